"""Token and residency intervals on the monotonic clock, appended to a JSON-lines file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# ---- interval log ----------------------------------------------------------------------------


class IntervalLog:
    """JSON lines appended with O_APPEND (one ``write`` per record, so records from several
    processes never interleave), times on ``time.monotonic()``. The arena-test checker reads it.

    ``record("token" | "resident", start, end, **extra)`` writes
    ``{"kind", "model", "pid", "start", "end", ...extra}``."""

    def __init__(self, path: str | os.PathLike[str], model: str, pid: int | None = None) -> None:
        self.path = Path(path)
        self.model = model
        self.pid = os.getpid() if pid is None else pid

    def record(self, kind: str, start: float, end: float, **extra: object) -> None:
        line = json.dumps(
            {"kind": kind, "model": self.model, "pid": self.pid, "start": start, "end": end, **extra}
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def read_intervals(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of an interval log (a torn last line from a killed process is skipped)."""
    out: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out
