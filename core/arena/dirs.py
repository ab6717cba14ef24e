"""Directory safety: where the arena lives, the checks that make it trustworthy, reading the holder."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path

from .. import paths
from ..errors import UnsafeArenaError
from .records import _O_DIR, _O_FILE, HOLDER_FILE, HolderRecord

log = logging.getLogger(__name__)


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
