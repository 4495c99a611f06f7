"""Anthropic-compatible routes: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Usage follows Anthropic's meaning: ``input_tokens`` are the prompt tokens
*not* read from a cache, ``cache_read_input_tokens`` those that were. A
stream sends the real event order, which coding-agent clients depend on:
message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop.
"""

from __future__ import annotations

import secrets
from typing import AsyncGenerator

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from semantic.service import SamplingParams
from semantic.serve import anthropic_schemas as an
from semantic.serve.protocol import Delta, Final, GenerateRequest
from semantic.serve.errors import from_stream, invalid, sse_error
from semantic.serve.state import ServeState, serve_state, tenant_of
from semantic.serve.streaming import EventStream, event
from semantic.serve.turns import Turn, agent_of, check_model

router = APIRouter()


def stop_reason(final: Final) -> str:
    if final.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if final.stop_sequence is not None else "end_turn"


def usage(final: Final) -> an.Usage:
    return an.Usage(input_tokens=final.prompt_tokens - final.cached_tokens, output_tokens=final.completion_tokens,
                    cache_read_input_tokens=final.cached_tokens)


def _text(content: str | list[an.ContentBlock] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise invalid(f"{where}[{j}] is a {block.type!r} block; this server reads text blocks only",
                          f"{where}.{j}.type")
    return "\n".join(block.text for block in content)


def _messages(body: an.CountTokensRequest) -> list[dict]:
    if not body.messages:
        raise invalid("messages must hold at least one message", "messages")
    out = []
    system = _text(body.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if m.role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role {m.role!r} is not supported: use user or assistant",
                          f"messages.{i}.role")
        out.append({"role": m.role, "content": _text(m.content, f"messages.{i}.content")})
    return out


def _request(body: an.MessagesRequest, request: Request) -> GenerateRequest:
    given = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    return GenerateRequest(
        max_tokens=body.max_tokens, messages=_messages(body),
        sampling=SamplingParams(**{k: v for k, v in given.items() if v is not None}),
        stop=tuple(body.stop_sequences or ()), tenant=tenant_of(request), api="anthropic.messages",
        agent=agent_of(request, body.metadata.user_id if body.metadata else None))


@router.post("/v1/messages")
async def messages(body: an.MessagesRequest, request: Request, state: ServeState = Depends(serve_state)) -> Response:
    check_model(state, body.model)
    turn = Turn(state, await state.backend.prepare(_request(body, request)), "messages")
    mid, model = f"msg_{secrets.token_hex(12)}", state.backend.model_id
    if not body.stream:
        final, _ = await turn.run(request)
        out = an.MessageOut(id=mid, model=model, content=[an.TextBlock(text=final.text)],
                            stop_reason=stop_reason(final), stop_sequence=final.stop_sequence, usage=usage(final))
        return Response(out.model_dump_json(), media_type="application/json")
    await turn.open(request)
    return EventStream(_events(turn, request.url.path, mid, model))


async def _events(turn: Turn, path: str, mid: str, model: str) -> AsyncGenerator[bytes, None]:
    # the turn's first delta says how much a cache covered (turn.open waited for it)
    cached = turn.cached_tokens or 0
    start = an.MessageOut(id=mid, model=model, content=[], stop_reason=None, stop_sequence=None,
                          usage=an.Usage(input_tokens=turn.prompt_tokens - cached, output_tokens=0,
                                         cache_read_input_tokens=cached))
    try:
        yield event("message_start", {"type": "message_start", "message": start.model_dump()})
        yield event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        yield event("ping", {"type": "ping"})
        while True:
            item = await turn.next()
            if isinstance(item, Delta):
                if item.text:
                    yield event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                        "delta": {"type": "text_delta", "text": item.text}})
                continue
            yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
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
    check_model(state, body.model)
    req = GenerateRequest(max_tokens=1, messages=_messages(body), tenant=tenant_of(request))
    out = an.CountTokens(input_tokens=len((await state.backend.prepare(req)).ids))
    return Response(out.model_dump_json(), media_type="application/json")
