"""Watching the config file: a file edited by hand is applied as ``timeshare reload`` applies it.

Editors and Timeshare itself save by writing a temporary file and renaming it over the old one, so
the watch is on the file's *directory* (inotify_simple; a poll of the file's stat every
:data:`POLL_S` where inotify is missing) and every event is only a cue to look: the file's text is
read and compared with the last text seen. Text this process wrote itself (``save_config``, see
:func:`files.written_by_us`) is not applied again: whoever saved it applied it already.

The watcher owns nothing but its thread; ``apply`` (the owner's reload: ``reload_config`` in
``timeshare serve``, the app's API reloader in the tray) is called on the watcher's thread and
must hand the new config to its owner itself. A file that does not parse or validate is
``on_invalid(error)``: one log line (and, in the tray, a notice); the running config stays.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import files

log = logging.getLogger(__name__)

POLL_S = 2.0
#: an editor's save is several events (write, rename, chmod): wait this long for the last one
SETTLE_S = 0.25


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class ConfigWatcher:
    """Calls ``apply()`` when ``path``'s text changes (not by this process), ``on_invalid(exc)``
    when ``apply`` raises ConfigError. :meth:`start`, :meth:`stop`."""

    def __init__(
        self,
        path: Path,
        apply: Callable[[], object],
        on_invalid: Callable[[ConfigError], None] | None = None,
    ) -> None:
        self.path = Path(path).expanduser().absolute()
        self.apply = apply
        self.on_invalid = on_invalid
        self._seen = _digest(self.path)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="timeshare-config-watch", daemon=True)
        self._inotify: Any = None

    def start(self) -> ConfigWatcher:
        try:
            import inotify_simple

            self.path.parent.mkdir(parents=True, exist_ok=True)
            flags = inotify_simple.flags
            self._inotify = inotify_simple.INotify()
            self._inotify.add_watch(
                str(self.path.parent),
                flags.CLOSE_WRITE | flags.MOVED_TO | flags.CREATE | flags.DELETE | flags.MOVED_FROM,
            )
        except (ImportError, OSError) as exc:
            log.info("watching %s by polling (no inotify: %s)", self.path, exc)
            self._inotify = None
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(5)
        if self._inotify is not None:
            self._inotify.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wait(self, timeout: float) -> bool:
        """True when an event about our file (or any, when polling) may have come."""
        fds = [self._wake_r] + ([self._inotify.fileno()] if self._inotify is not None else [])
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._inotify is None or self._inotify.fileno() not in ready:
            return self._inotify is None
        events = self._inotify.read(timeout=0)
        return any(e.name == self.path.name for e in events)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wait(POLL_S):
                continue
            if self._inotify is not None:  # let the save finish (and drain what it still sends)
                self._stop.wait(SETTLE_S)
                with contextlib.suppress(OSError, ValueError):
                    self._inotify.read(timeout=0)
            if self._stop.is_set():
                return
            self.check()

    def check(self) -> bool:
        """Apply the file if its text changed since last seen and this process did not write it.
        Returns whether ``apply`` was called."""
        digest = _digest(self.path)
        if digest is None or digest == self._seen:
            return False
        self._seen = digest
        if files.written_by_us(self.path, digest):
            log.debug("config %s changed by Timeshare itself: not applied again", self.path)
            return False
        log.info("config %s changed on disk: applying it", self.path)
        try:
            self.apply()
        except ConfigError as exc:
            log.warning("config %s changed but is not valid, the running config stays: %s", self.path, exc)
            if self.on_invalid is not None:
                self.on_invalid(exc)
        return True
