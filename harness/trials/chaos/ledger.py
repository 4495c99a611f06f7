"""What the soak saw: every request's outcome, every fault, and the durability check, kept thread-safely.

Outcomes of a request, and which of them are failures::

    ok                      answered (200)
    server_down             no connection: sent while the server was down        expected, retried
    interrupted             the connection broke because the injector killed
                            or stopped the server during the request             expected, retried
    refused_429             the queue was full                                    expected, retried
    refused_shutting_down   503 while a SIGTERM shutdown was under way            expected, retried
    http_5xx                any other 5xx                                         failure
    http_4xx                a 4xx other than 429 (the client or the server is wrong)  failure
    hang                    no answer within the client timeout                   failure
    disconnect              the connection broke while the server was up and
                            no fault touched it                                   failure
    stream_error            an error event inside a stream, no fault near it      failure

Durability: with ``--sync-saves`` a named agent's reply says ``cache_save: saved`` once its
cache is durable (the turn's new block files, their folder and its manifest fsynced). The agent's
first answered turn in a later server life must then find at least that turn's prompt tokens
cached, unless the injector damaged a file of its cache while the server was down: its manifest
or a block file only it uses (then it must miss: the file is quarantined), or a block file other
agents use too (then it may miss or not: another agent may have written the block again). A hit
after the damage is excused too when the agent sent a turn since that was not answered: the server
may have computed and saved its cache anew (a SIGTERM saves what its cancelled turns computed).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

EXPECTED = ("server_down", "interrupted", "refused_429", "refused_shutting_down")
FAILURES = ("http_5xx", "http_4xx", "hang", "disconnect", "stream_error")
UNSEEN = ("ok", "server_down", "refused_429")   # answered, or never worked on by the server
OUTCOMES = ("ok", *EXPECTED, *FAILURES)
SAVE_STATES = ("saved", "pending", "failed")


@dataclass(slots=True)
class Reply:
    """What an answered request said: its text and tool calls, its usage, what its cache did."""

    text: str
    tool_calls: list[tuple[str, str]]        # (name, arguments as canonical JSON)
    prompt_tokens: int | None
    cached_tokens: int | None
    cache_save: str | None                   # usage.cache_save
    header_save: str | None                  # the X-Semantic-Cache-Save header (non-streamed replies)
    ttft_s: float                            # to the first text or tool delta; the whole reply when not streamed
    finish: str | None = None

    @property
    def save_state(self) -> str | None:
        return self.cache_save or self.header_save


@dataclass(slots=True)
class _Durable:
    last_life: int
    prompt_tokens: int | None = None   # of the agent's latest turn that came back "saved"
    saved_life: int | None = None
    corrupted: bool = False            # a file of its cache was damaged since its last answered turn
    strict: bool = False               # ... one no other agent uses (its manifest, a block file only it names)
    damaged_t: float | None = None     # when (the first such damage since its last answered turn)
    rebuilt: bool = False              # a turn of it the server may have worked on was sent since (not answered)


@dataclass
class Ledger:
    """Everything recorded during one run; times are seconds since ``t0`` (``time.time()``)."""

    t0: float = field(default_factory=time.time)
    requests: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    resumptions: list[dict] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)       # correctness re-sends
    rss: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, life, turns in life, bytes)
    counts: Counter = field(default_factory=Counter)
    _agents: dict[str, _Durable] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.time() - self.t0

    def event(self, kind: str, **detail) -> dict:
        """A fault or server event, stamped with its wall time and its time into the run."""
        wall = time.time()
        row = {"t": round(wall - self.t0, 3), "wall": wall, "kind": kind, **detail}
        with self._lock:
            self.events.append(row)
            self.counts[f"event.{kind}"] += 1
        return row

    def request(self, row: dict) -> None:
        assert row["outcome"] in OUTCOMES, row["outcome"]
        with self._lock:
            self.requests.append(row)
            self.counts[row["outcome"]] += 1
            s = self._agents.get(row.get("agent")) if row.get("kind") == "turn" else None
            if s is not None and s.corrupted and row["outcome"] not in UNSEEN and row["t0"] >= s.damaged_t:
                # sent after the damage and not answered: the server may have prefilled it and saved a new
                # cache (a SIGTERM saves what its cancelled turns computed): a hit later is no damage served
                s.rebuilt = True

    def corrupted(self, agent: str, shared: bool = False) -> None:
        """The injector damaged a file of ``agent``'s cache: its next resumption is excused. Unless the file
        is ``shared`` (a block file other agents use: any of them may have written it again, or the pool may
        hold its blocks), that resumption must miss its durable turn: a hit is a damaged file served."""
        with self._lock:
            if agent in self._agents:
                s = self._agents[agent]
                if not s.corrupted:
                    s.damaged_t = self.now()
                s.corrupted = True
                s.strict = s.strict or not shared

    def last_life(self, agent: str) -> int | None:
        """The server life of the agent's last answered turn (None before its first)."""
        with self._lock:
            s = self._agents.get(agent)
            return s.last_life if s else None

    def answered(self, agent: str, life: int, reply: Reply, t: float) -> dict | None:
        """Book a named agent's answered turn in server life ``life``; returns the resumption check when
        this is the agent's first turn in a later life than its last one (else None)."""
        with self._lock:
            s = self._agents.setdefault(agent, _Durable(last_life=life))
            row = None
            if life != s.last_life and s.prompt_tokens is not None:
                cached = reply.cached_tokens
                if s.corrupted:
                    hit = cached is not None and cached >= s.prompt_tokens
                    served = s.strict and not s.rebuilt
                    verdict = ("corrupt_served" if served else "excused_rebuilt") if hit else "excused_corrupt"
                elif cached is None:
                    verdict = "unknown"     # a reply without usage: nothing to check
                else:
                    verdict = "kept" if cached >= s.prompt_tokens else "lost"
                # a prompt shorter than the durable one it extends: the history was tokenized otherwise
                # after the restart (a reply re-rendered from its text, not its generated ids)
                shrank = reply.prompt_tokens is not None and reply.prompt_tokens <= s.prompt_tokens
                row = {"t": round(t, 3), "agent": agent, "life": life, "saved_life": s.saved_life,
                       "durable_prompt_tokens": s.prompt_tokens, "cached_tokens": cached,
                       "prompt_tokens": reply.prompt_tokens, "prompt_shrank": shrank, "verdict": verdict}
                self.resumptions.append(row)
                self.counts[f"resume.{verdict}"] += 1
                if s.corrupted:   # its file is quarantined: nothing durable is left until its next save
                    s.prompt_tokens = s.saved_life = None
            if life != s.last_life:
                # the damaged file was met at this life's start (quarantined), whether or not a saved turn
                # made it a durable bar: a file this agent saves from now on is a new one
                s.corrupted = s.strict = s.rebuilt = False
                s.damaged_t = None
            s.last_life = life
            if reply.save_state == "saved":
                s.prompt_tokens, s.saved_life = reply.prompt_tokens, life
            return row

    def summary(self) -> dict:
        """The counts the verdicts read."""
        with self._lock:
            c = Counter(self.counts)
            res = Counter(r["verdict"] for r in self.resumptions)
            checks = Counter(r["verdict"] for r in self.checks)
        return {
            "requests": sum(c[o] for o in OUTCOMES),
            "turns": c["ok"],
            **{o: c[o] for o in OUTCOMES},
            "failures": sum(c[o] for o in FAILURES),
            "resumptions_checked": sum(res[v] for v in ("kept", "lost")),
            "lost_durable_turns": res["lost"],
            "resumptions_excused_corrupt": res["excused_corrupt"] + res["excused_rebuilt"],
            "resumptions_excused_rebuilt": res["excused_rebuilt"],
            "corrupt_served": res["corrupt_served"],
            "resumptions_without_usage": res["unknown"],
            "correctness_checked": sum(checks.values()) - checks["unfinished"],
            "wrong_replies": checks["different"],
            "correctness_unfinished": checks["unfinished"],
        }
