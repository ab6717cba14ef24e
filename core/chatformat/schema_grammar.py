"""A JSON schema as a GBNF grammar: llama-cpp-python's ``llama_grammar.SchemaConverter`` (the
Python port of llama.cpp's converter, whose C++ original is not in the shipped libraries), loaded
from its file without the ``llama_cpp`` package (whose import loads libllama: the API process,
which builds the grammars, never loads llama.cpp), with two corrections:

- **JSON strings exclude control characters.** The port's ``char`` rule excludes only ``"`` and
  ``\\``, so a model could write raw newlines inside a string (SmolLM2 did, until ``max_tokens``)
  and clients failed with "Invalid control character". Here it is llama.cpp's: ``\\x00-\\x1F`` and
  ``\\x7F`` excluded (as in ``JSON_GBNF``), ``\\/`` kept among the escapes. A ``pattern``'s ``.``
  likewise excludes them, and ``"`` and ``\\``.
- **A ``$ref`` at the root is followed**: the port resolved the root's reference but never looked
  inside its ``$defs``, so a recursive model at the root (what ``client.beta.chat.completions.parse``
  sends for a recursive pydantic model) failed. The root ``{"$ref": R, "$defs": ...}`` is read as
  ``{"anyOf": [{"$ref": R}], "$defs": ...}``: the same language (the port ignores a ``$ref``'s
  siblings), and every reference is resolved.

``schema_gbnf`` checks the schema first (``schema_check``) and the grammar after
(``gbnf_check``): both raise ``SchemaError``/``GrammarLimitError`` (ValueErrors naming the part).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from typing import Any

from .gbnf_check import check_gbnf
from .schema_check import SchemaError, check_schema

#: llama.cpp's JSON string character (json-schema-to-grammar.cpp, JSON_GBNF), ``\/`` kept
JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
#: a pattern's ``.``: any character a JSON string may hold raw
JSON_DOT = r'[^"\\\x7F\x00-\x1F]'
#: what the converter raises on a schema it cannot handle
CONVERTER_ERRORS = (
    AssertionError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    RecursionError,
)


class ConverterMissingError(RuntimeError):
    """llama-cpp-python is not installed (the grammars need its ``llama_grammar``)."""


@cache
def llama_grammar() -> Any:
    """Timeshare's own copy of llama-cpp-python's ``llama_grammar`` module (pure Python), loaded
    from its file without importing the ``llama_cpp`` package, its JSON string rule corrected
    (see the module docstring). ``llama_cpp.llama_grammar`` itself is left as it is."""
    name = "timeshare_llama_grammar"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("llama_cpp")  # found, not imported
    if package is None or not package.submodule_search_locations:
        raise ConverterMissingError("llama-cpp-python is not installed: grammars need its llama_grammar")
    path = f"{next(iter(package.submodule_search_locations))}/llama_grammar.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConverterMissingError(f"cannot load {path}")
    module: Any = importlib.util.module_from_spec(spec)  # the port's names are untyped
    spec.loader.exec_module(module)
    char = module.PRIMITIVE_RULES["char"]
    module.PRIMITIVE_RULES["char"] = module.BuiltinRule(JSON_CHAR, list(char.deps))
    module.DOT = JSON_DOT
    sys.modules[name] = module
    return module


def new_converter() -> Any:
    """A fresh converter with ``json_schema_to_gbnf``'s settings (untyped: the port's class)."""
    make: Any = llama_grammar().SchemaConverter
    return make(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def root_ref_followed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with a root ``$ref`` read as a one-way ``anyOf`` (see the module docstring)."""
    if "$ref" not in schema:
        return schema
    out = {k: v for k, v in schema.items() if k in ("$defs", "definitions")}
    out["anyOf"] = [{"$ref": schema["$ref"]}]
    return out


def hoist_defs(schema: dict[str, Any], tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A copy of ``schema`` without its root ``$defs``/``definitions``, and those definitions
    renamed ``{tag}-defs-NAME`` / ``{tag}-definitions-NAME``, every ``#/$defs/NAME...`` reference
    in both rewritten to match: for a schema placed inside another (a tool's parameters inside
    the call object), whose references the converter resolves from the outer root."""
    schema = json.loads(json.dumps(schema))
    moved: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        block = schema.pop(key, None)
        if isinstance(block, dict):
            for name, sub in block.items():
                moved[f"{tag}-{key.lstrip('$')}-{name}"] = sub
    if not moved:
        return schema, moved
    stack: list[Any] = [schema, moved]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                for key in ("$defs", "definitions"):
                    head = f"#/{key}/"
                    if ref.startswith(head):
                        node["$ref"] = f"#/$defs/{tag}-{key.lstrip('$')}-{ref[len(head) :]}"
            stack.extend(v for k, v in node.items() if k != "$ref")
    return schema, moved


def convert(converter: Any, schema: dict[str, Any], name: str, url: str) -> None:
    """Add the rules of ``schema`` to ``converter`` as rule ``name`` (the root ``$ref`` followed);
    raises the converter's own errors (``CONVERTER_ERRORS``)."""
    schema = converter.resolve_refs(root_ref_followed(schema), url)
    converter.visit(schema, name)


def schema_gbnf(schema: object, where: str) -> str:
    """The GBNF grammar (root ``root``) of a JSON schema; SchemaError naming ``where`` when it is
    refused (shape, limits, what the converter cannot do), GrammarLimitError when the grammar is
    over gbnf_check's limits."""
    check_schema(schema, where)
    assert isinstance(schema, dict)
    converter = new_converter()
    try:
        # a copy: the converter rewrites the $refs it resolves
        convert(converter, json.loads(json.dumps(schema)), "", "schema")
        grammar = str(converter.format_grammar())
    except CONVERTER_ERRORS as exc:
        raise SchemaError(
            where, f"the schema cannot be turned into a grammar ({exc or type(exc).__name__})"
        ) from None
    check_gbnf(grammar, where)
    return grammar
