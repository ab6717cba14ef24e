"""The KV cache's layout as the pinned build keeps it (llama-cpp-python 0.3.36), read once for the
two ways the cells in use travel: saved to host memory at a deep release (residency/kvsave.py) and
written back layer by layer at its restore (residency/kvupload.py).

- the cells' metadata of each stream (``llama_kv_cache::get_cells(stream)``: class llama_kv_cells,
  llama-kv-cells.h): the ``pos`` of every cell (-1: empty) and the set of sequences of each;
- each layer's K and V tensors (found by residency/kvbuffer.py): type, row bytes (``nb[1]``, or
  a transposed V's element bytes ``nb[0]``), the stride between streams (``nb[2]``) and a
  transposed V's rows (``ne[0]``, the V embedding: one row per value, each holding every cell).

Anything that does not read as the pinned build's raises :class:`KvLayoutUnsupportedError`."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _ggml
from .kvbuffer import KvBuffers

_GET_SIZE = "_ZNK14llama_kv_cache8get_sizeEv"
_GET_N_STREAM = "_ZNK14llama_kv_cache12get_n_streamEv"
_GET_CELLS = "_ZNK14llama_kv_cache9get_cellsEi"
#: class llama_kv_cells (llama-kv-cells.h): bool has_shift; std::set<uint32_t> used, whose node
#: count is at +0x30; then the vectors (begin, end, capacity) pos at +0x38 (i32 per cell), ext at
#: +0x50 (llama_kv_cell_ext: 12 bytes), shift at +0x68 (i32) and seq at +0x80 (std::bitset of
#: LLAMA_MAX_SEQ = 256 bits: 32 bytes per cell)
_CELLS_USED = 0x30
_CELLS_POS = 0x38
_CELLS_EXT = 0x50
_CELLS_SHIFT = 0x68
_CELLS_SEQ = 0x80
_EXT_BYTES = 12
_SEQ_BYTES = 32
#: ggml_tensor (ggml.h): enum ggml_type type at 0; size_t nb[4] after int64_t ne[4]
TENSOR_TYPE = 0
TENSOR_NB = 48

I32Array = np.ndarray[tuple[int], np.dtype[np.int32]]


class KvLayoutUnsupportedError(Exception):
    """The KV cache does not read as the pinned build's (the reason says why)."""


def _bind(name: str, restype: Any, *argtypes: Any) -> Any:
    fn = _ggml.bind_optional(name, restype, *argtypes)
    if fn is None:
        raise KvLayoutUnsupportedError(f"this llama.cpp build does not export {name}")
    return fn


def _vector(cells: int, at: int, n: int, item: int, what: str) -> int:
    """The first element's address of the std::vector at ``cells + at``, checked to hold ``n``
    elements of ``item`` bytes."""
    begin, end = _ggml.read_ptr(cells + at), _ggml.read_ptr(cells + at + 8)
    if not begin or end - begin != item * n:
        raise KvLayoutUnsupportedError(f"the KV cells' layout is not the pinned build's ({what})")
    return begin


def _cells(memory: int) -> tuple[int, list[int]]:
    """The cells per stream and the address of each stream's llama_kv_cells."""
    get_size = _bind(_GET_SIZE, ctypes.c_uint32, ctypes.c_void_p)
    get_n_stream = _bind(_GET_N_STREAM, ctypes.c_uint32, ctypes.c_void_p)
    get_cells = _bind(_GET_CELLS, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
    size = int(get_size(memory))
    return size, [int(get_cells(memory, s) or 0) for s in range(int(get_n_stream(memory)))]


def stream_count(memory: int) -> int:
    """The cache's streams (one per sequence, or one for all: ``kv_unified``)."""
    return int(_bind(_GET_N_STREAM, ctypes.c_uint32, ctypes.c_void_p)(memory))


def live_positions(memory: int) -> list[I32Array]:
    """The ``pos`` of every cell of each stream of the cache (-1: empty), read from its metadata;
    checked against the count of used cells the metadata keeps apart."""
    size, streams = _cells(memory)
    out = []
    for cells in streams:
        begin = _vector(cells, _CELLS_POS, size, 4, "pos")
        pos = np.ctypeslib.as_array((ctypes.c_int32 * size).from_address(begin)).copy()
        if int(np.count_nonzero(pos != -1)) != _ggml.read_size(cells + _CELLS_USED):
            raise KvLayoutUnsupportedError("the KV cells' layout is not the pinned build's (used)")
        out.append(pos)
    return out


def own_stream_cells(memory: int) -> list[I32Array]:
    """Like :func:`live_positions`, for a cache of one stream per sequence (sequence ``s`` in stream
    ``s``): checked that every cell in use of stream ``s`` belongs to sequence ``s`` alone (its
    sequence set is exactly ``{s}``), so that the state of sequence ``s`` holds exactly the cells
    in use of stream ``s``, in cell order."""
    size, streams = _cells(memory)
    live = live_positions(memory)
    for s, cells in enumerate(streams):
        _vector(cells, _CELLS_EXT, size, _EXT_BYTES, "ext")
        _vector(cells, _CELLS_SHIFT, size, 4, "shift")
        begin = _vector(cells, _CELLS_SEQ, size, _SEQ_BYTES, "seq")
        words = np.ctypeslib.as_array((ctypes.c_uint64 * (4 * size)).from_address(begin)).reshape(size, 4)
        used = words[live[s] != -1]
        want = np.zeros(4, dtype=np.uint64)
        if s >= 256:
            raise KvLayoutUnsupportedError("more KV streams than llama.cpp has sequences")
        want[s // 64] = np.uint64(1) << np.uint64(s % 64)
        if used.size and not bool((used == want).all()):
            raise KvLayoutUnsupportedError(
                f"a KV cell in use of stream {s} does not belong to sequence {s} alone"
            )
    return live


@dataclass(frozen=True)
class CellRun:
    """Consecutive cells in use of a stream: the first one's index in the cache, its index among
    the stream's cells in use (in a sequence's state), and how many."""

    cell: int
    first: int
    n: int


def cell_runs(cells: np.ndarray[tuple[int], np.dtype[np.intp]]) -> tuple[CellRun, ...]:
    """The cells in use (their indices, ascending) as runs of consecutive cells."""
    if cells.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(cells) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [cells.size]))
    return tuple(CellRun(int(cells[a]), int(a), int(b - a)) for a, b in zip(starts, ends, strict=True))


@dataclass(frozen=True)
class KvLayout:
    """Each layer's K and V tensors as the state writes them: types, row bytes and the stride
    between streams (``nb[2]``); a transposed V's element bytes (``v_row``) and rows (``v_rows``)."""

    k_type: list[int]
    k_row: list[int]
    k_stride: list[int]
    v_type: list[int]
    v_row: list[int]  # V row bytes, or the element bytes of a transposed V
    v_stride: list[int]
    v_rows: list[int]  # V rows of a transposed V (its first dimension)
    v_trans: bool

    @classmethod
    def of(cls, kvbuf: KvBuffers) -> KvLayout:
        if not kvbuf.layers or not kvbuf.memory:
            raise KvLayoutUnsupportedError("the KV cache's layers are not known")

        def nb(t: int, i: int) -> int:
            return _ggml.read_size(t + TENSOR_NB + 8 * i)

        def typ(t: int) -> int:
            return ctypes.c_int.from_address(t + TENSOR_TYPE).value

        ne = _ggml.TensorLayout().ne
        layers = kvbuf.layers
        return cls(
            k_type=[typ(x.k) for x in layers],
            k_row=[nb(x.k, 1) for x in layers],
            k_stride=[nb(x.k, 2) for x in layers],
            v_type=[typ(x.v) for x in layers],
            v_row=[nb(x.v, 0) if kvbuf.v_trans else nb(x.v, 1) for x in layers],
            v_stride=[nb(x.v, 2) for x in layers],
            v_rows=[int(ctypes.c_int64.from_address(x.v + ne).value) for x in layers],
            v_trans=kvbuf.v_trans,
        )

    @property
    def n_layer(self) -> int:
        return len(self.k_row)

    def cell_bytes(self) -> int:
        """The K and V bytes of one cell over every layer."""
        if self.v_trans:
            return sum(self.k_row) + sum(r * n for r, n in zip(self.v_row, self.v_rows, strict=True))
        return sum(self.k_row) + sum(self.v_row)

    def state_bytes(self, n_stream: int, cells: int) -> int:
        """The bytes of one sequence's state (``llama_state_seq_get_data``) whose ``cells`` lie in
        one of ``n_stream`` streams (0 cells: the header and the streams' counts only)."""
        head = 4 + 4 + 4 + 4 * n_stream  # magic, sequence id, streams, each stream's cell count
        if cells == 0:
            return head
        per_layer_head = (4 + 8) * self.n_layer + ((4 + 4 + 4) if self.v_trans else (4 + 8)) * self.n_layer
        return head + 12 * cells + 8 + per_layer_head + cells * self.cell_bytes()
