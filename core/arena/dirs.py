"""Directory safety: where the arena lives, the checks that make it trustworthy, reading the holder."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
from pathlib import Path

from .. import paths
from ..errors import UnsafeArenaError
from .records import HOLDER_FILE, MAX_PID, O_DIR, O_FILE, RECORD_MODEL_RE, HolderRecord

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
    try:
        fd = os.open(HOLDER_FILE, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=dir_fd)
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
        raw = os.read(fd, 1 << 16)
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror})"
    finally:
        os.close(fd)
    record = parse_holder(raw)
    if record is None:
        return None, f"it is not a holder record ({raw[:80]!r})"
    return record, ""


def parse_holder(raw: bytes) -> HolderRecord | None:
    """A holder record from its JSON, or None unless every field is sane (a model id, a pid in
    range, finite times)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    model, pid, pinned = data.get("model"), data.get("pid"), data.get("pinned", False)
    since, since_monotonic = data.get("since"), data.get("since_monotonic")
    if not (isinstance(model, str) and RECORD_MODEL_RE.match(model)):
        return None
    if not (type(pid) is int and 0 < pid <= MAX_PID) or not isinstance(pinned, bool):
        return None
    since_f, since_monotonic_f = _finite(since), _finite(since_monotonic)
    if since_f is None or since_monotonic_f is None:
        return None
    return HolderRecord(model=model, pid=pid, since=since_f, since_monotonic=since_monotonic_f, pinned=pinned)


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
