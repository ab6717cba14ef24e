"""The arena's directory: where it lives, the checks that make it trustworthy, the opened
directory (:class:`ArenaDir`: its fds, its entries, the arena lock) and reading the holder record
and the release record."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from .. import paths
from ..errors import ArenaError, UnsafeArenaError
from .records import (
    HOLDER_FILE,
    LEASES_DIR,
    MAX_PID,
    O_DIR,
    O_FILE,
    RECORD_MODEL_RE,
    RELEASE_FILE,
    TOKEN_FILE,
    WAITERS_DIR,
    HolderRecord,
    ReleaseRecord,
)

log = logging.getLogger(__name__)


# ---- directory safety ------------------------------------------------------------------------


def resolve_arena_dir(configured: str | None = None) -> Path:
    """The arena directory: ``$TIMESHARE_VRAM_ARENA``, else ``arena.dir`` from the config, else the
    default under the user's runtime dir."""
    override = paths.arena_dir_override()
    if override is not None or not configured:
        path = paths.default_arena_dir()
    else:
        path = Path(configured).expanduser()
    return Path(os.path.abspath(path))


def device_arena_dir(base: Path, device: int) -> Path:
    """The arena of GPU ``device``: the arena directory itself for device 0, ``device-N`` inside
    it for the others (one budget, queue and set of leases per device)."""
    return base if device == 0 else base / f"device-{device}"


def _check_dir_stat(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeArenaError(path, "it is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeArenaError(path, "it is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeArenaError(path, f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafeArenaError(path, f"it is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})")


def check_ancestors(path: Path) -> None:
    """Refuse a path that someone else could redirect: through a symbolic link not made by root
    (root-owned system links such as /var/run -> /run are trusted), or inside a folder owned by
    another user, or inside a folder others may write without the sticky bit (/tmp is fine)."""
    euid = os.geteuid()
    for parent in reversed(path.parents):
        try:
            st = os.lstat(parent)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid != 0:
                    raise UnsafeArenaError(path, f"it is reached through the symbolic link {parent}")
                st = os.stat(parent)
        except FileNotFoundError:
            return
        if st.st_uid not in (0, euid):
            raise UnsafeArenaError(path, f"it is inside {parent}, which belongs to uid {st.st_uid}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeArenaError(
                path,
                f"it is inside {parent}, which others may write (mode {stat.S_IMODE(st.st_mode):04o}, "
                f"no sticky bit)",
            )


def open_checked_dir(path: Path, *, create: bool, dir_fd: int | None = None, name: str | None = None) -> int:
    """Open (and create, mode 0700) a directory without following symlinks, then check what was
    opened: owned by us, not group/world-writable."""
    target: str = name if name is not None else str(path)
    if create:
        try:
            os.mkdir(target, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafeArenaError(path, f"it cannot be created ({exc.strerror})") from exc
    try:
        st = os.lstat(target, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise UnsafeArenaError(path, "it does not exist") from exc
    _check_dir_stat(path, st)
    try:
        fd = os.open(target, O_DIR, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeArenaError(path, "it is a symbolic link or not a directory") from exc
        raise UnsafeArenaError(path, f"it cannot be opened ({exc.strerror})") from exc
    try:
        _check_dir_stat(path, os.fstat(fd))  # what was opened, not what was looked at (no TOCTOU)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: what a look at one directory entry found (:meth:`ArenaDir.probe`)
Probe = Literal["live", "removed", "gone", "kept"]
#: the arena lock is retried this often while another process holds it (it is held for microseconds)
LOCK_RETRY_S = 0.001
#: open flags of a record file: read-write, created 0600, never through a link, never blocking
_O_RECORD = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | O_FILE
#: what opening a name that is not a regular file fails with (a link, a folder, a socket...)
_NOT_REGULAR = (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP)


class ArenaDir:
    """One arena directory, checked and opened: the fds of it and of ``waiters/`` and ``leases/``,
    listing and judging their entries, opening its record files, and the arena lock.

    What the ticket queue (:class:`~.tickets.TicketQueue`), the lease files
    (:class:`~.leases.LeaseFiles`) and the :class:`~.arena.Arena` share. Every entry is opened
    relative to these fds, only as a regular file, never through a link and never blocking.
    Opening raises :class:`UnsafeArenaError` (naming the path and the reason) for a directory that
    someone else could redirect or write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.waiters_path = path / WAITERS_DIR
        self.leases_path = path / LEASES_DIR
        check_ancestors(path)
        if not path.parent.exists():
            try:
                path.parent.mkdir(parents=True, mode=0o700)
            except OSError as exc:
                raise UnsafeArenaError(path, f"its parent cannot be created ({exc.strerror})") from exc
        self.fd = open_checked_dir(path, create=True)
        self.waiters_fd = self.leases_fd = -1
        try:
            self.waiters_fd = open_checked_dir(
                self.waiters_path, create=True, dir_fd=self.fd, name=WAITERS_DIR
            )
            self.leases_fd = open_checked_dir(self.leases_path, create=True, dir_fd=self.fd, name=LEASES_DIR)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in (self.leases_fd, self.waiters_fd, self.fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        # a read after close fails (EBADF) instead of reading whatever reuses the numbers
        self.leases_fd = self.waiters_fd = self.fd = -1

    # -- entries --

    @staticmethod
    def listdir(dir_fd: int) -> list[str]:
        """The names in one of the directories (``fd``, ``waiters_fd``, ``leases_fd``)."""
        # A fresh open file description per listing: os.listdir(fd) reads through a dup of the
        # fd, which shares the directory offset, so two threads listing through one fd at the
        # same time see entries twice or miss them.
        fd = os.open(".", O_DIR, dir_fd=dir_fd)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def where(self, dir_fd: int, name: str) -> Path:
        """The path of an entry, for messages."""
        if dir_fd == self.leases_fd:
            return self.leases_path / name
        return (self.waiters_path if dir_fd == self.waiters_fd else self.path) / name

    def report(self, path: Path, problem: str) -> None:
        """Say once per process what is wrong with an entry that is left in place."""
        warn_once(
            f"{path}: {problem}",
            "%s %s; it is ignored: remove it by hand (rm -r '%s') once no Timeshare uses the arena",
            path,
            problem,
            path,
        )

    def probe(self, dir_fd: int, name: str, *, remove: bool) -> Probe:
        """Look at one entry of ``waiters/`` or ``leases/``: "live" (a regular file, locked by its
        owner when ``remove``), "removed" (stale or never one: removed now), "gone" (vanished
        meanwhile) or "kept" (not a live entry, but left in place)."""
        try:
            st = os.lstat(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return "gone"
        if stat.S_ISREG(st.st_mode):
            return self.sweep_if_stale(dir_fd, name) if remove else "live"
        if not remove:
            return "kept"
        return "removed" if self.remove_odd(dir_fd, name, st) else "kept"

    def remove_odd(self, dir_fd: int, name: str, st: os.stat_result) -> bool:
        """Remove an entry that is not a regular file (no process can own it through the arena's
        protocol, which only opens regular files without following links). True when removed."""
        path = self.where(dir_fd, name)
        kind = file_kind(st.st_mode)
        try:
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dir_fd)
            else:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            self.report(path, f"is {kind} that cannot be removed ({exc.strerror})")
            return False
        log.warning("removed %s from the arena: it was %s, not one of its files", path, kind)
        return True

    def sweep_if_stale(self, dir_fd: int, name: str) -> Probe:
        """A regular file: "live" while its owner holds its lock, else removed."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=dir_fd)
        except FileNotFoundError:
            return "gone"
        except OSError as exc:  # replaced by a link meanwhile, or unreadable: the next scan says
            self.report(self.where(dir_fd, name), f"cannot be opened ({exc.strerror})")
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
            # got its public name until after it is unlinked), or it never was one of ours.
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

    # -- record files --

    def open_record(self, name: str, what: str, *, replace: bool) -> int:
        """The arena's file ``name`` (created 0600 if missing) opened read-write, a regular file.

        Something else in its place (a symbolic link, FIFO, socket, device node or directory):
        with ``replace`` it is removed when nothing can hold the file through it (an empty
        directory; the arena's files are only opened without following links) and the file is
        made again, and a directory with files in it is an :class:`ArenaError`; without
        ``replace`` (the token: a process could still hold the GPU through the file that name had
        before, and a new one beside it would let two processes hold it) it is an ArenaError that
        names what is there. ``what`` names the file in the error ("ticket counter")."""
        path = self.path / name
        for _ in range(5):
            try:
                fd = os.open(name, _O_RECORD, 0o600, dir_fd=self.fd)
            except OSError as exc:
                if exc.errno not in _NOT_REGULAR:
                    raise
            else:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    return fd
                os.close(fd)
            try:
                st = os.lstat(name, dir_fd=self.fd)
            except FileNotFoundError:
                continue
            if not replace:
                raise self._not_regular(path, what, file_kind(st.st_mode))
            if not self.remove_odd(self.fd, name, st):
                break
        if not replace:
            raise self._not_regular(path, what, "not a regular file")
        raise ArenaError(
            f"the arena's {what} {path} is not a regular file and cannot be replaced; "
            f"stop every Timeshare that uses {self.path}, remove it (rm -r '{path}') and start again"
        )

    def _not_regular(self, path: Path, what: str, kind: str) -> ArenaError:
        return ArenaError(
            f"the arena's {what} {path} is {kind}, not a regular file, so no model can take the GPU: "
            f"stop every Timeshare that uses {self.path}, remove it (rm -r '{path}') and start again, "
            f"or point TIMESHARE_VRAM_ARENA or arena.dir elsewhere"
        )

    def open_token(self) -> int:
        """The token file: :meth:`open_record` that never replaces it."""
        return self.open_record(TOKEN_FILE, "token", replace=False)

    # -- the arena lock --

    def lock(self, check: Callable[[], None] | None = None, timeout: float | None = None) -> int | None:
        """Take the arena lock (``flock`` on the token file); its fd, or None when ``timeout``
        passed. ``check`` runs while it is retried (it may raise: cancel, deadline). Never blocks
        in the kernel: a process stopped inside a critical section (SIGSTOP) must not freeze its
        waiters' cancel and deadline. Give it back with :meth:`unlock`."""
        fd = self.open_token()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    pass
                if check is not None:
                    check()
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(LOCK_RETRY_S)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise

    @staticmethod
    def unlock(fd: int) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts as alive)."""
    if pid <= 0 or pid > MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(path: str | os.PathLike[str] | None = None) -> HolderRecord | None:
    """The current holder record, or None when nobody holds the token (or its holder died, or the
    record is not one: a symbolic link, a directory, garbage). Reads only; never creates the arena."""
    base = Path(os.path.abspath(path)) if path is not None else resolve_arena_dir()
    try:
        dir_fd = os.open(base, O_DIR)
    except OSError:
        return None
    try:
        return read_holder_at(dir_fd)
    finally:
        os.close(dir_fd)


def read_holder_at(dir_fd: int) -> HolderRecord | None:
    record, problem = load_holder_at(dir_fd)
    if problem:
        warn_once(problem, "ignoring the arena's holder record: %s", problem)
    return record if record is not None and pid_alive(record.pid) else None


def load_holder_at(dir_fd: int) -> tuple[HolderRecord | None, str]:
    """The holder record as written (its pid not checked), or None and why it is not one ("" when
    there is no record). Never blocks (a FIFO named ``holder`` is not opened for a writer) and
    never raises OSError."""
    raw, problem = read_small_file(dir_fd, HOLDER_FILE)
    if raw is None:
        return None, problem
    record = parse_holder(raw)
    if record is None:
        return None, f"it is not a holder record ({raw[:80]!r})"
    return record, ""


def read_small_file(dir_fd: int, name: str) -> tuple[bytes | None, str]:
    """The bytes (at most 64 KiB) of the regular file ``name`` in ``dir_fd``, or None and why not
    ("" when there is no such file). Never blocks (a FIFO is not opened for a writer), never
    follows a symbolic link and never raises OSError."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "it is a symbolic link"
        return None, f"it cannot be opened ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"it is {file_kind(st.st_mode)}"
        return os.read(fd, 1 << 16), ""
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror})"
    finally:
        os.close(fd)


def load_release_at(dir_fd: int) -> ReleaseRecord | None:
    """The release record (:class:`~.records.ReleaseRecord`), or None when there is none or it is
    not one (garbage, a link: the grant that reads it then says 0). Never raises OSError."""
    raw, problem = read_small_file(dir_fd, RELEASE_FILE)
    if raw is None:
        if problem:
            warn_once(f"release: {problem}", "ignoring the arena's release record: %s", problem)
        return None
    return parse_release(raw)


def parse_holder(raw: bytes) -> HolderRecord | None:
    """A holder record from its JSON, or None unless every field is sane (a model id, a pid in
    range, finite times)."""
    data = _owned_record(raw)
    if data is None:
        return None
    pinned = data.get("pinned", False)
    since_f, since_monotonic_f = _finite(data.get("since")), _finite(data.get("since_monotonic"))
    if not isinstance(pinned, bool) or since_f is None or since_monotonic_f is None:
        return None
    return HolderRecord(
        model=data["model"], pid=data["pid"], since=since_f, since_monotonic=since_monotonic_f, pinned=pinned
    )


def parse_release(raw: bytes) -> ReleaseRecord | None:
    """A release record from its JSON, or None unless every field is sane (a model id, a pid in
    range, a finite, non-negative release time)."""
    data = _owned_record(raw)
    if data is None:
        return None
    release_ms, at = _finite(data.get("release_ms")), _finite(data.get("at"))
    if release_ms is None or release_ms < 0 or at is None:
        return None
    return ReleaseRecord(model=data["model"], pid=data["pid"], release_ms=release_ms, at=at)


def _owned_record(raw: bytes) -> dict[str, Any] | None:
    """A record's JSON object when it names a sane owner (a model id, a pid in range), else None."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    model, pid = data.get("model"), data.get("pid")
    if not (isinstance(model, str) and RECORD_MODEL_RE.match(model)):
        return None
    if not (type(pid) is int and 0 < pid <= MAX_PID):
        return None
    return data


def _finite(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def file_kind(mode: int) -> str:
    """What a directory entry is, for messages: "a directory", "a symbolic link"..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device node"


_warned: set[str] = set()


def warn_once(key: str, msg: str, *args: object) -> None:
    """Log a warning the first time ``key`` comes up in this process (a bad entry is looked at
    many times a second by some callers)."""
    if key in _warned:
        log.debug(msg, *args)
        return
    if len(_warned) > 1000:
        _warned.clear()
    _warned.add(key)
    log.warning(msg, *args)
