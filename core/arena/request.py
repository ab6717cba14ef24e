"""A request for a lease, served on a helper thread: the ticket queue, then the fit (see :mod:`.client`)."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import ArenaError, CancelledError, TokenTimeoutError, VramBudgetError
from ..util.units import decimal_bytes
from .arena import Arena
from .budget import BudgetRecord, LeaseRecord, Plan, plan_fit
from .records import RESCAN_INTERVAL_S, SWEEP_INTERVAL_S, Ticket, TokenGrant
from .watch import DirWatch

log = logging.getLogger(__name__)


class LeaseOwner(Protocol):
    """Whom a :class:`TokenRequest` is served for: the one that will hold the lease it gets
    (:class:`~.client.TokenClient`). The request's helper thread calls these, in this order:

    - :meth:`ticket_taken` once its ticket is in the queue, :meth:`ticket_gone` once it left it
      (the owner's doorbell does not ring for its own tickets);
    - as the head of the queue, under the arena lock, when the plan fits: :meth:`create_lease`,
      which creates the lease file (and the holder record) and returns what is then held;
    - then either :meth:`became_holder` (granted) or, when the request was cancelled meanwhile,
      :meth:`give_back` (nothing was ever resident under that lease);
    - last, whatever happened, :meth:`request_finished` (before the request reads as done).

    None of them may block for long: they run on the request's thread, the first under the lock."""

    arena: Arena
    model: str
    budget: BudgetRecord

    def ticket_taken(self, ticket: Ticket) -> None: ...

    def ticket_gone(self, ticket: Ticket) -> None: ...

    def create_lease(self, req: TokenRequest, plan: Plan, leases: list[LeaseRecord]) -> Held: ...

    def give_back(self, held: Held) -> None: ...

    def became_holder(self, held: Held) -> None: ...

    def request_finished(self, req: TokenRequest) -> None: ...


@dataclass
class Held:
    """The lease this client holds."""

    name: str
    fd: int
    record: LeaseRecord
    grant: TokenGrant
    #: the lease's sizes over time, ``(monotonic, bytes)`` from its grant, when it changed: it shrank
    #: after a load or a partial release, or grew back (empty: it kept its first size)
    sizes: list[tuple[float, int]] = field(default_factory=list)


class _Locker:
    """Blocks in ``flock`` on another holder's lease file on its own thread: it returns when that
    lease ends (released, or its holder killed: the kernel drops the lock), then lets go at once
    (this process never holds another's lease) and wakes the waiter. A blocked flock cannot be
    interrupted: a waiter that gives up simply stops looking at it."""

    def __init__(self, arena: Arena, name: str, wake: Callable[[], None]) -> None:
        self.name = name
        self.done = threading.Event()
        fd = arena.lease_files.open_for_wait(name)
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

    def __init__(self, client: LeaseOwner, timeout: float | None, need: int | None = None) -> None:
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
        self._watch: DirWatch | None = None
        self._ticket: Ticket | None = None
        self._ahead = 0
        self._had_ahead = False
        self._waited = False
        self._plan: Plan | None = None
        self._previous: str | None = None
        self._thread: threading.Thread | None = None
        self._next_sweep = self.requested_at + SWEEP_INTERVAL_S
        self._said = ""  # what the log last said this request waits for (each reason once)

    @classmethod
    def granted(cls, client: LeaseOwner, grant: TokenGrant) -> TokenRequest:
        """A request that is done already: the lease ``client`` holds (``grant``)."""
        req = cls(client, None)
        req._grant = grant
        req._done.set()
        return req

    # -- public --

    @property
    def ticket(self) -> Ticket | None:
        return self._ticket

    @property
    def previous(self) -> str | None:
        """The model that held the token when this request was made (None: nobody)."""
        return self._previous

    @property
    def waited(self) -> bool:
        """Whether anyone was ahead in the queue, or it had to wait for holders to leave."""
        return self._waited or self._had_ahead

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        """:meth:`cancel` gave its place up (before any grant): it ends without the lease."""
        with self._lock:
            return self._cancelled

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

    def start(self) -> None:
        """Serve it on its helper thread (once; the client does)."""
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
            watch = arena.watch()  # before the first scan: nothing that appears later is missed
            with self._lock:
                self._watch = watch
                cancelled = self._cancelled
            if cancelled:
                raise CancelledError("the request for the GPU was cancelled")
            self._ticket, ticket_fd = arena.queue.take(self._client.model, self.need)
            self._client.ticket_taken(self._ticket)
            while True:  # wait until no live ticket is ahead of ours
                self._check()
                ahead = [t for t in arena.waiters() if t.seq < self._ticket.seq]
                self._ahead = len(ahead)
                self._had_ahead = self._had_ahead or bool(ahead)
                if not ahead:
                    break
                self._say("queued behind " + ", ".join(f"{t.model} (pid {t.pid})" for t in ahead))
                self._sweep_now_and_then()
                watch.wait(min(RESCAN_INTERVAL_S, self._remaining()))
            held = self._fit(watch)
            with self._lock:  # atomic against cancel(): granted, or cancelled and given back
                cancelled = self._cancelled
                if not cancelled:
                    self._grant = held.grant
            if cancelled:
                self._client.give_back(held)
                raise CancelledError("the request for the GPU was cancelled")
            self._client.became_holder(held)
            arena.queue.drop(self._ticket, ticket_fd)  # lets the next waiter in
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
                arena.queue.drop(self._ticket, ticket_fd)
            if self._ticket is not None:
                self._client.ticket_gone(self._ticket)
            self._client.request_finished(self)  # before done: a new request() must not get this one
            with self._lock:
                self._done.set()
                watch_to_close, self._watch = self._watch, None
            if watch_to_close is not None:
                watch_to_close.close()

    def _say(self, why: str) -> None:
        """Log once per reason what this request waits for (the ms since it was made): a wait the
        doorbell does not end shows in the worker's log with its cause."""
        if why != self._said:
            self._said = why
            log.info(
                "%s waits for the GPU: %s (%.0f ms after its request)",
                self._client.model,
                why,
                (time.monotonic() - self.requested_at) * 1000.0,
            )

    def _fit(self, watch: DirWatch) -> Held:
        """As the head of the queue: take a lease as soon as this request fits (see the module
        docstring); raise VramBudgetError when it never can."""
        client = self._client
        arena = client.arena
        locker: _Locker | None = None
        while True:
            self._check()
            lock = arena.dir.lock(self._check)
            assert lock is not None
            try:
                now = time.monotonic()
                leases = arena.leases()
                # the bytes this process holds for this model count as its own (a partly
                # released holder asking for the rest); they are never its victims
                plan = plan_fit(self.need, leases, client.budget, now, requester=(os.getpid(), client.model))
                if plan.fits:
                    return client.create_lease(self, plan, leases)
            finally:
                arena.dir.unlock(lock)
            self._plan = plan
            self._waited = True
            self._say(
                _blockers(plan, self.need, client.budget)
                or f"no named holder (leases: {', '.join(f'{x.model}/{x.kind}/pid {x.pid}' for x in leases)})"
            )
            # a request for the device to itself (a load under an auto budget) waits for pinned
            # holders as under a one-model budget; one for its bytes fails at once
            fails = plan.too_large or (not client.budget.one_model and self.need is not None)
            if not plan.possible and fails:
                raise VramBudgetError(_too_large(client.model, self.need, plan, client.budget))
            target = plan.victims[0] if plan.victims else (plan.pinned[0] if plan.pinned else None)
            if target is None and plan.deepen:  # a parked worker's reserve: replaced once it went deep
                target = plan.deepen[0]
            if target is not None and (locker is None or locker.name != target.name or locker.done.is_set()):
                locker = _Locker(arena, target.name, watch.wake)
            if locker is None or not locker.done.is_set():
                self._sweep_now_and_then()
                watch.wait(min(RESCAN_INTERVAL_S, self._remaining()))


def gb_text(n: int | None) -> str:
    return "?" if n is None else decimal_bytes(n)


def _blockers(plan: Plan, need: int | None, budget: BudgetRecord) -> str:
    """Who a head waiter waits for: "held by X", "pinned by Y", "held by X, Y (needs 2.1 GB of
    the 20.0 GB budget)"."""
    parts = []
    if plan.victims:
        parts.append("held by " + ", ".join(x.model for x in plan.victims))
    if plan.pinned and not plan.victims:
        parts.append("pinned by " + ", ".join(x.model for x in plan.pinned))
    if plan.deepen:
        parts.append("the KV cache of " + ", ".join(x.model for x in plan.deepen))
    text = " and ".join(parts)
    if plan.budget is not None and need is not None and text:
        text += (
            f" (needs {gb_text(need)}; {gb_text(plan.leased)} of the {gb_text(plan.budget)} budget leased)"
        )
    return text


def _too_large(model: str, need: int | None, plan: Plan, budget: BudgetRecord) -> str:
    where = budget.device_name or f"device {budget.device}"
    setting = f"arena.vram_budget = {budget.setting!r}"
    if plan.too_large:
        return (
            f"{model} needs {gb_text(need)} of VRAM for its weights, more than the whole budget of "
            f"{gb_text(plan.budget)} on {where} ({setting}): raise the budget, or use a smaller "
            f"quantisation or fewer GPU layers"
        )
    pinned = ", ".join(f"{x.model} ({gb_text(x.bytes)})" for x in plan.pinned)
    return (
        f"{model} needs {gb_text(need)} of VRAM for its weights and cannot fit in the budget of "
        f"{gb_text(plan.budget)} on {where} ({setting}) even after every unpinned model left: pinned "
        f"{pinned} {'holds' if len(plan.pinned) == 1 else 'hold'} the rest; unpin "
        f"{'it' if len(plan.pinned) == 1 else 'one of them'} or raise the budget"
    )
