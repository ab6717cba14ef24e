"""Embeddings in the worker (core/worker/embed.py, Engine.embed) on the real SmolLM2 demo model,
against llama-cpp-python's own ``Llama(embedding=True, pooling_type=MEAN).embed``: a chat model
embeds without losing a conversation's KV, and a model entry with ``embedding = true`` embeds too
and answers nothing else. Batches (issue 45): inputs packed several to a decode, in sequences of
their own, give each input's vector alone (the oracle embeds each input by itself), with llama.cpp's
pooling too."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import InvalidInputError, InvalidSamplingError, PromptTooLongError
from timeshare.core.sampling import Sampling
from timeshare.core.wire.protocol import ChatMessage, Generate
from timeshare.core.worker.embed import embed_tokens, pack
from timeshare.core.worker.engine import Engine

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "日本語"]
#: inputs of many lengths, some alike (one decode packs like lengths), one of a few hundred tokens
MANY = [
    *TEXTS,
    "cat",
    "dog",
    "A bird in the hand is worth two in the bush.",
    "Embeddings turn text into vectors.",
    "Le chat est sur la table, et le chien dort.",
    "Timeshare keeps several models loaded and shares one GPU between them.",
    "one two three four five six seven eight nine ten",
    "Σ ∫ √ ∞ ≈ ≠",
    " ".join(f"word{i}" for i in range(120)),
    "Short.",
    "Another short one.",
]
#: a vector may differ from the oracle's by this much (cosine distance): the oracle's context is
#: another (one sequence, llama.cpp's repacked CPU kernels), so its last bits may differ
COSINE_TOLERANCE = 1e-5


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


def _cosine_distance(a: Any, b: Any) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(1.0 - x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def test_a_chat_model_packs_inputs_into_its_sequences(smollm2_path: Path, oracle: Any) -> None:
    """Four sequences: each decode holds up to four inputs; every vector is the input's own alone
    (the oracle, per input), bit for bit what the same engine gives it alone, and a conversation
    in one of the sequences survives (kept on the host while its sequence embedded)."""
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=1024, parallel=4))
    try:
        assert engine.parallel == 4
        history = [ChatMessage("user", "Name a colour.")]
        first = engine.generate(
            Generate(req="a", messages=tuple(history), conversation="c", sampling=Sampling(max_tokens=8)),
            lambda _: None,
        )
        steps: list[int] = []
        vectors, n = engine.embed(MANY, lambda: steps.append(1))
        lengths = [len(oracle.tokenize(t.encode())) for t in MANY]
        assert n == sum(lengths)
        decodes = len(steps) - 1  # before_step runs once first (residency), then before each decode
        assert decodes == len(pack(lengths, int(engine.llm.n_batch), 4)) < len(MANY)
        for text, vector in zip(MANY, vectors, strict=True):
            assert _cosine_distance(vector, oracle.embed(text, normalize=True)) < COSINE_TOLERANCE, text
        alone = [engine.embed([text])[0][0] for text in MANY]
        assert [np.asarray(v).tobytes() for v in vectors] == [np.asarray(v).tobytes() for v in alone]
        history += [ChatMessage("assistant", first.text), ChatMessage("user", "Another.")]
        second = engine.generate(
            Generate(req="b", messages=tuple(history), conversation="c", sampling=Sampling(max_tokens=4)),
            lambda _: None,
        )
        assert second.prompt_tokens_evaluated < second.prompt_tokens - first.prompt_tokens
    finally:
        engine.close()


def test_an_embedding_model_entry_packs_inputs(smollm2_path: Path, oracle: Any) -> None:
    engine = Engine.load(ModelConfig(id="emb", path=str(smollm2_path), n_ctx=512, embedding=True, parallel=4))
    try:
        steps: list[int] = []
        vectors, _ = engine.embed(MANY, lambda: steps.append(1))
        assert len(steps) - 1 < len(MANY)
        alone = [engine.embed([text])[0][0] for text in MANY]
        assert vectors == alone  # bit for bit
        for text, vector in zip(MANY, vectors, strict=True):
            assert _cosine_distance(vector, oracle.embed(text, normalize=True)) < COSINE_TOLERANCE, text
    finally:
        engine.close()


@contextlib.contextmanager
def _pooled_context(path: Path, pooling: int, sequences: int) -> Iterator[Any]:
    """A Llama whose context pools in llama.cpp (``pooling``) over ``sequences`` KV streams, as the
    worker makes a context of several sequences (engine._sequences)."""
    from llama_cpp import _internals

    llm = llama_cpp.Llama(
        str(path), n_ctx=512 * sequences, embedding=True, pooling_type=pooling, verbose=False
    )
    params = llm.context_params
    params.n_seq_max = sequences
    params.kv_unified = False
    llm._ctx.close()
    llm._ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    try:
        yield llm
    finally:
        llm._ctx.close()
        llm.close()


@pytest.mark.parametrize(
    "pooling",
    [llama_cpp.LLAMA_POOLING_TYPE_MEAN, llama_cpp.LLAMA_POOLING_TYPE_LAST, llama_cpp.LLAMA_POOLING_TYPE_CLS],
)
def test_llama_cpp_pooling_over_several_sequences(smollm2_path: Path, pooling: int) -> None:
    """Where llama.cpp pools, a decode of several KV streams packs only inputs of one length (a
    pooled sequence split over micro-batches would get the pooling of its last part only)."""
    solo = llama_cpp.Llama(str(smollm2_path), n_ctx=512, embedding=True, pooling_type=pooling, verbose=False)
    try:
        tokens = [list(solo.tokenize(t.encode())) for t in MANY]
        want = [solo.embed(t, normalize=True) for t in MANY]
    finally:
        solo.close()
    with _pooled_context(smollm2_path, pooling, 4) as llm:
        vectors = embed_tokens(llm, tokens, seq_ids=range(4))
    for text, got, expected in zip(MANY, vectors, want, strict=True):
        assert _cosine_distance(got, expected) < COSINE_TOLERANCE, text


def test_pack() -> None:
    assert pack([5, 1, 3, 1], limit=10, n_seq=4) == [[1, 3, 2, 0]]
    assert pack([5, 1, 3, 1], limit=6, n_seq=4) == [[1, 3, 2], [0]]
    assert pack([5, 1, 3, 1], limit=10, n_seq=2) == [[1, 3], [2, 0]]
    assert pack([5, 1, 3, 1, 3], limit=10, n_seq=4, equal=True) == [[1, 3], [2, 4], [0]]
