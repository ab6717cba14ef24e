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

import pytest
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
    ],
    ids=["maxLength-100000", "nested-parens-1e5", "enum-100000"],
)
def test_the_worker_refuses_a_grammar_past_the_limits_and_lives(pool: Pool, grammar: str, says: str) -> None:
    """Before: the first two crashed the worker (llama.cpp's parser recursed once per group until
    the stack ran out), the third held it for minutes in one C call."""
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


def test_a_model_that_never_answered_still_fails_after_its_crashes(tmp_path: Path, smollm2_path: Path) -> None:
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
        assert _status(pool).state is ModelState.FAILED
    finally:
        pool.stop()


def _unused(x: object) -> str:
    return json.dumps(x)
