"""What people wait for, and for how long: the words the tray and the chat window show while a
model loads, waits for the GPU, restores to it or reads the prompt.

Qt-free, like menu_model: the tray and the window hand in a snapshot and the seconds a
``WaitClock`` counted, and show what comes back; the tests check the words without a display.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..core.state import ModelState, ModelStatus, PoolSnapshot

#: a wait shows its seconds once it lasts this long ("waiting for the GPU: pinned by x, 12 s")
SHOW_SECONDS_FROM = 1.0

#: what a worker's loading stages mean to people (protocol.Loading.stage)
LOADING_STAGES = {
    "model": "reading the model file",
    "residency": "preparing GPU switching",
}

_LOADING = (ModelState.STARTING, ModelState.LOADING)


def with_seconds(phrase: str, seconds: float | None) -> str:
    """``phrase`` with how long it has lasted: "Loading X… 3 s", "waiting for the GPU, 12 s"."""
    if seconds is None or not math.isfinite(seconds) or seconds < SHOW_SECONDS_FROM:
        return phrase
    return f"{phrase}{' ' if phrase.endswith('…') else ', '}{int(seconds)} s"


def wait_kind(status: ModelStatus, holder: str | None) -> str:
    """What a model waits for, as a category: "loading", "gpu" (waiting for the token, or
    restoring its weights to the GPU for a request) or "" (it does not wait). A clock counts
    each category from when it began."""
    if status.state in _LOADING:
        return "loading"
    if status.state in (ModelState.FAILED, ModelState.STOPPED):
        return ""
    if status.busy and status.state in (ModelState.RELEASED, ModelState.SLEEPING):
        return "gpu"  # it holds the GPU token (``holder``) once granted, restoring until RESIDENT
    if status.reason and status.reason.startswith("waiting"):
        return "gpu"  # e.g. a wake (no request) that waits for the GPU
    return ""


def model_wait(status: ModelStatus, holder: str | None) -> str:
    """What a model waits for, as a phrase after its name ("loading", "waiting for the GPU:
    pinned by gemma3-270m", "restoring to the GPU"); "" when it does not wait."""
    kind = wait_kind(status, holder)
    if kind == "loading":
        return status.reason or "loading"  # e.g. "restarting in 2 s after a crash"
    if kind == "gpu":
        return status.reason or "restoring to the GPU"
    return ""


class WaitClock:
    """Since when each key (a model id, or the chat window's answer) has waited for its current
    kind of wait; a new kind starts the count again, no wait forgets it."""

    def __init__(self) -> None:
        self._since: dict[str, tuple[str, float]] = {}

    def mark(self, key: str, kind: str, now: float) -> float | None:
        """Note that ``key`` waits for ``kind`` ("" for nothing) at ``now``; returns the seconds
        it has waited for it (None when it does not wait)."""
        if not kind:
            self._since.pop(key, None)
            return None
        held = self._since.get(key)
        if held is None or held[0] != kind:
            self._since[key] = (kind, now)
            return 0.0
        return max(0.0, now - held[1])

    def observe(self, snapshot: PoolSnapshot, now: float) -> dict[str, float]:
        """Mark every model of ``snapshot``; returns the seconds each waiting model has waited."""
        waited: dict[str, float] = {}
        for status in snapshot.models:
            seconds = self.mark(status.id, wait_kind(status, snapshot.holder), now)
            if seconds is not None:
                waited[status.id] = seconds
        self.keep(m.id for m in snapshot.models)
        return waited

    def keep(self, keys: Iterable[str]) -> None:
        """Forget every key but these (models that were removed)."""
        kept = set(keys)
        for key in [k for k in self._since if k not in kept]:
            del self._since[key]


def loading_phrase(status: ModelStatus, stage: str = "") -> str:
    """The chat window's line while a model loads: "Loading SmolLM2 (reading the model file)…"."""
    if status.reason:
        return f"{status.display_name}: {status.reason}"
    words = LOADING_STAGES.get(stage, stage)
    return f"Loading {status.display_name} ({words})…" if words else f"Loading {status.display_name}…"


def chat_wait_line(
    status: ModelStatus,
    holder: str | None,
    *,
    answering: bool,
    seconds: float | None = None,
    stage: str = "",
) -> str:
    """The chat window's line under the transcript while the user waits; "" when nothing is
    awaited. ``answering``: a request was sent and no text came yet."""
    kind = chat_wait_kind(status, holder, answering=answering)
    if kind == "loading":
        return with_seconds(loading_phrase(status, stage), seconds)
    if kind == "gpu":
        if status.reason:
            return with_seconds(f"{status.display_name} is {status.reason}", seconds)
        return with_seconds(f"Restoring {status.display_name} to the GPU…", seconds)
    if kind == "thinking":
        return with_seconds(f"{status.display_name} is reading the prompt…", seconds)
    return ""


def chat_wait_kind(status: ModelStatus, holder: str | None, *, answering: bool) -> str:
    """The chat window's kind of wait: the model's (loading, gpu) or, once it holds the GPU
    with a request and no text yet, "thinking" (it reads the prompt); "" when nothing."""
    kind = wait_kind(status, holder)
    if kind == "loading":
        return kind
    if not answering:
        return kind if kind == "gpu" and status.reason else ""  # a wake waiting for the GPU
    if kind:
        return kind
    if status.state is not ModelState.RESIDENT:
        return "gpu"  # the request is on its way: the worker takes the GPU next
    return "thinking"
