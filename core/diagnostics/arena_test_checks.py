"""The arena invariant, checked over the interval records of an arena test (pure: no processes).

Every worker of ``timeshare arena-test`` (core/diagnostics/arena_test.py) logs on the monotonic
clock its token intervals (acquired → released, written by the arena's TokenClient) and its
weights-resident intervals (restore started → release finished, written by the worker).
:func:`check_intervals` proves over those records that

- every resident interval lies inside a token interval of the same process, and
- no two processes' resident intervals overlap (nor their token intervals),

and measures the handoffs (doorbell rung → token acquired). This module owns :class:`Interval`,
:class:`CheckResult`, :func:`check_intervals` and :func:`percentile`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


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
