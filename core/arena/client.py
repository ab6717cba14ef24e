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
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import ArenaError, CancelledError, TokenTimeoutError, VramBudgetError
from ..observe import NULL_OBSERVER, Observer
from ..units import decimal_bytes
from .budget import BudgetRecord, LeaseRecord, Plan, lease_bytes_for, plan_fit
from .records import (
    _MODEL_ID_RE,
    RESCAN_INTERVAL_S,
    RING_REPEAT_S,
    SWEEP_INTERVAL_S,
    DoorbellRing,
    HolderRecord,
    Ticket,
    TokenGrant,
)
from .tickets import Arena
from .watch import _DirWatch

log = logging.getLogger(__name__)

#: how long release() and set_pinned() try for the arena lock to keep the holder record current
#: (it only informs: a release never waits longer than this for it)
HOLDER_LOCK_TIMEOUT_S = 0.5


# ---- a worker's side -------------------------------------------------------------------------


@dataclass
class _Held:
    """The lease this client holds."""

    name: str
    fd: int
    record: LeaseRecord
    grant: TokenGrant
    load_bytes: int | None = None  # the bytes before a shrink
    shrunk_at: float | None = None


class _Locker:
    """Blocks in ``flock`` on another holder's lease file on its own thread: it returns when that
    lease ends (released, or its holder killed: the kernel drops the lock), then lets go at once
    (this process never holds another's lease) and wakes the waiter. A blocked flock cannot be
    interrupted: a waiter that gives up simply stops looking at it."""

    def __init__(self, arena: Arena, name: str, wake: Callable[[], None]) -> None:
        self.name = name
        self.done = threading.Event()
        fd = arena._open_lease_for_wait(name)
        if fd is None:
            self.done.set()
            return
        threading.Thread(target=self._run, args=(fd, wake), name="arena-flock", daemon=True).start()

    def _run(self, fd: int, wake: Callable[[], None]) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            log.debug("waiting on a lease failed: %s", exc)
        finally:
            os.close(fd)
            self.done.set()
            wake()


class TokenRequest:
    """A pending request for a lease (the GPU "token"), served on a helper thread. Thread-safe.

    ``wait(timeout)`` → True once finished; ``result()`` → :class:`TokenGrant` or raises
    :class:`TokenTimeoutError` (message names the holder), :class:`VramBudgetError` (it cannot
    fit: too large for the budget, or pinned models hold the rest), :class:`CancelledError` or
    :class:`ArenaError`. ``cancel()`` gives the place in the queue up; a request that already got
    the lease stays granted (release it through the client)."""

    def __init__(self, client: TokenClient, timeout: float | None, need: int | None = None) -> None:
        self._client = client
        self.need = need
        self.requested_at = time.monotonic()
        self._deadline = None if timeout is None else self.requested_at + timeout
        self._timeout = timeout
        self._done = threading.Event()
        self._cancelled = False
        self._grant: TokenGrant | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._watch: _DirWatch | None = None
        self._ticket: Ticket | None = None
        self._ahead = 0
        self._had_ahead = False
        self._waited = False
        self._plan: Plan | None = None
        self._previous: str | None = None
        self._thread: threading.Thread | None = None
        self._next_sweep = self.requested_at + SWEEP_INTERVAL_S

    # -- public --

    @property
    def ticket(self) -> Ticket | None:
        return self._ticket

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> TokenGrant:
        if not self._done.wait(timeout):
            raise TokenTimeoutError(
                f"still waiting for the GPU after {timeout:.1f} s: {self.waiting_reason()}"
            )
        if self._error is not None:
            raise self._error
        assert self._grant is not None
        return self._grant

    def cancel(self) -> bool:
        """Give up the place in the queue. False when the lease was already granted (then the
        client holds it: release it there)."""
        with self._lock:
            if self._grant is not None:
                return False
            if self._done.is_set():
                return True
            self._cancelled = True
            watch = self._watch
        if watch is not None:
            watch.wake()
        return True

    def waiting_reason(self) -> str:
        """Why this request waits, for people: "pinned by gemma3-270m", "held by X; 2 ahead"..."""
        if self._done.is_set():
            return ""
        parts = []
        plan = self._plan
        if plan is not None and not self._ahead:
            parts.append(_blockers(plan, self.need, self._client.budget))
        else:
            holder = self._client.arena.holder()
            if holder is not None and holder.pid != os.getpid():
                parts.append(holder.describe())
        if self._ahead:
            parts.append(f"{self._ahead} ahead in the queue")
        return "; ".join(p for p in parts if p) or "waiting for the GPU"

    # -- helper thread --

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"arena-request-{self._client.model}", daemon=True
        )
        self._thread.start()

    def _remaining(self) -> float:
        return RESCAN_INTERVAL_S if self._deadline is None else self._deadline - time.monotonic()

    def _sweep_now_and_then(self) -> None:
        """Waiters sweep the arena every ``SWEEP_INTERVAL_S`` (leftovers of dead processes)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        try:
            self._client.arena.sweep()
        except OSError as exc:
            log.warning("sweeping the arena %s failed: %s", self._client.arena.path, exc)

    def _check(self) -> None:
        if self._cancelled:
            raise CancelledError("the request for the GPU was cancelled")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise self._timeout_error()

    def _timeout_error(self) -> TokenTimeoutError:
        waited = f"waited {self._timeout:.1f} s for the GPU"
        plan = self._plan
        if plan is not None and plan.pinned and not plan.victims:
            names = " and ".join(x.model for x in plan.pinned)
            verb = "holds" if len(plan.pinned) == 1 else "hold"
            return TokenTimeoutError(
                f"{names} {verb} the GPU and {'is' if len(plan.pinned) == 1 else 'are'} pinned; "
                f"unpin {'it' if len(plan.pinned) == 1 else 'one'} or raise arena.wait_timeout_s ({waited})"
            )
        if plan is not None and plan.victims and not self._ahead:
            first = plan.victims[0]
            return TokenTimeoutError(
                f"{waited}: {first.model} (pid {first.pid}) holds it and has not yielded; "
                f"try again or raise arena.wait_timeout_s"
            )
        holder = self._client.arena.holder()
        if holder is not None and holder.pinned:
            return TokenTimeoutError(
                f"{holder.model} holds the GPU and is pinned; "
                f"unpin it or raise arena.wait_timeout_s ({waited})"
            )
        if holder is not None:
            return TokenTimeoutError(
                f"{waited}: {holder.model} (pid {holder.pid}) holds it and has not yielded; "
                f"try again or raise arena.wait_timeout_s"
            )
        return TokenTimeoutError(
            f"{waited}: {self._ahead} other request(s) were ahead in the queue; "
            f"try again or raise arena.wait_timeout_s"
        )

    def _run(self) -> None:
        arena = self._client.arena
        ticket_fd: int | None = None
        try:
            holder = arena.holder()
            self._previous = holder.model if holder is not None else None
            watch = arena._watch()  # before the first scan: nothing that appears later is missed
            with self._lock:
                self._watch = watch
                cancelled = self._cancelled
            if cancelled:
                raise CancelledError("the request for the GPU was cancelled")
            self._ticket, ticket_fd = arena._take_ticket(self._client.model, self.need)
            self._client._own_tickets.add(self._ticket.name)
            while True:  # wait until no live ticket is ahead of ours
                self._check()
                ahead = [t for t in arena.waiters() if t.seq < self._ticket.seq]
                self._ahead = len(ahead)
                self._had_ahead = self._had_ahead or bool(ahead)
                if not ahead:
                    break
                self._sweep_now_and_then()
                watch.wait(min(RESCAN_INTERVAL_S, self._remaining()))
            held = self._fit(watch)
            with self._lock:  # atomic against cancel(): granted, or cancelled and given back
                cancelled = self._cancelled
                if not cancelled:
                    self._grant = held.grant
            if cancelled:
                self._client._give_back(held)
                raise CancelledError("the request for the GPU was cancelled")
            self._client._became_holder(held)
            arena._drop_ticket(self._ticket, ticket_fd)  # lets the next waiter in
            ticket_fd = None
        except BaseException as exc:  # delivered through result()
            if isinstance(exc, OSError):
                exc = ArenaError(
                    f"the arena {arena.path} became unusable while waiting for the GPU ({exc}); "
                    f"restart Timeshare, or point TIMESHARE_VRAM_ARENA or arena.dir elsewhere"
                )
            self._error = exc
            if not isinstance(exc, (CancelledError, TokenTimeoutError, VramBudgetError)):
                log.error("waiting for the GPU token failed: %s", exc)
        finally:
            if ticket_fd is not None and self._ticket is not None:
                arena._drop_ticket(self._ticket, ticket_fd)
            if self._ticket is not None:
                self._client._own_tickets.discard(self._ticket.name)
            self._client._request_finished(self)  # before done: a new request() must not get this one
            with self._lock:
                self._done.set()
                watch_to_close, self._watch = self._watch, None
            if watch_to_close is not None:
                watch_to_close.close()

    def _fit(self, watch: _DirWatch) -> _Held:
        """As the head of the queue: take a lease as soon as this request fits (see the module
        docstring); raise VramBudgetError when it never can."""
        client = self._client
        arena = client.arena
        locker: _Locker | None = None
        while True:
            self._check()
            lock = arena._lock(self._check)
            assert lock is not None
            try:
                now = time.monotonic()
                leases = arena.leases()
                plan = plan_fit(self.need, leases, client.budget, now)
                if plan.fits:
                    return client._create_lease(self, plan, leases)
            finally:
                arena._unlock(lock)
            self._plan = plan
            self._waited = True
            # a request for the device to itself (a load under an auto budget) waits for pinned
            # holders as under a one-model budget; one for its bytes fails at once
            fails = plan.too_large or (not client.budget.one_model and self.need is not None)
            if not plan.possible and fails:
                raise VramBudgetError(_too_large(client.model, self.need, plan, client.budget))
            target = plan.victims[0] if plan.victims else (plan.pinned[0] if plan.pinned else None)
            if target is not None and (locker is None or locker.name != target.name or locker.done.is_set()):
                locker = _Locker(arena, target.name, watch.wake)
            if locker is None or not locker.done.is_set():
                self._sweep_now_and_then()
                watch.wait(min(RESCAN_INTERVAL_S, self._remaining()))


def _gb(n: int | None) -> str:
    return "?" if n is None else decimal_bytes(n)


def _blockers(plan: Plan, need: int | None, budget: BudgetRecord) -> str:
    """Who a head waiter waits for: "held by X", "pinned by Y", "held by X, Y (needs 2.1 GB of
    the 20.0 GB budget)"."""
    parts = []
    if plan.victims:
        parts.append("held by " + ", ".join(x.model for x in plan.victims))
    if plan.pinned and not plan.victims:
        parts.append("pinned by " + ", ".join(x.model for x in plan.pinned))
    text = " and ".join(parts)
    if plan.budget is not None and need is not None and text:
        text += f" (needs {_gb(need)}; {_gb(plan.leased)} of the {_gb(plan.budget)} budget leased)"
    return text


def _too_large(model: str, need: int | None, plan: Plan, budget: BudgetRecord) -> str:
    where = budget.device_name or f"device {budget.device}"
    setting = f"arena.vram_budget = {budget.setting!r}"
    if plan.too_large:
        return (
            f"{model} needs {_gb(need)} of VRAM for its weights, more than the whole budget of "
            f"{_gb(plan.budget)} on {where} ({setting}): raise the budget, or use a smaller "
            f"quantisation or fewer GPU layers"
        )
    pinned = ", ".join(f"{x.model} ({_gb(x.bytes)})" for x in plan.pinned)
    return (
        f"{model} needs {_gb(need)} of VRAM for its weights and cannot fit in the budget of "
        f"{_gb(plan.budget)} on {where} ({setting}) even after every unpinned model left: pinned "
        f"{pinned} {'holds' if len(plan.pinned) == 1 else 'hold'} the rest; unpin "
        f"{'it' if len(plan.pinned) == 1 else 'one of them'} or raise the budget"
    )


class TokenClient:
    """One worker's handle on the arena: its membership (the budget in force), its lease.

    ``request(timeout, need)`` → :class:`TokenRequest` for ``need`` weight bytes (None: the device
    to itself; immediately granted if this client holds a lease; the same pending request if one
    is pending). ``release()`` ends the lease (call it only after the weights are off the device).
    ``start_doorbell(on_waiter)`` starts the warden thread that calls ``on_waiter(DoorbellRing)``
    when the head of the queue needs this client's lease to go (always, under a one-model budget,
    unless pinned): at once for a new waiter, after each new acquisition and after
    :meth:`poke_doorbell`, and again every ``RING_REPEAT_S`` for as long as that holds
    (level-triggered: a dropped ring, e.g. one that came while restoring, is heard again).
    ``budget``: the budget this client would record if it is the arena's first member (None: one
    model at a time); :attr:`budget` is the one in force, :attr:`budget_note` says when they differ.
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
        if not _MODEL_ID_RE.match(model):
            raise ArenaError(
                f"model id {model!r} cannot name an arena ticket: use letters, digits and ._#+@=-"
            )
        self.arena = arena
        self.model = model
        self.observer = observer
        self._pinned = pinned
        self._lock = threading.Lock()
        self._held: _Held | None = None
        self._reserve: tuple[str, int, int] | None = None  # name, fd, bytes
        self._pending: TokenRequest | None = None
        self._own_tickets: set[str] = set()
        self._ring_generation = 0
        self._doorbell: threading.Thread | None = None
        self._doorbell_watch: _DirWatch | None = None
        self._doorbell_stop = threading.Event()
        # Set while the doorbell has a reason to scan: this client holds a lease (only a holder
        # rings), or close() stops the doorbell. While clear the warden sleeps on it, not scanning.
        self._doorbell_armed = threading.Event()
        self.budget, self._budget_fd, self.budget_note = arena._join_budget(budget)

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
        return self._reserve[2] if self._reserve is not None else 0

    def weights_budget(self) -> int | None:
        """The weight bytes the device may hold now (None: one model at a time)."""
        reserved = sum(x.bytes for x in self.arena.leases() if x.kind == "reserve")
        return self.budget.weights_budget(reserved)

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
        self.poke_doorbell()

    def note_use(self, busy: bool, quantum_until: float = 0.0) -> None:
        """The worker started (``busy``, keeping the GPU at least until ``quantum_until``) or
        finished using its weights: recorded in its lease for the others' least-recently-used
        choice."""
        with self._lock:
            held = self._held
            if held is None:
                return
            held.record = replace(
                held.record, busy=busy, quantum_until=quantum_until if busy else 0.0, used_at=time.monotonic()
            )
            self._write_lease(held)

    def _write_lease(self, held: _Held) -> None:
        try:
            self.arena._update_lease(held.fd, held.record)
        except OSError as exc:  # informs the others' choice only; the lock is what counts
            log.warning("could not update the lease %s: %s", held.name, exc)

    def others_waiting(self) -> tuple[Ticket, ...]:
        """Live tickets of other requesters (sweeps stale ones)."""
        return tuple(t for t in self.arena.waiters() if t.name not in self._own_tickets)

    def asked_to_yield(self, others: tuple[Ticket, ...] | None = None) -> bool:
        """The head of the queue needs this client's lease to go (it is named by the plan of
        :func:`~.budget.plan_fit`, judged as if this client were unpinned: the caller checks its
        own pin)."""
        held = self._held
        if held is None:
            return False
        if others is None:
            others = self.others_waiting()
        if not others:
            return False
        head = others[0]
        need = self.arena.ticket_need(head)
        # judged as if unpinned: a pinned holder hears the bell too (and ignores it while pinned),
        # so that unpinning yields at the next ring
        leases = [replace(x, pinned=False) if x.name == held.name else x for x in self.arena.leases()]
        plan = plan_fit(need, leases, self.budget, time.monotonic())
        return not plan.fits and plan.possible and any(v.name == held.name for v in plan.victims)

    # -- leases --

    def request(self, timeout: float | None = None, need: int | None = None) -> TokenRequest:
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return self._pending
            req = TokenRequest(self, timeout, need)
            if self._held is not None:
                req._grant = self._held.grant
                req._done.set()
                return req
            self._pending = req
        req._start()
        return req

    def acquire(self, timeout: float | None = None, need: int | None = None) -> TokenGrant:
        """Blocking convenience: request and wait (cancels the request if interrupted)."""
        req = self.request(timeout, need)
        try:
            return req.result()
        except BaseException:
            req.cancel()
            raise

    def _create_lease(self, req: TokenRequest, plan: Plan, leases: list[LeaseRecord]) -> _Held:
        """Under the arena lock: create the lease the plan allows, and the holder record."""
        now = time.monotonic()
        reserved = sum(x.bytes for x in leases if x.kind == "reserve")
        record = LeaseRecord(
            model=self.model,
            pid=os.getpid(),
            bytes=lease_bytes_for(req.need, self.budget, reserved),
            since=time.time(),
            since_monotonic=now,
            pinned=self._pinned,
            used_at=now,
        )
        name, fd = self.arena._create_lease(record)
        grant = TokenGrant(
            model=self.model,
            requested_at=req.requested_at,
            acquired_at=now,
            handoff=req._waited or req._had_ahead or (self.budget.one_model and req._previous is not None),
            previous=req._previous,
            bytes=record.bytes,
            budget=plan.budget,
        )
        self.arena._write_holder(self._holder_record(record, grant))
        return _Held(name=name, fd=fd, record=replace(record, name=name), grant=grant)

    def _give_back(self, held: _Held) -> None:
        """A lease granted to a request cancelled meanwhile: nothing was ever resident under it."""
        lock = self.arena._lock(timeout=HOLDER_LOCK_TIMEOUT_S)
        try:
            self.arena._drop_lease(held.name, held.fd)
            if lock is not None:
                self._rewrite_holder_record(exclude=held.name)
        finally:
            if lock is not None:
                self.arena._unlock(lock)

    def shrink(self, nbytes: int) -> None:
        """Lease ``nbytes`` instead (after a load, once the real weight bytes are known). The lease
        is replaced under the arena lock, so nobody sees both or neither. More than now (never
        expected: a load leases its file's bytes) only when the rest of the budget has room, else
        VramBudgetError."""
        with self._lock:
            held = self._held
            if held is None or nbytes == held.record.bytes:
                return
            lock = self.arena._lock()
            assert lock is not None
            try:
                if nbytes > held.record.bytes and not self.budget.one_model:
                    others = [x for x in self.arena.leases() if x.name != held.name]
                    plan = plan_fit(nbytes, others, self.budget, time.monotonic())
                    if not plan.fits:
                        raise VramBudgetError(
                            f"{self.model}'s weights take {_gb(nbytes)}, more than the "
                            f"{_gb(held.record.bytes)} its load reserved, and the VRAM budget has no "
                            "room for the rest now"
                        )
                # the new size counts from before anyone can see it (nobody is granted meanwhile)
                at = time.monotonic()
                record = replace(held.record, bytes=nbytes, name="")
                name, fd = self.arena._create_lease(record)
                self.arena._drop_lease(held.name, held.fd)
            finally:
                self.arena._unlock(lock)
            if held.load_bytes is None:
                held.load_bytes = held.record.bytes
            held.name, held.fd, held.record, held.shrunk_at = name, fd, replace(record, name=name), at
            held.grant = replace(held.grant, bytes=nbytes)
            try:  # for a holder killed later: its bytes from here on
                self.observer.record("shrunk", at, at, bytes=nbytes, device=self.budget.device)
            except OSError as exc:
                log.warning("could not record the lease's new size: %s", exc)

    def reserve(self, nbytes: int) -> None:
        """Hold a "reserve" lease of ``nbytes`` for as long as this client lives: what the worker
        keeps on the device while released (auto budgets). Replaces an earlier one."""
        with self._lock:
            lock = self.arena._lock()
            assert lock is not None
            try:
                old = self._reserve
                self._reserve = None
                if nbytes > 0:
                    now = time.monotonic()
                    record = LeaseRecord(
                        model=self.model,
                        pid=os.getpid(),
                        bytes=nbytes,
                        kind="reserve",
                        since=time.time(),
                        since_monotonic=now,
                        pinned=True,
                        used_at=now,
                    )
                    name, fd = self.arena._create_lease(record)
                    self._reserve = (name, fd, nbytes)
                if old is not None:
                    self.arena._drop_lease(old[0], old[1])
            finally:
                self.arena._unlock(lock)

    def release(self) -> float | None:
        """End the lease; returns the monotonic time the holding ended (None if not held)."""
        with self._lock:
            held = self._held
            if held is None:
                return None
            self._held = None
            self._doorbell_armed.clear()
            lock = None
            try:
                lock = self.arena._lock(timeout=HOLDER_LOCK_TIMEOUT_S)
                if lock is not None:
                    self._rewrite_holder_record(exclude=held.name)
                end = time.monotonic()
                self._record_interval(held, end)
            finally:  # whatever happened above, the lease goes back
                self.arena._drop_lease(held.name, held.fd)
                if lock is not None:
                    self.arena._unlock(lock)
            return end

    def _record_interval(self, held: _Held, end: float) -> None:
        grant = held.grant
        extra: dict[str, object] = {}
        if held.load_bytes is not None:
            extra = {"load_bytes": held.load_bytes, "shrunk_at": held.shrunk_at}
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
        lock = self.arena._lock(timeout=HOLDER_LOCK_TIMEOUT_S)
        if lock is None:
            return
        try:
            current = self.arena.holder()
            if current is None or (current.pid == os.getpid() and current.model == self.model):
                self.arena._write_holder(self._holder_record(held.record, held.grant))
        finally:
            self.arena._unlock(lock)

    def _rewrite_holder_record(self, exclude: str) -> None:
        """Under the arena lock, as a lease ends: the holder record names the most recent other
        holder, or goes."""
        current = self.arena.holder()
        if current is not None and not (current.pid == os.getpid() and current.model == self.model):
            return  # another process's record: theirs
        others = [x for x in self.arena.leases() if x.kind == "weights" and x.name != exclude]
        if others:
            latest = max(others, key=lambda x: x.since_monotonic)
            self.arena._write_holder(self._holder_record(latest))
        else:
            self.arena._remove_holder()

    def _became_holder(self, held: _Held) -> None:
        grant = held.grant
        with self._lock:
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

    def _request_finished(self, req: TokenRequest) -> None:
        with self._lock:
            if self._pending is req:
                self._pending = None

    # -- doorbell (warden thread) --

    def start_doorbell(self, on_waiter: Callable[[DoorbellRing], None]) -> None:
        if self._doorbell is not None:
            return
        self._doorbell_watch = self.arena._watch()
        self._doorbell_stop.clear()
        with self._lock:  # close() leaves it set; armed again only while holding
            if self._held is None:
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

    def _doorbell_loop(self, on_waiter: Callable[[DoorbellRing], None], watch: _DirWatch) -> None:
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
            try:
                others = self.others_waiting()
                asked = self.asked_to_yield(others)
            except OSError as exc:
                log.warning("scanning %s failed: %s", self.arena.waiters_path, exc)
                others, asked = (), False
            names = {t.name for t in others}
            generation = self._ring_generation
            now = time.monotonic()
            due = bool(names - rung) or generation != rung_generation or now - last_ring >= RING_REPEAT_S
            if asked and self.holds_token and due:
                rung |= names
                rung_generation = generation
                last_ring = now
                log.debug("doorbell: %s wait(s) for the GPU (%s)", len(others), others[0].model)
                try:
                    on_waiter(DoorbellRing(waiters=others, at=now))
                except Exception:
                    log.exception("the doorbell callback failed")
            rung &= names  # forget waiters that left, so a returning name rings again
            watch.wait(RING_REPEAT_S if others and self.holds_token else RESCAN_INTERVAL_S)
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
                self.arena._drop_lease(self._reserve[0], self._reserve[1])
                self._reserve = None
            if self._budget_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._budget_fd)
                self._budget_fd = -1
