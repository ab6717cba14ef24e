"""Atomic file writes: a crash leaves either the old file or the new one, whole."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_text(target: Path, text: str, *, backup: bool = True, mode: int = 0o600) -> None:
    """Write ``text`` to ``target`` so that a crash leaves either the old or the new file, whole.

    A temp file in the same folder is written and fsynced, then renamed over the target. With
    ``backup``, the previous version is kept as ``<name>.bak`` (itself replaced atomically).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    if backup and target.is_file():
        fd, bak_tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".bak-tmp")
        os.close(fd)
        try:
            shutil.copy2(target, bak_tmp)
            os.replace(bak_tmp, target.with_name(target.name + ".bak"))
        finally:
            if os.path.exists(bak_tmp):
                os.unlink(bak_tmp)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(target.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
