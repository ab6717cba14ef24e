"""The VRAM budget's invariant, checked from what a run left behind (pure).

*The leased weight bytes of a device never exceed its budget.* Two views, both counted in the
arena-test report's ``budget_violations``:

- the interval log (:func:`check_budget`): every lease a worker held is a segment of constant bytes
  on its device: a ``"token"`` record (acquired → released, ``bytes``, ``budget``, ``device``; a
  lease that changed size carries ``sizes``, ``[[at, bytes], ...]`` from its start: it shrank
  after its load, a partial release shrank it, a request for the rest grew it back; older records
  carry ``load_bytes`` until ``shrunk_at``), or for a holder killed before it released, its
  ``"acquired"`` point (and any ``"shrunk"``/``"resized"`` points) up to its ``"killed"`` record.
  A violation is a moment where the segments of one device overlap with more bytes than the
  budget recorded in them (under a one-model budget, ``budget`` null: two segments
  at once);
- the memory samples (:func:`check_memory_budget`): a sample where the weight bytes of the workers
  judged resident (above their minimum + ½ their weight bytes, as memwatch's check judges them),
  each counted as what it holds above its minimum up to its weight bytes (a partly released
  worker holds only some of its layers), sum above the budget (one-model: where two are resident).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .memwatch import HIGH_FRACTION, MemSample


@dataclass(frozen=True)
class Segment:
    device: int
    pid: int
    model: str
    start: float
    end: float
    bytes: int
    budget: int | None  # None: one model at a time


@dataclass(frozen=True)
class BudgetCheck:
    segments: int
    violations: int  # segment starts where a device's leased bytes exceeded its budget
    examples: tuple[tuple[Segment, ...], ...]  # the overlapping segments of the first violations
    max_holders: int  # most leases held on one device at once
    max_leased_bytes: int  # most weight bytes leased on one device at once


def _num(record: Mapping[str, Any], key: str, default: float | None = None) -> float | None:
    value = record.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return default
    return float(value)


def _budget(record: Mapping[str, Any]) -> int | None:
    value = _num(record, "budget")
    return None if value is None else int(value)


def lease_segments(records: Iterable[Mapping[str, Any]]) -> list[Segment]:
    """The constant-byte lease segments of a run's interval records (see the module docstring)."""
    out: list[Segment] = []
    acquired: list[Mapping[str, Any]] = []
    shrunk: dict[int, list[tuple[float, int]]] = {}
    killed: dict[int, float] = {}
    released: set[tuple[int, float]] = set()
    for r in records:
        kind = r.get("kind")
        pid = r.get("pid")
        start, end = _num(r, "start"), _num(r, "end")
        if not isinstance(pid, int) or start is None or end is None:
            continue
        if kind == "acquired":
            acquired.append(r)
        elif kind in ("shrunk", "resized"):
            shrunk.setdefault(pid, []).append((start, int(_num(r, "bytes", 0.0) or 0)))
        elif kind == "killed":
            killed[pid] = min(start, killed.get(pid, math.inf))
        elif kind == "token":
            released.add((pid, start))
            device = int(_num(r, "device", 0.0) or 0)
            nbytes = int(_num(r, "bytes", 0.0) or 0)
            budget = _budget(r)
            model = str(r.get("model", ""))
            cut = _num(r, "shrunk_at")
            sizes = _sizes(r.get("sizes"), start, end)
            if sizes:
                for (at, size), (nxt, _) in zip(sizes, [*sizes[1:], (end, 0)], strict=True):
                    out.append(Segment(device, pid, model, at, nxt, size, budget))
            elif cut is not None and start <= cut <= end:
                load = int(_num(r, "load_bytes", float(nbytes)) or 0)
                out.append(Segment(device, pid, model, start, cut, load, budget))
                out.append(Segment(device, pid, model, cut, end, nbytes, budget))
            else:
                out.append(Segment(device, pid, model, start, end, nbytes, budget))
    for r in acquired:  # holders killed before they released: up to the kill
        pid, start = int(r["pid"]), float(r["start"])
        end = killed.get(pid)
        if (pid, start) in released or end is None or end < start:
            continue
        device = int(_num(r, "device", 0.0) or 0)
        budget = _budget(r)
        model = str(r.get("model", ""))
        nbytes = int(_num(r, "bytes", 0.0) or 0)
        t = start
        for at, new in sorted(x for x in shrunk.get(pid, []) if start <= x[0] <= end):
            out.append(Segment(device, pid, model, t, at, nbytes, budget))
            t, nbytes = at, new
        out.append(Segment(device, pid, model, t, end, nbytes, budget))
    return out


def _sizes(raw: object, start: float, end: float) -> list[tuple[float, int]]:
    """A token record's ``sizes`` (``[[at, bytes], ...]``, in order, within its interval); [] when
    absent or not that shape."""
    if not isinstance(raw, list):
        return []
    out: list[tuple[float, int]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2):
            return []
        at, size = item
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not isinstance(size, int):
            return []
        if not (start <= at <= end) or (out and at < out[-1][0]):
            return []
        out.append((float(at), size))
    return out


def check_budget(records: Iterable[Mapping[str, Any]], max_examples: int = 5) -> BudgetCheck:
    """Count the moments a device's leases exceeded its budget (a sweep over segment starts)."""
    segments = [s for s in lease_segments(records) if s.end > s.start]
    violations = 0
    examples: list[tuple[Segment, ...]] = []
    max_holders = 0
    max_bytes = 0
    by_device: dict[int, list[Segment]] = {}
    for s in segments:
        by_device.setdefault(s.device, []).append(s)
    for items in by_device.values():
        items.sort(key=lambda s: (s.start, s.end))
        open_: list[Segment] = []
        for cur in items:
            open_ = [o for o in open_ if o.end > cur.start]
            open_.append(cur)
            holders = {o.pid for o in open_}
            leased = sum(o.bytes for o in open_)
            max_holders = max(max_holders, len(holders))
            max_bytes = max(max_bytes, leased)
            budgets = [o.budget for o in open_]
            if any(b is None for b in budgets):
                bad = len(holders) > 1
            else:
                bad = leased > min(b for b in budgets if b is not None)
            if bad:
                violations += 1
                if len(examples) < max_examples:
                    examples.append(tuple(open_))
    return BudgetCheck(
        segments=len(segments),
        violations=violations,
        examples=tuple(examples),
        max_holders=max_holders,
        max_leased_bytes=max_bytes,
    )


@dataclass(frozen=True)
class MemoryBudgetCheck:
    samples: int
    violations: int  # samples whose resident workers' weight bytes exceed the budget
    max_resident: int  # most workers judged resident in one sample
    max_resident_bytes: int


def check_memory_budget(
    samples: Sequence[MemSample],
    weight_bytes: Mapping[str, int],
    budget: int | None,
    *,
    fraction: float = HIGH_FRACTION,
    missing_as_zero: bool = False,
) -> MemoryBudgetCheck:
    """Samples where the weight bytes of the workers judged resident (memory above their own
    minimum + ``fraction`` × their weight bytes) sum above ``budget`` (None: one model at a time,
    a violation is two resident at once)."""
    keys = [k for k, w in weight_bytes.items() if w > 0]
    baseline: dict[str, int] = {}
    for sample in samples:
        for key in keys:
            v = sample.value(key, missing_as_zero)
            if v is not None:
                baseline[key] = min(v, baseline.get(key, v))
    violations = max_n = max_bytes = 0
    for sample in samples:
        high = []
        total = 0
        for key in keys:
            v = sample.value(key, missing_as_zero)
            if v is not None and v > baseline[key] + fraction * weight_bytes[key]:
                high.append(key)
                total += min(weight_bytes[key], v - baseline[key])
        max_n, max_bytes = max(max_n, len(high)), max(max_bytes, total)
        if (budget is None and len(high) > 1) or (budget is not None and total > budget):
            violations += 1
    return MemoryBudgetCheck(len(samples), violations, max_n, max_bytes)


def budget_fields(
    records: Sequence[Mapping[str, Any]],
    samples: Sequence[MemSample],
    weight_bytes: Mapping[str, int],
    budget_bytes: int | None,
    *,
    sampled: bool,
    missing_as_zero: bool = False,
) -> dict[str, Any]:
    """The arena-test report's budget fields: both checks, summed in ``budget_violations``."""
    intervals = check_budget(records)
    memory = check_memory_budget(samples, weight_bytes, budget_bytes, missing_as_zero=missing_as_zero)
    mem_violations = memory.violations if sampled else 0
    return {
        "budget_bytes": budget_bytes,
        "budget_violations": intervals.violations + mem_violations,
        "budget_interval_violations": intervals.violations,
        "memory_budget_violations": mem_violations,
        "max_holders": intervals.max_holders,
        "max_leased_bytes": intervals.max_leased_bytes,
        "memory_max_resident": memory.max_resident if sampled else 0,
    }
