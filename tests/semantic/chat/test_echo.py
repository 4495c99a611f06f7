"""Echo-stable history through the engine's façade, on the tiny Hermes tool model.

Turn 1 makes a tool call under the grammar; turn 2 echoes it back (as a
client does: structured, with its arguments as JSON text re-parsed) with the
tool's result. The echoed reply must be the generated ids, so turn 2 reuses
all of turn 1's cache; re-rendered, it would be cut inside the call.
"""

from __future__ import annotations

import json

import pytest

from harness.models.tiny import write_tiny_tool_llama
from semantic.service import SamplingParams, Service, Tools, TurnRequest
from semantic.serve.stream.toolcalls import CallSplitter

pytestmark = pytest.mark.compat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_tool_llama(tmp_path_factory.mktemp("hermes") / "model", "hermes")


def _service(model_dir, tmp_path, echo: bool) -> Service:
    return Service.open(str(model_dir), cache_dir=str(tmp_path / f"agents-{echo}"), pool_bytes=8 << 20,
                        disk_budget_bytes=1 << 30, block_tokens=16, echo_history=echo)


def _turn(service: Service, messages: list[dict], tools: Tools):
    prepared = service.prepare(TurnRequest(messages=messages, agent="a", tools=tools, max_tokens=120))
    done = service.submit(prepared.request).result(60)
    splitter = CallSplitter(prepared.tools)
    text, calls = splitter.feed(service.tokenizer.decode([t for t in done.token_ids if t not in service.eos]))
    rest, more = splitter.finish()
    calls += more
    service.remember(prepared, done, text + rest, calls)
    return prepared, done, text + rest, calls


def _loop(service: Service):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    required = Tools((WEATHER,), "required", parallel=False)
    prepared1, done1, text, calls = _turn(service, ask, required)
    assert done1.finish_reason == "stop" and [c.name for c in calls] == ["get_weather"]
    echoed = {"role": "assistant", "content": text or None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments_json)}}
        for c in calls]}
    history = ask + [echoed, {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]
    prepared2, done2, _, _ = _turn(service, history, Tools((WEATHER,), "auto"))
    return prepared1, done1, prepared2, done2


def test_an_echoed_tool_call_is_the_generated_ids_and_the_whole_turn_is_reused(model_dir, tmp_path):
    service = _service(model_dir, tmp_path, echo=True)
    try:
        prepared1, done1, prepared2, done2 = _loop(service)
        turn1 = prepared1.request.ids + tuple(done1.token_ids)  # the whole turn, echoed back
        assert prepared2.request.ids[: len(turn1)] == turn1
        # all the agent's cache holds: everything but the reply's last token, never fed
        assert done2.cached_tokens == len(turn1) - 1
        assert (service.echo.spliced, service.echo.rendered) == (1, 0)
    finally:
        service.close(30)


def _sampled_first_turn(service: Service):
    """A sampled first turn of agent a, remembered: a random byte-level reply that is not UTF-8."""
    ask = [{"role": "user", "content": "Say something."}]
    prepared = service.prepare(TurnRequest(messages=ask, agent="a", max_tokens=24, sampling=SamplingParams(temperature=1.0, seed=5)))
    done = service.submit(prepared.request).result(60)
    text = service.tokenizer.decode([t for t in done.token_ids if t not in service.eos])
    service.remember(prepared, done, text, [])
    return ask, prepared, done, text


def test_a_reply_that_does_not_re_tokenize_the_same_is_reused_whole_only_with_echo(model_dir, tmp_path):
    # a random byte-level model writes bytes that are not UTF-8: the text the client gets back holds
    # replacement characters, so rendering it again can never give the generated ids
    cached = {}
    for echo in (True, False):
        service = _service(model_dir, tmp_path, echo=echo)
        try:
            ask, prepared1, done1, text = _sampled_first_turn(service)
            prepared2 = service.prepare(TurnRequest(messages=ask + [{"role": "assistant", "content": text},
                                                    {"role": "user", "content": "And?"}], agent="a", max_tokens=4))
            cached[echo] = service.submit(prepared2.request).result(60).cached_tokens
            turn1 = len(prepared1.request.ids) + len(done1.token_ids) - 1  # its cache: the last token is never fed
        finally:
            service.close(30)
    assert "\ufffd" in text
    assert cached[True] == turn1 and cached[False] < turn1


def test_an_edited_history_or_another_reply_is_rendered_as_usual(model_dir, tmp_path):
    service = _service(model_dir, tmp_path, echo=True)
    try:
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        _, _, text, calls = _turn(service, ask, Tools((WEATHER,), "required", parallel=False))
        other = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
        result = {"role": "tool", "tool_call_id": "x", "content": "rain"}
        prepared, _, _, _ = _turn(service, ask + [other, result], Tools((WEATHER,), "auto"))
        edited = [{"role": "user", "content": "Weather in Bergen?"}]
        same = {"role": "assistant", "content": text or None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
        service.prepare(TurnRequest(messages=edited + [same, result], agent="a", tools=Tools((WEATHER,), "auto")))
        assert service.echo.spliced == 0 and service.echo.rendered == 2
        rendered = service.tokenizer.encode(prepared.prompt_text, add_special_tokens=False)
        assert list(prepared.request.ids) == rendered  # the template's own form, token for token
    finally:
        service.close(30)


def test_after_a_restart_the_echoed_reply_is_still_the_generated_ids_and_the_whole_turn_is_reused(model_dir, tmp_path):
    # the non-UTF-8 reply of the test above: only the echo, kept beside the cache file, can splice it back
    ask = [{"role": "user", "content": "Say something."}]
    first = _service(model_dir, tmp_path, echo=True)
    try:
        prepared1 = first.prepare(TurnRequest(messages=ask, agent="a", max_tokens=24, sampling=SamplingParams(temperature=1.0, seed=5)))
        done1 = first.submit(prepared1.request).result(60)
        text = first.tokenizer.decode([t for t in done1.token_ids if t not in first.eos])
        first.remember(prepared1, done1, text, [])
        assert first.wait_saved(prepared1.request.agent_id, 30)
    finally:
        first.close(30)
    restarted = _service(model_dir, tmp_path, echo=True)  # a new process over the same directory
    try:
        prepared2 = restarted.prepare(TurnRequest(messages=ask + [{"role": "assistant", "content": text},
                                                  {"role": "user", "content": "And?"}], agent="a", max_tokens=4))
        done2 = restarted.submit(prepared2.request).result(60)
    finally:
        restarted.close(30)
    assert "\ufffd" in text
    assert done2.cached_tokens == len(prepared1.request.ids) + len(done1.token_ids) - 1  # the last token is never fed
    assert (restarted.echo.spliced, restarted.echo.rendered) == (1, 0)


def test_a_regenerate_after_a_later_turn_still_splices_the_earlier_reply_as_generated(model_dir, tmp_path):
    # the book keeps a few turns per agent: regenerating turn 2 echoes turn 1's reply, not the last one
    service = _service(model_dir, tmp_path, echo=True)
    try:
        ask, prepared1, done1, text = _sampled_first_turn(service)
        ask2 = ask + [{"role": "assistant", "content": text}, {"role": "user", "content": "And?"}]
        prepared2 = service.prepare(TurnRequest(messages=ask2, agent="a", max_tokens=6))
        done2 = service.submit(prepared2.request).result(60)
        service.remember(prepared2, done2, service.tokenizer.decode([t for t in done2.token_ids if t not in service.eos]), [])
        regen = service.prepare(TurnRequest(messages=ask2, agent="a", max_tokens=6))  # the same turn 2 again
        assert regen.request.ids == prepared2.request.ids  # turn 1's reply spliced as generated, like the first time
    finally:
        service.close(30)
    assert "\ufffd" in text
