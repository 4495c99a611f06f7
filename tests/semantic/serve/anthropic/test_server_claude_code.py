"""What Claude Code sends, on a real ``semantic serve``: a budget past the context, system turns inside the
conversation (on a template that renders them there, and on Gemma's, which refuses them), and its fields.

Tiny random-weight models with the byte tokenizer: one under the ChatML-like template that renders a
system turn anywhere, one under Gemma 3's template (user/model alternation enforced).
"""

from __future__ import annotations

import json
from importlib import resources

import anthropic
import openai
import pytest

from harness.models.tiny import write_tiny_llama
from tests.serve_helpers import Server

CONTEXT = 512


def _gemma_templated(path):
    """The tiny llama under Gemma 3's own chat template (as the prepared Gemma 3 270M has it)."""
    write_tiny_llama(path)
    config = path / "tokenizer_config.json"
    doc = json.loads(config.read_text())
    doc["chat_template"] = resources.files("harness.models").joinpath("chat_templates/gemma3.jinja").read_text()
    config.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    dirs = {"free": write_tiny_llama(tmp_path_factory.mktemp("tiny-free")),
            "gemma": _gemma_templated(tmp_path_factory.mktemp("tiny-gemma"))}
    started: dict[str, Server] = {}
    try:
        for name, args in (("free", []), ("gemma", []), ("strict", ["--strict-max-tokens"])):
            started[name] = Server(dirs["gemma" if name == "gemma" else "free"],
                                   tmp_path_factory.mktemp(f"serve-{name}") / "agents",
                                   ["--pool-mb", "64", "--max-context", str(CONTEXT), *args]).start()
        yield started
    finally:
        for s in started.values():
            assert s.stop_cleanly(), s.log()


def _an(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def _oa(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_claude_codes_32000_token_budget_is_cut_to_the_context_and_said_in_a_header(servers):
    raw = _an(servers["free"]).messages.with_raw_response.create(
        model="tiny", max_tokens=32000, messages=[{"role": "user", "content": "Say hi."}])
    reply = raw.parse()
    budget = int(raw.headers["x-max-tokens-clamped"])
    assert budget == CONTEXT - reply.usage.input_tokens - reply.usage.cache_read_input_tokens
    assert reply.usage.output_tokens <= budget
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert (reply.stop_reason == "max_tokens") == (reply.usage.output_tokens == budget)
    with _oa(servers["free"]).chat.completions.with_streaming_response.create(
            model="tiny", max_completion_tokens=10_000, stream=True,
            messages=[{"role": "user", "content": "Say hi."}]) as streamed:
        assert int(streamed.headers["x-max-tokens-clamped"]) < CONTEXT
        assert any(line.startswith("data: [DONE]") for line in streamed.iter_lines())


def test_under_strict_max_tokens_the_same_budget_is_a_400(servers):
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        _an(servers["strict"]).messages.create(model="tiny", max_tokens=32000,
                                               messages=[{"role": "user", "content": "Say hi."}])
    with pytest.raises(openai.BadRequestError) as err:
        _oa(servers["strict"]).chat.completions.create(model="tiny", max_tokens=10_000,
                                                       messages=[{"role": "user", "content": "Say hi."}])
    assert err.value.code == "context_length_exceeded"


@pytest.mark.parametrize("template", ["free", "gemma"])
def test_a_system_turn_inside_the_conversation_is_accepted_and_the_next_turn_reads_the_first_from_cache(
        servers, template):
    """Claude Code's shape: the environment as a system turn after the first user turn, then a tool-less
    follow-up; on both templates the second request finds the whole first prompt and reply in the cache."""
    client, agent = _an(servers[template]), {"user_id": f"cc-{template}"}
    first = [{"role": "user", "content": [{"type": "text", "text": "Read greet.py."}]},
             {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp/repo"}]}]
    one = client.messages.create(model="tiny", max_tokens=8, system="You are a coding agent.", metadata=agent,
                                 messages=first)
    assert one.stop_reason in ("max_tokens", "end_turn")
    seen = one.usage.input_tokens + one.usage.cache_read_input_tokens
    two = client.messages.create(model="tiny", max_tokens=8, system="You are a coding agent.", metadata=agent,
                                 messages=first + [{"role": "assistant", "content": one.content[0].text or "ok"},
                                                   {"role": "system", "content": "The user is waiting."},
                                                   {"role": "user", "content": "Now run it."}])
    assert two.usage.cache_read_input_tokens >= seen  # the first prompt and its reply were not rendered anew


def test_openai_developer_turns_inside_the_conversation_are_accepted_on_gemmas_template(servers):
    client = _oa(servers["gemma"])
    messages = [{"role": "user", "content": "Hi."}, {"role": "developer", "content": "Answer briefly."}]
    one = client.chat.completions.create(model="tiny", max_tokens=6, messages=messages, prompt_cache_key="dev")
    two = client.chat.completions.create(
        model="tiny", max_tokens=6, prompt_cache_key="dev",
        messages=messages + [{"role": "assistant", "content": one.choices[0].message.content or "ok"},
                             {"role": "developer", "content": "Be polite."}, {"role": "user", "content": "More."}])
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens


def test_claude_codes_fields_are_accepted_and_an_unknown_one_is_named(servers):
    client = _an(servers["free"])
    reply = client.messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi."}],
        extra_body={"thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
        extra_headers={"anthropic-beta": "context-management-2025-06-27,effort-2025-11-24"})
    assert reply.content
    with pytest.raises(anthropic.BadRequestError, match="context_managment"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi."}],
                               extra_body={"context_managment": {}})
