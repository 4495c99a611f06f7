"""Tool calls: how a model writes them, the grammar that makes it write one, and reading them back.

A model either has a native format, which mlx-lm sniffs from its chat template
when it loads (``tokenizer.tool_parser``, ``tool_call_start`` / ``_end``:
Hermes/Qwen ``<tool_call>{json}</tool_call>``, Mistral ``[TOOL_CALLS][...]``
and the others under ``mlx_lm.tool_parsers``), or it has none (SmolLM2,
Gemma 3). Then ours, the generic format (llama.cpp's idea): the tools are
described in a system note and a call is one JSON object::

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    {"tool_calls": [{"name": ..., "arguments": ...}, ...]}          (parallel calls)

What the request allows decides the grammar (``semantic.decode.constraint``)::

    choice      native format                      generic format
    auto        free; calls parsed from the text   a call, or an answer that does not start with "{"
    required    a call in the native format*        a call
    <name>      that tool, native format*          that tool
    none        free; the text stops at a call     an answer that does not start with "{"
    * Hermes/Qwen and Mistral; other native formats are held to the generic call, read back as such.

Arguments always match the tool's JSON schema under a grammar.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Callable

from semantic import compat
from semantic.decode.constraint import Grammar
from semantic.errors import InvalidRequestError

GENERIC = "generic"
NATIVE_GRAMMARS = ("json_tools", "mistral")  # native formats whose calls we can also write as a grammar
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANSWER = r"/[^{\s][\s\S]*/"  # a plain answer: anything that does not open like a generic call


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model writes a call: markers around it in its text, and mlx-lm's parser for what is between."""

    name: str                                   # an mlx_lm.tool_parsers module, or GENERIC
    start: str | None = None
    end: str | None = None
    parse: Callable | None = field(default=None, repr=False)  # parse_tool_call(text, tools) -> dict | [dict]

    @property
    def native(self) -> bool:
        return self.name != GENERIC


def sniff(tokenizer, override: str | None = None) -> ToolFormat:
    """The model's tool format: ``override`` (a parser name, or "generic"), else what mlx-lm sniffed
    from the chat template at load, else the generic format.

    Raises:
        ValueError: ``override`` names no parser this mlx-lm has.
    """
    if override == GENERIC:
        return ToolFormat(GENERIC)
    if override is not None:
        if override not in compat.tool_parser_names():
            raise ValueError(f"unknown tool parser {override!r}: choose one of {', '.join(compat.tool_parser_names())}"
                             f" or {GENERIC!r}")
        module = importlib.import_module(f"mlx_lm.tool_parsers.{override}")
        return ToolFormat(override, module.tool_call_start, module.tool_call_end or None, module.parse_tool_call)
    if getattr(tokenizer, "has_tool_calling", False):
        name = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type") or _name_of(tokenizer.tool_parser)
        return ToolFormat(name, tokenizer.tool_call_start, tokenizer.tool_call_end or None, tokenizer.tool_parser)
    return ToolFormat(GENERIC)


def _name_of(parse: Callable) -> str:
    return getattr(parse, "__module__", "").rsplit(".", 1)[-1] or "native"


@dataclass(frozen=True, slots=True)
class Tools:
    """What a request offers: the tools (OpenAI function specs) and how the model may use them."""

    specs: tuple[dict, ...]     # {"type": "function", "function": {"name", "description", "parameters"}}
    choice: str = "auto"        # "auto", "none", "required", or a tool's name
    parallel: bool = True
    # tools whose definitions the conversation carries where they were loaded (a tool search's result):
    # callable, but left out of the template's list, so the rendered prefix stays the same
    inline: frozenset[str] = frozenset()

    def __post_init__(self):
        names = [s["function"]["name"] for s in self.specs]
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"tool names must be unique, got {names}")
        assert self.inline <= set(names)
        if self.choice not in ("auto", "none", "required") and self.choice not in names:
            raise InvalidRequestError(f"tool_choice names {self.choice!r}, which is not among the tools {names}")

    @property
    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.specs]

    def listed(self) -> tuple[dict, ...]:
        """The tools the template lists (all but the ``inline`` ones)."""
        return tuple(s for s in self.specs if s["function"]["name"] not in self.inline)

    def offered(self) -> tuple[dict, ...]:
        """The tools a call may name: one for a named choice, else all."""
        if self.choice in ("auto", "none", "required"):
            return self.specs
        return tuple(s for s in self.specs if s["function"]["name"] == self.choice)


def _call_schema(spec: dict) -> dict:
    f = spec["function"]
    params = f.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _generic_schema(tools: Tools) -> dict:
    one = {"anyOf": [_call_schema(s) for s in tools.offered()]}
    if tools.parallel:
        body = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
                "required": ["tool_calls"], "additionalProperties": False}
        body = {"anyOf": [body, {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"],
                                 "additionalProperties": False}]}
    else:
        body = {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"],
                "additionalProperties": False}
    return {**body, "x-guidance": _LAYOUT}


@dataclass(frozen=True, slots=True)
class ToolReading:
    """How a request's reply is read: which format its calls come in, and what the grammar allows."""

    format: ToolFormat
    tools: Tools
    grammar: Grammar | None
    stop_at_call: bool = False  # choice "none" on a native format: the text ends where a call would start

    @property
    def reads_calls(self) -> bool:
        return self.tools.choice != "none"


def reading(tools: Tools, fmt: ToolFormat, tokenizer) -> ToolReading:
    """The grammar and the reading for ``tools`` on a model whose native format is ``fmt`` (module doc)."""
    if tools.choice == "none":
        if fmt.native:
            return ToolReading(fmt, tools, None, stop_at_call=True)
        return ToolReading(fmt, tools, Grammar.lark(f"start: {_ANSWER}", "answer grammar"))
    if tools.choice == "auto":
        if fmt.native:
            return ToolReading(fmt, tools, None)
        lark = f"start: call | answer\ncall: %json {json.dumps(_generic_schema(tools))}\nanswer: {_ANSWER}"
        return ToolReading(fmt, tools, Grammar.lark(lark, "tool call grammar"))
    if fmt.name in NATIVE_GRAMMARS:
        return ToolReading(fmt, tools, Grammar.lark(_native_lark(tools, fmt, tokenizer), "tool call grammar"))
    generic = ToolFormat(GENERIC)
    return ToolReading(generic, tools, Grammar.json_schema(_generic_schema(tools), "tool call grammar"))


def _marker(text: str, tokenizer) -> str:
    """A marker as a Lark terminal: its special token when it is one, else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def _native_lark(tools: Tools, fmt: ToolFormat, tokenizer) -> str:
    one = json.dumps({"anyOf": [_call_schema(s) for s in tools.offered()], "x-guidance": _LAYOUT})
    start = _marker(fmt.start, tokenizer)
    if fmt.name == "json_tools":
        end = _marker(fmt.end, tokenizer)
        many = "+" if tools.parallel else ""
        return f'start: call{many}\ncall: {start} "\\n" %json {one} "\\n" {end}'
    # mistral: [TOOL_CALLS] then a JSON list of calls
    items = {"type": "array", "items": json.loads(one), "minItems": 1, "x-guidance": _LAYOUT}
    if not tools.parallel:
        items["maxItems"] = 1
    return f"start: {start} %json {json.dumps(items)}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: an id for the client to answer it by, the tool's name, its arguments."""

    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def read_calls(text: str, reading: ToolReading) -> list[dict]:
    """The calls in ``text`` (between a native format's markers, or a whole generic reply), as
    ``{"name", "arguments": dict}``; raises ValueError when it holds none that parse."""
    if not reading.format.native:
        return parse_generic(text)
    parsed = reading.format.parse(text, list(reading.tools.specs))
    calls = []
    for c in parsed if isinstance(parsed, list) else [parsed]:
        args = c.get("arguments", {}) if isinstance(c, dict) else None
        if isinstance(args, str):
            args = json.loads(args or "{}")
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(args, dict)):
            raise ValueError(f"not a tool call: {text[:200]}")
        calls.append({"name": c["name"], "arguments": args})
    return calls


def parse_generic(text: str) -> list[dict]:
    """The calls in a generic-format reply (its JSON object); raises ValueError if it is not one."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("a generic tool call is a JSON object")
    calls = doc.get("tool_calls") if "tool_calls" in doc else [doc.get("tool_call")]
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise ValueError(f"not a tool call: {text[:200]}")
    return [{"name": c["name"], "arguments": c.get("arguments") or {}} for c in calls]


def describe(tools: Tools) -> str:
    """The system note that offers ``tools`` to a model with no native format."""
    lines = ["You can call these tools. To call one, reply with only a JSON object, exactly",
             '{"tool_call": {"name": <tool name>, "arguments": <its arguments>}}',
             "and nothing else. Otherwise reply normally. Tools:"]
    for s in tools.listed():
        f = s["function"]
        lines.append(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                 "parameters": f.get("parameters") or {"type": "object", "properties": {}}}))
    return "\n".join(lines)


def generic_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """A conversation with tool calls and results, for a template that knows neither: calls as the JSON
    the model wrote, results as user turns, and the tools described in the system turn."""
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            body = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
            text = (m.get("content") or "") + json.dumps(body)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            text = f"Tool result ({m.get('name') or m.get('tool_call_id') or 'tool'}): {m.get('content') or ''}"
            if out and out[-1]["role"] == "user":  # results of parallel calls share one user turn
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    if tools is not None:  # also under "none": the system turn, and so every cached prefix, stays the same
        note = describe(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out
