"""Process checks the tests share."""

from __future__ import annotations

import os
from pathlib import Path


def proc_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ("R", "S", "Z", …), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (a zombie is dead for the tests' purpose:
    only its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return proc_state(pid) not in ("Z", "gone")
