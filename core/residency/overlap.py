"""An overlapped restore's upload gate in the llama context: installed as the restore returns
(its uploads go on while the next decode runs), taken out at the settle that follows, with the
timeline the gate saw (residency/gate.py, residency/evalhook.py)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

from .. import envvars
from ..errors import ResidencyError
from . import _ggml, evalhook
from .gate import PartGate
from .inplace import InPlace
from .probe import probe
from .timeline import OverlapTimeline, log_restore_steps

log = logging.getLogger(__name__)

#: the environment variable that turns overlapped restores off ("0") or on ("1")
OVERLAP_ENV = envvars.OVERLAP_RESTORE.name


def overlap_wanted(option: bool | None = None) -> bool | None:
    """The one rule for overlapped restores, as asked: ``TIMESHARE_OVERLAP_RESTORE`` = 0 / 1
    overrides ``option`` (``ResidencyOptions.overlap_restore``; None: auto, :func:`overlap_expected`)."""
    override = envvars.OVERLAP_RESTORE.switch()
    return option if override is None else override


def overlap_expected() -> bool:
    """Whether an attach here will overlap restores, known before any model loads (the worker
    splits a one-model budget's weights into parts only then): as asked, else auto, a CUDA build
    (the attach-time probe passes on CUDA only, never on Vulkan; off on the CPU build)."""
    wanted = overlap_wanted()
    return wanted if wanted is not None else probe().backend.startswith("CUDA")


def overlap_probed(wanted: bool | None, parts: int, gpu: _ggml.Device | None) -> bool:
    """Whether attach probes the eval hook (a few tiny decodes): only where overlap would be used."""
    return parts > 1 and (wanted is True or (wanted is None and gpu is not None))


def overlap_note(wanted: bool | None, gpu: _ggml.Device | None, ip: InPlace) -> str:
    """Why ``ip``'s restores are synchronous ("": they may overlap), as ``wanted``
    (:func:`overlap_wanted`) on ``gpu`` (None: the CPU build)."""
    if wanted is False:
        return f"off (ResidencyOptions.overlap_restore=False or {OVERLAP_ENV}=0)"
    if wanted is None and gpu is None:
        return (
            "off on the CPU build: the copy and the compute share the same cores, so overlapping them "
            f"is slower (docs/lab/HISTORY.md); ResidencyOptions.overlap_restore=True or {OVERLAP_ENV}=1 "
            "turns it on"
        )
    if len(ip.parts) < 2:
        return "one layer part: nothing to overlap (ResidencyOptions.parts > 1)"
    return "" if ip.hook is not None else ip.overlap_note


class RestoreGate:
    """Which context holds the upload gate of the in-place path's overlapped restore, and what
    the last one saw. The Residency (the loop thread) is its only caller."""

    def __init__(self, model_path: str) -> None:
        self._model_path = model_path
        self._ctx = 0  # the context the upload gate is installed in (0: none)
        #: what the last overlapped restore's gate saw, once settled
        self.last: OverlapTimeline | None = None

    @property
    def installed(self) -> bool:
        return self._ctx != 0

    def install(self, ip: InPlace, ctx: int, reset: bool) -> int | None:
        """After ``ip``'s restore: where its uploads go on (it made a gate), install the gate in
        ``ctx`` (the context the next decode runs in; 0: none, never expected: the uploads are
        waited for now), the scheduler reserved first where the graphs were ``reset``. Returns
        the bytes still to upload (None: not overlapped)."""
        gate = ip.uploads.gate
        if gate is None:
            return None
        if ip.hook is None or not ctx:
            ip.finish_uploads()  # no context to gate (never expected): synchronous
            return None
        if reset:  # now, not in the decode: a reserve frees compute buffers (on CUDA a device-wide wait)
            t_r = time.perf_counter()
            evalhook.reserve_now(ctx)
            ip.restore_steps["reserve_ms"] = (time.perf_counter() - t_r) * 1000
        evalhook.install(ctx, ip.hook, gate.pointer)
        self._ctx = ctx
        # the uploads began with the first part's allocation: some may be over already
        return gate.pending_bytes

    def take_out(self, ip: InPlace, live_ctx: int) -> None:
        """The gate out of its context (``live_ctx``: the one the model computes in now; a
        context freed meanwhile has no hook)."""
        if self._ctx:
            assert ip.hook is not None
            if live_ctx == self._ctx:
                evalhook.clear(self._ctx, ip.hook)
            self._ctx = 0

    def settled(self, steps: Mapping[str, float], gate: PartGate) -> None:
        """The restore's uploads are over (``steps``: its restore steps): :attr:`last` holds what
        its ``gate`` saw; ResidencyError where the gate failed."""
        self.last = OverlapTimeline.settled(steps, gate.stats)
        # one line per overlapped restore, its timeline from the restore's start (bench api
        # collects them from the worker logs)
        log.info(
            "overlapped restore settled (%s): %s",
            self._model_path,
            json.dumps({k: round(v, 3) for k, v in self.last.as_dict().items()}),
        )
        log_restore_steps(self._model_path, steps)
        if gate.error is not None:
            raise ResidencyError(f"the upload gate failed: {gate.error}") from gate.error
