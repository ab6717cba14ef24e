"""The CPU threads of a worker's llama.cpp context (core/worker/threads.py): llama-cpp-python's own
defaults unless ``$TIMESHARE_CPU_THREADS`` sets both counts; a bad value is refused naming the
variable. The oracle for what a context computes with is llama.cpp's own ``llama_n_threads`` /
``llama_n_threads_batch`` of the context, and a plain ``Llama`` for the defaults."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import llama_cpp
import pytest
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import ConfigError
from timeshare.core.worker.engine import Engine
from timeshare.core.worker.threads import cpu_threads


def context_threads(engine: Engine) -> tuple[int, int]:
    ctx = engine.llm.ctx
    return int(llama_cpp.llama_n_threads(ctx)), int(llama_cpp.llama_n_threads_batch(ctx))


def test_the_defaults_are_llama_cpp_pythons_and_the_worker_uses_them(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIMESHARE_CPU_THREADS", raising=False)
    plain = llama_cpp.Llama(str(smollm2_path), n_ctx=64, verbose=False)
    try:
        assert (plain.n_threads, plain.n_threads_batch) == cpu_threads()
    finally:
        plain.close()
    cpus = os.cpu_count() or 1
    assert cpu_threads() == (max(cpus // 2, 1), cpus)
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2))
    try:
        assert context_threads(engine) == cpu_threads()
    finally:
        engine.close()


def test_the_variable_sets_both_counts_of_the_workers_context(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIMESHARE_CPU_THREADS", "3")
    assert cpu_threads() == (3, 3)
    monkeypatch.setenv("TIMESHARE_CPU_THREADS", " 1 ")
    assert cpu_threads() == (1, 1)
    with caplog.at_level(logging.INFO, logger="timeshare.core.worker.engine"):
        engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2))
    assert "CPU threads 1/1 (one token/batch)" in caplog.text  # the worker's log says it
    try:
        assert context_threads(engine) == (1, 1)
        vectors, _tokens = engine.embed(["one thread embeds too"])
        assert len(vectors) == 1 and len(vectors[0]) == engine.llm.n_embd()
    finally:
        engine.close()


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "2x"])
def test_a_bad_value_is_refused_naming_the_variable(
    value: str, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESHARE_CPU_THREADS", value)
    message = f"$TIMESHARE_CPU_THREADS: {value!r} is not a thread count: give a whole number from 1"
    with pytest.raises(ConfigError) as info:
        cpu_threads()
    assert str(info.value).startswith(message)
    with pytest.raises(ConfigError) as info:  # the worker's load says it before loading anything
        Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2))
    assert str(info.value).startswith(message)
