"""The Responses API's input items, tools and text format in the one conversation form (``turn.conversation``)."""

from __future__ import annotations

import json

from semantic.service import Tools
from semantic.serve.errors import invalid
from semantic.serve.openai.messages import openai_tools, response_schema
from semantic.serve.turn.conversation import tool_name


HOSTED_TOOLS = ("web_search", "web_search_preview")  # run by OpenAI's servers; none runs here


def hosted_tools(tools: list | None) -> list[str]:
    """The hosted tools a request offers, which this server leaves out (it says so in a header)."""
    return [t["type"] for t in tools or () if isinstance(t, dict) and t.get("type") in HOSTED_TOOLS]


def responses_tools(tools: list | None, choice, parallel: bool | None) -> Tools | None:
    """The Responses API's flat function tools and ``tool_choice`` as :class:`Tools`: a ``namespace``'s
    functions join them (the namespace goes back on the call, ``namespace_of``); hosted tools are left out."""
    nested = []
    for i, t in enumerate(tools or ()):
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        if kind in HOSTED_TOOLS:
            continue
        members = t.get("tools") if kind == "namespace" and isinstance(t.get("tools"), list) else [t]
        for j, f in enumerate(members):
            where = f"tools.{i}" + (f".tools.{j}" if kind == "namespace" else "")
            if not isinstance(f, dict) or f.get("type") != "function":
                raise invalid(f"{where} is a {f.get('type') if isinstance(f, dict) else f!r} tool; this server calls "
                              "function tools (and namespaces of them) only", f"{where}.type")
            nested.append({"type": "function", "function": {k: f.get(k) for k in ("name", "description", "parameters")}})
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return openai_tools(nested, choice, parallel)


def namespace_of(tools: list | None) -> dict[str, str]:
    """Each namespaced function's namespace, by function name."""
    return {f["name"]: t["name"] for t in tools or () if isinstance(t, dict) and t.get("type") == "namespace"
            for f in t.get("tools") or () if isinstance(f, dict) and isinstance(f.get("name"), str)}


def responses_format(fmt) -> dict | None:
    """``text.format`` as the reply's JSON schema (None: free text)."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return response_schema({"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}})
    return response_schema(fmt)


def responses_input(items) -> list[dict]:
    """The Responses API's ``input`` (text, or message / function_call / function_call_output items) as
    messages; ``reasoning`` items are the model's own earlier thoughts and are not rendered back."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _parts_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            try:
                arguments = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError:
                raise invalid(f"{where}.arguments is not JSON", f"{where}.arguments") from None
            call = {"id": item.get("call_id") or "", "type": "function",
                    "function": {"name": tool_name(item.get("name"), f"{where}.name"), "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":  # calls that follow the assistant's text are its calls
                out[-1].setdefault("tool_calls", []).append(call)
                out[-1]["content"] = out[-1]["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                        "content": output if isinstance(output, str) else _parts_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise invalid(f"{where} is a {kind!r} item; this server reads message, function_call, "
                          "function_call_output and reasoning items", f"{where}.type")
    return out


def _parts_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be text or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}] is a {kind!r} part; this server reads text parts only", f"{where}.{j}.type")
        texts.append(part["text"])
    return "\n".join(texts)
