"""The KV cache a model's context needs, from its GGUF metadata (no llama objects).

What the worker's llama.cpp (llama-cpp-python 0.3.36) allocates: for every layer, K and V of
``n_head_kv × key_length`` and ``n_head_kv × value_length`` elements per cell, f16 (2 bytes: the
worker sets no ``type_k``/``type_v``; flash attention does not change them), for ``n_ctx ×
parallel`` cells (a context of ``parallel`` sequences, each with the model's whole ``n_ctx``:
``worker.engine``). Sliding-window layers (Gemma-3) are counted at the full context too: the
context defaults to ``swa_full`` (llama.cpp's "using full-size SWA cache"), which the worker keeps.
llama.cpp rounds the cells up to a multiple of 256 (``padded_cells``). Checked against llama.cpp's
own KV buffer sizes in tests/test_kvcache.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: bytes of one cached element (f16: the worker's K and V type)
ELEMENT_BYTES = 2
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
        return self.layers * self.head_count_kv * (self.key_length + self.value_length) * ELEMENT_BYTES

    def bytes(self, n_ctx: int, parallel: int) -> int:
        """The KV bytes of a context of ``parallel`` sequences of ``n_ctx`` tokens each."""
        return self.bytes_per_token * padded_cells(n_ctx, parallel)


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
