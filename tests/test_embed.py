"""Embeddings in the worker (core/worker/embed.py, Engine.embed) on the real SmolLM2 demo model,
against llama-cpp-python's own ``Llama(embedding=True, pooling_type=MEAN).embed``: a chat model
embeds without losing a conversation's KV, and a model entry with ``embedding = true`` embeds too
and answers nothing else."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import InvalidInputError, InvalidSamplingError, PromptTooLongError
from timeshare.core.sampling import Sampling
from timeshare.core.worker.engine import Engine
from timeshare.core.worker.protocol import ChatMessage, Generate

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "日本語"]


@pytest.fixture(scope="module")
def oracle(smollm2_path: Path) -> Iterator[Any]:
    llm = llama_cpp.Llama(
        str(smollm2_path),
        n_ctx=512,
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        verbose=False,
    )
    yield llm
    llm.close()


def _close(a: list[list[float]], b: Any) -> None:
    assert np.asarray(a).shape == np.asarray(b).shape
    assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-5


def test_a_chat_model_embeds_and_keeps_its_conversation(smollm2_path: Path, oracle: Any) -> None:
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=1024))
    try:
        history = [ChatMessage("user", "Name a colour.")]
        first = engine.generate(
            Generate(req="a", messages=tuple(history), conversation="c", sampling=Sampling(max_tokens=8)),
            lambda _: None,
        )
        vectors, n = engine.embed(TEXTS)
        want = [oracle.embed(t, normalize=True) for t in TEXTS]
        _close(vectors, want)
        assert n == sum(len(oracle.tokenize(t.encode())) for t in TEXTS)
        assert all(abs(np.linalg.norm(v) - 1.0) < 1e-9 for v in vectors)
        tokens = [list(oracle.tokenize(t.encode())) for t in TEXTS[:2]]
        _close(engine.embed(tokens)[0], want[:2])  # token arrays: the same vectors
        # the conversation's KV survived: the next turn evaluates only its new tokens
        history += [ChatMessage("assistant", first.text), ChatMessage("user", "Another.")]
        second = engine.generate(
            Generate(req="b", messages=tuple(history), conversation="c", sampling=Sampling(max_tokens=4)),
            lambda _: None,
        )
        assert second.prompt_tokens_evaluated < second.prompt_tokens - first.prompt_tokens
        with pytest.raises(InvalidInputError, match="vocabulary") as bad:  # not a sampling setting
            engine.embed([[10**7]])
        assert bad.value.code == "invalid_input" and str(bad.value).startswith("input: token 10000000")
        with pytest.raises(PromptTooLongError, match="at most"):
            engine.embed(["word " * 2000])
    finally:
        engine.close()


def test_an_embedding_model_entry(smollm2_path: Path, oracle: Any) -> None:
    engine = Engine.load(ModelConfig(id="emb", path=str(smollm2_path), n_ctx=512, embedding=True))
    try:
        vectors, _ = engine.embed(TEXTS)
        _close(vectors, oracle.embed(TEXTS, normalize=True))
        with pytest.raises(InvalidSamplingError, match="embedding model"):
            engine.generate(
                Generate(req="x", prompt="Hello", sampling=Sampling(max_tokens=4)), lambda _: None
            )
    finally:
        engine.close()
