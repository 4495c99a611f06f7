"""The Responses API on a real ``semantic serve``, driven by the openai SDK and the OpenAI Agents SDK.

A tiny random-weight model (the Hermes tool model, so calls have a native format) behind two API keys:
``previous_response_id`` chains that survive a SIGTERM and a SIGKILL restart with their cache, a function
tool round trip through Responses items, streamed and whole replies alike, and one tenant's ids hidden
from another.
"""

from __future__ import annotations

import signal

import openai
import pytest

from harness.models.tiny import write_tiny_tool_llama
from tests.serve_helpers import Server

KEYS = ("sk-one", "sk-two")
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_tool_llama(tmp_path_factory.mktemp("tiny-responses"), "hermes")
    s = Server(model, tmp_path_factory.mktemp("serve-responses") / "agents",
               ["--pool-mb", "64", *[a for k in KEYS for a in ("--api-key", k)]]).start()
    yield s
    s.stop(signal.SIGKILL)


def _client(server: Server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_response_streamed_and_whole_say_the_same_and_report_cached_tokens(server):
    client = _client(server)
    whole = client.responses.create(model="tiny", input="Say hi.", max_output_tokens=12, store=False)
    assert whole.status in ("completed", "incomplete") and whole.usage.input_tokens > 0
    with client.responses.stream(model="tiny", input="Say hi.", max_output_tokens=12, store=False) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    final = events[-1].response  # the SDK's get_final_response() wants response.completed, which a cut reply is not
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_chain_of_previous_response_ids_reads_its_cache_across_a_sigterm_and_a_sigkill(server):
    client, previous, seen = _client(server), None, 0
    for turn, stop in enumerate((None, signal.SIGTERM, signal.SIGKILL, None)):
        if stop == signal.SIGKILL:
            server.wait_saved(KEYS[0])  # write-behind: the newest turn's cache is on disk once its save is written
        if stop is not None:
            server.stop(stop)
            server.start()
            client = _client(server)
        r = client.responses.create(model="tiny", input=f"Question {turn}?", previous_response_id=previous,
                                    instructions="Be brief.", max_output_tokens=6)
        if turn:
            assert r.usage.input_tokens_details.cached_tokens >= seen - 1, (turn, stop)
        assert client.responses.retrieve(r.id).id == r.id
        previous, seen = r.id, r.usage.input_tokens + r.usage.output_tokens


def test_a_function_tool_round_trip_through_responses_items(server):
    client = _client(server)
    call = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=60)
    [item] = [o for o in call.output if o.type == "function_call"]
    assert item.name == "get_weather" and item.call_id
    answer = client.responses.create(model="tiny", previous_response_id=call.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": item.call_id,
                                             "output": "Sunny, 21 C."}], max_output_tokens=6)
    assert answer.usage.input_tokens_details.cached_tokens >= call.usage.input_tokens + call.usage.output_tokens - 1
    assert all(o.type != "function_call" for o in answer.output)


def test_another_api_keys_response_id_is_a_404_and_a_deleted_one_too(server):
    mine = _client(server).responses.create(model="tiny", input="Secret.", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        _client(server, KEYS[1]).responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        _client(server, KEYS[1]).responses.create(model="tiny", input="More.", previous_response_id=mine.id)
    _client(server).responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError, match="not stored here"):
        _client(server).responses.create(model="tiny", input="More.", previous_response_id=mine.id)


def test_fields_the_server_cannot_honour_are_refused_by_name(server):
    with pytest.raises(openai.BadRequestError, match="background"):
        _client(server).responses.create(model="tiny", input="x", background=True)
    with pytest.raises(openai.BadRequestError, match="file_search"):
        _client(server).responses.create(model="tiny", input="x", tools=[{"type": "file_search", "vector_store_ids": []}])


def test_the_openai_agents_sdks_default_responses_model_runs_a_tool_to_completion(server):
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city
        """
        calls.append(city)
        return f"Sunny in {city or 'the city'}."

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                               temperature=0.0),
                  tool_use_behavior="stop_on_first_tool")

    async def run():
        async with client:
            return await Runner.run(agent, "Weather in Oslo?", max_turns=3)

    result = asyncio.run(run())
    assert len(calls) == 1 and result.final_output.startswith("Sunny in ")
