"""A JSON schema checked before it becomes a grammar (issue 38): its shape, and limits that keep
the grammar small enough to build and apply in bounded time.

Every place a schema arrives (``response_format``, Ollama's ``format``, Anthropic's
``output_config.format``, tool ``parameters``) calls ``check_schema`` first; a ``SchemaError``
names the part (``where`` plus the path inside the schema) and the limit, and the API answers 400.

**Shape**: each keyword the converter reads must have the JSON type JSON Schema gives it
(``properties`` an object of schemas, ``items`` a schema, ``anyOf`` a non-empty list of schemas,
``required`` a list of strings, ``maxLength`` a whole number, ...): the converter crashed or
wrote a wrong grammar on the others.

**Limits** (docs/API.md lists them):

- ``MAX_SCHEMA_BYTES``: the schema as JSON text;
- ``MAX_SCHEMA_DEPTH``: subschemas nested in subschemas;
- ``MAX_REPETITION``: ``minLength``, ``maxLength``, ``minItems``, ``maxItems`` and a ``pattern``'s
  ``{m,n}`` (the converter writes the element out once per count: ``maxLength: 100000`` was a
  grammar of 100,000 nested groups that took the worker down);
- ``MAX_ENUM_VALUES`` and ``MAX_ENUM_CHARS``: ``enum`` and ``const`` values across the schema
  (each value is one alternative of the grammar);
- ``MAX_PROPERTIES``: properties across the schema (the converter's work grows with the square of
  an object's optional properties);
- ``MAX_PATTERN_CHARS`` and ``MAX_PATTERN_NESTING``: a ``pattern``'s length and group nesting.

The grammar that comes out is checked again by ``gbnf_check`` (what the worker's llama.cpp can
build); these limits keep any schema within them under that check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: the schema's JSON text (bytes)
MAX_SCHEMA_BYTES = 100_000
#: subschemas nested deeper than this are refused: each level multiplies the grammar's stacks
MAX_SCHEMA_DEPTH = 16
#: minLength, maxLength, minItems, maxItems, and a pattern's {m,n}
MAX_REPETITION = 1000
#: enum and const values across the schema
MAX_ENUM_VALUES = 1000
#: characters of the enum and const values across the schema (as JSON)
MAX_ENUM_CHARS = 50_000
#: properties across the schema
MAX_PROPERTIES = 500
#: a pattern's length, and how deep its groups nest
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_NESTING = 32

TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")

#: keywords whose value is one subschema / a non-empty list of them / a map of them
ONE = ("additionalProperties", "items", "contains", "if", "then", "else", "propertyNames", "not")
LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: keywords whose value is a whole number of at least 0, and those of them the grammar repeats by
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
REPEATS = ("minLength", "maxLength", "minItems", "maxItems")
NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


@dataclass(frozen=True)
class SchemaSize:
    """What a checked schema holds, of what the limits count (``check_total`` adds them up for
    the schemas of one request: a request's tools)."""

    bytes: int = 0
    properties: int = 0
    enum_values: int = 0
    enum_chars: int = 0

    def __add__(self, other: SchemaSize) -> SchemaSize:
        return SchemaSize(
            self.bytes + other.bytes,
            self.properties + other.properties,
            self.enum_values + other.enum_values,
            self.enum_chars + other.enum_chars,
        )


class SchemaError(ValueError):
    """A schema refused (the message names the part and says what to do)."""

    def __init__(self, where: str, what: str) -> None:
        message = f"{where}: {what}"
        super().__init__(message if message.endswith(".") else message + ".")
        self.where = where


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def pattern_repetitions(pattern: str, where: str) -> None:
    """Refuse a ``pattern`` whose quantifiers or nesting the converter cannot write out in
    bounded work (``{m,n}`` over ``MAX_REPETITION``, groups deeper than ``MAX_PATTERN_NESTING``)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise SchemaError(
            where,
            f"the pattern is {len(pattern)} characters; at most {MAX_PATTERN_CHARS} (MAX_PATTERN_CHARS)",
        )
    depth = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            continue
        if c == "(":
            depth += 1
            if depth > MAX_PATTERN_NESTING:
                raise SchemaError(
                    where,
                    f"the pattern's groups nest more than {MAX_PATTERN_NESTING} deep (MAX_PATTERN_NESTING)",
                )
        elif c == ")":
            depth -= 1
        elif c == "{":
            j = pattern.find("}", i)
            if j < 0:
                break  # the converter refuses it
            for part in pattern[i + 1 : j].split(","):
                digits = part.strip()
                if digits and (not digits.isdigit() or len(digits) > 9 or int(digits) > MAX_REPETITION):
                    raise SchemaError(
                        where,
                        f"the quantifier {pattern[i : j + 1]} repeats more than {MAX_REPETITION} times "
                        "(MAX_REPETITION); the grammar writes each repetition out: repeat less",
                    )
            i = j
        i += 1


def check_schema(schema: object, where: str) -> SchemaSize:
    """Refuse a schema of the wrong shape, over a limit, or using what a grammar cannot enforce
    (``not``, a remote ``$ref``, a ``pattern`` not anchored ``^...$``); ``SchemaError`` naming
    the part. Iterative: a deep schema costs no Python stack."""
    if not isinstance(schema, dict):
        raise SchemaError(where, "the schema must be a JSON object")
    enum_values = enum_chars = properties = 0
    stack: list[tuple[object, str, int]] = [(schema, where, 0)]
    while stack:
        node, at, depth = stack.pop()
        if isinstance(node, bool):
            continue  # true / false schemas
        if not isinstance(node, dict):
            raise SchemaError(at, f"a subschema must be a JSON object (or true/false), not {_kind(node)}")
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(
                at,
                f"the schema nests more than {MAX_SCHEMA_DEPTH} levels (MAX_SCHEMA_DEPTH); "
                "Timeshare's grammar "
                "cannot follow it that deep: flatten it (or use $defs with $ref)",
            )
        if "not" in node:
            raise SchemaError(
                f"{at}.not",
                "'not' cannot be enforced by a grammar; remove it (or describe the constraint in the prompt)",
            )
        _check_type(node, at)
        ref = node.get("$ref")
        if ref is not None:
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise SchemaError(
                    f"{at}.$ref",
                    f"only references inside the schema (#/$defs/...) are followed; {ref!r} is "
                    "remote: inline it under $defs",
                )
            _resolve(schema, ref, f"{at}.$ref")
        for key in ONE:
            if key not in node or (key == "items" and isinstance(node[key], list)):
                continue
            sub = node[key]
            if not isinstance(sub, (dict, bool)):
                raise SchemaError(
                    f"{at}.{key}", f"must be a schema (an object, or true/false), not {_kind(sub)}"
                )
            stack.append((sub, f"{at}.{key}", depth + 1))
        for key in LIST:
            if key not in node or (key == "items" and not isinstance(node[key], list)):
                continue
            subs = node[key]
            if not isinstance(subs, list) or not subs:
                raise SchemaError(f"{at}.{key}", f"must be a non-empty list of schemas, not {_kind(subs)}")
            stack.extend((s, f"{at}.{key}[{i}]", depth + 1) for i, s in enumerate(subs))
        for key in MAP:
            if key not in node:
                continue
            subs = node[key]
            if not isinstance(subs, dict):
                raise SchemaError(
                    f"{at}.{key}", f"must be an object mapping names to schemas, not {_kind(subs)}"
                )
            if key == "properties":
                properties += len(subs)
                if properties > MAX_PROPERTIES:
                    raise SchemaError(
                        f"{at}.properties",
                        f"the schema has more than {MAX_PROPERTIES} properties in all "
                        "(MAX_PROPERTIES): use fewer",
                    )
            stack.extend((s, f"{at}.{key}.{name}", depth + 1) for name, s in subs.items())
        required = node.get("required")
        if required is not None and (
            not isinstance(required, list) or not all(isinstance(r, str) for r in required)
        ):
            raise SchemaError(f"{at}.required", "must be a list of property names (strings)")
        for key in COUNTS:
            if key in node and not _whole(node[key]):
                raise SchemaError(f"{at}.{key}", f"must be a whole number of at least 0, not {node[key]!r}")
        for key in REPEATS:
            if key in node and node[key] > MAX_REPETITION:
                raise SchemaError(
                    f"{at}.{key}",
                    f"{node[key]} is more than {MAX_REPETITION} (MAX_REPETITION): the grammar writes each "
                    "repetition out; use a smaller limit, or none (then the length is not enforced)",
                )
        for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
            if low in node and high in node and node[low] > node[high]:
                raise SchemaError(
                    f"{at}.{high}", f"{node[high]} is less than {low} {node[low]}: nothing fits"
                )
        for key in NUMBERS:
            if key in node and (isinstance(node[key], bool) or not isinstance(node[key], (int, float))):
                raise SchemaError(f"{at}.{key}", f"must be a number, not {_kind(node[key])}")
        for key in ("format", "pattern", "title", "description"):
            if key in node and not isinstance(node[key], str):
                raise SchemaError(f"{at}.{key}", f"must be a string, not {_kind(node[key])}")
        if "enum" in node:
            values = node["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{at}.enum", f"must be a non-empty list of values, not {_kind(values)}")
            enum_values += len(values)
            enum_chars += sum(len(json.dumps(v)) for v in values)
        if "const" in node:
            enum_values += 1
            enum_chars += len(json.dumps(node["const"]))
        if enum_values > MAX_ENUM_VALUES:
            raise SchemaError(
                f"{at}.enum" if "enum" in node else f"{at}.const",
                f"the schema's enum and const values are more than {MAX_ENUM_VALUES} in all "
                "(MAX_ENUM_VALUES): "
                "each is an alternative of the grammar; use fewer, or a plain string",
            )
        if enum_chars > MAX_ENUM_CHARS:
            raise SchemaError(
                f"{at}.enum" if "enum" in node else f"{at}.const",
                f"the schema's enum and const values are more than {MAX_ENUM_CHARS} characters in all "
                "(MAX_ENUM_CHARS): use fewer or shorter ones",
            )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            if not (pattern.startswith("^") and pattern.endswith("$")):
                raise SchemaError(
                    f"{at}.pattern",
                    f"{pattern!r}: only patterns anchored at both ends (^...$) can be enforced; anchor it",
                )
            pattern_repetitions(pattern, f"{at}.pattern")
    # last: the limits above name the part that is too big, this one only the whole
    size = len(json.dumps(schema).encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise SchemaError(
            where,
            f"the schema is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} (MAX_SCHEMA_BYTES): "
            "make it smaller",
        )
    return SchemaSize(size, properties, enum_values, enum_chars)


def check_total(total: SchemaSize, where: str) -> None:
    """The limits applied to several schemas of one request together (a request's tools: one
    grammar holds them all)."""
    for count, limit, name, what in (
        (total.properties, MAX_PROPERTIES, "MAX_PROPERTIES", "properties"),
        (total.enum_values, MAX_ENUM_VALUES, "MAX_ENUM_VALUES", "enum and const values"),
        (total.enum_chars, MAX_ENUM_CHARS, "MAX_ENUM_CHARS", "characters of enum and const values"),
        (total.bytes, MAX_SCHEMA_BYTES, "MAX_SCHEMA_BYTES", "bytes of JSON"),
    ):
        if count > limit:
            raise SchemaError(
                where,
                f"the schemas hold {count} {what} together; at most {limit} ({name}): "
                "offer fewer or smaller ones",
            )


def _check_type(node: dict[str, Any], at: str) -> None:
    if "type" not in node:
        return
    kind = node["type"]
    names = kind if isinstance(kind, list) else [kind]
    if not names or not all(isinstance(t, str) and t in TYPES for t in names):
        raise SchemaError(
            f"{at}.type", f"must be one of {', '.join(TYPES)} (or a non-empty list of them), not {kind!r}"
        )


def _resolve(root: dict[str, Any], ref: str, where: str) -> None:
    target: Any = root
    for part in ref.lstrip("#").split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise SchemaError(where, f"{ref!r} points to nothing in the schema")
        target = target[part]
