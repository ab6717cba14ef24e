"""One Timeshare per runtime dir: the instance lock.

``timeshare serve`` and the tray app each hold an exclusive ``flock`` on ``instance.lock`` in the
runtime dir (``paths.runtime_dir()``; ``TIMESHARE_HOME`` moves it) for their whole lifetime. The
kernel drops the lock when the process dies, however it dies, so a crashed instance never blocks
the next one. The holder writes ``{"pid", "kind", "started"}`` into the file, so a refused second
instance can say who runs (its API URL comes from the address file, when that records the same
pid). The file itself stays: removing a lock file races with the next instance opening it.

Instances with different runtime dirs are independent. Nothing here imports Qt or the pool.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .api.address import ApiAddress
from .diskspace import NO_SPACE_ERRNOS, disk_full_error
from .errors import InstanceRunningError

LOCK_NAME = "instance.lock"

#: what runs, as the messages name it
KIND_NAMES = {"serve": "`timeshare serve`", "tray": "the Timeshare tray app"}


def lock_file(directory: Path | None = None) -> Path:
    return (directory or paths.runtime_dir()) / LOCK_NAME


@dataclass(frozen=True)
class InstanceInfo:
    """The instance that holds the lock, as far as its files tell."""

    runtime_dir: Path
    pid: int | None  # None: the holder has not written its record yet
    kind: str  # "serve" | "tray" | "" (unknown)
    url: str | None  # its API, from the address file (None: no API, or not listening yet)

    def who(self) -> str:
        """'`timeshare serve` (pid 1234)'"""
        who = KIND_NAMES.get(self.kind, "Timeshare")
        return who + (f" (pid {self.pid})" if self.pid is not None else "")

    def describe(self) -> str:
        """'`timeshare serve` (pid 1234), API at http://127.0.0.1:8385'"""
        return self.who() + (f", API at {self.url}" if self.url else ", no API address recorded")

    def refusal(self) -> str:
        """The sentence a second instance prints before it exits."""
        return (
            f"Timeshare is already running for {self.runtime_dir}: {self.describe()}. Use that one "
            "(`timeshare status`), stop it first, or set TIMESHARE_HOME to run an independent instance."
        )


def _read_info(path: Path) -> InstanceInfo:
    directory = path.parent
    pid: int | None = None
    kind = ""
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        record = {}
    if isinstance(record, dict):
        if isinstance(record.get("pid"), int):
            pid = record["pid"]
        if isinstance(record.get("kind"), str):
            kind = record["kind"]
    url = None
    try:
        address = ApiAddress.read(directory / paths.api_address_file().name)
    except (OSError, ValueError):
        address = None
    if address is not None and (pid is None or address.pid in (None, pid)):
        url = address.url
    return InstanceInfo(directory, pid, kind, url)


class InstanceLock:
    """The held lock. ``acquire`` raises InstanceRunningError (with ``.info``) when another
    instance holds it; ``release`` (or the process's death) lets the next one start."""

    def __init__(self, fd: int, path: Path, kind: str) -> None:
        self._fd: int | None = fd
        self.path = path
        self.kind = kind

    @classmethod
    def acquire(cls, kind: str, directory: Path | None = None) -> InstanceLock:
        path = lock_file(directory)
        # O_CLOEXEC (Python's default): the workers this instance spawns never inherit the lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = _read_info(path)
            raise InstanceRunningError(info.refusal(), kind=info.kind, pid=info.pid, url=info.url) from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps({"pid": os.getpid(), "kind": kind, "started": time.time()}) + "\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
        except OSError as exc:
            os.close(fd)  # drops the lock: nobody runs
            if exc.errno in NO_SPACE_ERRNOS:
                raise disk_full_error(exc, "the instance lock", path) from exc
            raise
        return cls(fd, path, kind)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # the next reader sees no stale pid
        os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> InstanceLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def running_instance(directory: Path | None = None) -> InstanceInfo | None:
    """The instance that holds the lock of this runtime dir, or None when none runs."""
    path = lock_file(directory)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_info(path)
    finally:
        os.close(fd)
    return None
