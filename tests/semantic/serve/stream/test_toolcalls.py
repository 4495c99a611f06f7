"""Tool calls out of streamed text: mlx-lm's parsers behind our splitter, and no marker ever in the content.

The chunking fuzz feeds each reply in every way two cut points can split it
(so every marker is split across chunk boundaries at every position) and
checks that the content is exactly the text outside the calls, that no chunk
of content holds any piece of a marker, and that the calls are the same.
"""

from __future__ import annotations

import itertools

import pytest

from semantic import compat
from semantic.service import ToolReading, Tools
from semantic.serve.stream.toolcalls import CallSplitter
from semantic.chat.toolformat import GENERIC, ToolFormat, sniff

pytestmark = pytest.mark.compat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MULTIPLY = {"type": "function", "function": {"name": "multiply", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
TOOLS = Tools((WEATHER, MULTIPLY))


def _reading(name: str, tools: Tools = TOOLS) -> ToolReading:
    return ToolReading(sniff(None, override=name), tools, None)


def _feed(splitter: CallSplitter, chunks: list[str]) -> tuple[list[str], list]:
    content, calls = [], []
    for chunk in chunks:
        text, done = splitter.feed(chunk)
        content.append(text)
        calls += done
    text, done = splitter.finish()
    return content + [text], calls + done


def _splits(text: str):
    """Every way to cut ``text`` into three chunks (two cut points), and whole."""
    yield [text]
    for i, j in itertools.combinations(range(1, len(text)), 2):
        yield [text[:i], text[i:j], text[j:]]


def _assert_clean(reading: ToolReading, reply: str, content: str, calls: list[tuple[str, dict]]):
    markers = [m for m in (reading.format.start, reading.format.end) if m]
    for chunks in _splits(reply):
        pieces, got = _feed(CallSplitter(reading), chunks)
        assert "".join(pieces) == content
        for piece in pieces:  # no chunk of content holds any part of a marker's text
            for m in markers:
                assert all(m[:n] not in piece for n in range(2, len(m) + 1)), (chunks, piece)
        assert [(c.name, c.arguments) for c in got] == calls


def test_hermes_calls_leave_the_content_and_parse_with_mlx_lms_parser():
    reply = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>Done.'
    _assert_clean(_reading("json_tools"), reply, "Let me look.Done.", [("get_weather", {"city": "Oslo"})])


def test_two_hermes_calls_in_a_row_are_two_calls_with_their_own_ids():
    reply = ('<tool_call>\n{"name": "multiply", "arguments": {"a": 12234585, "b": 48838483920}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>')
    _assert_clean(_reading("json_tools"), reply, "\n",
                  [("multiply", {"a": 12234585, "b": 48838483920}), ("get_weather", {"city": "Lima"})])
    _, calls = _feed(CallSplitter(_reading("json_tools"), "toolu_"), [reply])
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("toolu_") for c in calls)


def test_one_call_only_when_parallel_calls_are_off():
    reply = ('<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
             '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    _, calls = _feed(CallSplitter(_reading("json_tools", Tools((MULTIPLY,), parallel=False))), [reply])
    assert [c.arguments for c in calls] == [{"a": 1, "b": 2}]


def test_text_that_only_looks_like_a_marker_is_released_whole():
    reply = "a <tool is not a call, nor is a reply that ends in <tool_call"
    pieces, calls = _feed(CallSplitter(_reading("json_tools")), [reply[:10], reply[10:]])
    assert pieces[-1] == "<tool_call" and "".join(pieces) == reply and calls == []  # held back, then released


def test_a_complete_call_that_does_not_parse_is_kept_as_text_and_a_cut_one_is_dropped():
    broken = "x<tool_call>\nnot json\n</tool_call>y"
    pieces, calls = _feed(CallSplitter(_reading("json_tools")), [broken])
    assert "".join(pieces) == broken and calls == []
    cut = 'x<tool_call>\n{"name": "multiply", "arguments": {"a": 1'
    pieces, calls = _feed(CallSplitter(_reading("json_tools")), [cut])
    assert "".join(pieces) == "x" and calls == []


@pytest.mark.skipif("mistral" not in compat.tool_parser_names(), reason="this mlx-lm has no Mistral parser")
def test_a_mistral_call_runs_to_the_end_of_the_reply():
    reply = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    _assert_clean(_reading("mistral"), reply, "Sure.", [("get_weather", {"city": "Rome"})])


def test_qwen3_coder_and_function_gemma_formats_parse_through_mlx_lm():
    coder = ("<tool_call>\n<function=multiply>\n<parameter=a>\n12234585\n</parameter>\n<parameter=b>\n48838483920\n"
             "</parameter>\n</function>\n</tool_call>")
    _assert_clean(_reading("qwen3_coder"), coder, "", [("multiply", {"a": 12234585, "b": 48838483920})])
    fmt = sniff(None, override="function_gemma")
    gemma = f"{fmt.start}call:get_weather{{city:<escape>London<escape>}}{fmt.end}"
    _, calls = _feed(CallSplitter(ToolReading(fmt, TOOLS, None)), [gemma])
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "London"})]


def test_a_generic_reply_is_a_call_when_it_opens_with_a_brace_and_content_otherwise():
    reading = ToolReading(ToolFormat(GENERIC), TOOLS, None)
    one = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
    _assert_clean(reading, one, "", [("get_weather", {"city": "Oslo"})])
    many = '  {"tool_calls": [{"name": "multiply", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {}}]}'
    _, calls = _feed(CallSplitter(reading), [many[:7], many[7:]])
    assert [c.name for c in calls] == ["multiply", "get_weather"]
    _assert_clean(reading, "It is sunny {really}.", "It is sunny {really}.", [])
