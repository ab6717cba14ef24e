"""The hand-over holder's bookkeeping: which chunks of device memory it holds, and who may have
each mapped (issue 40; docs/INTERFACES.md, "Device memory handed over between workers").

Pure: no syscall here. The holder (:mod:`.holder`) owns one :class:`Ledger` and closes the fds
the ledger hands back to it.

A chunk is one allocation of device memory of the arena's chunk size, known to the holder by an
fd (a CUDA VMM POSIX-fd handle, or a memfd on the CPU stand-in). Its state is either **on hand**
(only the holder references it) or **lent** to one pid (which may have it mapped). A chunk is
lent to one pid at a time; it comes back on hand only by that pid's :meth:`Ledger.put` (sent once
it unmapped the chunk) or that pid's exit (:meth:`Ledger.pid_gone`, from a pidfd: its mappings
are gone with it). So no chunk is ever mapped by two live workers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

ChunkState = Literal["on_hand", "lent"]


class LedgerError(ValueError):
    """A request the ledger refuses (a chunk id that is not lent to the asker, a bad count)."""


@dataclass
class Chunk:
    id: int
    fd: int
    state: ChunkState
    pid: int = 0  # the borrower while lent
    #: when it last came on hand (the holder's clock): trims close the oldest first
    since: float = 0.0


@dataclass
class LedgerStats:
    """What the holder did since it started (counts of chunks)."""

    given: int = 0  # lent out of the chunks on hand (take)
    adopted: int = 0  # created by a worker and handed to the holder (adopt)
    put: int = 0  # came back on hand from a live worker
    returned_by_exit: int = 0  # came back on hand because their borrower exited
    closed: dict[str, int] = field(default_factory=dict)  # why: "trim", "idle", "budget", "drop", "exit"

    def as_dict(self) -> dict[str, object]:
        return {
            "given": self.given,
            "adopted": self.adopted,
            "put": self.put,
            "returned_by_exit": self.returned_by_exit,
            "closed": dict(self.closed),
        }


class Ledger:
    """The chunks one holder holds. ``chunk_bytes``: the size of every chunk."""

    def __init__(self, chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunks: dict[int, Chunk] = {}
        self._ids = itertools.count(1)
        self.stats = LedgerStats()
        #: the most chunks one pid has had lent at once (a one-model budget keeps that many on hand)
        self.largest_set = 0

    # -- reading --

    @property
    def chunks(self) -> list[Chunk]:
        return list(self._chunks.values())

    @property
    def on_hand(self) -> list[Chunk]:
        """The chunks on hand, the oldest first."""
        return sorted(
            (c for c in self._chunks.values() if c.state == "on_hand"), key=lambda c: (c.since, c.id)
        )

    @property
    def on_hand_bytes(self) -> int:
        return self.chunk_bytes * sum(1 for c in self._chunks.values() if c.state == "on_hand")

    @property
    def lent_bytes(self) -> int:
        return self.chunk_bytes * sum(1 for c in self._chunks.values() if c.state == "lent")

    @property
    def held_bytes(self) -> int:
        return self.chunk_bytes * len(self._chunks)

    def lent_to(self, pid: int) -> list[int]:
        """The ids of the chunks lent to ``pid``."""
        return sorted(c.id for c in self._chunks.values() if c.state == "lent" and c.pid == pid)

    def borrowers(self) -> dict[int, int]:
        """pid -> chunks lent to it."""
        out: dict[int, int] = {}
        for c in self._chunks.values():
            if c.state == "lent":
                out[c.pid] = out.get(c.pid, 0) + 1
        return out

    # -- changes (each returns the fds the holder must close, where any) --

    def adopt(self, fds: Iterable[int], pid: int) -> list[int]:
        """Chunks a worker created and sent: held from now on, lent to ``pid`` (it has them
        mapped). Returns their ids, in order."""
        ids = []
        for fd in fds:
            chunk = Chunk(next(self._ids), fd, "lent", pid)
            self._chunks[chunk.id] = chunk
            ids.append(chunk.id)
        self.stats.adopted += len(ids)
        self._note_set(pid)
        return ids

    def give(self, pid: int, n: int) -> list[Chunk]:
        """Lend up to ``n`` chunks on hand to ``pid`` (the most recently put first: their memory
        was touched last). Fewer, or none, when fewer are on hand."""
        if n < 0:
            raise LedgerError(f"cannot take {n} chunks")
        out = list(reversed(self.on_hand))[:n]
        for c in out:
            c.state, c.pid = "lent", pid
        self.stats.given += len(out)
        self._note_set(pid)
        return out

    def put(self, pid: int, ids: Iterable[int], now: float, keep: bool = True) -> list[int]:
        """``pid`` unmapped the chunks ``ids`` (lent to it): they come back on hand, or are
        dropped (``keep`` False: the fds returned are to be closed). Every id is checked before
        anything changes: one that is not lent to ``pid`` raises LedgerError."""
        wanted = list(dict.fromkeys(ids))
        for i in wanted:
            c = self._chunks.get(i)
            if c is None or c.state != "lent" or c.pid != pid:
                raise LedgerError(f"chunk {i} is not lent to pid {pid}")
        closing: list[int] = []
        for i in wanted:
            c = self._chunks[i]
            if keep:
                c.state, c.pid, c.since = "on_hand", 0, now
            else:
                closing.append(self._chunks.pop(i).fd)
        self.stats.put += len(wanted)
        self._closed("drop", len(closing))
        return closing

    def pid_gone(self, pid: int, now: float) -> int:
        """``pid`` exited (its mappings are gone with it): what was lent to it is on hand again.
        Returns how many chunks came back."""
        back = 0
        for c in self._chunks.values():
            if c.state == "lent" and c.pid == pid:
                c.state, c.pid, c.since = "on_hand", 0, now
                back += 1
        self.stats.returned_by_exit += back
        return back

    def trim(self, keep_bytes: int, why: str) -> list[int]:
        """Close on-hand chunks, the oldest first, until at most ``keep_bytes`` are on hand;
        returns their fds (to close). Lent chunks are never touched."""
        keep = max(0, keep_bytes) // self.chunk_bytes
        hand = self.on_hand
        closing = hand[: max(0, len(hand) - keep)]
        for c in closing:
            del self._chunks[c.id]
        self._closed(why, len(closing))
        return [c.fd for c in closing]

    def _closed(self, why: str, n: int) -> None:
        if n:
            self.stats.closed[why] = self.stats.closed.get(why, 0) + n

    def _note_set(self, pid: int) -> None:
        self.largest_set = max(self.largest_set, len(self.lent_to(pid)))


def on_hand_limit(budget_bytes: int | None, leased_bytes: int, ledger: Ledger) -> int:
    """How many bytes the holder may keep on hand under the budget in force.

    ``budget_bytes``: the device's weights budget (None: one model at a time); ``leased_bytes``:
    the live weights leases' bytes. A byte budget keeps what a lease could still take: the budget
    less what is leased. A one-model budget keeps the largest set of chunks one pid has had (the
    next model needs the device alone, and one model's chunks are what it frees) less what is
    lent now. (No budget recorded -- workers that use no arena lease -- no limit: the holder's
    idle time and lifetime still apply.)"""
    if budget_bytes is None:
        return max(0, ledger.largest_set * ledger.chunk_bytes - ledger.lent_bytes)
    return max(0, budget_bytes - leased_bytes)
