"""The API address file: where a running instance's API listens, written by the server and read by
the CLI (``paths.api_address_file()``, mode 0600).

JSON: ``{"url": "http://127.0.0.1:8385", "pid": 1234, "key_required": false, "started": 1712345678.9}``;
only ``url`` is required when reading. Nothing here imports the server (the CLI stays light).

``read(trusted_only=True)`` (the CLI, which may send the API key to the address) reads the file
only when it and the runtime dir belong to this user and neither is group- or world-writable (in a
shared /tmp another user could plant one), and never through a symbolic link.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import UntrustedAddressError
from ..util.atomic import atomic_write_text


@dataclass(frozen=True)
class ApiAddress:
    url: str  # base URL, e.g. http://127.0.0.1:8385
    key_required: bool = False  # clients must send ``Authorization: Bearer <api.key>``
    pid: int | None = None  # the process that serves it (None: unknown)
    started: float | None = None  # time.time() when it was written

    @classmethod
    def this_process(cls, url: str, key_required: bool) -> ApiAddress:
        """The address of an API this process serves, as of now."""
        return cls(url, key_required, os.getpid(), time.time())

    def write(self, path: Path | None = None) -> Path:
        """Record this address (atomically, mode 0600); returns the file written."""
        target = path or paths.api_address_file()
        record = {
            "url": self.url,
            "pid": self.pid,
            "key_required": self.key_required,
            "started": self.started,
        }
        atomic_write_text(target, json.dumps(record) + "\n", backup=False, mode=0o600)
        return target

    @classmethod
    def read(cls, path: Path | None = None, *, trusted_only: bool = False) -> ApiAddress:
        """The recorded address. FileNotFoundError when there is none; ValueError, whose message
        says what is wrong ("the file is unreadable: ...", "the file does not hold a URL"), when the
        file cannot be used; with ``trusted_only``, UntrustedAddressError when the file or its
        folder is not this user's own (see the module's docstring)."""
        target = path or paths.api_address_file()
        try:
            text = _read_trusted(target) if trusted_only else target.read_text()
            record = json.loads(text)
        except (FileNotFoundError, UntrustedAddressError):
            raise
        except (OSError, ValueError) as exc:
            raise ValueError(f"the file is unreadable: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("url"), str):
            raise ValueError("the file does not hold a URL")
        pid = record.get("pid")
        started = record.get("started")
        return cls(
            url=record["url"],
            key_required=bool(record.get("key_required")),
            pid=pid if isinstance(pid, int) else None,
            started=float(started) if isinstance(started, (int, float)) else None,
        )

    def remove(self, path: Path | None = None) -> None:
        """Remove the address file if it still records this address (a newer instance may have
        replaced it)."""
        target = path or paths.api_address_file()
        try:
            current = ApiAddress.read(target)
        except (OSError, ValueError):
            return
        if current.pid == self.pid and current.url == self.url:
            with contextlib.suppress(OSError):
                target.unlink()


def _untrusted(path: Path, what: str, why: str) -> UntrustedAddressError:
    return UntrustedAddressError(
        f"Not using the API address in {path}: {what} {why}, so another user could have written "
        "it. Make it yours and private (chmod 700 the folder, 600 the file), or give the address "
        "with --url."
    )


def _check_private(st: os.stat_result, path: Path, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise _untrusted(path, what, f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _untrusted(path, what, f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def _read_trusted(target: Path) -> str:
    """The file's text, when it and its folder are this user's own and private."""
    folder = target.parent
    st = os.lstat(folder)  # FileNotFoundError: no runtime dir, so no address
    if stat.S_ISLNK(st.st_mode):
        _check_private(st, folder, "the runtime dir (a symbolic link)")
        st = os.stat(folder)
    _check_private(st, folder, "the runtime dir")
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _untrusted(target, "the file", "is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _untrusted(target, "the file", "is not a regular file")
        _check_private(st, target, "the file")
        return f.read(64 * 1024).decode("utf-8")
