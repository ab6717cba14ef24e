"""Process checks the tests share."""

from __future__ import annotations

import ctypes
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


def _statm(pid: int | str, field: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return 0
    return int(fields[field]) * os.sysconf("SC_PAGE_SIZE")


def rss_of(pid: int | str = "self") -> int:
    """Resident set size in bytes, from /proc/<pid>/statm (the kernel's figure, not Timeshare's);
    0 once the process is gone."""
    return _statm(pid, 1)


def vm_size_of(pid: int | str = "self") -> int:
    """Virtual memory size in bytes (mapped, resident or not), from /proc/<pid>/statm; 0 once the
    process is gone."""
    return _statm(pid, 0)


def resident_in(ranges: list[tuple[int, int]]) -> int:
    """Resident bytes of this process's pages inside the address ranges ``(start, size)``, page by
    page from mincore(2) (the kernel's count, restricted to those ranges: a free elsewhere in the
    process, by another thread or the garbage collector, does not change it); a page no longer
    mapped counts 0."""
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for start, size in ranges:
        lo = start - start % page
        pages = (start + size - lo + page - 1) // page
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(lo, pages * page, vec) == 0:
            total += sum(b & 1 for b in vec.raw)
            continue
        for i in range(pages):  # partly unmapped (ENOMEM): each page on its own
            one = ctypes.create_string_buffer(1)
            if libc.mincore(lo + i * page, page, one) == 0:
                total += one.raw[0] & 1
    return total * page


def lease_holders(arena_dir: Path) -> set[int]:
    """The pids holding a lease of the arena (the token, under a one-model budget): an exclusive
    ``flock`` on a file in ``<arena>/leases/``, read from /proc/locks, not from Timeshare's records."""
    try:
        inodes = {p.stat().st_ino for p in (arena_dir / "leases").iterdir()}
    except OSError:
        return set()
    holders: set[int] = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        # "3: FLOCK  ADVISORY  WRITE 1234 fe:00:2146417 0 EOF" (blocked requests have "->" in [1])
        granted = len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "WRITE"
        if granted and int(fields[5].rsplit(":", 1)[1]) in inodes:
            holders.add(int(fields[4]))
    return holders


class ResidencyWatch:
    """A thread that samples, every ``interval_s``, who holds a lease (before and after) and each
    worker's RSS; ``check`` finds the samples where a worker's RSS was high (above its own minimum
    plus half its weights) while it held no lease: weights kept without the token."""

    def __init__(self, arena_dir: Path, pids: dict[str, int], interval_s: float = 0.002) -> None:
        import threading

        self.arena_dir = arena_dir
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.samples: list[tuple[set[int], dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="residency-watch", daemon=True)

    def __enter__(self) -> ResidencyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            before = lease_holders(self.arena_dir)
            rss = {key: rss_of(pid) for key, pid in self.pids.items()}
            after = lease_holders(self.arena_dir)
            self.samples.append((before | after, rss))
            time.sleep(self.interval_s)

    def check(self, weight_bytes: dict[str, int]) -> tuple[list[str], dict[str, bool]]:
        """(violations, high_seen per worker). A worker gone (RSS 0) is left out of its minimum."""
        floor = {
            key: min((rss[key] for _, rss in self.samples if rss[key] > 0), default=0) for key in self.pids
        }
        high_seen = dict.fromkeys(self.pids, False)
        violations: list[str] = []
        for i, (holders, rss) in enumerate(self.samples):
            for key, pid in self.pids.items():
                if rss[key] > floor[key] + weight_bytes[key] // 2:
                    high_seen[key] = True
                    if pid not in holders:
                        violations.append(f"sample {i}: {key} {rss[key]} B (floor {floor[key]}), no lease")
        return violations, high_seen
