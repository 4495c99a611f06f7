"""Tool calls and structured output on a real ``semantic serve``, driven by the official SDKs and two agent frameworks.

Three tiny random-weight models, one server each: Hermes ``<tool_call>`` (Qwen2.5's
template), Mistral ``[TOOL_CALLS]`` (mlx-lm 0.30.4 has no parser for it, so it falls
back to the generic format there) and the byte-tokenizer llama with no native format
(the generic JSON call). A random model finishes only under a grammar, so every
request asks for one call (``parallel_tool_calls=False``) over bounded schemas.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Annotated

import anthropic
import httpx2
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from harness.models.tiny import write_tiny_llama, write_tiny_tool_llama
from tests.serve_helpers import Server

# properties not in alphabetical order: a client that re-serializes arguments with sorted keys changes them
WEATHER = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "city": {"type": "string", "maxLength": 12}},
           "required": ["days", "city"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} for a place", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "description": f"{name} for a place", "input_schema": schema}
                   for name, schema in SCHEMAS.items()]
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", '{"tool_call"')
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
KINDS = ["hermes", "mistral", "generic"]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


# ---------------------------------------------------------------- servers


def _model(kind: str, path):
    return write_tiny_llama(path) if kind == "generic" else write_tiny_tool_llama(path, kind)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {kind: _model(kind, tmp_path_factory.mktemp(f"tiny-{kind}")) for kind in KINDS}


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    started: dict[str, Server] = {}
    try:
        for kind in KINDS:
            started[kind] = Server(model_dirs[kind], tmp_path_factory.mktemp(f"serve-{kind}") / "agents",
                                   ["--pool-mb", "64"]).start()
        yield started
    finally:
        for s in started.values():
            assert s.stop_cleanly(), s.log()


@pytest.fixture(params=KINDS)
def server(request, servers) -> Server:
    return servers[request.param]


@pytest.fixture(scope="module")
def hermes(servers) -> Server:
    return servers["hermes"]


@pytest.fixture(scope="module")
def hermes_no_echo(model_dirs, tmp_path_factory):
    s = Server(model_dirs["hermes"], tmp_path_factory.mktemp("serve-no-echo") / "agents",
               ["--pool-mb", "64", "--no-echo-history"]).start()
    yield s
    assert s.stop_cleanly(), s.log()


@pytest.fixture
def loopback_only(monkeypatch):
    """Every connection this process opens goes to 127.0.0.1: anything else raises, and is listed."""
    elsewhere: list = []
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def local(host) -> bool:
        return (host.decode() if isinstance(host, bytes) else host) in (None, "127.0.0.1", "::1", "localhost")

    def guard(real):
        def guarded(self, address):
            if isinstance(address, tuple) and not local(address[0]):  # a str is a unix socket: local
                elsewhere.append(address)
                raise ConnectionRefusedError(f"test traffic stays on loopback, not {address!r}")
            return real(self, address)
        return guarded

    def resolve(host, *args, **kw):
        if not local(host):
            elsewhere.append(host)
            raise socket.gaierror(f"test traffic stays on loopback, not {host!r}")
        return getaddrinfo(host, *args, **kw)

    monkeypatch.setattr(socket.socket, "connect", guard(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guard(connect_ex))
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    yield elsewhere
    assert elsewhere == []


def _oa(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _an(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


def _recording_client(server: Server, bodies: list) -> openai.AsyncOpenAI:
    """An AsyncOpenAI whose request bodies are kept, to see what a framework asked the server for."""

    async def keep(request):
        bodies.append(json.loads(request.content or b"{}"))

    http = httpx2.AsyncClient(event_hooks={"request": [keep]}, timeout=60)
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, http_client=http)


def _valid_call(name: str, arguments) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _no_markup(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKUP)


# ---------------------------------------------------------------- openai sdk


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_openai_forced_tool_choice_returns_one_valid_call_and_no_markup(server, choice):
    r = _oa(server).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=120)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls"
    assert choice0.message.content is None or _no_markup(choice0.message.content)
    [call] = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in (SCHEMAS if choice == "required" else ["get_weather"])
    _valid_call(call.function.name, call.function.arguments)


def test_openai_streamed_call_deltas_carry_the_whole_call_and_assemble_into_the_unstreamed_one(server):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False, max_tokens=120)
    client = _oa(server)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas, texts, finishes = [], [], []
    with client.chat.completions.stream(**kw) as stream:  # the SDK's own accumulator
        for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            choice = event.chunk.choices[0]
            deltas += choice.delta.tool_calls or []
            texts.append(choice.delta.content or "")
            finishes += [choice.finish_reason] if choice.finish_reason else []
        final = stream.get_final_completion()
    [delta] = deltas  # one whole call in one delta
    assert delta.index == 0 and delta.id.startswith("call_") and delta.type == "function"
    assert delta.function.name == "get_weather" and delta.function.arguments == whole.function.arguments
    assert finishes == ["tool_calls"] and _no_markup("".join(texts))
    [call] = final.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == (delta.id, "get_weather", whole.function.arguments)
    _valid_call(call.function.name, call.function.arguments)


def test_openai_response_format_json_schema_strict_returns_json_matching_the_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "strict": True, "schema": WEATHER}}
    r = _oa(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A forecast as JSON."}],
                                            response_format=fmt, max_tokens=60)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


def test_openai_response_format_json_object_returns_a_json_object(hermes):
    # any object is allowed, so a random model may write one number forever: this prompt is one Hermes's closes
    r = _oa(hermes).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A JSON object."}],
                                            response_format={"type": "json_object"}, max_tokens=60)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _tool_loop(server: Server, agent: str, echo) -> tuple:
    """A forced call, then its result sent back with the call echoed by ``echo``: (first, second) responses."""
    client = _oa(server)
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           parallel_tool_calls=False, max_tokens=120, user=agent)
    [call] = first.choices[0].message.tool_calls
    echoed = {"id": call.id, "type": "function",
              "function": {"name": call.function.name, "arguments": echo(call.function.arguments)}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [echoed]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, user=agent)
    return first, second


def test_a_named_agents_tool_result_turn_reads_the_whole_previous_turn_from_cache(hermes):
    before = hermes.stats()["echo"]["spliced"]
    first, second = _tool_loop(hermes, "echo-verbatim", lambda arguments: arguments)
    # the whole previous turn but the reply's last token, which is never fed
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert hermes.stats()["echo"]["spliced"] == before + 1


def test_echoed_tool_calls_cache_more_than_the_same_history_rendered_again(hermes, hermes_no_echo):
    # echoed verbatim, these tiny templates render the call just as the model wrote it; a client that keeps
    # arguments parsed and writes them back with sorted keys does not, and only the echo splice still matches
    def resorted(arguments: str) -> str:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))

    first, echo = _tool_loop(hermes, "echo-sorted", resorted)
    again, rendered = _tool_loop(hermes_no_echo, "echo-sorted", resorted)
    turn = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the reply's last token is never fed
    assert (again.usage.prompt_tokens, again.usage.completion_tokens) == (first.usage.prompt_tokens,
                                                                          first.usage.completion_tokens)
    assert echo.usage.prompt_tokens_details.cached_tokens >= turn
    assert echo.usage.prompt_tokens_details.cached_tokens > rendered.usage.prompt_tokens_details.cached_tokens
    assert rendered.usage.prompt_tokens_details.cached_tokens < turn


# ---------------------------------------------------------------- anthropic sdk


def test_anthropic_streamed_tool_use_then_a_tool_result_turn_read_from_cache(server):
    client, agent = _an(server), "claude-tools"
    kw = dict(model="tiny", tools=ANTHROPIC_TOOLS, metadata={"user_id": agent})
    events = []
    with client.messages.stream(max_tokens=120, messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                **kw) as stream:
        for event in stream:
            events.append(event)
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert isinstance(use, anthropic.types.ToolUseBlock) and use.id.startswith("toolu_") and use.name in SCHEMAS
    _valid_call(use.name, use.input)
    assert all(_no_markup(b.text) for b in first.content if b.type == "text")
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts[-1] == "tool_use" and set(starts) <= {"text", "tool_use"}
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(deltas) == 1 and json.loads(deltas[0].partial_json) == use.input  # the whole input, once

    history = ASK + [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny."}]}]
    second = client.messages.create(max_tokens=8, messages=history, **kw)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the whole previous turn but the reply's last token, which is never fed
    turn = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens - 1
    assert second.usage.cache_read_input_tokens >= turn


def test_anthropic_named_tool_choice_calls_that_tool(server):
    m = _an(server).messages.create(model="tiny", max_tokens=120, messages=ASK, tools=ANTHROPIC_TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    _valid_call(use.name, use.input)
    assert all(_no_markup(b.text) for b in m.content if b.type == "text")


# ---------------------------------------------------------------- openai-agents


def _agents_run(server: Server, bodies: list, **agent_kw):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city.

        Args:
            city: the city
            days: how many days ahead
        """
        calls.append((city, days))
        return f"Sunny in {city or 'the city'} for {days} days."

    client = _recording_client(server, bodies)
    model = OpenAIChatCompletionsModel(model="tiny", openai_client=client)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                               temperature=0.0),
                  **agent_kw)
    async def run():
        async with client:  # closes its connections inside this event loop
            return await Runner.run(agent, "Weather in Oslo?", max_turns=3)

    return asyncio.run(run()), calls


@pytest.mark.parametrize("kind", ["hermes", "generic"])
def test_openai_agents_runner_calls_the_tool_and_answers_from_its_result(servers, kind, loopback_only):
    bodies = []
    result, calls = _agents_run(servers[kind], bodies)
    assert len(calls) == 1 and isinstance(result.final_output, str)
    assert len(bodies) == 2  # the call, then the answer made from the tool's result
    assert bodies[0]["tool_choice"] == "required" and bodies[1].get("tool_choice") in (None, "auto")
    assert any(m["role"] == "tool" and "Sunny" in m["content"] for m in bodies[1]["messages"])


def test_openai_agents_stop_on_first_tool_ends_with_the_tools_output(hermes, loopback_only):
    bodies = []
    result, calls = _agents_run(hermes, bodies, tool_use_behavior="stop_on_first_tool")
    assert len(calls) == 1 and len(bodies) == 1
    assert result.final_output.startswith("Sunny in ")


# ---------------------------------------------------------------- pydantic-ai


def _pydantic_ai_run(server: Server, output_type, bodies: list):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = _recording_client(server, bodies)
    agent = Agent(OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client)), output_type=output_type,
                  retries=1, model_settings={"max_tokens": 120, "temperature": 0.0, "parallel_tool_calls": False})

    async def run():
        async with client:
            return await agent.run("A forecast for Oslo.")

    return asyncio.run(run())


def test_pydantic_ai_tool_output_is_an_instance_of_the_output_model(server, loopback_only):
    bodies = []
    result = _pydantic_ai_run(server, Forecast, bodies)
    assert isinstance(result.output, Forecast)
    assert bodies[0]["tool_choice"] == "required" and len(bodies[0]["tools"]) == 1


def test_pydantic_ai_native_output_asks_for_a_json_schema_and_gets_the_model(server, loopback_only):
    from pydantic_ai import NativeOutput

    bodies = []
    result = _pydantic_ai_run(server, NativeOutput(Forecast), bodies)
    assert isinstance(result.output, Forecast)
    assert bodies[0]["response_format"]["type"] == "json_schema" and "tools" not in bodies[0]


# ---------------------------------------------------------------- refusals


IMAGE_URL = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"65": 5}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}]},
     "messages.0.content.1.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
], ids=["logit_bias", "n", "image_part", "unknown_tool_type"])
def test_openai_refuses_what_it_cannot_honour_with_a_400_naming_the_field(hermes, extra, param):
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        _oa(hermes).chat.completions.create(**kw)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    assert e.value.param == param and param.split(".")[0] in e.value.message


@pytest.mark.parametrize("extra, named", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "What is this?"}]}]}, "messages.0.content.0"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]}, "tools[0]"),
], ids=["image_block", "server_tool"])
def test_anthropic_refuses_what_it_cannot_honour_with_a_400_naming_the_field(hermes, extra, named):
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
    with pytest.raises(anthropic.BadRequestError) as e:
        _an(hermes).messages.create(**kw)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and named in e.value.body["error"]["message"]
