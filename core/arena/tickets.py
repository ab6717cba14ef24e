"""The ticket queue and the token file: :class:`Arena`, one per arena directory and process."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from .. import paths
from ..errors import ArenaError, UnsafeArenaError
from .dirs import (
    check_ancestors,
    file_kind,
    load_holder_at,
    open_checked_dir,
    pid_alive,
    read_holder_at,
    resolve_arena_dir,
    warn_once,
)
from .leases import LEASES_DIR, LeaseArena
from .records import (
    HOLDER_FILE,
    MAX_SEQ,
    O_DIR,
    O_FILE,
    SEQ_FILE,
    TOKEN_FILE,
    WAITERS_DIR,
    Backend,
    HolderRecord,
    Ticket,
)
from .watch import DirWatch, inotify_available

log = logging.getLogger(__name__)


# ---- the arena -------------------------------------------------------------------------------


#: what a look at one directory entry found (:meth:`Arena._probe`)
_Probe = Literal["live", "removed", "gone", "kept"]
_SEQ_RE = re.compile(rb"^\s*(\d{0,12})\s*$")


class Arena(LeaseArena):
    """An arena directory, validated and opened. Cheap; one per process is plenty.

    ``backend``: "inotify", "poll", or "auto" (inotify where it exists, else polling).

    Opening it sweeps what dead processes left (:meth:`sweep`) and checks the token file (an
    :class:`ArenaError` naming it when it is not a regular file)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, backend: Backend = "auto") -> None:
        self.path = Path(os.path.abspath(path)) if path is not None else resolve_arena_dir()
        self.waiters_path = self.path / WAITERS_DIR
        if backend == "auto":
            backend = "inotify" if inotify_available() else "poll"
        elif backend == "inotify" and not inotify_available():
            raise ArenaError("inotify is not available here: use the polling backend")
        self.backend: Literal["inotify", "poll"] = backend
        check_ancestors(self.path)
        if not self.path.parent.exists():
            try:
                self.path.parent.mkdir(parents=True, mode=0o700)
            except OSError as exc:
                raise UnsafeArenaError(self.path, f"its parent cannot be created ({exc.strerror})") from exc
        self._dir_fd = open_checked_dir(self.path, create=True)
        self._lease_cache = {}
        try:
            self._waiters_fd = open_checked_dir(
                self.waiters_path, create=True, dir_fd=self._dir_fd, name=WAITERS_DIR
            )
        except BaseException:
            os.close(self._dir_fd)
            raise
        try:
            self._leases_fd = open_checked_dir(
                self.path / LEASES_DIR, create=True, dir_fd=self._dir_fd, name=LEASES_DIR
            )
        except BaseException:
            os.close(self._waiters_fd)
            os.close(self._dir_fd)
            raise
        try:
            os.close(self._open_token())  # a token that is not a regular file: said now, by name
            self.sweep()
        except OSError as exc:
            log.warning("sweeping the arena %s failed: %s", self.path, exc)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"Arena({str(self.path)!r}, backend={self.backend!r})"

    def close(self) -> None:
        for fd in (self._leases_fd, self._waiters_fd, self._dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        # a read after close fails (EBADF) instead of reading whatever reuses the numbers
        self._leases_fd = self._waiters_fd = self._dir_fd = -1

    # -- reading --

    def holder(self) -> HolderRecord | None:
        return read_holder_at(self._dir_fd)

    def waiters(self, *, sweep: bool = True) -> list[Ticket]:
        """Live tickets in queue order; when ``sweep``, what is not a live ticket is removed where
        that is safe (see :meth:`sweep`). Without ``sweep`` the locks are not looked at (every
        regular file with a ticket's name counts)."""
        live = []
        for name in self._listdir(self._waiters_fd):
            ticket = Ticket.parse(name)
            if self._probe(self._waiters_fd, name, remove=sweep) == "live" and ticket is not None:
                live.append(ticket)
        return sorted(live)

    def sweep(self) -> list[str]:
        """Remove what dead processes left and what can never be a ticket; return the names removed.

        - ``waiters/``: a regular file nobody holds a lock on (a ticket's owner keeps its lock
          until the file is gone, so an unlocked one belongs to a dead process, and a file with
          another name is not a ticket at all); a symbolic link, FIFO, socket or device node (never
          a ticket: removing one touches nothing it points to); an empty directory. A directory
          with files in it is left alone, ignored, and reported by path once.
        - ``leases/``: the same, for lease files (a live holder keeps its lease locked).
        - temporary files ``.holder.<pid>.<thread>.tmp``, ``.<ticket>.tmp`` and
          ``.lease.<lease>.tmp`` of dead pids.
        - a holder record that is not one (garbage, a symbolic link, an empty directory...) or
          whose process is dead, removed only while the token is free (taken for an instant, so
          no new holder can be writing its record meanwhile).
        """
        removed = []
        for name in self._listdir(self._waiters_fd):
            if self._probe(self._waiters_fd, name, remove=True) == "removed":
                removed.append(name)
        for name in self._listdir(self._leases_fd):
            if self._probe(self._leases_fd, name, remove=True) == "removed":
                removed.append(f"{LEASES_DIR}/{name}")
        for name in self._listdir(self._dir_fd):
            if name.startswith(".") and name.endswith(".tmp") and self._sweep_tmp(name):
                removed.append(name)
        if self._sweep_holder():
            removed.append(HOLDER_FILE)
        return removed

    @staticmethod
    def _listdir(dir_fd: int) -> list[str]:
        # A fresh open file description per listing: os.listdir(fd) reads through a dup of the
        # fd, which shares the directory offset, so two threads listing through one fd at the
        # same time see entries twice or miss them.
        fd = os.open(".", O_DIR, dir_fd=dir_fd)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def _where(self, dir_fd: int, name: str) -> Path:
        if dir_fd == self._leases_fd:
            return self.leases_path / name
        return (self.waiters_path if dir_fd == self._waiters_fd else self.path) / name

    def _report(self, path: Path, problem: str) -> None:
        """Say once per process what is wrong with an entry that is left in place."""
        warn_once(
            f"{path}: {problem}",
            "%s %s; it is ignored: remove it by hand (rm -r '%s') once no Timeshare uses the arena",
            path,
            problem,
            path,
        )

    def _probe(self, dir_fd: int, name: str, *, remove: bool) -> _Probe:
        """Look at one entry of ``waiters/``: "live" (a regular file, locked by its owner when
        ``remove``), "removed" (stale or never a ticket: removed now), "gone" (vanished
        meanwhile) or "kept" (not a live ticket, but left in place)."""
        try:
            st = os.lstat(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return "gone"
        if stat.S_ISREG(st.st_mode):
            return self._sweep_if_stale(dir_fd, name) if remove else "live"
        if not remove:
            return "kept"
        return "removed" if self._remove_odd(dir_fd, name, st) else "kept"

    def _remove_odd(self, dir_fd: int, name: str, st: os.stat_result) -> bool:
        """Remove an entry that is not a regular file (no process can own it through the arena's
        protocol, which only opens regular files without following links). True when removed."""
        path = self._where(dir_fd, name)
        kind = file_kind(st.st_mode)
        try:
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dir_fd)
            else:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            self._report(path, f"is {kind} that cannot be removed ({exc.strerror})")
            return False
        log.warning("removed %s from the arena: it was %s, not one of its files", path, kind)
        return True

    def _sweep_if_stale(self, dir_fd: int, name: str) -> _Probe:
        """A regular file: "live" while its owner holds its lock, else removed."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=dir_fd)
        except FileNotFoundError:
            return "gone"
        except OSError as exc:  # replaced by a link meanwhile, or unreadable: the next scan says
            self._report(self._where(dir_fd, name), f"cannot be opened ({exc.strerror})")
            return "kept"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "kept"  # replaced meanwhile: looked at again by the next scan
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "live"  # its owner is alive and holds it
            # Nobody holds it: its owner died (a live owner keeps the lock from before the file
            # got its public name until after it is unlinked), or it never was a ticket.
            try:
                now = os.lstat(name, dir_fd=dir_fd)
            except FileNotFoundError:
                return "gone"
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return "kept"  # a new file took the name: not the one we locked
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
            log.info("swept stale arena entry %s", name)
            return "removed"
        finally:
            os.close(fd)

    def _sweep_tmp(self, name: str) -> bool:
        """A temporary file of a dead process: ``.holder.<pid>.<thread>.tmp`` (never locked: its
        pid says) or ``.<ticket>.tmp`` (a ticket being made, locked right after its creation)."""
        pid: int | None = None
        if name.startswith(".holder."):
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
            st = os.lstat(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return False
        if stat.S_ISREG(st.st_mode):
            return self._sweep_if_stale(self._dir_fd, name) == "removed"
        return self._remove_odd(self._dir_fd, name, st)

    def _sweep_holder(self) -> bool:
        """Remove a holder record that is not one, or whose process died, while the token is free."""
        record, problem = load_holder_at(self._dir_fd)
        if record is None and not problem:
            return False  # no record
        if record is not None and pid_alive(record.pid):
            return False
        try:
            token = self._open_token()
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
                st = os.lstat(HOLDER_FILE, dir_fd=self._dir_fd)
            except FileNotFoundError:
                return False
            why = problem or f"its process {record.pid if record else '?'} is gone"
            if stat.S_ISDIR(st.st_mode):
                removed = self._remove_odd(self._dir_fd, HOLDER_FILE, st)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(HOLDER_FILE, dir_fd=self._dir_fd)
                removed = True
            if removed:
                log.warning("removed the arena's holder record %s: %s", self.path / HOLDER_FILE, why)
            return removed
        finally:
            os.close(token)  # drops the lock

    # -- tickets --

    def _open_seq(self) -> int:
        """The ticket counter, a regular file. A symbolic link, FIFO, socket, device node or empty
        directory in its place is removed (nothing can be counting through it: the counter is
        only opened without following links); a directory with files in it is an ArenaError."""
        path = self.path / SEQ_FILE
        for _ in range(5):
            try:
                fd = os.open(
                    SEQ_FILE, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | O_FILE, 0o600, dir_fd=self._dir_fd
                )
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
                    raise
            else:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    return fd
                os.close(fd)
            try:
                st = os.lstat(SEQ_FILE, dir_fd=self._dir_fd)
            except FileNotFoundError:
                continue
            if not self._remove_odd(self._dir_fd, SEQ_FILE, st):
                break
        raise ArenaError(
            f"the arena's ticket counter {path} is not a regular file and cannot be replaced; "
            f"stop every Timeshare that uses {self.path}, remove it (rm -r '{path}') and start again"
        )

    def _next_seq(self, seq_fd: int) -> int:
        """The last ticket number handed out (under the counter's lock), and never less than the
        highest live ticket. A counter that is not a number of at most 12 digits (garbage,
        negative, too large) starts again after the highest ticket in the queue."""
        raw = os.pread(seq_fd, 64, 0)
        match = _SEQ_RE.match(raw)
        queue_last = max((t.seq for t in self.waiters()), default=0)
        if match is not None and int(match.group(1) or b"0") < MAX_SEQ:
            # never behind the queue (a counter removed by hand would let newcomers jump it)
            return max(int(match.group(1) or b"0"), queue_last)
        log.warning(
            "the arena's ticket counter %s held %r, not a ticket number: counting on after the queue (%d)",
            self.path / SEQ_FILE,
            raw[:40],
            queue_last,
        )
        return queue_last

    def _take_ticket(self, model: str, need: int | None = None) -> tuple[Ticket, int]:
        """Create this process's ticket; return it and the fd that keeps it locked (alive).
        ``need``: the weight bytes it asks for (None: the device to itself)."""
        seq_fd = self._open_seq()
        try:
            fcntl.flock(seq_fd, fcntl.LOCK_EX)
            last = self._next_seq(seq_fd)
            for _ in range(100):
                if last >= MAX_SEQ:
                    break
                ticket = Ticket(last + 1, os.getpid(), model)
                made = self._make_ticket(ticket, need)
                last = ticket.seq
                if made is not None:
                    text = f"{ticket.seq}\n".encode()
                    os.pwrite(seq_fd, text, 0)
                    os.ftruncate(seq_fd, len(text))
                    return ticket, made
            raise ArenaError(
                f"no ticket number is free in {self.waiters_path} (the last tried was {last}); stop "
                f"every Timeshare that uses {self.path}, empty {self.waiters_path} and start again"
            )
        finally:
            os.close(seq_fd)  # drops the counter lock

    def _make_ticket(self, ticket: Ticket, need: int | None = None) -> int | None:
        """Create ``ticket`` locked; its fd, or None when its name is taken (a leftover: the
        caller takes the next number)."""
        tmp = f".{ticket.name}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_FILE, 0o600, dir_fd=self._dir_fd)
        except FileExistsError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            body = {
                "model": ticket.model,
                "pid": ticket.pid,
                "at": time.time(),
                "at_monotonic": time.monotonic(),
                "bytes": need,
            }
            os.write(fd, json.dumps(body).encode())
            try:
                os.lstat(ticket.name, dir_fd=self._waiters_fd)
            except FileNotFoundError:
                pass
            else:  # a leftover has this name (a rename would replace a file, fail on a folder)
                os.unlink(tmp, dir_fd=self._dir_fd)
                os.close(fd)
                return None
            # Renamed in: watchers get IN_MOVED_TO and never see a half-made, unlocked ticket.
            os.rename(tmp, ticket.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._waiters_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)
            os.close(fd)
            raise
        return fd

    def ticket_need(self, ticket: Ticket) -> int | None:
        """The weight bytes a ticket asks for; None when it wants the device to itself (or its
        body cannot be read: the safe reading)."""
        try:
            fd = os.open(ticket.name, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=self._waiters_fd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            body = json.loads(os.read(fd, 4096))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        need = body.get("bytes") if isinstance(body, dict) else None
        return need if type(need) is int and need >= 0 else None

    def _drop_ticket(self, ticket: Ticket, fd: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ticket.name, dir_fd=self._waiters_fd)
        os.close(fd)

    # -- token and holder record --

    def _open_token(self) -> int:
        """The token file, a regular file; anything else in its place is an ArenaError that names
        it (it is not removed: a process could still hold the token through the file that name
        had before, and a new token beside it would let two processes hold the GPU)."""
        path = self.path / TOKEN_FILE
        try:
            fd = os.open(
                TOKEN_FILE, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | O_FILE, 0o600, dir_fd=self._dir_fd
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._bad_token(path, "a symbolic link") from None
            if exc.errno == errno.EISDIR:
                raise self._bad_token(path, "a directory") from None
            if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):
                raise self._bad_token(path, "not a regular file") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise self._bad_token(path, file_kind(st.st_mode))
        return fd

    def _bad_token(self, path: Path, kind: str) -> ArenaError:
        return ArenaError(
            f"the arena's token {path} is {kind}, not a regular file, so no model can take the GPU: "
            f"stop every Timeshare that uses {self.path}, remove it (rm -r '{path}') and start again, "
            f"or point TIMESHARE_VRAM_ARENA or arena.dir elsewhere"
        )

    def _write_holder(self, record: HolderRecord) -> None:
        """Write the holder record atomically. It only informs (the lock is what counts), so a
        failure is logged with the path, never raised."""
        tmp = f".holder.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_FILE, 0o644, dir_fd=self._dir_fd)
            try:
                os.write(fd, json.dumps(asdict(record)).encode())
            finally:
                os.close(fd)
            os.rename(tmp, HOLDER_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)
            self._report(
                self.path / HOLDER_FILE,
                f"cannot be written ({exc.strerror}), so nobody sees who holds the GPU",
            )

    def _remove_holder(self) -> None:
        """Remove the holder record (by its holder, before it unlocks the token). Never raises."""
        try:
            os.unlink(HOLDER_FILE, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError:
            with contextlib.suppress(OSError):
                st = os.lstat(HOLDER_FILE, dir_fd=self._dir_fd)
                self._remove_odd(self._dir_fd, HOLDER_FILE, st)

    def _watch(self) -> DirWatch:
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
