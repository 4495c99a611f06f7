"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``.

Each route turns the request into a :class:`ApiRequest`, runs a
:class:`~semantic.serve.turn.turn.Turn`, and writes OpenAI's exact shapes back;
``usage.prompt_tokens_details.cached_tokens`` says what the cache did.
"""

from __future__ import annotations

import secrets
import time
from typing import AsyncGenerator

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from semantic.service import SamplingParams
from semantic.serve.openai import protocol as oa
from semantic.serve.stream.items import Delta, Final, TokenLogprob
from semantic.serve.turn.apirequest import ApiRequest
from semantic.serve.openai.messages import openai_call, openai_tools, response_schema
from semantic.serve.errors import from_stream, invalid, sse_error
from semantic.serve.state import ServeState, serve_state, tenant_of
from semantic.serve.stream.sse import DONE, EventStream, data
from semantic.serve.fleet.fleet import Slot
from semantic.serve.turn.turn import Turn, agent_of, resolve_model, salt_of, use_model

router = APIRouter()

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def wire_finish(reason: str) -> str:
    return "stop" if reason == "cancelled" else reason


def _calls_out(final: Final) -> list[oa.ToolCallOut] | None:
    return [oa.ToolCallOut(id=c.id, function=oa.FunctionCall(name=c.name, arguments=c.arguments_json))
            for c in final.tool_calls] or None


def usage(final: Final) -> oa.Usage:
    return oa.Usage(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                    total_tokens=final.prompt_tokens + final.completion_tokens,
                    prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=final.cached_tokens),
                    cache_save=final.cache_save)


def sampling(body: oa._Sampling, top_logprobs: int = 0) -> SamplingParams:
    """OpenAI's fields as SamplingParams (unset: the defaults, greedy); bad ranges raise a 400."""
    given = {name: getattr(body, name) for name in
             ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
              "repetition_penalty")}
    return SamplingParams(**{k: v for k, v in given.items() if v is not None}, top_logprobs=top_logprobs)


def _common_checks(state: ServeState, body: oa._Sampling) -> Slot:
    slot = resolve_model(state, body.model)
    if body.n != 1:
        raise invalid("this server generates one choice per request (n must be 1)", "n")
    return slot


def _chat_messages(body: oa.ChatCompletionRequest) -> list[dict]:
    if not body.messages:
        raise invalid("messages must hold at least one message", "messages")
    out = []
    for i, m in enumerate(body.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise invalid(f"messages[{i}].role {m.role!r} is not supported: use system, developer, user, "
                          "assistant or tool", f"messages.{i}.role")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"messages[{i}].content[{j}] is a {part.type!r} part; this server reads "
                                  "text parts only", f"messages.{i}.content.{j}.type")
            text = "\n".join(part.text for part in m.content)
        else:
            text = m.content or ""
        message = {"role": role, "content": text}
        if role == "assistant" and m.tool_calls:
            message["tool_calls"] = [openai_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
            message["content"] = text or None
        elif role == "tool":
            message["tool_call_id"] = m.tool_call_id or ""
            if m.name:
                message["name"] = m.name
        out.append(message)
    return out


def _refuse_unsupported(body: oa.ChatCompletionRequest) -> None:
    """A 400 naming any field that would change the output and that this server does not implement."""
    for name in oa.REFUSED:
        if getattr(body, name):
            raise invalid(f"{name} is not supported by this server", name)
    if body.verbosity not in (None, "medium"):
        raise invalid(f"verbosity {body.verbosity!r} is not supported: nothing here steers a reply's length "
                      "(send medium or leave it out)", "verbosity")
    if body.reasoning_effort not in (None, *oa.REASONING_EFFORTS):
        raise invalid(f"reasoning_effort {body.reasoning_effort!r} is not one of {', '.join(oa.REASONING_EFFORTS)}",
                      "reasoning_effort")
    if body.modalities and set(body.modalities) != {"text"}:
        raise invalid(f"modalities {body.modalities} is not supported: this server writes text only", "modalities")


def _chat_logprobs(tokens: list[TokenLogprob]) -> oa.ChoiceLogprobs:
    return oa.ChoiceLogprobs(content=[
        oa.TokenLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.bytes),
                           top_logprobs=[oa.TopLogprobOut(token=a.token, logprob=a.logprob, bytes=list(a.bytes))
                                         for a in t.top])
        for t in tokens])


@router.post("/v1/chat/completions")
async def chat_completions(body: oa.ChatCompletionRequest, request: Request,
                           state: ServeState = Depends(serve_state)) -> Response:
    slot = _common_checks(state, body)
    _refuse_unsupported(body)
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    want_logprobs = bool(body.logprobs)
    req = ApiRequest(
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        messages=_chat_messages(body),
        sampling=sampling(body, (body.top_logprobs or 0) if want_logprobs else 0),
        stop=_stops(body.stop), logprobs=want_logprobs, tenant=tenant_of(request),
        agent=agent_of(request, body.prompt_cache_key, body.user), cache_salt=salt_of(request, body.cache_salt),
        api="openai.chat", tools=openai_tools(body.tools, body.tool_choice, body.parallel_tool_calls),
        response_schema=response_schema(body.response_format))
    backend = await use_model(state, request, slot)
    turn = Turn(state, await backend.prepare(req), "chat")
    rid, created, model = f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), backend.model_id
    if not body.stream:
        final, tokens = await turn.run(request)
        out = oa.ChatCompletion(
            id=rid, created=created, model=model, usage=usage(final),
            choices=[oa.ChatChoice(message=oa.AssistantMessage(content=final.text if final.text or not final.tool_calls
                                                               else None, tool_calls=_calls_out(final),
                                                               reasoning_content=final.reasoning or None),
                                   logprobs=_chat_logprobs(tokens) if want_logprobs else None,
                                   finish_reason=wire_finish(final.finish_reason))])
        return _json(out, turn.headers)
    await turn.open(request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStream(_chat_events(turn, request.url.path, rid, created, model, include_usage, want_logprobs),
                       turn.headers)


async def _chat_events(turn: Turn, path: str, rid: str, created: int, model: str, include_usage: bool,
                       want_logprobs: bool) -> AsyncGenerator[bytes, None]:
    def chunk(delta: oa.ChunkDelta, finish: str | None = None, logprobs=None) -> bytes:
        c = oa.ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            oa.ChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)])
        return _sse(c, include_usage)

    calls = 0  # tool calls streamed so far: each delta's index
    try:
        yield chunk(oa.ChunkDelta(role="assistant", content=""))
        while True:
            item = await turn.next()
            if isinstance(item, Delta):
                if item.reasoning:
                    yield chunk(oa.ChunkDelta(reasoning_content=item.reasoning))
                if item.text or item.logprobs:
                    yield chunk(oa.ChunkDelta(content=item.text),
                                logprobs=_chat_logprobs(item.logprobs) if want_logprobs else None)
                for call in item.tool_calls:  # whole, one delta each: id, name and arguments at once
                    yield chunk(oa.ChunkDelta(tool_calls=[oa.ToolCallDelta(
                        index=calls, id=call.id, function=oa.FunctionCall(name=call.name, arguments=call.arguments_json))]))
                    calls += 1
                continue
            yield chunk(oa.ChunkDelta(), finish=wire_finish(item.finish_reason))
            if include_usage:
                yield _sse(oa.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                                  usage=usage(item)), True)
            break
        yield DONE
    except Exception as exc:  # the headers said 200: the error goes into the stream
        yield sse_error(path, from_stream(exc))
        yield DONE
    finally:
        await turn.close()


@router.post("/v1/completions")
async def completions(body: oa.CompletionRequest, request: Request,
                      state: ServeState = Depends(serve_state)) -> Response:
    slot = _common_checks(state, body)
    if body.echo:
        raise invalid("echo is not supported", "echo")
    if body.best_of not in (None, 1):
        raise invalid("best_of must be 1", "best_of")
    if body.suffix:
        raise invalid("suffix is not supported", "suffix")
    if body.logit_bias:
        raise invalid("logit_bias is not supported by this server", "logit_bias")
    want_logprobs = body.logprobs is not None
    req = ApiRequest(
        max_tokens=body.max_tokens, prompt=_one_prompt(body.prompt),
        sampling=sampling(body, body.logprobs or 0), stop=_stops(body.stop), logprobs=want_logprobs,
        tenant=tenant_of(request), agent=agent_of(request, body.prompt_cache_key, body.user),
        cache_salt=salt_of(request, body.cache_salt), api="openai.completions")
    backend = await use_model(state, request, slot)
    turn = Turn(state, await backend.prepare(req), "completions")
    rid, created, model = f"cmpl-{secrets.token_hex(12)}", int(time.time()), backend.model_id
    if not body.stream:
        final, tokens = await turn.run(request)
        out = oa.CompletionResponse(id=rid, created=created, model=model, usage=usage(final), choices=[
            oa.CompletionChoice(text=final.text, logprobs=_legacy_logprobs(tokens, 0) if want_logprobs else None,
                                finish_reason=wire_finish(final.finish_reason))])
        return _json(out, turn.headers)
    await turn.open(request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStream(_completion_events(turn, request.url.path, rid, created, model, include_usage,
                                          want_logprobs), turn.headers)


async def _completion_events(turn: Turn, path: str, rid: str, created: int, model: str, include_usage: bool,
                             want_logprobs: bool) -> AsyncGenerator[bytes, None]:
    offset = 0
    try:
        while True:
            item = await turn.next()
            if isinstance(item, Delta):
                # the legacy completion has no reasoning field: its text only, as the reply unstreamed
                if item.text or item.logprobs:
                    lp = _legacy_logprobs(item.logprobs, offset) if want_logprobs else None
                    yield _sse(oa.CompletionResponse(id=rid, created=created, model=model, choices=[
                        oa.CompletionChoice(text=item.text, logprobs=lp, finish_reason=None)]), include_usage)
                    offset += len(item.text)
                continue
            yield _sse(oa.CompletionResponse(id=rid, created=created, model=model, choices=[
                oa.CompletionChoice(text="", logprobs=None, finish_reason=wire_finish(item.finish_reason))]),
                include_usage)
            if include_usage:
                yield _sse(oa.CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage(item)), True)
            break
        yield DONE
    except Exception as exc:
        yield sse_error(path, from_stream(exc))
        yield DONE
    finally:
        await turn.close()


def _legacy_logprobs(tokens: list[TokenLogprob], offset: int) -> oa.CompletionLogprobs:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return oa.CompletionLogprobs(
        tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[{a.token: a.logprob for a in t.top} for t in tokens], text_offset=offsets)


def _one_prompt(prompt) -> str | list[int]:
    """A prompt string or token-id list; a batch of one is unwrapped, larger batches are refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid("this server takes one prompt per request", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    return prompt


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _sse(model, include_usage: bool) -> bytes:
    # chunks carry "usage": null only when the client asked for usage, as OpenAI's do
    return data(model.model_dump(exclude={"usage"} if not include_usage else set()))


def _json(model, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


@router.get("/v1/models")
async def list_models(request: Request, state: ServeState = Depends(serve_state)) -> Response:
    rows = state.models.rows()
    if "anthropic-version" in request.headers:  # the Anthropic SDK's models.list() asks here too
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.started))
        ids = [r["id"] for r in rows]
        return JSONResponse({"data": [{"type": "model", "id": i, "display_name": i, "created_at": created}
                                      for i in ids], "has_more": False, "first_id": ids[0], "last_id": ids[-1]})
    return _json(oa.ModelList(data=[_model(state, row) for row in rows]))


@router.get("/v1/models/{model:path}")
async def get_model(model: str, state: ServeState = Depends(serve_state)) -> Response:
    model_id = resolve_model(state, model).id
    return _json(_model(state, next(r for r in state.models.rows() if r["id"] == model_id)))


def _model(state: ServeState, row: dict) -> oa.Model:
    """A served model, with what its backend says once it is loaded."""
    backend = state.models.backend_of(row["id"])
    kinds, speculating = backend.model_info() if backend is not None else (None, None)
    return oa.Model(id=row["id"], created=state.started, cache_kinds=kinds, speculation=speculating,
                    state=row["state"], aliases=row["aliases"], context_length=row["context_length"],
                    memory_bytes=row["memory_bytes"] or None, pinned=row["pinned"], idle_ttl_s=row["idle_ttl_s"],
                    error=row.get("error"))


@router.get("/health")
async def health(state: ServeState = Depends(serve_state)) -> Response:
    if state.models.closing:
        return JSONResponse({"status": "closing"}, status_code=503)
    return JSONResponse({"status": "ok"})
