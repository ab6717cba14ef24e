"""A GGUF's Jinja chat template, rendered as llama.cpp's ``--jinja`` and transformers render it.

The environment is jinja2's ``ImmutableSandboxedEnvironment`` with transformers' settings (the
ones llama-cpp-python's ``Jinja2ChatFormatter`` uses, so a request without tools renders the same
prompt as before): ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, the
``{% generation %}`` tag passed through, ``tojson`` without ASCII escaping, and the globals
``raise_exception`` and ``strftime_now``. The template gets ``messages``, ``tools`` (OpenAI tool
objects, or undefined when the request has none), ``bos_token``, ``eos_token`` and
``add_generation_prompt``.

``TemplateCaps`` says what the template can show, found as llama.cpp (minja) finds it: by
rendering probe conversations and looking for the probes in the text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .families import Family, detect_family, detect_reasoning


class TemplateError(ValueError):
    """The chat template could not be rendered (it raised, or it is not valid Jinja)."""


class _GenerationTag(jinja2.ext.Extension):
    """Pass-through for transformers' ``{% generation %}`` tag."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template shows of a conversation with tools."""

    tools: bool  # the ``tools`` list reaches the prompt
    tool_calls: bool  # an assistant message's tool_calls are written
    tool_responses: bool  # a ``tool`` message's content is written
    object_arguments: bool  # tool-call arguments must be an object (a string would be written quoted)
    parallel_calls: bool  # an assistant message may hold several tool calls
    nine_char_ids: bool  # tool-call ids must be 9 alphanumeric characters (Mistral)
    thinks: bool  # the model writes <think>...</think> (reasoning)
    starts_thinking: bool  # the generation prompt ends inside an opened <think> (DeepSeek-R1)


_PROBE_FN = "probe_function_q7"
_PROBE_ARG = "probe_argument_q7"
_PROBE_RESULT = "probe_result_q7"
_PROBE_ID = "call00001"  # 9 alphanumerics: accepted by Mistral templates


def _probe_call(arguments: Any) -> dict[str, Any]:
    return {"id": _PROBE_ID, "type": "function", "function": {"name": _PROBE_FN, "arguments": arguments}}


class ChatTemplate:
    """One chat template. ``render`` is safe to call from one thread at a time per instance
    (jinja2 templates are thread-safe; the caps are computed once)."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template is not valid Jinja: {exc}") from None
        self.family: Family = detect_family(source)

    def render_raw(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The template applied to already normalised messages (see ``history.normalise``)."""
        context: dict[str, Any] = {
            "messages": list(messages),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_generation_prompt": add_generation_prompt,
            # as llama-cpp-python's Jinja2ChatFormatter and transformers: None when absent
            "tools": list(tools) if tools else None,
            "functions": None,
            "function_call": None,
            "tool_choice": None,
            **extra,
        }
        try:
            try:
                return self._template.render(**context)
            except TypeError:
                if tools:
                    raise
                # a tool-use template that iterates ``tools`` unguarded: render it without them
                del context["tools"]
                return self._template.render(**context)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None

    def _try(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kw: Any
    ) -> str:
        try:
            return self.render_raw(messages, tools, **kw)
        except Exception:  # a probe the template refuses shows nothing
            return ""

    @cached_property
    def caps(self) -> TemplateCaps:
        user = {"role": "user", "content": "Hi"}
        tool = {
            "type": "function",
            "function": {
                "name": _PROBE_FN,
                "description": "probe",
                "parameters": {"type": "object", "properties": {_PROBE_ARG: {"type": "string"}}},
            },
        }
        tools_shown = _PROBE_FN in self._try([user], [tool])

        def with_call(arguments: Any, n: int = 1) -> str:
            calls = [_probe_call(arguments) for _ in range(n)]
            assistant = {"role": "assistant", "content": "", "tool_calls": calls}
            result = {"role": "tool", "tool_call_id": _PROBE_ID, "name": _PROBE_FN, "content": _PROBE_RESULT}
            return self._try([user, assistant, result], [tool])

        as_object = with_call({_PROBE_ARG: "v"})
        as_string = with_call(json.dumps({_PROBE_ARG: "v"}))
        calls_shown = _PROBE_FN in as_object or _PROBE_FN in as_string
        object_json = f'"{_PROBE_ARG}": "v"' in as_object or f'"{_PROBE_ARG}":"v"' in as_object
        string_json = f'"{_PROBE_ARG}": "v"' in as_string and f'\\"{_PROBE_ARG}\\"' not in as_string
        parallel = with_call({_PROBE_ARG: "v"}, 2).count(_PROBE_FN) >= 2 + (1 if tools_shown else 0)
        responses_shown = _PROBE_RESULT in (as_object or as_string)
        src = self.source
        generation = self._try([user], add_generation_prompt=True)
        return TemplateCaps(
            tools=tools_shown,
            tool_calls=calls_shown,
            tool_responses=responses_shown,
            object_arguments=object_json or not string_json,
            parallel_calls=parallel,
            nine_char_ids="length != 9" in src or "|length != 9" in src or self.family.name == "mistral",
            thinks=detect_reasoning(src),
            starts_thinking=generation.rstrip().endswith("<think>"),
        )
