"""EXP-021's coding-agent trace, over HTTP to servers taking turns (``harness.servers.phases.Bench``).

Each agent has a system prompt of its own (a project's instructions and file list), so its first turn
is a cold prefill. Its later turns each append its reply and a tool's output (a slice of a file of this
repository, about ``tool_tokens`` tokens, as a ``read_file`` would return it); agents take their turns
round robin. After round ``subagents_after``, each agent starts ``subagents`` sub-agents: a new task on
the agent's own system prompt (what a coding agent's task tool does)::

    round 1      a0 first   a1 first   a2 first                      cold: nothing cached anywhere
    round 2..R   a0 append  a1 append  a2 append                     + reply + ~250 tokens of tool output
    after k      s0.0 s1.0 s2.0 (sub-agents)                         the agent's system prompt is cached

Every step goes to every server in an order that rotates step by step (interleaved pairs), after one
short request to each that is not recorded (a warm-up); each server keeps its own copy of each
conversation (its own greedy replies). A row per server and step: client TTFT,
prompt and cached tokens, and the fewest cached tokens the turn must find (an append: the previous
turn's prompt and reply, less the one token a server may not have fed; a sub-agent: the prefix its
prompt shares with its agent's first one).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import semantic
from harness.prompts import text_of_tokens
from harness.servers.loadgen import generated
from harness.servers.phases import Bench, Server
from semantic.cache.reuse import common_prefix

PACKAGE = Path(semantic.__file__).parent
PROJECTS = ("billing-service", "log-indexer", "render-farm", "feature-store", "auth-gateway", "etl-scheduler")
# the files a read_file returns slices of: our own source, deterministic and code-shaped
SOURCES = ("cache/pool.py", "cache/reuse.py", "runner/steploop.py", "cache/blockclaim.py", "runner/executor.py",
           "cache/convert.py", "store/blocklayout.py", "sched/scheduler.py")
REPLY_SLACK = 1  # a server may leave the reply's last token unfed (ours never feeds it)


def system_prompt(tok, agent: int, n_tokens: int) -> dict:
    """Agent ``agent``'s system prompt: its project first (so agents share no prefix), about ``n_tokens``."""
    project = PROJECTS[agent % len(PROJECTS)]
    head = (f"Project: {project} (agent {agent}). You are a coding agent in this repository. Tools: "
            "read_file(path, start, end), run_tests(pattern), apply_patch(diff). Read before you edit, keep "
            "answers short, never invent file names.\n\nNotes from earlier sessions:\n")
    return {"role": "system", "content": text_of_tokens(tok, n_tokens, offset=977 * agent, prefix=head)}


def warm_up(b) -> None:
    """One short request to every server of Bench ``b``, not recorded: a server's first request pays
    one-time costs (MLX kernels, the template compiled) that are no turn type's."""

    async def go():
        for s in b.servers:
            async with s.client() as client:
                rec = await b._one(s, client, "warm-up", 999, 0, "warm-up", [task(999)], extra={}, max_tokens=2)
            assert rec.error is None, f"{s.name}'s warm-up failed: {rec.error}"
    asyncio.run(go())
    b.records.clear()


def task(agent: int, sub: int | None = None) -> dict:
    who = f"sub-task {sub} of agent {agent}" if sub is not None else f"task of agent {agent}"
    return {"role": "user", "content": f"New {who}: find why the cache tests fail after the last change and "
                                       f"propose the smallest fix. Start by reading the relevant files."}


def tool_output(tok, agent: int, turn: int, n_tokens: int) -> dict:
    """A ``read_file`` result of about ``n_tokens`` tokens: lines of one of this repository's files."""
    path = SOURCES[(agent * 3 + turn) % len(SOURCES)]
    lines = (PACKAGE / path).read_text().splitlines()
    start = (agent * 37 + turn * 53) % max(1, len(lines) - 40)
    head = f"Tool result: read_file('semantic/{path}', {start + 1})\n```python\n"
    out, i = [], start
    while len(tok.encode(head + "\n".join(out), add_special_tokens=False)) < n_tokens and i < start + 400:
        out.append(lines[i % len(lines)])
        i += 1
    return {"role": "user", "content": head + "\n".join(out) + "\n```"}


class Trace:
    """The trace on one :class:`Bench`; each step recorded as a row per server."""

    def __init__(self, bench: Bench, tok, *, agents: int, rounds: int, system_tokens: int, tool_tokens: int,
                 subagents: int, subagents_after: int, max_tokens: int):
        self.bench, self.tok = bench, tok
        self.agents, self.rounds, self.max_tokens = agents, rounds, max_tokens
        self.subagents, self.subagents_after = subagents, subagents_after
        self.tool_tokens = tool_tokens
        self.systems = [system_prompt(tok, a, system_tokens) for a in range(agents)]
        self.rows: list[dict] = []
        self.last: dict[tuple[str, int], tuple[int, int]] = {}  # (server, user) -> its last (prompt, reply)

    def ids(self, messages: list[dict]) -> list[int]:
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def warm_up(self) -> None:
        warm_up(self.bench)

    def run(self) -> None:
        self.warm_up()
        for r in range(1, self.rounds + 1):
            for a in range(self.agents):
                if r == 1:
                    self.step(a, r, "first", lambda s, a=a: [self.systems[a], task(a)])
                else:
                    tool = tool_output(self.tok, a, r, self.tool_tokens)
                    self.step(a, r, "append", lambda s, a=a, tool=tool: s.histories[a] + [tool])
            if r == self.subagents_after:
                for a in range(self.agents):
                    for k in range(self.subagents):
                        user = 100 + a * 10 + k
                        first = [self.systems[a], task(a)]
                        msgs = [self.systems[a], task(a, k)]
                        self.step(user, 1, "subagent", lambda s, msgs=msgs: msgs, agent=a,
                                  shares=common_prefix(self.ids(first), self.ids(msgs)))

    def step(self, user: int, round_: int, kind: str, build, agent: int | None = None, shares: int | None = None):
        """One request to every server in rotated order; each reply kept in that server's history."""
        b = self.bench

        async def go():
            for s in b._order():
                messages = build(s)
                async with s.client() as client:
                    rec = await b._one(s, client, "trace", user, round_, kind, messages, max_tokens=self.max_tokens)
                self._row(s, rec, kind, agent if agent is not None else user, shares)
                if rec.error is None:
                    s.histories[user] = messages + [{"role": "assistant", "content": rec.reply}]
                    self.last[(s.name, user)] = (rec.prompt_tokens, generated(rec))
        asyncio.run(go())

    def _row(self, s: Server, rec, kind: str, agent: int, shares: int | None) -> None:
        prev = self.last.get((s.name, rec.user))
        expected = (prev[0] + prev[1] - REPLY_SLACK if kind == "append" and prev else
                    shares if kind == "subagent" else None)
        self.rows.append({
            "server": s.name, "kind": kind, "user": rec.user, "agent": agent, "round": rec.round,
            "prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens, "ttft_s": rec.ttft_s,
            "e2e_s": rec.e2e_s, "completion_tokens": rec.output_tokens, "expected_cached": expected,
            "reuse_ok": None if expected is None or rec.cached_tokens is None else rec.cached_tokens >= expected,
            "error": rec.error, "reply": rec.reply[:80]})
