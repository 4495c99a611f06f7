"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or not), ``GET`` and ``DELETE /v1/responses/{id}``.

The server holds the conversation: a stored response (``responses.store``)
is its messages and the agent whose cache holds them, so a follow-up naming
it with ``previous_response_id`` sends only what is new and its prompt is
the agent's cache plus the new input. A chain with no ``prompt_cache_key``
or ``user`` is an agent of its own (named after its first response), so it
is saved to disk and survives restarts like any named agent. ``instructions``
are not carried over (as on OpenAI's API): each request's go first.

The stream is the event sequence the openai SDK and Codex read::

    response.created, response.in_progress,
    per output item: response.output_item.added,
        reasoning:      response.reasoning_text.delta ... .done
        message:        response.content_part.added, response.output_text.delta ... .done, response.content_part.done
        function call:  response.function_call_arguments.delta, .done
    response.output_item.done ..., then response.completed (or response.incomplete at max_output_tokens)
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import AsyncGenerator

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from semantic.service import SamplingParams
from semantic.serve.responses import protocol as rs
from semantic.serve.responses.messages import hosted_tools, namespace_of, responses_format, responses_input, responses_tools
from semantic.serve.errors import NOT_FOUND, ApiError, from_stream, invalid, sse_error
from semantic.serve.stream.items import Delta, Final
from semantic.serve.turn.apirequest import ApiRequest
from semantic.serve.state import ServeState, serve_state, tenant_of
from semantic.serve.stream.sse import EventStream, event
from semantic.serve.turn.turn import Turn, resolve_model, salt_of, use_model

log = logging.getLogger(__name__)

router = APIRouter()
HOSTED_HEADER = "X-Tools-Not-Offered"  # hosted tools (web_search) the model was not offered: none runs here
REFUSED = {"background": "background responses", "conversation": "conversation objects",
           "prompt": "stored prompt templates", "max_tool_calls": "max_tool_calls",
           "top_logprobs": "top_logprobs on responses"}


def _hex() -> str:
    return secrets.token_hex(12)


def _missing(response_id: str) -> ApiError:
    return ApiError(NOT_FOUND, f"response {response_id!r} is not stored here: it was never stored (store: false), "
                               "belongs to another API key, was deleted, or was evicted to keep the disk budget",
                    param="previous_response_id", code="response_not_found")


def _check(body: rs.ResponsesRequest) -> None:
    for name, what in REFUSED.items():
        if getattr(body, name) not in (None, False):
            raise invalid(f"{name} is not supported: this server has no {what}", name)
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise invalid(f"text.verbosity {body.text.verbosity!r} is not supported (send medium or leave it out)",
                      "text.verbosity")


@router.post("/v1/responses")
async def create(body: rs.ResponsesRequest, request: Request, state: ServeState = Depends(serve_state)) -> Response:
    slot = resolve_model(state, body.model)
    _check(body)
    tenant = tenant_of(request)
    backend = await use_model(state, request, slot)
    before, agent = [], body.prompt_cache_key or body.user
    if body.previous_response_id is not None:
        stored = await asyncio.to_thread(state.responses.get, tenant, body.previous_response_id)
        if stored is None:
            raise _missing(body.previous_response_id)
        same_model = stored.get("model", backend.model_id) == backend.model_id
        if same_model and not await asyncio.to_thread(backend.knows_agent, tenant, stored["agent"]):
            await asyncio.to_thread(state.responses.delete, tenant, body.previous_response_id)
            raise ApiError(NOT_FOUND, f"response {body.previous_response_id!r} was evicted: its cache left this "
                                      "server's disk budget; send the whole conversation as input instead",
                           param="previous_response_id", code="response_evicted")
        before, agent = stored["messages"], agent or stored["agent"]
        if same_model and stored.get("echo") and agent == stored["agent"]:  # after a restart: as generated
            backend.restore_echo(tenant, agent, stored["echo"])
    rid = f"resp_{_hex()}"
    if agent is None and body.store:
        agent = f"responses-{rid}"  # the chain's own agent: its cache is saved, and follows the chain
    new = responses_input(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    given = {"temperature": body.temperature, "top_p": body.top_p}
    req = ApiRequest(
        max_tokens=body.max_output_tokens, messages=system + before + new, tenant=tenant, agent=agent,
        cache_salt=salt_of(request),
        sampling=SamplingParams(**{k: v for k, v in given.items() if v is not None}), api="openai.responses",
        tools=responses_tools(body.tools, body.tool_choice, body.parallel_tool_calls),
        response_schema=responses_format(body.text.format if body.text else None),
        until_context=True)  # OpenAI's meaning of no max_output_tokens: Codex never sends one
    turn = Turn(state, await backend.prepare(req), "responses")
    shell = _shell(body, rid, backend.model_id)
    ns = namespace_of(body.tools)
    hosted = hosted_tools(body.tools)
    headers = {**turn.headers, **({HOSTED_HEADER: ",".join(hosted)} if hosted else {})}
    keep = _keeper(state, backend, tenant, rid, agent, before + new) if body.store else None
    if not body.stream:
        final, _ = await turn.run(request)
        out = _finished(shell, final, _items(final, ns))
        await _store(keep, final, out)
        return JSONResponse(out, headers={**headers, **turn.headers})
    await turn.open(request)
    return EventStream(_events(turn, request.url.path, shell, keep, ns), headers)


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, state: ServeState = Depends(serve_state)) -> Response:
    stored = await asyncio.to_thread(state.responses.get, tenant_of(request), response_id)
    if stored is None:
        raise _missing(response_id)
    return JSONResponse(stored["response"])


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request, state: ServeState = Depends(serve_state)) -> Response:
    if not await asyncio.to_thread(state.responses.delete, tenant_of(request), response_id):
        raise _missing(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


# ---------------------------------------------------------------- the response object


def _shell(body: rs.ResponsesRequest, rid: str, model: str) -> dict:
    """The response object before any output: what the request asked, echoed as OpenAI's does."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "previous_response_id": body.previous_response_id,
            "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "store": body.store,
            "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
            "metadata": body.metadata or {}, "usage": None}


def _items(final: Final, ns: dict[str, str]) -> list[dict]:
    items = []
    if final.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{_hex()}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": final.reasoning}]})
    if final.text or not final.tool_calls:
        items.append(_message(f"msg_{_hex()}", final.text, "completed"))
    items += [_call(f"fc_{_hex()}", c, "completed", namespace=ns.get(c.name)) for c in final.tool_calls]
    return items


def _message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call(item_id: str, call, status: str, arguments: str | None = None, namespace: str | None = None) -> dict:
    out = {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
           "arguments": call.arguments_json if arguments is None else arguments, "status": status}
    return {**out, "namespace": namespace} if namespace else out


def _usage(final: Final) -> dict:
    return {"input_tokens": final.prompt_tokens, "input_tokens_details": {"cached_tokens": final.cached_tokens},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": final.reasoning_tokens},
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            **({"cache_save": final.cache_save} if final.cache_save is not None else {})}


def _finished(shell: dict, final: Final, items: list[dict]) -> dict:
    """The whole response: its output items, status and usage."""
    cut = final.finish_reason == "length"
    return {**shell, "output": items, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "usage": _usage(final)}


async def _store(keep, final: Final, response: dict) -> None:
    """Store a finished response when the request asked (file I/O: off the event loop)."""
    if keep is not None and final.finish_reason != "cancelled":
        try:
            await asyncio.to_thread(keep, final, response)
        except OSError as exc:  # a full or read-only disk: the reply stands; a follow-up naming it is a 404
            log.warning("response %s not stored: %s", response.get("id"), exc)


def _keeper(state: ServeState, backend, tenant: str, rid: str, agent: str, messages: list[dict]):
    """What stores a finished response: its conversation (the reply as the message a client would echo),
    the agent that holds its cache, and the response object."""
    def keep(final: Final, response: dict) -> None:
        reply = {"role": "assistant", "content": final.text if final.text or not final.tool_calls else None}
        if final.tool_calls:
            reply["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in final.tool_calls]
        state.responses.put(tenant, rid, {"agent": agent, "messages": messages + [reply], "response": response,
                                          "model": backend.model_id, "echo": backend.echo_state(tenant, agent)})
    return keep


# ---------------------------------------------------------------- the stream


class _Stream:
    """The stream's events in order, each with its sequence number; the output items as they are built."""

    def __init__(self, ns: dict[str, str]):
        self.seq, self.items, self.ns = 0, [], ns
        self.open: dict | None = None    # the item being streamed (reasoning or message)

    def emit(self, name: str, payload: dict) -> bytes:
        out = event(name, {"type": name, "sequence_number": self.seq, **payload})
        self.seq += 1
        return out

    def text(self, kind: str, piece: str):
        if self.open is None or self.open["type"] != kind:
            yield from self.close()
            item = ({"type": "reasoning", "id": f"rs_{_hex()}", "summary": [], "content": []} if kind == "reasoning"
                    else _message(f"msg_{_hex()}", None, "in_progress"))
            self.open, self.buffer = item, ""
            yield self.emit("response.output_item.added", {"output_index": len(self.items), "item": item})
            if kind == "message":
                yield self.emit("response.content_part.added", {
                    "item_id": item["id"], "output_index": len(self.items), "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}})
        self.buffer += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        if piece:
            yield self.emit(name, {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0,
                                   "delta": piece, **({"logprobs": []} if kind == "message" else {})})

    def close(self):
        item, self.open = self.open, None
        if item is None:
            return
        at = len(self.items)
        if item["type"] == "reasoning":
            yield self.emit("response.reasoning_text.done", {"item_id": item["id"], "output_index": at,
                                                             "content_index": 0, "text": self.buffer})
            item = {**item, "content": [{"type": "reasoning_text", "text": self.buffer}]}
        else:
            part = {"type": "output_text", "text": self.buffer, "annotations": [], "logprobs": []}
            yield self.emit("response.output_text.done", {"item_id": item["id"], "output_index": at,
                                                          "content_index": 0, "text": self.buffer, "logprobs": []})
            yield self.emit("response.content_part.done", {"item_id": item["id"], "output_index": at,
                                                           "content_index": 0, "part": part})
            item = {**item, "status": "completed", "content": [part]}
        self.items.append(item)
        yield self.emit("response.output_item.done", {"output_index": at, "item": item})

    def call(self, call):
        yield from self.close()
        at, item_id = len(self.items), f"fc_{_hex()}"
        yield self.emit("response.output_item.added", {"output_index": at,
                                                       "item": _call(item_id, call, "in_progress", "",
                                                                     self.ns.get(call.name))})
        yield self.emit("response.function_call_arguments.delta", {"item_id": item_id, "output_index": at,
                                                                   "delta": call.arguments_json})
        yield self.emit("response.function_call_arguments.done", {"item_id": item_id, "output_index": at,
                                                                  "arguments": call.arguments_json})
        item = _call(item_id, call, "completed", namespace=self.ns.get(call.name))
        self.items.append(item)
        yield self.emit("response.output_item.done", {"output_index": at, "item": item})


async def _events(turn: Turn, path: str, shell: dict, keep, ns: dict[str, str]) -> AsyncGenerator[bytes, None]:
    s = _Stream(ns)
    try:
        yield s.emit("response.created", {"response": shell})
        yield s.emit("response.in_progress", {"response": shell})
        while True:
            item = await turn.next()
            if isinstance(item, Delta):
                if item.reasoning:
                    for out in s.text("reasoning", item.reasoning):
                        yield out
                if item.text:
                    for out in s.text("message", item.text):
                        yield out
                for call in item.tool_calls:
                    for out in s.call(call):
                        yield out
                continue
            if not s.items and s.open is None and not item.tool_calls:
                for out in s.text("message", ""):  # an empty reply is still one message
                    yield out
            for out in s.close():
                yield out
            done = _finished(shell, item, s.items)
            await _store(keep, item, done)
            yield s.emit("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                         {"response": done})
            break
    except Exception as exc:  # the headers said 200: the error goes into the stream
        yield sse_error(path, from_stream(exc))
    finally:
        await turn.close()
