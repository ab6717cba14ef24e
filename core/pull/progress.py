"""Progress of a download: what the CLI and the dialog are told, throttled, with a rate and an ETA."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..util.units import human_bytes


@dataclass(frozen=True)
class Progress:
    filename: str  # the file being transferred (or checked)
    part: int  # 1-based part of a split model
    parts: int
    done: int  # bytes of the choice present so far (all parts)
    total: int | None
    rate: float = 0.0  # bytes per second over the last seconds (0 while checking)
    eta_s: float | None = None
    phase: Literal["download", "verify"] = "download"

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total else None

    def describe(self) -> str:
        """One line: "x.gguf  12.0 MiB / 120.0 MiB (10%), 4.2 MiB/s, 26 s left"."""
        head = self.filename.rsplit("/", 1)[-1] + (f" [{self.part}/{self.parts}]" if self.parts > 1 else "")
        if self.phase == "verify":
            return f"{head}  checking {human_bytes(self.done, empty='0 B')}"
        amount = human_bytes(self.done, empty="0 B")
        if self.total:
            amount += f" / {human_bytes(self.total)} ({100 * self.done // self.total}%)"
        line = f"{head}  {amount}"
        if self.rate > 0:
            line += f", {human_bytes(int(self.rate))}/s"
        if self.eta_s is not None:
            line += f", {format_duration(self.eta_s)} left"
        return line


def format_duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


ProgressFn = Callable[[Progress], None]


class Meter:
    """Turns byte counts into throttled Progress reports with a rate over the last five seconds."""

    def __init__(
        self, callback: ProgressFn | None, parts: int, total: int | None, interval: float = 0.1
    ) -> None:
        self.callback = callback
        self.parts = parts
        self.total = total
        self.interval = interval
        self.base = 0  # bytes of the parts already finished
        self.samples: deque[tuple[float, int]] = deque()
        self.last = 0.0

    def report(
        self,
        filename: str,
        part: int,
        done_in_part: int,
        *,
        phase: Literal["download", "verify"] = "download",
        force: bool = False,
    ) -> None:
        if self.callback is None:
            return
        now = time.monotonic()
        done = self.base + done_in_part
        if phase == "download":
            self.samples.append((now, done))
            while len(self.samples) > 2 and now - self.samples[0][0] > 5.0:
                self.samples.popleft()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        rate = 0.0
        eta = None
        if phase == "download" and len(self.samples) >= 2:
            (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
            if t1 > t0:
                rate = max(0.0, (d1 - d0) / (t1 - t0))
            if rate > 0 and self.total:
                eta = max(0.0, (self.total - done) / rate)
        self.callback(Progress(filename, part, self.parts, done, self.total, rate, eta, phase))

    def restart_rate(self) -> None:
        self.samples.clear()
