"""OpenAI's tool calls, tools and ``response_format`` in the one conversation form (``turn.conversation``)."""

from __future__ import annotations

import json

from semantic.service import Tools
from semantic.serve.errors import invalid
from semantic.serve.turn.conversation import tool_name, tool_spec, tools_of


def openai_tools(tools: list | None, choice, parallel: bool | None, where: str = "tools") -> Tools | None:
    """OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as :class:`Tools` (None: no tools)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    specs = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise invalid(f"{where}[{i}] is a {kind!r} tool; this server calls function tools only", f"{where}.{i}.type")
        specs.append(tool_spec(t["function"], f"{where}.{i}.function"))
    return tools_of(specs, _openai_choice(choice), parallel)


def _openai_choice(choice) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return tool_name(choice["function"].get("name"), "tool_choice.function.name")
    raise invalid(f"tool_choice {choice!r} is not one of auto, none, required or a named function"[:200], "tool_choice")


def response_schema(fmt) -> dict | None:
    """OpenAI's ``response_format`` as the JSON schema the reply must match (None: free text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema must be a JSON schema object",
                          "response_format.json_schema.schema")
        return schema
    raise invalid(f"response_format type {kind!r} is not one of text, json_object, json_schema", "response_format")


def openai_call(call, where: str) -> dict:
    """An assistant's tool call as templates want it: arguments decoded from their JSON text."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise invalid(f"{where} must be a function call", where)
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise invalid(f"{where}.function.arguments is not JSON", f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise invalid(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {"id": call.get("id") or "", "type": "function",
            "function": {"name": tool_name(fn.get("name"), f"{where}.function.name"), "arguments": args}}
