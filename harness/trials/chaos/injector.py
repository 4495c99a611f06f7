"""The fault injector: a seeded plan of faults, run one after another while the agents talk.

Faults (each logged in the ledger with its wall time and what it found)::

    sigkill     SIGKILL, then a restart (maybe a damaged file in between: a block file several agents
                share, a manifest, or one agent's block file, truncated or with bytes overwritten;
                :mod:`harness.trials.chaos.damage`)
    sigterm     SIGTERM (graceful: pending saves land), then a restart
    disk_full   a filler file written until ENOSPC, held, freed; then a SIGKILL and a restart, whose
                resumptions show that every cache saved before the disk filled still loads
    read_only   the cache filesystem remounted read-only, held, remounted read-write
    hangup      streams opened, a chunk or two read, closed
    flood       many requests at once, past the queue: 429s expected, never a 5xx

After every start: no writer's temporary file may be left in the cache folder or its block folders
(the server deletes dead writers' temporaries at startup).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from harness.servers.ours import OurServer
from harness.trials.chaos import damage, fs
from harness.trials.chaos.agents import Fleet, anthropic_turn, classify, openai_turn
from harness.trials.chaos.damage import Damage
from harness.trials.chaos.ledger import Ledger

FS_FAULTS = ("disk_full", "read_only")


def quarantined_count(stats: dict | None) -> int | None:
    """``/v1/cache/stats`` ``quarantined``: the files set aside so far (None: no stats)."""
    return (stats or {}).get("quarantined")


def quarantined_names(stats: dict | None) -> list[str]:
    """The files ``/v1/cache/stats`` says it refused as damaged lately, moved aside or (a read-only
    directory) left in place."""
    return [q["file"] for q in (stats or {}).get("quarantined_recent", [])]


@dataclass(slots=True)
class FaultPlan:
    """How many of each fault a run injects, over how long."""

    sigkill: int = 14
    sigterm: int = 6
    corrupt: int = 5          # of the SIGKILLs, how many damage a file while the server is down
    disk_full: int = 1
    read_only: int = 1
    hangup: int = 4
    flood: int = 3
    duration_s: float = 480.0
    hold_s: float = 20.0      # how long the disk stays full / read-only
    flood_requests: int = 48
    hangup_streams: int = 3

    def draw(self, rng: np.random.Generator, skip: tuple[str, ...] = ()) -> list[str]:
        """The faults in a seeded order (a corrupting SIGKILL is ``sigkill+corrupt``); none of ``skip``."""
        kills = ["sigkill+corrupt"] * min(self.corrupt, self.sigkill) + ["sigkill"] * max(0, self.sigkill - self.corrupt)
        plan = kills + ["sigterm"] * self.sigterm + ["hangup"] * self.hangup + ["flood"] * self.flood
        plan += [f for f in FS_FAULTS for _ in range(getattr(self, f)) if f not in skip]
        order = [plan[i] for i in rng.permutation(len(plan))]
        # the first fault comes after some turns have saved something: never a filesystem fault first
        if order and order[0] in FS_FAULTS:
            j = next((i for i, f in enumerate(order) if f not in FS_FAULTS), 0)
            order[0], order[j] = order[j], order[0]
        return order


class Injector:
    """Runs a :class:`FaultPlan` against the server while ``fleet`` talks to it."""

    def __init__(self, server: OurServer, fleet: Fleet, ledger: Ledger, plan: FaultPlan, mount: Path | None,
                 cache_dir: Path, seed: int, max_queued: int):
        self.server, self.fleet, self.ledger, self.plan = server, fleet, ledger, plan
        self.mount, self.cache_dir, self.max_queued = mount, cache_dir, max_queued
        self.rng = np.random.default_rng([seed, 15])
        self.phases: list[dict] = []     # disk_full / read_only: what the server did during each
        self.damages: list[Damage] = []  # the files damaged so far

    # ------------------------------------------------------------ the plan

    def run(self, stop: threading.Event | None = None) -> list[str]:
        """Every fault of the plan at evenly spread moments (jittered) over ``duration_s``."""
        skip = FS_FAULTS if self.mount is None else ()
        order = self.plan.draw(self.rng, skip)
        t_start = time.monotonic()
        gap = self.plan.duration_s / max(1, len(order))
        for i, fault in enumerate(order):
            due = t_start + gap * (i + float(self.rng.uniform(0.5, 1.0)))
            while time.monotonic() < due and not (stop and stop.is_set()):
                time.sleep(0.1)
            if stop and stop.is_set():
                break
            getattr(self, "_" + fault.split("+")[0])(corrupt=fault.endswith("+corrupt"))
        return order

    # ------------------------------------------------------------ crashes

    def crash(self, sig: int, corrupt: bool = False, cause: str = "") -> None:
        """Stop the server with ``sig``; maybe damage a file while it is down; start it again (the agents of
        a damaged file still in place excused for their next resumption)."""
        waited = self._await_damageable() if corrupt else None
        before = self.server.stats(timeout_s=5)
        name = signal.Signals(sig).name
        ev = self.ledger.event(name.lower(), life=self.server.life, cause=cause,
                               quarantined_this_life=quarantined_count(before),
                               refused_files=quarantined_names(before),
                               saves=before.get("saves") if before else None)
        t0 = time.perf_counter()
        if waited is not None:
            ev["waited_for_files_s"] = waited
        ev["exit"] = self.server.stop(sig)
        ev["stop_s"] = round(time.perf_counter() - t0, 3)
        fresh = self._corrupt() if corrupt else None
        self._excuse_lingering(fresh)
        self.restart()

    def restart(self) -> dict:
        took = self.server.start()
        left = fs.temp_files(self.cache_dir)
        stats = self.server.stats(timeout_s=10) or {}
        return self.ledger.event("restart", life=self.server.life, start_s=round(took, 3), temp_files=left,
                                 quarantined_at_start=quarantined_count(stats),
                                 quarantine_dir=len(fs.quarantined_files(self.cache_dir)))

    def _sigkill(self, corrupt: bool = False) -> None:
        self.crash(signal.SIGKILL, corrupt)

    def _sigterm(self, corrupt: bool = False) -> None:
        self.crash(signal.SIGTERM, corrupt)

    def _await_damageable(self, timeout_s: float = 120.0) -> float:
        """Before a crash that damages a file: wait (at most ``timeout_s``) until the cache folder holds a
        file of the kind the damage wants first (early in a run no agent may have saved yet; a block file
        two agents share takes two saves). Returns the seconds waited."""
        t0 = time.monotonic()
        want = damage.wanted([d.pick for d in self.damages])[0]
        while time.monotonic() - t0 < timeout_s:
            if damage.candidates(self.cache_dir, list(self.fleet.agent_ids))[want]:
                break
            time.sleep(0.5)
        return round(time.monotonic() - t0, 3)

    def _corrupt(self) -> Damage | None:
        """Damage one cache file (a shared block file, a manifest, one agent's block file, in turn), a live
        agent's when there is one: every agent that uses it is excused for its next resumption."""
        d = damage.choose(self.cache_dir, list(self.fleet.agent_ids), set(self.fleet.live.values()),
                          [d.pick for d in self.damages], self.rng)
        if d is None:
            self.ledger.event("corrupt", skipped="no cache file")
            return None
        d.detail = fs.corrupt(d.path, self.rng)
        d.seal()
        self.damages.append(d)
        for agent in d.agents:
            self.ledger.corrupted(agent, shared=d.shared)
        d.row = self.ledger.event("corrupt", **d.event())
        return d

    def _excuse_lingering(self, fresh: Damage | None) -> None:
        """A damaged file earlier lives left (:meth:`Damage.excuses_now`): its agents excused again."""
        for d in self.damages:
            agents = set() if d is fresh else d.excuses_now(self.cache_dir)
            if not agents:
                continue
            d.shared = d.shared or len(agents) > 1
            d.row["shared"] = d.shared   # the checks read it: a shared file need not be read again
            for agent in agents:
                self.ledger.corrupted(agent, shared=d.shared)
            self.ledger.event("damage_lingers", file=d.path.name, state=d.state(), agents=sorted(agents),
                              shared=d.shared)

    # ------------------------------------------------------------ the filesystem

    def _disk_full(self, corrupt: bool = False) -> None:
        assert self.mount is not None
        start = self.ledger.event("disk_full_start")
        start["filled_bytes"] = fs.fill(self.mount)
        samples = self._hold()
        fs.free(self.mount)
        end = self.ledger.event("disk_full_end")
        self.phases.append(self._phase("disk_full", start["t"], end["t"], samples))
        self.crash(signal.SIGKILL, cause="after disk_full")   # caches saved before it must all load

    def _read_only(self, corrupt: bool = False) -> None:
        assert self.mount is not None
        ok, tries, msg = fs.remount(self.mount, "ro")
        start = self.ledger.event("read_only_start", remounted=ok, attempts=tries, error=msg)
        samples = self._hold() if ok else []
        ok_rw, tries_rw, msg_rw = fs.remount(self.mount, "rw", attempts=200)
        end = self.ledger.event("read_only_end", remounted=ok_rw, attempts=tries_rw, error=msg_rw)
        if not ok_rw:
            raise RuntimeError(f"could not remount {self.mount} read-write: {msg_rw}")
        self.phases.append(self._phase("read_only", start["t"], end["t"], samples))

    def _hold(self) -> list[dict]:
        """Stats sampled every second while a filesystem fault holds."""
        samples, until = [], time.monotonic() + self.plan.hold_s
        while time.monotonic() < until:
            s = self.server.stats(timeout_s=5)
            if s:
                samples.append({"t": round(self.ledger.now(), 3), "ram_bytes": s["ram"]["bytes"],
                                "ram_budget_bytes": s["ram"]["budget_bytes"], "disk": s.get("disk", {}),
                                "saves": s.get("saves", {})})
            time.sleep(1.0)
        return samples

    def _phase(self, kind: str, t0: float, t1: float, samples: list[dict]) -> dict:
        """What the server answered during [t0, t1], and whether resident bytes stayed in budget once settled
        (the second half of the hold)."""
        rows = [r for r in list(self.ledger.requests) if r.get("kind") == "turn" and t0 <= r["t0"] <= t1]
        outcomes, saves = {}, {}
        for r in rows:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
            if r["outcome"] == "ok":
                k = r.get("cache_save") or r.get("header_save") or "none"
                saves[k] = saves.get(k, 0) + 1
        settled = samples[len(samples) // 2:]
        return {"kind": kind, "t0": t0, "t1": t1, "outcomes": outcomes, "cache_save": saves,
                "ram_within_budget": bool(settled) and all(s["ram_bytes"] <= s["ram_budget_bytes"] for s in settled),
                "max_ram_bytes": max((s["ram_bytes"] for s in samples), default=None),
                "disk_states": sorted({str(s["disk"].get("state")) for s in samples}),
                "samples": samples}

    # ------------------------------------------------------------ clients

    def _hangup(self, corrupt: bool = False) -> None:
        """A few streams opened at once, each closed after a chunk or two."""
        import anthropic
        import openai

        ev = self.ledger.event("hangup", streams=self.plan.hangup_streams)
        results = []

        def one(i: int) -> None:
            kw = dict(max_retries=0, timeout=60.0)
            named = i % 2 == 0
            headers = {"X-Agent-Id": f"hangup-{len(self.ledger.events)}-{i}"} if named else {}
            life, was_up = self.server.life, self.server.up.is_set()
            msgs = [{"role": "user", "content": f"Tell me a long story about caches, part {i}."}]
            try:
                if i % 4 < 2:
                    c = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", **kw)
                    openai_turn(c, {"model": self.server.model_id, "messages": msgs, "max_tokens": 64,
                                    "temperature": 0}, headers, True, True, hang_up_after=1 + i % 2)
                else:
                    c = anthropic.Anthropic(base_url=self.server.url, api_key="none", **kw)
                    anthropic_turn(c, {"model": self.server.model_id, "messages": msgs, "max_tokens": 64,
                                       "temperature": 0}, headers, True, hang_up_after=2 + i % 2)
                results.append("ok")
            except Exception as exc:  # noqa: BLE001
                results.append(classify(exc, self.server, life, was_up).outcome)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(self.plan.hangup_streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        ev["outcomes"] = results
        for o in results:
            self.ledger.request({"kind": "hangup", "t0": ev["t"], "t1": round(self.ledger.now(), 3), "outcome": o,
                                 "life": self.server.life})
        time.sleep(1.0)
        ev["healthy_after"] = self.server.stats(timeout_s=30) is not None

    def _flood(self, corrupt: bool = False) -> None:
        """``flood_requests`` anonymous requests released at once: each answered or refused with 429."""
        n = self.plan.flood_requests
        ev = self.ledger.event("flood", requests=n, max_queued=self.max_queued)
        barrier, statuses = threading.Barrier(n), []
        life = self.server.life

        def one(i: int) -> None:
            body = {"model": self.server.model_id, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Flood {i}: say yes."}]}
            try:
                barrier.wait(30)
                r = httpx.post(self.server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(120, connect=10))
                statuses.append(r.status_code)
            except httpx.TimeoutException:
                statuses.append("hang")
            except (httpx.TransportError, threading.BrokenBarrierError) as exc:
                statuses.append(type(exc).__name__)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        counts: dict = {}
        for s in statuses:
            counts[str(s)] = counts.get(str(s), 0) + 1
        ev["statuses"] = counts
        for s in statuses:
            outcome = ("ok" if s == 200 else "refused_429" if s == 429 else "hang" if s == "hang"
                       else "refused_shutting_down" if s == 503 and self.server.life != life
                       else "http_5xx" if isinstance(s, int) and s >= 500
                       else "http_4xx" if isinstance(s, int) else "disconnect")
            self.ledger.request({"kind": "flood", "t0": ev["t"], "t1": round(self.ledger.now(), 3), "outcome": outcome,
                                 "status": s if isinstance(s, int) else None, "life": life})
