"""GBNF grammars for tool calls: the family's call syntax, with each function's arguments from its
JSON schema (``schema_grammar``: llama-cpp-python's converter, JSON strings without control
characters). The grammar is checked against ``gbnf_check``'s limits.

``tool_grammar`` is for ``tool_choice: required`` or a named function (the grammar applies from
the first token, so even a small model writes a call whose arguments validate) and, with
``tool_triggers``, for ``auto`` (lazy: it applies from the family's call marker on; the text before
it is the message's content). Trigger patterns follow llama.cpp's lazy-grammar rule: a pattern is
searched in the text generated so far (these are all written ``^...$``: they match the whole answer
so far), and the grammar starts where the first group starts and is fed everything from there (the
rest of the token that completed the marker too). llama.cpp aborts the process when the grammar
refuses that text, so each trigger matches only text its grammar accepts as the start of a call.

A reasoning template (``<think>``) may think first: the grammar allows one ``<think>...</think>``
block before the calls (after ``</think>`` only, when the prompt opened the block already).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .families import Family
from .gbnf_check import GrammarLimitError, check_gbnf
from .schema_grammar import CONVERTER_ERRORS, convert, hoist_defs, new_converter


class ToolGrammarError(ValueError):
    """A function's parameters schema cannot be turned into a grammar (the message names it)."""


#: text up to (not including) "</think>"
_THINK_TEXT = (
    'think-text ::= ( [^<] | "<" [^/] | "</" [^t] | "</t" [^h] | "</th" [^i] | "</thi" [^n] '
    '| "</thin" [^k] | "</think" [^>] )*'
)

#: the arguments schema of a function that declares none
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    if not isinstance(params, dict) or not params:
        return dict(_NO_PARAMETERS)
    return params


def _call_schema(family: Family, function: dict[str, Any], defs: dict[str, Any], tag: str) -> dict[str, Any]:
    """One call object of ``function``; the definitions of its parameters schema move into
    ``defs`` (the combined schema's root ``$defs``), renamed with ``tag``."""
    name = str(function.get("name", ""))
    parameters, moved = hoist_defs(_parameters(function), tag)
    defs.update(moved)
    properties: dict[str, Any] = {"name": {"const": name}, family.arguments_key: parameters}
    required = ["name", family.arguments_key]
    if family.name == "mistral":
        properties["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        required.append("id")
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _call_rules(family: Family, functions: Sequence[dict[str, Any]]) -> str:
    """The GBNF rules whose rule ``tool-call`` is one call object of any of ``functions``."""
    if not functions:
        raise ToolGrammarError("no functions to call")
    converter = new_converter()
    # a parameters schema's "#/$defs/..." points into itself: its definitions move to the root
    # of the combined schema (where the converter resolves references), one name space per tool
    defs: dict[str, Any] = {}
    schemas = [_call_schema(family, f, defs, f"tool{i}") for i, f in enumerate(functions)]
    schema: dict[str, Any] = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    if defs:
        schema["$defs"] = defs
    try:
        convert(converter, json.loads(json.dumps(schema)), "tool-call", "tools")
    except CONVERTER_ERRORS as exc:
        names = ", ".join(str(f.get("name")) for f in functions)
        raise ToolGrammarError(
            f"the parameters schema of {names} cannot be turned into a grammar "
            f"({exc or type(exc).__name__}); simplify it (no remote $ref, no 'not')"
        ) from None
    return str(converter.format_grammar())


def tool_grammar(
    family: Family,
    functions: Sequence[dict[str, Any]],
    *,
    parallel: bool,
    thinks: bool = False,
    starts_thinking: bool = False,
    lazy: bool = False,
) -> str:
    """A GBNF grammar (root rule ``root``) for one call, or one or more when ``parallel`` (and the
    family allows several), of any of ``functions`` (OpenAI function objects: name, parameters).
    ``lazy``: for ``tool_triggers`` (the trigger starts the grammar at the call marker, after any
    thinking), so no think block."""
    rules = _call_rules(family, functions)
    many = parallel and family.parallel
    if family.name == "hermes":
        block = '"<tool_call>" tc-nl tool-call tc-nl "</tool_call>"'
        calls = f"{block} ( tc-ws {block} )*" if many else block
        extra = ['tc-nl ::= ( "\\n" | " " )?', "tc-ws ::= [ \\n]{0,2}"]
    elif family.name == "mistral":
        calls = (
            '"[TOOL_CALLS]" "[" tool-call ( "," " "? tool-call )* "]"'
            if many
            else '"[TOOL_CALLS]" "[" tool-call "]"'
        )
        extra = []
    else:  # llama3, generic: the bare JSON object(s), one per line
        calls = 'tool-call ( "\\n" tool-call )*' if many else "tool-call"
        extra = []
    if lazy:
        root = f"root ::= {calls}"
    elif starts_thinking:
        root = f'root ::= think-text "</think>" [ \\n]{{0,2}} {calls}'
        extra.append(_THINK_TEXT)
    elif thinks:
        root = f'root ::= ( "<think>" think-text "</think>" [ \\n]{{0,2}} )? {calls}'
        extra.append(_THINK_TEXT)
    else:
        root = f"root ::= {calls}"
    grammar = "\n".join([root, *extra, rules]) + "\n"
    try:
        check_gbnf(grammar, "the tools' grammar")
    except GrammarLimitError as exc:
        raise ToolGrammarError(f"{exc}; offer fewer or smaller tools") from None
    return grammar


def tool_triggers(family: Family, *, thinks: bool = False) -> tuple[str, ...]:
    """The lazy-grammar trigger patterns of ``auto`` (see the module docstring)."""
    if family.name in ("llama3", "generic"):
        # the answer itself is the call: it starts with {"name" (Llama 3.x may put <|python_tag|>
        # first); the brace and the key as the grammar writes them (``"{" space``: at most one
        # space), so the text the trigger hands the grammar is always text it accepts
        lead = r"(?:<\|python_tag\|>)?\s*" if family.name == "llama3" else r"\s*"
        call = lead + r'(\{ ?"name")[\s\S]*$'
        if thinks:
            return (r"^\s*<think>[\s\S]*?</think>" + call, "^" + call)
        return ("^" + call,)
    marker = r"<tool_call>" if family.name == "hermes" else r"\[TOOL_CALLS\]"
    if thinks:
        return (
            rf"^\s*<think>[\s\S]*?</think>[\s\S]*?({marker})[\s\S]*$",
            rf"^(?!\s*<think>)[\s\S]*?({marker})[\s\S]*$",
        )
    return (rf"^[\s\S]*?({marker})[\s\S]*$",)


def functions_of(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function objects of OpenAI ``tools``."""
    return [t["function"] for t in tools if isinstance(t.get("function"), dict)]


def schema_json(function: dict[str, Any]) -> str:
    """A function's parameters schema as JSON text (for error messages and tests)."""
    return json.dumps(_parameters(function))
