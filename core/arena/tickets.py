"""The ticket queue and the token file: :class:`Arena`, one per arena directory and process."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from ..errors import ArenaError, UnsafeArenaError
from .dirs import _check_ancestors, _open_checked_dir, _read_holder_at, pid_alive, resolve_arena_dir
from .records import (
    _O_DIR,
    _O_FILE,
    HOLDER_FILE,
    SEQ_FILE,
    TOKEN_FILE,
    WAITERS_DIR,
    Backend,
    HolderRecord,
    Ticket,
)
from .watch import _DirWatch, inotify_available

log = logging.getLogger(__name__)


# ---- the arena -------------------------------------------------------------------------------


class Arena:
    """An arena directory, validated and opened. Cheap; one per process is plenty.

    ``backend``: "inotify", "poll", or "auto" (inotify where it exists, else polling)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, backend: Backend = "auto") -> None:
        self.path = Path(os.path.abspath(path)) if path is not None else resolve_arena_dir()
        self.waiters_path = self.path / WAITERS_DIR
        if backend == "auto":
            backend = "inotify" if inotify_available() else "poll"
        elif backend == "inotify" and not inotify_available():
            raise ArenaError("inotify is not available here: use the polling backend")
        self.backend: Literal["inotify", "poll"] = backend
        _check_ancestors(self.path)
        if not self.path.parent.exists():
            try:
                self.path.parent.mkdir(parents=True, mode=0o700)
            except OSError as exc:
                raise UnsafeArenaError(self.path, f"its parent cannot be created ({exc.strerror})") from exc
        self._dir_fd = _open_checked_dir(self.path, create=True)
        try:
            self._waiters_fd = _open_checked_dir(
                self.waiters_path, create=True, dir_fd=self._dir_fd, name=WAITERS_DIR
            )
        except BaseException:
            os.close(self._dir_fd)
            raise

    def __repr__(self) -> str:
        return f"Arena({str(self.path)!r}, backend={self.backend!r})"

    def close(self) -> None:
        for fd in (self._waiters_fd, self._dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- reading --

    def holder(self) -> HolderRecord | None:
        return _read_holder_at(self._dir_fd)

    def waiters(self, *, sweep: bool = True) -> list[Ticket]:
        """Live tickets in queue order; stale ones (owner dead) are removed when ``sweep``."""
        live = []
        for name in self._listdir(self._waiters_fd):
            ticket = Ticket.parse(name)
            if ticket is None:
                continue
            if sweep and self._sweep_if_stale(self._waiters_fd, name):
                continue
            live.append(ticket)
        return sorted(live)

    def sweep(self) -> list[str]:
        """Remove tickets and temporary files of dead processes; return their names."""
        removed = []
        for name in self._listdir(self._waiters_fd):
            if self._sweep_if_stale(self._waiters_fd, name):
                removed.append(name)
        for name in self._listdir(self._dir_fd):
            if not (name.startswith(".") and name.endswith(".tmp")):
                continue
            if name.startswith(".holder."):  # .holder.<pid>.<thread>.tmp, not locked: check the pid
                pid = name.split(".")[2]
                if pid.isdigit() and not pid_alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=self._dir_fd)
                    removed.append(name)
            else:  # a ticket being made: locked right after its creation, so also check the pid
                ticket = Ticket.parse(name[1:-4])
                if ticket and not pid_alive(ticket.pid) and self._sweep_if_stale(self._dir_fd, name):
                    removed.append(name)
        return removed

    @staticmethod
    def _listdir(dir_fd: int) -> list[str]:
        # A fresh open file description per listing: os.listdir(fd) reads through a dup of the
        # fd, which shares the directory offset, so two threads listing through one fd at the
        # same time see entries twice or miss them.
        fd = os.open(".", _O_DIR, dir_fd=dir_fd)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def _sweep_if_stale(self, dir_fd: int, name: str) -> bool:
        """True when ``name`` is gone or was stale (and is now removed)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _O_FILE, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its owner is alive and holds it
            # Nobody holds it: its owner died (a live owner keeps the lock from before the file
            # got its public name until after it is unlinked).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
            log.info("swept stale arena entry %s", name)
            return True
        finally:
            os.close(fd)

    # -- tickets --

    def _take_ticket(self, model: str) -> tuple[Ticket, int]:
        """Create this process's ticket; return it and the fd that keeps it locked (alive)."""
        seq_fd = os.open(SEQ_FILE, os.O_RDWR | os.O_CREAT | _O_FILE, 0o600, dir_fd=self._dir_fd)
        try:
            fcntl.flock(seq_fd, fcntl.LOCK_EX)
            raw = os.pread(seq_fd, 64, 0)
            try:
                last = int(raw.strip() or b"0")
            except ValueError:
                log.warning("the arena's ticket counter was unreadable (%r); continuing after the queue", raw)
                last = max((t.seq for t in self.waiters(sweep=False)), default=0)
            ticket = Ticket(last + 1, os.getpid(), model)
            os.pwrite(seq_fd, f"{ticket.seq}\n".encode(), 0)
            os.ftruncate(seq_fd, len(f"{ticket.seq}\n"))
            tmp = f".{ticket.name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_FILE, 0o600, dir_fd=self._dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                body = {
                    "model": model,
                    "pid": ticket.pid,
                    "at": time.time(),
                    "at_monotonic": time.monotonic(),
                }
                os.write(fd, json.dumps(body).encode())
                # Renamed in: watchers get IN_MOVED_TO and never see a half-made, unlocked ticket.
                os.rename(tmp, ticket.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._waiters_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self._dir_fd)
                os.close(fd)
                raise
            return ticket, fd
        finally:
            os.close(seq_fd)  # drops the counter lock

    def _drop_ticket(self, ticket: Ticket, fd: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ticket.name, dir_fd=self._waiters_fd)
        os.close(fd)

    # -- token and holder record --

    def _open_token(self) -> int:
        return os.open(TOKEN_FILE, os.O_RDWR | os.O_CREAT | _O_FILE, 0o600, dir_fd=self._dir_fd)

    def _write_holder(self, record: HolderRecord) -> None:
        tmp = f".holder.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_FILE, 0o644, dir_fd=self._dir_fd)
        try:
            os.write(fd, json.dumps(asdict(record)).encode())
        finally:
            os.close(fd)
        os.rename(tmp, HOLDER_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def _remove_holder(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(HOLDER_FILE, dir_fd=self._dir_fd)

    def _watch(self) -> _DirWatch:
        if self.backend == "inotify":
            try:
                return _DirWatch(self.waiters_path, "inotify")
            except OSError as exc:  # e.g. fs.inotify.max_user_instances reached: same protocol, polled
                log.warning("inotify on %s failed (%s); polling instead", self.waiters_path, exc)
        return _DirWatch(self.waiters_path, "poll")


def check_arena_dir(path: str | os.PathLike[str]) -> Path:
    """Validate (creating it if missing) an arena directory; raise :class:`UnsafeArenaError` naming
    the path and the reason. For processes that only need to refuse early (serve, the tray)."""
    arena = Arena(path)
    arena.close()
    return arena.path


def env_arena_dir() -> Path | None:
    """``$TIMESHARE_VRAM_ARENA`` with ``~`` expanded, checked by :func:`check_arena_dir` (raises
    :class:`UnsafeArenaError`); None when it is not set. For tools that refuse an unsafe arena
    before they load anything (arena-test, bench switch)."""
    raw = os.environ.get("TIMESHARE_VRAM_ARENA")
    if not raw:
        return None
    path = Path(raw).expanduser()
    check_arena_dir(path)
    return path
