"""The tools path of /v1/chat/completions, request side: ``tools``, ``tool_choice``,
``parallel_tool_calls`` and the legacy ``functions``/``function_call`` validated into a
``ToolRequest``; a model's chat format (its template's tool-call family and reasoning) read from
the GGUF; and the ``ToolPlan`` of a request on that model: what the template is given, the
grammar that forces or lazily constrains the call syntax, and how the answer is parsed
(``chat_output`` shapes the answer).

``tool_choice``:

- ``none``: the request is answered as if it had no tools (they are not shown to the model).
- ``auto`` (the default with tools): the model may call; a lazy grammar, triggered by the
  family's call marker (``<tool_call>``, ``[TOOL_CALLS]``, or an answer that starts with
  ``{"name"`` for Llama 3.x and the generic format), makes what follows a valid call.
- ``required``: a grammar from the first token forces one call (or several, with
  ``parallel_tool_calls``) of any of the tools; a named function forces a call of that one.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..chatformat.families import generic_system_prompt
from ..chatformat.format import ChatFormat, of_source
from ..chatformat.grammar import ToolGrammarError, functions_of, tool_grammar, tool_triggers
from ..chatformat.history import add_system
from ..chatformat.schema_check import SchemaError, SchemaSize, check_total
from ..config.schema import ModelConfig
from ..gguf.catalog import read_chat_template
from ..wire.protocol import ChatMessage, ToolCall, ToolSpec
from .errors import BadRequestError
from .structured import check_schema

#: OpenAI's rule for function names
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: the most tools one request may offer
MAX_TOOLS = 128

Choice = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects, {"type": "function", "function": {...}}
    choice: Choice
    named: str | None  # tool_choice naming one function (choice is then "required")
    parallel: bool
    legacy: bool  # came as functions/function_call: answered with message.function_call


def _bad(message: str, param: str) -> BadRequestError:
    return BadRequestError(message, param)


def _function(obj: object, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _bad(
            f"{where} must be an object with 'name' and optionally 'description', 'parameters'.", where
        )
    name = obj.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(
            f"{where}.name must be 1 to 64 letters, digits, '_' or '-'; got {name!r}.", f"{where}.name"
        )
    description = obj.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.description must be a string.", f"{where}.description")
    parameters = obj.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}.parameters must be a JSON Schema object.", f"{where}.parameters")
    out: dict[str, Any] = {"name": name}
    if description is not None:
        out["description"] = description
    if parameters is not None:
        out["parameters"] = parameters
    return out


def _choice_name(obj: object, param: str, legacy: bool) -> str:
    function = obj.get("function") if isinstance(obj, dict) and not legacy else obj
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        shape = '{"name": "..."}' if legacy else '{"type": "function", "function": {"name": "..."}}'
        words = '"none", "auto"' if legacy else '"none", "auto", "required"'
        raise _bad(f"'{param}' must be {words} or {shape}.", param)
    return name


def parse_tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """The tool fields of a chat body (None: it has none, or ``tool_choice`` none). Raises
    BadRequestError naming the field."""
    tools_raw, functions_raw = body.get("tools"), body.get("functions")
    if tools_raw is not None and functions_raw is not None:
        raise _bad("Send 'tools' or the legacy 'functions', not both.", "functions")
    legacy = functions_raw is not None and tools_raw is None
    raw = functions_raw if legacy else tools_raw
    param = "functions" if legacy else "tools"
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _bad(f"'{param}' must be a list of {'functions' if legacy else 'tools'}.", param)
    if len(raw) > MAX_TOOLS:
        raise _bad(f"'{param}' holds {len(raw)} entries; send at most {MAX_TOOLS}.", param)
    tools: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"{param}[{i}]"
        if legacy:
            tools.append({"type": "function", "function": _function(item, where)})
            continue
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            kind = item.get("type") if isinstance(item, dict) else None
            raise _bad(
                f"{where}: only tools of type 'function' are supported (got {kind!r}).", f"{where}.type"
            )
        tools.append({"type": "function", "function": _function(item.get("function"), f"{where}.function")})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad(f"'{param}' names a function twice; give each function one entry.", param)
    choice_param = "function_call" if legacy else "tool_choice"
    choice_raw = body.get(choice_param)
    if legacy and body.get("tool_choice") is not None:
        raise _bad(
            "'tool_choice' goes with 'tools'; with the legacy 'functions' use 'function_call'.", "tool_choice"
        )
    if not legacy and body.get("function_call") is not None:
        raise _bad(
            "'function_call' goes with the legacy 'functions'; with 'tools' use 'tool_choice'.",
            "function_call",
        )
    named: str | None = None
    choice: Choice
    if choice_raw is None:
        choice = "auto"
    elif choice_raw in ("none", "auto") or (choice_raw == "required" and not legacy):
        choice = choice_raw
    else:
        named = _choice_name(choice_raw, choice_param, legacy)
        if named not in names:
            known = ", ".join(names) or "none are given"
            raise _bad(
                f"'{choice_param}' names {named!r}, which is not in '{param}' ({known}).", choice_param
            )
        choice = "required"
    if not tools:
        if choice == "required":
            raise _bad(
                f"'{choice_param}' asks for a call but '{param}' is empty: give the functions.", choice_param
            )
        return None
    # llama-server's default (OpenAI's is true): a small model repeats its call when it may
    parallel = body.get("parallel_tool_calls", False)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be true or false.", "parallel_tool_calls")
    if choice == "none":
        return None
    return ToolRequest(tuple(tools), choice, named, parallel and not legacy and named is None, legacy)


# ---- the model's chat format -------------------------------------------------------------------


_cache: dict[tuple[object, ...], ChatFormat] = {}
_cache_lock = threading.Lock()


def chat_format_of(model: ModelConfig) -> ChatFormat:
    """The chat format of ``model`` before its worker has reported it (``ModelStatus.chat_family``,
    ...: it has not loaded since it started), derived as the worker derives it
    (``chatformat.format``): ``chat_template`` when set, else the GGUF's own (read from the header,
    cached while the file is unchanged), else the fallback format (family ``generic``). Blocking
    (file I/O): call it off the event loop."""
    path = Path(model.path)
    try:
        stat = path.stat()
        stamp: tuple[object, ...] = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = ()
    key = (model.path, model.chat_template, model.chat_format, *stamp)
    with _cache_lock:
        known = _cache.get(key)
    if known is not None:
        return known
    source: str | None = None
    if model.chat_format != "fallback" and not model.embedding:
        source = model.chat_template
        if source is None:
            try:
                source = read_chat_template(path)
            except Exception:  # the worker reports an unreadable file; here: no template
                source = None
    fmt = of_source(source)
    with _cache_lock:
        _cache[key] = fmt
    return fmt


# ---- the plan of one request -------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request with tools runs on one model."""

    request: ToolRequest | None
    fmt: ChatFormat
    template_tools: tuple[dict[str, Any], ...] = ()  # what the template shows (OpenAI tool objects)
    system_prompt: str = ""  # added to the system message (generic family: the tools described)
    grammar: str | None = None
    grammar_triggers: tuple[str, ...] = field(default_factory=tuple)

    @property
    def parses_calls(self) -> bool:
        return self.request is not None

    def messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages the worker renders (the generic family's system prompt added)."""
        return add_system(messages, self.system_prompt) if self.system_prompt else list(messages)


def plan(request: ToolRequest | None, fmt: ChatFormat) -> ToolPlan:
    """The plan of a request (``request`` None: no tools; the answer is still split into reasoning
    and content for a thinking model). Raises BadRequestError when a schema cannot become a
    grammar."""
    if request is None:
        return ToolPlan(None, fmt)
    family = fmt.family
    functions = functions_of(request.tools)
    forced = request.choice == "required"
    if request.named is not None:
        functions = [f for f in functions if f["name"] == request.named]
    param = "functions" if request.legacy else "tools"
    total = SchemaSize()
    for function in functions:
        try:
            total += check_schema(function.get("parameters", {}), f"{param}: {function['name']}.parameters")
        except BadRequestError as exc:
            raise BadRequestError(exc.message, param) from None
    try:  # one grammar holds them all: the limits apply to them together too
        check_total(total, f"{param} (the parameters of all of them)")
    except SchemaError as exc:
        raise BadRequestError(str(exc), param) from None
    try:
        grammar = tool_grammar(
            family,
            functions,
            parallel=request.parallel,
            thinks=fmt.thinks and forced,
            starts_thinking=fmt.starts_thinking and forced,
            lazy=not forced,
        )
    except ToolGrammarError as exc:
        raise BadRequestError(f"'{param}': {exc}.", param) from None
    triggers = () if forced else tool_triggers(family, thinks=fmt.thinks and not fmt.starts_thinking)
    if family.name == "generic":
        shown = [{"type": "function", "function": f} for f in functions]
        prompt = generic_system_prompt(shown, required=forced, parallel=request.parallel)
        return ToolPlan(request, fmt, (), prompt, grammar, triggers)
    return ToolPlan(request, fmt, request.tools, "", grammar, triggers)


# ---- one request, ready for the pool -----------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    plan: ToolPlan
    messages: tuple[ChatMessage, ...]  # what the worker renders
    tools: tuple[ToolSpec, ...]  # what the template shows


def prepare(
    messages: Sequence[ChatMessage],
    request: ToolRequest | None,
    model: ModelConfig,
    fmt: ChatFormat | None = None,
) -> Prepared:
    """A chat request's plan on ``model`` and what the worker gets (see ``plan``); ``fmt``: the
    chat format its worker reported (None: not yet, read from the model's file). Blocking (it may
    read the GGUF's header once): call it off the event loop. Raises BadRequestError."""
    the_plan = plan(request, fmt if fmt is not None else chat_format_of(model))
    out = tuple(messages)
    if the_plan.system_prompt:
        if out and out[0].role == "system":
            first = out[0]
            text = f"{first.content}\n\n{the_plan.system_prompt}" if first.content else the_plan.system_prompt
            out = (_with_content(first, text), *out[1:])
        else:
            out = (ChatMessage(role="system", content=the_plan.system_prompt), *out)
    specs = tuple(
        ToolSpec(
            name=t["function"]["name"],
            description=t["function"].get("description", ""),
            parameters=t["function"].get("parameters"),
        )
        for t in the_plan.template_tools
    )
    return Prepared(the_plan, out, specs)


def _with_content(message: ChatMessage, content: str) -> ChatMessage:
    return msgspec.structs.replace(message, content=content)  # (its images keep their places)


# ---- tool history in messages ------------------------------------------------------------------


def has_tool_fields(item: Mapping[str, Any]) -> bool:
    """Whether a request message is tool history (a tool result, or an assistant's calls)."""
    return item.get("role") in ("tool", "function") or (
        item.get("role") == "assistant" and bool(item.get("tool_calls") or item.get("function_call"))
    )


def _call(obj: object, where: str) -> tuple[str, str]:
    if not isinstance(obj, dict):
        raise _bad(f"{where} must be an object with 'name' and 'arguments'.", where)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name must be the function's name.", f"{where}.name")
    arguments = obj.get("arguments", "{}")
    if isinstance(arguments, dict):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise _bad(f"{where}.arguments must be a JSON string.", f"{where}.arguments")
    return name, arguments


def tool_message(item: Mapping[str, Any], index: int, text: str) -> ChatMessage:
    """A request message that is tool history (``has_tool_fields``) as the protocol's message;
    ``text`` is its content ("" for null). Raises BadRequestError naming the field."""
    where = f"messages[{index}]"
    role = item.get("role")
    if role in ("tool", "function"):
        call_id = item.get("tool_call_id")
        name = item.get("name")
        if role == "tool" and not isinstance(call_id, str):
            raise _bad(
                f"{where}.tool_call_id is required: the id of the call this answers.", f"{where}.tool_call_id"
            )
        if role == "function" and not isinstance(name, str):
            raise _bad(f"{where}.name is required: the function whose result this is.", f"{where}.name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{where}.name must be a string.", f"{where}.name")
        return ChatMessage(
            role="tool", content=text, tool_call_id=call_id if role == "tool" else None, name=name
        )
    calls: list[ToolCall] = []
    raw = item.get("tool_calls")
    if raw is not None:
        if not isinstance(raw, list):
            raise _bad(f"{where}.tool_calls must be a list of calls.", f"{where}.tool_calls")
        for i, call in enumerate(raw):
            at = f"{where}.tool_calls[{i}]"
            if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                raise _bad(f"{at} must be an object with 'id', 'type' and 'function'.", at)
            name, arguments = _call(call.get("function"), f"{at}.function")
            calls.append(ToolCall(id=call["id"], name=name, arguments=arguments))
    legacy = item.get("function_call")
    if legacy is not None:
        name, arguments = _call(legacy, f"{where}.function_call")
        calls.append(ToolCall(id=f"call_{index}", name=name, arguments=arguments))
    return ChatMessage(role="assistant", content=text, tool_calls=tuple(calls))
