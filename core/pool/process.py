"""Worker processes: the environment they inherit, starting, signalling and reaping them, their logs."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

#: environment variables a worker inherits (everything else is dropped)
_ENV_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "LD_LIBRARY_PATH", "VIRTUAL_ENV"}
)
_ENV_PREFIXES = ("LC_", "XDG_", "TIMESHARE_", "CUDA_", "HIP_", "GGML_")
_LOG_TAIL_LINES = 30
_LOG_LIMIT = 4 << 20  # bytes of a worker's log before it is rotated


def clean_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: a whitelist of the app's (locale, paths, GPU runtime knobs)."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}


def read_log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> tuple[str, ...]:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            data = f.read()
    except OSError:
        return ()
    text = data.decode("utf-8", errors="replace").splitlines()
    return tuple(text[-lines:])


def _rotate_log(path: Path, limit: int = _LOG_LIMIT) -> None:
    """Keep one previous log (``.1``) once a worker's log grows past ``limit`` bytes."""
    with contextlib.suppress(OSError):
        if path.stat().st_size > limit:
            os.replace(path, path.with_name(path.name + ".1"))


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the process has exited, without reaping it (a zombie keeps its process group id
    reserved, so the group can still be signalled safely)."""
    if proc.returncode is not None:
        return True
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile by another thread's wait()
        return True
    return info is not None


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the process to exit, without reaping it."""
    deadline = time.monotonic() + max(0.0, timeout)
    while not _exited(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the worker's process group (its own session: pgid == pid). Nothing once the worker
    was reaped: its pid, and so the group id, may belong to someone else by then."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except OSError as exc:
        if exc.errno not in (errno.ESRCH, errno.EPERM):
            raise
