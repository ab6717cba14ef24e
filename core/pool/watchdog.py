"""The hung-holder watchdog: a worker of this pool that blocks the GPU while others wait, and does
not answer a status ping for ``arena.hung_holder_s``, is named for the pool to kill and restart.

Blocking the GPU means holding a lease the head of the queue waits for (the holders its plan
names, pinned or not: :func:`~..arena.budget.plan_fit`; the holder record, or the worker's own
last report, where no lease can be read) while a ticket of another process waits, or holding the
head ticket of the queue while a ticket of another process waits behind it (a stopped head waiter
never takes its lease, so nobody behind it ever gets one). Each device's arena is looked at.

The ping is the protocol's :class:`~..wire.protocol.StatusRequest`, answered by the worker's
loop thread (its reader thread only queues it): between decode steps and prefill chunks, while it
loads or waits for the GPU, and when idle. So the answer proves the loop thread makes progress: a
process that is stopped (SIGSTOP, a debugger), frozen or dead answers nothing, and neither does
one whose loop thread hangs while the process still runs (its reader would have answered). A loop
thread inside one llama call that calls back nothing for longer than ``arena.hung_holder_s``
while another model waits for the GPU counts as hung too (raise ``hung_holder_s`` for models that
need longer single calls).

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

from ..arena.arena import Arena
from ..arena.budget import ONE_MODEL, compute_budget, plan_fit
from ..arena.dirs import device_arena_dir
from ..errors import ArenaError
from ..wire import protocol
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
        self._arenas: dict[Path, Arena] = {}
        self._pings: dict[str, _Ping] = {}
        self._ids = itertools.count(1)
        self._open_failed = False

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        self._pings.clear()

    def _open(self, arena_dir: Path) -> Arena | None:
        if arena_dir in self._arenas:
            return self._arenas[arena_dir]
        try:
            self._arenas[arena_dir] = Arena(arena_dir)
        except (ArenaError, OSError) as exc:
            if not self._open_failed:
                log.error("the hung-holder watchdog cannot open the arena %s: %s", arena_dir, exc)
            self._open_failed = True
            return None
        self._open_failed = False
        return self._arenas[arena_dir]

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
        workers = list(workers)
        blockers: dict[str, tuple[WorkerRecord, str]] = {}
        for device in sorted({w.info.device if w.info else w.config.device for w in workers}):
            on_device = [w for w in workers if (w.info.device if w.info else w.config.device) == device]
            blockers.update(self._blockers(on_device, device_arena_dir(arena_dir, device)))
        return self._ping(blockers, limit_s)

    def _blockers(self, workers: list[WorkerRecord], arena_dir: Path) -> dict[str, tuple[WorkerRecord, str]]:
        arena = self._open(arena_dir)
        if arena is None:
            return {}
        try:
            tickets = arena.waiters()  # sweeps stale tickets too
            leases = [x for x in arena.leases() if x.kind == "weights"]
            holder = arena.holder()
            need = arena.ticket_need(tickets[0]) if tickets else None
            budget = arena.budget_record() or compute_budget(ONE_MODEL, total=0, free=0)
        except OSError as exc:
            log.warning("the hung-holder watchdog cannot read the arena %s: %s", arena_dir, exc)
            return {}
        alive = [w for w in workers if w.alive and w.pid is not None]
        by_pid = {w.pid: w for w in alive}
        blockers: dict[str, tuple[WorkerRecord, str]] = {}
        holding: list[WorkerRecord] = []
        if tickets and leases:
            head = tickets[0]
            plan = plan_fit(need, [x for x in leases if x.pid != head.pid], budget, time.monotonic())
            holding = [by_pid[x.pid] for x in (*plan.victims, *plan.pinned) if x.pid in by_pid]
        elif holder is not None and holder.pid in by_pid:
            holding = [by_pid[holder.pid]]
        elif not leases:  # no lease or record could be read: the workers' own reports
            holding = [w for w in alive if w.status is not None and w.status.holds_token][:1]
        for holder_w in holding:
            others = [t for t in tickets if t.pid != holder_w.pid]
            if others:
                blockers[holder_w.id] = (holder_w, f"held the GPU while {others[0].model} waited")
        if tickets:
            head = tickets[0]
            head_w = by_pid.get(head.pid)
            behind = [t for t in tickets[1:] if t.pid != head.pid]
            if head_w is not None and behind and head_w.id not in blockers:
                blockers[head_w.id] = (head_w, f"headed the GPU queue while {behind[0].model} waited")
        return blockers

    def _ping(
        self, blockers: dict[str, tuple[WorkerRecord, str]], limit_s: float
    ) -> list[tuple[WorkerRecord, str]]:
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
