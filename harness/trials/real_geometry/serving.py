"""``semantic serve`` on a directory holding a synthetic long agent, timed from the client.

Every turn is one ``POST /v1/completions`` whose prompt is a list of token ids (the agent's own ids plus a
few new ones, more at each restart: :class:`Growing`), greedy, not streamed, its agent named by ``X-Agent-Id`` (none: an anonymous turn, not saved).
With ``max_tokens`` 1 the turn's whole time is its time to first token. A server's resident set is sampled
every 100 ms for its whole life (``harness.trials.multi_model.sampler``), and the lines it logs at start
say its budget: ``loaded <id> in S s (N MB weights, pool and working memory; P MB the process, ...)``, P the
bound of its RSS with the runtime and tokenizer counted (before: N alone, or ``weights and pool``).

Phases, one server, restarted between reps:

- **restore cold**: SIGTERM, the agent's files dropped from the page cache, start, one tiny anonymous turn
  (the process's first forward pass is no part of a restore), then the agent's turn beside a sequential read
  of the same files with the page cache dropped again (the order alternates by rep);
- **restore warm**: the same with the files in the page cache (read once first), beside a memcpy of as many
  bytes and a read of the files from the page cache;
- **cached turn vs a decode step**: the agent resident; its turn again with ``max_tokens`` 1 (all but its last
  token cached) against the same turn with ``max_tokens`` 1 + ``decode_tokens``: a decode step at this context
  is the difference over the extra tokens, both measured at the client, pair by pair;
- **beside a save**: another agent's turn of ``beside_tokens`` fresh tokens (prefilled; its save runs behind
  its reply), then at once the agent's cached turn; its quiet twin is the same sequence with the other turn
  anonymous (not saved). Pairs alternate their order; the server is idle before each sequence.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx

from harness.servers.ours import OurServer
from harness.trials.multi_model.sampler import MemorySampler
from harness.trials.real_geometry import floors
from harness.trials.real_geometry.synthetic import agent_files, token_ids

LONG = "long"
WARM_UP = [72, 105, 10, 72]   # "Hi\nH": an anonymous 4-token turn after each start
# the process's figure (runtime and tokenizers too) where the server logs one; before, the model's alone
BUDGET_LINE = re.compile(r"loaded (?P<id>\S+) in (?P<s>[\d.]+) s \((?P<mb>\d+) MB weights(?:,| and) pool"
                         r"(?: and working memory)?(?:; (?P<process>\d+) MB the process[^)]*)?\)")
POOL_LINE = re.compile(r"loaded \S+: (?P<blocks>\d+) blocks of (?P<bt>\d+) tokens \((?P<mb>\d+) MB\)")


class Growing:
    """The agent's prompts: each its previous one plus ``new`` fresh token ids, so that the turn after a
    restart is an append and every turn ends past everything the agent has saved. Two at least: a hybrid
    agent whose last turn resumed from the snapshot at its prompt's last token but one (a regenerate, or an
    append of one token right after a snapshot) finds nothing cached after a restart, and re-prefills its
    whole history (EXP-020 reports it)."""

    def __init__(self, ids: list[int], new: int, seed: int):
        self.last, self.new, self.seed = list(ids), new, seed

    def next(self) -> list[int]:
        self.seed += 1
        self.last = self.last + token_ids(self.new, self.seed)
        return self.last


def turn(url: str, model: str, ids: list[int], max_tokens: int, agent: str | None, timeout_s: float) -> dict:
    """One completion; its status, usage and the seconds from send to the whole reply, or its error."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    headers = {"X-Agent-Id": agent} if agent else {}
    t0 = time.perf_counter()
    try:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"[:500], "s": time.perf_counter() - t0}
    s = time.perf_counter() - t0
    try:
        doc = r.json()
    except ValueError:
        doc = {}
    if r.status_code != 200:
        err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
        return {"status": r.status_code, "error": (err.get("message") or r.text)[:1000], "code": err.get("code"),
                "s": s}
    u = doc.get("usage") or {}
    return {"status": 200, "s": s, "prompt_tokens": u.get("prompt_tokens"),
            "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "completion_tokens": u.get("completion_tokens"), "cache_save": u.get("cache_save")}


class Served:
    """One ``semantic serve`` (an :class:`OurServer`) and its memory sampler, kept across restarts."""

    def __init__(self, model_dir: Path, model_id: str, cache_dir: Path, log: Path, args: list[str],
                 timeout_s: float):
        self.server = OurServer(model_dir, model_id, cache_dir, log, args, ready_timeout_s=900)
        self.model_id, self.cache_dir, self.timeout_s = model_id, cache_dir, timeout_s
        self.sampler = MemorySampler(lambda: self.server.pid, None, 0.1)
        self.lives: list[dict] = []

    def start(self, phase: str) -> float:
        self.sampler.phase = phase
        took = self.server.start()
        self.lives.append({"phase": phase, "start_s": took, **self.budget()})
        return took

    def stop(self) -> None:
        self.server.stop(signal.SIGTERM)

    def kill(self) -> None:
        self.server.kill_now()

    def budget(self) -> dict:
        """The last start's budget lines from the log, parsed."""
        text = self.server.log_tail(20000)
        b = [m for m in BUDGET_LINE.finditer(text)]
        p = [m for m in POOL_LINE.finditer(text)]
        out: dict = {"log_lines": [ln for ln in text.splitlines()[-40:] if "loaded" in ln][-2:]}
        if b:
            out["budget_bytes"] = int(b[-1]["process"] or b[-1]["mb"]) << 20
        if p:
            out["pool_blocks"], out["pool_reported_bytes"] = int(p[-1]["blocks"]), int(p[-1]["mb"]) * 10**6
        return out

    def turn(self, ids: list[int], max_tokens: int = 1, agent: str | None = LONG) -> dict:
        return turn(self.server.url, self.model_id, ids, max_tokens, agent, self.timeout_s)

    def wait_idle(self, max_s: float = 600.0) -> float:
        """Until no save is pending (polled every 50 ms); seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < max_s:
            st = self.server.stats(timeout_s=30)
            if st is not None and not (st.get("saves") or {}).get("pending"):
                return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError(f"saves still pending after {max_s:.0f} s")


def default_flags(model_dir: Path, model_id: str, cache_dir: Path, log: Path, prompt: list[int],
                  timeout_s: float) -> dict:
    """Start a server with no pool or RAM flags on the agent's directory and send the agent's turn: what
    happens (status, message, cached tokens, seconds), and the budget it logged."""
    s = Served(model_dir, model_id, cache_dir, log, [], timeout_s)
    try:
        s.sampler.start()
        s.start("default")
        t = s.turn(prompt)
        return {**t, **s.lives[-1], "rss_max_bytes": max((r["rss_bytes"] for r in s.sampler.rss), default=None)}
    finally:
        s.sampler.stop()
        s.stop()
        s.kill()


def _restart(s: Served, phase: str, cold: bool) -> dict:
    s.stop()
    if cold:
        floors.evict([s.cache_dir])
    took = s.start(phase)
    warm = s.turn(WARM_UP, 1, None)
    return {"start_s": took, "warm_up": warm}


def restore(s: Served, prompt: list[int], rep: int, cold: bool, bufs: floors.Buffers) -> dict:
    """One restart and the agent's turn beside its floor (cold: a sequential read with the page cache
    dropped; warm: a memcpy of as many bytes, and a read from the page cache)."""
    phase = "restore-cold" if cold else "restore-warm"
    row: dict = {"rep": rep, "cold": cold, **_restart(s, phase, cold)}
    files = agent_files(s.cache_dir)
    nbytes = sum(f.stat().st_size for f in files)
    row["bytes"] = nbytes
    if not cold:
        floors.read_files(files, bufs)
    for side in (("floor", "turn") if rep % 2 == 0 else ("turn", "floor")):
        if side == "turn":
            if cold:
                floors.evict(files)
            row["turn"], row["rss"] = rss_around(s.sampler, phase, lambda: s.turn(prompt))
        elif cold:
            row["floor_read"] = floors.cold_read(files, bufs)
        else:
            row["memcpy"] = floors.memcpy(nbytes, bufs)
            row["floor_read"] = floors.read_files(files, bufs)
    return row


def rss_around(sampler, phase: str, run, settle: int = 3) -> tuple:
    """``run()``'s result and the server's RSS around it: ``before`` (the median of ``settle`` samples taken
    just before, the restarted server idle) and ``peak`` (the largest sample while it ran and over
    ``settle`` samples after, so that a turn shorter than a sample interval is still seen)."""
    sampler.phase = f"{phase}-before"
    sampler.wait_samples(settle)
    before = sorted(r["rss_bytes"] for r in sampler.rss if r["phase"] == sampler.phase)
    sampler.phase = f"{phase}-turn"
    result = run()
    sampler.phase = f"{phase}-after"
    sampler.wait_samples(settle)
    during = [r["rss_bytes"] for r in sampler.rss if r["phase"] in (f"{phase}-turn", f"{phase}-after")]
    sampler.phase = phase
    return result, {"before": before[len(before) // 2] if before else None, "peak": max(during, default=None)}


def cached_vs_decode(s: Served, prompt: list[int], reps: int, extra: int) -> list[dict]:
    """Pairs of the agent's fully cached turn (max_tokens 1) and the same turn generating 1 + ``extra``."""
    rows = []
    for r in range(reps):
        row: dict = {"rep": r}
        for side in (("one", "more") if r % 2 == 0 else ("more", "one")):
            s.wait_idle()
            row[side] = s.turn(prompt, 1 if side == "one" else 1 + extra)
        one, more = row["one"], row["more"]
        n = (more.get("completion_tokens") or 0) - 1
        row["decode_step_s"] = (more["s"] - one["s"]) / n if n > 0 and one["status"] == more["status"] == 200 else None
        rows.append(row)
    return rows


def beside_save(s: Served, prompt: list[int], reps: int, other_tokens: int, seed: int) -> list[dict]:
    """Pairs of (another agent's turn, saved; the agent's cached turn) and (the same turn anonymous; the
    agent's cached turn). The other turn's tokens are fresh every time, so it prefills and, named, saves them."""
    rows = []
    for r in range(reps):
        row: dict = {"rep": r}
        for side in (("quiet", "beside") if r % 2 == 0 else ("beside", "quiet")):
            s.wait_idle()
            other = token_ids(other_tokens, seed + 2 * r + (side == "beside"))
            first = s.turn(other, 1, f"saver-{r}" if side == "beside" else None)
            a = s.turn(prompt)
            row[side] = {"other": first, "turn": a}
        s.wait_idle()
        rows.append(row)
    return rows


def fleet(model_dir: Path, model_id: str, cache_dir: Path, log: Path, prompts: dict[str, "Growing"],
          timeout_s: float) -> dict:
    """A server with no pool flags on a directory of agents (``prompts``: each agent's :class:`Growing`): each
    agent's turn (its cache read from disk), then each one's next turn (resumed from RAM), each saved before the
    next is sent; the RSS every 100 ms against the budget the server logged, and what its stats say of turns
    run in the pool's buffers."""
    s = Served(model_dir, model_id, cache_dir, log, [], timeout_s)
    turns: list[dict] = []
    stats: dict = {}
    try:
        s.sampler.start()
        s.start("start")
        for phase in ("restore", "append"):
            s.sampler.phase = phase
            for agent, growing in prompts.items():
                turns.append({"agent": agent, "phase": phase, **s.turn(growing.next(), 1, agent)})
                if turns[-1]["status"] == 200:
                    s.wait_idle()
        stats = s.server.stats(timeout_s=30) or {}
    finally:
        s.sampler.stop()
        s.stop()
        s.kill()
    life = s.lives[-1] if s.lives else {}
    life["log_lines"] = [ln for ln in s.server.log_tail(20000).splitlines() if "memory: " in ln][-1:] + life.get("log_lines", [])
    rss = [r["rss_bytes"] for r in s.sampler.rss if r.get("rss_bytes")]
    budget = life.get("budget_bytes")
    return {"turns": turns, **life, "rss_max_bytes": max(rss, default=None),
            "rss_over_budget_max": max(rss) / budget if rss and budget else None,
            "longest_cache_tokens": (stats.get("pool") or {}).get("longest_cache_tokens"),
            "sizing": (stats.get("pool") or {}).get("sizing"), "in_place": stats.get("in_place")}
