"""Process checks the tests share."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
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


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it is true (bounded; a failure names what never happened). The
    synchronisation the tests use instead of sleeping; never a timing assertion."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.01)
    if predicate():
        return
    raise AssertionError(f"timed out after {timeout:g} s waiting for: {what}")


def blocked_flocks(path: str | os.PathLike[str], pid: int | None = None) -> int:
    """How many flock requests of process ``pid`` (default: this one) are blocked in the kernel
    waiting for the lock on ``path`` (the "->" entries of /proc/locks for its inode): proof that a
    thread is inside a blocking flock(2), not merely about to call it."""
    st = os.stat(path)
    want_pid = os.getpid() if pid is None else pid
    count = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) < 7 or fields[1] != "->" or fields[2] != "FLOCK":
            continue
        # "1: -> FLOCK  ADVISORY  WRITE 1234 fe:00:2146417 0 EOF"
        if int(fields[5]) == want_pid and int(fields[6].rsplit(":", 1)[1]) == st.st_ino:
            count += 1
    return count


def thread_wchan(native_id: int) -> str:
    """The kernel function the thread ``native_id`` of this process sleeps in
    (/proc/self/task/<tid>/wchan: "0" while it runs), or "" when it is gone."""
    try:
        return Path(f"/proc/self/task/{native_id}/wchan").read_text().strip()
    except OSError:
        return ""


def workers_of(home: Path) -> list[int]:
    """The live worker processes (``-m timeshare.core.worker``) whose spec names a path under
    ``home`` (their kv_dir is in it), found in /proc, not asked of Timeshare."""
    found: list[int] = []
    needle = str(home).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"timeshare.core.worker" in argv and any(needle in a for a in argv) and alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)
