"""The report of an arena test: :class:`ArenaTestReport` (what ``timeshare arena-test`` found, and
whether it passed), its JSON (``to_json``, for ``--json``) and its text (``to_text``), and
:class:`Mismatch` (an output under contention that differs from its uncontended reference).
The harness that fills it in is core/diagnostics/arena_test.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


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
    # the weight bytes those restores moved (all of a model after a whole release, only the lost
    # layer parts after a partial one: a byte budget) and their share of the model; the switched
    # requests whose restore moved only part of their model
    restored_bytes_p50: int | None = None
    restored_fraction_p50: float | None = None
    partial_restores: int = 0
    parallel: int = 0  # each worker's models[].parallel (0: auto)
    batched_requests: int = 0  # answers decoded together with others (their batch_size > 1)
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
            f"batched              {self.batched_requests} answered in a batch "
            f"(parallel {self.parallel or 'auto'})",
            f"handoffs             {self.handoffs}",
            f"handoff p50 / p99    {ms(self.handoff_ms_p50)} / {ms(self.handoff_ms_p99)} (doorbell → token)",
            f"restore p50          {ms(self.restore_ms_p50)}{self._restored_text()}",
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

    def _restored_text(self) -> str:
        if self.restored_bytes_p50 is None:
            return ""
        fraction = self.restored_fraction_p50
        share = "" if fraction is None else f" = {fraction:.2f} x the model"
        return (
            f", {self.restored_bytes_p50 / 1e6:.1f} MB moved{share}; {self.partial_restores} partial restores"
        )

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
