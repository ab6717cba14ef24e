"""The tool-call formats of the common model families, detected from the chat template's text.

Each family is how a model of that family writes a call (the format its template shows the model
in the tool history and in the tools preamble):

- ``hermes`` (Hermes 2/3, Qwen 2.5, Qwen 3, QwQ, and every template that writes ``<tool_call>``)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  one block per call (parallel calls: several blocks).
- ``llama3`` (Llama 3.1/3.2/3.3: the templates with an ``ipython`` role): the answer is the JSON
  object ``{"name": "get_weather", "parameters": {"city": "Paris"}}``, optionally after the
  ``<|python_tag|>`` token; one call per message (the templates refuse more).
- ``mistral`` (Mistral Nemo, Small, Devstral: the templates with ``[TOOL_CALLS]``)::

      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]

- ``generic`` (every other template, e.g. SmolLM2's plain ChatML): the template has no tool
  syntax, so the tools are described in a system message (``generic_system_prompt``) and a call is
  the JSON object ``{"name": "get_weather", "arguments": {"city": "Paris"}}`` as the whole answer
  (parallel calls: one object per line). With ``tool_choice: auto`` an answer that starts with
  ``{`` is a call (the grammar constrains it from that character on); any other answer is text.

Reasoning: a template that writes ``<think>`` (Qwen 3, QwQ, DeepSeek-R1 distills) makes the
answer's ``<think>...</think>`` block the message's ``reasoning_content``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

FamilyName = Literal["hermes", "llama3", "mistral", "generic"]


@dataclass(frozen=True)
class Family:
    name: FamilyName
    #: the key a call object names its arguments with
    arguments_key: str
    #: whether one answer may hold several calls
    parallel: bool
    #: the text that starts a call (what a lazy grammar is triggered by)
    marker: str


FAMILIES: dict[FamilyName, Family] = {
    "hermes": Family("hermes", "arguments", True, "<tool_call>"),
    "llama3": Family("llama3", "parameters", False, "{"),
    "mistral": Family("mistral", "arguments", True, "[TOOL_CALLS]"),
    "generic": Family("generic", "arguments", True, "{"),
}


def detect_family(template: str | None) -> Family:
    """The tool-call family of a chat template (``generic`` for None or one without tool syntax)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return FAMILIES["mistral"]
    if "<tool_call>" in text:
        return FAMILIES["hermes"]
    if "<|start_header_id|>" in text and ("ipython" in text or "<|python_tag|>" in text):
        return FAMILIES["llama3"]
    return FAMILIES["generic"]


def detect_reasoning(template: str | None) -> bool:
    """Whether the template's model writes a ``<think>...</think>`` block before its answer."""
    text = template or ""
    return "<think>" in text or "</think>" in text


def generic_system_prompt(tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool) -> str:
    """The system message that describes ``tools`` to a model whose template has no tool syntax
    (the ``generic`` family). ``tools`` are OpenAI tool objects."""
    lines = [
        "You can call these functions (JSON Schema of each function's arguments):",
        "",
    ]
    for tool in tools:
        function = tool.get("function", {})
        lines.append(json.dumps(function, ensure_ascii=False))
    lines.append("")
    call = '{"name": "<function name>", "arguments": {<the arguments as JSON>}}'
    if required:
        lines.append(f"Call a function: answer with only the JSON object {call}.")
    else:
        lines.append(
            f"To call a function, answer with only the JSON object {call}. "
            "Otherwise answer the user normally, without JSON."
        )
    if parallel:
        lines.append("To call several functions, write one such object per line.")
    return "\n".join(lines)


#: Mistral templates check that ids are 9 alphanumeric characters
MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")
