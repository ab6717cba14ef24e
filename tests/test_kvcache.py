"""The KV cache a model needs, from its GGUF metadata (core/gguf/kvcache.py), against llama.cpp's
own: the KV buffers the worker's engine makes for the demo models (its log's "KV buffer size" and
cell counts, captured with a log callback), at one and several sequences, with the padding
llama.cpp adds; and the remote read of a file's metadata with a Range request."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timeshare.core.gguf.header import parse_metadata
from timeshare.core.gguf.kvcache import KvShape, kv_shape, padded_cells

KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\)"
)


def _metadata(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return parse_metadata(data, len(data))[4]


@pytest.fixture
def llama_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the test runs (whatever ``verbose`` says)."""
    import llama_cpp
    from llama_cpp import _logger

    lines: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[misc]
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _engine_kv(path: Path, n_ctx: int, parallel: int, log: list[str]) -> tuple[float, int]:
    """(KV MiB, cells) of the context the worker's engine makes: the last cache(s) the log shows
    (an iSWA model has two: its full-attention and its sliding-window layers)."""
    from timeshare.core.config.schema import ModelConfig
    from timeshare.core.worker.engine import Engine

    del log[:]
    engine = Engine.load(ModelConfig(id="m", path=str(path), n_ctx=n_ctx, parallel=parallel))
    try:
        assert engine.parallel == parallel
    finally:
        engine.close()
    text = "".join(log)
    # a context of several sequences is made twice (the constructor's, then the engine's): the last
    made = text.rsplit("llama_context: n_seq_max", 1)[-1]
    caches = KV_LINE.findall(made)
    assert caches, text[-2000:]
    assert all(int(seqs) == parallel for *_, seqs, _total in caches)
    cells = {int(c[1]) for c in caches}
    assert len(cells) == 1  # swa_full: the sliding-window layers have the whole context too
    return sum(float(c[0]) for c in caches), cells.pop() * parallel


@pytest.mark.parametrize(("n_ctx", "parallel"), [(2048, 1), (1000, 3)])
def test_smollm2_kv_is_llama_cpps(
    smollm2_path: Path, llama_log: list[str], n_ctx: int, parallel: int
) -> None:
    shape = kv_shape(_metadata(smollm2_path))
    assert shape == KvShape(layers=30, head_count_kv=3, key_length=64, value_length=64)
    mib, cells = _engine_kv(smollm2_path, n_ctx, parallel, llama_log)
    assert cells == padded_cells(n_ctx, parallel)  # 1000 x 3 -> 3072: rounded up to 256
    assert abs(shape.bytes(n_ctx, parallel) / 2**20 - mib) < 0.01  # the log's two decimals


def test_gemma3_kv_counts_its_sliding_window_layers_in_full(gemma3_path: Path, llama_log: list[str]) -> None:
    values = _metadata(gemma3_path)
    assert values["gemma3.attention.sliding_window"] == 512
    shape = kv_shape(values)
    assert isinstance(shape, KvShape) and shape.layers == 18 and shape.key_length == 256
    mib, cells = _engine_kv(gemma3_path, 2048, 2, llama_log)
    assert cells == 4096
    assert abs(shape.bytes(2048, 2) / 2**20 - mib) < 0.01


def test_shapes_without_a_plain_kv_cache_say_why() -> None:
    assert kv_shape({}) == "the file names no architecture"
    assert "recurrent" in str(kv_shape({"general.architecture": "mamba", "mamba.ssm.conv_kernel": 4}))
    assert "MLA" in str(
        kv_shape({"general.architecture": "deepseek2", "deepseek2.attention.kv_lora_rank": 512})
    )
    assert "block_count" in str(kv_shape({"general.architecture": "llama"}))
    per_layer = {
        "general.architecture": "openelm",
        "openelm.block_count": 2,
        "openelm.attention.head_count": ("array", 2),
        "openelm.attention.head_count_kv": ("array", 2),
    }
    assert isinstance(kv_shape(per_layer), str)
    # no head_count_kv: as many as the query heads; no key_length: embedding / heads
    assert kv_shape(
        {
            "general.architecture": "llama",
            "llama.block_count": 2,
            "llama.attention.head_count": 4,
            "llama.embedding_length": 256,
        }
    ) == KvShape(2, 4, 64, 64)
