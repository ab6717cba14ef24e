"""``--card SIZE`` for bench api, doctor and arena-test (issue 39, item 5): measure as on a card of
SIZE. On a GPU a ballast process (:mod:`.ballast`) holds all but SIZE of the GPU's free memory
before anything starts, and lets it go when the run ends; on a CPU build (no CUDA GPU here) the
same option sets a host-memory budget instead: ``$TIMESHARE_HOST_MEMORY`` = SIZE, which the
workers' device (host memory) is capped by (core/worker/device.py), so the auto budget and the fit
of n_ctx/parallel see a machine of SIZE.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import envvars
from ..errors import TimeshareError
from ..util.units import decimal_bytes, parse_size

#: the host-memory cap of a CPU build (read by core/worker/device.host_memory)
HOST_MEMORY_ENV = envvars.HOST_MEMORY.name
#: how long the ballast may take to allocate (an 80 GB GPU in 1 GiB pieces: seconds)
READY_TIMEOUT_S = 120.0


class CardError(TimeshareError):
    code = "card"


@dataclass(frozen=True)
class CardReport:
    """What ``--card`` did: ``kind`` "gpu" (a ballast holds the rest) or "host" (a memory cap)."""

    size: int
    kind: str
    total: int = 0  # the GPU's (or the host's) memory
    held: int = 0  # the ballast's bytes (gpu)
    free_before: int = 0
    free_after: int = 0  # what is left for the run (gpu: measured after the ballast)
    api: str = ""  # "cudart" | "cuda" (gpu)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.kind == "host":
            return f"card {decimal_bytes(self.size)}: host memory capped ({self.note})"
        return (
            f"card {decimal_bytes(self.size)}: a ballast holds {decimal_bytes(self.held)} of the GPU's "
            f"{decimal_bytes(self.total)}; {decimal_bytes(self.free_after)} free for the run"
        )


def parse_card(text: str) -> int:
    """``--card``'s SIZE in bytes. Raises CardError with a sentence."""
    try:
        size = parse_size(text.strip())
    except ValueError as exc:
        raise CardError(f"--card: {exc}") from None
    if size <= 0:
        raise CardError(f"--card: {text!r}: the card must be more than 0 bytes")
    return size


def _host_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _start_ballast(
    size: int, device: int, argv: list[str] | None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = argv or [sys.executable, "-m", "timeshare.core.diagnostics.ballast"]
    proc = subprocess.Popen(
        [*cmd, "--leave", str(size), "--device", str(device)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""))
    reader.start()
    reader.join(READY_TIMEOUT_S)
    if reader.is_alive() or not line or not line[0].strip():
        proc.kill()
        err = _end(proc)
        raise CardError(f"--card: the ballast process did not start ({err.strip()[-500:] or 'no answer'})")
    try:
        report: dict[str, Any] = json.loads(line[0])
    except ValueError:
        proc.kill()
        _end(proc)
        raise CardError(f"--card: the ballast process answered {line[0][:200]!r}") from None
    return proc, report


def _end(proc: subprocess.Popen[str]) -> str:
    """Close the ballast's stdin (it lets its memory go and exits), reap it; its stderr."""
    try:
        return proc.communicate(timeout=10)[1] or ""
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1] or ""


@contextlib.contextmanager
def hold_card(
    card: str | None, device: int = 0, ballast_argv: list[str] | None = None
) -> Iterator[CardReport | None]:
    """While the block runs, the machine looks like a card of ``card`` (None: nothing is done).
    Raises CardError for a bad size, a card larger than the GPU (or the host's memory, or the
    GPU's free memory)."""
    if not card:
        yield None
        return
    size = parse_card(card)
    proc, report = _start_ballast(size, device, ballast_argv)
    if report.get("ok"):
        try:
            yield CardReport(
                size=size,
                kind="gpu",
                total=int(report["total"]),
                held=int(report["held"]),
                free_before=int(report["free_before"]),
                free_after=int(report["free_after"]),
                api=str(report.get("api", "")),
            )
        finally:
            _end(proc)
        return
    _end(proc)
    if report.get("gpu"):
        raise CardError(f"--card: {report.get('reason', 'the ballast failed')}")
    total = _host_total()
    if size > total:
        raise CardError(
            f"--card: a card of {decimal_bytes(size)} is larger than this machine's memory "
            f"({decimal_bytes(total)}) and there is no GPU: give a smaller --card"
        )
    environ = envvars.process_environ()
    before = environ.get(HOST_MEMORY_ENV)
    environ[HOST_MEMORY_ENV] = str(size)  # inherited by serve and the workers
    try:
        yield CardReport(
            size=size, kind="host", total=total, note=f"${HOST_MEMORY_ENV}={size}; {report.get('reason', '')}"
        )
    finally:
        if before is None:
            environ.pop(HOST_MEMORY_ENV, None)
        else:
            environ[HOST_MEMORY_ENV] = before
