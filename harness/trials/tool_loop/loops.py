"""EXP-011's tool loops: one agent's calls and results against a server, over the OpenAI and Anthropic APIs.

A conversation is ``turns`` requests. Turns 1 .. turns-1 must call the tool
(``tool_choice`` required on the OpenAI API, ``any`` on Anthropic's), the
last may not (``none``), so it answers. Every reply goes back as the client
got it (the assistant's calls, then each call's result), so a server that
keeps an agent's cache whole finds everything before the newest result cached::

    turn k prompt   [ system | task | call 1 | result 1 | ... | call k-1 | result k-1 ]
    cached, ideally [ ------------- turn k-1's prompt -------------- | call k-1 ]
    new             the tool result and the template's glue around it

Three clients, each timing from its own side of the socket (TTFT: to the first
chunk that carries text or a call; servers send a call whole, so on a call
turn TTFT includes writing it):

- ``agents``: the OpenAI Agents SDK (``Runner`` with a function tool, ``ModelSettings(tool_choice=...,
  parallel_tool_calls=False)``); each turn's tool_choice and the timing live in :class:`_TurnModel`,
  the SDK's own chat-completions model with ``stream_response`` wrapped.
- ``openai``: the plain openai SDK, the same requests. A server whose reply holds no call (mlx_lm.server
  has no tool_choice and no grammar) gets the result as a user message, so its loop keeps the same shape;
  the Agents SDK would end the run at such a reply.
- ``anthropic``: the anthropic SDK, as Claude Code sends it: ``metadata.user_id``, a first system block
  ``x-anthropic-billing-header: ...; cch=...`` that changes on every request, ``tool_use`` / ``tool_result``.

Sides (servers) take turns through a :class:`Baton`: request k of every side
before request k + 1 of any, in an order that rotates with k (A B C, B C A, ...).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Sequence

TOOL_NAME = "lookup"
TOOL_DESCRIPTION = "Read one entry of the ship's log."
# a bounded argument: the call fits its token budget on any model, random weights included
TOOL_SCHEMA = {"type": "object", "properties": {"query": {"type": "string", "pattern": "^[a-z][a-z ]{0,23}$"}},
               "required": ["query"], "additionalProperties": False}
TASK = "Read the log one entry at a time with the lookup tool, then summarize the winds in one sentence."
BILLING_HEADER = "x-anthropic-billing-header:"

_WINDS = ("north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west")
_BIRDS = ("two gulls", "a cormorant", "no birds", "a flock of terns", "an albatross")


def tool_result(turn: int) -> str:
    """The tool's answer to the call of ``turn`` (1-based): the same on every side."""
    return (f"Entry {turn}: wind {_WINDS[turn % len(_WINDS)]} at {6 + 3 * turn} knots; "
            f"{_BIRDS[turn % len(_BIRDS)]}; barometer {1002 + turn} hPa.")


def billing_header() -> str:
    """A Claude-Code-like first system block: its ``cch=`` field changes on every request."""
    return f"{BILLING_HEADER} cc_version=2.0.14.{secrets.token_hex(2)}; cc_entrypoint=cli; cch={secrets.token_hex(3)};"


@dataclass(slots=True)
class Turn:
    """One request of a conversation, as the client saw it."""

    side: str
    api: str
    conversation: int
    turn: int
    choice: str                       # the tool_choice sent: "required" / "any", then "none"
    prompt_tokens: int | None = None  # as the server reported them (Anthropic: input + cache read + cache creation)
    cached_tokens: int | None = None  # usage: OpenAI prompt_tokens_details.cached_tokens, Anthropic cache_read_input_tokens
    completion_tokens: int | None = None
    ttft_s: float | None = None       # to the first chunk with text or a call
    e2e_s: float | None = None
    calls: int = 0
    text: str = ""
    error: str | None = None

    def row(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Loop:
    """What every side of one conversation is sent: the system prompt, the task, the budgets."""

    conversation: int
    system: str
    turns: int
    call_tokens: int      # max_tokens of a call turn (a ceiling: a call ends where its grammar does)
    answer_tokens: int    # max_tokens of the last turn
    agent: str            # the agent's name: OpenAI ``user``, Anthropic ``metadata.user_id``

    def max_tokens(self, turn: int) -> int:
        return self.call_tokens if turn < self.turns else self.answer_tokens


class Baton:
    """Sides take turns, one request at a time: request k of every side before request k + 1 of any,
    in an order that rotates with k. A side that :meth:`leave` s (its loop ended) is skipped."""

    def __init__(self, sides: Sequence[str]):
        self.sides = list(sides)
        self.done = dict.fromkeys(self.sides, 0)
        self.gone: set[str] = set()
        self.log: list[tuple[str, int]] = []   # (side, k) in the order requests started
        self._cond = asyncio.Condition()

    def order(self, k: int) -> list[str]:
        r = k % len(self.sides)
        return self.sides[r:] + self.sides[:r]

    def _may(self, side: str) -> bool:
        k, order = self.done[side], self.order(self.done[side])
        live = [s for s in self.sides if s not in self.gone]
        return (all(self.done[s] >= k for s in live)
                and all(self.done[s] > k for s in order[: order.index(side)] if s not in self.gone))

    @asynccontextmanager
    async def turn(self, side: str):
        async with self._cond:
            await self._cond.wait_for(lambda: self._may(side))
            self.log.append((side, self.done[side]))
        try:
            yield
        finally:
            async with self._cond:
                self.done[side] += 1
                self._cond.notify_all()

    async def leave(self, side: str) -> None:
        async with self._cond:
            self.gone.add(side)
            self._cond.notify_all()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


# ---------------------------------------------------------------- the plain openai SDK


async def openai_loop(client, model: str, side: str, loop: Loop, baton: Baton, extra: dict | None = None) -> list[Turn]:
    """One conversation through ``client.chat.completions`` (streamed); ``extra`` goes into every body."""
    tools = [{"type": "function", "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                                               "parameters": TOOL_SCHEMA}}]
    messages: list[dict] = [{"role": "system", "content": loop.system}, {"role": "user", "content": TASK}]
    out = []
    for turn in range(1, loop.turns + 1):
        rec = Turn(side, "openai", loop.conversation, turn, "required" if turn < loop.turns else "none")
        async with baton.turn(side):
            reply = await _openai_turn(client, model, messages, tools, rec, loop, extra)
        out.append(rec)
        if rec.error is not None:
            break
        messages.append(reply)
        for call in reply.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(turn)})
        if not reply.get("tool_calls") and turn < loop.turns:
            messages.append({"role": "user", "content": tool_result(turn)})  # no call: the loop keeps its shape
    return out


async def _openai_turn(client, model: str, messages: list[dict], tools: list[dict], rec: Turn, loop: Loop,
                       extra: dict | None) -> dict:
    """Send one turn; fill ``rec`` and return the assistant message as a client echoes it."""
    text, calls = [], {}
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice=rec.choice, parallel_tool_calls=False,
            max_tokens=loop.max_tokens(rec.turn), temperature=0.0, user=loop.agent, stream=True,
            stream_options={"include_usage": True}, extra_body=extra or None)
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and (delta.content or delta.tool_calls):
                if rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - t0
                text.append(delta.content or "")
                for c in delta.tool_calls or ():
                    got = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
                    got["id"] = c.id or got["id"]
                    got["name"] += (c.function.name or "") if c.function else ""
                    got["arguments"] += (c.function.arguments or "") if c.function else ""
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                rec.prompt_tokens, rec.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                rec.cached_tokens = details.cached_tokens if details is not None else None
        rec.e2e_s = time.perf_counter() - t0
    except Exception as exc:  # a server's failure is a result, not a crash of the run
        rec.error = _error(exc)
    rec.text, rec.calls = "".join(text), len(calls)
    message: dict = {"role": "assistant", "content": rec.text or (None if calls else "")}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for _, c in sorted(calls.items())]
    return message


# ---------------------------------------------------------------- the OpenAI Agents SDK


def _turn_model_class():
    from agents import ModelSettings, OpenAIChatCompletionsModel

    class _TurnModel(OpenAIChatCompletionsModel):
        """The SDK's chat-completions model with each turn's tool_choice and budget, its side's turn on the
        baton, and what the client saw recorded (the Runner calls ``stream_response`` once per turn)."""

        def __init__(self, *, side: str, loop: Loop, baton: Baton, **kw):
            super().__init__(**kw)
            self.side, self.loop, self.baton, self.records = side, loop, baton, []

        async def stream_response(self, system_instructions, input, model_settings, tools, *args, **kwargs):
            turn = len(self.records) + 1
            rec = Turn(self.side, "openai", self.loop.conversation, turn, "required" if turn < self.loop.turns else "none")
            self.records.append(rec)
            settings = model_settings.resolve(ModelSettings(tool_choice=rec.choice, max_tokens=self.loop.max_tokens(turn)))
            text = []
            async with self.baton.turn(self.side):
                t0 = time.perf_counter()
                try:
                    async for event in super().stream_response(system_instructions, input, settings, tools, *args, **kwargs):
                        kind = event.type
                        if kind in ("response.output_text.delta", "response.function_call_arguments.delta") or (
                                kind == "response.output_item.added" and event.item.type == "function_call"):
                            if rec.ttft_s is None:
                                rec.ttft_s = time.perf_counter() - t0
                        if kind == "response.output_text.delta":
                            text.append(event.delta)
                        elif kind == "response.completed":
                            rec.e2e_s = time.perf_counter() - t0
                            usage = event.response.usage
                            rec.prompt_tokens, rec.completion_tokens = usage.input_tokens, usage.output_tokens
                            rec.cached_tokens = usage.input_tokens_details.cached_tokens
                            rec.calls = sum(item.type == "function_call" for item in event.response.output)
                        yield event
                except Exception as exc:
                    rec.error = _error(exc)
                    raise
                finally:
                    rec.text = "".join(text)

    return _TurnModel


async def agents_loop(client, model: str, side: str, loop: Loop, baton: Baton) -> list[Turn]:
    """One conversation driven by the OpenAI Agents SDK's Runner (streamed) with one function tool."""
    from agents import Agent, FunctionTool, ModelSettings, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # nothing leaves this machine
    calls = []

    async def invoke(ctx, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return tool_result(len(calls))

    tool = FunctionTool(name=TOOL_NAME, description=TOOL_DESCRIPTION, params_json_schema=TOOL_SCHEMA,
                        on_invoke_tool=invoke, strict_json_schema=False)
    turn_model = _turn_model_class()(side=side, loop=loop, baton=baton, model=model, openai_client=client)
    agent = Agent(name="log-reader", instructions=loop.system, tools=[tool], model=turn_model,
                  reset_tool_choice=False,  # the SDK would set tool_choice back to auto after the first call
                  model_settings=ModelSettings(parallel_tool_calls=False, include_usage=True, temperature=0.0,
                                               extra_body={"user": loop.agent}))
    try:
        result = Runner.run_streamed(agent, TASK, max_turns=loop.turns)
        async for _ in result.stream_events():
            pass
    except Exception as exc:  # recorded on the turn that failed, or here when it was between turns
        if not turn_model.records or turn_model.records[-1].error is None:
            turn_model.records.append(Turn(side, "openai", loop.conversation, len(turn_model.records) + 1, "",
                                            error=_error(exc)))
    return turn_model.records


# ---------------------------------------------------------------- the anthropic SDK


async def anthropic_loop(client, model: str, side: str, loop: Loop, baton: Baton) -> list[Turn]:
    """One conversation through ``client.messages.stream`` as Claude Code sends it (module doc)."""
    tools = [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}]
    messages: list[dict] = [{"role": "user", "content": TASK}]
    out = []
    for turn in range(1, loop.turns + 1):
        last = turn == loop.turns
        rec = Turn(side, "anthropic", loop.conversation, turn, "none" if last else "any")
        choice = {"type": "none"} if last else {"type": "any", "disable_parallel_tool_use": True}
        system = [{"type": "text", "text": billing_header()},
                  {"type": "text", "text": loop.system, "cache_control": {"type": "ephemeral"}}]
        async with baton.turn(side):
            blocks = await _anthropic_turn(client, model, system, messages, tools, choice, rec, loop)
        out.append(rec)
        if rec.error is not None:
            break
        messages.append({"role": "assistant", "content": blocks})
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": tool_result(turn)}
                   for b in blocks if b["type"] == "tool_use"]
        if not last:
            messages.append({"role": "user", "content": results or tool_result(turn)})
    return out


async def _anthropic_turn(client, model: str, system: list, messages: list, tools: list, choice: dict, rec: Turn,
                          loop: Loop) -> list[dict]:
    """Send one turn; fill ``rec`` and return the assistant's content blocks as a client echoes them."""
    t0 = time.perf_counter()
    blocks: list[dict] = []
    try:
        # no temperature: this SDK no longer sends one, and unset the servers here decode greedily
        async with client.messages.stream(model=model, system=system, messages=messages, tools=tools,
                                          tool_choice=choice, max_tokens=loop.max_tokens(rec.turn),
                                          metadata={"user_id": loop.agent}) as stream:
            async for event in stream:
                if event.type == "content_block_delta" and rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - t0
            message = await stream.get_final_message()
        rec.e2e_s = time.perf_counter() - t0
        u = message.usage
        rec.cached_tokens = u.cache_read_input_tokens or 0
        rec.prompt_tokens = u.input_tokens + rec.cached_tokens + (u.cache_creation_input_tokens or 0)
        rec.completion_tokens = u.output_tokens
        for b in message.content:
            if b.type == "text":
                blocks.append({"type": "text", "text": b.text})
                rec.text += b.text
            elif b.type == "tool_use":
                blocks.append({"type": "tool_use", "id": b.id, "name": b.name, "input": b.input})
        rec.calls = sum(b["type"] == "tool_use" for b in blocks)
    except Exception as exc:
        rec.error = _error(exc)
    return blocks
