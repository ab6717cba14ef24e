"""The API address file: where a running instance's API listens, written by the server and read by
the CLI (``paths.api_address_file()``, mode 0600).

JSON: ``{"url": "http://127.0.0.1:8385", "pid": 1234, "key_required": false, "started": 1712345678.9}``;
only ``url`` is required when reading. Nothing here imports the server (the CLI stays light).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..atomic import atomic_write_text


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
    def read(cls, path: Path | None = None) -> ApiAddress:
        """The recorded address. FileNotFoundError when there is none; ValueError, whose message
        says what is wrong ("the file is unreadable: ...", "the file does not hold a URL"), when the
        file cannot be used."""
        target = path or paths.api_address_file()
        try:
            record = json.loads(target.read_text())
        except FileNotFoundError:
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
