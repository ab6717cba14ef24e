"""An arena directory opened by one process: :class:`Arena` (see the package docstring for the
layout and the protocol)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from .. import paths
from ..errors import ArenaError
from .budget import BudgetRecord, LeaseRecord
from .dirs import ArenaDir, load_holder_at, load_release_at, pid_alive, read_holder_at, resolve_arena_dir
from .leases import LeaseFiles
from .records import (
    HOLDER_FILE,
    LEASES_DIR,
    O_FILE,
    RELEASE_FILE,
    Backend,
    HolderRecord,
    ReleaseRecord,
    Ticket,
)
from .tickets import TicketQueue
from .watch import DirWatch, inotify_available

log = logging.getLogger(__name__)


class Arena:
    """An arena directory, validated and opened. Cheap; one per process is plenty.

    It owns the opened directory (:attr:`dir`, an :class:`~.dirs.ArenaDir`: its fds, the arena
    lock), the ticket queue (:attr:`queue`, a :class:`~.tickets.TicketQueue`) and the lease files
    and budget record (:attr:`lease_files`, a :class:`~.leases.LeaseFiles`), which all work on
    that one directory; itself it keeps the holder record, the release record, the sweep and
    the watch.

    ``backend``: "inotify", "poll", or "auto" (inotify where it exists, else polling).

    Opening it sweeps what dead processes left (:meth:`sweep`) and checks the token file (an
    :class:`ArenaError` naming it when it is not a regular file)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, backend: Backend = "auto") -> None:
        self.path = Path(os.path.abspath(path)) if path is not None else resolve_arena_dir()
        if backend == "auto":
            backend = "inotify" if inotify_available() else "poll"
        elif backend == "inotify" and not inotify_available():
            raise ArenaError("inotify is not available here: use the polling backend")
        self.backend: Literal["inotify", "poll"] = backend
        self.dir = ArenaDir(self.path)
        self.waiters_path = self.dir.waiters_path
        self.leases_path = self.dir.leases_path
        self.queue = TicketQueue(self.dir)
        self.lease_files = LeaseFiles(self.dir)
        try:
            os.close(self.dir.open_token())  # a token that is not a regular file: said now, by name
            self.sweep()
        except OSError as exc:
            log.warning("sweeping the arena %s failed: %s", self.path, exc)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"Arena({str(self.path)!r}, backend={self.backend!r})"

    def close(self) -> None:
        self.dir.close()

    # -- reading --

    def holder(self) -> HolderRecord | None:
        """The holder record, or None when nobody holds the token (or its holder died)."""
        return read_holder_at(self.dir.fd)

    def waiters(self, *, sweep: bool = True) -> list[Ticket]:
        """Live tickets in queue order (:meth:`.tickets.TicketQueue.waiting`)."""
        return self.queue.waiting(sweep=sweep)

    def ticket_need(self, ticket: Ticket) -> int | None:
        """The weight bytes a ticket asks for (:meth:`.tickets.TicketQueue.need`)."""
        return self.queue.need(ticket)

    def leases(self, *, sweep: bool = True) -> list[LeaseRecord]:
        """The live leases (:meth:`.leases.LeaseFiles.live`)."""
        return self.lease_files.live(sweep=sweep)

    def budget_record(self) -> BudgetRecord | None:
        """The budget recorded in this arena (:meth:`.leases.LeaseFiles.budget_record`)."""
        return self.lease_files.budget_record()

    def budget_in_force(self) -> BudgetRecord | None:
        """The recorded budget while some member lives (:meth:`.leases.LeaseFiles.budget_in_force`)."""
        return self.lease_files.budget_in_force()

    def sweep(self) -> list[str]:
        """Remove what dead processes left and what can never be a ticket; return the names removed.

        - ``waiters/``: a regular file nobody holds a lock on (a ticket's owner keeps its lock
          until the file is gone, so an unlocked one belongs to a dead process, and a file with
          another name is not a ticket at all); a symbolic link, FIFO, socket or device node (never
          a ticket: removing one touches nothing it points to); an empty directory. A directory
          with files in it is left alone, ignored, and reported by path once.
        - ``leases/``: the same, for lease files (a live holder keeps its lease locked).
        - temporary files ``.holder.<pid>.<thread>.tmp``, ``.released.<pid>.<thread>.tmp``,
          ``.<ticket>.tmp`` and ``.lease.<lease>.tmp`` of dead pids.
        - a holder record that is not one (garbage, a symbolic link, an empty directory...) or
          whose process is dead, removed only while the token is free (taken for an instant, so
          no new holder can be writing its record meanwhile).
        """
        d = self.dir
        removed = []
        for name in d.listdir(d.waiters_fd):
            if d.probe(d.waiters_fd, name, remove=True) == "removed":
                removed.append(name)
        for name in d.listdir(d.leases_fd):
            if d.probe(d.leases_fd, name, remove=True) == "removed":
                removed.append(f"{LEASES_DIR}/{name}")
        for name in d.listdir(d.fd):
            if name.startswith(".") and name.endswith(".tmp") and self._sweep_tmp(name):
                removed.append(name)
        if self._sweep_holder():
            removed.append(HOLDER_FILE)
        return removed

    def _sweep_tmp(self, name: str) -> bool:
        """A temporary file of a dead process: ``.holder.<pid>.<thread>.tmp`` or
        ``.released.<pid>.<thread>.tmp`` (never locked: its pid says) or ``.<ticket>.tmp`` (a
        ticket being made, locked right after its creation)."""
        pid: int | None = None
        if name.startswith((".holder.", ".released.")):
            part = name.split(".")[2]
            pid = int(part) if part.isdigit() and len(part) <= 10 else None
        elif name.startswith(".lease."):
            part = name[len(".lease.") :].split("-", 1)[0]
            pid = int(part) if part.isdigit() and len(part) <= 10 else None
        else:
            ticket = Ticket.parse(name[1:-4])
            pid = ticket.pid if ticket is not None else None
        if pid is None or pid_alive(pid):
            return False  # not ours to judge, or its writer lives
        try:
            st = os.lstat(name, dir_fd=self.dir.fd)
        except FileNotFoundError:
            return False
        if stat.S_ISREG(st.st_mode):
            return self.dir.sweep_if_stale(self.dir.fd, name) == "removed"
        return self.dir.remove_odd(self.dir.fd, name, st)

    def _sweep_holder(self) -> bool:
        """Remove a holder record that is not one, or whose process died, while the token is free."""
        record, problem = load_holder_at(self.dir.fd)
        if record is None and not problem:
            return False  # no record
        if record is not None and pid_alive(record.pid):
            return False
        try:
            token = self.dir.open_token()
        except ArenaError:
            return False  # said by name to whoever waits for the GPU
        try:
            try:
                fcntl.flock(token, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # someone is inside the arena lock: looked at again later
            if self.leases():
                return False  # someone holds the GPU: the record is theirs to rewrite
            try:
                st = os.lstat(HOLDER_FILE, dir_fd=self.dir.fd)
            except FileNotFoundError:
                return False
            why = problem or f"its process {record.pid if record else '?'} is gone"
            if stat.S_ISDIR(st.st_mode):
                removed = self.dir.remove_odd(self.dir.fd, HOLDER_FILE, st)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(HOLDER_FILE, dir_fd=self.dir.fd)
                removed = True
            if removed:
                log.warning("removed the arena's holder record %s: %s", self.path / HOLDER_FILE, why)
            return removed
        finally:
            os.close(token)  # drops the lock

    def write_holder(self, record: HolderRecord) -> None:
        """Write the holder record atomically. It only informs (the lock is what counts), so a
        failure is logged with the path, never raised."""
        self._write_record(HOLDER_FILE, asdict(record), "so nobody sees who holds the GPU")

    def write_release(self, record: ReleaseRecord) -> None:
        """Write the release record atomically (by a holder whose lease is about to go: before it
        goes, so that the grant it lets through finds it). Informs only: a failure is logged with
        the path (the next grant then says 0 ms), never raised."""
        consequence = "so the next holder cannot say how long the release took"
        self._write_record(RELEASE_FILE, asdict(record), consequence)

    def take_release(self) -> ReleaseRecord | None:
        """Read and remove the release record (by a grant, under the arena lock: each release is
        credited once, to the first grant after it). None when there is none or it is not one.
        Never raises."""
        record = load_release_at(self.dir.fd)
        self._remove_record(RELEASE_FILE)
        return record

    def _write_record(self, name: str, data: dict[str, object], consequence: str) -> None:
        """Write the JSON record ``name`` atomically (a temporary file renamed over it); a failure
        is reported with the path and ``consequence``."""
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_FILE, 0o644, dir_fd=self.dir.fd)
            try:
                os.write(fd, json.dumps(data).encode())
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.dir.fd, dst_dir_fd=self.dir.fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir.fd)
            self.dir.report(self.path / name, f"cannot be written ({exc.strerror}), {consequence}")

    def remove_holder(self) -> None:
        """Remove the holder record (by its holder, before it unlocks the token). Never raises."""
        self._remove_record(HOLDER_FILE)

    def _remove_record(self, name: str) -> None:
        """Remove the record ``name``: a file unlinked, anything else there (a directory...) as
        the sweep removes odd entries. Never raises."""
        try:
            os.unlink(name, dir_fd=self.dir.fd)
        except FileNotFoundError:
            pass
        except OSError:
            with contextlib.suppress(OSError):
                st = os.lstat(name, dir_fd=self.dir.fd)
                self.dir.remove_odd(self.dir.fd, name, st)

    def watch(self) -> DirWatch:
        """A watch on ``waiters/`` and ``leases/``."""
        if self.backend == "inotify":
            try:
                return DirWatch(self.waiters_path, "inotify", also=(self.leases_path,))
            except OSError as exc:  # e.g. fs.inotify.max_user_instances reached: same protocol, polled
                log.warning("inotify on %s failed (%s); polling instead", self.waiters_path, exc)
        return DirWatch(self.waiters_path, "poll")


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
    path = paths.arena_dir_override()
    if path is None:
        return None
    check_arena_dir(path)
    return path
