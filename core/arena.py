"""The VRAM arena: one GPU token that worker processes pass between them.

Layout of an arena directory (mode 0700, owned by the user, never reached through a symlink):

    token        the token: whoever holds an exclusive ``flock`` on it may have weights on the GPU
    holder       JSON record of the holder (model, pid, since, pinned), written atomically by it
    seq          ticket counter, incremented under ``flock``
    waiters/     one ticket file per process that wants the token: ``<seq>-<pid>-<model>``

Why tickets: ``flock`` is not FIFO (a holder may re-take the lock it just dropped) and dropping it
makes no inotify event. So a waiter takes a ticket (the counter is bumped and the ticket file is
created under the counter's lock, so ticket order is creation order); only the head of the queue
calls ``flock``, the others watch ``waiters/`` until every ticket ahead of theirs is gone. The head
removes its ticket once it holds the token, which lets the next one in.

Liveness: each ticket file is ``flock``-ed by its owner for as long as it waits (the lock is taken
on a temporary name before the file is renamed into ``waiters/``, so it is never seen unlocked).
A ticket whose lock anyone can take belongs to a dead process and is swept by whoever scans.
The kernel drops the token's lock when its holder dies, so a crash never wedges the arena; a
holder record whose pid is dead is ignored by :func:`read_holder`.

The doorbell: the holder watches ``waiters/`` (inotify IN_CREATE, IN_MOVED_TO, IN_DELETE,
IN_MOVED_FROM, IN_Q_OVERFLOW; a rescan right after adding the watch and every
``RESCAN_INTERVAL_S``) and rings a callback when another process waits, and again every
``RING_REPEAT_S`` for as long as anyone waits (level-triggered, so a dropped ring is not a lost
waiter). Where inotify does not exist (or cannot be set up) the same protocol runs by polling
the directory.

Threads: a :class:`TokenClient` waits for the token on a helper thread (the worker's loop thread
stays free for status and cancel) and watches the doorbell on a warden thread; both only call
back, they never touch anything of the worker's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import select
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from . import paths
from .errors import ArenaError, CancelledError, TokenTimeoutError

log = logging.getLogger(__name__)

TOKEN_FILE = "token"
HOLDER_FILE = "holder"
SEQ_FILE = "seq"
WAITERS_DIR = "waiters"

#: how often waiters and the doorbell rescan ``waiters/`` even without an event (a ticket created
#: before the watch existed, a waiter killed with -9: its file does not go away by itself)
RESCAN_INTERVAL_S = 0.5
#: while this client holds the token and someone waits, the doorbell rings again this often
RING_REPEAT_S = 0.2
#: directory polling period of the polling backend
POLL_INTERVAL_S = 0.02

Backend = Literal["auto", "inotify", "poll"]

_MODEL_ID_RE = re.compile(r"^[A-Za-z0-9._#+@=-]{1,120}$")
_TICKET_RE = re.compile(r"^(\d{1,20})-(\d{1,10})-(.+)$")
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeArenaError(ArenaError):
    """The arena directory cannot be trusted (owner, mode, symlink) or used (not a directory)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"refusing the arena directory {path}: {reason}. Use a directory only you own and only you "
            f"can write (chmod 700), or point TIMESHARE_VRAM_ARENA or arena.dir in the config elsewhere."
        )


# ---- records ---------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Ticket:
    """A place in the queue for the token. Order is the order of ``seq``."""

    seq: int
    pid: int
    model: str

    @property
    def name(self) -> str:
        return f"{self.seq:012d}-{self.pid}-{self.model}"

    @classmethod
    def parse(cls, name: str) -> Ticket | None:
        match = _TICKET_RE.match(name)
        if not match:
            return None
        return cls(int(match.group(1)), int(match.group(2)), match.group(3))


@dataclass(frozen=True)
class HolderRecord:
    """Who holds the GPU token. ``since`` is wall-clock (for people), ``since_monotonic`` is
    ``time.monotonic()`` of the holder (CLOCK_MONOTONIC: comparable across processes on Linux)."""

    model: str
    pid: int
    since: float
    since_monotonic: float
    pinned: bool = False

    def describe(self) -> str:
        return f"pinned by {self.model}" if self.pinned else f"held by {self.model}"


@dataclass(frozen=True)
class TokenGrant:
    """The token was acquired. ``handoff`` is True when another process held it or was ahead in the
    queue when it was requested (``wait_ms`` then measures doorbell rung → token acquired)."""

    model: str
    requested_at: float
    acquired_at: float
    handoff: bool
    previous: str | None  # model that held the token when it was requested

    @property
    def wait_ms(self) -> float:
        return (self.acquired_at - self.requested_at) * 1000.0


@dataclass(frozen=True)
class DoorbellRing:
    """Other processes wait for the token this client holds (or is about to hold)."""

    waiters: tuple[Ticket, ...]
    at: float  # time.monotonic() of the scan that saw them


# ---- directory safety ------------------------------------------------------------------------


def resolve_arena_dir(configured: str | None = None) -> Path:
    """The arena directory: ``$TIMESHARE_VRAM_ARENA``, else ``arena.dir`` from the config, else the
    default under the user's runtime dir."""
    if os.environ.get("TIMESHARE_VRAM_ARENA") or not configured:
        path = paths.default_arena_dir()
    else:
        path = Path(configured).expanduser()
    return Path(os.path.abspath(path))


def _check_dir_stat(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeArenaError(path, "it is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeArenaError(path, "it is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeArenaError(path, f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafeArenaError(path, f"it is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})")


def _check_ancestors(path: Path) -> None:
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


def _open_checked_dir(path: Path, *, create: bool, dir_fd: int | None = None, name: str | None = None) -> int:
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
        fd = os.open(target, _O_DIR, dir_fd=dir_fd)
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


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(path: str | os.PathLike[str] | None = None) -> HolderRecord | None:
    """The current holder record, or None when nobody holds the token (or its holder died).
    Reads only; never creates the arena."""
    base = Path(os.path.abspath(path)) if path is not None else resolve_arena_dir()
    try:
        dir_fd = os.open(base, _O_DIR)
    except OSError:
        return None
    try:
        return _read_holder_at(dir_fd)
    finally:
        os.close(dir_fd)


def _read_holder_at(dir_fd: int) -> HolderRecord | None:
    try:
        fd = os.open(HOLDER_FILE, os.O_RDONLY | _O_FILE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
        record = HolderRecord(
            model=str(data["model"]),
            pid=int(data["pid"]),
            since=float(data["since"]),
            since_monotonic=float(data["since_monotonic"]),
            pinned=bool(data.get("pinned", False)),
        )
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring an unreadable holder record: %r", raw[:200])
        return None
    return record if pid_alive(record.pid) else None


# ---- watching a directory --------------------------------------------------------------------


def inotify_available() -> bool:
    try:
        import inotify_simple

        inotify_simple.INotify().close()
    except (ImportError, OSError):
        return False
    return True


class _DirWatch:
    """Wait until a directory may have changed, a timeout passes or someone calls :meth:`wake`.

    Callers rescan after every return: events only say *when* to look, never *what* is there (so a
    queue overflow or a coalesced event cannot lose anything)."""

    def __init__(self, path: Path, backend: Literal["inotify", "poll"]) -> None:
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
                self._inotify.add_watch(str(path), mask)
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


# ---- interval log ----------------------------------------------------------------------------


class IntervalLog:
    """JSON lines appended with O_APPEND (one ``write`` per record, so records from several
    processes never interleave), times on ``time.monotonic()``. The arena-test checker reads it.

    ``record("token" | "resident", start, end, **extra)`` writes
    ``{"kind", "model", "pid", "start", "end", ...extra}``."""

    def __init__(self, path: str | os.PathLike[str], model: str, pid: int | None = None) -> None:
        self.path = Path(path)
        self.model = model
        self.pid = os.getpid() if pid is None else pid

    def record(self, kind: str, start: float, end: float, **extra: object) -> None:
        line = json.dumps(
            {"kind": kind, "model": self.model, "pid": self.pid, "start": start, "end": end, **extra}
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def read_intervals(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of an interval log (a torn last line from a killed process is skipped)."""
    out: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


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
        interval_log: IntervalLog | None = None,
        pinned: bool = False,
    ) -> None:
        if not _MODEL_ID_RE.match(model):
            raise ArenaError(
                f"model id {model!r} cannot name an arena ticket: use letters, digits and ._#+@=-"
            )
        self.arena = arena
        self.model = model
        self.interval_log = interval_log
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
            self.arena._remove_holder()
            end = time.monotonic()
            if self.interval_log is not None and grant is not None:
                try:
                    self.interval_log.record(
                        "token",
                        grant.acquired_at,
                        end,
                        requested=grant.requested_at,
                        handoff=grant.handoff,
                        previous=grant.previous,
                    )
                except OSError as exc:
                    log.warning("could not write the interval log %s: %s", self.interval_log.path, exc)
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
