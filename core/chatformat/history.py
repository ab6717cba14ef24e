"""OpenAI chat messages normalised for a chat template (what llama.cpp does before ``--jinja``
rendering), so that any client's history renders:

- ``content`` null (an assistant message that only calls tools) becomes "";
- a tool call's ``arguments`` (a JSON string on the wire) become the object they hold when the
  template writes them with ``tojson`` (``TemplateCaps.object_arguments``), else stay the string;
- tool-call ids become 9 alphanumeric characters for templates that insist (Mistral), the same
  mapping for the assistant's ``tool_calls[].id`` and the ``tool`` message's ``tool_call_id``;
- a ``tool`` message without ``name`` gets the name of the call it answers;
- a template that cannot show tool calls gets them as the call text of the generic format in the
  assistant's content, and one that cannot show ``tool`` messages gets them as user messages
  holding ``{"tool_response": {"name": ..., "content": ...}}``;
- keys a message does not have are left out (templates test ``'tool_calls' in message``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

from .families import MISTRAL_ID
from .template import ChatTemplate, TemplateCaps

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def nine_char_id(call_id: str) -> str:
    """A Mistral-style id (9 alphanumerics) for ``call_id``: itself when it is one, else derived
    from its hash (the same id always maps to the same one)."""
    if MISTRAL_ID.match(call_id):
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest()[:8], "big")
    out = []
    for _ in range(9):
        digest, r = divmod(digest, len(_ALNUM))
        out.append(_ALNUM[r])
    return "".join(out)


def call_text(name: str, arguments: str) -> str:
    """A call in the generic format (what the generic system prompt asks the model to write)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def add_system(messages: Sequence[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` appended to the first system message, or a system message of its own first."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        first = out[0].get("content") or ""
        out[0]["content"] = f"{first}\n\n{text}" if first else text
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _arguments(arguments: object, as_object: bool) -> object:
    if not as_object or not isinstance(arguments, str):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def normalise(messages: Iterable[dict[str, Any]], caps: TemplateCaps) -> list[dict[str, Any]]:
    """The messages as the template expects them (see the module docstring). Input messages are
    OpenAI-shaped dicts: ``role``, ``content`` (str or None), and optionally ``tool_calls``
    (``[{"id", "type", "function": {"name", "arguments"}}]``), ``tool_call_id``, ``name``."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []

    def fix_id(call_id: object) -> object:
        if caps.nine_char_ids and isinstance(call_id, str):
            return nine_char_id(call_id)
        return call_id

    for message in messages:
        role = message.get("role")
        content = message.get("content")
        item: dict[str, Any] = {"role": role, "content": "" if content is None else content}
        calls = message.get("tool_calls") or []
        if role == "assistant" and calls:
            if caps.tool_calls:
                fixed = []
                for call in calls:
                    function = call.get("function", {})
                    names[str(call.get("id"))] = str(function.get("name", ""))
                    fixed.append(
                        {
                            "id": fix_id(call.get("id")),
                            "type": "function",
                            "function": {
                                "name": function.get("name", ""),
                                "arguments": _arguments(
                                    function.get("arguments", "{}"), caps.object_arguments
                                ),
                            },
                        }
                    )
                item["tool_calls"] = fixed
            else:
                texts = [
                    call_text(
                        str(c.get("function", {}).get("name", "")),
                        str(c.get("function", {}).get("arguments", "")),
                    )
                    for c in calls
                ]
                item["content"] = "\n".join(([item["content"]] if item["content"] else []) + texts)
        if role == "tool":
            call_id = message.get("tool_call_id")
            name = message.get("name") or names.get(str(call_id), "")
            if not caps.tool_responses:
                wrapped = {"tool_response": {"name": name, "content": item["content"]}}
                out.append({"role": "user", "content": json.dumps(wrapped, ensure_ascii=False)})
                continue
            if call_id is not None:
                item["tool_call_id"] = fix_id(call_id)
            if name:
                item["name"] = name
        elif message.get("name") and role != "assistant":
            item["name"] = message["name"]
        out.append(item)
    return out


def render(
    template: ChatTemplate,
    messages: Iterable[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt of a chat: ``messages`` normalised for ``template``, then rendered with ``tools``
    (OpenAI tool objects; a function without ``parameters`` or ``description`` gets empty ones,
    which some templates read unguarded). Raises TemplateError."""
    fixed_tools = None
    if tools:
        fixed_tools = []
        for tool in tools:
            function = dict(tool.get("function") or {})
            function.setdefault("description", "")
            function.setdefault("parameters", {"type": "object", "properties": {}})
            fixed_tools.append({**tool, "function": function})
    return template.render_raw(
        normalise(messages, template.caps), fixed_tools, add_generation_prompt=add_generation_prompt
    )
