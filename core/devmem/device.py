"""What a chunk device does, and where chunks come from: the two interfaces the worker's mapped
memory (:mod:`.mapped`) works with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

#: one chunk of device memory: every chunk of an arena has this size (a multiple of any CUDA
#: allocation granularity seen: 2 MiB on the H100/H200); the holder says the one in force
CHUNK_BYTES = 64 << 20


class ChunkDeviceError(Exception):
    """A device call failed; ``out_of_memory``: it was an allocation the device had no room for."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


class ChunkHandles(Protocol):
    """Physical allocations with shareable fd handles: what every device of the hand-over does
    (CUDA VMM, Vulkan external memory, the memfd stand-in). A handle keeps its memory alive until
    it is released and nothing else -- a mapping, a binding, an fd in any process -- refers to it."""

    #: "CUDA VMM (CUDA0)", "Vulkan opaque fd (NVIDIA H200)", "memfd (CPU stand-in)"
    name: str
    #: allocation sizes (and, with :class:`ChunkDevice`, mapping addresses) are multiples of this
    granularity: int
    #: allocations made by :meth:`create` since this object was made (cuMemCreate calls)
    creates: int

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device now."""
        ...

    def create(self, nbytes: int) -> int:
        """A new allocation of ``nbytes`` (a multiple of the granularity): its handle."""
        ...

    def export(self, handle: int) -> int:
        """A new fd for the allocation (the caller closes it)."""
        ...

    def import_fd(self, fd: int) -> int:
        """A handle for the allocation behind ``fd`` (``fd`` stays the caller's)."""
        ...

    def release(self, handle: int) -> None:
        """Drop the handle (the memory lives on while mapped or held elsewhere)."""
        ...


class ChunkDevice(ChunkHandles, Protocol):
    """Chunk handles mapped at addresses reserved once (CUDA VMM's model, which the memfd
    stand-in follows): what :class:`~.mapped.HandedMemory` needs. Vulkan has no such mapping
    (:mod:`.vulkan` says why and what it does instead)."""

    #: :meth:`map` and :meth:`unmap` calls since this object was made (cuMemMap, cuMemUnmap)
    maps: int
    unmaps: int

    def reserve(self, nbytes: int) -> int:
        """Reserve an address range of ``nbytes``; its address."""
        ...

    def free_reserve(self, address: int, nbytes: int) -> None: ...

    def map(self, address: int, nbytes: int, handle: int) -> None:
        """Map the whole allocation at ``address`` (inside a reserved range)."""
        ...

    def set_access(self, address: int, nbytes: int) -> None:
        """Make a mapped range readable and writable by the device."""
        ...

    def synchronize(self) -> None:
        """Wait until no device work can touch a mapping (called once before unmapping)."""
        ...

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap one allocation's mapping (the range stays reserved)."""
        ...


@dataclass
class Given:
    """What a :meth:`ChunkSource.take` got: ``chunks``, (id, fd) pairs (the fds the caller's to
    close); ``intact``, the ids of the kept chunks it named in ``use`` that the source vouches
    nobody else mapped since they were kept (their bytes are still the caller's)."""

    chunks: list[tuple[int, int]]
    intact: set[int]


class ChunkSource(Protocol):
    """Where a worker's chunks come from and go back to: the arena's hand-over holder
    (``core/arena/handclient.HandoverClient``). Any of its methods may raise an exception of the
    arena's (the holder is gone, refused, not started): the worker then uses its own memory."""

    chunk_bytes: int
    #: the holder's session the ids belong to (a new holder: new ids, the old ones mean nothing)
    session: str

    @property
    def keeps(self) -> bool:
        """Released chunks may stay mapped (the holder can ask them back)."""
        ...

    def take(
        self, n: int, room: int | None = None, use: list[int] | None = None, gens: list[int] | None = None
    ) -> Given:
        """Up to ``n`` chunks: (id, fd) pairs; the fds are the caller's to close. ``room``: the
        bytes the caller may allocate itself (kept chunks of others are asked back for the
        rest); ``use``: kept chunks the caller restores into (in use again); ``gens``: their
        generations as :meth:`keep` gave them (the answer's ``intact`` vouches by them)."""
        ...

    def keep(self, ids: list[int]) -> list[int]:
        """The chunks stay mapped by the caller while its model is released (lent back to the
        arena: the holder may ask them back). Returns their generations (in order; [] when the
        source gives none: nothing kept will be vouched for)."""
        ...

    def serve_reclaims(self, reclaimer: Callable[[list[int], str], list[int]]) -> None:
        """Call ``reclaimer(ids, session)`` (on a thread of the source's) when the holder asks
        kept chunks back; it returns the ids it unmapped."""
        ...

    def adopt(self, fds: list[int]) -> list[int]:
        """Hand over chunks this process created (exported fds, still the caller's to close)."""
        ...

    def put(self, ids: list[int], keep: bool = True) -> None:
        """The chunks are unmapped: the holder's again (closed when not ``keep``)."""
        ...
