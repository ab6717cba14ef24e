"""Typed restore timelines: what an overlapped restore's upload gate saw once settled."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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
    pending_bytes_at_first_node: float
    gate_calls: float
    gate_waits: float
    gate_wait_ms: float
    gate_ranges: float

    def as_dict(self) -> dict[str, float]:
        """The fields by name, in this order (the keys of the logged JSON line)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}
