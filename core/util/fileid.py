"""Which file a path names, and whether it changed: device, inode, size and modification time."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class FileId:
    """A file's identity on disk; a replaced file (an atomic rename, a re-download) or one written
    to since (size or modification time) compares unequal."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileId:
        """The identity of the file ``path`` names now; raises OSError when there is none."""
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
