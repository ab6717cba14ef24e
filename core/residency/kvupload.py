"""The KV cache's cells in use, written back layer by layer into the cache they came from (issue 39,
item 2): the restore of the deep level joins the weights' upload, each layer's K and V right after
the weights of its layer part, so the first layers compute while the later ones still arrive.

At the deep level in place (residency/kvbuffer.py) the cache's cell metadata stays as it was (the
cells, their positions and sequences: only the buffers' memory goes), and the sequences' cells in
use were saved in the format of ``llama_state_seq_get_data`` (by it, or byte for byte the same by
residency/kvsave.py). Each sequence's state is read here (the pinned build's format, below) to
find every layer's rows in it; the cells they go back to are the ones they came from: the
stream's non-empty cells, in order (the metadata's ``pos`` of each, read from
``llama_kv_cache::get_cells(stream)``, must match the state's positions one for one). Nothing is
recomputed, no slot is searched: the cache is bitwise what it was, with any number of sequences.

The state of one sequence (``llama_state_seq_get_data``, llama-cpp-python 0.3.36: llama-context.cpp
``state_seq_get_data``, llama-kv-cache.cpp ``state_write``, ``state_write_meta``,
``state_write_data``):

- u32 magic (0xaf143cd8), i32 the sequence id, u32 the cache's streams; per stream: u32 cells (0:
  nothing more for that stream), then per cell, in cell order, i32 pos, u32 n_seq_id (1: only the
  sequence asked for is counted), [a llama_kv_cell_ext of 12 bytes where the model has M-RoPE or
  PLE: never read here, the layer sizes then do not add up], i32 seq ids; then u32 v_trans, u32
  layers; per layer: i32 K type, u64 K row bytes, the cells' K rows; per layer: i32 V type, then
  either u64 V row bytes and the cells' V rows, or (``v_trans``) u32 element bytes, u32 V rows
  and, per V row, the cells' elements. The layout of the cache (metadata, tensors) is read by
  residency/kvlayout.py.

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

import numpy as np

from . import _ggml
from .kv import KvSnapshot
from .kvbuffer import KvBuffers
from .kvlayout import CellRun, KvLayout, KvLayoutUnsupportedError, cell_runs, live_positions


class KvUploadUnsupportedError(Exception):
    """The state cannot be written back layer by layer (the reason says why)."""


@dataclass(frozen=True)
class _Stream:
    stream: int
    cells: int  # in the state
    runs: tuple[CellRun, ...]
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
        try:
            live = live_positions(kvbuf.memory) if kvbuf.memory else []
            lay = KvLayout.of(kvbuf)
        except KvLayoutUnsupportedError as exc:
            raise KvUploadUnsupportedError(str(exc)) from exc
        kv_size = int(live[0].size) if live else 0
        n_layer = lay.n_layer
        k_row, v_row, v_rows = lay.k_row, lay.v_row, lay.v_rows
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
                for il in range(n_layer):
                    if r.i32() != lay.k_type[il] or r.u64() != k_row[il]:
                        raise KvUploadUnsupportedError("the KV state's K rows are not the cache's")
                    ks.append(r.skip(n * k_row[il]))
                for il in range(n_layer):
                    if r.i32() != lay.v_type[il]:
                        raise KvUploadUnsupportedError("the KV state's V type is not the cache's")
                    if kvbuf.v_trans:
                        if r.u32() != v_row[il] or r.u32() != v_rows[il]:
                            raise KvUploadUnsupportedError("the KV state's V elements are not the cache's")
                        vs.append(r.skip(n * v_row[il] * v_rows[il]))
                    else:
                        if r.u64() != v_row[il]:
                            raise KvUploadUnsupportedError("the KV state's V rows are not the cache's")
                        vs.append(r.skip(n * v_row[il]))
                streams.append(_Stream(s, n, cell_runs(cells), tuple(ks), tuple(vs)))
                nbytes += n * lay.cell_bytes()
            if r.o != size:
                raise KvUploadUnsupportedError("the KV state holds more than its layout says")
        return cls(kvbuf, streams, k_row, lay.k_stride, v_row, lay.v_stride, v_rows, kv_size, nbytes)

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
