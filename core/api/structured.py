"""Structured output: an OpenAI ``response_format`` as the GBNF grammar the worker samples under.

- ``{"type": "text"}`` (or none): no grammar.
- ``{"type": "json_object"}``: llama.cpp's JSON grammar (``llama_grammar.JSON_GBNF``): one JSON
  object, any keys.
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``: the
  schema through llama-cpp-python's ``json_schema_to_gbnf`` (llama.cpp's C++ converter is not in
  the shipped libraries; this is its Python port). ``strict`` true or false: the grammar is
  enforced either way (a local model has no "best effort" mode worth having).

What the grammar enforces (``ENFORCED``), what it accepts but cannot enforce (``NOT_ENFORCED``:
the answer is valid JSON of the right shape, but e.g. a number may fall outside ``minimum``), and
what is refused with a 400 naming the part (``not``, a ``$ref`` that is not local to the schema,
nesting deeper than ``MAX_SCHEMA_DEPTH``, anything the converter itself fails on, such as a
``pattern`` not anchored with ``^...$``). docs/API.md repeats these lists.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from .errors import BadRequestError

#: subschemas nested deeper than this are refused: each level multiplies the grammar's stacks
MAX_SCHEMA_DEPTH = 16

ENFORCED = (
    "type (one or a list)",
    "properties",
    "required",
    "additionalProperties (false, true or a schema; absent counts as false)",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf (as anyOf)",
    "allOf (of object schemas)",
    "local $ref (#/$defs/..., #/definitions/..., recursion included)",
    "pattern (anchored ^...$)",
    "minLength",
    "maxLength",
    "format: date, time, date-time, uuid",
)
NOT_ENFORCED = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "uniqueItems",
    "contains",
    "dependentRequired",
    "dependentSchemas",
    "if/then/else",
    "other formats (email, uri, ...)",
)
#: keywords whose value is one subschema / a list of them / a map of them
_ONE = ("additionalProperties", "items", "contains", "if", "then", "else", "propertyNames", "not")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@functools.cache
def json_object_grammar() -> str:
    """llama.cpp's JSON grammar (one object), as llama-cpp-python ships it."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return str(JSON_GBNF)


def _refuse(where: str, what: str) -> BadRequestError:
    message = f"{where}: {what}"
    return BadRequestError(message if message.endswith(".") else message + ".", "response_format")


def check_schema(schema: object, where: str) -> None:
    """Refuse what the grammar converter cannot handle (see the module docstring); 400 naming
    the part. Iterative."""
    if not isinstance(schema, dict):
        raise _refuse(where, "the schema must be a JSON object")
    stack: list[tuple[object, str, int]] = [(schema, where, 0)]
    while stack:
        node, at, depth = stack.pop()
        if isinstance(node, bool):
            continue  # true / false schemas
        if not isinstance(node, dict):
            raise _refuse(at, "a subschema must be a JSON object (or true/false)")
        if depth > MAX_SCHEMA_DEPTH:
            raise _refuse(
                at,
                f"the schema nests more than {MAX_SCHEMA_DEPTH} levels; Timeshare's grammar cannot "
                "follow it that deep: flatten it (or use $defs with $ref)",
            )
        if "not" in node:
            raise _refuse(
                f"{at}.not",
                "'not' cannot be enforced by a grammar; remove it (or describe the constraint in the prompt)",
            )
        ref = node.get("$ref")
        if ref is not None:
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise _refuse(
                    f"{at}.$ref",
                    f"only references inside the schema (#/$defs/...) are followed; {ref!r} is "
                    "remote: inline it under $defs",
                )
            _resolve(schema, ref, f"{at}.$ref")
        for key in _ONE:
            sub = node.get(key)
            if isinstance(sub, (dict, bool)):
                stack.append((sub, f"{at}.{key}", depth + 1))
        for key in _LIST:
            subs = node.get(key)
            if isinstance(subs, list):
                stack.extend((s, f"{at}.{key}[{i}]", depth + 1) for i, s in enumerate(subs))
        for key in _MAP:
            subs = node.get(key)
            if isinstance(subs, dict):
                stack.extend((s, f"{at}.{key}.{name}", depth + 1) for name, s in subs.items())
        pattern = node.get("pattern")
        if pattern is not None and (
            not isinstance(pattern, str) or not (pattern.startswith("^") and pattern.endswith("$"))
        ):
            raise _refuse(
                f"{at}.pattern",
                f"{pattern!r}: only patterns anchored at both ends (^...$) can be enforced; anchor it",
            )


def _resolve(root: Mapping[str, Any], ref: str, where: str) -> None:
    target: Any = root
    for part in ref.lstrip("#").split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise _refuse(where, f"{ref!r} points to nothing in the schema")
        target = target[part]


def schema_grammar(schema: object, where: str = "response_format.json_schema.schema") -> str:
    """The GBNF grammar of a JSON schema (checked first: see ``check_schema``)."""
    check_schema(schema, where)
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise _refuse(
            where, f"the schema cannot be turned into a grammar ({exc or type(exc).__name__})"
        ) from None


def response_format_grammar(response_format: object) -> str | None:
    """The grammar a ``response_format`` asks for (None: plain text). 400 on a bad one."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _refuse("response_format", 'must be an object such as {"type": "json_object"}')
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _refuse(
                "response_format.json_schema",
                'must be an object with "name" and "schema" (the JSON schema the answer follows)',
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _refuse("response_format.json_schema.strict", "must be true or false")
        return schema_grammar(spec["schema"])
    raise _refuse("response_format.type", f"{kind!r} is not one of 'text', 'json_object', 'json_schema'")
