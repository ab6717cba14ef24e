"""The deep release's save of the KV cells in use, straight from the KV tensors (issue 39): the
bytes ``llama_state_seq_get_data`` would write for each sequence (its format: residency/kvupload.py),
with the header and the cells' metadata written here (numpy) and the K and V rows read with one
``ggml_backend_tensor_get`` per layer and run of cells (a transposed V: one
``ggml_backend_tensor_get_2d`` per layer and run, every V row at once). ``llama_state_seq_get_data``
instead reads each run of each layer synchronously and, for a transposed V (no flash attention),
each V row of each run apart: 32 layers x 1,024 rows of an 8B model, 657 ms against 425 ms with
flash attention on an H100, where the copy itself is ~30 ms.

Only where the cells of each sequence can be told for sure: one KV stream per sequence (a
worker's contexts have ``kv_unified`` false; a context of one sequence has one stream), every
cell in use of stream ``s`` belonging to sequence ``s`` alone, a model without the cells' extra
data (M-RoPE, PLE), and a layout read as the pinned build's (residency/kvlayout.py); the first
save of each cache checks its sizes against ``llama_state_seq_get_size`` too. Elsewhere
:class:`KvSaveUnsupportedError` says why and the caller takes the state the portable way."""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import llama_cpp
import numpy as np

from . import _ggml
from .kv import KvSnapshot, SeqState
from .kvbuffer import KvBuffers
from .kvlayout import CellRun, KvLayout, KvLayoutUnsupportedError, cell_runs, own_stream_cells, stream_count
from .kvmemory import KvHostMemory

#: llama-context.cpp ``io_magic``: the first word of a sequence's state
STATE_MAGIC = 0xAF143CD8
#: ropes whose cells carry a 2-D position (llama_kv_cell_ext) in the state
_EXT_ROPES = (llama_cpp.LLAMA_ROPE_TYPE_MROPE, llama_cpp.LLAMA_ROPE_TYPE_IMROPE)


class KvSaveUnsupportedError(Exception):
    """The cells cannot be saved straight from the tensors (the reason says why)."""


@dataclass(frozen=True)
class _Seq:
    seq_id: int  # = its stream
    pos: np.ndarray[tuple[int], np.dtype[np.int32]]  # of its cells in use, in cell order
    runs: tuple[CellRun, ...]
    size: int  # its state's bytes


@dataclass(frozen=True)
class _Plan:
    seqs: list[_Seq]
    layout: KvLayout
    n_stream: int
    kv_size: int  # cells per stream
    most: int  # the largest snapshot the cache can give (every cell of every stream in use)


class KvSaver:
    """Saves the cells in use of ``kvbuf``'s cache (the context's, found at attach) into a
    snapshot. The loop thread's KV level is its only caller."""

    def __init__(self, kvbuf: KvBuffers, model: int) -> None:
        self._kvbuf = kvbuf
        self._model = model
        self._checked = False  # the sizes compared with llama_state_seq_get_size once
        self._broken = ""  # why it never can, found by that check
        self._layout: KvLayout | None = None  # read once: the tensors' types and strides stay

    def plan(self, ctx: int) -> _Plan:
        """The sequences with cells in use, the layout and the largest snapshot the cache can give;
        KvSaveUnsupportedError when the cells cannot be told for sure."""
        if self._broken:
            raise KvSaveUnsupportedError(self._broken)
        memory = int(llama_cpp.llama_get_memory(ctx) or 0)
        if not memory or memory != self._kvbuf.memory:
            raise KvSaveUnsupportedError("the context's KV cache is not the one whose buffers were found")
        if int(llama_cpp.llama_model_rope_type(self._model)) in _EXT_ROPES:
            raise KvSaveUnsupportedError("an M-RoPE model's cells carry 2-D positions in the state")
        n_seq = int(llama_cpp.llama_n_seq_max(ctx))
        try:
            n_stream = stream_count(memory)
            if n_stream != n_seq:
                raise KvSaveUnsupportedError(
                    f"one KV stream holds several sequences ({n_stream} streams, {n_seq} sequences: "
                    "kv_unified)"
                )
            lay = self._layout = self._layout or KvLayout.of(self._kvbuf)
            live = own_stream_cells(memory)
        except KvLayoutUnsupportedError as exc:
            raise KvSaveUnsupportedError(str(exc)) from exc
        seqs = []
        for s in range(n_seq):
            cells = np.flatnonzero(live[s] != -1)
            pos_max = int(llama_cpp.llama_memory_seq_pos_max(memory, s))
            if (pos_max >= 0) != bool(cells.size) or (cells.size and int(live[s][cells].max()) != pos_max):
                raise KvSaveUnsupportedError(f"the KV cells of sequence {s} are not those its positions say")
            if cells.size:
                size = lay.state_bytes(n_seq, int(cells.size))
                seqs.append(_Seq(s, live[s][cells], cell_runs(cells), size))
        if not self._checked and seqs:
            for seq in seqs:
                want = int(llama_cpp.llama_state_seq_get_size(ctx, seq.seq_id))
                if want != seq.size:
                    self._broken = (
                        f"the KV state of sequence {seq.seq_id} is {want} bytes, not the {seq.size} its "
                        "layout gives (cells with extra data, or another format)"
                    )
                    raise KvSaveUnsupportedError(self._broken)
            self._checked = True
        kv_size = int(live[0].size) if live else 0
        return _Plan(seqs, lay, n_seq, kv_size, n_seq * lay.state_bytes(n_seq, kv_size))

    def take(self, ctx: int, memory: KvHostMemory) -> KvSnapshot:
        """The snapshot of every sequence with cells in use (KvSaveUnsupportedError: nothing taken)."""
        plan = self.plan(ctx)
        # the last decode's computation may still run on the device (its KV rows among what it
        # writes): waited for first, as llama_state_seq_get_data does
        llama_cpp.llama_synchronize(ctx)
        states = []
        offset = 0
        for seq in plan.seqs:
            states.append(SeqState(seq.seq_id, offset, seq.size))
            offset += seq.size
        snap = KvSnapshot(states, memory, memory.lend(offset, plan.most), path="raw")
        try:
            for seq, (_sid, addr, size) in zip(plan.seqs, snap.segments(), strict=True):
                end = self._write(seq, plan, addr)
                if end != addr + size:  # (the layout's sizes are checked: never)
                    raise KvSaveUnsupportedError("the KV state written is not the size its layout gives")
        except BaseException:
            snap.close()
            raise
        return snap

    def _write(self, seq: _Seq, plan: _Plan, at: int) -> int:
        """Write ``seq``'s state at ``at``; returns the address after it."""
        n = int(seq.pos.size)
        s = seq.seq_id
        lay, n_stream, kv_size = plan.layout, plan.n_stream, plan.kv_size
        # each stream's cell count, followed by its cells where it has any: none before stream s
        head = np.array([STATE_MAGIC, s, n_stream, *([0] * s), n], dtype=np.uint32).tobytes()
        meta = np.empty((n, 3), dtype=np.int32)
        meta[:, 0] = seq.pos
        meta[:, 1] = 1
        meta[:, 2] = s
        at = _put(at, head)
        ctypes.memmove(at, meta.ctypes.data, meta.nbytes)
        at += meta.nbytes
        at = _put(at, struct.pack("<II", int(lay.v_trans), lay.n_layer))
        layers = self._kvbuf.layers
        for il, layer in enumerate(layers):
            row = lay.k_row[il]
            at = _put(at, struct.pack("<iQ", lay.k_type[il], row))
            base = lay.k_stride[il] * s
            for run in seq.runs:
                _ggml.tensor_get(layer.k, at + run.first * row, base + run.cell * row, run.n * row)
            at += n * row
        for il, layer in enumerate(layers):
            row, base = lay.v_row[il], lay.v_stride[il] * s
            if lay.v_trans:
                rows = lay.v_rows[il]
                at = _put(at, struct.pack("<iII", lay.v_type[il], row, rows))
                for run in seq.runs:
                    # V row j of the stream holds every cell's element j: each run's elements of
                    # every row at once, into row j of the state (n elements apart)
                    _ggml.tensor_get_2d(
                        layer.v,
                        at + run.first * row,
                        base + run.cell * row,
                        run.n * row,
                        rows,
                        kv_size * row,
                        n * row,
                    )
                at += n * row * rows
            else:
                at = _put(at, struct.pack("<iQ", lay.v_type[il], row))
                for run in seq.runs:
                    _ggml.tensor_get(layer.v, at + run.first * row, base + run.cell * row, run.n * row)
                at += n * row
        return _put(at, bytes(4 * (n_stream - s - 1)))  # none after it


def _put(at: int, data: bytes) -> int:
    ctypes.memmove(at, data, len(data))
    return at + len(data)
