"""The KV cache a model's context needs, from its GGUF metadata (no llama objects).

What the worker's llama.cpp (llama-cpp-python 0.3.36) allocates: for every layer, K and V of
``n_head_kv × key_length`` and ``n_head_kv × value_length`` elements per cell, of the context's
cache type (``models[].kv_cache_type``: f16, 2 bytes an element, unless set; q8_0 and q4_0 are
blocks of 32 elements of 34 and 18 bytes: :data:`KV_TYPES`), for ``n_ctx ×
parallel`` cells (a context of ``parallel`` sequences, each with the model's whole ``n_ctx``:
``worker.engine``). Sliding-window layers (Gemma-3) are counted at the full context too: the
context defaults to ``swa_full`` (llama.cpp's "using full-size SWA cache"), which the worker keeps.
llama.cpp rounds the cells up to a multiple of 256 (``padded_cells``). Checked against llama.cpp's
own KV buffer sizes in tests/test_kvcache.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: bytes of one cached element of the default type (f16)
ELEMENT_BYTES = 2
#: the KV cache types a model may use (``models[].kv_cache_type``, for K and V alike): the bytes of
#: one block and the elements it holds (ggml's type traits), and the ggml type number
#: (llama-cpp-python's ``type_k``/``type_v``)
KV_TYPES: dict[str, tuple[int, int, int]] = {"f16": (2, 1, 1), "q8_0": (34, 32, 8), "q4_0": (18, 32, 2)}
DEFAULT_KV_TYPE = "f16"


def kv_row_bytes(elements: int, kv_type: str = DEFAULT_KV_TYPE) -> int:
    """Bytes of ``elements`` cached elements of ``kv_type`` (ggml_row_size). ValueError for a type
    that is not one of :data:`KV_TYPES`, or a count that is not whole blocks."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r}: use {', '.join(repr(t) for t in KV_TYPES)}")
    block_bytes, block, _ = KV_TYPES[kv_type]
    if elements % block:
        raise ValueError(f"{elements} elements are not whole {kv_type} blocks of {block}")
    return elements // block * block_bytes


#: llama.cpp rounds a context's cells up to a multiple of this
CELL_PAD = 256


@dataclass(frozen=True)
class KvShape:
    """One model's KV cache per cell (a token of one sequence)."""

    layers: int
    head_count_kv: int
    key_length: int
    value_length: int

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes()

    def token_bytes(self, kv_type: str = DEFAULT_KV_TYPE, layers: int | None = None) -> int:
        """One cell's K and V bytes of ``kv_type`` over ``layers`` layers (None: all of them)."""
        n = self.layers if layers is None else max(0, min(layers, self.layers))
        k = kv_row_bytes(self.head_count_kv * self.key_length, kv_type)
        v = kv_row_bytes(self.head_count_kv * self.value_length, kv_type)
        return n * (k + v)

    def bytes(
        self, n_ctx: int, parallel: int, kv_type: str = DEFAULT_KV_TYPE, layers: int | None = None
    ) -> int:
        """The KV bytes of a context of ``parallel`` sequences of ``n_ctx`` tokens each (of
        ``layers`` layers: those on the GPU, when not all are)."""
        return self.token_bytes(kv_type, layers) * padded_cells(n_ctx, parallel)


def padded_cells(n_ctx: int, parallel: int) -> int:
    """The cells llama.cpp makes for ``parallel`` sequences of ``n_ctx``: n_ctx × parallel rounded
    up to CELL_PAD, split evenly over the sequences (a non-unified cache's streams)."""
    total = -(-(n_ctx * parallel) // CELL_PAD) * CELL_PAD
    return total // parallel * parallel


def _count(values: dict[str, Any], key: str) -> int | None:
    v = values.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def kv_shape(values: dict[str, Any]) -> KvShape | str:
    """The KV shape from a GGUF's metadata (``header.parse_metadata``'s values), or why it cannot
    be told (a sentence: no estimate is made for an architecture whose cache is not plain K/V)."""
    arch = values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return "the file names no architecture"
    if any(k.startswith(f"{arch}.ssm.") or k.startswith(f"{arch}.wkv.") for k in values):
        return f"{arch} keeps a recurrent state, not a KV cache"
    if f"{arch}.attention.kv_lora_rank" in values:
        return f"{arch} compresses its KV cache (MLA)"
    layers = _count(values, f"{arch}.block_count")
    heads = _count(values, f"{arch}.attention.head_count")
    if layers is None or heads is None:
        return f"the file has no {arch}.block_count or {arch}.attention.head_count"
    kv_key = f"{arch}.attention.head_count_kv"
    if kv_key in values and _count(values, kv_key) is None:
        return f"{kv_key} varies by layer"
    heads_kv = _count(values, kv_key) or heads
    key_length = _count(values, f"{arch}.attention.key_length")
    value_length = _count(values, f"{arch}.attention.value_length")
    if key_length is None or value_length is None:
        embd = _count(values, f"{arch}.embedding_length")
        if embd is None or embd % heads:
            return f"the file has no {arch}.attention.key_length and no usable {arch}.embedding_length"
        key_length = key_length or embd // heads
        value_length = value_length or embd // heads
    return KvShape(layers, heads_kv, key_length, value_length)
