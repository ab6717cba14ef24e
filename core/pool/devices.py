"""Per-device summaries for a snapshot: each GPU's VRAM budget and the models holding it."""

from __future__ import annotations

from collections.abc import Iterable

from ..state import DeviceStatus, ModelStatus
from .record import WorkerRecord


def device_statuses(
    workers: Iterable[WorkerRecord], models: Iterable[ModelStatus]
) -> tuple[DeviceStatus, ...]:
    """One :class:`DeviceStatus` per device a configured model is placed on, in index order.
    Holders are listed most recent first (by the time the pool saw them take the GPU)."""
    by_id = {m.id: m for m in models}
    found: dict[int, dict[str, object]] = {}
    holders: dict[int, list[tuple[float, str, int]]] = {}
    for w in workers:
        info = w.info
        index = info.device if info is not None else w.config.device
        d = found.setdefault(index, {"name": "", "budget": "", "budget_bytes": None, "note": ""})
        status = by_id.get(w.id)
        if info is not None and w.alive:
            d["name"] = d["name"] or info.device_name
            d["budget"] = d["budget"] or info.budget_setting
            d["note"] = d["note"] or info.budget_note
            st = w.status
            if st is not None and info.budget_setting and info.budget_setting != "one-model":
                d["budget_bytes"] = st.budget_bytes
        if status is not None and status.holds_gpu:
            holders.setdefault(index, []).append((w.gpu_since, w.id, status.lease_bytes))
    out = []
    for index in sorted(found):
        d = found[index]
        held = sorted(holders.get(index, []), reverse=True)
        budget_bytes = d["budget_bytes"]
        out.append(
            DeviceStatus(
                index=index,
                name=str(d["name"]),
                budget=str(d["budget"]),
                budget_bytes=budget_bytes if isinstance(budget_bytes, int) else None,
                leased_bytes=sum(b for _, _, b in held),
                holders=tuple(i for _, i, _ in held),
                note=str(d["note"]),
            )
        )
    return tuple(out)
