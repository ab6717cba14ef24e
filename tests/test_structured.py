"""response_format → grammar (core/api/structured.py): what is refused with a sentence naming the
part, and what a pydantic model's schema (what the openai client's ``.parse()`` sends) becomes."""

from __future__ import annotations

from typing import Any

import pytest
from timeshare.core.api.errors import BadRequestError
from timeshare.core.api.structured import response_format_grammar, schema_grammar


def _rf(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def test_text_and_json_object() -> None:
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    grammar = response_format_grammar({"type": "json_object"})
    assert grammar is not None and "root" in grammar and "object" in grammar


def test_a_pydantic_style_schema_becomes_a_grammar() -> None:
    schema = {
        "$defs": {
            "Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}
        },
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
            "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "age": {"type": "integer", "minimum": 0},  # accepted, not enforced
        },
        "required": ["name", "pets", "nick", "age"],
        "additionalProperties": False,
    }
    grammar = response_format_grammar(_rf(schema))
    assert grammar is not None and '"\\"cat\\""' in grammar


@pytest.mark.parametrize(
    ("schema", "where", "says"),
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "properties.a.not", "'not'"),
        ({"$ref": "https://example.com/s.json"}, "schema.$ref", "remote"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "properties.a.$ref", "points to nothing"),
        ({"type": "string", "pattern": "[a-z]+"}, "schema.pattern", "anchored"),
        ({"type": "frobnicate"}, "schema.type", "must be one of"),
        ({"type": "string", "pattern": "^(?=a)b$"}, "schema", "cannot be turned into a grammar"),
        ("not a schema", "schema", "JSON object"),
    ],
)
def test_refusals_name_the_part(schema: Any, where: str, says: str) -> None:
    with pytest.raises(BadRequestError) as info:
        response_format_grammar(_rf(schema))
    assert where in info.value.message and says in info.value.message
    assert info.value.param == "response_format"


def test_overflowing_nesting_is_refused() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(20):
        schema = {"type": "array", "items": schema}
    with pytest.raises(BadRequestError, match="nests more than"):
        schema_grammar(schema)


def test_bad_response_format_shapes() -> None:
    for bad, says in (
        ({"type": "yaml"}, "'yaml' is not one of"),
        ({"type": "json_schema"}, '"name" and "schema"'),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
            "true or false",
        ),
        ("json", "must be an object"),
    ):
        with pytest.raises(BadRequestError, match=says):
            response_format_grammar(bad)
