"""The KV cache's cells in use, written back layer by layer into the cache they came from (issue 39,
item 2): the restore of the deep level joins the weights' upload, each layer's K and V right after
the weights of its layer part, so the first layers compute while the later ones still arrive.

At the deep level in place (residency/kvbuffer.py) the cache's cell metadata stays as it was (the
cells, their positions and sequences: only the buffers' memory goes), and the sequences' cells in
use were saved with ``llama_state_seq_get_data``. Each sequence's state is read here (the pinned
build's format, below) to find every layer's rows in it; the cells they go back to are the ones
they came from: the stream's non-empty cells, in order (the metadata's ``pos`` of each, read from
``llama_kv_cache::get_cells(stream)``, must match the state's positions one for one). Nothing is
recomputed, no slot is searched: the cache is bitwise what it was, with any number of sequences.

The state of one sequence (``llama_state_seq_get_data``, llama-cpp-python 0.3.36):

- u32 magic, u32 the sequence id, u32 the cache's streams; per stream: u32 cells (0: nothing more
  for that stream), then per cell i32 pos, u32 n_seq_id, i32 seq ids; then u32 v_trans, u32 layers;
  per layer: i32 K type, u64 K row bytes, the cells' K rows; per layer: i32 V type, then either u64
  V row bytes and the cells' V rows, or (``v_trans``) u32 element bytes, u32 V rows and, per V row,
  the cells' elements.

Anything that does not read exactly so (another layout, a cell of two sequences in a stream the
other shares, metadata that moved) raises :class:`KvUploadUnsupportedError` before anything is
written, and the residency puts the state back the portable way (``llama_state_seq_set_data``,
the metadata cleared first), after the weights."""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _ggml
from .kv import KvSnapshot
from .kvbuffer import KvBuffers

_GET_SIZE = "_ZNK14llama_kv_cache8get_sizeEv"
_GET_N_STREAM = "_ZNK14llama_kv_cache12get_n_streamEv"
_GET_CELLS = "_ZNK14llama_kv_cache9get_cellsEi"
#: class llama_kv_cells (llama-kv-cells.h): bool has_shift; std::set<uint32_t> used, whose node
#: count is at +0x30; std::vector<llama_pos> pos at +0x38 (begin, end)
_CELLS_USED = 0x30
_CELLS_POS = 0x38
#: ggml_tensor (ggml.h): enum ggml_type type at 0; size_t nb[4] after int64_t ne[4]
_TENSOR_TYPE = 0
_TENSOR_NB = 48


class KvUploadUnsupportedError(Exception):
    """The state cannot be written back layer by layer (the reason says why)."""


def _bind(name: str, restype: Any, *argtypes: Any) -> Any:
    fn = _ggml.bind_optional(name, restype, *argtypes)
    if fn is None:
        raise KvUploadUnsupportedError(f"this llama.cpp build does not export {name}")
    return fn


def live_positions(memory: int) -> list[np.ndarray[tuple[int], np.dtype[np.int32]]]:
    """The ``pos`` of every cell of each stream of the cache (-1: empty), read from its metadata;
    checked against the count of used cells the metadata keeps apart."""
    get_size = _bind(_GET_SIZE, ctypes.c_uint32, ctypes.c_void_p)
    get_n_stream = _bind(_GET_N_STREAM, ctypes.c_uint32, ctypes.c_void_p)
    get_cells = _bind(_GET_CELLS, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
    size = int(get_size(memory))
    out = []
    for s in range(int(get_n_stream(memory))):
        cells = int(get_cells(memory, s) or 0)
        begin, end = _ggml.read_ptr(cells + _CELLS_POS), _ggml.read_ptr(cells + _CELLS_POS + 8)
        if not begin or end - begin != 4 * size:
            raise KvUploadUnsupportedError("the KV cells' layout is not the pinned build's (pos)")
        pos = np.ctypeslib.as_array((ctypes.c_int32 * size).from_address(begin)).copy()
        if int(np.count_nonzero(pos != -1)) != _ggml.read_size(cells + _CELLS_USED):
            raise KvUploadUnsupportedError("the KV cells' layout is not the pinned build's (used)")
        out.append(pos)
    return out


@dataclass(frozen=True)
class _Run:
    cell: int  # first cell in the cache
    first: int  # its index among the stream's cells in the state
    n: int


@dataclass(frozen=True)
class _Stream:
    stream: int
    cells: int  # in the state
    runs: tuple[_Run, ...]
    k: tuple[int, ...]  # per layer: host address of its K rows
    v: tuple[int, ...]  # per layer: host address of its V rows (or, transposed, elements)


@dataclass
class KvUploadStats:
    """What the layer-wise KV upload did (milliseconds, bytes)."""

    bytes: int = 0
    busy_s: float = 0.0
    first_start: float = 0.0  # perf_counter() (0.0: nothing uploaded yet)
    last_end: float = 0.0


class _Reader:
    def __init__(self, addr: int, size: int) -> None:
        self.mem = memoryview((ctypes.c_uint8 * size).from_address(addr)).cast("B")
        self.addr = addr
        self.o = 0

    def u32(self) -> int:
        v = int(struct.unpack_from("<I", self.mem, self.o)[0])
        self.o += 4
        return v

    def i32(self) -> int:
        v = int(struct.unpack_from("<i", self.mem, self.o)[0])
        self.o += 4
        return v

    def u64(self) -> int:
        v = int(struct.unpack_from("<Q", self.mem, self.o)[0])
        self.o += 8
        return v

    def skip(self, n: int) -> int:
        """The address of the next ``n`` bytes, skipped."""
        at = self.addr + self.o
        self.o += n
        if self.o > len(self.mem):
            raise KvUploadUnsupportedError("the KV state is shorter than its layout says")
        return at


def _runs(cells: np.ndarray[tuple[int], np.dtype[np.intp]]) -> tuple[_Run, ...]:
    """Consecutive cells as runs (cell, index in the state, count)."""
    if cells.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(cells) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [cells.size]))
    return tuple(_Run(int(cells[a]), int(a), int(b - a)) for a, b in zip(starts, ends, strict=True))


@dataclass
class KvUpload:
    """A KV snapshot's cells, to be written back into ``kvbuf``'s cache layer by layer (its buffers
    allocated again and cleared first). The residency's upload hook: :meth:`claim` as the weights'
    parts are handed to the upload thread, :meth:`upload` on that thread after each part's
    weights, :meth:`upload_unclaimed` on the caller's thread for the layers of no part (weights
    that stayed resident)."""

    kvbuf: KvBuffers
    streams: list[_Stream]
    k_row: list[int]  # per layer: K row bytes (the cache's nb[1]) and the stream stride (nb[2])
    k_stride: list[int]
    v_row: list[int]  # per layer: V row bytes, or the element bytes of a transposed V
    v_stride: list[int]
    v_rows: list[int]  # per layer: V rows of a transposed V (its first dimension)
    kv_size: int
    nbytes: int
    claimed: set[int] = field(default_factory=set)
    stats: KvUploadStats = field(default_factory=KvUploadStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def plan(cls, kvbuf: KvBuffers, snapshot: KvSnapshot) -> KvUpload:
        """Read ``snapshot`` (taken from ``kvbuf``'s cache, whose metadata has not changed since)
        and find where each of its rows goes; KvUploadUnsupportedError when it cannot be told for
        sure."""
        if not kvbuf.layers or not kvbuf.memory:
            raise KvUploadUnsupportedError("the KV cache's layers are not known")
        live = live_positions(kvbuf.memory)
        kv_size = int(live[0].size) if live else 0
        n_layer = len(kvbuf.layers)

        def nb(t: int, i: int) -> int:
            return _ggml.read_size(t + _TENSOR_NB + 8 * i)

        k_row = [nb(layer.k, 1) for layer in kvbuf.layers]
        k_stride = [nb(layer.k, 2) for layer in kvbuf.layers]
        v_row = [nb(layer.v, 0) if kvbuf.v_trans else nb(layer.v, 1) for layer in kvbuf.layers]
        v_stride = [nb(layer.v, 2) for layer in kvbuf.layers]
        ne = _ggml.TensorLayout().ne
        v_rows = [int(ctypes.c_int64.from_address(layer.v + ne).value) for layer in kvbuf.layers]
        streams: list[_Stream] = []
        taken: set[int] = set()
        nbytes = 0
        for seq_id, addr, size in snapshot.segments():
            r = _Reader(addr, size)
            r.u32()  # magic
            if r.u32() != seq_id:
                raise KvUploadUnsupportedError("the KV state's header is not the pinned build's")
            if r.u32() != len(live):
                raise KvUploadUnsupportedError("the KV state's streams are not the cache's")
            for s in range(len(live)):
                n = r.u32()
                if n == 0:
                    continue
                if s in taken:
                    raise KvUploadUnsupportedError("two sequences share a KV stream")
                taken.add(s)
                words = np.frombuffer(r.mem, dtype=np.int32, count=3 * n, offset=r.o).reshape(n, 3)
                if not (words[:, 1] == 1).all() or not (words[:, 2] == seq_id).all():
                    raise KvUploadUnsupportedError("a KV cell belongs to more than one sequence")
                r.o += 12 * n
                cells = np.flatnonzero(live[s] != -1)
                if cells.size != n or not np.array_equal(live[s][cells], words[:, 0]):
                    raise KvUploadUnsupportedError("the KV cells in use are not those the state holds")
                if bool(r.u32()) != kvbuf.v_trans or r.u32() != n_layer:
                    raise KvUploadUnsupportedError("the KV state's layers are not the cache's")
                ks, vs = [], []
                for il, layer in enumerate(kvbuf.layers):
                    k_type = ctypes.c_int.from_address(layer.k + _TENSOR_TYPE).value
                    if r.i32() != k_type or r.u64() != k_row[il]:
                        raise KvUploadUnsupportedError("the KV state's K rows are not the cache's")
                    ks.append(r.skip(n * k_row[il]))
                for il, layer in enumerate(kvbuf.layers):
                    if r.i32() != ctypes.c_int.from_address(layer.v + _TENSOR_TYPE).value:
                        raise KvUploadUnsupportedError("the KV state's V type is not the cache's")
                    if kvbuf.v_trans:
                        if r.u32() != v_row[il] or r.u32() != v_rows[il]:
                            raise KvUploadUnsupportedError("the KV state's V elements are not the cache's")
                        vs.append(r.skip(n * v_row[il] * v_rows[il]))
                    else:
                        if r.u64() != v_row[il]:
                            raise KvUploadUnsupportedError("the KV state's V rows are not the cache's")
                        vs.append(r.skip(n * v_row[il]))
                streams.append(_Stream(s, n, _runs(cells), tuple(ks), tuple(vs)))
                nbytes += sum(n * k for k in k_row) + sum(
                    n * v * (rows if kvbuf.v_trans else 1) for v, rows in zip(v_row, v_rows, strict=True)
                )
            if r.o != size:
                raise KvUploadUnsupportedError("the KV state holds more than its layout says")
        return cls(kvbuf, streams, k_row, k_stride, v_row, v_stride, v_rows, kv_size, nbytes)

    def reset(self) -> None:
        """Before a restore: nothing claimed or uploaded yet (a restore that failed for memory
        leaves its claims; the next one writes every layer again)."""
        self.claimed.clear()
        self.stats = KvUploadStats()

    def claim(self, first: int, last: int) -> list[int]:
        """Layers ``first``..``last`` go with a weight part (uploaded by :meth:`upload` on the
        upload thread): their K and V tensors, for the gate to wait on."""
        out = []
        for layer in self.kvbuf.layers[max(0, first) : last + 1]:
            self.claimed.add(layer.index)
            out += [layer.k, layer.v]
        return out

    def upload(self, first: int, last: int) -> None:
        """Write layers ``first``..``last`` (any thread)."""
        t0 = time.perf_counter()
        nbytes = 0
        for layer in self.kvbuf.layers[max(0, first) : last + 1]:
            nbytes += self._layer(layer.index)
        t1 = time.perf_counter()
        with self._lock:
            st = self.stats
            st.bytes += nbytes
            st.busy_s += t1 - t0
            st.first_start = st.first_start or t0
            st.last_end = max(st.last_end, t1)

    def upload_unclaimed(self) -> None:
        """Write the layers no part claimed (on the caller's thread)."""
        for layer in self.kvbuf.layers:
            if layer.index not in self.claimed:
                self.upload(layer.index, layer.index)

    def _layer(self, il: int) -> int:
        layer = self.kvbuf.layers[il]
        k_row, v_row = self.k_row[il], self.v_row[il]
        nbytes = 0
        for st in self.streams:
            k_base, v_base = self.k_stride[il] * st.stream, self.v_stride[il] * st.stream
            for run in st.runs:
                src = st.k[il] + run.first * k_row
                _ggml.tensor_set(layer.k, src, k_base + run.cell * k_row, run.n * k_row)
                if self.kvbuf.v_trans:
                    # V row j of the stream holds every cell's element j: one 2-D copy per run
                    _ggml.tensor_set_2d(
                        layer.v,
                        st.v[il] + run.first * v_row,
                        v_base + run.cell * v_row,
                        run.n * v_row,
                        self.v_rows[il],
                        self.kv_size * v_row,
                        st.cells * v_row,
                    )
                    nbytes += run.n * v_row * self.v_rows[il]
                else:
                    src = st.v[il] + run.first * v_row
                    _ggml.tensor_set(layer.v, src, v_base + run.cell * v_row, run.n * v_row)
                    nbytes += run.n * v_row
                nbytes += run.n * k_row
        return nbytes
