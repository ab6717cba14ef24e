"""The hand-over holder's bookkeeping: which chunks of device memory it holds, and who may have
each mapped (issue 40; docs/INTERFACES.md, "Device memory handed over between workers").

Pure: no syscall here. The holder (:mod:`.holder`) owns one :class:`Ledger` and closes the fds
the ledger hands back to it.

A chunk is one allocation of device memory of the arena's chunk size, known to the holder by an
fd (a CUDA VMM POSIX-fd handle, or a memfd on the CPU stand-in). Its state is **on hand** (only
the holder references it), **lent** to one pid (which has it mapped, in use by its model), or
**kept** by one pid: lent back to the arena but still mapped by its owner, which released its
model and keeps the mapping so that its next restore maps nothing (:meth:`Ledger.keep`; its
:meth:`Ledger.use` makes it lent again). A kept chunk is given to another worker only after
its owner unmapped it at the holder's request (:meth:`Ledger.ask_back`, then
:meth:`Ledger.released`). A chunk comes back on hand only by its pid's :meth:`Ledger.put` or
:meth:`Ledger.released` (sent once it unmapped the chunk) or that pid's exit
(:meth:`Ledger.pid_gone`, from a pidfd: its mappings are gone with it). So no chunk is ever
mapped by two live workers.

Each chunk has a **generation** (:attr:`Chunk.gen`), bumped whenever a pid's hold of it begins or
ends (given, adopted, put, released, returned by an exit) -- never by keep or use. A worker that
keeps a chunk learns its generation (:meth:`Ledger.keep`); when it restores into it again it names
that generation (:meth:`Ledger.use`) and the holder vouches for the chunk only if it is still kept
by that pid at the same generation: nobody else can have mapped it since, so the bytes the owner
left there are still there (its restore need not upload them again).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

ChunkState = Literal["on_hand", "lent", "kept"]


class LedgerError(ValueError):
    """A request the ledger refuses (a chunk id that is not lent to the asker, a bad count)."""


@dataclass
class Chunk:
    id: int
    fd: int
    state: ChunkState
    pid: int = 0  # the borrower while lent or kept
    #: when it last came on hand, or was kept (the holder's clock): the oldest go first
    since: float = 0.0
    #: kept, and its owner was asked to unmap it (:meth:`Ledger.ask_back`)
    asked: bool = False
    #: bumped each time a pid's hold of the chunk begins or ends (see the module's doc)
    gen: int = 1


@dataclass
class LedgerStats:
    """What the holder did since it started (counts of chunks)."""

    given: int = 0  # lent out of the chunks on hand (take)
    adopted: int = 0  # created by a worker and handed to the holder (adopt)
    put: int = 0  # came back on hand from a live worker
    returned_by_exit: int = 0  # came back on hand because their borrower exited
    kept: int = 0  # released by their borrower and still mapped by it (keep)
    reused: int = 0  # kept ones their owner used again (a restore that mapped nothing)
    asked_back: int = 0  # kept ones whose owner was asked to unmap them (another worker needed them)
    released: int = 0  # kept ones their owner unmapped when asked: on hand again
    intact: int = 0  # reused ones vouched for: still kept by their owner at the generation it named
    closed: dict[str, int] = field(default_factory=dict)  # why: "trim", "idle", "budget", "drop", "exit"

    def as_dict(self) -> dict[str, object]:
        return {
            "given": self.given,
            "adopted": self.adopted,
            "put": self.put,
            "returned_by_exit": self.returned_by_exit,
            "kept": self.kept,
            "reused": self.reused,
            "asked_back": self.asked_back,
            "released": self.released,
            "intact": self.intact,
            "closed": dict(self.closed),
        }


class Ledger:
    """The chunks one holder holds. ``chunk_bytes``: the size of every chunk."""

    def __init__(self, chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunks: dict[int, Chunk] = {}
        # ids start at a random point: a worker that still holds ids of a dead holder's session
        # never names one of this holder's chunks by chance
        self._ids = itertools.count(1 + secrets.randbelow(1 << 40))
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
    def kept_bytes(self) -> int:
        return self.chunk_bytes * sum(1 for c in self._chunks.values() if c.state == "kept")

    def kept_by(self, pid: int) -> list[int]:
        """The ids of the chunks ``pid`` keeps mapped while its model is released."""
        return sorted(c.id for c in self._chunks.values() if c.state == "kept" and c.pid == pid)

    @property
    def held_bytes(self) -> int:
        return self.chunk_bytes * len(self._chunks)

    def lent_to(self, pid: int) -> list[int]:
        """The ids of the chunks lent to ``pid``."""
        return sorted(c.id for c in self._chunks.values() if c.state == "lent" and c.pid == pid)

    def borrowers(self) -> dict[int, int]:
        """pid -> chunks lent to it or kept by it (it has them mapped)."""
        out: dict[int, int] = {}
        for c in self._chunks.values():
            if c.state != "on_hand":
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
            c.gen += 1
        self.stats.given += len(out)
        self._note_set(pid)
        return out

    def put(self, pid: int, ids: Iterable[int], now: float, keep: bool = True) -> list[int]:
        """``pid`` unmapped the chunks ``ids`` (lent to it or kept by it): they come back on
        hand, or are dropped (``keep`` False: the fds returned are to be closed). Every id is
        checked before anything changes: one that is not lent to ``pid`` raises LedgerError."""
        wanted = self._mine(pid, ids, ("lent", "kept"))
        closing: list[int] = []
        for i in wanted:
            c = self._chunks[i]
            if keep:
                c.state, c.pid, c.since, c.asked = "on_hand", 0, now, False
                c.gen += 1
            else:
                closing.append(self._chunks.pop(i).fd)
        self.stats.put += len(wanted)
        self._closed("drop", len(closing))
        return closing

    def _mine(self, pid: int, ids: Iterable[int], states: tuple[ChunkState, ...]) -> list[int]:
        """``ids`` without repeats, each checked to be ``pid``'s in one of ``states`` (else
        LedgerError, nothing changed)."""
        wanted = list(dict.fromkeys(ids))
        for i in wanted:
            c = self._chunks.get(i)
            if c is None or c.state not in states or c.pid != pid:
                raise LedgerError(f"chunk {i} is not {' or '.join(states)} by pid {pid}")
        return wanted

    def keep(self, pid: int, ids: Iterable[int], now: float) -> list[int]:
        """``pid`` released its model and keeps the chunks ``ids`` (lent to it) mapped: they are
        lent back to the arena (not in use by a model; another worker may have them once
        ``pid`` has unmapped them at the holder's request). Returns their generations, in the
        order of ``ids`` (what :meth:`use` is to be told)."""
        ids = list(ids)
        wanted = self._mine(pid, ids, ("lent",))
        for i in wanted:
            c = self._chunks[i]
            c.state, c.since, c.asked = "kept", now, False
        self.stats.kept += len(wanted)
        return [self._chunks[i].gen for i in ids]

    def use(self, pid: int, ids: Iterable[int], gens: Iterable[int] | None = None) -> list[int]:
        """``pid`` restores into the chunks ``ids`` it kept mapped: lent (in use) again. A
        chunk it was asked to unmap meanwhile is in use now: its answer will not name it.

        ``gens``: the generations :meth:`keep` gave for them (in the order of ``ids``); returns
        the ids vouched for -- kept by ``pid`` since then, at that generation: nobody else can
        have mapped them in between (none without ``gens``). Every id is checked before
        anything changes (LedgerError: one not kept by ``pid``, or ``gens`` of another length)."""
        ids = list(ids)
        named = None if gens is None else list(gens)
        if named is not None and len(named) != len(ids):
            raise LedgerError(f"{len(named)} generation(s) for {len(ids)} chunk(s)")
        wanted = self._mine(pid, ids, ("kept",))
        intact = []
        if named is not None:
            intact = list(
                dict.fromkeys(i for i, g in zip(ids, named, strict=True) if self._chunks[i].gen == g)
            )
        for i in wanted:
            c = self._chunks[i]
            c.state, c.asked = "lent", False
        self.stats.reused += len(wanted)
        self.stats.intact += len(intact)
        return intact

    def ask_back(self, n: int, but: int) -> dict[int, list[int]]:
        """Choose up to ``n`` kept chunks of pids other than ``but`` (the oldest kept first,
        not asked already) whose owners are to unmap them: pid -> ids, marked asked."""
        kept = sorted(
            (c for c in self._chunks.values() if c.state == "kept" and not c.asked and c.pid != but),
            key=lambda c: (c.since, c.id),
        )
        out: dict[int, list[int]] = {}
        for c in kept[: max(0, n)]:
            c.asked = True
            out.setdefault(c.pid, []).append(c.id)
        self.stats.asked_back += sum(len(v) for v in out.values())
        return out

    def released(self, pid: int, ids: Iterable[int], asked: Iterable[int], now: float) -> int:
        """``pid`` unmapped the kept chunks ``ids`` (at the holder's request): on hand again.
        ``asked``: what it was asked for; the ones it did not unmap (in use again: it sent
        :meth:`use`) may be asked for again. Returns how many came back."""
        wanted = self._mine(pid, ids, ("kept",))
        for i in wanted:
            c = self._chunks[i]
            c.state, c.pid, c.since, c.asked = "on_hand", 0, now, False
            c.gen += 1
        self.unask(asked)
        self.stats.released += len(wanted)
        return len(wanted)

    def still_asked(self, ids: Iterable[int]) -> bool:
        """Any of ``ids`` still kept and asked back (its owner has not answered)."""
        return any((c := self._chunks.get(i)) is not None and c.state == "kept" and c.asked for i in ids)

    def unask(self, ids: Iterable[int]) -> None:
        """No answer came in time: the chunks stay kept and may be asked for again."""
        for i in ids:
            c = self._chunks.get(i)
            if c is not None:
                c.asked = False

    def pid_gone(self, pid: int, now: float) -> int:
        """``pid`` exited (its mappings are gone with it): what was lent to it or kept by it is
        on hand again. Returns how many chunks came back."""
        back = 0
        for c in self._chunks.values():
            if c.state != "on_hand" and c.pid == pid:
                c.state, c.pid, c.since, c.asked = "on_hand", 0, now, False
                c.gen += 1
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
    less what is leased and less what released workers keep mapped (device memory outside every
    lease: :func:`outside_limit`). A one-model budget keeps the largest set of chunks one pid has
    had (the next model needs the device alone, and one model's chunks are what it frees) less
    what is lent or kept now. (No budget recorded -- workers that use no arena lease -- no limit:
    the holder's idle time and lifetime still apply.)"""
    if budget_bytes is None:
        held = ledger.lent_bytes + ledger.kept_bytes
        return max(0, ledger.largest_set * ledger.chunk_bytes - held)
    return max(0, outside_limit(budget_bytes, leased_bytes) - ledger.kept_bytes)


def outside_limit(budget_bytes: int, leased_bytes: int) -> int:
    """Under a byte budget, the device memory the arena may hold outside every weights lease
    (chunks on hand, and chunks released workers keep mapped): what a lease could still take.
    More than that and a lease the budget grants would not find its bytes on the device."""
    return max(0, budget_bytes - leased_bytes)
