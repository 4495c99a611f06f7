"""Both APIs' conversations, tools and output formats, in the one form the engine renders.

One message form (OpenAI's, as chat templates expect it)::

    {"role": "system" | "user" | "assistant" | "tool", "content": str | None,
     "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": {...}}}],   (assistant)
     "tool_call_id": str, "name": str}                                                        (tool)

Call arguments are decoded JSON (templates render them with ``tojson``).
Anthropic's ``tool_use`` blocks become an assistant's ``tool_calls`` and its
``tool_result`` blocks become ``tool`` messages; its tools and ``tool_choice``
map to OpenAI's. Anything that cannot be honoured is a 400 naming the field.
"""

from __future__ import annotations

import json

from semantic.service import Tools
from semantic.serve.errors import invalid

BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block: it changes on every request


# ---------------------------------------------------------------- tools


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
        specs.append(_spec(t["function"], f"{where}.{i}.function"))
    return _tools(specs, _openai_choice(choice), parallel)


def _openai_choice(choice) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return _name(choice["function"].get("name"), "tool_choice.function.name")
    raise invalid(f"tool_choice {choice!r} is not one of auto, none, required or a named function"[:200], "tool_choice")


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
        name = _name(t.get("name"), f"tools.{i}.name")
        if t.get("defer_loading"):
            if name not in loaded:
                continue
            inline.add(name)
        specs.append(_spec({"name": name, "description": _described(t), "parameters": t["input_schema"]}, f"tools.{i}"))
    if not specs:
        if mode not in ("auto", "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    return _tools(specs, mode, parallel, frozenset(inline))


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


def _anthropic_choice(choice: dict | None) -> str:
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return _name(choice.get("name"), "tool_choice.name")
    raise invalid(f"tool_choice {choice!r} is not one of auto, any, tool or none"[:200], "tool_choice")


def _spec(f: dict, where: str) -> dict:
    params = f.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    return {"type": "function", "function": {"name": _name(f.get("name"), f"{where}.name"),
                                             "description": f.get("description") or "", "parameters": params}}


def _name(name, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise invalid(f"{where} must be a non-empty tool name", where)
    return name


def _tools(specs: list[dict], choice: str, parallel: bool | None, inline: frozenset[str] = frozenset()) -> Tools:
    try:
        return Tools(tuple(specs), choice, True if parallel is None else bool(parallel), inline)
    except ValueError as exc:  # InvalidRequestError: a duplicate name, a choice naming no tool
        raise invalid(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None


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


# ---------------------------------------------------------------- messages


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
            "function": {"name": _name(fn.get("name"), f"{where}.function.name"), "arguments": args}}


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
                          "function": {"name": _name(b.name, f"{where}.content.{j}.name"), "arguments": b.input}})
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


# ---------------------------------------------------------------- the Responses API


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
                    "function": {"name": _name(item.get("name"), f"{where}.name"), "arguments": arguments}}
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
