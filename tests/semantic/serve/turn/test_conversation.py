"""Both APIs' tools, tool calls, tool results and output formats, mapped to the one form templates render."""

from __future__ import annotations

import pytest

from semantic.serve.anthropic import protocol as an
from semantic.serve.anthropic.messages import (
    anthropic_format,
    anthropic_messages,
    anthropic_tools,
    tool_definitions,
    tool_references,
)
from semantic.serve.openai.messages import openai_call, openai_tools, response_schema
from semantic.serve.errors import ApiError

pytestmark = pytest.mark.compat

FN = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _param(call) -> str:
    with pytest.raises(ApiError) as err:
        call()
    assert err.value.status_code == 400
    return err.value.param


def test_openai_tool_choices_map_and_refuse_what_cannot_be_honoured():
    assert openai_tools(None, None, None) is None
    assert openai_tools([FN], None, None).choice == "auto"
    assert openai_tools([FN], "required", False).choice == "required" and not openai_tools([FN], "required", False).parallel
    assert openai_tools([FN], {"type": "function", "function": {"name": "get_weather"}}, None).choice == "get_weather"
    assert _param(lambda: openai_tools([FN], {"type": "function", "function": {"name": "nope"}}, None)) == "tool_choice"
    assert _param(lambda: openai_tools([FN], "sometimes", None)) == "tool_choice"
    assert _param(lambda: openai_tools(None, "required", None)) == "tool_choice"
    assert _param(lambda: openai_tools([{"type": "web_search"}], None, None)) == "tools.0.type"
    assert _param(lambda: openai_tools([FN, FN], None, None)) == "tools"  # duplicate names


def test_anthropic_tools_and_choices_map_to_openais():
    tools = [{"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}]
    mapped = anthropic_tools(tools, {"type": "any", "disable_parallel_tool_use": True})
    assert (mapped.choice, mapped.parallel) == ("required", False)
    assert mapped.specs[0]["function"] == {"name": "get_weather", "description": "w", "parameters": {"type": "object"}}
    assert anthropic_tools(tools, {"type": "tool", "name": "get_weather"}).choice == "get_weather"
    assert anthropic_tools(tools, {"type": "none"}).choice == "none"
    assert _param(lambda: anthropic_tools([{"type": "web_search_20250305", "name": "web_search"}], None)) == "tools.0"
    assert _param(lambda: anthropic_tools(tools, {"type": "sometimes"})) == "tool_choice"


def test_response_formats_become_the_schema_the_reply_must_match():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_schema(None) is None and response_schema({"type": "text"}) is None
    assert response_schema({"type": "json_object"}) == {"type": "object"}
    assert response_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}) == schema
    assert _param(lambda: response_schema({"type": "json_schema", "json_schema": {"name": "x"}})) == \
        "response_format.json_schema.schema"
    assert _param(lambda: response_schema({"type": "grammar"})) == "response_format"


def test_an_openai_call_is_decoded_for_templates_and_bad_arguments_are_refused():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert openai_call(call, "m") == {"id": "c1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    bad = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
    assert _param(lambda: openai_call(bad, "messages.1.tool_calls.0")) == "messages.1.tool_calls.0.function.arguments"


def _msg(role, content):
    return an.Message(role=role, content=content)


def test_anthropic_tool_use_and_results_become_tool_calls_and_tool_messages():
    messages = [
        _msg("user", "Weather?"),
        _msg("assistant", [{"type": "text", "text": "Checking."},
                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]),
        _msg("user", [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sun"}]},
                      {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                      {"type": "text", "text": "Thanks"}]),
    ]
    assert anthropic_messages("Be brief.", messages, keep_billing_header=False) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sun"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "Thanks"},
    ]


def test_claude_codes_volatile_billing_block_is_dropped_unless_kept():
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.330; cch=9f1e;"},
              {"type": "text", "text": "You are Claude Code."}]
    blocks = [an.ContentBlock(**b) for b in system]
    assert anthropic_messages(blocks, [_msg("user", "hi")], keep_billing_header=False)[0] == \
        {"role": "system", "content": "You are Claude Code."}
    kept = anthropic_messages(blocks, [_msg("user", "hi")], keep_billing_header=True)[0]["content"]
    assert kept.startswith("x-anthropic-billing-header:") and kept.endswith("You are Claude Code.")


def test_anthropic_blocks_the_server_cannot_read_are_refused_by_name():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    assert _param(lambda: anthropic_messages(None, [_msg("user", [image])], False)) == "messages.0.content.0.type"
    assert _param(lambda: anthropic_messages(None, [_msg("tool", "x")], False)) == "messages.0.role"


SEARCH = {"name": "ToolSearch", "description": "find tools", "input_schema": {"type": "object", "properties": {}}}
FETCH = {"name": "WebFetch", "description": "fetch a page", "defer_loading": True,
         "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}},
         "input_examples": [{"url": "https://example.com"}]}


def test_a_deferred_tool_is_neither_listed_nor_callable_until_a_tool_reference_loads_it():
    before = anthropic_tools([SEARCH, FETCH], None)
    assert before.names == ["ToolSearch"] and before.inline == frozenset()
    loaded = [_msg("user", "Fetch it."),
              _msg("assistant", [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]),
              _msg("user", [{"type": "tool_result", "tool_use_id": "t1",
                             "content": [{"type": "tool_reference", "tool_name": "WebFetch"}]}])]
    refs = tool_references(loaded)
    assert refs == {"WebFetch"}
    after = anthropic_tools([SEARCH, FETCH], None, refs)
    assert after.names == ["ToolSearch", "WebFetch"] and after.inline == {"WebFetch"}
    assert [s["function"]["name"] for s in after.listed()] == ["ToolSearch"]  # the rendered list is unchanged
    assert "Input examples:" in after.specs[1]["function"]["description"]
    # the definition stands where the search loaded it
    result = anthropic_messages(None, loaded, False, tool_definitions([SEARCH, FETCH]))[-1]
    assert result["role"] == "tool" and result["content"].startswith("Tool loaded: {")
    assert '"name": "WebFetch"' in result["content"] and '"url"' in result["content"]
    # only deferred tools, none loaded: no tools at all (and a choice that needs one is refused)
    assert anthropic_tools([FETCH], None) is None
    assert _param(lambda: anthropic_tools([FETCH], {"type": "any"})) == "tool_choice"


def test_anthropic_output_format_is_a_json_schema_or_a_400_naming_where():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert anthropic_format({"type": "json_schema", "schema": schema}, "output_config.format") == schema
    assert anthropic_format(None, "output_format") is None
    assert _param(lambda: anthropic_format({"type": "xml"}, "output_config.format")) == "output_config.format"


def test_responses_items_become_messages_and_calls_join_the_assistant_text_before_them():
    from semantic.serve.responses.messages import responses_format, responses_input, responses_tools

    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sun"}]
    assert responses_input(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]
    assert responses_input("Hi") == [{"role": "user", "content": "Hi"}]
    assert _param(lambda: responses_input([{"type": "input_image", "image_url": "x"}])) == "input.0.type"
    assert _param(lambda: responses_input([{"role": "user", "content": [{"type": "input_file"}]}])) == \
        "input.0.content.0.type"
    flat = {"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}}
    assert responses_tools([flat], {"type": "function", "name": "get_weather"}, False).choice == "get_weather"
    assert _param(lambda: responses_tools([{"type": "file_search"}], None, None)) == "tools.0.type"
    assert responses_tools([{"type": "web_search"}], None, None) is None  # hosted: left out (a header says so)
    space = {"type": "namespace", "name": "agents", "tools": [{**flat, "name": "spawn"}, {"type": "web_search"}]}
    assert _param(lambda: responses_tools([space], None, None)) == "tools.0.tools.1.type"
    assert responses_format({"type": "json_schema", "name": "f", "schema": {"type": "object"}}) == {"type": "object"}
    assert responses_format({"type": "text"}) is None
