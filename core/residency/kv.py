"""KV-cache snapshots of every sequence of a llama context, in host memory (pinned when possible)
lent by the model's KvHostMemory (residency/kvmemory.py): taken with ``llama_state_seq_get_data``
here (the portable way), or written byte for byte the same from the KV tensors by
residency/kvsave.py."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import llama_cpp

from ..errors import ResidencyError
from .kvmemory import KvHostMemory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqState:
    """Where one sequence's state lies in a snapshot's memory."""

    seq_id: int
    offset: int
    size: int


def state_sizes(ctx: int) -> list[tuple[int, int]]:
    """(sequence id, bytes) of each sequence with cells in ``ctx``'s KV cache, as
    ``llama_state_seq_get_size`` counts them (no data is copied)."""
    llama_memory = llama_cpp.llama_get_memory(ctx)
    if not llama_memory:
        return []
    return [
        (s, int(llama_cpp.llama_state_seq_get_size(ctx, s)))
        for s in range(int(llama_cpp.llama_n_seq_max(ctx)))
        if int(llama_cpp.llama_memory_seq_pos_max(llama_memory, s)) >= 0
    ]


def _u8(addr: int) -> ctypes._Pointer[ctypes.c_uint8]:
    return ctypes.cast(ctypes.c_void_p(addr), ctypes.POINTER(ctypes.c_uint8))


class KvSnapshot:
    """The KV cells of each non-empty sequence, as ``llama_state_seq_get_data`` writes them."""

    def __init__(self, seqs: list[SeqState], memory: KvHostMemory, base: int, path: str = "state") -> None:
        self._seqs = seqs
        self._memory = memory  # lent until close()
        self._base = base
        self._open = True
        #: how it was taken: "state" (llama_state_seq_get_data) or "raw" (residency/kvsave.py)
        self.path = path

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self._seqs)

    @property
    def pinned(self) -> bool:
        return self._memory.pinned

    def segments(self) -> list[tuple[int, int, int]]:
        """(sequence id, host address, bytes) of each sequence's state, as
        ``llama_state_seq_get_data`` wrote it (valid until :meth:`close`)."""
        return [(s.seq_id, self._base + s.offset, s.size) for s in self._seqs]

    @classmethod
    def take(cls, ctx: int, memory: KvHostMemory) -> KvSnapshot:
        """The state of every sequence with cells, through ``llama_state_seq_get_data``."""
        seqs: list[SeqState] = []
        offset = 0
        for s, size in state_sizes(ctx):
            seqs.append(SeqState(s, offset, size))
            offset += size
        snap = cls(seqs, memory, memory.lend(offset))
        for seq in seqs:
            got = int(
                llama_cpp.llama_state_seq_get_data(ctx, _u8(snap._base + seq.offset), seq.size, seq.seq_id)
            )
            if got != seq.size:
                snap.close()
                raise ResidencyError(
                    f"the KV cache of sequence {seq.seq_id} could not be saved ({got} of {seq.size} bytes): "
                    "the model was not released"
                )
        log.debug("KV snapshot: %d sequences, %d bytes, pinned=%s", len(seqs), offset, memory.pinned)
        return snap

    def apply(self, ctx: int) -> None:
        for seq in self._seqs:
            got = int(
                llama_cpp.llama_state_seq_set_data(ctx, _u8(self._base + seq.offset), seq.size, seq.seq_id)
            )
            if got != seq.size:
                raise ResidencyError(
                    f"the KV cache of sequence {seq.seq_id} could not be restored ({got} of {seq.size} bytes)"
                )

    def close(self) -> None:
        """Give the memory back to its owner (which keeps it for the next snapshot)."""
        if self._open:
            self._open = False
            self._memory.give_back()
