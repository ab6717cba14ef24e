"""Physical memory check for the arena: sample each worker's memory while they alternate, and
show that the weights of two workers were never resident at once.

Two sources:

- ``nvidia-smi`` (a CUDA build with ``nvidia-smi`` on PATH): one subprocess,
  ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms N``,
  whose stream (one ``pid, MiB`` line per process per poll) a reader thread turns into samples;
- ``rss`` (everywhere else): a thread reads ``/proc/<pid>/statm`` of every worker every N ms. On a
  CPU build the in-place residency path frees the host weight buffers on release (the worker sets
  glibc's mmap threshold so the memory really goes back), so RSS drops by the weight bytes: the
  same mechanism, measured on host memory.

:func:`check_memory` is pure: a worker is *high* in a sample when its memory exceeds its own
minimum over the run (its released baseline) plus ``fraction`` × its weight bytes; a sample where
two or more workers are high is an overlap. ``high_seen`` per worker shows the check has teeth
(the worker was seen both released and resident).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: a worker is high above its baseline + this fraction of its weight bytes
HIGH_FRACTION = 0.5

# ---- samples and the checker (pure) ----------------------------------------------------------


@dataclass(frozen=True)
class MemSample:
    """Memory of each worker at one moment (monotonic clock). A worker missing from ``bytes_by``
    was not seen in this sample (for nvidia-smi: it held no device memory); one in ``unmeasured``
    was seen without a figure (nvidia-smi's ``[N/A]``)."""

    t: float
    bytes_by: tuple[tuple[str, int], ...]
    unmeasured: tuple[str, ...] = ()

    def get(self, key: str) -> int | None:
        return next((b for k, b in self.bytes_by if k == key), None)

    def value(self, key: str, missing_as_zero: bool) -> int | None:
        """``key``'s bytes; a worker not seen counts as 0 with ``missing_as_zero`` (a sampler that
        lists only the processes holding memory), unless it was seen without a figure."""
        got = self.get(key)
        if got is None and missing_as_zero and key not in self.unmeasured:
            return 0
        return got


@dataclass(frozen=True)
class MemCheck:
    samples: int
    overlaps: int  # samples where two or more workers were high
    overlap_examples: tuple[MemSample, ...]  # the first few overlapping samples
    high_seen: tuple[tuple[str, bool], ...]  # per worker: was it ever high
    threshold_bytes: tuple[tuple[str, int], ...]  # per worker: fraction × weight bytes
    baseline_bytes: tuple[tuple[str, int], ...]  # per worker: its minimum over the run
    peak_bytes: tuple[tuple[str, int], ...]  # per worker: its maximum over the run

    @property
    def ok(self) -> bool:
        return self.overlaps == 0


def check_memory(
    samples: Sequence[MemSample],
    weight_bytes: Mapping[str, int],
    *,
    fraction: float = HIGH_FRACTION,
    missing_as_zero: bool = False,
) -> MemCheck:
    """Count the samples where two or more workers were high (see the module docstring).
    ``weight_bytes``: the workers to check and their weight bytes (a worker with 0 is never high).
    ``missing_as_zero``: a worker missing from a sample holds no memory (nvidia-smi lists only
    processes with a context); otherwise it was just not measured."""
    keys = list(weight_bytes)
    baseline: dict[str, int] = {}
    peak: dict[str, int] = {}
    for sample in samples:
        for key in keys:
            v = sample.value(key, missing_as_zero)
            if v is None:
                continue
            baseline[key] = min(v, baseline.get(key, v))
            peak[key] = max(v, peak.get(key, v))
    threshold = {k: int(fraction * weight_bytes[k]) for k in keys}
    high_seen = dict.fromkeys(keys, False)
    overlaps = 0
    examples: list[MemSample] = []
    for sample in samples:
        high = []
        for key in keys:
            v = sample.value(key, missing_as_zero)
            if v is None or weight_bytes[key] <= 0:
                continue
            if v > baseline[key] + threshold[key]:
                high.append(key)
                high_seen[key] = True
        if len(high) >= 2:
            overlaps += 1
            if len(examples) < 5:
                examples.append(sample)
    return MemCheck(
        samples=len(samples),
        overlaps=overlaps,
        overlap_examples=tuple(examples),
        high_seen=tuple(high_seen.items()),
        threshold_bytes=tuple(threshold.items()),
        baseline_bytes=tuple((k, baseline[k]) for k in keys if k in baseline),
        peak_bytes=tuple((k, peak[k]) for k in keys if k in peak),
    )


# ---- nvidia-smi's stream (pure) ---------------------------------------------------------------


def parse_nvidia_smi_line(line: str) -> tuple[int, int | None] | None:
    """``"12345, 6072"`` → ``(12345, 6072 MiB in bytes)``; ``"12345, [N/A]"`` → ``(12345, None)``
    (a process whose memory nvidia-smi cannot tell); None for a line that is not a process
    (``No running processes found``, a blank line, a header, an error)."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != 2 or not parts[0].isdigit():
        return None
    pid_text, mib_text = parts
    if mib_text.isdigit():
        return int(pid_text), int(mib_text) * MIB
    if mib_text.upper() in ("[N/A]", "N/A", "[NOT SUPPORTED]", "[INSUFFICIENT PERMISSIONS]"):
        return int(pid_text), None
    return None


def group_nvidia_smi_lines(lines: Iterable[tuple[float, str]], names: Mapping[int, str]) -> list[MemSample]:
    """Timestamped lines of ``nvidia-smi --query-compute-apps=pid,used_memory -lms N`` → samples.
    One poll prints one line per process and nothing between polls, so a poll ends where a pid
    repeats or where a line is not a process line (``No running processes found``). ``names``
    maps worker pids to their ids; other processes are left out."""
    samples: list[MemSample] = []
    current: dict[int, int | None] = {}
    current_t: float | None = None

    def flush() -> None:
        nonlocal current, current_t
        if current_t is not None:
            known = tuple((names[p], b) for p, b in current.items() if p in names and b is not None)
            unknown = tuple(names[p] for p, b in current.items() if p in names and b is None)
            samples.append(MemSample(current_t, known, unknown))
        current, current_t = {}, None

    for t, line in lines:
        parsed = parse_nvidia_smi_line(line)
        if parsed is None:
            if line.strip():  # "No running processes found": a poll with no process at all
                flush()
                samples.append(MemSample(t, ()))
            continue
        pid, used = parsed
        if pid in current:
            flush()
        if current_t is None:
            current_t = t
        current[pid] = used
    flush()
    return samples


# ---- the samplers ----------------------------------------------------------------------------


def nvidia_smi_available() -> bool:
    return shutil.which("nvidia-smi") is not None


def choose_source(backends: Iterable[str]) -> str:
    """``"nvidia-smi"`` when a worker runs on CUDA and nvidia-smi is on PATH, else ``"rss"``."""
    if any(b.upper().startswith("CUDA") for b in backends) and nvidia_smi_available():
        return "nvidia-smi"
    return "rss"


def read_rss(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes (``/proc/<pid>/statm``), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") if len(fields) > 1 else None


class MemorySampler:
    """Samples the memory of the workers ``pids`` (id → pid) every ``interval_ms`` from ``source``
    between :meth:`start` and :meth:`stop`. Its thread owns the samples; :meth:`stop` returns them."""

    def __init__(self, pids: Mapping[str, int], interval_ms: int, source: str) -> None:
        if interval_ms < 1:
            raise ValueError("--sample-memory-ms must be at least 1 (or 0 to turn sampling off)")
        if source not in ("nvidia-smi", "rss"):
            raise ValueError(f"unknown memory source {source!r}: use 'nvidia-smi' or 'rss'")
        self.pids = dict(pids)
        self.interval_ms = interval_ms
        self.source = source
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._samples: list[MemSample] = []
        self._lines: list[tuple[float, str]] = []
        #: pids nvidia-smi listed that are no worker's (other programs, or the workers' own pids as
        #: another pid namespace sees them: then no sample matches a worker)
        self.other_pids: tuple[int, ...] = ()

    def start(self) -> None:
        if self.source == "nvidia-smi":
            cmd = [
                "nvidia-smi",
                "--query-compute-apps=pid,used_memory",
                "--format=csv,noheader,nounits",
                "-lms",
                str(self.interval_ms),
            ]
            self._proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1
            )
            target = self._read_nvidia_smi
        else:
            target = self._poll_rss
        self._thread = threading.Thread(target=target, name="memwatch", daemon=True)
        self._thread.start()

    def stop(self) -> list[MemSample]:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5.0)
        if self._thread is not None:
            self._thread.join(10.0)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
        if self.source == "nvidia-smi":
            names = {pid: key for key, pid in self.pids.items()}
            seen = {p[0] for _, line in self._lines if (p := parse_nvidia_smi_line(line)) is not None}
            self.other_pids = tuple(sorted(seen - set(names)))
            return group_nvidia_smi_lines(self._lines, names)
        return list(self._samples)

    def _poll_rss(self) -> None:
        period = self.interval_ms / 1000.0
        next_t = time.monotonic()
        while not self._stop.is_set():
            t = time.monotonic()
            values = ((key, read_rss(pid)) for key, pid in self.pids.items())
            self._samples.append(MemSample(t, tuple((k, v) for k, v in values if v is not None)))
            next_t += period
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def _read_nvidia_smi(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.append((time.monotonic(), line))
        rc = self._proc.wait()
        if rc not in (0, -15) and not self._stop.is_set():
            log.warning("nvidia-smi exited with status %s while sampling memory", rc)
