"""The one conversation form every API's messages become, and the tools in it.

One message form (OpenAI's, as chat templates expect it)::

    {"role": "system" | "user" | "assistant" | "tool", "content": str | None,
     "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": {...}}}],   (assistant)
     "tool_call_id": str, "name": str}                                                        (tool)

Call arguments are decoded JSON (templates render them with ``tojson``).
Each API's folder turns its own messages, tools and output formats into this
form (``openai.messages``, ``anthropic.messages``, ``responses.messages``);
anything that cannot be honoured is a 400 naming the field.
"""

from __future__ import annotations

from semantic.service import Tools
from semantic.serve.errors import invalid


def tool_spec(f: dict, where: str) -> dict:
    params = f.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    return {"type": "function", "function": {"name": tool_name(f.get("name"), f"{where}.name"),
                                             "description": f.get("description") or "", "parameters": params}}


def tool_name(name, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise invalid(f"{where} must be a non-empty tool name", where)
    return name


def tools_of(specs: list[dict], choice: str, parallel: bool | None, inline: frozenset[str] = frozenset()) -> Tools:
    try:
        return Tools(tuple(specs), choice, True if parallel is None else bool(parallel), inline)
    except ValueError as exc:  # InvalidRequestError: a duplicate name, a choice naming no tool
        raise invalid(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None
