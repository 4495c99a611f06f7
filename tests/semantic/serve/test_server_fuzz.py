"""Fuzzed request bodies against a live ``semantic serve`` (tiny llama): never a 5xx, never a hang.

``hypothesis`` builds bodies that are almost right (the APIs' own fields with
wrong types, out-of-range values, odd roles and content blocks, unknown
fields) and bodies that are plain junk (any JSON, broken bytes). Every answer
must come back within the client's timeout, with a status below 500 and a
JSON error in the API's shape when it is an error.
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.models.tiny import write_tiny_llama
from tests.fuzzing import cases
from tests.serve_helpers import Server


EXAMPLES = cases(full=150, quick=30)  # per endpoint and shape; 7 * 150 requests in all under make test-slow
pytestmark = pytest.mark.fuzz
COUNTS: collections.Counter = collections.Counter()

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
small_int = st.integers(-3, 24) | junk
text = st.text(max_size=60) | junk
role = st.sampled_from(["system", "user", "assistant", "developer", "tool", "wizard", ""]) | junk
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "image_url", "tool_use"]) | junk, "text": text})
content = text | st.lists(part, max_size=3)
tool_call = st.fixed_dictionaries({"id": text, "type": st.just("function") | junk, "function": st.fixed_dictionaries(
    {"name": text, "arguments": st.sampled_from(['{"city": "Oslo"}', "{}", "{not json", "[1]"]) | junk})}) | junk
message = st.fixed_dictionaries({"role": role, "content": content}, optional={
    "tool_calls": st.lists(tool_call, max_size=2) | junk, "tool_call_id": text}) | junk
schema = st.sampled_from([{"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}},
                          {"type": "object"}, {"type": "nonsense"}, {"$ref": "#/nowhere"}]) | junk
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | junk, "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "f", ""]) | junk, "parameters": schema})}) | junk
tool_choice = st.sampled_from(["auto", "none", "required", "sometimes",
                               {"type": "function", "function": {"name": "get_weather"}}]) | junk
response_format = st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "grammar"}]) | \
    st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schema) | junk
sampling = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(-1, 3) | junk, "top_p": st.floats(-0.5, 1.5) | junk, "top_k": small_int,
    "seed": st.integers(-5, 2**70) | junk, "stop": st.lists(st.text(max_size=5), max_size=5) | text,
    "stream": st.booleans() | junk, "n": small_int, "logprobs": st.booleans() | junk, "top_logprobs": small_int,
    "presence_penalty": st.floats(-3, 3) | junk, "frequency_penalty": st.floats(-3, 3) | junk,
    "prompt_cache_key": text, "user": text, "unknown_field": junk,
    "tools": st.lists(tool, max_size=2) | junk, "tool_choice": tool_choice, "parallel_tool_calls": junk,
    "response_format": response_format, "logit_bias": junk,
})
chat = st.builds(lambda m, s, mt, model: {**s, "messages": m, "max_tokens": mt, "model": model},
                 st.lists(message, max_size=4) | junk, sampling, small_int, st.sampled_from(["tiny", "nope"]) | junk)
completion = st.builds(lambda p, s, mt: {**s, "prompt": p, "max_tokens": mt, "model": "tiny"},
                       text | st.lists(st.integers(-5, 300), max_size=8), sampling, small_int)
anthropic_body = st.builds(
    lambda m, sysm, mt, extra: {**extra, "model": "tiny", "messages": m, "system": sysm, "max_tokens": mt},
    st.lists(message, max_size=4) | junk, text | st.lists(part, max_size=2), small_int,
    st.fixed_dictionaries({}, optional={"stop_sequences": st.lists(text, max_size=3) | junk,
                                        "temperature": st.floats(-1, 2) | junk, "stream": st.booleans() | junk,
                                        "metadata": st.fixed_dictionaries({"user_id": text}) | junk,
                                        "tools": st.lists(st.fixed_dictionaries({"name": text, "input_schema": schema})
                                                          | junk, max_size=2) | junk,
                                        "tool_choice": st.sampled_from([{"type": "any"}, {"type": "auto"},
                                                                        {"type": "tool", "name": "x"}]) | junk}),
)
agent_name = st.from_regex(r"[A-Za-z0-9_.:-]{1,20}", fullmatch=True)  # control characters are refused (400)
# well-formed requests with random settings in range: these exercise generation itself
# (stop strings, logprobs, seeds, penalties, streaming) rather than validation
valid_chat = st.builds(
    # OpenAI takes top_logprobs only beside logprobs: true
    lambda m, mt, extra: {**extra, "model": "tiny", "messages": m, "max_tokens": mt,
                          **({"logprobs": True} if "top_logprobs" in extra else {})},
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                    "content": st.text(min_size=1, max_size=80)}), min_size=1, max_size=4),
    st.integers(1, 24),
    st.fixed_dictionaries({}, optional={
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
        "min_p": st.floats(0, 1), "seed": st.integers(0, 2**31), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
        "stream": st.booleans(), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2), "prompt_cache_key": agent_name,
    }),
)
valid_messages = st.builds(
    lambda m, mt, extra: {**extra, "model": "tiny", "messages": m, "max_tokens": mt},
    st.lists(st.text(min_size=1, max_size=60), min_size=1, max_size=3).map(
        lambda texts: [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]),
    st.integers(1, 24),
    st.fixed_dictionaries({}, optional={
        "system": st.text(max_size=80), "temperature": st.floats(0, 1), "top_k": st.integers(0, 50),
        "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=4), "stream": st.booleans(),
        "metadata": st.fixed_dictionaries({"user_id": agent_name}),
    }),
)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
    "additionalProperties": False}}}
# well-formed tool requests: the grammar must produce a call (or JSON) every time, streamed or not
valid_tool_chat = st.builds(
    lambda mt, extra: {**extra, "model": "tiny", "max_tokens": mt, "tools": [WEATHER], "parallel_tool_calls": False,
                       "messages": [{"role": "user", "content": "weather?"}]},
    st.integers(64, 96),
    st.fixed_dictionaries({"tool_choice": st.sampled_from(
        ["required", "auto", "none", {"type": "function", "function": {"name": "get_weather"}}])},
        optional={"stream": st.booleans(), "temperature": st.floats(0, 1.5), "seed": st.integers(0, 99),
                  "prompt_cache_key": agent_name}),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-fuzz"))
    s = Server(model, tmp_path_factory.mktemp("fuzz") / "agents", ["--pool-mb", "64", "--max-context", "512"]).start()
    yield s
    print(f"\nfuzz: {sum(COUNTS.values())} requests, by status: {dict(sorted(COUNTS.items()))}")
    assert s.stop_cleanly(), s.log()


def _send(server, path: str, body: bytes, ok: bool = False) -> None:
    # a hang shows up as httpx.ReadTimeout, failing the example
    with httpx.stream("POST", server.url + path, content=body, timeout=30,
                      headers={"content-type": "application/json"}) as r:
        raw = r.read()
    COUNTS[r.status_code] += 1
    assert r.status_code < 500, (path, body[:300], raw[:300])
    if ok:  # well-formed: only the context limit may refuse it
        assert r.status_code == 200 or b"context" in raw, (path, body[:300], raw[:300])
    if r.status_code >= 400:
        err = json.loads(raw)
        assert ("error" in err) if path != "/v1/messages" else (err["type"] == "error" and "message" in err["error"])


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(body=chat)
def test_fuzzed_chat_completions_never_5xx(server, body):
    _send(server, "/v1/chat/completions", json.dumps(body).encode())


@FUZZ
@given(body=completion)
def test_fuzzed_completions_never_5xx(server, body):
    _send(server, "/v1/completions", json.dumps(body).encode())


@FUZZ
@given(body=anthropic_body)
def test_fuzzed_anthropic_messages_never_5xx(server, body):
    _send(server, "/v1/messages", json.dumps(body).encode())


@FUZZ
@given(body=valid_chat)
def test_fuzzed_valid_chat_requests_succeed(server, body):
    _send(server, "/v1/chat/completions", json.dumps(body).encode(), ok=True)


@FUZZ
@given(body=valid_messages)
def test_fuzzed_valid_anthropic_requests_succeed(server, body):
    _send(server, "/v1/messages", json.dumps(body).encode(), ok=True)


@FUZZ
@given(body=valid_tool_chat)
def test_fuzzed_valid_tool_requests_succeed(server, body):
    _send(server, "/v1/chat/completions", json.dumps(body).encode(), ok=True)


@FUZZ
@given(raw=st.binary(max_size=200) | junk.map(lambda j: json.dumps(j).encode()),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages"]))
def test_fuzzed_junk_bodies_never_5xx(server, raw, path):
    _send(server, path, raw)
