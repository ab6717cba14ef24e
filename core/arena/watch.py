"""Watching ``waiters/``: inotify where it exists, polling elsewhere."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from pathlib import Path
from typing import Any, Literal

from .records import POLL_INTERVAL_S

log = logging.getLogger(__name__)


# ---- watching a directory --------------------------------------------------------------------


def inotify_available() -> bool:
    try:
        import inotify_simple

        inotify_simple.INotify().close()
    except (ImportError, OSError):
        return False
    return True


class DirWatch:
    """Wait until a directory may have changed, a timeout passes or someone calls :meth:`wake`.

    Callers rescan after every return: events only say *when* to look, never *what* is there (so a
    queue overflow or a coalesced event cannot lose anything)."""

    def __init__(self, path: Path, backend: Literal["inotify", "poll"], also: tuple[Path, ...] = ()) -> None:
        self.backend = backend
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._inotify: Any = None
        self._closed = False
        self._lock = threading.Lock()
        if backend == "inotify":
            import inotify_simple

            f = inotify_simple.flags
            self._inotify = inotify_simple.INotify()
            mask = f.CREATE | f.MOVED_TO | f.DELETE | f.MOVED_FROM | f.DELETE_SELF | f.ONLYDIR | f.DONT_FOLLOW
            try:
                for watched in (path, *also):
                    self._inotify.add_watch(str(watched), mask)
            except OSError:
                self.close()
                raise

    def wait(self, timeout: float) -> None:
        fds = [self._wake_r]
        if self._inotify is not None:
            fds.append(self._inotify.fileno())
            period = max(0.0, timeout)
        else:
            period = max(0.0, min(timeout, POLL_INTERVAL_S))
        try:
            ready, _, _ = select.select(fds, [], [], period)
        except InterruptedError:  # pragma: no cover (PEP 475 retries)
            return
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        if self._inotify is not None and self._inotify.fileno() in ready:
            # Drain; IN_Q_OVERFLOW needs nothing more than the rescan every caller does anyway.
            for event in self._inotify.read(timeout=0):
                if event.mask & 0x4000:  # IN_Q_OVERFLOW
                    log.debug("inotify queue overflow; rescanning")

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self._inotify is not None:
                self._inotify.close()
