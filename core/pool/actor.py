"""The pool's actor machinery, a component the :class:`~.supervisor.Pool` owns: one thread runs the
calls posted to its inbox and the timers due, in order; another hands events to subscribers (so a
slow subscriber never stalls the pool thread). Nothing here knows what a worker is."""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import ModelUnavailableError
from ..state import PoolEvent

log = logging.getLogger(__name__)

T = TypeVar("T")
_Item = tuple[Callable[..., object], tuple[object, ...]]


class Timers:
    """A heap of (due, seq, callback) run by the actor's thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def add(self, delay: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay), next(self._seq), callback))

    def next_delay(self) -> float | None:
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - time.monotonic())

    def pop_due(self) -> list[Callable[[], None]]:
        now = time.monotonic()
        due = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def clear(self) -> None:
        self._heap.clear()


class Actor:
    """One thread owns the state; others post calls to it (``post``) or wait for their answer
    (``call``). ``running`` and ``closing`` (under ``lock``) say whether calls are taken.

    ``on_ended`` runs on the actor's thread once its loop has ended (after what was in the inbox).
    """

    def __init__(self, name: str, on_ended: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self._on_ended = on_ended
        self._inbox: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # None: quit
        self._timers = Timers()
        self.thread: threading.Thread | None = None
        self._event_thread: threading.Thread | None = None
        self._events: queue.SimpleQueue[PoolEvent | None] = queue.SimpleQueue()
        self._subscribers: list[Callable[[PoolEvent], None]] = []
        self._sub_lock = threading.Lock()
        self.running = False
        self.closing = False
        self.lock = threading.Lock()

    # ---- events ------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[PoolEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` from the event thread for every event; returns the function
        that unsubscribes. Keep callbacks short (post to your own thread/queue)."""
        with self._sub_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._sub_lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, event: PoolEvent) -> None:
        """Queue an event for the subscribers (the event thread calls them)."""
        self._events.put(event)

    # ---- the threads -------------------------------------------------------------------

    def start(self) -> None:
        """Start the event thread and the actor's thread (the caller holds ``lock``; once)."""
        self.running = True
        self._event_thread = threading.Thread(
            target=self._event_loop, name=f"{self.name}-events", daemon=True
        )
        self._event_thread.start()
        self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self.thread.start()

    def join(self) -> None:
        """End the actor's thread (after what is in its inbox), then the event thread (after the
        events queued so far)."""
        self._inbox.put(None)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10.0)
        with self.lock:
            self.running = False
        self._events.put(None)
        if self._event_thread is not None and self._event_thread is not threading.current_thread():
            self._event_thread.join(timeout=10.0)

    def on_thread(self) -> bool:
        return threading.current_thread() is self.thread

    # ---- calls and timers ----------------------------------------------------------------

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the actor's thread, soon; from any thread."""
        self._inbox.put((fn, args))

    def call(self, fn: Callable[..., T], *args: object, closing_ok: bool = False) -> T:
        """Run ``fn(*args)`` on the actor's thread and return its result (or raise its error)."""
        if self.on_thread():
            return fn(*args)
        with self.lock:
            if not self.running or (self.closing and not closing_ok):
                raise ModelUnavailableError("the pool is not running; start Timeshare first")
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()

            def run() -> None:
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)

            self._inbox.put((run, ()))
        return fut.result()

    def later(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the actor's thread after ``delay`` seconds (actor's thread only)."""
        self._timers.add(delay, callback)

    def clear_timers(self) -> None:
        self._timers.clear()

    def _loop(self) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=self._timers.next_delay())
            except queue.Empty:
                for callback in self._timers.pop_due():
                    self._guard(callback)
                continue
            for callback in self._timers.pop_due():
                self._guard(callback)
            if item is None:
                break
            fn, args = item
            self._guard(fn, *args)
        self._on_ended()

    def _guard(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s: %s failed", self.name, getattr(fn, "__name__", fn))

    def _event_loop(self) -> None:
        while True:
            event = self._events.get()
            if event is None:
                return
            with self._sub_lock:
                subscribers = list(self._subscribers)
            for cb in subscribers:
                try:
                    cb(event)
                except Exception:
                    log.exception("%s event subscriber %r failed", self.name, cb)
