"""Full disks: how much room a folder's disk has, and the one sentence that says which is full.

``timeshare serve`` checks its folders before it writes anything (``check_room``) and turns a
write that still fails for lack of space (a race, a quota) into a :class:`DiskFullError` naming
the file (``disk_full_error``). The workers' own writes (KV snapshots, logs) fail their model with
that sentence; see the pool for the retry once there is room again. Nothing here imports Qt.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path

from .errors import DiskFullError
from .util.units import human_bytes

#: the errors that say the disk (or the user's quota on it) is full
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: room a folder must have for `serve` to start: the lock, the address file, a few log lines
MIN_FREE_BYTES = 1024 * 1024


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a write refused for lack of space."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DiskFullError):
            return True
        if isinstance(current, OSError) and current.errno in NO_SPACE_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged process may still write on ``folder``'s disk (statvfs f_bavail)."""
    st = os.statvfs(_existing(folder))
    return int(st.f_bavail) * int(st.f_frsize)


def _existing(folder: Path) -> Path:
    """``folder`` or its nearest existing parent (a folder not created yet lives on its disk)."""
    current = folder
    while not current.exists() and current.parent != current:
        current = current.parent
    return current


def check_room(folders: Mapping[str, Path], need: int = MIN_FREE_BYTES) -> None:
    """Raise DiskFullError for the first folder (by its role, e.g. "runtime dir") whose disk has
    less than ``need`` bytes free. A folder whose disk cannot be asked is left to the writes."""
    for role, folder in folders.items():
        try:
            free = free_bytes(folder)
        except OSError:
            continue
        if free < need:
            left = human_bytes(free, empty="0 B")
            raise DiskFullError(
                f"The disk holding the {role} {folder} is full ({left} free; Timeshare needs at "
                f"least {human_bytes(need)} there): free some space and start again.",
                path=folder,
            )


def disk_full_error(exc: OSError, what: str, path: Path | str) -> DiskFullError:
    """The DiskFullError for a write of ``what`` (e.g. "the instance lock") to ``path`` that
    failed with ``exc`` (ENOSPC or EDQUOT)."""
    full = "the disk quota is used up" if exc.errno == errno.EDQUOT else "the disk is full"
    error = DiskFullError(
        f"Cannot write {what} ({path}): {full}. Free some space on that disk and start again.",
        path=Path(path),
    )
    error.__cause__ = exc
    return error
