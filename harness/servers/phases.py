"""EXP-009's phases: the same multi-turn workload sent to every server, taking turns.

Every server runs at once on 127.0.0.1 (each idle while another answers), and
each step of the workload goes to all of them in an order that rotates step by
step (A B C, B C A, ...), so machine drift hits them alike. Each server keeps
its own copy of every conversation (its own greedy replies appended), which is
what a real client does::

    warm        1 user, R rounds; each round: append, regenerate (the same request), edit (last user message)
    five_turns  five turns past a sliding window (cold, append, regenerate, edit, back to the first
                branch), ours and mlx_lm.server only, each reply checked against a fresh prefill
    agents      N users round robin (more than mlx_lm.server's 10 cache entries)
    shared      K new users' first turns on the shared system prompt; RSS after each
    restart     SIGTERM (then SIGKILL) every server, restart on its state, every user's next round
    concurrency C users at once, closed loop, one server at a time: throughput, inter-token p99

Only the concurrency phase overlaps requests; everything else is one request
at a time, so a server's stats endpoint can say what one request hit.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from harness.servers import cache_hits, processes
from harness.servers.loadgen import RequestRecord, chat
from harness.servers.targets import ServerTarget

QUESTIONS = [
    "Summarize the last entry in two sentences.", "What changed in the weather that week?",
    "List the ships that passed, briefly.", "Which birds were mentioned most often?",
    "What would you check first tomorrow?", "Rewrite that as a short note for the harbour master.",
    "Give one risk and one precaution.", "What is the most surprising detail so far?",
]


def user_turn(user: int, round_: int) -> dict:
    """User ``user``'s question of round ``round_``: the same message on every server."""
    return {"role": "user", "content": f"{QUESTIONS[(user + round_) % len(QUESTIONS)]} (user {user}, round {round_})"}


# The five turns past a sliding window: what each sends (see five_turn_messages)
FIVE_TURNS = ("first", "append", "regenerate", "edit", "branch")


def five_turn_messages(turn: int, system: dict, questions: Sequence[dict], replies: Mapping[int, str]) -> list[dict]:
    """The messages of turn ``turn`` (1-5) of the five turns for one server, given its own earlier replies.

    1 cold ``[system, q1]``; 2 append ``+ [a1, q2]``; 3 regenerate: turn 2 again; 4 edit: turn 2
    with ``q3`` in place of ``q2``; 5 branch: the original turn 2 continued ``+ [a2, q4]``.
    ``replies[k]`` is the server's reply to turn k (only turns 1 and 2 are ever needed).

    Raises:
        ValueError: ``turn`` is not 1-5, there are fewer than 4 questions, or a needed reply is missing.
    """
    if not 1 <= turn <= len(FIVE_TURNS):
        raise ValueError(f"turn must be 1..{len(FIVE_TURNS)}, not {turn}")
    if len(questions) < 4:
        raise ValueError(f"five turns need 4 user messages, got {len(questions)}")
    need = {1: (), 2: (1,), 3: (1,), 4: (1,), 5: (1, 2)}[turn]
    missing = [k for k in need if k not in replies]
    if missing:
        raise ValueError(f"turn {turn} needs the replies to turns {missing}")
    said = lambda k: {"role": "assistant", "content": replies[k]}  # noqa: E731
    t1 = [system, questions[0]]
    if turn == 1:
        return t1
    if turn == 4:
        return t1 + [said(1), questions[2]]
    t2 = t1 + [said(1), questions[1]]
    return t2 if turn in (2, 3) else t2 + [said(2), questions[3]]


@dataclass
class Server:
    """One started target: its handle and client, and its copy of each conversation."""

    target: ServerTarget
    running: processes.Running
    settings: dict
    histories: dict[int, list[dict]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.target.name

    def client(self):
        """A new async client: one per event loop (each step runs its own), closed after it."""
        import openai

        return openai.AsyncOpenAI(base_url=self.running.url + "/v1", api_key="none", max_retries=0, timeout=900)

    def extra(self, user: int) -> dict:
        # a server with a per-conversation cache field gets the user's id there, as a client would send it
        return {self.target.cache_key_field: f"user-{user}"} if self.target.cache_key_field else {}


@dataclass
class Bench:
    """The servers of one run, the model they all load, and the records so far."""

    model_dir: Path
    model_id: str
    workdir: Path
    count: Callable[[list[dict]], int]
    count_text: Callable[[str], int]
    system: dict
    max_tokens: int
    pythons: dict[str, Path]
    servers: list[Server] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    step: int = 0

    # ------------------------------------------------------------ servers

    def start_all(self, targets: list[ServerTarget], settings: dict[str, dict], tag: str, fresh: bool = True) -> None:
        for target in targets:
            self.servers.append(self._start(target, settings.get(target.name, {}), tag, fresh))

    def _start(self, target: ServerTarget, settings: dict, tag: str, fresh: bool) -> Server:
        work = self.workdir / f"{tag}-{target.name}"
        if fresh and work.exists():
            shutil.rmtree(work)
        running = processes.start(target, self.model_dir, processes.free_port(), work, model_id=self.model_id,
                          python=self.pythons.get(target.name), **settings)
        self.events.append({"event": "started", "server": target.name, "tag": tag, "fresh": fresh,
                            "start_to_ready_s": running.start_to_ready_s, "settings": settings,
                            "blas": running.blas_mapping().openblas})
        return Server(target, running, settings)

    def restart_all(self, sig: int, tag: str, settle_s: float = 2.0) -> None:
        """Stop every server with ``sig`` and start it again on its own state (its workdir)."""
        time.sleep(settle_s)  # an idle moment between rounds, as between a user's turns
        for i, s in enumerate(self.servers):
            code = s.running.stop(sig)
            self.events.append({"event": "stopped", "server": s.name, "signal": signal.Signals(sig).name, "code": code})
            fresh = self._start(s.target, s.settings, tag, fresh=False)
            fresh.histories = s.histories
            self.servers[i] = fresh

    def stop_all(self) -> None:
        for s in self.servers:
            s.running.stop(signal.SIGTERM)
        self.servers = []

    def rss(self) -> dict[str, int]:
        return {s.name: s.running.rss_bytes() for s in self.servers}

    # ------------------------------------------------------------ requests

    def _order(self) -> list[Server]:
        k = self.step % len(self.servers)
        self.step += 1
        return self.servers[k:] + self.servers[:k]

    async def _one(self, s: Server, client, phase: str, user: int, round_: int, kind: str,
                   messages: list[dict], stats: bool = True, extra: dict | None = None,
                   max_tokens: int | None = None) -> RequestRecord:
        # a stats endpoint says what one request hit only when nothing else runs (not under concurrency)
        before = s.running.stats() if stats and s.target.cached_from == "stats_endpoint" else None
        rec = await chat(client, s.name, phase, user, round_, kind, s.running.model, messages,
                         max_tokens or self.max_tokens, self.count, s.extra(user) if extra is None else extra)
        rec.output_tokens = self.count_text(rec.reply)
        if before is not None and rec.error is None:
            rec.cached_tokens = cache_hits.cached_tokens(s.running, None, before, s.running.stats())
        self.records.append(rec)
        return rec

    def each_server(self, phase: str, user: int, round_: int, kind: str,
                    build: Callable[[Server], list[dict]], keep: bool = True, only: set[str] | None = None,
                    max_tokens: int | None = None) -> dict[str, RequestRecord]:
        """Send one step to every server (or those named in ``only``) in rotated order; ``keep``
        appends its reply to its history. Returns each server's record."""
        out = {}

        async def go():
            for s in self._order():
                if only is not None and s.name not in only:
                    continue
                messages = build(s)
                async with s.client() as client:
                    out[s.name] = rec = await self._one(s, client, phase, user, round_, kind, messages,
                                                        max_tokens=max_tokens)
                if keep:
                    s.histories[user] = messages + [{"role": "assistant", "content": rec.reply}]
        asyncio.run(go())
        return out

    def turn(self, phase: str, user: int, round_: int, kind: str = "append", question: str | None = None) -> None:
        """The user's next turn on every server: its history plus a new question."""
        q = {"role": "user", "content": question} if question else user_turn(user, round_)
        self.each_server(phase, user, round_, kind, lambda s: (s.histories.get(user) or [self.system]) + [q])

    # ------------------------------------------------------------ phases

    def warm(self, rounds: int, user: int = 0) -> None:
        """Append, regenerate and edit, round by round, for one user."""
        self.turn("warm", user, 1, "first")
        for r in range(2, rounds + 1):
            self.turn("warm", user, r, "append")
            # regenerate: the same request again (the last reply dropped, the question kept)
            self.each_server("warm", user, r, "regenerate", lambda s: s.histories[user][:-1])
            # edit: the last user message changed; the conversation goes on from the edited turn
            self.each_server("warm", user, r, "edit", lambda s: s.histories[user][:-2] + [
                {"role": "user", "content": s.histories[user][-2]["content"] + " Answer in one line."}])

    def five_turns(self, user: int, system: dict, questions: Sequence[dict], max_tokens: int,
                   servers: set[str], fresh: str) -> list[dict]:
        """The five turns for one user on ``servers``, then each of ``fresh``'s five requests
        again anonymously under a ``cache_salt`` used once (nothing cached can match: a fresh prefill).

        The fresh requests come after all five turns, so their prefills neither slow the measured
        turns nor take pool room the turns' branches need. Returns one row per turn.
        """
        replies: dict[str, dict[int, str]] = {}
        rows = []
        for turn, kind in enumerate(FIVE_TURNS, 1):
            recs = self.each_server("five_turns", user, turn, kind, lambda s, turn=turn: five_turn_messages(
                turn, system, questions, replies.setdefault(s.name, {})), keep=False, only=servers,
                max_tokens=max_tokens)
            for name, rec in recs.items():
                replies[name][turn] = rec.reply
            rows.append({"user": user, "turn": turn, "kind": kind,
                         "servers": {n: _turn_cell(r) for n, r in sorted(recs.items())}})
        (ref,) = [s for s in self.servers if s.name == fresh]

        async def again():
            for row in rows:
                messages = five_turn_messages(row["turn"], system, questions, replies[fresh])
                async with ref.client() as client:
                    rec = await self._one(ref, client, "five_turns-fresh", user, row["turn"], row["kind"], messages,
                                          extra={"cache_salt": f"fresh-{user}-{row['turn']}-{time.time_ns()}"},
                                          max_tokens=max_tokens)
                same = rec.error is None and rec.reply == replies[fresh][row["turn"]]
                row["fresh"] = _turn_cell(rec) | {"equal": same}
        asyncio.run(again())
        return rows

    def agents(self, phase: str, users: range, rounds: int, first_round: int = 1) -> None:
        """Users in round robin: every user's round r before anyone's round r + 1."""
        for r in range(first_round, first_round + rounds):
            for u in users:
                self.turn(phase, u, r, "first" if r == 1 else "append")

    def shared(self, users: range) -> list[dict]:
        """First turns of new users on the shared system prompt, with every server's RSS after each."""
        rss = [{"users": 0, **self.rss()}]
        for i, u in enumerate(users, 1):
            self.turn("shared", u, 1, "first")
            rss.append({"users": i, **self.rss()})
        return rss

    def concurrency(self, level: int, rounds: int, user0: int) -> dict[str, dict]:
        """``level`` users at once on one server at a time (rotating which goes first)."""
        out = {}
        for s in self._order():
            async def user_loop(client, u: int):
                for r in range(1, rounds + 1):
                    q = f"{QUESTIONS[(u + r) % len(QUESTIONS)]} (user {u}, round {r})"
                    msgs = (s.histories.get(u) or [self.system]) + [{"role": "user", "content": q}]
                    rec = await self._one(s, client, f"concurrency-{level}", u, r, "first" if r == 1 else "append", msgs,
                                          stats=False)
                    s.histories[u] = msgs + [{"role": "assistant", "content": rec.reply}]

            async def run_all():
                async with s.client() as client:
                    await asyncio.gather(*(user_loop(client, user0 + i) for i in range(level)))

            t0 = time.perf_counter()
            n0 = len(self.records)
            asyncio.run(run_all())
            wall = time.perf_counter() - t0
            recs = [r for r in self.records[n0:] if r.server == s.name]
            out[s.name] = {"wall_s": wall, "requests": len(recs), "errors": sum(r.error is not None for r in recs),
                           "output_tokens": sum(r.output_tokens for r in recs)}
        return out


def _turn_cell(rec: RequestRecord) -> dict:
    return {"prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens, "ttft_s": rec.ttft_s,
            "reply": rec.reply, "error": rec.error}
