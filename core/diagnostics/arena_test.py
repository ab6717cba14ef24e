"""``timeshare arena-test``: stress the VRAM arena with real workers and check its invariant.

Starts N real workers (a :class:`~.pool.Pool`) on real models, takes an uncontended greedy
reference for every (model file, prompt), then drives random concurrent requests for a while.
Every worker logs on the monotonic clock its token intervals (acquired → released, written by the
arena's TokenClient) and its weights-resident intervals (restore started → release finished,
written by the worker). :func:`~.arena_test_checks.check_intervals` then proves that

- every resident interval lies inside a token interval of the same process, and
- no two processes' resident intervals overlap (nor their token intervals),

and the report says how many requests ran, how many handoffs happened, whether every output under
contention equals its uncontended reference, and the handoff time (doorbell rung → token acquired).

This module owns the orchestration: the worker plans, :class:`ArenaHarness` (start, reference,
contention, recovery, the report), :func:`run_arena_test` and the CLI handler :func:`main`. The
invariant check is in arena_test_checks.py, the report in arena_test_report.py, and ``--chaos``
(kill -9 / SIGSTOP while the clients contend) in arena_test_chaos.py.

The harness uses a private arena in a temporary folder (so a running Timeshare is not disturbed)
unless ``TIMESHARE_VRAM_ARENA`` names one; an unsafe arena is refused with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..arena.arena import env_arena_dir
from ..arena.budget import parse_budget
from ..config import demo
from ..config.schema import ArenaConfig, Config, ModelConfig, suggest_model_id
from ..errors import ArenaError, TimeshareError
from ..observe import read_events
from ..sampling import Sampling
from ..state import EventKind, ModelState, PoolEvent
from .arena_test_chaos import CHAOS_ERRORS, ChaosInjector, ChaosPlan, chaos_options
from .arena_test_checks import check_intervals, percentile
from .arena_test_report import ArenaTestReport, Mismatch
from .budget_check import budget_fields
from .card import hold_card
from .memwatch import MemCheck, MemorySampler, MemSample, check_memory, choose_source

log = logging.getLogger(__name__)

#: short prompts whose greedy continuations are long enough to need several decode steps
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
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


@dataclass
class _Tally:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)  # documented errors by code
    watchdog_kills: int = 0
    crashes: int = 0
    restarts: int = 0
    deadlocks: int = 0
    deadlocked: list[str] = field(default_factory=list)  # what each deadlock looked like
    mismatches: list[Mismatch] = field(default_factory=list)
    restore_ms: list[float] = field(default_factory=list)
    # per switched request: the weight bytes its restore moved, and their share of its model's
    restored_bytes: list[int] = field(default_factory=list)
    restored_fraction: list[float] = field(default_factory=list)
    batched: int = 0  # answers decoded together with another (batch_size > 1)
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
        parallel: int = 0,
    ) -> None:
        from ..pool.supervisor import Pool  # here: importing the harness module stays cheap

        parse_budget(budget)  # ValueError: said before anything starts
        if parallel < 0:
            raise ValueError("--parallel must be >= 0 (0: auto)")
        self.budget = budget
        self.budget_bytes: int | None = None  # the device's, once the workers are up
        self.weight_bytes: dict[str, int] = {}  # each worker's, once they are up
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
                ModelConfig(id=p.id, path=p.path, n_ctx=512, n_seq=2, parallel=parallel, idle_sleep_s=None)
                for p in self.plans
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
        self.parallel = parallel
        self.pool = Pool(
            config,
            arena_dir=arena_dir,
            log_dir=work_dir / "logs",
            kv_dir=work_dir / "kv",
            event_log=str(self.event_log),
            max_restarts=max_restarts,
        )
        self.pool.subscribe(self._on_event)
        self.injector = (
            None
            if chaos is None
            else ChaosInjector(
                chaos, self.pool, arena_dir=arena_dir, event_log=self.event_log, progress=self.progress
            )
        )

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
        self.weight_bytes = {m.id: m.weight_bytes for m in snap.models}

    def generate(self, worker_id: str, prompt: str) -> str:
        gen = self.pool.generate(worker_id, prompt=prompt, sampling=Sampling(max_tokens=self.max_tokens))
        try:
            result = gen.result(timeout=self.deadlock_s)
        except TimeoutError:
            gen.cancel()
            raise
        weights = self.weight_bytes.get(worker_id, 0)
        with self.tally.lock:
            if result.switch.switched:
                self.tally.restore_ms.append(result.switch.restore_ms)
                self.tally.restored_bytes.append(result.switch.restored_bytes)
                if weights > 0:
                    self.tally.restored_fraction.append(result.switch.restored_bytes / weights)
            if result.batch_size > 1:
                self.tally.batched += 1
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
        if self.injector is not None:
            chaos = threading.Thread(
                target=self.injector.run,
                args=(self.rng.randrange(1 << 30), deadline, chaos_done),
                name="arena-chaos",
                daemon=True,
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
        injector = self.injector
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
            parallel=self.parallel,
            batched_requests=tally.batched,
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
            restored_bytes_p50=_int_or_none(percentile([float(b) for b in tally.restored_bytes], 50)),
            restored_fraction_p50=_round(percentile(tally.restored_fraction, 50)),
            partial_restores=sum(1 for f in tally.restored_fraction if 0.0 < f < 1.0),
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
            kills=injector.kills if injector else 0,
            stops=injector.stops if injector else 0,
            watchdog_kills=tally.watchdog_kills,
            crashes=tally.crashes,
            restarts=tally.restarts,
            chaos_under_contention=injector.under_contention if injector else 0,
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


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


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
        with hold_card(getattr(args, "card", None)) as card:  # before any worker starts
            if card is not None:
                progress(card.describe())
            report = run_arena_test(
                models,
                workers=args.workers,
                seconds=args.seconds,
                arena_dir=arena_dir,
                progress=progress,
                sample_memory_ms=args.sample_memory_ms,
                budget=getattr(args, "budget", None) or "one-model",
                parallel=getattr(args, "parallel", 0) or 0,
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
