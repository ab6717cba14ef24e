"""What a residency's release and restore report to their caller (and log, one line each)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..state import WorkerReleaseLevel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReleaseReport:
    ms: float
    #: what the memory measure (device free memory, or RSS) says this call freed
    freed_bytes: int
    level: WorkerReleaseLevel
    #: exact bytes of the weight parts this call released, and of those resident after it
    released_bytes: int = 0
    resident_bytes: int = 0

    @classmethod
    def logged(
        cls, model_path: str, ms: float, freed: int, level: WorkerReleaseLevel, released: int, resident: int
    ) -> ReleaseReport:
        """The report of a release of ``model_path``, logged."""
        log.info(
            "released %s (%s): %.2f ms, %.1f MB freed, %.1f MB of weights resident",
            model_path,
            level,
            ms,
            freed / 1e6,
            resident / 1e6,
        )
        return cls(ms, freed, level, released, resident)


@dataclass(frozen=True)
class RestoreReport:
    ms: float
    bytes: int
    gbps: float
    level: WorkerReleaseLevel
    #: the in-place path: whether a weight buffer came back at another address (None: not known,
    #: another path); graphs_reset: whether the context's graphs were made to be built anew
    addresses_moved: bool | None = None
    graphs_reset: bool = False
    #: the uploads go on after this call returned (``ms`` is then the allocation only) and the
    #: next decode waits for each part it reaches that is not in yet: ``pending_bytes`` were
    #: still to upload as it returned (the uploads began with the first part's allocation, so
    #: some, or even all, may be over by then)
    overlapped: bool = False
    pending_bytes: int = 0

    @classmethod
    def logged(
        cls,
        model_path: str,
        dt: float,
        nbytes: int,
        level: WorkerReleaseLevel,
        moved: bool | None,
        reset: bool,
        overlapped: bool,
        pending: int,
    ) -> RestoreReport:
        """The report of a restore of ``model_path`` that took ``dt`` seconds, logged."""
        gbps = nbytes / 1e9 / dt if dt > 0 and not overlapped else 0.0
        # the rate of what this call moved, once it is all there: none while uploads go on (an
        # overlapped restore's uploads end at its settle, whose line has its timeline)
        rate = f", {nbytes / 1e9 / dt:.2f} GB/s" if dt > 0 and nbytes and not pending else ""
        log.info(
            "restored %s (%s): %.2f ms, %.1f MB%s%s%s",
            model_path,
            level,
            dt * 1000,
            nbytes / 1e6,
            rate,
            "" if moved is None else f", weights {'moved' if moved else 'back at their addresses'}",
            f", overlapped ({pending / 1e6:.1f} MB uploading on)" if overlapped else "",
        )
        return cls(dt * 1000.0, nbytes, gbps, level, moved, reset, overlapped, pending)
