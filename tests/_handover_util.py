"""Helpers of the hand-over tests (tests/test_handover*.py): where the memfd chunks of a tag are
in ``/proc``, line-driven helper processes, the test's own holder connection."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.arena.handover import read_state

CHUNK = 1 << 20
WORKER = str(Path(__file__).with_name("_handover_worker.py"))
WAIT_S = 15.0  # waits for an event (a process's exit seen by the holder), never a timing check


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


# ---- /proc: where the memfd chunks of a tag are --------------------------------------------


def memfd_fds(tag: str) -> dict[int, set[int]]:
    """pid -> inodes of the tag's memfds it holds an fd of."""
    name = f"/memfd:timeshare-chunk-{tag} (deleted)"
    out: dict[int, set[int]] = {}
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit():
            continue
        fd_dir = f"/proc/{pid_s}/fd"
        try:
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    if os.readlink(f"{fd_dir}/{fd}") == name:
                        out.setdefault(int(pid_s), set()).add(os.stat(f"{fd_dir}/{fd}").st_ino)
        except OSError:
            continue
    return out


def memfd_maps(tag: str) -> dict[int, set[int]]:
    """pid -> inodes of the tag's memfds it has mapped."""
    name = f"/memfd:timeshare-chunk-{tag}"
    out: dict[int, set[int]] = {}
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit():
            continue
        try:
            with open(f"/proc/{pid_s}/maps") as f:
                for line in f:
                    if name in line:
                        out.setdefault(int(pid_s), set()).add(int(line.split()[4]))
        except OSError:
            continue
    return out


def alive(pid: int) -> bool:
    """``pid`` runs (not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def shared_between(maps: dict[int, set[int]]) -> set[int]:
    """Inodes mapped by more than one pid."""
    seen: dict[int, int] = {}
    for inodes in maps.values():
        for i in inodes:
            seen[i] = seen.get(i, 0) + 1
    return {i for i, n in seen.items() if n > 1}


# ---- processes ----------------------------------------------------------------------------


class Worker:
    """A line-driven helper process: the stand-in worker (tests/_handover_worker.py) by default."""

    def __init__(self, arena: Path, tag: str, script: str = "", *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, script or WORKER, str(arena), tag, str(CHUNK), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = self._line()
        assert first.startswith("ready"), first
        self.pid = self.proc.pid

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"worker {self.proc.pid} ended (rc {self.proc.wait()})")
        return line.strip()

    def __call__(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._close_pipes()

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=WAIT_S) == 0
        self._close_pipes()

    def discard(self) -> None:
        """After a test: a process still running (stopped by SIGSTOP or not) is killed; its pipes
        are closed either way."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


_clients: list[HandoverClient] = []


# ---- the fixtures' bodies (each test module makes them fixtures: ``pytest.fixture(name=...)``) --


def new_tag() -> str:
    """A tag of the test's own (its memfd chunks are named after it)."""
    return secrets.token_hex(4)


def arena_dir(tmp_path: Path) -> Iterator[Path]:
    """The test's arena folder; after the test, a holder it left (a test that failed half-way)
    is killed."""
    path = tmp_path / "arena"
    yield path
    state = None
    if path.exists():
        fd = os.open(path, os.O_RDONLY)
        state = read_state(fd)
        os.close(fd)
    if state is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGKILL)


def worker_list() -> Iterator[list[Worker]]:
    """The workers a test starts (it appends them); each discarded after the test."""
    made: list[Worker] = []
    yield made
    for w in made:
        w.discard()


def clients_closed() -> Iterator[None]:
    """After each test, the connections :func:`observer` made are closed."""
    yield
    close_clients()


def close_clients() -> None:
    """Close the connections :func:`observer` made (after each test)."""
    while _clients:
        _clients.pop().close()


def observer(arena: Path, idle_s: float = 600.0, chunk: int = CHUNK) -> HandoverClient:
    """The test's own connection (it keeps the holder alive and reads its status); the first
    connection starts the holder, with this chunk size and idle time."""
    client = HandoverClient(arena, "observer", chunk_bytes=chunk, idle_s=idle_s)
    _clients.append(client)
    client.connect()
    return client
