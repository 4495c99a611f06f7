"""Every turn type an agent server sees, sent to two servers taking turns, as paired rows.

One :class:`~harness.servers.phases.Bench` holds both sides' servers (the same model, each its own cache
directory); every step goes to both, in an order that alternates step by step, so drift on the machine
hits them alike and each step is a pair. Each server keeps its own copy of every conversation::

    round r, agent a (a fresh agent each round: a system prompt of its own, nothing cached anywhere)
      first        [system(r, a), task]                              cold prefill
      append       + reply + ~tool_tokens of tool output             the previous turn cached
      regenerate   the append again                                  all but the last token cached
      edit         the append with another tool output in its place  cached up to the edited message
      subagent     [system(r, a), another task] as a new agent       the system prompt cached (pool)
    after the round's agents
      return       each agent's next append but the last's           its cache left RAM (--ram-mb)
    decode         decode_tokens out, one request, then batch_rows at once (one server at a time)
    restart        both servers stopped (SIGTERM) and started on their state; every agent's next append

Decode rows time the tokens after the first (the inter-token pace), so their ratio is a step's, not a
prefill's. Rows carry client TTFT and the whole turn's time, the prompt and cached tokens the server
reported, and the reply.
"""

from __future__ import annotations

import asyncio
import signal
import time

from harness.servers.phases import Bench, Server
from harness.trials.window_trace.trace import system_prompt, task, tool_output, warm_up

KINDS = ("first", "append", "regenerate", "edit", "subagent", "return", "restart", "decode_b1", "decode_batch")


class Workload:
    """The turns on one :class:`Bench` of two servers; ``rows``: one per server and step."""

    def __init__(self, bench: Bench, tok, *, agents: int, rounds: int, system_tokens: int, tool_tokens: int,
                 max_tokens: int, decode_tokens: int, batch_rows: int, decode_reps: int,
                 kinds: tuple[str, ...] = KINDS):
        self.bench, self.tok = bench, tok
        self.agents, self.rounds, self.system_tokens, self.tool_tokens = agents, rounds, system_tokens, tool_tokens
        self.max_tokens, self.decode_tokens, self.batch_rows, self.decode_reps = (
            max_tokens, decode_tokens, batch_rows, decode_reps)
        self.kinds = kinds   # the turn types run (a first turn always: every other starts from one)
        self.rows: list[dict] = []
        self.pair = 0

    # ------------------------------------------------------------ the run

    def run(self) -> None:
        self.warm_up()
        everyone = []
        want = self.kinds.__contains__
        for r in range(self.rounds):
            users = [self._user(r, a) for a in range(self.agents)]
            for a, u in enumerate(users):
                system = system_prompt(self.tok, r * self.agents + a, self.system_tokens)
                self.step(u, "first", lambda s, system=system, a=a: [system, task(a)])
                if want("append") or want("regenerate") or want("edit"):
                    self.step(u, "append", lambda s, u=u, a=a: s.histories[u] + [
                        tool_output(self.tok, a, 1, self.tool_tokens)])
                if want("regenerate"):
                    self.step(u, "regenerate", lambda s, u=u: s.histories[u][:-1], keep=False)
                if want("edit"):
                    self.step(u, "edit", lambda s, u=u, a=a: s.histories[u][:-2] + [
                        tool_output(self.tok, a, 2, self.tool_tokens)], keep=False)
                if want("subagent"):
                    self.step(u + 50, "subagent", lambda s, system=system, a=a: [system, task(a, 0)])
            # every agent but the last has seen the others' turns since its own: its cache left RAM
            for a, u in enumerate(users[:-1] if want("return") else []):
                self.step(u, "return", lambda s, u=u, a=a: s.histories[u] + [tool_output(self.tok, a, 3, self.tool_tokens)])
            everyone += [(a, u) for a, u in enumerate(users)]
        for rep in range(self.decode_reps):
            if want("decode_b1"):
                self.decode(1, 900 + rep)
            if want("decode_batch"):
                self.decode(self.batch_rows, 920 + rep * self.batch_rows)
        if want("restart"):
            self.bench.restart_all(signal.SIGTERM, "run", settle_s=1.0)
            for a, u in everyone:
                self.step(u, "restart", lambda s, u=u, a=a: s.histories[u] + [
                    tool_output(self.tok, a, 4, self.tool_tokens)])

    @staticmethod
    def _user(round_: int, agent: int) -> int:
        return 1000 * (round_ + 1) + agent

    def warm_up(self) -> None:
        warm_up(self.bench)

    # ------------------------------------------------------------ steps

    def step(self, user: int, kind: str, build, keep: bool = True) -> None:
        """One request to both servers in alternating order; ``keep`` appends the reply to the history."""
        b, pair = self.bench, self._next_pair()

        async def go():
            for s in b._order():
                messages = build(s)
                async with s.client() as client:
                    rec = await b._one(s, client, "compare", user, pair, kind, messages, max_tokens=self.max_tokens)
                self._row(s, rec, kind, pair)
                if keep and rec.error is None:
                    s.histories[user] = messages + [{"role": "assistant", "content": rec.reply}]
        asyncio.run(go())

    def decode(self, rows: int, user0: int) -> None:
        """``rows`` requests of ``decode_tokens`` at once on one server, then on the other (alternating which
        goes first): each row's pace after its first token, and the batch's tokens per second."""
        b, pair = self.bench, self._next_pair()
        kind = "decode_b1" if rows == 1 else "decode_batch"
        for s in b._order():
            async def one(client, u: int):
                msgs = [{"role": "user", "content": f"Write a long, plain list of harbour chores, one per line. ({u})"}]
                return await b._one(s, client, "decode", u, pair, kind, msgs, stats=False, extra={},
                                    max_tokens=self.decode_tokens)

            async def all_rows():
                async with s.client() as client:
                    return await asyncio.gather(*(one(client, user0 + i) for i in range(rows)))

            t0 = time.perf_counter()
            recs = asyncio.run(all_rows())
            wall = time.perf_counter() - t0
            paces = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in recs
                     if r.error is None and r.output_tokens > 1 and r.e2e_s and r.ttft_s is not None]
            tokens = sum(r.output_tokens for r in recs if r.error is None)
            self.rows.append({
                "server": s.name, "kind": kind, "pair": pair, "user": user0, "rows": rows,
                "ttft_s": max((r.ttft_s or 0.0) for r in recs), "total_s": wall,
                # seconds per token after the first, the rows' mean: a decode step's pace
                "pace_s": sum(paces) / len(paces) if paces else None,
                "tokens_per_s": tokens / wall if wall else None,
                "completion_tokens": tokens, "prompt_tokens": sum(r.prompt_tokens for r in recs),
                "cached_tokens": None, "error": next((r.error for r in recs if r.error), None), "reply": "",
            })

    def _next_pair(self) -> int:
        self.pair += 1
        return self.pair

    def _row(self, s: Server, rec, kind: str, pair: int) -> None:
        self.rows.append({
            "server": s.name, "kind": kind, "pair": pair, "user": rec.user, "ttft_s": rec.ttft_s,
            "total_s": rec.e2e_s, "prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens,
            "completion_tokens": rec.output_tokens, "error": rec.error, "reply": rec.reply[:80]})
