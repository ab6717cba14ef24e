"""Structured output: an OpenAI ``response_format`` as the GBNF grammar the worker samples under.

- ``{"type": "text"}`` (or none): no grammar.
- ``{"type": "json_object"}``: llama.cpp's JSON grammar (``llama_grammar.JSON_GBNF``): one JSON
  object, any keys.
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``: the
  schema through llama-cpp-python's converter (``chatformat.schema_grammar``: llama.cpp's C++
  converter is not in the shipped libraries; this is its Python port, its JSON strings corrected
  to exclude control characters, a root ``$ref`` followed). ``strict`` true or false: the grammar is
  enforced either way (a local model has no "best effort" mode worth having).

What the grammar enforces (``ENFORCED``), what it accepts but cannot enforce (``NOT_ENFORCED``:
the answer is valid JSON of the right shape, but e.g. a number may fall outside ``minimum``), and
what is refused with a 400 naming the part (``not``, a ``$ref`` that is not local to the schema,
a keyword of the wrong JSON type, anything over the limits of ``chatformat.schema_check`` and
``chatformat.gbnf_check``, anything the converter itself fails on, such as a ``pattern`` not
anchored with ``^...$``). docs/API.md repeats these lists.
"""

from __future__ import annotations

import functools

from ..chatformat import schema_check
from ..chatformat.gbnf_check import GrammarLimitError
from ..chatformat.schema_check import SchemaError
from ..chatformat.schema_grammar import llama_grammar, schema_gbnf
from .errors import BadRequestError

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


@functools.cache
def json_object_grammar() -> str:
    """llama.cpp's JSON grammar (one object), as llama-cpp-python ships it (its strings exclude
    control characters already)."""
    return str(llama_grammar().JSON_GBNF)


def check_schema(schema: object, where: str) -> schema_check.SchemaSize:
    """Refuse a schema of the wrong shape, over a limit, or using what a grammar cannot enforce
    (``chatformat.schema_check``): 400 naming the part. Returns what it holds."""
    try:
        return schema_check.check_schema(schema, where)
    except SchemaError as exc:
        raise BadRequestError(str(exc), "response_format") from None


def schema_grammar(schema: object, where: str = "response_format.json_schema.schema") -> str:
    """The GBNF grammar of a JSON schema (checked first, and the grammar after: 400 naming the
    part and the limit)."""
    try:
        return schema_gbnf(schema, where)
    except (SchemaError, GrammarLimitError) as exc:
        raise BadRequestError(str(exc), "response_format") from None


def _refuse(where: str, what: str) -> BadRequestError:
    message = f"{where}: {what}"
    return BadRequestError(message if message.endswith(".") else message + ".", "response_format")


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
