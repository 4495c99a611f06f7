"""The HTTP layer of ``semantic serve``: routes, wire shapes, errors, auth, limits, streams.

A stand-in backend (tests/serve_stub.py) replies with scripted pieces: what
is tested here is the route and shape logic, fast; the real Backend over a
real model is tested separately.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from semantic.errors import AgentBusyError, QueueFullError, SchedulerClosedError
from semantic.serve.app import create_app
from semantic.serve.auth import tenant_id
from semantic.serve.cli import parse_config
from semantic.serve.config import ServeConfig
from semantic.service import ToolCall
from tests.serve_stub import StubBackend

CHAT = "/v1/chat/completions"
MSG = "/v1/messages"


def client(backend: StubBackend | None = None, **config) -> TestClient:
    backend = backend or StubBackend()
    return TestClient(create_app(backend, ServeConfig(model="stub", **config)), raise_server_exceptions=False)


def chat(**extra) -> dict:
    return {"model": "stub-model", "messages": [{"role": "user", "content": "hi there"}], **extra}


def msg(**extra) -> dict:
    return {"model": "stub-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hi there"}], **extra}


def openai_error(r, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    assert "Traceback" not in r.text
    return body["error"]


def anthropic_error(r, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type_ and body["error"]["message"]
    return body["error"]


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---- request errors --------------------------------------------------------


def test_malformed_json_is_a_400_in_openai_shape():
    r = client().post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "not valid JSON" in openai_error(r, 400, "invalid_request_error")["message"]


def test_malformed_json_on_messages_is_a_400_in_anthropic_shape():
    r = client().post(MSG, content=b"{nope", headers={"content-type": "application/json"})
    anthropic_error(r, 400, "invalid_request_error")


def test_wrong_types_are_400_naming_the_field():
    err = openai_error(client().post(CHAT, json={"messages": "hi"}), 400, "invalid_request_error")
    assert err["param"] == "messages"
    err = openai_error(client().post(CHAT, json=chat(max_tokens="lots")), 400, "invalid_request_error")
    assert err["param"] == "max_tokens"


def test_empty_messages_are_refused():
    assert openai_error(client().post(CHAT, json=chat(messages=[])), 400, "invalid_request_error")["param"] == "messages"
    anthropic_error(client().post(MSG, json=msg(messages=[])), 400, "invalid_request_error")


def test_unknown_role_is_refused_and_developer_is_system():
    backend = StubBackend()
    c = client(backend)
    err = openai_error(c.post(CHAT, json=chat(messages=[{"role": "robot", "content": "x"}])), 400,
                       "invalid_request_error")
    assert "'robot'" in err["message"] and err["param"] == "messages.0.role"
    ok = c.post(CHAT, json=chat(messages=[{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}]))
    assert ok.status_code == 200
    assert backend.prepared[-1].api.messages == [{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "a\nb"}]


def test_max_tokens_must_be_positive_in_both_apis():
    for field in ("max_tokens", "max_completion_tokens"):
        openai_error(client().post(CHAT, json=chat(**{field: 0})), 400, "invalid_request_error")
    anthropic_error(client().post(MSG, json=msg(max_tokens=0)), 400, "invalid_request_error")
    anthropic_error(client().post(MSG, json={k: v for k, v in msg().items() if k != "max_tokens"}), 400,
                    "invalid_request_error")


def test_more_than_one_choice_is_refused():
    assert openai_error(client().post(CHAT, json=chat(n=2)), 400, "invalid_request_error")["param"] == "n"


def test_bad_sampling_ranges_are_400():
    openai_error(client().post(CHAT, json=chat(temperature=5)), 400, "invalid_request_error")
    openai_error(client().post(CHAT, json=chat(top_logprobs=3)), 400, "invalid_request_error")  # without logprobs
    anthropic_error(client().post(MSG, json=msg(temperature=1.5)), 400, "invalid_request_error")


def test_unknown_model_is_404_in_each_shape():
    err = openai_error(client().post(CHAT, json=chat(model="gpt-9")), 404, "not_found_error")
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    anthropic_error(client().post(MSG, json=msg(model="claude-9")), 404, "not_found_error")
    openai_error(client().get("/v1/models/other"), 404, "not_found_error")


def test_unknown_path_and_method_answer_in_shape():
    openai_error(client().get("/v1/nothing"), 404, "not_found_error")
    openai_error(client().get(CHAT), 405, "invalid_request_error")


def test_a_max_tokens_past_the_context_is_cut_to_what_it_leaves_and_the_header_says_so():
    # the stub's context is 64 tokens and "hi there" is 4: 60 are left
    for stream in (False, True):
        r = client().post(CHAT, json=chat(max_tokens=1000, stream=stream))
        assert r.status_code == 200 and r.headers["x-max-tokens-clamped"] == "60"
        r = client().post(MSG, json=msg(max_tokens=32000, stream=stream))
        assert r.status_code == 200 and r.headers["x-max-tokens-clamped"] == "60"
    backend = StubBackend()
    r = client(backend).post(CHAT, json=chat(max_completion_tokens=61))
    assert r.status_code == 200 and backend.prepared[-1].turn.request.max_tokens == 60
    r = client().post(CHAT, json=chat(max_tokens=60))
    assert r.status_code == 200 and "x-max-tokens-clamped" not in r.headers  # it fit: nothing was cut


def test_a_max_tokens_past_the_context_is_refused_under_strict_max_tokens():
    strict = StubBackend(strict_max_tokens=True)
    err = openai_error(client(strict).post(CHAT, json=chat(max_tokens=1000)), 400, "invalid_request_error")
    assert err["code"] == "context_length_exceeded" and "1004 tokens" in err["message"]
    anthropic_error(client(strict).post(MSG, json=msg(max_tokens=32000)), 400, "invalid_request_error")
    assert parse_config(["--model", "m", "--strict-max-tokens"]).strict_max_tokens
    assert not parse_config(["--model", "m"]).strict_max_tokens


def test_a_prompt_that_leaves_no_room_for_one_token_is_still_a_400():
    err = openai_error(client().post(CHAT, json=chat(messages=[{"role": "user", "content": "x " * 70}])), 400,
                       "invalid_request_error")
    assert err["code"] == "context_length_exceeded"


def test_claude_codes_real_first_request_is_accepted_as_it_was_sent():
    from pathlib import Path

    body = json.loads((Path(__file__).parents[2] / "data" / "claude-code-2.1.330-first-request.json").read_text())
    body["model"] = "stub-model"  # ANTHROPIC_MODEL names the served model
    backend = StubBackend(context_length=32768)  # Gemma 3's
    r = client(backend).post(MSG + "?beta=true", json=body, headers={
        "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,advanced-tool-use-2025-11-20"})
    assert r.status_code == 200, r.text
    req = backend.prepared[-1].api
    roles = [m["role"] for m in req.messages]
    assert roles[0] == "system" and "system" in roles[1:]  # the environment block, where it stood
    assert not any(m["role"] == "system" and m["content"].startswith("x-anthropic-billing-header") for m in req.messages)
    assert "DeferredToolPlaceholder" not in req.tools.names and "Bash" in req.tools.names  # defer_loading honoured
    assert req.max_tokens == 32000 and backend.prepared[-1].turn.request.max_tokens < 32000  # cut, not refused


def test_an_unknown_field_is_a_400_naming_it_on_both_apis():
    err = openai_error(client().post(CHAT, json=chat(temperatur=0.5)), 400, "invalid_request_error")
    assert err["param"] == "temperatur" and "does not know this field" in err["message"]
    err = anthropic_error(client().post(MSG, json=msg(thinkin={"type": "enabled"})), 400, "invalid_request_error")
    assert "thinkin" in err["message"]
    openai_error(client().post("/v1/completions", json={"model": "stub-model", "prompt": "hi", "bogus": 1}), 400,
                 "invalid_request_error")


def test_advisory_fields_are_accepted_and_change_nothing():
    backend = StubBackend()
    for extra in ({"store": True}, {"metadata": {"k": "v"}}, {"service_tier": "auto"}, {"safety_identifier": "u1"},
                  {"prompt_cache_retention": "24h"}, {"reasoning_effort": "high"}, {"verbosity": "medium"},
                  {"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "text"},
                   "parallel_tool_calls": False}):
        assert client(backend).post(CHAT, json=chat(**extra)).status_code == 200, extra
    for extra in ({"thinking": {"type": "adaptive", "display": "omitted"}}, {"thinking": {"type": "disabled"}},
                  {"thinking": {"type": "adaptive", "display": "updates"}},  # Claude Code's stream-json --verbose
                  {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
                  {"output_config": {"effort": "high"}}, {"cache_control": {"type": "ephemeral"}},
                  {"service_tier": "auto"}, {"context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                                               "keep": "all"}]}}):
        assert client(backend).post(MSG, json=msg(**extra)).status_code == 200, extra
    assert all(p.api.response_schema is None for p in backend.prepared)


def test_fields_this_server_cannot_honour_are_refused_by_name():
    for extra, param in (({"verbosity": "high"}, "verbosity"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                         ({"logit_bias": {"1": 5}}, "logit_bias")):
        assert openai_error(client().post(CHAT, json=chat(**extra)), 400, "invalid_request_error")["param"] == param
    for extra, where in (({"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "m"}]}, "mcp_servers"),
                         ({"container": "c1"}, "container"),
                         ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
                          "clear_tool_uses_20250919"),
                         ({"thinking": {"type": "enabled"}}, "budget_tokens"),
                         ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "less than max_tokens"),
                         ({"thinking": {"type": "sometimes"}}, "thinking"),
                         ({"output_config": {"effort": "extreme"}}, "effort"),
                         ({"output_config": {"format": {"type": "xml"}}}, "output_config.format")):
        err = anthropic_error(client().post(MSG, json=msg(**extra)), 400, "invalid_request_error")
        assert where in err["message"], (extra, err)


def test_anthropic_output_format_reaches_the_backend_as_the_replys_schema():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for extra in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):
        backend = StubBackend()
        assert client(backend).post(MSG, json=msg(**extra)).status_code == 200
        assert backend.prepared[-1].api.response_schema == schema
    both = {"output_config": {"format": {"type": "json_schema", "schema": schema}},
            "output_format": {"type": "json_schema", "schema": schema}}
    anthropic_error(client().post(MSG, json=msg(**both)), 400, "invalid_request_error")


def test_system_and_developer_turns_inside_the_conversation_reach_the_backend_where_they_stand():
    backend = StubBackend()
    body = chat(messages=[{"role": "user", "content": "u1"}, {"role": "developer", "content": "d1"},
                          {"role": "assistant", "content": "a1"}, {"role": "system", "content": "s2"},
                          {"role": "user", "content": "u2"}])
    assert client(backend).post(CHAT, json=body).status_code == 200
    assert [m["role"] for m in backend.prepared[-1].api.messages] == ["user", "system", "assistant", "system", "user"]
    body = msg(messages=[{"role": "user", "content": "u1"}, {"role": "system", "content": [{"type": "text", "text": "env"}]}])
    assert client(backend).post(MSG, json=body).status_code == 200
    assert backend.prepared[-1].api.messages[-1] == {"role": "system", "content": "env"}


def test_anthropic_non_text_blocks_are_refused_clearly_and_cache_control_is_accepted():
    backend = StubBackend()
    c = client(backend)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    err = anthropic_error(c.post(MSG, json=msg(messages=[{"role": "user", "content": [image]}])), 400,
                          "invalid_request_error")
    assert "'image'" in err["message"] and "text" in err["message"]
    r = c.post(MSG, json=msg(system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]))
    assert r.status_code == 200
    assert backend.prepared[-1].api.messages[0] == {"role": "system", "content": "sys"}


# ---- auth, limits, load, shutdown ------------------------------------------


def test_keys_are_required_in_either_header_and_name_the_tenant():
    backend = StubBackend()
    c = client(backend, api_keys=("k1", "k2"))
    openai_error(c.post(CHAT, json=chat()), 401, "authentication_error")
    openai_error(c.post(CHAT, json=chat(), headers={"Authorization": "Bearer nope"}), 401, "authentication_error")
    anthropic_error(c.post(MSG, json=msg(), headers={"x-api-key": "nope"}), 401, "authentication_error")
    assert c.post(CHAT, json=chat(), headers={"Authorization": "Bearer k1"}).status_code == 200
    assert c.post(MSG, json=msg(), headers={"x-api-key": "k2"}).status_code == 200
    assert [p.api.tenant for p in backend.streamed] == [tenant_id("k1"), tenant_id("k2")]
    assert tenant_id("k1") != tenant_id("k2") and "k1" not in tenant_id("k1")


def test_health_and_dashboard_are_open_but_metrics_and_stats_need_a_key():
    c = client(api_keys=("k1",))
    assert c.get("/health").json() == {"status": "ok"}
    page = c.get("/dashboard")
    assert page.status_code == 200 and 'id="hit-rate"' in page.text and 'id="agents"' in page.text
    assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")  # no external URLs
    assert c.get("/").status_code == 200
    for path in ("/metrics", "/v1/cache/stats", "/v1/models"):
        assert c.get(path).status_code == 401
        assert c.get(path, headers={"x-api-key": "k1"}).status_code == 200


def test_cache_stats_are_the_callers_tenants():
    c = client(api_keys=("k1",))
    assert c.get("/v1/cache/stats", headers={"x-api-key": "k1"}).json()["tenant"] == tenant_id("k1")
    assert client().get("/v1/cache/stats").json()["tenant"] is None


def test_a_body_over_the_limit_is_413():
    c = client(max_body_mb=0.001)  # 1048 bytes
    big = chat(messages=[{"role": "user", "content": "x" * 4000}])
    openai_error(c.post(CHAT, json=big), 413, "invalid_request_error")
    anthropic_error(c.post(MSG, json=msg(messages=[{"role": "user", "content": "x" * 4000}])), 413,
                    "request_too_large")

    def chunks():  # no Content-Length: counted as it streams in
        yield json.dumps(big).encode()[:600]
        yield json.dumps(big).encode()[600:]

    r = c.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    openai_error(r, 413, "invalid_request_error")


def test_a_full_queue_is_429_with_retry_after_even_for_streams():
    c = client(StubBackend(refuse=QueueFullError("full")))
    for stream in (False, True):
        r = c.post(CHAT, json=chat(stream=stream))
        openai_error(r, 429, "rate_limit_error")
        assert r.headers["retry-after"] == "1"
    r = c.post(MSG, json=msg(stream=True))
    anthropic_error(r, 429, "rate_limit_error")
    assert r.headers["retry-after"] == "1"


def test_executor_refusals_map_to_statuses():
    openai_error(client(StubBackend(refuse=SchedulerClosedError())).post(CHAT, json=chat()), 503,
                 "service_unavailable")
    openai_error(client(StubBackend(refuse=AgentBusyError("a"))).post(CHAT, json=chat()), 409,
                 "invalid_request_error")


def test_closing_answers_503_but_stats_still_answer():
    c = client(StubBackend(closing=True))
    openai_error(c.post(CHAT, json=chat()), 503, "service_unavailable")
    anthropic_error(c.post(MSG, json=msg()), 503, "overloaded_error")
    assert c.get("/health").status_code == 503
    assert c.get("/v1/cache/stats").status_code == 200


def _cancelled_by_shutdown(path: str, body: dict) -> tuple[int, bytes]:
    """A request whose task uvicorn cancels once shutdown's graceful timeout ran out, while the backend is
    still preparing it (before any turn exists): the status and body the client gets."""
    backend = StubBackend()
    reached = asyncio.Event()

    async def prepare_forever(req):
        reached.set()
        await asyncio.Event().wait()

    backend.prepare = prepare_forever
    app = create_app(backend, ServeConfig(model="stub"))
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    sent: list[dict] = []
    bodies = iter([{"type": "http.request", "body": raw, "more_body": False}])

    async def receive():
        return next(bodies, None) or await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    async def main():
        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(reached.wait(), 30)
        backend.closing = True  # SIGTERM: shutdown began; then the graceful timeout runs out
        task.cancel()
        await task  # answered, not cancelled

    asyncio.run(main())
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_request_cancelled_by_shutdown_before_it_answered_is_a_503_in_its_apis_shape_not_a_bare_500():
    status, body = _cancelled_by_shutdown(CHAT, chat())
    error = json.loads(body)["error"]
    assert status == 503 and (error["type"], error["code"]) == ("service_unavailable", "shutting_down")
    assert "graceful-timeout" in error["message"]
    status, body = _cancelled_by_shutdown(MSG, msg())
    assert status == 503 and json.loads(body)["error"]["type"] == "overloaded_error"


def test_an_unexpected_error_is_a_generic_500_without_details():
    backend = StubBackend()
    backend.prepare = lambda req: (_ for _ in ()).throw(RuntimeError("secret detail"))
    r = client(backend).post(CHAT, json=chat())
    openai_error(r, 500, "server_error")
    assert "secret" not in r.text
    r = client(backend).post(MSG, json=msg())
    anthropic_error(r, 500, "api_error")
    assert "secret" not in r.text and "Traceback" not in r.text


def test_lifespan_shutdown_stops_admitting_then_closes():
    backend = StubBackend()
    with TestClient(create_app(backend, ServeConfig(model="stub"))) as c:
        assert c.get("/health").status_code == 200
    assert backend.shut == ["begin", "aclose"]


# ---- replies ---------------------------------------------------------------


def test_chat_reply_shape_and_usage_from_final():
    r = client(StubBackend(cached_tokens=3)).post(CHAT, json=chat(max_tokens=8))
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "stub-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello world", "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 3}}


def test_cancelled_finish_is_stop_on_the_wire():
    body = client(StubBackend(finish_reason="cancelled")).post(CHAT, json=chat()).json()
    assert body["choices"][0]["finish_reason"] == "stop"


def test_default_max_tokens_is_capped_by_the_context():
    backend = StubBackend(context_length=64)
    client(backend).post(CHAT, json=chat())
    assert backend.streamed[-1].turn.request.max_tokens == 64 - 4 and backend.streamed[-1].ids == (0, 1, 2, 3)
    client(backend).post(CHAT, json=chat(max_completion_tokens=5, max_tokens=9))
    assert backend.streamed[-1].turn.request.max_tokens == 5


def test_sampling_stop_and_agent_reach_the_request():
    backend = StubBackend()
    c = client(backend)
    c.post(CHAT, json=chat(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop="END",
                           frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.1,
                           user="u", prompt_cache_key="pk", cache_salt="salt"))
    req = backend.prepared[-1].api
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 5, 0.1, 3)
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert req.stop == ("END",) and req.agent == "pk" and req.cache_salt == "salt"
    c.post(CHAT, json=chat(user="u"), headers={"X-Agent-Id": "h"})
    assert backend.prepared[-1].api.agent == "u"
    c.post(CHAT, json=chat(), headers={"X-Agent-Id": "h"})
    assert backend.prepared[-1].api.agent == "h"
    c.post(MSG, json=msg(metadata={"user_id": "m"}, stop_sequences=["a", "b"]))
    assert backend.prepared[-1].api.agent == "m" and backend.prepared[-1].api.stop == ("a", "b")


def test_chat_logprobs_shape():
    body = client().post(CHAT, json=chat(logprobs=True, top_logprobs=1)).json()
    first = body["choices"][0]["logprobs"]["content"][0]
    assert first == {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"),
                     "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")}]}


def test_completions_take_text_or_token_ids_and_one_prompt():
    backend = StubBackend()
    c = client(backend)
    body = c.post("/v1/completions", json={"model": "stub-model", "prompt": [5, 6, 7], "max_tokens": 4,
                                           "logprobs": 1}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "Hello world" and body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["logprobs"]["tokens"] == ["Hel", "lo", " world"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 3, 5]
    assert backend.prepared[-1].api.prompt == [5, 6, 7]
    assert c.post("/v1/completions", json={"prompt": ["once"]}).status_code == 200
    assert backend.prepared[-1].api.prompt == "once"
    openai_error(c.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, "invalid_request_error")
    openai_error(c.post("/v1/completions", json={"prompt": "a", "echo": True}), 400, "invalid_request_error")


def test_models_lists_the_served_model():
    c = client()
    assert c.get("/v1/models").json()["data"][0]["id"] == "stub-model"
    assert c.get("/v1/models/stub-model").json()["object"] == "model"
    listing = c.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert listing["data"][0]["type"] == "model"


def test_anthropic_reply_shape_and_usage_excludes_cache_reads():
    backend = StubBackend(cached_tokens=3, finish_reason="stop", stop_sequence="##")
    body = client(backend).post(MSG, json=msg(system="be nice")).json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "Hello world"}]
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "##"
    prompt = len(backend.prepared[-1].ids)
    assert body["usage"] == {"input_tokens": prompt - 3, "output_tokens": 3, "cache_read_input_tokens": 3,
                             "cache_creation_input_tokens": 0}
    assert client(StubBackend(finish_reason="length")).post(MSG, json=msg()).json()["stop_reason"] == "max_tokens"
    assert client(StubBackend(finish_reason="stop")).post(MSG, json=msg()).json()["stop_reason"] == "end_turn"


def test_count_tokens_is_the_prompts_length():
    backend = StubBackend()
    r = client(backend).post("/v1/messages/count_tokens", json={"model": "stub-model",
                                                                 "messages": [{"role": "user", "content": "a b c"}]})
    assert r.json() == {"input_tokens": 5}


# ---- streams ---------------------------------------------------------------


def test_chat_stream_event_order_and_usage_chunk():
    r = client().post(CHAT, json=chat(stream=True, stream_options={"include_usage": True}))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:4]] == ["Hel", "lo", " world"]
    assert chunks[4]["choices"][0]["finish_reason"] == "stop" and chunks[4]["usage"] is None
    assert chunks[5]["choices"] == [] and chunks[5]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert len(chunks) == 6


def test_chat_stream_without_usage_has_no_usage_chunk():
    chunks = [json.loads(e) for e in sse_data(client().post(CHAT, json=chat(stream=True)).text)[:-1]]
    assert len(chunks) == 5 and all("usage" not in c for c in chunks)


def test_completion_stream():
    events = sse_data(client().post("/v1/completions", json={"prompt": "x", "stream": True}).text)
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["Hel", "lo", " world", ""]


def test_anthropic_stream_event_order_and_usage():
    backend = StubBackend(cached_tokens=3)
    r = client(backend).post(MSG, json=msg(stream=True))
    events = sse_events(r.text)
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(name == payload["type"] for name, payload in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 4
    assert "".join(p["delta"]["text"] for n, p in events if n == "content_block_delta") == "Hello world"
    delta = events[7][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 1, "output_tokens": 3, "cache_read_input_tokens": 3,
                              "cache_creation_input_tokens": 0}


def test_an_error_mid_stream_is_an_error_event_without_details():
    r = client(StubBackend(fail_after=1)).post(CHAT, json=chat(stream=True))
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "secret" not in r.text
    r = client(StubBackend(fail_after=1)).post(MSG, json=msg(stream=True))
    name, payload = sse_events(r.text)[-1]
    assert name == "error" and payload["error"]["type"] == "api_error"


def _asgi_post(app, path: str, body: dict, disconnect_after_chunks: int, spec: str = "2.3") -> list[bytes]:
    """Drive the app as uvicorn would, and hang up once ``disconnect_after_chunks`` body chunks arrived."""
    sent: list[bytes] = []

    async def run():
        got = asyncio.Event()
        raw = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await got.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sent.append(message["body"])
                if len(sent) >= disconnect_after_chunks:
                    got.set()

        if disconnect_after_chunks == 0:
            asyncio.get_running_loop().call_later(0.05, got.set)
        await asyncio.wait_for(app(scope, receive, send), timeout=5)

    asyncio.run(run())
    return sent


@pytest.mark.parametrize("spec", ["2.3", "2.4"])  # Starlette's own StreamingResponse ignores disconnects on 2.4
def test_a_client_leaving_mid_stream_cancels_the_turn(spec):
    backend = StubBackend(pieces=tuple(f"t{i} " for i in range(200)), delay_s=0.005)
    sent = _asgi_post(create_app(backend, ServeConfig(model="stub")), CHAT, chat(stream=True), 3, spec)
    assert backend.closed_early == 1 and backend.finished == 0
    assert len(sent) < 50


def test_a_client_leaving_a_non_streamed_request_cancels_the_turn():
    backend = StubBackend(pieces=tuple(f"t{i} " for i in range(200)), delay_s=0.005)
    sent = _asgi_post(create_app(backend, ServeConfig(model="stub")), MSG, msg(), 0)
    assert backend.closed_early == 1 and backend.finished == 0 and sent == []


# ---- metrics, sdk clients, cli ---------------------------------------------


def test_metrics_count_requests_tokens_and_read_the_backend():
    c = client()
    c.post(CHAT, json=chat())
    c.post(MSG, json=msg(stream=True))
    c.post(CHAT, json=chat(n=3))
    text = c.get("/metrics").text
    assert 'semantic_requests_total{api="chat",status="200"} 1.0' in text
    assert 'semantic_requests_total{api="chat",status="400"} 1.0' in text
    m = 'model="stub-model"'
    assert f'semantic_cached_tokens_total{{api="messages",{m}}} 3.0' in text
    assert f'semantic_ttft_seconds_count{{api="chat",{m}}} 1.0' in text
    assert f'semantic_inter_token_seconds_count{{api="messages",{m}}} 2.0' in text
    assert f"semantic_queue_depth{{{m}}} 2.0" in text and f"semantic_evictions_total{{{m}}} 5.0" in text
    assert f"semantic_cached_token_ratio{{{m}}} 0.4" in text
    assert f"semantic_ram_bytes{{{m}}} 1024.0" in text and f"semantic_ram_budget_bytes{{{m}}} 4096.0" in text
    assert f"semantic_ram_peak_bytes{{{m}}} 2048.0" in text and f"semantic_ram_budget_evictions_total{{{m}}} 3.0" in text
    assert f"semantic_model_loaded{{{m}}} 1.0" in text


def test_the_openai_and_anthropic_sdks_parse_the_replies():
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    c = client(StubBackend(cached_tokens=2), api_keys=("sk-test",))
    oc = openai.OpenAI(api_key="sk-test", base_url="http://testserver/v1", http_client=c, max_retries=0)
    done = oc.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}])
    assert done.choices[0].message.content == "Hello world"
    assert done.usage.prompt_tokens_details.cached_tokens == 2
    pieces = [ch.choices[0].delta.content for ch in oc.chat.completions.create(
        model="stub-model", messages=[{"role": "user", "content": "hi"}], stream=True) if ch.choices]
    assert "".join(p for p in pieces if p) == "Hello world"
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    ac = anthropic.Anthropic(api_key="sk-test", base_url="http://testserver", http_client=c, max_retries=0)
    m = ac.messages.create(model="stub-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert m.content[0].text == "Hello world" and m.usage.cache_read_input_tokens == 2
    with ac.messages.stream(model="stub-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert final.content[0].text == "Hello world" and final.usage.cache_read_input_tokens == 2
    assert final.usage.input_tokens == 3 - 2 and final.stop_reason == "end_turn"  # 3 stub tokens, 2 cached
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(api_key="bad", base_url="http://testserver", http_client=c, max_retries=0) \
            .messages.create(model="stub-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


def test_cli_reads_keys_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("SEMANTIC_API_KEYS", "e1, e2,")
    cfg = parse_config(["--model", "m", "--api-key", "f1", "--port", "9000"])
    assert cfg.api_keys == ("f1", "e1", "e2") and cfg.port == 9000 and cfg.host == "127.0.0.1"
    assert "f1" not in repr(cfg)
    assert cfg.prefill_chunk is None  # the device's default
    assert parse_config(["--model", "m", "--prefill-chunk", "16"]).prefill_chunk == 16
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--port", "70000"])
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--prefill-chunk", "0"])


def test_cli_picks_the_cache_layout_and_refuses_the_old_one_with_a_shared_tier():
    assert parse_config(["--model", "m"]).cache_layout == "blocks"
    assert parse_config(["--model", "m", "--cache-layout", "file"]).cache_layout == "file"
    for bad in (["--cache-layout", "segments"], ["--cache-layout", "file", "--remote", "redis://127.0.0.1:1/0"]):
        with pytest.raises(SystemExit):
            parse_config(["--model", "m", *bad])


def test_cli_turns_speculation_off_and_sets_the_step_budget():
    from semantic import defaults
    from semantic.decode.promptlookup import SpecConfig

    cost = defaults.spec_position_cost()
    cfg = parse_config(["--model", "m"])
    assert cfg.spec_config == SpecConfig(position_cost=cost) and cfg.itl_target_ms is None  # on by default
    assert parse_config(["--model", "m", "--no-speculation"]).spec_config is None
    assert parse_config(["--model", "m", "--spec-max-draft", "4"]).spec_config == SpecConfig(max_draft=4, position_cost=cost)
    assert parse_config(["--model", "m", "--itl-target-ms", "250"]).itl_target_ms == 250
    for bad in (["--spec-max-draft", "0"], ["--itl-target-ms", "-1"], ["--itl-target-ms", "250", "--prefill-chunk", "64"]):
        with pytest.raises(SystemExit):
            parse_config(["--model", "m", *bad])


@pytest.mark.parametrize("bad", [{"port": 0}, {"pool_mb": 0}, {"host": " "}, {"max_body_mb": -1},
                                 {"api_keys": ("",)}, {"log_level": "loud"}, {"prefill_chunk": 0},
                                 {"ram_mb": 0}, {"ram_mb": 65, "pool_mb": 64}, {"spec_max_draft": 0},
                                 {"itl_target_ms": 0}, {"itl_target_ms": 100, "prefill_chunk": 64}])
def test_serve_config_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        ServeConfig(model="m", **bad)


def test_the_ram_budget_defaults_within_the_pool_so_it_binds():
    from semantic.serve.fleet.registry import ModelEntry, ModelOptions
    from semantic.serve.opening import ram_budget_bytes

    entry = ModelEntry("m", "m", ModelOptions())
    assert ram_budget_bytes(entry, ServeConfig(model="m", pool_mb=64)) == (64 << 20) * 3 // 4
    assert ram_budget_bytes(entry, ServeConfig(model="m", pool_mb=64, ram_mb=64)) == 64 << 20
    assert ram_budget_bytes(entry, ServeConfig(model="m")) is None  # sized with the pool, from the machine


# ---- tool calls ------------------------------------------------------------

CALLS = (ToolCall("call_1", "get_weather", {"city": "Oslo"}), ToolCall("call_2", "get_time", {}))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_openai_tool_calls_replace_the_content_and_finish_with_tool_calls():
    backend = StubBackend(pieces=(), calls=CALLS)
    body = client(backend).post(CHAT, json=chat(tools=[WEATHER], tool_choice="required")).json()
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert backend.prepared[-1].api.tools.choice == "required"


def test_openai_streamed_tool_calls_are_whole_indexed_deltas():
    events = sse_data(client(StubBackend(pieces=("Sure.",), calls=CALLS)).post(
        CHAT, json=chat(tools=[WEATHER], stream=True)).text)
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[1] == {"role": None, "content": "Sure."}
    assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0, 1]
    assert deltas[2]["tool_calls"][0] == {"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


def test_anthropic_tool_use_blocks_stream_in_the_order_the_sdk_reads():
    backend = StubBackend(pieces=(), calls=CALLS)
    events = sse_events(client(backend).post(MSG, json=msg(stream=True, tools=[
        {"name": "get_weather", "input_schema": {"type": "object"}}])).text)
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {
        "type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}}
    assert events[3][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}
    assert events[5][1]["index"] == 1 and events[8][1]["delta"]["stop_reason"] == "tool_use"


def test_the_sdks_assemble_the_tool_calls():
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    c = client(StubBackend(pieces=("Let me check.",), calls=CALLS[:1]))
    oc = openai.OpenAI(api_key="x", base_url="http://testserver/v1", http_client=c, max_retries=0)
    done = oc.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert done.choices[0].message.tool_calls[0].function.name == "get_weather"
    ac = anthropic.Anthropic(api_key="x", base_url="http://testserver", http_client=c, max_retries=0)
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    with ac.messages.stream(model="stub-model", max_tokens=8, tools=tools,
                            messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == "Let me check." and final.content[1].input == {"city": "Oslo"}


@pytest.mark.parametrize("field, value", [("logit_bias", {"50256": -100}), ("functions", [{"name": "f"}]),
                                          ("audio", {"voice": "alloy"}), ("modalities", ["text", "audio"])])
def test_fields_that_would_change_the_output_are_refused_by_name(field, value):
    err = openai_error(client().post(CHAT, json=chat(**{field: value})), 400, "invalid_request_error")
    assert err["param"] == field


# ---- the Responses API ------------------------------------------------------

RESP = "/v1/responses"


def test_a_response_has_openais_shape_and_is_stored_for_its_follow_up():
    backend = StubBackend()
    c = client(backend)
    r = c.post(RESP, json={"model": "stub-model", "input": "hi there", "instructions": "Be brief."})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "response" and doc["status"] == "completed" and doc["id"].startswith("resp_")
    assert doc["output"][0]["type"] == "message" and doc["output"][0]["content"][0]["text"] == "Hello world"
    assert doc["usage"]["input_tokens_details"]["cached_tokens"] == 3
    assert c.get(f"{RESP}/{doc['id']}").json()["id"] == doc["id"]
    r = c.post(RESP, json={"model": "stub-model", "input": "and then?", "previous_response_id": doc["id"]})
    sent = backend.prepared[-1].api
    assert [m["role"] for m in sent.messages] == ["user", "assistant", "user"]  # instructions are not carried over
    assert sent.agent == backend.prepared[0].api.agent and sent.agent.startswith("responses-resp_")


def test_a_response_without_max_output_tokens_may_take_all_the_context_leaves():
    backend = StubBackend(context_length=64)
    assert client(backend).post(RESP, json={"input": "hi there"}).status_code == 200
    assert backend.prepared[-1].turn.request.max_tokens == 64 - 4  # not the chat routes' default
    assert client(backend).post(RESP, json={"input": "hi there", "max_output_tokens": 8}).status_code == 200
    assert backend.prepared[-1].turn.request.max_tokens == 8


def test_a_streamed_response_sends_the_event_sequence_in_order():
    text = client().post(RESP, json={"model": "stub-model", "input": "hi", "stream": True}).text
    events = sse_events(text)
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names.count("response.output_text.delta") == 3 and names[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "Hello world"


def test_a_missing_or_evicted_previous_response_is_a_404_that_says_which():
    backend = StubBackend()
    c = client(backend)
    err = openai_error(c.post(RESP, json={"input": "x", "previous_response_id": "resp_" + "0" * 24}), 404,
                       "not_found_error")
    assert err["code"] == "response_not_found"
    first = c.post(RESP, json={"input": "x"}).json()
    backend.evicted_agents.add(backend.prepared[-1].api.agent)
    err = openai_error(c.post(RESP, json={"input": "y", "previous_response_id": first["id"]}), 404, "not_found_error")
    assert err["code"] == "response_evicted"
    openai_error(c.get(f"{RESP}/{first['id']}"), 404, "not_found_error")  # the record went with its cache


def test_responses_fields_it_cannot_honour_are_refused_and_unknown_ones_named():
    for extra, param in (({"background": True}, "background"), ({"top_logprobs": 2}, "top_logprobs"),
                         ({"text": {"verbosity": "low"}}, "text.verbosity"),
                         ({"tools": [{"type": "file_search"}]}, "tools.0.type"),
                         ({"input": [{"type": "input_image"}]}, "input.0.type")):
        err = openai_error(client().post(RESP, json={"input": "x", **extra}), 400, "invalid_request_error")
        assert err["param"] == param, (extra, err)
    err = openai_error(client().post(RESP, json={"input": "x", "temprature": 1}), 400, "invalid_request_error")
    assert err["param"] == "temprature"
    ok = client().post(RESP, json={"input": "x", "store": False, "metadata": {"a": "b"}, "truncation": "disabled",
                                   "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"]})
    assert ok.status_code == 200 and "x-max-tokens-clamped" not in ok.headers


def test_codexs_real_first_request_is_accepted_its_namespaced_tools_offered_and_its_hosted_one_named():
    from pathlib import Path

    body = json.loads((Path(__file__).parents[2] / "data" / "codex-0.169.0-first-request.json").read_text())
    body["model"] = "stub-model"
    backend = StubBackend(context_length=32768)
    r = client(backend).post(RESP, json=body)
    assert r.status_code == 200, r.text[:500]
    assert r.headers["x-tools-not-offered"] == "web_search"
    sent = backend.prepared[-1].api
    assert {"exec_command", "close_agent"} <= set(sent.tools.names)  # close_agent came from the namespace
    assert sent.agent == body["prompt_cache_key"] and [m["role"] for m in sent.messages] == [
        "system", "system", "user", "user"]
