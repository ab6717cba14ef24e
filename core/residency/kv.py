"""KV-cache snapshots of every sequence of a llama context, in host memory (pinned when possible)."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import llama_cpp

from ..errors import ResidencyError
from .hostmem import HostMemory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Seq:
    seq_id: int
    offset: int
    size: int


def _u8(addr: int) -> ctypes._Pointer[ctypes.c_uint8]:
    return ctypes.cast(ctypes.c_void_p(addr), ctypes.POINTER(ctypes.c_uint8))


class KvSnapshot:
    """The KV cells of each non-empty sequence, as ``llama_state_seq_get_data`` writes them."""

    def __init__(self, seqs: list[_Seq], mem: HostMemory) -> None:
        self._seqs = seqs
        self._mem = mem

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self._seqs)

    @property
    def pinned(self) -> bool:
        return self._mem.pinned

    def segments(self) -> list[tuple[int, int, int]]:
        """(sequence id, host address, bytes) of each sequence's state, as
        ``llama_state_seq_get_data`` wrote it (valid until :meth:`close`)."""
        return [(s.seq_id, self._mem.ptr + s.offset, s.size) for s in self._seqs]

    @classmethod
    def take(cls, ctx: int, want_pinned: bool) -> KvSnapshot:
        memory = llama_cpp.llama_get_memory(ctx)
        n_seq = int(llama_cpp.llama_n_seq_max(ctx))
        ids = [s for s in range(n_seq) if memory and int(llama_cpp.llama_memory_seq_pos_max(memory, s)) >= 0]
        seqs: list[_Seq] = []
        offset = 0
        for s in ids:
            size = int(llama_cpp.llama_state_seq_get_size(ctx, s))
            seqs.append(_Seq(s, offset, size))
            offset += size
        mem = HostMemory(offset, want_pinned)
        for seq in seqs:
            got = int(
                llama_cpp.llama_state_seq_get_data(ctx, _u8(mem.ptr + seq.offset), seq.size, seq.seq_id)
            )
            if got != seq.size:
                mem.close()
                raise ResidencyError(
                    f"the KV cache of sequence {seq.seq_id} could not be saved ({got} of {seq.size} bytes): "
                    "the model was not released"
                )
        log.debug("KV snapshot: %d sequences, %d bytes, pinned=%s", len(seqs), offset, mem.pinned)
        return cls(seqs, mem)

    def apply(self, ctx: int) -> None:
        for seq in self._seqs:
            got = int(
                llama_cpp.llama_state_seq_set_data(ctx, _u8(self._mem.ptr + seq.offset), seq.size, seq.seq_id)
            )
            if got != seq.size:
                raise ResidencyError(
                    f"the KV cache of sequence {seq.seq_id} could not be restored ({got} of {seq.size} bytes)"
                )

    def close(self) -> None:
        self._mem.close()
