"""The hand-over of device memory (issue 40) in the diagnostics: a holder of their own for
``doctor --handover`` and ``bench residency --handover`` (a fresh arena in a temporary folder, so
a running Timeshare's arena is never touched), the report's figures and its text lines."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..arena.handclient import HandoverClient
from ..arena.handover import HandoverError


@contextlib.contextmanager
def handover_source(on: bool) -> Iterator[HandoverClient | None]:
    """A connection to a holder started for this run (None when ``on`` is False); the holder
    exits, closing what it holds, once the connection ends."""
    if not on:
        yield None
        return
    work = Path(tempfile.mkdtemp(prefix="timeshare-handover-"))
    client = HandoverClient(work / "arena", "diagnostics")
    try:
        client.connect()
        yield client
    finally:
        client.close()
        shutil.rmtree(work, ignore_errors=True)


def handover_report(res: Any, client: HandoverClient | None) -> dict[str, Any]:
    """The residency's hand-over figures; off: whether this machine could use it, and why not."""
    out: dict[str, Any] = dict(res.handover)
    if client is not None:
        try:
            out["holder"] = client.status()
        except HandoverError as exc:
            out["holder"] = {"error": str(exc)}
        return out
    from ..residency.residency import handed_memory

    mem, why = handed_memory(res.device, None)
    out["possible"] = mem is not None
    out["possible_note"] = why or f"{mem.device.name if mem else ''}: turn it on with arena.handover"
    return out


def handover_lines(h: dict[str, Any] | None) -> list[str]:
    if not h:
        return []
    if not h.get("on"):
        could = "possible" if h.get("possible") else "not possible"
        return [f"hand-over:          off: {h.get('note', '')}; {could} here: {h.get('possible_note', '')}"]
    chunk = int(h["chunk_bytes"])
    line = (
        f"hand-over:          {h['device']}, chunks of {chunk / 2**20:.0f} MiB: "
        f"{h['handed_chunks']} handed over "
        f"({h['handed_chunks'] * chunk / 1e9:.2f} GB), {h['created_chunks']} allocated "
        f"({h['creates']} cuMemCreate/memfd calls), padding {h['padding_bytes'] / 1e6:.1f} MB; "
        f"{h.get('reused_chunks', 0)} found still mapped (kept since the release), "
        f"{h.get('maps', 0)} map calls"
    )
    notes = [x for x in (h.get("note"), h.get("source_note")) if x]
    return [line + (f" ({'; '.join(notes)})" if notes else "")]
