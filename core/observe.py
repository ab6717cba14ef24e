"""What a harness may observe of the product: a narrow interface that product code calls and
diagnostics implement or read. Product code never imports :mod:`.diagnostics`.

Product code reports through an :class:`Observer`:

- a worker's :class:`~.arena.client.TokenClient` records each ``"token"`` interval (acquired →
  released, with ``requested``, ``handoff`` and ``previous``);
- a worker's :class:`~.worker.tenancy.ArenaTenancy` records each ``"resident"`` interval
  (restore or load started → release finished);
- the TokenClient also records an ``"acquired"`` point (start == end == the moment the token was
  taken, with ``requested``) as it takes the token, so a holder killed before it could release
  leaves the start of its last interval behind;
- the pool's hung-holder watchdog records a ``"killed"`` point (``by="watchdog"``, ``reason``) in
  the pool's event log just before it sends SIGKILL to a worker, under the worker's model and pid.
  A harness that kills workers itself writes the same record (``by="harness"``). The kernel drops
  a dead holder's lock only once it is dead, so "acquired → killed" is a lower bound of the
  interval the killed process held the token.

The default observer does nothing. The observed events happen in worker processes, which a harness
cannot hand an object to, so the one implementation product code builds by itself is
:class:`EventLog`: JSON lines appended to a file that the worker's spec names (``event_log``; the
pool passes its own ``event_log`` argument to every worker). A harness (``timeshare arena-test``,
the tests) names the file, reads it back with :func:`read_events` and checks what it needs. Times
are ``time.monotonic()`` (one clock for every process on the machine).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol


class Observer(Protocol):
    """Receives intervals of what a worker did: ``kind`` names it, ``start`` <= ``end``."""

    def record(self, kind: str, start: float, end: float, **extra: object) -> None: ...


class NullObserver:
    """Observes nothing (the product's default)."""

    def record(self, kind: str, start: float, end: float, **extra: object) -> None:
        return None


NULL_OBSERVER = NullObserver()


class EventLog:
    """An :class:`Observer` that appends JSON lines with ``O_APPEND`` (one ``write`` per record, so
    records from several processes never interleave).

    ``record(kind, start, end, **extra)`` writes ``{"kind", "model", "pid", "start", "end", ...extra}``.
    Raises OSError when the file cannot be written; callers log it and go on."""

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


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of an :class:`EventLog` (a torn last line from a killed process is skipped)."""
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
