"""A thinking model on a real ``semantic serve``: its reasoning apart from its content on both APIs, and its
history a cache hit although the template drops old reasoning.

The tiny thinking model (``write_tiny_tool_llama(..., "think")``): ``<think>`` / ``</think>`` special tokens
(mlx-lm finds them), a template whose generation prompt opens a think block and whose history keeps only
the text after ``</think>``. Its random weights rarely close the block, so most of a reply is reasoning.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from harness.models.tiny import write_tiny_tool_llama
from tests.serve_helpers import Server

ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_tiny_tool_llama(tmp_path_factory.mktemp("tiny-think"), "think")
    started: dict[str, Server] = {}
    try:
        for name, args in (("echo", []), ("no_echo", ["--no-echo-history"])):
            started[name] = Server(model, tmp_path_factory.mktemp(f"serve-think-{name}") / "agents",
                                   ["--pool-mb", "64", *args]).start()
        yield started
    finally:
        for s in started.values():
            assert s.stop_cleanly(), s.log()


def _oa(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_openai_reasoning_comes_apart_from_content_and_the_stream_splits_it_the_same(servers):
    client = _oa(servers["echo"])
    whole = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24)
    message = whole.choices[0].message
    reasoning = message.model_extra.get("reasoning_content") or ""
    assert reasoning and message.model_extra.get("reasoning") == reasoning  # the reply opens inside <think>
    assert "<think>" not in reasoning + (message.content or "") and "</think>" not in reasoning + (message.content or "")
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content or "")


def test_anthropic_shows_thinking_blocks_only_when_the_request_turns_thinking_on(servers):
    client = anthropic.Anthropic(base_url=servers["echo"].url, api_key="x", max_retries=0, timeout=60)
    on = client.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body={"thinking": {"type": "adaptive"}})
    assert on.content[0].type == "thinking" and on.content[0].thinking and on.content[0].signature
    off = client.messages.create(model="tiny", max_tokens=24, messages=ASK)
    assert all(b.type != "thinking" for b in off.content)
    with client.messages.stream(model="tiny", max_tokens=24, messages=ASK,
                                extra_body={"thinking": {"type": "adaptive"}}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == on.content[0].thinking
    assert final.content[0].signature == on.content[0].signature


def test_a_thinking_models_history_stays_a_cache_hit_although_its_template_drops_old_reasoning(servers):
    turns = {}
    for name in ("echo", "no_echo"):
        client = _oa(servers[name])
        first = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=16, user="thinker")
        history = ASK + [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": "And at sunset?"}]
        second = client.chat.completions.create(model="tiny", messages=history, max_tokens=4, user="thinker")
        turns[name] = (first.usage, second.usage)
    (first, second), (_, rendered) = turns["echo"], turns["no_echo"]
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens + first.completion_tokens - 1
    # rendered again, the reply loses its reasoning: the cache is cut where the reasoning began
    assert rendered.prompt_tokens_details.cached_tokens < first.prompt_tokens


def test_a_responses_reply_of_a_thinking_model_is_a_reasoning_item_and_its_tokens_are_counted(servers):
    r = _oa(servers["echo"]).responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=24,
                                              store=False)
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning" and r.output[0].content[0].text
    details = r.usage.output_tokens_details.reasoning_tokens
    assert 1 <= details <= r.usage.output_tokens
    if r.output_text == "":  # the think block never closed: every generated token was reasoning
        assert details == r.usage.output_tokens
