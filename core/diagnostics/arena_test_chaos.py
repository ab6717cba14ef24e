"""The chaos of ``timeshare arena-test --chaos``: workers killed (kill -9) and stopped (SIGSTOP,
then SIGCONT) while the clients contend, so that the pool restarts them and its hung-holder
watchdog acts. This module owns :class:`ChaosPlan` (the schedule), :class:`ChaosInjector` (the
thread that carries it out against a pool and counts what it did), :data:`CHAOS_ERRORS` (what a
request may fail with meanwhile) and :func:`chaos_options` (the CLI flags as harness options).
The harness that runs it is core/diagnostics/arena_test.py."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..arena.dirs import read_holder
from ..arena.records import WAITERS_DIR
from ..config.schema import ArenaConfig
from ..observe import EventLog
from ..state import ModelState

if TYPE_CHECKING:
    from ..pool.supervisor import Pool

#: what a request may fail with under chaos (a worker killed, stopped, restarting): each is a
#: documented error code of the pool and the API (docs/API.md); anything else is a lost request
CHAOS_ERRORS = ("model_unavailable", "gpu_busy", "cancelled")


@dataclass(frozen=True)
class ChaosPlan:
    """What ``--chaos`` does while the clients contend: kill -9 a random worker every
    ``kill_every_s``; SIGSTOP one (the GPU holder when there is one, else a random worker) every
    ``stop_every_s`` for ``stop_for_s``, then SIGCONT. A stop longer than the pool's
    ``hung_holder_s`` exercises the watchdog (a stopped holder with someone waiting is killed and
    restarted); a shorter one, a plain stall. 0 turns an action off."""

    kill_every_s: float = 20.0
    stop_every_s: float = 30.0
    stop_for_s: float = 45.0
    #: how long to wait for contention (a ticket waiting for the GPU) before each action
    contention_wait_s: float = 10.0


class ChaosInjector:
    """Carries out a :class:`ChaosPlan` against the workers of ``pool`` (see :meth:`run`), and
    counts the kills, the stops and those of them done while a ticket waited for the GPU."""

    def __init__(
        self,
        plan: ChaosPlan,
        pool: Pool,
        *,
        arena_dir: Path,
        event_log: Path,
        progress: Callable[[str], None],
    ) -> None:
        self.plan = plan
        self.pool = pool
        self.arena_dir = arena_dir
        self.event_log = event_log  # where a kill is recorded, for the interval check
        self.progress = progress
        self.kills = 0  # kill -9
        self.stops = 0  # SIGSTOP (SIGCONT after plan.stop_for_s, unless killed meanwhile)
        self.under_contention = 0  # kills and stops done while a ticket waited for the GPU
        self._lock = threading.Lock()

    def run(self, seed: int, deadline: float, done: threading.Event) -> None:
        """The chaos thread: kills and stops on schedule until ``deadline`` (or ``done``); a
        stopped worker is always resumed (or already dead) when it returns."""
        plan = self.plan
        rng = random.Random(seed)
        start = time.monotonic()
        next_kill = start + plan.kill_every_s if plan.kill_every_s > 0 else math.inf
        next_stop = start + plan.stop_every_s if plan.stop_every_s > 0 and plan.stop_for_s > 0 else math.inf
        stopped: tuple[str, int, float] | None = None  # model, pid, resume at
        try:
            while not done.is_set():
                now = time.monotonic()
                if stopped is not None and now >= stopped[2]:
                    self._resume(stopped[0], stopped[1])
                    stopped = None
                if now >= deadline:
                    break
                if now >= next_kill:
                    self._kill_one(rng, plan, avoid=stopped[1] if stopped else None, done=done)
                    next_kill = time.monotonic() + plan.kill_every_s
                elif now >= next_stop and stopped is None:
                    stopped = self._stop_one(rng, plan, done)
                    next_stop = time.monotonic() + plan.stop_every_s
                wake = min(next_kill, next_stop, stopped[2] if stopped else math.inf, deadline)
                done.wait(max(0.01, wake - time.monotonic()))
        finally:
            if stopped is not None:
                self._resume(stopped[0], stopped[1])

    def _contended(self, plan: ChaosPlan, done: threading.Event) -> bool:
        """Wait (up to ``plan.contention_wait_s``) until a ticket waits for the GPU."""
        waiters = self.arena_dir / WAITERS_DIR
        end = time.monotonic() + plan.contention_wait_s
        while time.monotonic() < end and not done.is_set():
            with contextlib.suppress(OSError):
                if os.listdir(waiters):
                    return True
            time.sleep(0.005)
        return False

    def _live_workers(self) -> dict[str, int]:
        return {
            m.id: m.pid
            for m in self.pool.snapshot().models
            if m.pid is not None and m.state not in (ModelState.STOPPED, ModelState.FAILED)
        }

    def _kill_one(
        self, rng: random.Random, plan: ChaosPlan, avoid: int | None, done: threading.Event
    ) -> None:
        contended = self._contended(plan, done)
        live = {k: v for k, v in self._live_workers().items() if v != avoid}
        if not live or done.is_set():
            return
        model = rng.choice(sorted(live))
        pid = live[model]
        at = time.monotonic()
        try:
            # written before the signal: the interval check closes this pid's holding here
            EventLog(self.event_log, model, pid).record("killed", at, at, by="harness")
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.progress(f"chaos: kill -9 {model} (pid {pid})")
        with self._lock:
            self.kills += 1
            self.under_contention += contended

    def _stop_one(
        self, rng: random.Random, plan: ChaosPlan, done: threading.Event
    ) -> tuple[str, int, float] | None:
        contended = self._contended(plan, done)
        live = self._live_workers()
        if not live or done.is_set():
            return None
        holder = read_holder(self.arena_dir)
        by_pid = {pid: model for model, pid in live.items()}
        if holder is not None and holder.pid in by_pid:
            model, pid = by_pid[holder.pid], holder.pid  # the one others wait for
        else:
            model = rng.choice(sorted(live))
            pid = live[model]
        at = time.monotonic()
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return None
        with contextlib.suppress(OSError):
            EventLog(self.event_log, model, pid).record("stopped", at, at, by="harness")
        self.progress(f"chaos: SIGSTOP {model} (pid {pid}) for {plan.stop_for_s:g} s")
        with self._lock:
            self.stops += 1
            self.under_contention += contended
        return model, pid, at + plan.stop_for_s

    def _resume(self, model: str, pid: int) -> None:
        """SIGCONT, unless the pool killed it meanwhile (its pid is no longer the model's)."""
        if self._live_workers().get(model) != pid:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.progress(f"chaos: SIGCONT {model} (pid {pid})")


def chaos_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--chaos``, ``--kill-every``, ``--stop-every``, ``--stop-for`` and ``--hung-holder-s`` as
    harness options. ``--stop-for`` defaults to 1.5 x hung_holder_s (a stopped holder outlives the
    watchdog's patience: it is killed and restarted); give less than hung_holder_s for plain stalls."""
    options: dict[str, Any] = {}
    deadlock_s = getattr(args, "deadlock_s", None)
    if deadlock_s is not None:
        if deadlock_s <= 0:
            raise ValueError("--deadlock-s must be > 0")
        options["deadlock_s"] = deadlock_s
    hung = getattr(args, "hung_holder_s", None)
    if hung is not None:
        options["hung_holder_s"] = hung
    if not getattr(args, "chaos", False):
        return options
    hung_s = ArenaConfig.hung_holder_s if hung is None else hung
    stop_for = getattr(args, "stop_for", None)
    kill_every = getattr(args, "kill_every", None)
    stop_every = getattr(args, "stop_every", None)
    options["chaos"] = ChaosPlan(
        kill_every_s=ChaosPlan.kill_every_s if kill_every is None else kill_every,
        stop_every_s=ChaosPlan.stop_every_s if stop_every is None else stop_every,
        stop_for_s=1.5 * hung_s if stop_for is None else stop_for,
    )
    return options
