"""A worker's side of the arena: waiting for a lease on a helper thread, the doorbell, release.

The "token" of the arena's first version is now a lease on the device's VRAM budget: under a
one-model budget a lease is exactly the old token (one holder at a time); under a byte budget
several workers hold leases at once as long as their weight bytes fit. A request takes a ticket
(FIFO: :mod:`.tickets`); the head of the queue checks, under the arena lock, whether its bytes fit
beside the live leases (:func:`~.budget.plan_fit`) and creates its lease there; otherwise it waits
for the holders the plan names (least recently used, unpinned) to leave, blocked in ``flock`` on
the first one's lease file (so a killed holder frees its bytes at once) and woken by any change
of ``leases/``. The named holders hear the doorbell: each holder's warden evaluates the same plan
for the head of the queue and rings its worker when it is named.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..errors import ArenaError, VramBudgetError
from ..observe import NULL_OBSERVER, Observer
from .arena import Arena
from .budget import BudgetRecord, LeaseRecord, Plan, lease_bytes_for, plan_fit
from .records import (
    RECORD_MODEL_RE,
    RESCAN_INTERVAL_S,
    RING_REPEAT_S,
    DoorbellRing,
    HolderRecord,
    ReleaseRecord,
    Ticket,
    TokenGrant,
)
from .request import Held, TokenRequest, gb_text
from .watch import DirWatch

log = logging.getLogger(__name__)

#: how long release() and set_pinned() try for the arena lock to keep the holder record current
#: (it only informs: a release never waits longer than this for it)
HOLDER_LOCK_TIMEOUT_S = 0.5


# ---- a worker's side -------------------------------------------------------------------------


class TokenClient:
    """One worker's handle on the arena: its membership (the budget in force), its lease.

    ``request(timeout, need)`` → :class:`TokenRequest` for ``need`` weight bytes (None: the device
    to itself; immediately granted if this client holds a lease; the same pending request if one
    is pending and not cancelled). ``release(release_ms)`` ends the lease (call it only after the
    weights are off the device), leaving how long their release took in the arena for the next
    holder's grant (:class:`~.records.ReleaseRecord`, :attr:`~.records.TokenGrant.previous_release_ms`).
    ``start_doorbell(on_waiter)`` starts the warden thread that calls ``on_waiter(DoorbellRing)``
    when the head of the queue needs this client's lease to go (always, under a one-model budget,
    unless pinned): at once for a new waiter, after each new acquisition and after
    :meth:`poke_doorbell`, and again every ``RING_REPEAT_S`` for as long as that holds
    (level-triggered: a dropped ring, e.g. one that came while restoring, is heard again).
    ``budget``: the budget this client would record if it is the arena's first member (None: one
    model at a time); :attr:`budget` is the one in force, :attr:`budget_note` says when they differ.

    It is the :class:`~.request.LeaseOwner` of its requests: the methods of "the requests' side"
    are called by a request's helper thread, never by the worker.
    """

    def __init__(
        self,
        arena: Arena,
        model: str,
        *,
        observer: Observer = NULL_OBSERVER,
        pinned: bool = False,
        budget: BudgetRecord | None = None,
    ) -> None:
        if not RECORD_MODEL_RE.match(model):
            raise ArenaError(
                f"model id {model!r} cannot name an arena ticket: use letters, digits and ._#+@=-"
            )
        self.arena = arena
        self.model = model
        self.observer = observer
        self._pinned = pinned
        self._partial = False
        self._lock = threading.Lock()
        self._held: Held | None = None
        self._reserve: tuple[str, int, LeaseRecord] | None = None  # name, fd, record
        self._pending: TokenRequest | None = None
        self._own_tickets: set[str] = set()
        self._ring_generation = 0
        self._doorbell: threading.Thread | None = None
        self._doorbell_watch: DirWatch | None = None
        self._doorbell_stop = threading.Event()
        # Set while the doorbell has a reason to scan: this client holds a lease (only a holder
        # rings), or close() stops the doorbell. While clear the warden sleeps on it, not scanning.
        self._doorbell_armed = threading.Event()
        # scans of the arena made to judge what the head of the queue asks (ring_now: the waiters
        # and the leases read, the head's plan made): by the warden for its rings, and by any other
        # thread (a worker deciding a yield). Counters for tests and benchmarks: one ring is one
        # scan, and a yield decided from a fresh ring adds none
        self.ring_scans = 0
        self.yield_scans = 0
        self._scans_lock = threading.Lock()
        self.budget, self._budget_fd, self.budget_note = arena.lease_files.join_budget(budget)

    # -- state --

    @property
    def holds_token(self) -> bool:
        """Holds a lease: its weights may be on the device."""
        return self._held is not None

    @property
    def lease_bytes(self) -> int:
        held = self._held
        return held.record.bytes if held is not None else 0

    @property
    def reserve_bytes(self) -> int:
        return self._reserve[2].bytes if self._reserve is not None else 0

    @property
    def reserve_deepens(self) -> int:
        """The bytes its reserve says a deep release would free (0: it is deep, or no reserve)."""
        return self._reserve[2].deepens if self._reserve is not None else 0

    def weights_budget(self) -> int | None:
        """The weight bytes the device may hold now (None: one model at a time)."""
        reserved = sum(x.bytes for x in self.arena.leases() if x.kind == "reserve")
        return self.budget.weights_budget(reserved)

    def deepable_bytes(self) -> int:
        """What the other workers' deep releases could free (their unpinned reserves' ``deepens``):
        room an auto budget can make beyond :meth:`weights_budget`."""
        mine = os.getpid(), self.model
        return sum(
            x.deepens
            for x in self.arena.leases()
            if x.kind == "reserve" and not x.pinned and (x.pid, x.model) != mine
        )

    def holders(self) -> list[LeaseRecord]:
        """The live weights leases of the device (every process's), most recent first."""
        leases = [x for x in self.arena.leases() if x.kind == "weights"]
        return sorted(leases, key=lambda x: x.since_monotonic, reverse=True)

    def set_pinned(self, pinned: bool) -> None:
        """Record pinned-ness (a pinned holder is never asked to leave; waiters are told so);
        unpinning re-rings."""
        with self._lock:
            self._pinned = pinned
            held = self._held
            if held is not None:
                held.record = replace(held.record, pinned=pinned)
                self._write_lease(held)
                self._update_holder_record(keep_mine=True)
            self._rewrite_reserve(pinned=pinned)
        self.poke_doorbell()

    def set_partial(self, partial: bool) -> None:
        """Record whether this client's worker can free part of its lease (layer parts): the
        plan then asks it, under a byte budget, for only the bytes a request lacks."""
        with self._lock:
            self._partial = partial
            held = self._held
            if held is not None and held.record.partial != partial:
                held.record = replace(held.record, partial=partial)
                self._write_lease(held)
        self.poke_doorbell()

    def note_use(self, busy: bool, quantum_until: float = 0.0) -> None:
        """The worker started (``busy``, keeping the GPU at least until ``quantum_until``) or
        finished using its weights: recorded in its lease for the others' least-recently-used
        choice."""
        with self._lock:
            until, at = (quantum_until if busy else 0.0), time.monotonic()
            self._rewrite_reserve(busy=busy, quantum_until=until, used_at=at)  # who goes deep first: LRU too
            held = self._held
            if held is None:
                return
            held.record = replace(held.record, busy=busy, quantum_until=until, used_at=at)
            self._write_lease(held)

    def _rewrite_reserve(
        self,
        *,
        pinned: bool | None = None,
        busy: bool | None = None,
        quantum_until: float | None = None,
        used_at: float | None = None,
    ) -> None:
        """Rewrite the reserve lease's record in place (under ``self._lock``)."""
        if self._reserve is None:
            return
        name, fd, record = self._reserve
        record = replace(
            record,
            pinned=record.pinned if pinned is None else pinned,
            busy=record.busy if busy is None else busy,
            quantum_until=record.quantum_until if quantum_until is None else quantum_until,
            used_at=record.used_at if used_at is None else used_at,
        )
        self._reserve = (name, fd, record)
        try:
            self.arena.lease_files.update(fd, record)
        except OSError as exc:
            log.warning("could not update the reserve lease %s: %s", name, exc)

    def _write_lease(self, held: Held) -> None:
        try:
            self.arena.lease_files.update(held.fd, held.record)
        except OSError as exc:  # informs the others' choice only; the lock is what counts
            log.warning("could not update the lease %s: %s", held.name, exc)

    def others_waiting(self) -> tuple[Ticket, ...]:
        """Live tickets of other requesters (sweeps stale ones)."""
        return tuple(t for t in self.arena.waiters() if t.name not in self._own_tickets)

    def asked_to_yield(self, waiters: tuple[Ticket, ...] | None = None) -> bool:
        """The head of the queue needs this client's lease to go, or part of it
        (:meth:`asked_to_free`)."""
        return self.asked_to_free(waiters) is not None

    def asked_to_free(self, waiters: tuple[Ticket, ...] | None = None) -> int | None:
        """The weight bytes the head of the queue (``waiters``: every live ticket in queue order)
        asks this client to free: its whole lease, or for a partial lease under a byte budget only
        what the head lacks; None when not asked (it is not named by the plan of
        :func:`~.budget.plan_fit`, the head is this client's own request, or the head can never
        fit). Judged as if this client were unpinned: the caller checks its own pin."""
        if self._held is None:
            return None
        return self.ring_now(waiters).ask

    def asked_to_deepen(self, waiters: tuple[Ticket, ...] | None = None) -> bool:
        """The head of the queue's plan asks this client's worker to go deep: release its KV cache
        and compute buffers (its reserve lease is named; issue 39). Judged as if unpinned, as
        :meth:`asked_to_free`."""
        if not self._may_deepen():
            return False
        return self.ring_now(waiters).deepen

    def _may_deepen(self) -> bool:
        reserve = self._reserve
        return reserve is not None and reserve[2].deepens > 0 and self.budget.kind == "auto"

    def ring_now(self, waiters: tuple[Ticket, ...] | None = None) -> DoorbellRing:
        """One scan of the arena (``waiters``: every live ticket in queue order, listed now when
        None): who waits, and what the head of the queue asks of this client, its weights
        (:meth:`asked_to_free`) and its KV cache (:meth:`asked_to_deepen`), each judged as if this
        client were unpinned (a pinned holder hears the bell too, and ignores it while pinned, so
        that unpinning yields at the next ring). What the doorbell rings with; a worker deciding a
        yield calls it only when the last ring is no longer fresh."""
        at = time.monotonic()
        self._count_scan()
        if waiters is None:
            waiters = tuple(self.arena.waiters())
        others = tuple(t for t in waiters if t.name not in self._own_tickets)
        held, reserve = self._held, self._reserve
        deepable = reserve is not None and self._may_deepen()
        if not waiters or waiters[0].name in self._own_tickets or (held is None and not deepable):
            return DoorbellRing(waiters=others, at=at)
        head = waiters[0]
        need = self.arena.ticket_need(head)
        leases = self.arena.leases()
        ask: int | None = None
        deepen = False
        if held is not None:
            plan = self._head_plan(head, need, leases, held.name)
            ask = None if plan.fits or not plan.possible else plan.asked(held.name)
        if reserve is not None and deepable:
            plan = self._head_plan(head, need, leases, reserve[0])
            deepen = not plan.fits and plan.possible and plan.asked_to_deepen(reserve[0])
        return DoorbellRing(waiters=others, at=at, ask=ask, deepen=deepen, need=need)

    def _count_scan(self) -> None:
        """One more scan: :attr:`ring_scans` on the warden's thread, else :attr:`yield_scans`."""
        with self._scans_lock:
            if threading.current_thread() is self._doorbell:
                self.ring_scans += 1
            else:
                self.yield_scans += 1

    def _head_plan(self, head: Ticket, need: int | None, leases: list[LeaseRecord], mine: str) -> Plan:
        """The plan of the head of the queue for ``need`` bytes beside ``leases``, with this
        client's lease ``mine`` judged as if unpinned."""
        leases = [replace(x, pinned=False) if x.name == mine else x for x in leases]
        return plan_fit(need, leases, self.budget, time.monotonic(), requester=(head.pid, head.model))

    # -- leases --

    def request(self, timeout: float | None = None, need: int | None = None) -> TokenRequest:
        """A request for ``need`` weight bytes (see the class docstring). A holder whose lease is
        smaller than ``need`` under a byte budget (a partial release shrank it) asks for the rest
        through the queue like any request: the bytes it holds count as its own, and once it fits
        its lease grows to ``need``.

        A pending request that was cancelled is never handed out again (its ``result()`` raises
        CancelledError: the caller that asks now cancelled nothing): this waits until its thread
        has finished (it gives back what it took meanwhile; a cancel is seen at its next scan) and
        makes a new one."""
        while True:
            with self._lock:
                pending = self._pending
                if pending is None or pending.done():
                    held = self._held
                    grows = held is not None and need is not None and held.record.bytes < need
                    if held is not None and not (grows and not self.budget.one_model):
                        return TokenRequest.granted(self, held.grant)
                    req = TokenRequest(self, timeout, need)
                    self._pending = req
                    break
                if not pending.cancelled:
                    return pending
            pending.wait()  # outside the lock: its thread calls back into this client as it ends
        req.start()
        return req

    def acquire(self, timeout: float | None = None, need: int | None = None) -> TokenGrant:
        """Blocking convenience: request and wait (cancels the request if interrupted)."""
        req = self.request(timeout, need)
        try:
            return req.result()
        except BaseException:
            req.cancel()
            raise

    def shrink(self, nbytes: int, release_ms: float | None = None) -> None:
        """Lease ``nbytes`` instead (after a load, once the real weight bytes are known; after a
        partial release, which ``release_ms`` says took that long: recorded for the grant the
        room lets through, as :meth:`release` does). The lease is replaced under the arena lock,
        so nobody sees both or neither. More than now (never expected: a load leases its file's
        bytes) only when the rest of the budget has room, else VramBudgetError."""
        with self._lock:
            held = self._held
            if held is None or nbytes == held.record.bytes:
                return
            lock = self.arena.dir.lock()
            assert lock is not None
            try:
                if nbytes > held.record.bytes and not self.budget.one_model:
                    others = [x for x in self.arena.leases() if x.name != held.name]
                    plan = plan_fit(nbytes, others, self.budget, time.monotonic())
                    if not plan.fits:
                        raise VramBudgetError(
                            f"{self.model}'s weights take {gb_text(nbytes)}, more than the "
                            f"{gb_text(held.record.bytes)} its load reserved, and the VRAM budget has no "
                            "room for the rest now"
                        )
                if release_ms is not None and nbytes < held.record.bytes:
                    self._write_release(release_ms)
                # the new size counts from before anyone can see it (nobody is granted meanwhile)
                at = time.monotonic()
                record = replace(held.record, bytes=nbytes, name="")
                name, fd = self.arena.lease_files.create(record)
                self.arena.lease_files.drop(held.name, held.fd)
            finally:
                self.arena.dir.unlock(lock)
            self._resized(held, name, fd, record, at, "shrunk")

    def _resized(self, held: Held, name: str, fd: int, record: LeaseRecord, at: float, kind: str) -> None:
        """``held`` is now the lease file ``name`` of ``record``'s bytes, from ``at`` on."""
        if not held.sizes:
            held.sizes.append((held.grant.acquired_at, held.record.bytes))
        held.sizes.append((at, record.bytes))
        held.name, held.fd, held.record = name, fd, replace(record, name=name)
        held.grant = replace(held.grant, bytes=record.bytes)
        try:  # for a holder killed later: its bytes from here on
            self.observer.record(kind, at, at, bytes=record.bytes, device=self.budget.device)
        except OSError as exc:
            log.warning("could not record the lease's new size: %s", exc)

    def reserve(self, nbytes: int, deepens: int = 0, *, from_lease: bool = False) -> None:
        """Hold a "reserve" lease of ``nbytes`` for as long as this client lives: what the worker
        keeps on the device while released (auto budgets); ``deepens``: the bytes of it a deep
        release (KV cache and compute buffers) would free, 0 when it has nothing more to free.
        Replaces an earlier one. ``from_lease``: the bytes it grows by come out of the weights
        lease held now (a worker back from the deep level, whose request asked for its weights and
        them), in the same critical section, so the device's leased total never moves."""
        with self._lock:
            lock = self.arena.dir.lock()
            assert lock is not None
            try:
                old = self._reserve
                grows = nbytes - (old[2].bytes if old is not None else 0)
                held = self._held
                if from_lease and grows > 0 and held is not None and held.record.bytes > grows:
                    at = time.monotonic()
                    record = replace(held.record, bytes=held.record.bytes - grows, name="")
                    name, fd = self.arena.lease_files.create(record)
                    self.arena.lease_files.drop(held.name, held.fd)
                    self._resized(held, name, fd, record, at, "shrunk")
                self._reserve = None
                if nbytes > 0:
                    now = time.monotonic()
                    reserve = LeaseRecord(
                        model=self.model,
                        pid=os.getpid(),
                        bytes=nbytes,
                        kind="reserve",
                        since=time.time(),
                        since_monotonic=now,
                        pinned=self._pinned,
                        used_at=old[2].used_at if old is not None else now,
                        deepens=max(0, deepens),
                    )
                    name, fd = self.arena.lease_files.create(reserve)
                    self._reserve = (name, fd, replace(reserve, name=name))
                if old is not None:
                    self.arena.lease_files.drop(old[0], old[1])
            finally:
                self.arena.dir.unlock(lock)
            if self.reserve_deepens > 0:
                self._doorbell_armed.set()  # a parked worker hears the head asking for its KV cache
            elif self._held is None and not self._doorbell_stop.is_set():
                self._doorbell_armed.clear()
        self.poke_doorbell()

    def release(self, release_ms: float | None = None) -> float | None:
        """End the lease; returns the monotonic time the holding ended (None if not held).
        ``release_ms``: how long the worker's release of its weights took (None: nothing was
        released, e.g. a lease taken only to make room), written to the arena's release record
        before the lease goes, so that the grant this lets through carries it."""
        with self._lock:
            held = self._held
            if held is None:
                return None
            self._held = None
            if self.reserve_deepens <= 0:  # a parked worker with a KV cache to free still listens
                self._doorbell_armed.clear()
            lock = None
            try:
                lock = self.arena.dir.lock(timeout=HOLDER_LOCK_TIMEOUT_S)
                if release_ms is not None:  # without the lock too: the grant comes after the drop
                    self._write_release(release_ms)
                if lock is not None:
                    self._rewrite_holder_record(exclude=held.name)
                end = time.monotonic()
                self._record_interval(held, end)
            finally:  # whatever happened above, the lease goes back
                self.arena.lease_files.drop(held.name, held.fd)
                if lock is not None:
                    self.arena.dir.unlock(lock)
            return end

    def _write_release(self, release_ms: float) -> None:
        """The release record for the next grant (before the lease, or part of it, goes)."""
        record = ReleaseRecord(
            model=self.model, pid=os.getpid(), release_ms=max(0.0, float(release_ms)), at=time.monotonic()
        )
        self.arena.write_release(record)

    def _previous_release_ms(self, req: TokenRequest) -> float:
        """Under the arena lock, as a lease is granted: take the release record, and say how long
        the release took that this grant followed: one another holder made after ``req`` was
        requested (one from before was no part of this wait), else 0.0 (none: no previous holder,
        a share beside a pinned holder, a holder that crashed: it wrote nothing)."""
        record = self.arena.take_release()
        if record is None or record.at < req.requested_at:
            return 0.0
        if record.pid == os.getpid() and record.model == self.model:
            return 0.0  # its own release (it gave way while it waited): no other holder's
        return record.release_ms

    def _record_interval(self, held: Held, end: float) -> None:
        grant = held.grant
        extra: dict[str, object] = {}
        if held.sizes:
            extra = {"sizes": [[at, nbytes] for at, nbytes in held.sizes]}
        try:
            self.observer.record(
                "token",
                grant.acquired_at,
                end,
                requested=grant.requested_at,
                handoff=grant.handoff,
                previous=grant.previous,
                bytes=held.record.bytes,
                budget=grant.budget,
                device=self.budget.device,
                **extra,
            )
        except OSError as exc:
            log.warning("could not record the token interval: %s", exc)

    def _holder_record(self, lease: LeaseRecord, grant: TokenGrant | None = None) -> HolderRecord:
        since_mono = grant.acquired_at if grant is not None else lease.since_monotonic
        return HolderRecord(
            model=lease.model,
            pid=lease.pid,
            since=time.time() - (time.monotonic() - since_mono),
            since_monotonic=since_mono,
            pinned=lease.pinned,
        )

    def _update_holder_record(self, keep_mine: bool) -> None:
        """Rewrite the holder record when it names this client (pinned changed)."""
        held = self._held
        if held is None:
            return
        lock = self.arena.dir.lock(timeout=HOLDER_LOCK_TIMEOUT_S)
        if lock is None:
            return
        try:
            current = self.arena.holder()
            if current is None or (current.pid == os.getpid() and current.model == self.model):
                self.arena.write_holder(self._holder_record(held.record, held.grant))
        finally:
            self.arena.dir.unlock(lock)

    def _rewrite_holder_record(self, exclude: str) -> None:
        """Under the arena lock, as a lease ends: the holder record names the most recent other
        holder, or goes."""
        current = self.arena.holder()
        if current is not None and not (current.pid == os.getpid() and current.model == self.model):
            return  # another process's record: theirs
        others = [x for x in self.arena.leases() if x.kind == "weights" and x.name != exclude]
        if others:
            latest = max(others, key=lambda x: x.since_monotonic)
            self.arena.write_holder(self._holder_record(latest))
        else:
            self.arena.remove_holder()

    # -- the requests' side (LeaseOwner: called on a request's helper thread) --

    def ticket_taken(self, ticket: Ticket) -> None:
        self._own_tickets.add(ticket.name)

    def ticket_gone(self, ticket: Ticket) -> None:
        self._own_tickets.discard(ticket.name)

    def create_lease(self, req: TokenRequest, plan: Plan, leases: list[LeaseRecord]) -> Held:
        """Under the arena lock: create the lease the plan allows, and the holder record."""
        now = time.monotonic()
        reserved = sum(x.bytes for x in leases if x.kind == "reserve")
        # a holder growing back: a lease of the rest beside its own, merged into it once granted
        record = LeaseRecord(
            model=self.model,
            pid=os.getpid(),
            bytes=lease_bytes_for(req.need, self.budget, reserved) - plan.own,
            since=time.time(),
            since_monotonic=now,
            pinned=self._pinned,
            used_at=now,
            partial=self._partial,
        )
        name, fd = self.arena.lease_files.create(record)
        grant = TokenGrant(
            model=self.model,
            requested_at=req.requested_at,
            acquired_at=now,
            handoff=req.waited or (self.budget.one_model and req.previous is not None),
            previous=req.previous,
            bytes=record.bytes,
            budget=plan.budget,
            previous_release_ms=self._previous_release_ms(req),
        )
        self.arena.write_holder(self._holder_record(record, grant))
        return Held(name=name, fd=fd, record=replace(record, name=name), grant=grant)

    def give_back(self, held: Held) -> None:
        """A lease granted to a request cancelled meanwhile: nothing was ever resident under it."""
        lock = self.arena.dir.lock(timeout=HOLDER_LOCK_TIMEOUT_S)
        try:
            self.arena.lease_files.drop(held.name, held.fd)
            if lock is not None:
                self._rewrite_holder_record(exclude=held.name)
        finally:
            if lock is not None:
                self.arena.dir.unlock(lock)

    def became_holder(self, held: Held) -> None:
        grant = held.grant
        with self._lock:
            if self._held is not None:  # it grew back: one lease of both, from the grant on
                self._merge(self._held, held)
                self._ring_generation += 1
                return
            self._held = held
            self._ring_generation += 1
            self._doorbell_armed.set()
            try:  # the start of the interval, in case this process dies before it releases
                self.observer.record(
                    "acquired",
                    grant.acquired_at,
                    grant.acquired_at,
                    requested=grant.requested_at,
                    bytes=grant.bytes,
                    budget=grant.budget,
                    device=self.budget.device,
                )
            except OSError as exc:
                log.warning("could not record the token acquisition: %s", exc)
        if self._doorbell_watch is not None:
            self._doorbell_watch.wake()

    def _merge(self, held: Held, extra: Held) -> None:
        """Replace ``held`` and the ``extra`` lease a request for the rest was granted by one lease
        of both (under the arena lock, so nobody sees both or neither); the holding goes on."""
        lock = self.arena.dir.lock()
        assert lock is not None
        try:
            record = replace(held.record, bytes=held.record.bytes + extra.record.bytes, name="")
            name, fd = self.arena.lease_files.create(record)
            self.arena.lease_files.drop(extra.name, extra.fd)
            self.arena.lease_files.drop(held.name, held.fd)
        finally:
            self.arena.dir.unlock(lock)
        # the holding (its grant, its token interval) goes on from its first acquisition
        self._resized(held, name, fd, record, extra.grant.acquired_at, "resized")

    def request_finished(self, req: TokenRequest) -> None:
        with self._lock:
            if self._pending is req:
                self._pending = None

    # -- doorbell (warden thread) --

    def start_doorbell(self, on_waiter: Callable[[DoorbellRing], None]) -> None:
        if self._doorbell is not None:
            return
        self._doorbell_watch = self.arena.watch()
        self._doorbell_stop.clear()
        with self._lock:  # close() leaves it set; armed again only while holding
            if self._held is None and self.reserve_deepens <= 0:
                self._doorbell_armed.clear()
        self._doorbell = threading.Thread(
            target=self._doorbell_loop,
            args=(on_waiter, self._doorbell_watch),
            name="arena-doorbell",
            daemon=True,
        )
        self._doorbell.start()

    def poke_doorbell(self) -> None:
        """Make the warden rescan now and ring again if this client is asked to yield."""
        with self._lock:
            self._ring_generation += 1
        if self._doorbell_watch is not None:
            self._doorbell_watch.wake()

    def _doorbell_loop(self, on_waiter: Callable[[DoorbellRing], None], watch: DirWatch) -> None:
        # Level-triggered: while this client holds a lease the head of the queue needs, the bell
        # rings again every RING_REPEAT_S. A ring that the worker drops (it arrived while the worker
        # was restoring, or while it was pinned) must not leave a waiter waiting forever.
        rung: set[str] = set()
        rung_generation = -1
        last_ring = -math.inf
        while not self._doorbell_stop.is_set():
            if not self._doorbell_armed.is_set():
                # Not holding: nothing to ring for (waiters sweep stale tickets in their own scans).
                self._doorbell_armed.wait()
                continue
            ring: DoorbellRing | None = None
            try:
                ring = self.ring_now()  # the one scan: who waits, and what the head asks of this client
                others, asked = ring.waiters, ring.ask is not None or ring.deepen
            except OSError as exc:
                log.warning("scanning %s failed: %s", self.arena.waiters_path, exc)
                ring, others, asked = None, (), False
            names = {t.name for t in others}
            generation = self._ring_generation
            now = time.monotonic()
            due = bool(names - rung) or generation != rung_generation or now - last_ring >= RING_REPEAT_S
            if ring is not None and asked and (self.holds_token or self.reserve_deepens > 0) and due:
                rung |= names
                rung_generation = generation
                last_ring = now
                log.debug("doorbell: %s wait(s) for the GPU (%s)", len(others), others[0].model)
                try:
                    on_waiter(ring)  # with what the head asks: the worker need not scan again
                except Exception:
                    log.exception("the doorbell callback failed")
            rung &= names  # forget waiters that left, so a returning name rings again
            listening = self.holds_token or self.reserve_deepens > 0
            watch.wait(RING_REPEAT_S if others and listening else RESCAN_INTERVAL_S)
        watch.close()

    def close(self) -> None:
        """Stop the doorbell, cancel a pending request, release the lease and the membership."""
        self._doorbell_stop.set()
        self._doorbell_armed.set()
        if self._doorbell_watch is not None:
            self._doorbell_watch.wake()
        if self._doorbell is not None:
            self._doorbell.join(timeout=5.0)
            self._doorbell = None
            self._doorbell_watch = None
        pending = self._pending
        if pending is not None:
            pending.cancel()
            pending.wait(5.0)
        self.release()
        with self._lock:
            if self._reserve is not None:
                self.arena.lease_files.drop(self._reserve[0], self._reserve[1])
                self._reserve = None
            if self._budget_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._budget_fd)
                self._budget_fd = -1
