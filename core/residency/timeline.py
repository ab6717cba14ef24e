"""Typed release and restore timelines: the steps of the last in-place release and restore, and
what an overlapped restore's upload gate saw once settled."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from .gate import GateStats

log = logging.getLogger(__name__)


def log_restore_steps(model_path: str, steps: Mapping[str, float]) -> None:
    """One "restore steps (model): {json}" line per restore: every step it recorded (the
    hand-over's take and map, the room, the copy, the KV level's), for the lab scripts that take
    a switch's cost apart from the worker logs (scripts/lab/switch_steps.py)."""
    log.info(
        "restore steps (%s): %s", model_path, json.dumps({k: round(float(v), 3) for k, v in steps.items()})
    )


@dataclass(frozen=True)
class ReleaseSteps:
    """The last in-place release (``Residency.release_steps``): its milliseconds and how many
    buffers and layer parts it freed; all None on other paths and before the first release.
    ``as_dict()`` gives the keys the diagnostics' JSON has always printed (none: ``{}``)."""

    free_ms: float | None = None  # swapping and freeing the buffers
    buffers: int | None = None
    parts: int | None = None
    # the deep level (issue 39): saving the KV cells in use to host memory, before the buffers
    # go; its way: "raw" (straight from the KV tensors, residency/kvsave.py) or "state"
    # (llama_state_seq_get_data); None where that release did not save them
    kv_save_ms: float | None = None
    kv_save_bytes: int | None = None
    kv_save_path: str | None = None
    # whether that save allocated its host memory (1) or found it held already (0: grown ahead
    # while idle, or by an earlier release), and what the allocation took (0.0: none)
    kv_host_grown: int | None = None
    kv_host_alloc_ms: float | None = None

    def as_dict(self) -> dict[str, float | str]:
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class RestoreSteps:
    """Milliseconds of the last in-place restore's steps (``Residency.restore_steps``); None: a
    step this restore did not have (a synchronous one has no ``uploads_ms``, an overlapped one no
    ``total_ms``; the parallel one of Vulkan only alloc, copy, buffers and total). ``as_dict()``
    gives the keys the diagnostics' JSON has always printed: those of the steps it had."""

    alloc_ms: float | None = None  # allocation and relocation (the copies run meanwhile)
    first_alloc_ms: float | None = None  # before the first copy could start
    alloc_max_ms: float | None = None  # the slowest single buffer allocation
    copy_ms: float | None = None  # the upload thread busy
    wait_ms: float | None = None  # waiting for the uploads at the end
    total_ms: float | None = None  # a synchronous restore, whole
    buffers: float | None = None  # (counts are kept as the restore gave them: whole numbers)
    parts: float | None = None
    overlapped: float | None = None  # 1.0 / 0.0
    pending_bytes: float | None = None  # still to upload when an overlapped restore returned
    first_upload_at_ms: float | None = None  # from the restore's start
    upload_wall_ms: float | None = None  # first copy's start to last copy's end
    upload_gaps_ms: float | None = None  # the upload thread idle in between
    uploads_ms: float | None = None  # an overlapped restore's upload wall time
    first_node_at_ms: float | None = None
    last_wait_end_at_ms: float | None = None
    last_upload_end_at_ms: float | None = None
    reserve_ms: float | None = None  # the scheduler's reserve (graphs reset)
    returned_ms: float | None = None  # until restore() returned
    # the deep level's KV cells, written layer by layer after each part's weights (issue 39):
    # the KV and compute buffers' allocation (before the weights'), bytes, the time spent writing
    # them, and (on the weights' timeline) when the first began and the last ended
    kv_alloc_ms: float | None = None
    kv_bytes: float | None = None
    kv_upload_ms: float | None = None
    kv_first_upload_at_ms: float | None = None
    kv_last_upload_end_at_ms: float | None = None
    # handed-over memory (issue 40): mapping it (take, import, create what was lacking, map)
    handover_ms: float | None = None
    handed_chunks: float | None = None  # chunks taken from the holder (nothing allocated)
    created_chunks: float | None = None  # chunks allocated (cuMemCreate) by this restore
    creates_total: float | None = None  # the worker's cuMemCreate calls since it started
    mapped_chunks: float | None = None  # chunks mapped by this restore (cuMemMap calls)
    kept_chunks: float | None = None  # chunks still mapped since the release: nothing to map
    # of those, chunks whose memory still held the weights (the holder vouched nobody else mapped
    # them since the release): their buffers were not uploaded
    intact_chunks: float | None = None
    uploaded_bytes: float | None = None  # weight bytes copied from the host shadow
    skipped_upload_bytes: float | None = None  # weight bytes not copied: still in kept memory
    # the bytes the restore allocates after the weights (a deep restore's new context: its KV
    # cache and compute buffers; a projector), kept out of the room the take said this worker
    # may allocate chunks in (room_bytes; absent when the take said none)
    later_bytes: float | None = None
    room_bytes: float | None = None
    # a vision projector's restore (issue 41), off the caller's path on a thread of its own once
    # the model's restore returned: its allocation and upload, and how long it first waited for
    # the model's uploads (from its start); known once joined (an image encode, a release)
    projector_ms: float | None = None
    projector_after_ms: float | None = None

    @classmethod
    def of(cls, steps: Mapping[str, float]) -> RestoreSteps:
        """From the steps as the in-place path records them while it restores."""
        return cls(**steps)

    def as_dict(self) -> dict[str, float]:
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


#: fields named otherwise than the restore step they come from
_STEP_KEY = {"settle_wait_ms": "wait_ms"}


@dataclass(frozen=True)
class OverlapTimeline:
    """The last settled overlapped restore (``Residency.last_overlap``): its steps (ms), its
    timeline from the restore's start (``*_at_ms``), and the gate's counts. Counts and bytes stay
    floats, as the JSON line ``settle()`` logs (and bench api reads back) has always carried them."""

    alloc_ms: float
    uploads_ms: float
    copy_ms: float
    settle_wait_ms: float
    first_alloc_ms: float
    first_upload_at_ms: float
    upload_gaps_ms: float
    reserve_ms: float
    returned_ms: float
    first_node_at_ms: float
    last_wait_end_at_ms: float
    last_upload_end_at_ms: float
    pending_bytes: float
    kv_bytes: float  # the deep level's KV cells, uploaded with the parts (0: not a deep restore)
    kv_upload_ms: float
    kv_last_upload_end_at_ms: float
    pending_bytes_at_first_node: float
    gate_calls: float
    gate_waits: float
    gate_wait_ms: float
    gate_ranges: float

    @classmethod
    def settled(cls, steps: Mapping[str, float], stats: GateStats) -> OverlapTimeline:
        """From a settled restore's ``restore_steps`` (0.0 for a step it has not) and its gate's
        counts."""
        gate = {
            "pending_bytes_at_first_node": float(stats.pending_bytes_at_start),
            "gate_calls": float(stats.calls),
            "gate_waits": float(stats.waits),
            "gate_wait_ms": stats.wait_s * 1000,
            "gate_ranges": float(stats.ranges),
        }
        timed = {
            f.name: steps.get(_STEP_KEY.get(f.name, f.name), 0.0)
            for f in dataclasses.fields(cls)
            if f.name not in gate
        }
        return cls(**timed, **gate)

    def as_dict(self) -> dict[str, float]:
        """The fields by name, in this order (the keys of the logged JSON line)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}
