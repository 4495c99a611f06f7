"""Anthropic's messages, tools and output format in the one conversation form (``turn.conversation``).

Its ``tool_use`` blocks become an assistant's ``tool_calls`` and its
``tool_result`` blocks become ``tool`` messages; its tools and
``tool_choice`` map to OpenAI's.
"""

from __future__ import annotations

import json

from semantic.service import Tools
from semantic.serve.errors import invalid
from semantic.serve.turn.conversation import tool_name, tool_spec, tools_of


BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block: it changes on every request


def anthropic_tools(tools: list | None, choice: dict | None, loaded: frozenset[str] = frozenset()) -> Tools | None:
    """Anthropic's ``tools`` / ``tool_choice`` (auto, any, tool, none; ``disable_parallel_tool_use``).

    A ``defer_loading`` tool waits behind the client's tool search: it is
    neither listed nor callable until a ``tool_reference`` in the conversation
    (``loaded``) brings it in, and then its definition stands where it was
    loaded (:func:`anthropic_messages`), so the rendered prefix does not change.
    """
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    mode = _anthropic_choice(choice)
    specs, inline = [], set()
    for i, t in enumerate(tools or ()):
        kind = t.get("type", "custom") if isinstance(t, dict) else None
        if kind not in ("custom", None) or not isinstance(t, dict) or "input_schema" not in t:
            raise invalid(f"tools[{i}] is a {kind!r} tool; this server calls custom tools (name, input_schema) only",
                          f"tools.{i}")
        name = tool_name(t.get("name"), f"tools.{i}.name")
        if t.get("defer_loading"):
            if name not in loaded:
                continue
            inline.add(name)
        specs.append(tool_spec({"name": name, "description": _described(t), "parameters": t["input_schema"]}, f"tools.{i}"))
    if not specs:
        if mode not in ("auto", "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    return tools_of(specs, mode, parallel, frozenset(inline))


def _anthropic_choice(choice: dict | None) -> str:
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return tool_name(choice.get("name"), "tool_choice.name")
    raise invalid(f"tool_choice {choice!r} is not one of auto, any, tool or none"[:200], "tool_choice")


def _described(tool: dict) -> str:
    """A tool's description, its ``input_examples`` appended (Anthropic shows them to the model too)."""
    text = tool.get("description") or ""
    examples = tool.get("input_examples")
    if isinstance(examples, list) and examples:
        text += "\n\nInput examples:\n" + "\n".join(json.dumps(e, sort_keys=True) for e in examples)
    return text


def tool_references(messages: list) -> frozenset[str]:
    """The tools a ``tool_reference`` block in a ``tool_result`` loads (a client's tool search)."""
    names = set()
    for m in messages:
        for b in m.content if m.role == "user" and isinstance(m.content, list) else ():
            if b.type == "tool_result" and isinstance(b.content, list):
                names.update(r.tool_name for r in b.content if r.type == "tool_reference" and r.tool_name)
    return frozenset(names)


def tool_definitions(tools: list | None) -> dict[str, dict]:
    """Each Anthropic tool's definition by name, as a loaded tool's ``tool_reference`` renders it."""
    return {t["name"]: {"name": t["name"], "description": _described(t), "input_schema": t.get("input_schema")}
            for t in tools or () if isinstance(t, dict) and isinstance(t.get("name"), str)}


def anthropic_format(fmt, where: str) -> dict | None:
    """Anthropic's ``output_config.format`` (``{"type": "json_schema", "schema"}``) as the reply's schema."""
    if fmt is None:
        return None
    schema = fmt.get("schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be {{'type': 'json_schema', 'schema': {{...}}}}", where)
    return schema


def anthropic_messages(system, messages: list, keep_billing_header: bool,
                       definitions: dict[str, dict] | None = None) -> list[dict]:
    """Anthropic's system and messages in the one form (module doc); a ``tool_reference`` in a tool
    result becomes the loaded tool's definition (from ``definitions``, :func:`tool_definitions`)."""
    out: list[dict] = []
    blocks = system if isinstance(system, list) else [system] if system else []
    texts = []
    for j, b in enumerate(blocks):
        text = b if isinstance(b, str) else _text_block(b, f"system.{j}")
        if not keep_billing_header and text.startswith(BILLING_HEADER):
            continue  # volatile: it would make every local prefix cache miss from the first token
        texts.append(text)
    if texts:
        out.append({"role": "system", "content": "\n".join(texts)})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.role == "system":  # sent inside messages by some clients: a system turn where it stands
            out.append({"role": "system", "content": _flat_text(m.content, f"{where}.content")})
        elif m.role == "user":
            out.extend(_user_turn(m.content, where, definitions or {}))
        elif m.role == "assistant":
            out.append(_assistant_turn(m.content, where))
        else:
            raise invalid(f"messages[{i}].role {m.role!r} is not supported: use user or assistant", f"{where}.role")
    return out


def _user_turn(content, where: str, definitions: dict[str, dict]) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, text = [], []
    for j, b in enumerate(content):
        if b.type == "tool_result":
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            result = b.content if isinstance(b.content, str) else _result_text(b.content or [], f"{where}.content.{j}.content",
                                                                                definitions)
            if b.is_error:
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": b.tool_use_id or "", "content": result})
        else:
            text.append(_text_block(b, f"{where}.content.{j}"))
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _assistant_turn(content, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, calls = [], []
    for j, b in enumerate(content):
        if b.type == "tool_use":
            if not isinstance(b.input, dict):
                raise invalid(f"{where}.content.{j}.input must be an object", f"{where}.content.{j}.input")
            calls.append({"id": b.id or "", "type": "function",
                          "function": {"name": tool_name(b.name, f"{where}.content.{j}.name"), "arguments": b.input}})
        elif b.type in ("thinking", "redacted_thinking"):
            continue  # the model's own earlier reasoning: not rendered back
        else:
            text.append(_text_block(b, f"{where}.content.{j}"))
    message = {"role": "assistant", "content": "\n".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _result_text(blocks: list, where: str, definitions: dict[str, dict]) -> str:
    """A tool result's blocks as text: a ``tool_reference`` as the definition of the tool it loads."""
    parts = []
    for j, b in enumerate(blocks):
        if b.type == "tool_reference":
            known = definitions.get(b.tool_name or "")
            parts.append(f"Tool loaded: {json.dumps(known, sort_keys=True)}" if known is not None
                         else f"Tool loaded: {b.tool_name} (not among this request's tools)")
        else:
            parts.append(_text_block(b, f"{where}.{j}"))
    return "\n".join(parts)


def _flat_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_text_block(b, f"{where}.{j}") for j, b in enumerate(content))


def _text_block(block, where: str) -> str:
    kind = getattr(block, "type", None) if not isinstance(block, dict) else block.get("type")
    text = getattr(block, "text", None) if not isinstance(block, dict) else block.get("text")
    if kind != "text" or text is None:
        raise invalid(f"{where} is a {kind!r} block; this server reads text, tool_use and tool_result blocks",
                      f"{where}.type")
    return text
