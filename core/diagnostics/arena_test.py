"""``timeshare arena-test``: stress the VRAM arena with real workers and check its invariant.

Starts N real workers (a :class:`~.pool.Pool`) on real models, takes an uncontended greedy
reference for every (model file, prompt), then drives random concurrent requests for a while.
Every worker logs on the monotonic clock its token intervals (acquired → released, written by the
arena's TokenClient) and its weights-resident intervals (restore started → release finished,
written by the worker). :func:`check_intervals` then proves that

- every resident interval lies inside a token interval of the same process, and
- no two processes' resident intervals overlap (nor their token intervals),

and the report says how many requests ran, how many handoffs happened, whether every output under
contention equals its uncontended reference, and the handoff time (doorbell rung → token acquired).

The harness uses a private arena in a temporary folder (so a running Timeshare is not disturbed)
unless ``TIMESHARE_VRAM_ARENA`` names one; an unsafe arena is refused with exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..arena.budget import parse_budget
from ..arena.dirs import read_holder
from ..arena.records import WAITERS_DIR
from ..arena.tickets import env_arena_dir
from ..config import demo
from ..config.schema import ArenaConfig, Config, ModelConfig, suggest_model_id
from ..errors import ArenaError, TimeshareError
from ..observe import EventLog, read_events
from ..state import EventKind, ModelState, PoolEvent
from .budget_check import budget_fields
from .memwatch import MemCheck, MemorySampler, MemSample, check_memory, choose_source

log = logging.getLogger(__name__)

#: what a request may fail with under chaos (a worker killed, stopped, restarting): each is a
#: documented error code of the pool and the API (docs/API.md); anything else is a lost request
CHAOS_ERRORS = ("model_unavailable", "gpu_busy", "cancelled")

#: short prompts whose greedy continuations are long enough to need several decode steps
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
)

# ---- the checker (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    kind: str
    model: str
    pid: int
    start: float
    end: float

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Interval:
        return cls(
            kind=str(record["kind"]),
            model=str(record["model"]),
            pid=int(record["pid"]),
            start=float(record["start"]),
            end=float(record["end"]),
        )

    def overlaps(self, other: Interval) -> bool:
        return self.start < other.end and other.start < self.end

    def inside(self, other: Interval) -> bool:
        return other.start <= self.start and self.end <= other.end


@dataclass(frozen=True)
class CheckResult:
    token_intervals: int
    resident_intervals: int
    overlaps: tuple[tuple[Interval, Interval], ...]  # resident intervals of two processes at once
    outside_token: tuple[Interval, ...]  # resident intervals not inside a token interval of their own
    token_overlaps: tuple[tuple[Interval, Interval], ...]  # token held by two processes at once
    malformed: int  # records that are not intervals (end before start, missing fields)
    handoffs: int
    handoff_ms: tuple[float, ...]  # doorbell rung (token requested) → token acquired, per handoff
    # holdings of killed processes, closed at the kill ("acquired" → "killed" records): the process
    # held the token at least that long (the kernel drops its lock only once it is dead)
    killed_intervals: int = 0
    unclosed_intervals: int = 0  # "acquired" with neither a release nor a kill recorded after it

    @property
    def ok(self) -> bool:
        return not (self.overlaps or self.outside_token or self.token_overlaps or self.malformed)


def _cross_process_overlaps(intervals: Sequence[Interval]) -> list[tuple[Interval, Interval]]:
    ordered = sorted(intervals, key=lambda i: (i.start, i.end))
    found: list[tuple[Interval, Interval]] = []
    open_: list[Interval] = []  # intervals that may still overlap later ones (sweep line)
    for cur in ordered:
        open_ = [o for o in open_ if o.end > cur.start]
        found.extend((o, cur) for o in open_ if o.pid != cur.pid and o.overlaps(cur))
        open_.append(cur)
    return found


def check_intervals(records: Iterable[Mapping[str, Any]]) -> CheckResult:
    """Check the arena invariant over interval records (see the module docstring).

    A process killed while it held the token left an ``"acquired"`` record and no ``"token"``
    interval; when a ``"killed"`` record of its pid follows, its holding is checked as a token and
    a resident interval from the acquisition to the kill (a lower bound of what it held)."""
    tokens: list[Interval] = []
    resident: list[Interval] = []
    handoff_ms: list[float] = []
    acquired: list[Interval] = []
    killed_at: dict[int, float] = {}
    malformed = 0
    for record in records:
        kind = record.get("kind")
        if kind in ("acquired", "killed"):
            try:
                point = Interval.from_record(record)
            except (KeyError, TypeError, ValueError):
                malformed += 1
                continue
            if kind == "acquired":
                acquired.append(point)
            else:
                killed_at[point.pid] = min(point.start, killed_at.get(point.pid, math.inf))
            continue
        if kind not in ("token", "resident"):
            continue
        try:
            interval = Interval.from_record(record)
        except (KeyError, TypeError, ValueError):
            malformed += 1
            continue
        if interval.end < interval.start:
            malformed += 1
            continue
        if kind == "token":
            tokens.append(interval)
            if record.get("handoff") and record.get("requested") is not None:
                handoff_ms.append((interval.start - float(record["requested"])) * 1000.0)
        else:
            resident.append(interval)
    released = {(t.pid, t.start) for t in tokens}
    killed_intervals = unclosed = 0
    for a in acquired:
        if (a.pid, a.start) in released:
            continue
        end = killed_at.get(a.pid)
        if end is None or end < a.start:
            unclosed += 1
            continue
        killed_intervals += 1
        tokens.append(Interval("token", a.model, a.pid, a.start, end))
        resident.append(Interval("resident", a.model, a.pid, a.start, end))
    by_pid: dict[int, list[Interval]] = {}
    for t in tokens:
        by_pid.setdefault(t.pid, []).append(t)
    outside = tuple(
        r for r in resident if not any(r.model == t.model and r.inside(t) for t in by_pid.get(r.pid, ()))
    )
    return CheckResult(
        token_intervals=len(tokens),
        resident_intervals=len(resident),
        overlaps=tuple(_cross_process_overlaps(resident)),
        outside_token=outside,
        token_overlaps=tuple(_cross_process_overlaps(tokens)),
        malformed=malformed,
        handoffs=len(handoff_ms),
        handoff_ms=tuple(handoff_ms),
        killed_intervals=killed_intervals,
        unclosed_intervals=unclosed,
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# ---- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    model: str
    prompt: str
    expected: str
    got: str


@dataclass(frozen=True)
class ArenaTestReport:
    workers: int
    models: tuple[str, ...]
    seconds: float
    requests: int  # completed under contention
    reference_requests: int
    errors: int
    handoffs: int
    overlaps: int
    outside_token: int
    token_overlaps: int
    deadlocks: int  # requests that did not finish within the deadlock timeout
    outputs_match_reference: bool
    handoff_ms_p50: float | None
    handoff_ms_p99: float | None
    token_intervals: int
    resident_intervals: int
    malformed_records: int
    restore_ms_p50: float | None = None  # restore of the weights, as requests that switched report it
    start_s: float = 0.0  # starting the workers
    reference_s: float = 0.0  # taking the uncontended reference
    requests_by_worker: tuple[tuple[str, int], ...] = ()
    mismatches: tuple[Mismatch, ...] = ()
    error_messages: tuple[str, ...] = ()
    arena_dir: str = ""
    # the physical check (--sample-memory-ms): each worker's memory sampled during the contention
    memory_source: str = ""  # "nvidia-smi" | "rss" | "" (not sampled)
    memory_interval_ms: int = 0
    memory_samples: int = 0
    memory_overlaps: int = 0  # samples where two or more workers were high at once
    memory_high_seen: tuple[tuple[str, bool], ...] = ()  # per worker: seen with its weights in
    memory_threshold_bytes: tuple[tuple[str, int], ...] = ()  # per worker: high above baseline + this
    memory_baseline_bytes: tuple[tuple[str, int], ...] = ()  # per worker: its minimum (released)
    memory_peak_bytes: tuple[tuple[str, int], ...] = ()
    memory_window: tuple[float, float] | None = None  # first and last sample (monotonic clock)
    memory_other_pids: tuple[int, ...] = ()  # nvidia-smi listed these, no worker's (see memwatch)
    # --chaos: workers killed (kill -9) and stopped (SIGSTOP) while they contend; the pool restarts
    chaos: bool = False
    kill_every_s: float = 0.0
    stop_every_s: float = 0.0
    stop_for_s: float = 0.0
    hung_holder_s: float = 0.0
    kills: int = 0  # kill -9 by the harness
    stops: int = 0  # SIGSTOP by the harness (SIGCONT after stop_for_s, unless killed meanwhile)
    watchdog_kills: int = 0  # killed by the pool's hung-holder watchdog
    crashes: int = 0  # exits the pool saw as crashes (kills of either kind)
    restarts: int = 0  # the pool's RESTARTED events (a restart that reached Ready)
    chaos_under_contention: int = 0  # kills and stops done while a ticket waited for the GPU
    killed_intervals: int = 0  # holdings of killed processes checked up to their kill
    unclosed_intervals: int = 0  # acquisitions with neither a release nor a kill recorded
    # requests that got neither an answer nor one of documented_errors (deadlocks included)
    lost_requests: int = 0
    documented_errors: tuple[str, ...] = ()
    failed_requests: tuple[tuple[str, int], ...] = ()  # documented errors met, by code
    recovered: tuple[tuple[str, bool], ...] = ()  # per worker: answered after the chaos
    # the VRAM budget (--budget; core/diagnostics/budget_check.py): under a byte budget several
    # workers may be resident at once (overlaps are expected), the leased bytes never above it
    budget: str = "one-model"
    budget_bytes: int | None = None  # the device's weights budget (None: one model at a time)
    budget_violations: int = 0  # intervals + memory samples over the budget (must be 0)
    budget_interval_violations: int = 0
    memory_budget_violations: int = 0
    max_holders: int = 0  # most workers holding a lease at once
    max_leased_bytes: int = 0
    memory_max_resident: int = 0  # most workers judged resident in one memory sample

    @property
    def one_model(self) -> bool:
        return self.budget_bytes is None

    @property
    def ok(self) -> bool:
        return (
            (self.overlaps == 0 or not self.one_model)
            and self.budget_violations == 0
            and self.outside_token == 0
            and (self.token_overlaps == 0 or not self.one_model)
            and self.deadlocks == 0
            and self.errors == 0
            and self.lost_requests == 0
            and self.malformed_records == 0
            and self.outputs_match_reference
            and self.requests > 0
            and self.resident_intervals > 0
            and (self.memory_overlaps == 0 or not self.one_model)
            and all(ok for _, ok in self.recovered)
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["models"] = list(self.models)
        out["requests_by_worker"] = dict(self.requests_by_worker)
        out["documented_errors"] = list(self.documented_errors)
        out["failed_requests"] = dict(self.failed_requests)
        out["recovered"] = dict(self.recovered)
        out["mismatches"] = [asdict(m) for m in self.mismatches[:10]]
        out["error_messages"] = list(self.error_messages[:10])
        for name in (
            "memory_high_seen",
            "memory_threshold_bytes",
            "memory_baseline_bytes",
            "memory_peak_bytes",
        ):
            out[name] = dict(getattr(self, name))
        out["ok"] = self.ok
        return out

    def to_text(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f} ms"

        lines = [
            f"workers              {self.workers} ({', '.join(self.models)})",
            f"requests             {self.requests} under contention in {self.seconds:.1f} s "
            f"(+{self.reference_requests} reference)",
            f"per worker           {', '.join(f'{k}: {v}' for k, v in self.requests_by_worker)}",
            f"handoffs             {self.handoffs}",
            f"handoff p50 / p99    {ms(self.handoff_ms_p50)} / {ms(self.handoff_ms_p99)} (doorbell → token)",
            f"restore p50          {ms(self.restore_ms_p50)}",
            f"intervals            {self.token_intervals} token, {self.resident_intervals} resident",
            f"overlaps             {self.overlaps}",
            f"outside_token        {self.outside_token}",
            f"token_overlaps       {self.token_overlaps}",
            f"budget               {self._budget_text()}",
            f"budget_violations    {self.budget_violations} ({self.budget_interval_violations} in the "
            f"lease intervals, {self.memory_budget_violations} in the memory samples)",
            f"deadlocks            {self.deadlocks}",
            f"memory               {self._memory_text()}",
            f"errors               {self.errors}",
            *self._chaos_lines(),
            f"outputs match        {'yes' if self.outputs_match_reference else 'NO'}",
            f"result               {'OK' if self.ok else 'FAILED'}",
        ]
        if self.memory_source:
            lines.insert(
                -1, f"memory high seen     {', '.join(f'{k}: {v}' for k, v in self.memory_high_seen)}"
            )
        for m in self.mismatches[:3]:
            lines.append(f"  mismatch {m.model} {m.prompt!r}: expected {m.expected!r}, got {m.got!r}")
        lines.extend(f"  error: {e}" for e in self.error_messages[:3])
        return "\n".join(lines)

    def _chaos_lines(self) -> list[str]:
        if not self.chaos:
            return []
        failed = ", ".join(f"{k}: {v}" for k, v in self.failed_requests) or "none"
        back = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in self.recovered)
        return [
            f"chaos                kill -9 every {self.kill_every_s:g} s, SIGSTOP every "
            f"{self.stop_every_s:g} s for {self.stop_for_s:g} s (hung_holder_s {self.hung_holder_s:g})",
            f"kills / stops        {self.kills} / {self.stops} ({self.chaos_under_contention} while a "
            f"request waited for the GPU)",
            f"watchdog kills       {self.watchdog_kills}",
            f"crashes / restarts   {self.crashes} / {self.restarts}",
            f"killed intervals     {self.killed_intervals} checked up to the kill, "
            f"{self.unclosed_intervals} unclosed",
            f"failed (documented)  {failed} (allowed: {', '.join(self.documented_errors)})",
            f"lost_requests        {self.lost_requests}",
            f"answered afterwards  {back}",
        ]

    def _budget_text(self) -> str:
        if self.one_model:
            return f"{self.budget}: one model at a time (overlaps must be 0)"
        return (
            f"{self.budget} = {self.budget_bytes} bytes; up to {self.max_holders} holders at once "
            f"({self.max_leased_bytes} bytes), {self.memory_max_resident} resident in one memory sample"
        )

    def _memory_text(self) -> str:
        if not self.memory_source:
            return "not sampled"
        mib = ", ".join(f"{k}: {v / 2**20:.0f} MiB" for k, v in self.memory_threshold_bytes)
        return (
            f"{self.memory_overlaps} overlaps in {self.memory_samples} samples "
            f"({self.memory_source}, every {self.memory_interval_ms} ms; high above baseline + {mib})"
        )


# ---- the harness -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerPlan:
    id: str
    path: str


def plan_workers(workers: int, models: Sequence[tuple[str, str]]) -> tuple[WorkerPlan, ...]:
    """``workers`` worker ids over ``models`` ((id, path) pairs), reusing models round-robin:
    the second worker on a model gets ``<id>-2`` and so on."""
    if workers < 1:
        raise ValueError("--workers must be at least 1")
    if not models:
        raise ValueError("no models to run: give --model PATH or install the demo models")
    plans = []
    for i in range(workers):
        base_id, path = models[i % len(models)]
        round_ = i // len(models)
        plans.append(WorkerPlan(base_id if round_ == 0 else f"{base_id}-{round_ + 1}", path))
    return tuple(plans)


def model_id_for_path(path: str, taken: Iterable[str] = ()) -> str:
    """A model id from the file name (config.suggest_model_id), not one of ``taken``."""
    return suggest_model_id(Path(path).name.removesuffix(".gguf"), taken)


def model_ids_for_paths(paths: Iterable[str]) -> list[str]:
    """One id per file, all different (the same file twice is fine: the ids must still differ)."""
    ids: list[str] = []
    for path in paths:
        ids.append(model_id_for_path(path, ids))
    return ids


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


@dataclass
class _Tally:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)  # documented errors by code
    kills: int = 0
    stops: int = 0
    under_contention: int = 0
    watchdog_kills: int = 0
    crashes: int = 0
    restarts: int = 0
    deadlocks: int = 0
    deadlocked: list[str] = field(default_factory=list)  # what each deadlock looked like
    mismatches: list[Mismatch] = field(default_factory=list)
    restore_ms: list[float] = field(default_factory=list)
    by_worker: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ArenaHarness:
    """The pieces of an arena test, for the CLI and for tests that need finer control."""

    def __init__(
        self,
        plans: Sequence[WorkerPlan],
        *,
        work_dir: Path,
        arena_dir: Path,
        prompts: Sequence[str] = DEFAULT_PROMPTS,
        max_tokens: int = 16,
        min_quantum_ms: float = ArenaConfig.min_quantum_ms,
        deadlock_s: float = 120.0,
        wait_timeout_s: float | None = None,
        seed: int = 0,
        max_restarts: int = 3,
        progress: Callable[[str], None] | None = None,
        sample_memory_ms: int = 0,
        hung_holder_s: float | None = None,
        chaos: ChaosPlan | None = None,
        budget: str = "one-model",
    ) -> None:
        from ..pool.supervisor import Pool  # here: importing the harness module stays cheap

        parse_budget(budget)  # ValueError: said before anything starts
        self.budget = budget
        self.budget_bytes: int | None = None  # the device's, once the workers are up
        self.plans = tuple(plans)
        self.work_dir = work_dir
        self.arena_dir = arena_dir
        self.event_log = work_dir / "intervals.jsonl"
        self.prompts = tuple(prompts)
        self.max_tokens = max_tokens
        self.deadlock_s = deadlock_s
        self.rng = random.Random(seed)
        self.progress = progress or (lambda _msg: None)
        self.reference: dict[tuple[str, str], str] = {}  # (model path, prompt) -> text
        self.reference_requests = 0
        self.tally = _Tally()
        self.contention_s = 0.0
        self._until: Callable[[Mapping[str, int]], bool] | None = None
        self.start_s = 0.0
        self.reference_s = 0.0
        self.recovered: dict[str, bool] = {}
        if sample_memory_ms < 0:
            raise ValueError("--sample-memory-ms must be 0 (off) or a positive number of milliseconds")
        if chaos is not None:
            if min(chaos.kill_every_s, chaos.stop_every_s, chaos.stop_for_s) < 0:
                raise ValueError("--kill-every, --stop-every and --stop-for must be >= 0")
            if sample_memory_ms:
                self.progress("chaos: memory not sampled (the workers' pids change as they restart)")
            sample_memory_ms = 0
            max_restarts = max(max_restarts, 1_000_000)  # every kill is restarted (with backoff)
        if hung_holder_s is not None and hung_holder_s < 0:
            raise ValueError("--hung-holder-s must be >= 0 (0: off)")
        self.chaos = chaos
        self.documented_errors = CHAOS_ERRORS if chaos is not None else ()
        self.sample_memory_ms = sample_memory_ms
        self.memory_source = ""
        self.memory_samples: list[MemSample] = []
        self.memory_weight_bytes: dict[str, int] = {}
        self.memory_other_pids: tuple[int, ...] = ()
        self.memory_window: tuple[float, float] | None = None  # first and last sample (monotonic)
        config = Config(
            models=tuple(
                ModelConfig(id=p.id, path=p.path, n_ctx=512, n_seq=2, idle_sleep_s=None) for p in self.plans
            ),
            arena=ArenaConfig(
                dir=str(arena_dir),
                min_quantum_ms=min_quantum_ms,
                wait_timeout_s=deadlock_s if wait_timeout_s is None else wait_timeout_s,
                hung_holder_s=ArenaConfig.hung_holder_s if hung_holder_s is None else hung_holder_s,
                vram_budget=budget,
            ),
        )
        self.hung_holder_s = config.arena.hung_holder_s
        self.pool = Pool(
            config,
            arena_dir=arena_dir,
            log_dir=work_dir / "logs",
            kv_dir=work_dir / "kv",
            event_log=str(self.event_log),
            max_restarts=max_restarts,
        )
        self.pool.subscribe(self._on_event)

    def _on_event(self, event: PoolEvent) -> None:
        """Counts what the pool did about the chaos (the pool's event thread)."""
        with self.tally.lock:
            if event.kind is EventKind.CRASHED:
                self.tally.crashes += 1
                if event.extra.get("watchdog"):
                    self.tally.watchdog_kills += 1
            elif event.kind is EventKind.RESTARTED:
                self.tally.restarts += 1

    def start(self, timeout: float = 300.0) -> None:
        self.progress(f"starting {len(self.plans)} workers")
        started = time.monotonic()
        self.pool.start()
        self.pool.wait_ready(timeout=timeout)
        self.start_s = time.monotonic() - started
        snap = self.pool.snapshot()
        failed = [f"{m.id}: {m.reason or m.state.value}" for m in snap.models if m.state is ModelState.FAILED]
        if failed:
            raise TimeshareError("workers failed to start: " + "; ".join(failed))
        self.budget_bytes = _budget_bytes_of(self)

    def generate(self, worker_id: str, prompt: str) -> str:
        gen = self.pool.generate(worker_id, prompt=prompt, max_tokens=self.max_tokens, temperature=0.0)
        try:
            result = gen.result(timeout=self.deadlock_s)
        except TimeoutError:
            gen.cancel()
            raise
        if result.switch.switched:
            with self.tally.lock:
                self.tally.restore_ms.append(result.switch.restore_ms)
        return result.text

    def take_reference(self) -> None:
        """One request at a time (no contention), one per (model file, prompt)."""
        self.progress("taking the uncontended reference")
        started = time.monotonic()
        for plan in self.plans:
            for prompt in self.prompts:
                key = (plan.path, prompt)
                if key not in self.reference:
                    self.reference[key] = self.generate(plan.id, prompt)
                    self.reference_requests += 1
        self.reference_s = time.monotonic() - started

    def contend(
        self,
        seconds: float,
        clients: int | None = None,
        *,
        dedicated: bool = False,
        until: Callable[[Mapping[str, int]], bool] | None = None,
    ) -> None:
        """Random concurrent requests from ``clients`` threads for ``seconds``. ``dedicated``:
        client i sends only to worker i (every worker always busy: the no-starvation case).
        ``until(requests_by_worker)``: stop sending early once it returns True."""
        self._until = until
        n = clients or len(self.plans) + (0 if dedicated else 1)
        self.progress(f"contention: {n} clients for {seconds:.1f} s")
        deadline = time.monotonic() + seconds
        seeds = [self.rng.randrange(1 << 30) for _ in range(n)]
        threads = [
            threading.Thread(
                target=self._client,
                args=(deadline, s, self.plans[i % len(self.plans)] if dedicated else None),
                name=f"arena-client-{i}",
                daemon=True,
            )
            for i, s in enumerate(seeds)
        ]
        sampler = self._start_sampler()
        started = time.monotonic()
        chaos_done = threading.Event()
        chaos = None
        if self.chaos is not None:
            chaos = threading.Thread(
                target=self._chaos, args=(self.chaos, deadline, chaos_done), name="arena-chaos", daemon=True
            )
        try:
            for t in threads:
                t.start()
            if chaos is not None:
                chaos.start()
            for t in threads:
                t.join(seconds + self.deadlock_s + 30.0)
        finally:
            chaos_done.set()
            if chaos is not None:
                chaos.join(60.0)  # resumes a stopped worker on its way out
            self.contention_s = time.monotonic() - started
            if sampler is not None:
                self.memory_samples.extend(sampler.stop())
                self.memory_other_pids = sampler.other_pids
                if sampler.other_pids:
                    self.progress(f"nvidia-smi also listed pids {list(sampler.other_pids)} (not workers)")
                if self.memory_samples:
                    self.memory_window = (self.memory_samples[0].t, self.memory_samples[-1].t)

    def _start_sampler(self) -> MemorySampler | None:
        """Sample every worker's memory during the contention (``sample_memory_ms`` > 0)."""
        if self.sample_memory_ms <= 0:
            return None
        snap = self.pool.snapshot()
        pids = {m.id: m.pid for m in snap.models if m.pid is not None}
        self.memory_weight_bytes = {m.id: m.weight_bytes for m in snap.models if m.pid is not None}
        self.memory_source = choose_source(m.backend for m in snap.models)
        self.progress(f"sampling memory every {self.sample_memory_ms} ms ({self.memory_source})")
        sampler = MemorySampler(pids, self.sample_memory_ms, self.memory_source)
        sampler.start()
        return sampler

    def memory_check(self) -> MemCheck | None:
        if not self.memory_source:
            return None
        return check_memory(
            self.memory_samples,
            self.memory_weight_bytes,
            missing_as_zero=self.memory_source == "nvidia-smi",
        )

    def _client(self, deadline: float, seed: int, target: WorkerPlan | None) -> None:
        rng = random.Random(seed)
        tally = self.tally
        while time.monotonic() < deadline:
            if self._until is not None:
                with tally.lock:
                    if self._until(dict(tally.by_worker)):
                        return
            plan = target or rng.choice(self.plans)
            prompt = rng.choice(self.prompts)
            try:
                text = self.generate(plan.id, prompt)
            except TimeoutError:
                model = next((m for m in self.pool.snapshot().models if m.id == plan.id), None)
                seen = (
                    f"{model.state.value}, {model.queued} queued, {model.restarts} restarts"
                    f"{': ' + model.reason if model.reason else ''}"
                    if model is not None
                    else "gone"
                )
                with tally.lock:
                    tally.deadlocks += 1
                    tally.deadlocked.append(
                        f"{plan.id}: no answer within {self.deadlock_s:g} s (the model then: {seen})"
                    )
                continue
            except TimeshareError as exc:
                with tally.lock:
                    if exc.code in self.documented_errors:
                        tally.failed[exc.code] = tally.failed.get(exc.code, 0) + 1
                    else:
                        tally.errors.append(f"{plan.id}: {type(exc).__name__} ({exc.code}): {exc}")
                time.sleep(0.05)
                continue
            expected = self.reference.get((plan.path, prompt))
            with tally.lock:
                tally.requests += 1
                tally.by_worker[plan.id] = tally.by_worker.get(plan.id, 0) + 1
                if expected is not None and text != expected:
                    tally.mismatches.append(Mismatch(plan.id, prompt, expected, text))
            time.sleep(rng.uniform(0.0, 0.03))

    # -- chaos --

    def _chaos(self, plan: ChaosPlan, deadline: float, done: threading.Event) -> None:
        """The chaos thread: kills and stops on schedule until ``deadline`` (or ``done``); a
        stopped worker is always resumed (or already dead) when it returns."""
        rng = random.Random(self.rng.randrange(1 << 30))
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
        with self.tally.lock:
            self.tally.kills += 1
            self.tally.under_contention += contended

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
        with self.tally.lock:
            self.tally.stops += 1
            self.tally.under_contention += contended
        return model, pid, at + plan.stop_for_s

    def _resume(self, model: str, pid: int) -> None:
        """SIGCONT, unless the pool killed it meanwhile (its pid is no longer the model's)."""
        if self._live_workers().get(model) != pid:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.progress(f"chaos: SIGCONT {model} (pid {pid})")

    def recover(self, timeout: float | None = None) -> dict[str, bool]:
        """After the chaos: every worker must answer again (a killed one was restarted), with its
        uncontended reference. Returns per worker whether it did."""
        self.progress("after the chaos: one request per worker")
        budget = self.deadlock_s * 2 if timeout is None else timeout
        out: dict[str, bool] = {}
        for plan in self.plans:
            prompt = self.prompts[0]
            end = time.monotonic() + budget
            ok = False
            while time.monotonic() < end and not ok:
                try:
                    ok = self.generate(plan.id, prompt) == self.reference.get((plan.path, prompt))
                    if not ok:
                        break
                except (TimeoutError, TimeshareError) as exc:
                    self.progress(f"{plan.id} after the chaos: {exc}")
                    states = {m.id: m.state for m in self.pool.snapshot().models}
                    if states.get(plan.id) is ModelState.FAILED:
                        break  # it will not come back by itself (a load failure): said above
                    time.sleep(0.5)
            out[plan.id] = ok
        self.recovered = out
        return out

    def stop(self) -> None:
        self.pool.stop(timeout=30.0)

    def report(self) -> ArenaTestReport:
        records = read_events(self.event_log)
        check = check_intervals(records)
        tally = self.tally
        mem = self.memory_check()
        budget = budget_fields(
            records,
            self.memory_samples,
            self.memory_weight_bytes,
            self.budget_bytes,
            sampled=bool(self.memory_source),
            missing_as_zero=self.memory_source == "nvidia-smi",
        )
        return ArenaTestReport(
            budget=self.budget,
            **budget,
            workers=len(self.plans),
            models=tuple(p.id for p in self.plans),
            seconds=round(self.contention_s, 3),
            requests=tally.requests,
            reference_requests=self.reference_requests,
            errors=len(tally.errors),
            handoffs=check.handoffs,
            overlaps=len(check.overlaps),
            outside_token=len(check.outside_token),
            token_overlaps=len(check.token_overlaps),
            deadlocks=tally.deadlocks,
            outputs_match_reference=not tally.mismatches and bool(self.reference),
            handoff_ms_p50=_round(percentile(check.handoff_ms, 50)),
            handoff_ms_p99=_round(percentile(check.handoff_ms, 99)),
            restore_ms_p50=_round(percentile(tally.restore_ms, 50)),
            start_s=round(self.start_s, 3),
            reference_s=round(self.reference_s, 3),
            requests_by_worker=tuple((p.id, tally.by_worker.get(p.id, 0)) for p in self.plans),
            token_intervals=check.token_intervals,
            resident_intervals=check.resident_intervals,
            malformed_records=check.malformed,
            mismatches=tuple(tally.mismatches),
            error_messages=tuple(tally.errors + tally.deadlocked),
            arena_dir=str(self.arena_dir),
            memory_source=self.memory_source,
            memory_interval_ms=self.sample_memory_ms if mem else 0,
            memory_samples=mem.samples if mem else 0,
            memory_overlaps=mem.overlaps if mem else 0,
            memory_high_seen=mem.high_seen if mem else (),
            memory_threshold_bytes=mem.threshold_bytes if mem else (),
            memory_baseline_bytes=mem.baseline_bytes if mem else (),
            memory_peak_bytes=mem.peak_bytes if mem else (),
            memory_window=self.memory_window if mem else None,
            memory_other_pids=self.memory_other_pids,
            chaos=self.chaos is not None,
            kill_every_s=self.chaos.kill_every_s if self.chaos else 0.0,
            stop_every_s=self.chaos.stop_every_s if self.chaos else 0.0,
            stop_for_s=self.chaos.stop_for_s if self.chaos else 0.0,
            hung_holder_s=self.hung_holder_s,
            kills=tally.kills,
            stops=tally.stops,
            watchdog_kills=tally.watchdog_kills,
            crashes=tally.crashes,
            restarts=tally.restarts,
            chaos_under_contention=tally.under_contention,
            killed_intervals=check.killed_intervals,
            unclosed_intervals=check.unclosed_intervals,
            lost_requests=tally.deadlocks + len(tally.errors),
            documented_errors=self.documented_errors,
            failed_requests=tuple(sorted(tally.failed.items())),
            recovered=tuple(sorted(self.recovered.items())),
        )


def _budget_bytes_of(harness: ArenaHarness) -> int | None:
    """The weights budget of device 0 as the workers reported it (None: one model at a time)."""
    for d in harness.pool.snapshot().devices:
        if d.index == 0 and d.budget and d.budget != "one-model":
            return d.budget_bytes
    return harness.budget_bytes


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def default_models() -> list[tuple[str, str]]:
    return [(m.id, m.path) for m in demo.demo_model_configs()]


def run_arena_test(
    models: Sequence[tuple[str, str]],
    workers: int = 3,
    seconds: float = 20.0,
    *,
    work_dir: Path | None = None,
    arena_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> ArenaTestReport:
    """Run the whole test: start, reference, contention, stop, check."""
    plans = plan_workers(workers, models)
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="timeshare-arena-test-")) if work_dir is None else work_dir
    arena = arena_dir if arena_dir is not None else work / "arena"
    harness = ArenaHarness(plans, work_dir=work, arena_dir=arena, progress=progress, **options)
    try:
        harness.start()
        harness.take_reference()
        harness.contend(seconds)
        if harness.chaos is not None:
            harness.recover()
    finally:
        harness.stop()
    report = harness.report()
    if own_work and report.ok:
        shutil.rmtree(work, ignore_errors=True)
    return report


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


def main(args: argparse.Namespace) -> int:
    """The ``timeshare arena-test`` handler. Exit 0: invariant held; 1: it did not; 2: could not run."""

    def progress(msg: str) -> None:
        print(f"arena-test: {msg}", file=sys.stderr, flush=True)

    try:
        if args.model:
            models = list(zip(model_ids_for_paths(args.model), args.model, strict=True))
        else:
            models = default_models()
        arena_dir = env_arena_dir()  # refuse an unsafe arena before loading anything
        report = run_arena_test(
            models,
            workers=args.workers,
            seconds=args.seconds,
            arena_dir=arena_dir,
            progress=progress,
            sample_memory_ms=args.sample_memory_ms,
            budget=getattr(args, "budget", None) or "one-model",
            **chaos_options(args),
        )
    except ArenaError as exc:
        print(f"timeshare arena-test: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TimeshareError, demo.DemoUnavailableError) as exc:
        print(f"timeshare arena-test: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.to_text())
    if not report.ok and not args.json:
        print("the arena invariant or the outputs did not hold: see above", file=sys.stderr)
    return 0 if report.ok else 1
