"""Anthropic-compatible routes: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Usage follows Anthropic's meaning: ``input_tokens`` are the prompt tokens
*not* read from a cache, ``cache_read_input_tokens`` those that were. A
stream sends the real event order, which coding-agent clients depend on:
message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import AsyncGenerator

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from semantic.service import SamplingParams
from semantic.serve.anthropic import protocol as an
from semantic.serve.stream.items import Delta, Final
from semantic.serve.turn.apirequest import ApiRequest
from semantic.serve.anthropic.messages import (
    anthropic_format, anthropic_messages, anthropic_tools, tool_definitions, tool_references,
)
from semantic.serve.errors import from_stream, invalid, sse_error
from semantic.serve.state import ServeState, serve_state, tenant_of
from semantic.serve.stream.sse import EventStream, event
from semantic.serve.turn.turn import Turn, agent_of, resolve_model, salt_of, use_model

router = APIRouter()


def stop_reason(final: Final) -> str:
    if final.finish_reason == "length":
        return "max_tokens"
    if final.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if final.stop_sequence is not None else "end_turn"


def usage(final: Final) -> an.Usage:
    return an.Usage(input_tokens=final.prompt_tokens - final.cached_tokens, output_tokens=final.completion_tokens,
                    cache_read_input_tokens=final.cached_tokens, cache_save=final.cache_save)


# context edits this server honours: thinking is never rendered back, so there is none to clear
CONTEXT_EDITS = ("clear_thinking_20251015",)


def _refuse_unsupported(body: an.CountTokensRequest) -> None:
    """A 400 naming a field this server cannot honour (the field table of docs/serving.md lists them all)."""
    if body.mcp_servers:
        raise invalid("mcp_servers is not supported: this server connects to no MCP server; "
                      "give the tools as tools", "mcp_servers")
    if body.container is not None:
        raise invalid("container is not supported: this server runs no code-execution container", "container")
    for i, edit in enumerate(body.context_management.edits if body.context_management else ()):
        if edit.type not in CONTEXT_EDITS:
            raise invalid(f"context_management.edits[{i}].type {edit.type!r} is not supported; this server "
                          f"applies {', '.join(CONTEXT_EDITS)}", f"context_management.edits.{i}.type")
    if body.output_format is not None and body.output_config is not None and body.output_config.format is not None:
        raise invalid("give output_config.format or output_format, not both", "output_format")


def _conversation(body: an.CountTokensRequest, keep_billing_header: bool):
    """The request's messages and tools in the service's form (``conversation``)."""
    _refuse_unsupported(body)
    if not body.messages:
        raise invalid("messages must hold at least one message", "messages")
    loaded = tool_references(body.messages)
    tools = anthropic_tools(body.tools, body.tool_choice, loaded)
    # the tools' definitions only where a tool_reference renders one
    messages = anthropic_messages(body.system, body.messages, keep_billing_header,
                                  tool_definitions(body.tools) if loaded else None)
    fmt = body.output_config.format if body.output_config is not None else None
    schema = anthropic_format(fmt, "output_config.format") if fmt is not None else \
        anthropic_format(body.output_format, "output_format")
    return messages, tools, schema


def _request(body: an.MessagesRequest, request: Request, state: ServeState) -> ApiRequest:
    given = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    messages, tools, schema = _conversation(body, state.config.keep_billing_header)
    return ApiRequest(
        max_tokens=body.max_tokens, messages=messages,
        sampling=SamplingParams(**{k: v for k, v in given.items() if v is not None}),
        stop=tuple(body.stop_sequences or ()), tenant=tenant_of(request), api="anthropic.messages",
        agent=agent_of(request, body.metadata.user_id if body.metadata else None),
        cache_salt=salt_of(request),
        tools=tools, response_schema=schema)


def shows_thinking(body: an.MessagesRequest) -> bool:
    """A thinking model's reasoning comes back as ``thinking`` blocks only when the request turned thinking on."""
    return body.thinking is not None and body.thinking.type in ("enabled", "adaptive")


def signature(thinking: str) -> str:
    return "semantic-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _content(final: Final, thinking: bool) -> list:
    blocks: list = [an.ThinkingBlock(thinking=final.reasoning, signature=signature(final.reasoning))] \
        if thinking and final.reasoning else []
    blocks += [an.TextBlock(text=final.text)] if final.text or not final.tool_calls else []
    return blocks + [an.ToolUseBlock(id=c.id, name=c.name, input=c.arguments) for c in final.tool_calls]


@router.post("/v1/messages")
async def messages(body: an.MessagesRequest, request: Request, state: ServeState = Depends(serve_state)) -> Response:
    slot = resolve_model(state, body.model)
    req = _request(body, request, state)
    backend = await use_model(state, request, slot)
    turn = Turn(state, await backend.prepare(req), "messages")
    mid, model = f"msg_{secrets.token_hex(12)}", backend.model_id
    if not body.stream:
        final, _ = await turn.run(request)
        out = an.MessageOut(id=mid, model=model, content=_content(final, shows_thinking(body)), stop_reason=stop_reason(final),
                            stop_sequence=final.stop_sequence, usage=usage(final))
        return Response(out.model_dump_json(), media_type="application/json", headers=turn.headers)
    await turn.open(request)
    return EventStream(_events(turn, request.url.path, mid, model, shows_thinking(body)), turn.headers)


class _Blocks:
    """The stream's content blocks, in order: text, then a tool_use block per call (text again if it resumes)."""

    def __init__(self):
        self.index, self.open = -1, None  # the current block's index and type
        self.thought = ""                 # the open thinking block's text, for its signature

    def thinking(self, text: str):
        if self.open != "thinking":
            yield from self.close()
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.open, self.thought = "thinking", ""
        self.thought += text
        yield event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                            "delta": {"type": "thinking_delta", "thinking": text}})

    def text(self, text: str):
        if self.open != "text":
            yield from self.close()
            yield from self._start({"type": "text", "text": ""})
            self.open = "text"
        if text:
            yield event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "text_delta", "text": text}})

    def call(self, call):
        yield from self.close()
        yield from self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        yield event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                            "delta": {"type": "input_json_delta", "partial_json": call.arguments_json}})
        yield event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def close(self):
        if self.open == "thinking":
            yield event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "signature_delta", "signature": signature(self.thought)}})
        if self.open is not None:
            yield event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = None

    def _start(self, block: dict):
        self.index += 1
        yield event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})


async def _events(turn: Turn, path: str, mid: str, model: str, thinking: bool) -> AsyncGenerator[bytes, None]:
    # the turn's first item says how much a cache covered, and whether the reply opens with text (turn.open waited)
    cached = turn.cached_tokens or 0
    start = an.MessageOut(id=mid, model=model, content=[], stop_reason=None, stop_sequence=None,
                          usage=an.Usage(input_tokens=turn.prompt_tokens - cached, output_tokens=0,
                                         cache_read_input_tokens=cached))
    blocks = _Blocks()
    try:
        yield event("message_start", {"type": "message_start", "message": start.model_dump()})
        if not turn.opens_with_calls and not (thinking and turn.opens_with_reasoning):
            for out in blocks.text(""):
                yield out
        yield event("ping", {"type": "ping"})
        while True:
            item = await turn.next()
            if isinstance(item, Delta):
                if item.reasoning and thinking:
                    for out in blocks.thinking(item.reasoning):
                        yield out
                if item.text:
                    for out in blocks.text(item.text):
                        yield out
                for call in item.tool_calls:  # whole, one input_json_delta each
                    for out in blocks.call(call):
                        yield out
                continue
            for out in blocks.close():
                yield out
            yield event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(item), "stop_sequence": item.stop_sequence},
                "usage": usage(item).model_dump()})
            yield event("message_stop", {"type": "message_stop"})
            break
    except Exception as exc:  # the headers said 200: the error goes into the stream
        yield sse_error(path, from_stream(exc))
    finally:
        await turn.close()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: an.CountTokensRequest, request: Request,
                       state: ServeState = Depends(serve_state)) -> Response:
    slot = resolve_model(state, body.model)
    messages, tools, schema = _conversation(body, state.config.keep_billing_header)
    req = ApiRequest(max_tokens=1, messages=messages, tenant=tenant_of(request), tools=tools,
                          response_schema=schema)
    backend = await use_model(state, request, slot)
    out = an.CountTokens(input_tokens=len((await backend.prepare(req)).ids))
    return Response(out.model_dump_json(), media_type="application/json")
