"""The hung-holder watchdog: a worker of this pool that blocks the GPU while others wait, and does
not answer a status ping for ``arena.hung_holder_s``, is named for the pool to kill and restart.

Blocking the GPU means holding the token (the arena's holder record names its pid; the worker's
own last report where there is no record) while a ticket of another process waits, or holding the
head ticket of the queue while a ticket of another process waits behind it (a stopped head waiter
never calls ``flock``, so nobody behind it ever gets the token).

The ping is the protocol's :class:`~..worker.protocol.StatusRequest`, answered by the worker's
reader thread (not its loop thread). That proves the process runs and its connection works: a
process that is stopped (SIGSTOP, a debugger), frozen or dead answers nothing. It does not prove
the loop thread makes progress: a loop thread inside one long llama call (a prefill of thousands
of tokens on a CPU takes minutes, and calls back nothing meanwhile) is busy, not hung, and must not
be killed; waiters bound such a wait with ``arena.wait_timeout_s``.

Pool thread only. One ping is outstanding per worker at a time, so a stopped worker's socket
buffer never fills with pings (a full buffer would block the pool thread's sends).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..arena.tickets import Arena
from ..errors import ArenaError
from ..worker import protocol
from .record import WorkerRecord

log = logging.getLogger(__name__)


def tick_period(limit_s: float) -> float:
    """How often the watchdog looks: a fifth of the limit, between 0.05 and 1 s (1 s when off)."""
    if limit_s <= 0:
        return 1.0
    return min(1.0, max(0.05, limit_s / 5.0))


@dataclass(frozen=True)
class _Ping:
    req: str
    sent_at: float
    epoch: int  # the worker's spawn the ping went to


class HolderWatchdog:
    """Looks at the arena and pings the workers that block it; :meth:`check` returns the ones to
    kill, with a sentence saying why."""

    def __init__(self) -> None:
        self._arena: Arena | None = None
        self._arena_dir: Path | None = None
        self._pings: dict[str, _Ping] = {}
        self._ids = itertools.count(1)
        self._open_failed = False

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
        self._arena = None
        self._pings.clear()

    def _open(self, arena_dir: Path) -> Arena | None:
        if self._arena is not None and self._arena_dir == arena_dir:
            return self._arena
        self.close()
        try:
            self._arena = Arena(arena_dir)
        except (ArenaError, OSError) as exc:
            if not self._open_failed:
                log.error("the hung-holder watchdog cannot open the arena %s: %s", arena_dir, exc)
            self._open_failed = True
            return None
        self._open_failed = False
        self._arena_dir = arena_dir
        return self._arena

    def answered(self, w: WorkerRecord, req: str) -> None:
        """A StatusReply came from ``w`` (pool thread)."""
        ping = self._pings.get(w.id)
        if ping is not None and ping.req == req and ping.epoch == w.epoch:
            del self._pings[w.id]

    def check(
        self, workers: Iterable[WorkerRecord], arena_dir: Path, limit_s: float
    ) -> list[tuple[WorkerRecord, str]]:
        """Ping each worker that blocks others; return those whose ping has gone unanswered for
        ``limit_s`` seconds while they kept blocking, each with the reason."""
        arena = self._open(arena_dir)
        if arena is None:
            return []
        try:
            tickets = arena.waiters()  # sweeps stale tickets too
            holder = arena.holder()
        except OSError as exc:
            log.warning("the hung-holder watchdog cannot read the arena %s: %s", arena_dir, exc)
            return []
        alive = [w for w in workers if w.alive and w.pid is not None]
        by_pid = {w.pid: w for w in alive}
        blockers: dict[str, tuple[WorkerRecord, str]] = {}
        if holder is not None:
            holder_w = by_pid.get(holder.pid)
        else:  # no record (it could not be written): the workers' own reports
            holder_w = next((w for w in alive if w.status is not None and w.status.holds_token), None)
        if holder_w is not None:
            others = [t for t in tickets if t.pid != holder_w.pid]
            if others:
                blockers[holder_w.id] = (holder_w, f"held the GPU while {others[0].model} waited")
        if tickets:
            head = tickets[0]
            head_w = by_pid.get(head.pid)
            behind = [t for t in tickets[1:] if t.pid != head.pid]
            if head_w is not None and behind and head_w.id not in blockers:
                blockers[head_w.id] = (head_w, f"headed the GPU queue while {behind[0].model} waited")
        for model_id in list(self._pings):
            if model_id not in blockers:
                del self._pings[model_id]  # it stopped blocking: its late answer does not matter
        now = time.monotonic()
        hung: list[tuple[WorkerRecord, str]] = []
        for model_id, (w, what) in blockers.items():
            ping = self._pings.get(model_id)
            if ping is None or ping.epoch != w.epoch:
                req = f"watchdog-{next(self._ids)}"
                if w.send(protocol.StatusRequest(req=req)):
                    self._pings[model_id] = _Ping(req, now, w.epoch)
                continue
            silent = now - ping.sent_at
            if silent >= limit_s:
                del self._pings[model_id]
                hung.append((w, f"{what} and answered no status ping for {silent:.1f} s"))
        return hung
