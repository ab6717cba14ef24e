"""The pool thread's machinery: an inbox of calls, timers run on the same thread, and an event
thread that hands events to subscribers. :class:`~.supervisor.Pool` builds on it."""

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
    """A heap of (due, seq, callback) run by the pool thread."""

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


class PoolThread:
    """One thread owns the state; others post calls to it (``_post``) or wait for their answer
    (``_call``). ``_running``/``_closing`` (under ``_run_lock``) say whether calls are taken."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # None: quit
        self._timers = Timers()
        self._thread: threading.Thread | None = None
        self._event_thread: threading.Thread | None = None
        self._events: queue.SimpleQueue[PoolEvent | None] = queue.SimpleQueue()
        self._subscribers: list[Callable[[PoolEvent], None]] = []
        self._sub_lock = threading.Lock()
        self._running = False
        self._closing = False
        self._run_lock = threading.Lock()

    def subscribe(self, callback: Callable[[PoolEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` from the pool's event thread for every event; returns the
        function that unsubscribes. Keep callbacks short (post to your own thread/queue)."""
        with self._sub_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._sub_lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    # ---- the threads ---------------------------------------------------------------------

    def _start_threads(self) -> None:
        """Start the event thread and the pool thread (under ``_run_lock``, once)."""
        self._running = True
        self._event_thread = threading.Thread(target=self._event_loop, name="pool-events", daemon=True)
        self._event_thread.start()
        self._thread = threading.Thread(target=self._loop, name="pool", daemon=True)
        self._thread.start()

    def _join_threads(self) -> None:
        """End the pool thread (after what is in its inbox), then the event thread (after the
        events queued so far)."""
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        with self._run_lock:
            self._running = False
        self._events.put(None)
        if self._event_thread is not None and self._event_thread is not threading.current_thread():
            self._event_thread.join(timeout=10.0)

    def _post(self, fn: Callable[..., object], *args: object) -> None:
        self._inbox.put((fn, args))

    def _call(self, fn: Callable[..., T], *args: object, closing_ok: bool = False) -> T:
        """Run ``fn(*args)`` on the pool thread and return its result (or raise its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        with self._run_lock:
            if not self._running or (self._closing and not closing_ok):
                raise ModelUnavailableError("the pool is not running; start Timeshare first")
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()

            def run() -> None:
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)

            self._inbox.put((run, ()))
        return fut.result()

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
        self._loop_ended()

    def _loop_ended(self) -> None:
        """Called on the pool thread once its loop has ended."""

    def _guard(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("pool: %s failed", getattr(fn, "__name__", fn))

    def _emit(self, event: PoolEvent) -> None:
        """Queue an event for the subscribers (the event thread calls them)."""
        self._events.put(event)

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
                    log.exception("pool event subscriber %r failed", cb)
