"""A worker's side of the arena: waiting for the token on a helper thread, the doorbell, release."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ArenaError, CancelledError, TokenTimeoutError
from ..observe import NULL_OBSERVER, Observer
from .records import (
    _MODEL_ID_RE,
    RESCAN_INTERVAL_S,
    RING_REPEAT_S,
    SWEEP_INTERVAL_S,
    TOKEN_FILE,
    DoorbellRing,
    HolderRecord,
    Ticket,
    TokenGrant,
)
from .tickets import Arena
from .watch import _DirWatch

log = logging.getLogger(__name__)


# ---- a worker's side -------------------------------------------------------------------------


@dataclass
class _LockerState:
    acquired: bool = False
    abandoned: bool = False
    error: OSError | None = None


class TokenRequest:
    """A pending request for the token, served on a helper thread. Thread-safe.

    ``wait(timeout)`` → True once finished; ``result()`` → :class:`TokenGrant` or raises
    :class:`TokenTimeoutError` (message names the holder), :class:`CancelledError` or
    :class:`ArenaError`. ``cancel()`` gives the place in the queue up; a request that already got
    the token stays granted (release it through the client)."""

    def __init__(self, client: TokenClient, timeout: float | None) -> None:
        self._client = client
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
        """Give up the place in the queue. False when the token was already granted (then the
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
        holder = self._client.arena.holder()
        parts = []
        if holder is not None and holder.pid != os.getpid():
            parts.append(holder.describe())
        if self._ahead:
            parts.append(f"{self._ahead} ahead in the queue")
        return "; ".join(parts) or "waiting for the GPU"

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
        holder = self._client.arena.holder()
        waited = f"waited {self._timeout:.1f} s for the GPU"
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
            self._ticket, ticket_fd = arena._take_ticket(self._client.model)
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
            handoff = self._previous is not None
            fd = arena._open_token()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handoff = True
                fd = self._lock_blocking(fd, watch)
            except BaseException:
                os.close(fd)
                raise
            grant = TokenGrant(
                model=self._client.model,
                requested_at=self.requested_at,
                acquired_at=time.monotonic(),
                handoff=handoff or self._had_ahead,
                previous=self._previous,
            )
            with self._lock:  # atomic against cancel(): granted, or cancelled and given back
                cancelled = self._cancelled
                if not cancelled:
                    self._grant = grant
            if cancelled:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise CancelledError("the request for the GPU was cancelled")
            self._client._became_holder(fd, grant)
            arena._drop_ticket(self._ticket, ticket_fd)  # lets the next waiter call flock
            ticket_fd = None
        except BaseException as exc:  # delivered through result()
            if isinstance(exc, OSError):
                exc = ArenaError(
                    f"the arena {arena.path} became unusable while waiting for the GPU ({exc}); "
                    f"restart Timeshare, or point TIMESHARE_VRAM_ARENA or arena.dir elsewhere"
                )
            self._error = exc
            if not isinstance(exc, (CancelledError, TokenTimeoutError)):
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

    def _lock_blocking(self, fd: int, watch: _DirWatch) -> int:
        """Block in flock on a locker thread; this thread keeps honouring cancel and the deadline.

        A blocked flock cannot be interrupted. If we give up, the locker is abandoned: when it
        gets the lock it drops it at once (nothing is ever resident under it)."""
        state = _LockerState()
        lock = threading.Lock()

        def locker() -> None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                with lock:
                    state.error = exc
                watch.wake()
                return
            with lock:
                if state.abandoned:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    return
                state.acquired = True
            watch.wake()

        threading.Thread(target=locker, name="arena-flock", daemon=True).start()
        while True:
            with lock:
                if state.acquired:
                    return fd
                if state.error is not None:
                    os.close(fd)
                    raise ArenaError(f"locking {self._client.arena.path / TOKEN_FILE} failed: {state.error}")
            try:
                self._check()
            except BaseException:
                with lock:
                    if state.acquired:  # got it in the meantime: give it back
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        os.close(fd)
                    else:
                        state.abandoned = True
                raise
            self._sweep_now_and_then()
            watch.wait(min(RESCAN_INTERVAL_S, self._remaining()))


class TokenClient:
    """One worker's handle on the token.

    ``request(timeout)`` → :class:`TokenRequest` (immediately granted if this client holds the
    token; the same pending request if one is pending). ``release()`` drops it (call it only after
    the weights are off the device). ``start_doorbell(on_waiter)`` starts the warden thread that
    calls ``on_waiter(DoorbellRing)`` when another process waits while this client holds the
    token: at once for a new waiter, after each new acquisition and after :meth:`poke_doorbell`,
    and again every ``RING_REPEAT_S`` for as long as anyone waits (level-triggered: a dropped
    ring, e.g. one that came while pinned or while restoring, is heard again).
    """

    def __init__(
        self,
        arena: Arena,
        model: str,
        *,
        observer: Observer = NULL_OBSERVER,
        pinned: bool = False,
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
        self._token_fd: int | None = None
        self._grant: TokenGrant | None = None
        self._pending: TokenRequest | None = None
        self._own_tickets: set[str] = set()
        self._ring_generation = 0
        self._doorbell: threading.Thread | None = None
        self._doorbell_watch: _DirWatch | None = None
        self._doorbell_stop = threading.Event()
        # Set while the doorbell has a reason to scan: this client holds the token (only a holder
        # rings), or close() stops the doorbell. While clear the warden sleeps on it, not scanning.
        self._doorbell_armed = threading.Event()

    # -- state --

    @property
    def holds_token(self) -> bool:
        return self._token_fd is not None

    def set_pinned(self, pinned: bool) -> None:
        """Record pinned-ness (shown to waiters in the holder record); unpinning re-rings."""
        with self._lock:
            self._pinned = pinned
            if self._token_fd is not None and self._grant is not None:
                self.arena._write_holder(self._holder_record(self._grant))
        self.poke_doorbell()

    def others_waiting(self) -> tuple[Ticket, ...]:
        """Live tickets of other requesters (sweeps stale ones)."""
        return tuple(t for t in self.arena.waiters() if t.name not in self._own_tickets)

    # -- token --

    def request(self, timeout: float | None = None) -> TokenRequest:
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return self._pending
            req = TokenRequest(self, timeout)
            if self._token_fd is not None and self._grant is not None:
                req._grant = self._grant
                req._done.set()
                return req
            self._pending = req
        req._start()
        return req

    def acquire(self, timeout: float | None = None) -> TokenGrant:
        """Blocking convenience: request and wait (cancels the request if interrupted)."""
        req = self.request(timeout)
        try:
            return req.result()
        except BaseException:
            req.cancel()
            raise

    def release(self) -> float | None:
        """Give the token back; returns the monotonic time the holding ended (None if not held)."""
        with self._lock:
            fd = self._token_fd
            if fd is None:
                return None
            grant = self._grant
            self._token_fd = None
            self._grant = None
            self._doorbell_armed.clear()
            try:
                self.arena._remove_holder()
                end = time.monotonic()
                if grant is not None:
                    try:
                        self.observer.record(
                            "token",
                            grant.acquired_at,
                            end,
                            requested=grant.requested_at,
                            handoff=grant.handoff,
                            previous=grant.previous,
                        )
                    except OSError as exc:
                        log.warning("could not record the token interval: %s", exc)
            finally:  # whatever happened above, the token goes back
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return end

    def _holder_record(self, grant: TokenGrant) -> HolderRecord:
        return HolderRecord(
            model=self.model,
            pid=os.getpid(),
            since=time.time() - (time.monotonic() - grant.acquired_at),
            since_monotonic=grant.acquired_at,
            pinned=self._pinned,
        )

    def _became_holder(self, fd: int, grant: TokenGrant) -> None:
        with self._lock:
            self._token_fd = fd
            self._grant = grant
            self._ring_generation += 1
            self._doorbell_armed.set()
            try:  # the start of the interval, in case this process dies before it releases
                self.observer.record(
                    "acquired", grant.acquired_at, grant.acquired_at, requested=grant.requested_at
                )
            except OSError as exc:
                log.warning("could not record the token acquisition: %s", exc)
            try:
                self.arena._write_holder(self._holder_record(grant))
            except OSError as exc:  # the record only informs; holding the lock is what counts
                log.warning("could not write the holder record in %s: %s", self.arena.path, exc)
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
            if self._token_fd is None:
                self._doorbell_armed.clear()
        self._doorbell = threading.Thread(
            target=self._doorbell_loop,
            args=(on_waiter, self._doorbell_watch),
            name="arena-doorbell",
            daemon=True,
        )
        self._doorbell.start()

    def poke_doorbell(self) -> None:
        """Make the warden rescan now and ring again if anyone waits."""
        with self._lock:
            self._ring_generation += 1
        if self._doorbell_watch is not None:
            self._doorbell_watch.wake()

    def _doorbell_loop(self, on_waiter: Callable[[DoorbellRing], None], watch: _DirWatch) -> None:
        # Level-triggered: while this client holds the token and anyone waits, the bell rings again
        # every RING_REPEAT_S. A ring that the worker drops (it arrived while the worker was
        # restoring, or while it was pinned) must not leave a waiter waiting forever.
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
            except OSError as exc:
                log.warning("scanning %s failed: %s", self.arena.waiters_path, exc)
                others = ()
            names = {t.name for t in others}
            generation = self._ring_generation
            now = time.monotonic()
            due = bool(names - rung) or generation != rung_generation or now - last_ring >= RING_REPEAT_S
            if others and self.holds_token and due:
                rung |= names
                rung_generation = generation
                last_ring = now
                log.debug("doorbell: %s wait(s) for the token (%s)", len(others), others[0].model)
                try:
                    on_waiter(DoorbellRing(waiters=others, at=now))
                except Exception:
                    log.exception("the doorbell callback failed")
            rung &= names  # forget waiters that left, so a returning name rings again
            watch.wait(RING_REPEAT_S if others and self.holds_token else RESCAN_INTERVAL_S)
        watch.close()

    def close(self) -> None:
        """Stop the doorbell, cancel a pending request, release the token."""
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
