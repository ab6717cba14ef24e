"""The host memory a model's KV snapshots are taken into, kept from one deep release to the next
(issue 39): pinned memory of a gigabyte costs 100-300 ms to allocate (``cudaMallocHost``), more
than the copy it is for, so it is allocated once at the high-water mark and grown only when a
bigger snapshot comes, then freed when the model is closed.

Its owner is the model's KV level (residency/kvlevel.py) or, on the rebuild path, the path
itself (residency/rebuild.py); the one snapshot alive at a time lends it (residency/kv.py), and
gives it back when closed. The memory stays allocated while the model is resident: it is host
RAM (pinned, where the backend has pinned memory: like the weights' host shadow) of about the KV
cells in use at the longest conversation parked so far, a quarter more (or twice what it held
when it grows), and no more than every cell of the cache (:attr:`KvHostMemory.nbytes`, in the
worker's status with the shadow).

Its owner may also grow it ahead (:meth:`KvHostMemory.grow_ahead`), off the switch's path: the
worker, idle after an answer, grows it to what a deep release of the cells in use now would take,
by the same rule, so that release allocates nothing (worker/tenancy.py says when)."""

from __future__ import annotations

import logging
import time

from ..errors import ResidencyError
from .hostmem import HostMemory

log = logging.getLogger(__name__)

#: the memory is grown in steps of this many bytes at least
GRAIN = 1 << 20


class KvHostMemory:
    """Host memory for one snapshot at a time: :meth:`lend` (grows it when needed), :meth:`give_back`,
    :meth:`close`. ``want_pinned``: pinned where the device offers it (HostMemory's fallback to
    pageable memory kept as it is)."""

    def __init__(self, want_pinned: bool) -> None:
        self._want_pinned = want_pinned
        self._mem: HostMemory | None = None
        self._lent = False
        self.grown = 0  # allocations made (the first one included), ahead or not
        self.grown_ahead = 0  # of those, made ahead of a release (grow_ahead)
        #: the last lend's allocation: its milliseconds (None: it allocated nothing, it had room)
        self.lend_alloc_ms: float | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0: none)."""
        return self._mem.size if self._mem is not None else 0

    @property
    def address(self) -> int:
        """Where it starts (0: none held)."""
        return self._mem.ptr if self._mem is not None else 0

    @property
    def pinned(self) -> bool:
        return self._mem is not None and self._mem.pinned

    @property
    def note(self) -> str:
        """Why the memory is not pinned though it was asked for ("" otherwise)."""
        return self._mem.note if self._mem is not None else ""

    @property
    def lent(self) -> bool:
        """A snapshot holds it now (taken and not closed)."""
        return self._lent

    def wanted(self, size: int, most: int | None = None) -> int:
        """What it would hold after a lend of ``size`` bytes (:meth:`nbytes` where that is
        enough): ``size`` and a quarter more or twice what it holds, whichever is more, at most
        ``most``, in whole grains."""
        if size <= self.nbytes:
            return self.nbytes
        want = max(size + size // 4, 2 * self.nbytes)
        if most is not None:
            want = min(want, most)
        return -(-max(want, size) // GRAIN) * GRAIN

    def lend(self, size: int, most: int | None = None) -> int:
        """The address of at least ``size`` bytes, for the snapshot about to be taken (0 for 0
        bytes); where it holds less, grown to ``size`` and a quarter more or twice what it held,
        whichever is more (a conversation that keeps growing costs a few allocations, not one
        per quarter: each is a pinned allocation on the switch's path), at most ``most`` (the
        largest snapshot the cache can give, when known). :attr:`lend_alloc_ms` says what the
        allocation took (None: none was made)."""
        if self._lent:
            raise ResidencyError("the KV snapshot's host memory is lent already (a snapshot was not closed)")
        self.lend_alloc_ms = None
        if size > self.nbytes:
            t0 = time.perf_counter()
            self._grow(self.wanted(size, most), "at a release")
            self.lend_alloc_ms = (time.perf_counter() - t0) * 1000
        self._lent = size > 0
        return self._mem.ptr if self._mem is not None and size > 0 else 0

    def grow_ahead(self, size: int, most: int | None = None) -> int:
        """Off the switch's path: grow, by :meth:`lend`'s rule, where it holds less than ``size``
        bytes (the snapshot a release would take now), so that lend allocates nothing. Returns
        the bytes allocated (0: it had room, or it is lent: a release's snapshot is in it, never
        replaced). An allocation that fails is logged and left to the next lend (the memory held
        before is freed by then)."""
        if self._lent or size <= self.nbytes:
            return 0
        want = self.wanted(size, most)
        try:
            self._grow(want, "ahead of a release")
        except MemoryError as exc:
            log.warning("growing the KV snapshot host memory ahead failed (%s): a release allocates it", exc)
            return 0
        self.grown_ahead += 1
        return want

    def _grow(self, want: int, when: str) -> None:
        t0 = time.perf_counter()
        old, self._mem = self._mem, None
        if old is not None:
            old.close()
        self._mem = HostMemory(want, self._want_pinned)
        self.grown += 1
        log.info(
            "KV snapshot host memory: %.1f MB (%s), allocated %s in %.1f ms",
            want / 1e6,
            "pinned" if self._mem.pinned else "pageable",
            when,
            (time.perf_counter() - t0) * 1000,
        )

    def give_back(self) -> None:
        """The snapshot that was lent the memory is closed: the next one may take it."""
        self._lent = False

    def close(self) -> None:
        """Free the memory (the model is closed)."""
        self._lent = False
        if self._mem is not None:
            self._mem.close()
            self._mem = None
