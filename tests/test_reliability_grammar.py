"""Grammars that cannot take a model down (issue 38 items 1-2, issue 45's root $ref).

- A request's grammar is bounded: a schema's ``maxLength: 100000`` (a grammar of 100,000 nested
  groups), 10^5 nested parentheses, an enum of 100,000 strings, wrong-shaped schemas and a
  ``pattern`` repeat of 10^20 are refused with a 400 naming the part and the limit, on every
  dialect; the worker checks every grammar again before llama.cpp parses it, so a grammar that
  reaches it by another way (here: the pool, directly) is refused there and the worker lives.
- A crash charged to one request (in flight at two crashes in a row) does not count toward
  taking the model offline (a real crash: a lazy grammar whose trigger hands it text it refuses
  makes llama.cpp abort the process).
- JSON strings exclude control characters (structured output and tools alike).
- A recursive pydantic model at the schema's root (what openai's ``.parse()`` sends) works.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from _api_util import SMOL, Served, serving, write_config
from _proc_util import wait_until
from timeshare.core.chatformat.gbnf_check import MAX_GRAMMAR_BYTES, MAX_GRAMMAR_NESTING, check_gbnf
from timeshare.core.config.schema import Config, ModelConfig
from timeshare.core.errors import InvalidGrammarError, ModelUnavailableError
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState

WAIT = 180.0
#: the grammar llama-cpp-python's converter wrote for {"type": "string", "maxLength": 100000}
#: (the shape of it: one nested optional group per character)
DEEP_STRING = (
    'root ::= "\\"" ' + "(char " * 100_000 + ")?" * 100_000 + ' "\\"" space\n'
    'char ::= [^"\\\\] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])\n'
    'space ::= " "?\n'
)
#: 10^5 nested parentheses
DEEP_PARENS = "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000 + "\n"
#: an enum of 100,000 strings, as the converter writes it (1 MB)
BIG_ENUM = "root ::= " + " | ".join(f'"\\"value{i}\\""' for i in range(100_000)) + "\n"
#: a grammar no token can follow: from the first token, or after "a"
NOTHING = "root ::= [^\\x00-\\U0010FFFF]\n"
NOTHING_AFTER_A = 'root ::= "a" [^\\x00-\\U0010FFFF]\n'


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("grammar-pool")
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path), n_ctx=1024),))
    p = Pool(config, arena_dir=tmp / "arena", log_dir=tmp / "logs", restart_backoff_s=0.05)
    p.start()
    p.wait_ready(timeout=WAIT)
    try:
        yield p
    finally:
        p.stop()


def _status(pool: Pool) -> Any:
    return next(s for s in pool.snapshot().models if s.id == "m")


def _answer(pool: Pool, grammar: str | None = None, **extra: Any) -> str:
    sampling = Sampling(max_tokens=6, grammar=grammar, **extra)
    return pool.generate("m", prompt="Say hello.", sampling=sampling).result(timeout=WAIT).text


@pytest.mark.parametrize(
    ("grammar", "says"),
    [
        (DEEP_STRING, "MAX_GRAMMAR_BYTES"),
        (DEEP_PARENS, f"nest more than {MAX_GRAMMAR_NESTING} deep"),
        (BIG_ENUM, f"at most {MAX_GRAMMAR_BYTES}"),
        (NOTHING, "allows no token"),
        (NOTHING_AFTER_A, "allows no token"),
    ],
    ids=["maxLength-100000", "nested-parens-1e5", "enum-100000", "allows-nothing", "dead-end-after-a"],
)
def test_the_worker_refuses_a_grammar_past_the_limits_and_lives(pool: Pool, grammar: str, says: str) -> None:
    """Before: the first two crashed the worker (llama.cpp's parser recursed once per group until
    the stack ran out), the third held it for minutes in one C call, the last two aborted it (the
    sampler made the grammar accept a token it had masked)."""
    pid = _status(pool).pid
    restarts = _status(pool).restarts
    with pytest.raises(InvalidGrammarError) as caught:
        _answer(pool, grammar)
    assert says in str(caught.value)
    assert _answer(pool)  # the same worker answers the next request
    status = _status(pool)
    assert status.pid == pid and status.restarts == restarts and status.state is not ModelState.FAILED


def test_check_gbnf_accepts_what_the_converter_writes_within_the_limits() -> None:
    """The limits leave room for the schemas the schema limits admit (the largest repetition)."""
    from timeshare.core.chatformat.schema_check import MAX_REPETITION
    from timeshare.core.chatformat.schema_grammar import schema_gbnf

    check_gbnf(schema_gbnf({"type": "string", "maxLength": MAX_REPETITION}, "s"))
    check_gbnf(schema_gbnf({"type": "array", "items": {"type": "integer"}, "maxItems": MAX_REPETITION}, "s"))


@pytest.mark.parametrize(
    "hiding",
    ["# a comment ended by a carriage return\r", '"a"{1,\n2} ', ") ", "{x} "],
    ids=["comment-cr", "repetition-newline", "stray-paren", "bad-repetition"],
)
def test_deep_nesting_cannot_hide_behind_what_the_scan_reads_differently(hiding: str) -> None:
    """The scan reads comments, repetitions and stray characters as llama.cpp does, or counts on
    past them: never stops early where llama.cpp's parser would go on into the nesting."""
    from timeshare.core.chatformat.gbnf_check import GrammarLimitError

    with pytest.raises(GrammarLimitError, match="MAX_GRAMMAR_NESTING"):
        check_gbnf("root ::= " + hiding + "(" * 5000 + '"a"' + ")" * 5000 + "\n")


# ---- a crash charged to one request --------------------------------------------------------------

#: a lazy grammar whose trigger fires on the first character and hands the grammar text it refuses:
#: llama.cpp throws through its C API and the worker process aborts (a real crash, every time)
ABORTS = Sampling(max_tokens=6, grammar='root ::= "\\u0001"\n', grammar_triggers=(r"^([\s\S])[\s\S]*$",))


def test_a_request_that_crashes_its_worker_twice_is_charged_and_the_model_stays_up(
    tmp_path: Path, smollm2_path: Path
) -> None:
    """One restart allowed within a minute: before, one such request (two crashes: it is sent
    again after the first) made the model FAILED for everyone; now its crashes are charged to it,
    it gets the error, and the model keeps serving, request after request."""
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path), n_ctx=512),))
    pool = Pool(
        config,
        arena_dir=tmp_path / "arena",
        log_dir=tmp_path / "logs",
        restart_backoff_s=0.05,
        max_restarts=1,
        restart_window_s=600.0,
    )
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        assert _answer(pool)  # the model works
        for _ in range(2):
            gen = pool.generate("m", prompt="Say hello.", sampling=ABORTS)
            with pytest.raises(ModelUnavailableError) as caught:
                gen.result(timeout=WAIT)
            assert "crashed twice while answering this request" in str(caught.value)
            assert "likely cause" in str(caught.value)
            assert _status(pool).state is not ModelState.FAILED
            assert _answer(pool)  # served after the restart
        assert _status(pool).restarts >= 4
    finally:
        pool.stop()


def test_a_model_that_never_answered_still_fails_after_its_crashes(
    tmp_path: Path, smollm2_path: Path
) -> None:
    """The charge is forgiven only for a model that has answered something: one that crashes on
    every request is not restarted for ever."""
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path), n_ctx=512),))
    pool = Pool(
        config,
        arena_dir=tmp_path / "arena",
        log_dir=tmp_path / "logs",
        restart_backoff_s=0.05,
        max_restarts=1,
        restart_window_s=600.0,
    )
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)
        gen = pool.generate("m", prompt="Say hello.", sampling=ABORTS)
        with pytest.raises(ModelUnavailableError):
            gen.result(timeout=WAIT)
        wait_until(lambda: _status(pool).state is ModelState.FAILED, WAIT, "the model to fail")
    finally:
        pool.stop()


# ---- schemas refused with a 400 naming the part and the limit -------------------------------------


def _rf(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


#: hostile schemas (the independent suite's cases), the part each refusal names and what it says
HOSTILE: list[tuple[str, Any, str, str]] = [
    ("maxLength-100000", {"type": "string", "maxLength": 100_000}, "schema.maxLength", "MAX_REPETITION"),
    ("minLength-100000", {"type": "string", "minLength": 100_000}, "schema.minLength", "MAX_REPETITION"),
    (
        "minItems-100000",
        {"type": "array", "items": {"type": "integer"}, "minItems": 100_000},
        "schema.minItems",
        "MAX_REPETITION",
    ),
    ("enum-100000", {"enum": [f"value-{i}" for i in range(100_000)]}, "schema.enum", "MAX_ENUM_VALUES"),
    ("enum-long", {"enum": ["x" * 20_000, "y" * 20_000, "z" * 20_000]}, "schema.enum", "MAX_ENUM_CHARS"),
    ("properties-list", {"type": "object", "properties": ["a", "b"]}, "schema.properties", "not a list"),
    ("properties-string", {"type": "object", "properties": "a"}, "schema.properties", "not a string"),
    ("items-3", {"type": "array", "items": 3}, "schema.items", "must be a schema"),
    ("anyOf-x", {"anyOf": "x"}, "schema.anyOf", "non-empty list of schemas"),
    (
        "required-3",
        {"type": "object", "properties": {}, "required": 3},
        "schema.required",
        "list of property",
    ),
    ("maxLength-text", {"type": "string", "maxLength": "10"}, "schema.maxLength", "whole number"),
    (
        "pattern-1e20",
        {"type": "string", "pattern": "^a{0,100000000000000000000}$"},
        "schema.pattern",
        "MAX_REPETITION",
    ),
    (
        "nested-properties",
        {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"items": "x"}}}}},
        "schema.properties.a.properties.b.items",
        "must be a schema",
    ),
    (
        "properties-1000",
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}},
        "schema.properties",
        "MAX_PROPERTIES",
    ),
    ("big", {"type": "object", "description": "x" * 200_000}, "schema", "MAX_SCHEMA_BYTES"),
]


@pytest.mark.parametrize(("schema", "where", "says"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_schema_is_refused_naming_the_part_and_the_limit(
    schema: Any, where: str, says: str
) -> None:
    from timeshare.core.api.errors import BadRequestError
    from timeshare.core.api.structured import response_format_grammar

    with pytest.raises(BadRequestError) as caught:
        response_format_grammar(_rf(schema))
    assert f"response_format.json_schema.{where}:" in caught.value.message
    assert says in caught.value.message


def test_the_limits_apply_to_a_request_s_tools_together() -> None:
    """128 tools each under the limits were minutes of grammar building in the API process."""
    from timeshare.core.api.errors import BadRequestError
    from timeshare.core.api.tools import ChatFormat, parse_tool_request, plan
    from timeshare.core.chatformat.families import FAMILIES
    from timeshare.core.chatformat.schema_check import MAX_PROPERTIES

    params = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_PROPERTIES)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(128)]
    request = parse_tool_request({"tools": tools, "tool_choice": "required"})
    with pytest.raises(BadRequestError) as caught:
        plan(request, ChatFormat(FAMILIES["hermes"], thinks=False, starts_thinking=False, template=True))
    assert caught.value.param == "tools" and "MAX_PROPERTIES" in caught.value.message


def test_a_grammar_extension_of_nested_parentheses_is_refused_at_the_api() -> None:
    from timeshare.core.api.errors import BadRequestError
    from timeshare.core.api.requests import parse_chat_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "grammar": DEEP_PARENS}
    with pytest.raises(BadRequestError) as caught:
        parse_chat_request(body)
    assert caught.value.param == "grammar" and "MAX_GRAMMAR_NESTING" in caught.value.message


def test_a_json_string_excludes_control_characters_in_both_grammars() -> None:
    """The rule itself: llama.cpp's (the converter's own allowed any character but " and \\)."""
    from timeshare.core.api.structured import schema_grammar
    from timeshare.core.chatformat.families import FAMILIES
    from timeshare.core.chatformat.grammar import tool_grammar
    from timeshare.core.chatformat.schema_grammar import JSON_CHAR

    rule = f"char ::= {JSON_CHAR}"
    assert "\\x00-\\x1F" in JSON_CHAR
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert rule in schema_grammar(person).splitlines()
    tools = tool_grammar(FAMILIES["hermes"], [{"name": "f", "parameters": person}], parallel=False)
    assert rule in tools.splitlines()


# ---- over HTTP: every dialect, the real clients ---------------------------------------------------

LONG = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 100_000}}, "required": ["a"]}
HI = [{"role": "user", "content": "hi"}]
DIALECTS: list[tuple[str, str, dict[str, Any], str]] = [
    ("openai-response_format", "/v1/chat/completions", {"response_format": _rf(LONG)}, "MAX_REPETITION"),
    (
        "openai-tools",
        "/v1/chat/completions",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": LONG}}],
            "tool_choice": "required",
        },
        "MAX_REPETITION",
    ),
    ("openai-grammar", "/v1/chat/completions", {"grammar": DEEP_PARENS}, "MAX_GRAMMAR_NESTING"),
    ("ollama-format", "/api/chat", {"format": LONG, "stream": False}, "MAX_REPETITION"),
    (
        "ollama-tools",
        "/api/chat",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": LONG}}], "stream": False},
        "MAX_REPETITION",
    ),
    (
        "anthropic-output_config",
        "/v1/messages",
        {"output_config": {"format": {"type": "json_schema", "schema": LONG}}},
        "MAX_REPETITION",
    ),
    ("anthropic-tools", "/v1/messages", {"tools": [{"name": "f", "input_schema": LONG}]}, "MAX_REPETITION"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("grammar-home")
    config = write_config(home / "elsewhere" / "timeshare.toml", [(SMOL, smollm2_path)])
    with serving(home, config=config) as server:
        server.wait_ready([SMOL])
        yield server


def _post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, headers=served.headers(), timeout=WAIT)


def test_every_dialect_refuses_a_100_byte_schema_that_crashed_the_worker(served: Served) -> None:
    """Before: a 503 "crashed again before answering" on every dialect, and a few of them within a
    minute made the model FAILED for everyone."""
    pid = served.model_status(SMOL)["pid"]
    for name, path, extra, says in DIALECTS:
        body = {"model": SMOL, "messages": HI, "max_tokens": 4, **extra}
        answer = _post(served, path, body)
        assert answer.status_code == 400, (name, answer.text)
        assert says in answer.text, (name, answer.text)
    ok = _post(
        served, "/v1/chat/completions", {"model": SMOL, "messages": HI, "max_tokens": 4, "temperature": 0}
    )
    assert ok.status_code == 200, ok.text
    status = served.model_status(SMOL)
    assert status["pid"] == pid and status["restarts"] == 0


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
EXTRACT = [{"role": "user", "content": "Extract the person: Bob is 42 years old."}]
#: SmolLM2's "\n" token, pushed up: wherever the grammar lets a raw newline in, it is chosen
NEWLINE_BIAS = {"198": 100}


def _no_control_characters(text: str) -> None:
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text), repr(text)


def test_structured_output_strings_hold_no_control_characters(served: Served) -> None:
    """The issue's reproduction (greedy, 40 tokens), and the same with the newline pushed up."""
    for bias in ({}, NEWLINE_BIAS):
        body = {
            "model": SMOL,
            "messages": EXTRACT,
            "max_tokens": 40,
            "temperature": 0,
            "logit_bias": bias,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        }
        answer = _post(served, "/v1/chat/completions", body)
        assert answer.status_code == 200, answer.text
        content = answer.json()["choices"][0]["message"]["content"]
        _no_control_characters(content)
        if answer.json()["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(content), PERSON)


def test_tool_call_arguments_hold_no_control_characters(served: Served) -> None:
    body = {
        "model": SMOL,
        "messages": EXTRACT,
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": NEWLINE_BIAS,
        "tools": [{"type": "function", "function": {"name": "record_person", "parameters": PERSON}}],
        "tool_choice": "required",
    }
    answer = _post(served, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    for call in message.get("tool_calls") or []:
        _no_control_characters(call["function"]["arguments"])
    _no_control_characters(message.get("content") or "")


class Node(pydantic.BaseModel):
    """A recursive model: its JSON schema is ``{"$defs": {"Node": ...}, "$ref": "#/$defs/Node"}``,
    the recursion at the schema's root."""

    value: int
    children: list[Node]


TREE = [{"role": "user", "content": "Write a tree: the root has value 1 and no children."}]


def test_a_recursive_pydantic_model_at_the_root_gives_valid_output(served: Served) -> None:
    """Before: a 400 (the converter never looked inside the root's $defs). The schema as pydantic
    writes it (what the ollama client's ``format=Model.model_json_schema()`` and others send), on
    both dialects, and openai's ``.parse()`` (this SDK version inlines the root before sending)."""
    schema = Node.model_json_schema()
    assert schema["$ref"] == "#/$defs/Node"  # the shape this test is about
    body = {"model": SMOL, "messages": TREE, "max_tokens": 200, "temperature": 0}
    answer = _post(served, "/v1/chat/completions", {**body, "response_format": _rf(schema)})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), schema)
    ollama = {"model": SMOL, "messages": TREE, "format": schema, "stream": False}
    answer = _post(served, "/api/chat", {**ollama, "options": {"temperature": 0, "num_predict": 200}})
    assert answer.status_code == 200, answer.text
    jsonschema.validate(json.loads(answer.json()["message"]["content"]), schema)

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=WAIT)
    completion = client.beta.chat.completions.parse(
        model=SMOL, messages=TREE, response_format=Node, temperature=0, max_tokens=200
    )
    choice = completion.choices[0]
    assert isinstance(choice.message.parsed, Node), choice
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
