"""EXP-018's workload over HTTP, servers taking turns (``harness.servers.phases.Bench``), and what each turn
type must reuse.

One turn of each type goes to every server in an order that rotates step by step (interleaved pairs);
each server keeps its own copy of each conversation (its own greedy replies)::

    warm      user 0: a first turn, then per round: append, regenerate (the same request), edit (the last
              user message changed; the conversation goes on from the edit)
    shared    new agents' first turns on the shared system prompt
    agents    12 agents round robin (mlx_lm.server keeps 10 prompt caches)
    restart   ours SIGKILLed after its saves, started again, a new agent's first turn on the system prompt
              (from disk), user 0's next turn resumed from disk; the same prompt under a fresh cache salt
              (a cold prefill) beside it; the peers restarted alike (cold)

What a turn must find cached, in prompt tokens counted with the model's own tokenizer and template
(:func:`expected_cached`): an append, the whole previous turn (its prompt and its reply, less the one
token a server may not have fed); a regenerate, the whole prompt but its last token; an edit, every
token before the edited message; a new agent's first turn, the system prompt.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Callable, Sequence

from harness.servers.loadgen import generated
from harness.servers.phases import Bench, Server, user_turn

OURS = "semantic"
# a server may leave the reply's last token unfed (ours never feeds it): the previous turn counts
# as reused whole with this many tokens short of its prompt + reply
REPLY_SLACK = 1


def expected_cached(kind: str, *, prompt: int, prev_prompt: int | None = None, prev_reply: int | None = None,
                    message_start: int | None = None, system_end: int | None = None) -> int | None:
    """The fewest prompt tokens a turn of ``kind`` must find cached (None: no goal, a first turn alone)."""
    if kind in ("append", "restart"):
        return None if prev_prompt is None else prev_prompt + (prev_reply or 0) - REPLY_SLACK
    if kind == "regenerate":
        return prompt - 1
    if kind == "edit":
        return message_start
    if kind in ("shared", "first_shared"):
        return system_end
    return None


def reuse_ok(cached: int | None, expected: int | None) -> bool | None:
    """Whether a turn found what it must (None where there is no goal or the server does not say)."""
    if expected is None or cached is None:
        return None
    return cached >= expected


class Workload:
    """The phases on one :class:`Bench`, each turn recorded as a row with its goal and our stats."""

    def __init__(self, bench: Bench, tokenizer, max_tokens: int):
        self.bench, self.tok, self.max_tokens = bench, tokenizer, max_tokens
        self.rows: list[dict] = []
        self.stats: list[dict] = []   # ours' /v1/cache/stats (ram and pool) after each of its turns
        self.last: dict[tuple[str, int], tuple[int, int]] = {}  # (server, user) -> its last kept (prompt, reply)
        self.system_end = self._prefix([bench.system])

    def _prefix(self, messages: list[dict]) -> int:
        """Tokens of ``messages`` under the template, no generation prompt: where the next message starts."""
        return len(self.tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True))

    def _row(self, s: Server, rec, phase: str, kind: str, goal_kind: str, messages: list[dict], **extra) -> dict:
        prev = self.last.get((s.name, rec.user))
        exp = expected_cached(goal_kind, prompt=rec.prompt_tokens, prev_prompt=prev and prev[0],
                              prev_reply=prev and prev[1], message_start=self._prefix(messages[:-1]),
                              system_end=self.system_end)
        row = {"server": s.name, "phase": phase, "kind": kind, "user": rec.user, "round": rec.round,
               "prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens,
               "completion_tokens": rec.output_tokens, "ttft_s": rec.ttft_s, "e2e_s": rec.e2e_s,
               "expected_cached": exp, "reuse_ok": reuse_ok(rec.cached_tokens, exp), "error": rec.error,
               "reply": rec.reply[:80], **extra}
        if s.name == OURS:
            st = s.running.stats() or {}
            ram, pool = st.get("ram", {}), st.get("pool", {})
            snap = {"ram_bytes": ram.get("bytes"), "ram_budget_bytes": ram.get("budget_bytes"),
                    "ram_peak_bytes": ram.get("peak_bytes"), "over_budget_steps": ram.get("over_budget_steps"),
                    "pool_used_bytes": pool.get("used_bytes"), "pool_capacity_bytes": pool.get("capacity_bytes"),
                    "pool_used_blocks": pool.get("used_blocks"), "pool_cached_blocks": pool.get("cached_blocks")}
            row["ours_stats"] = snap
            self.stats.append({"phase": phase, "kind": kind, "user": rec.user, **snap})
        self.rows.append(row)
        return row

    def step(self, phase: str, user: int, round_: int, kind: str, build: Callable[[Server], list[dict]],
             goal_kind: str | None = None, keep: bool = True, **extra) -> dict[str, dict]:
        """One step to every server, rotated; each reply kept in its history (``keep``)."""
        out, b = {}, self.bench

        async def go():
            for s in b._order():
                messages = build(s)
                async with s.client() as client:
                    rec = await b._one(s, client, phase, user, round_, kind, messages, max_tokens=self.max_tokens)
                out[s.name] = self._row(s, rec, phase, kind, goal_kind or kind, messages, **extra)
                if keep and rec.error is None:
                    s.histories[user] = messages + [{"role": "assistant", "content": rec.reply}]
                    self.last[(s.name, user)] = (rec.prompt_tokens, generated(rec))
        asyncio.run(go())
        return out

    def turn(self, phase: str, user: int, round_: int, kind: str = "append", goal_kind: str | None = None, **extra):
        q = user_turn(user, round_)
        return self.step(phase, user, round_, kind, lambda s: (s.histories.get(user) or [self.bench.system]) + [q],
                         goal_kind, **extra)

    # ------------------------------------------------------------ phases

    def warm(self, rounds: int, user: int = 0) -> None:
        self.turn("warm", user, 1, "first")   # the first turn of the run: nothing to reuse yet
        for r in range(2, rounds + 1):
            self.turn("warm", user, r, "append")
            self.step("warm", user, r, "regenerate", lambda s: s.histories[user][:-1])
            self.step("warm", user, r, "edit", lambda s: s.histories[user][:-2] + [
                {"role": "user", "content": s.histories[user][-2]["content"] + " Answer in one line."}])

    def shared(self, users: Sequence[int]) -> None:
        for u in users:
            self.turn("shared", u, 1, "first", goal_kind="shared")

    def agents(self, users: Sequence[int], rounds: int) -> None:
        for r in range(1, rounds + 1):
            for u in users:
                self.turn("agents", u, r, "first" if r == 1 else "append", goal_kind="shared" if r == 1 else None)

    def restart(self, reps: int, user: int = 0, first_round: int = 100, settle_max_s: float = 300.0) -> list[dict]:
        """SIGKILL every server once its saves are done, start it again on its state, send user ``user``'s
        next turn (resumed), and the same prompt under a fresh cache salt to ours (cold); the order of the
        two alternates by rep. Returns per rep what each side took."""
        b, events = self.bench, []
        for rep in range(reps):
            ours = next(s for s in b.servers if s.name == OURS)
            pending = _wait_saves(ours, settle_max_s)
            b.restart_all(signal.SIGKILL, "run", settle_s=0.5)
            r = first_round + rep
            q = user_turn(user, r)
            build = lambda s: (s.histories.get(user) or [b.system]) + [q]  # noqa: E731
            ev = {"rep": rep, "pending_before_kill": pending, "cold_first": rep % 2 == 1}
            # a new agent first, before anything reaches the pool: its system prompt can come only from disk
            ev["new_agent"] = {n: {k: row[k] for k in ("ttft_s", "cached_tokens", "expected_cached", "reuse_ok")}
                               for n, row in self.turn("restart", 300 + rep, 1, "first", goal_kind="shared").items()}
            if ev["cold_first"]:
                ev["cold"] = self._cold(build, user, r, rep)
            ev["resumed"] = {n: {k: row[k] for k in ("ttft_s", "cached_tokens", "prompt_tokens", "expected_cached",
                                                       "reuse_ok", "error")}
                             for n, row in self.step("restart", user, r, "restart", build, rep=rep).items()}
            if not ev["cold_first"]:
                ev["cold"] = self._cold(build, user, r, rep)
            events.append(ev)
        return events

    def _cold(self, build, user: int, round_: int, rep: int) -> dict:
        """The prompt of the resumed turn on ours under a cache salt used once: nothing cached can match."""
        b = self.bench
        ours = next(s for s in b.servers if s.name == OURS)
        messages = build(ours)
        if ours.histories.get(user):   # the resumed turn already ran: its prompt, without its reply
            messages = ours.histories[user][:-1] if messages[-1]["role"] == "assistant" else messages

        async def go():
            async with ours.client() as client:
                return await b._one(ours, client, "restart-cold", user, round_, "cold", messages,
                                    extra={"cache_salt": f"cold-{rep}-{time.time_ns()}"}, max_tokens=self.max_tokens)
        rec = asyncio.run(go())
        row = self._row(ours, rec, "restart-cold", "cold", "cold", messages, rep=rep)
        return {k: row[k] for k in ("ttft_s", "cached_tokens", "prompt_tokens", "error")}


def _wait_saves(s: Server, max_s: float) -> int:
    """Poll ours' stats until no save is pending (a SIGKILL then loses nothing); returns what was pending
    at the deadline (0: all written)."""
    deadline = time.monotonic() + max_s
    while True:
        pending = (s.running.stats() or {}).get("saves", {}).get("pending", 0)
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.1)
