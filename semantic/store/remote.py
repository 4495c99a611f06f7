"""A cache tier on Redis that several servers share: block files once each, and each agent's manifest, versioned.

::

    publish(agent, manifest, version, blocks, chain) ─► queue ─► publisher thread ─► which blocks Redis lacks (one
                              EXISTS round trip) ─► Lua: only if newer, the missing blocks, then the manifest
    fetch(agent)              ─► (version, manifest bytes) | None   (the store verifies them as any manifest)
    fetch_blocks(keys)        ─► {key: block file bytes}: only the blocks the caller's pool and disk lack
    holder(chain)             ─► (blocks, agent): the agent whose cache holds the most leading blocks
    version(agent)            ─► the newest version any server published (one small read)
    drop(agent, version)      ─► delete a manifest that failed verification, unless replaced meanwhile
    drop_block(key)           ─► delete a block value that failed verification

The layout is the disk's (``semantic.store.blocklayout``), so no value is larger than a block::

    <prefix>:<fingerprint>:kvb:<key>              a block file's bytes, by its content key (written once)
    <prefix>:<fingerprint>:manifest:<sha256(id)>  hash {v: version, data: the manifest's bytes}
    <prefix>:<fingerprint>:block:<chain key>      an agent whose cache holds that full block (for prefetch)

Keys carry the model fingerprint, so another model's caches never match; the agent id is the service's,
already namespaced by tenant, and block keys hash every token before them under the tenant's salt root,
so another tenant's prompt never matches. The bytes keep their checksums: a value damaged in Redis (or
written by anything else) fails the store's checks and is dropped, never used.

Redis down, slow or full costs the caller nothing but a miss: every call has a socket timeout (1 s;
30 s for moving values, on connections of their own; a fetch follows a version read that answered), a
failure is counted and logged once per streak, and from then on calls are skipped while the tier's
own prober thread pings Redis once a second (one try, the small timeout): the first answer ends the
streak, so a returned Redis is used again within about a second and no request ever waits for a
probe. A Redis that answers but refuses a write (``maxmemory`` with ``noeviction``) is counted as
``refused``, logged once, and not treated as down: reads still work.

The remote budget (``budget_bytes``, ``--remote-mb``) bounds the values of one model, blocks and
manifests alike: a publish that takes the total past it deletes the values least recently published,
used by a publish, or fetched, oldest first, in the same script (so two servers never both evict for
one overflow); what the publish just wrote or used always stays. A manifest whose blocks went loads the
prefix before them (or misses). Servers sharing a tier should pass the same budget: each publish
applies its own. A Redis ``maxmemory`` with an evicting policy (``allkeys-lru``) is a second, coarser
bound beneath it. Publishing never blocks: a full queue drops the oldest entry (counted).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

PREFIX = "semkv"
PROBE_S = 1.0  # while the tier is down, one ping this often (on the prober thread, never a caller's)
QUEUE_LIMIT = 256

# replace the agent's manifest only with a newer version: the older writer loses cleanly. KEYS[4..] are the
# manifest's blocks, ARGV[4..] their bytes ('' where Redis held them already: only touched). Every value
# is indexed by last use (KEYS[2], a sorted set) and size (KEYS[3]); past the budget ARGV[3] (0: none)
# the least recently used values go, oldest first, never one this publish wrote or touched
_PUT_IF_NEWER = """
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '-1')
if tonumber(ARGV[1]) <= v then return {0, 0, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local sent = 0
for i = 4, #KEYS do
  if ARGV[i] ~= '' then
    if redis.call('SET', KEYS[i], ARGV[i], 'NX') then
      redis.call('HSET', KEYS[3], KEYS[i], string.len(ARGV[i]))
      sent = sent + string.len(ARGV[i])
    end
  end
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('ZADD', KEYS[2], now, KEYS[i]) end
end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'data', ARGV[2])
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], string.len(ARGV[2]))
local budget, evicted = tonumber(ARGV[3]), 0
if budget > 0 then
  local total = 0
  for _, n in ipairs(redis.call('HVALS', KEYS[3])) do total = total + tonumber(n) end
  while total > budget do
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    if not oldest[1] or tonumber(oldest[2]) >= now then break end
    total = total - tonumber(redis.call('HGET', KEYS[3], oldest[1]) or '0')
    evicted = evicted + redis.call('DEL', oldest[1])
    redis.call('ZREM', KEYS[2], oldest[1])
    redis.call('HDEL', KEYS[3], oldest[1])
  end
end
return {1, evicted, sent}
"""
# a fetched value counts as recently used, on Redis's clock (servers' clocks may differ)
_TOUCH = """
local t = redis.call('TIME')
for _, k in ipairs(ARGV) do
  if redis.call('ZSCORE', KEYS[1], k) then
    redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000000 + tonumber(t[2]), k)
  end
end
return 0
"""
# delete a manifest that failed verification, unless a newer one replaced it meanwhile
_DROP_IF_SAME = """
if redis.call('HGET', KEYS[1], 'v') == ARGV[1] then
  redis.call('ZREM', KEYS[2], KEYS[1])
  redis.call('HDEL', KEYS[3], KEYS[1])
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RemoteUnavailable(Exception):
    """The remote tier did not answer (down, slow, full); the caller carries on without it."""


@dataclass(frozen=True, slots=True)
class Fetched:
    version: int
    data: bytes


class RemoteTier:
    """Agents' block files and manifests on a Redis (or Valkey) server at ``url``, for one model.

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS).
        fingerprint: the model's; part of every key.
        budget_bytes: the most bytes of agents' values this model's keys hold (0: no bound of ours).
        timeout_s: socket timeout of every small call (versions, pointers), and the first a down tier gets.
        bulk_timeout_s: socket timeout of moving a value (a publish, a fetch): an 8K-token cache of a small
            model is ~400 MB, which takes seconds to send.
    """

    def __init__(self, url: str, fingerprint: str, *, budget_bytes: int = 0, timeout_s: float = 1.0,
                 bulk_timeout_s: float = 30.0, prefix: str = PREFIX, clock: Callable[[], float] = time.monotonic):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        assert budget_bytes >= 0
        self.url, self.fingerprint, self.prefix, self.budget_bytes = url, fingerprint, prefix, budget_bytes
        self._clock = clock
        self._refused = redis.ResponseError
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # values move on their own connections: a small call never waits behind one, nor times out for it
        self._bulk = redis.Redis.from_url(url, socket_timeout=bulk_timeout_s, socket_connect_timeout=timeout_s)
        self._put = self._bulk.register_script(_PUT_IF_NEWER)
        self._drop = self._client.register_script(_DROP_IF_SAME)
        self._touch = self._client.register_script(_TOUCH)
        # the prober's ping: one try on a connection of its own (redis-py would otherwise retry it 3 times)
        self._probe = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.latency_s: Counter[str] = Counter()  # total seconds per call kind (with counts: a mean)
        self._down_since: float | None = None
        self._down = threading.Event()  # set while down: the prober pings
        self._closing = threading.Event()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._publisher, name="semantic-remote", daemon=True)
        self._prober = threading.Thread(target=self._probing, name="semantic-remote-probe", daemon=True)
        self._thread.start()
        self._prober.start()

    # ------------------------------------------------------------ reads

    def key(self, agent_id: str) -> str:
        """The key of the agent's manifest."""
        return f"{self.prefix}:{self.fingerprint}:manifest:{hashlib.sha256(agent_id.encode()).hexdigest()}"

    def data_key(self, block: int) -> str:
        """The key of a block file's bytes (``block``: its content key)."""
        return f"{self.prefix}:{self.fingerprint}:kvb:{block & 0xFFFFFFFFFFFFFFFF:016x}"

    def _index(self) -> list[str]:
        """The keys of the budget's index: publish (or fetch) times, and sizes, of the agents' values."""
        return [f"{self.prefix}:{self.fingerprint}:lru", f"{self.prefix}:{self.fingerprint}:sizes"]

    def version(self, agent_id: str) -> int | None:
        """The newest version published for the agent (None: none, or the tier is unavailable)."""
        try:
            v = self._call("version", lambda: self._client.hget(self.key(agent_id), "v"))
        except RemoteUnavailable:
            return None
        return int(v) if v is not None else None

    def fetch(self, agent_id: str) -> Fetched | None:
        """The agent's newest published manifest (unverified: the caller checks it), or None."""
        try:
            got = self._call("fetch", lambda: self._bulk.hmget(self.key(agent_id), ["v", "data"]))
        except RemoteUnavailable:
            return None
        v, data = got
        if v is None or data is None:
            self._count("misses")
            return None
        self._count("hits")
        self._count("bytes_in", len(data))
        try:  # a fetched value is recently used: the budget deletes it last
            self._call("touch", lambda: self._touch(keys=self._index()[:1], args=[self.key(agent_id)]))
        except RemoteUnavailable:
            pass
        return Fetched(int(v), bytes(data))

    def fetch_blocks(self, keys: list[int]) -> dict[int, bytes]:
        """The bytes of the block files ``keys`` that the tier holds (unverified: the caller checks them)."""
        if not keys:
            return {}
        try:
            got = self._call("fetch_blocks", lambda: self._bulk.mget([self.data_key(k) for k in keys]))
        except RemoteUnavailable:
            return {}
        out = {k: bytes(v) for k, v in zip(keys, got) if v is not None}
        self._count("block_hits", len(out))
        self._count("block_misses", len(keys) - len(out))
        self._count("bytes_in", sum(map(len, out.values())))
        if out:
            try:  # fetched blocks are recently used: the budget deletes them last
                self._call("touch", lambda: self._touch(keys=self._index()[:1], args=[self.data_key(k) for k in out]))
            except RemoteUnavailable:
                pass
        return out

    def drop_block(self, key: int) -> None:
        """Delete a block value that failed verification (its content key names one content only)."""
        self._count("verify_failures")
        name = self.data_key(key)
        try:
            self._call("drop", lambda: self._client.pipeline().delete(name).zrem(self._index()[0], name)
                       .hdel(self._index()[1], name).execute())
        except RemoteUnavailable:
            pass

    def block_key(self, chain_key: int) -> str:
        return f"{self.prefix}:{self.fingerprint}:block:{chain_key:x}"

    def holder(self, chain: list[int]) -> tuple[int, str] | None:
        """(n, agent): an agent whose published file holds the first ``n`` full blocks of ``chain`` (the
        largest ``n`` found), or None."""
        if not chain:
            return None
        try:
            found = self._call("holder", lambda: self._client.mget([self.block_key(k) for k in chain]))
        except RemoteUnavailable:
            return None
        n = next((i for i in range(len(found), 0, -1) if found[i - 1] is not None), 0)
        return (n, found[n - 1].decode()) if n else None

    def drop(self, agent_id: str, version: int) -> None:
        """Delete the agent's value of ``version`` (it failed verification) unless a newer one replaced it."""
        self._count("verify_failures")
        try:
            self._call("drop", lambda: self._drop(keys=[self.key(agent_id), *self._index()],
                                                            args=[str(version)]))
        except RemoteUnavailable:
            pass

    # ------------------------------------------------------------ writes, behind the caller

    def publish(self, agent_id: str, path: Path, version: int, chain: list[int] = (),
                blocks: list[tuple[int, Path]] = ()) -> None:
        """Queue the agent's manifest at ``path`` for publishing as ``version`` (read when it is sent), with the
        block files it names (``(key, path)``: those Redis lacks are sent with it) and its full blocks'
        ``chain`` keys as pointers to the agent."""
        if self._queue.qsize() >= QUEUE_LIMIT:
            try:
                self._queue.get_nowait()
                self._count("publish_dropped")
            except queue.Empty:
                pass
        self._queue.put((agent_id, Path(path), version, tuple(chain), tuple(blocks)))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued publish was sent or given up (False: timed out)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self._closing.set()
        self._down.set()  # wakes the prober to see the close
        self._queue.put(None)
        self._thread.join(timeout)
        self._prober.join(timeout)
        for client in (self._client, self._bulk, self._probe):
            client.close()

    def stats(self) -> dict:
        with self._lock:
            c, lat = Counter(self.counts), Counter(self.latency_s)
            down = self._down_since
        calls = {k[:-len(".calls")]: c[k] for k in c if k.endswith(".calls")}
        return {
            "url": self.url, "up": down is None, "budget_bytes": self.budget_bytes, "evicted": c["evicted"],
            "down_s": round(self._clock() - down, 1) if down is not None else 0.0,
            "hits": c["hits"], "misses": c["misses"], "bytes_in": c["bytes_in"], "bytes_out": c["bytes_out"],
            "published": c["published"], "publish_lost_race": c["publish_lost_race"],
            "publish_dropped": c["publish_dropped"], "verify_failures": c["verify_failures"],
            "errors": c["errors"], "refused": c["refused"], "skipped": c["skipped"],
            "probes_failed": c["probes_failed"], "blocks_sent": c["blocks_sent"], "block_hits": c["block_hits"],
            "block_misses": c["block_misses"],
            "mean_latency_ms": {k: round(1000 * lat[k] / n, 3) for k, n in calls.items() if n},
        }

    def _publisher(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._send(*job)
            finally:
                self._queue.task_done()

    def _send(self, agent_id: str, path: Path, version: int, chain: tuple, blocks: tuple) -> None:
        """One publish: the blocks Redis lacks and the manifest, in one script, if the version is newer."""
        names = [self.data_key(k) for k, _ in blocks]
        try:
            there = self._call("exists", lambda: _exists(self._client, names)) if names else []
            data = path.read_bytes()
            values = [b"" if held else p.read_bytes() for held, (_, p) in zip(there, blocks)]
        except RemoteUnavailable:
            return
        except OSError:  # replaced or collected meanwhile: a newer save publishes its own
            return
        try:
            won, evicted, sent = self._call("publish", lambda: self._put(
                keys=[self.key(agent_id), *self._index(), *names],
                args=[str(version), data, str(self.budget_bytes), *values]))
        except RemoteUnavailable:
            return
        self._count("published" if won else "publish_lost_race")
        self._count("evicted", evicted)
        if won:
            self._count("bytes_out", len(data) + sent)
            self._count("blocks_sent", sum(1 for v in values if v))
            if chain:
                pointers = {self.block_key(k): agent_id for k in chain}
                try:
                    self._call("pointers", lambda: self._client.mset(pointers))
                except RemoteUnavailable:
                    pass

    # ------------------------------------------------------------ faults

    def _call(self, kind: str, fn):
        with self._lock:
            if self._down_since is not None:
                self.counts["skipped"] += 1
                raise RemoteUnavailable(f"{self.url} is unavailable; probing it every {PROBE_S:.0f} s")
        t0 = time.perf_counter()
        try:
            out = fn()
        except self._refused as exc:  # it answered, and said no (maxmemory with noeviction): not down
            with self._lock:
                self.counts["errors"] += 1
                self.counts["refused"] += 1
                first = self.counts["refused"] == 1
            if first:
                log.warning("remote cache tier %s refused a write: %s (further refusals are counted, not logged)",
                            self.url, exc)
            raise RemoteUnavailable(str(exc)) from None
        except self._errors as exc:
            self._failed(exc)
            raise RemoteUnavailable(str(exc)) from None
        with self._lock:
            self.counts[f"{kind}.calls"] += 1
            self.latency_s[kind] += time.perf_counter() - t0
        self._answered()
        return out

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.counts["errors"] += 1
            if self._down_since is not None:
                return
            self._down_since = self._clock()
            self._down.set()
        log.warning("remote cache tier %s: %s; serving from RAM and local disk, probing it every %.0f s",
                    self.url, exc, PROBE_S)

    def _answered(self) -> None:
        """Redis answered: a streak of failures, if any, ends here (logged once)."""
        with self._lock:
            since, self._down_since = self._down_since, None
            self._down.clear()
        if since is not None:
            log.info("remote cache tier %s: answering again after %.0f s", self.url, self._clock() - since)

    def _probing(self) -> None:
        """While the tier is down, ping it every ``PROBE_S``; the first answer brings it back."""
        while self._down.wait() and not self._closing.wait(PROBE_S):
            if self._down_since is None:
                continue
            try:
                self._probe.ping()
            except self._errors:
                with self._lock:
                    self.counts["probes_failed"] += 1
                continue
            self._answered()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n


def _exists(client, names: list[str]) -> list[bool]:
    """Which of the keys ``names`` Redis holds (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for n in names:
        pipe.exists(n)
    return [bool(x) for x in pipe.execute()]
