"""Worker processes: the environment they inherit, starting, signalling and reaping them, their logs."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .. import envvars
from ..errors import FrameError
from ..wire import protocol

log = logging.getLogger(__name__)

#: environment variables a worker inherits (everything else is dropped)
_ENV_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "LD_LIBRARY_PATH", "VIRTUAL_ENV"}
)
_ENV_PREFIXES = ("LC_", "XDG_", "TIMESHARE_", "CUDA_", "HIP_", "GGML_")
_LOG_TAIL_LINES = 30
_LOG_LIMIT = 4 << 20  # bytes of a worker's log before it is rotated


def clean_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: a whitelist of the app's (locale, paths, GPU runtime knobs)."""
    source = envvars.environment() if environ is None else environ
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


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the worker's process group (its own session: pgid == pid). Nothing once the worker
    was reaped: its pid, and so the group id, may belong to someone else by then."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except OSError as exc:
        if exc.errno not in (errno.ESRCH, errno.EPERM):
            raise


def spawn_worker(
    argv: Sequence[str], spec_json: str, log_path: Path, model_id: str
) -> tuple[subprocess.Popen[bytes], protocol.Connection]:
    """Start a worker: ``argv --spec JSON --ipc-fd N`` in its own session (its process group is
    its own), a clean environment, stderr to its log. Returns the process and the pool's end of
    the socketpair. Raises OSError."""
    _rotate_log(log_path)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with log_path.open("ab") as logf:
            logf.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting worker for {model_id}\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                [*argv, "--spec", spec_json, "--ipc-fd", str(child.fileno())],
                pass_fds=(child.fileno(),),
                start_new_session=True,
                env=clean_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=logf,
                close_fds=True,
            )
    except OSError:
        parent.close()
        raise
    finally:
        child.close()
    return proc, protocol.Connection(parent)


def read_worker(
    model_id: str,
    conn: protocol.Connection,
    proc: subprocess.Popen[bytes],
    grace_s: float,
    on_message: Callable[[object], None],
    on_exit: Callable[[int], None],
) -> None:
    """A reader thread's body, one per worker process: hand over every message, then the exit
    status once the process is reaped (its process group killed first)."""
    while True:
        try:
            msg = conn.recv()
        except FrameError as exc:
            log.warning("%s: %s", model_id, exc)
            if exc.recoverable:
                continue
            break
        except OSError as exc:
            log.warning("%s: connection lost: %s", model_id, exc)
            break
        if msg is None:
            break
        on_message(msg)
    if not _wait(proc, grace_s):
        # it closed (or broke) the connection but keeps running: it cannot be talked to any more
        log.warning("%s: worker closed its connection but did not exit: killing it", model_id)
    # the exited leader is not reaped yet, so its process group id is still ours: take any
    # process the worker left behind, then reap
    signal_group(proc, signal.SIGKILL)
    on_exit(proc.wait())


def end_processes(procs: Sequence[tuple[str, subprocess.Popen[bytes]]], timeout: float) -> None:
    """After Shutdown was sent to each: wait, SIGTERM the groups still there, wait, then SIGKILL
    every group (that also takes any child a worker left behind) and reap."""
    deadline = time.monotonic() + timeout * 0.6
    for _, proc in procs:
        _wait(proc, deadline - time.monotonic())
    for model_id, proc in procs:
        if not _exited(proc):
            log.warning("%s did not exit after Shutdown: SIGTERM to its process group", model_id)
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout * 0.3
    for _, proc in procs:
        _wait(proc, deadline - time.monotonic())
    for model_id, proc in procs:
        if not _exited(proc):
            log.warning("%s ignored SIGTERM: SIGKILL to its process group", model_id)
        signal_group(proc, signal.SIGKILL)
        proc.wait()
