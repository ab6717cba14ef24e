"""What the tray shows, as pure functions of a ``PoolSnapshot``.

No Qt here: the tray turns these entries into a QMenu each time the menu is about to show, and the
tests check the mapping without any tray.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from ..core import words
from ..core.errors import ModelFileError
from ..core.state import ModelState, ModelStatus, PoolSnapshot
from . import strings
from .waits import model_wait, with_seconds

#: a FAILED model's failure_code when its file is the problem
MODEL_FILE_FAILURE = ModelFileError.code


class TrayState(str, enum.Enum):
    IDLE = "idle"  # no model holds the GPU
    HOLDING = "holding"  # a model's weights are on the GPU
    SWITCHING = "switching"  # a handoff or a load is in progress
    ERROR = "error"  # at least one model failed


class Command(str, enum.Enum):
    PIN = "pin"
    UNPIN = "unpin"
    SLEEP = "sleep"
    WAKE = "wake"
    RESTART = "restart"
    LOCATE_FILE = "locate_file"  # a model whose file is missing or unusable: pick the file
    REMOVE_MODEL = "remove_model"
    CHAT = "chat"
    OPEN_CHAT = "open_chat"
    ADD_MODEL = "add_model"
    GET_MODEL = "get_model"
    SETTINGS = "settings"
    START_AT_LOGIN = "start_at_login"
    SHOW_LOG = "show_log"
    QUIT = "quit"


@dataclass(frozen=True)
class Action:
    text: str
    command: Command
    model: str | None = None
    enabled: bool = True
    checkable: bool = False
    checked: bool = False


@dataclass(frozen=True)
class Label:
    """A line of information (shown disabled)."""

    text: str


@dataclass(frozen=True)
class Separator:
    pass


@dataclass(frozen=True)
class Submenu:
    text: str
    model: str
    entries: tuple[Entry, ...]


Entry = Action | Label | Separator | Submenu


def display_state(status: ModelStatus, gpu: bool = True) -> str:
    """The words the menu shows for a model's state (core/words.py): "on the GPU", "answering",
    "set aside — ready in 0.1 s", "waiting for the GPU", "asleep", "partly on the GPU (62 %)",
    "stopped", "failed" ... ("in memory", "waiting for its turn" where ``gpu`` is False)."""
    return strings.state_of(status, gpu)


def _holder(snapshot: PoolSnapshot) -> ModelStatus | None:
    return snapshot.model(snapshot.holder) if snapshot.holder else None


def tray_state(snapshot: PoolSnapshot) -> TrayState:
    if any(m.state is ModelState.FAILED for m in snapshot.models):
        return TrayState.ERROR
    if snapshot.switching or any(
        m.state in (ModelState.STARTING, ModelState.LOADING) for m in snapshot.models
    ):
        return TrayState.SWITCHING
    if _holder(snapshot) is not None:
        return TrayState.HOLDING
    return TrayState.IDLE


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def tooltip(snapshot: PoolSnapshot, waited: Mapping[str, float] | None = None) -> str:
    """One line naming the holder and what the others wait for, with the seconds ``waited``
    (model id → seconds, from a WaitClock): "SmolLM2 holds the GPU (pinned) · Gemma waiting for
    the GPU: pinned by smollm2, 12 s · 1 other set aside"."""
    if not snapshot.models:
        return "Timeshare · no models configured"
    waited = waited or {}
    holder = _holder(snapshot)
    others = [m for m in snapshot.models if holder is None or m.id != holder.id]
    waits = [(m, model_wait(m, snapshot.holder)) for m in others]
    waiting = [
        with_seconds(
            strings.plain_reason(strings.for_people(f"{m.display_name} {phrase}", snapshot)), waited.get(m.id)
        )
        for m, phrase in waits
        if phrase
    ]
    gpu = strings.has_gpu(snapshot)
    others = [m for m, phrase in waits if not phrase]  # counted by state below
    shared = devices_line(snapshot)
    if shared:
        head = shared
    elif holder is not None:
        head = f"{holder.display_name} {strings.holds(gpu)}"
        if holder.pinned:
            head += " (pinned)"
    elif snapshot.switching:
        head = strings.switching(gpu)
    else:
        head = strings.nobody_holds(gpu)
    parts = [head, *waiting]
    for state in (
        ModelState.RELEASED,
        ModelState.SLEEPING,
        ModelState.STARTING,
        ModelState.LOADING,
        ModelState.STOPPED,
        ModelState.FAILED,
    ):
        n = sum(1 for m in others if m.state is state)
        if n:
            # "1 other set aside" beside a named holder, "2 asleep" otherwise
            others_word = holder is not None and state is ModelState.RELEASED
            parts.append(words.state_count(n, state.value, gpu, others=others_word))
    return " · ".join(parts)


def gb_text(n: int) -> str:
    value = n / 1e9
    text = f"{value:.2f}" if value < 1 else f"{value:.1f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def devices_line(snapshot: PoolSnapshot) -> str:
    """Where a budget lets several models stay on a GPU at once: "2 models on the GPU (8.4 of
    20 GB)" (per GPU when there are several: "GPU 1: 2 models (8.4 of 20 GB)"); "" otherwise."""
    parts = []
    many = len(snapshot.devices) > 1
    for d in snapshot.devices:
        if len(d.holders) < 2:
            continue
        figures = f" ({gb_text(d.leased_bytes)} of {gb_text(d.budget_bytes)} GB)" if d.budget_bytes else ""
        if many:
            parts.append(f"GPU {d.index}: {len(d.holders)} models{figures}")
        else:
            parts.append(f"{strings.models_together(len(d.holders), strings.has_gpu(snapshot))}{figures}")
    return " · ".join(parts)


def model_title(status: ModelStatus, holder: str | None, gpu: bool = True) -> str:
    title = f"{status.display_name} — {display_state(status, gpu)}"
    if status.id == holder and status.state is not ModelState.RESIDENT:
        title += f", {strings.holds(gpu)}"  # e.g. restoring: it has the token, not yet its weights
    if status.pinned:
        title += ", pinned"
    return title


def model_entries(status: ModelStatus, waited: float | None = None) -> tuple[Entry, ...]:
    """A model's submenu; ``waited``: the seconds it has waited for what it waits for."""
    state = status.state
    alive = state not in (ModelState.FAILED, ModelState.STOPPED)
    entries: list[Entry] = []
    wait = model_wait(status, None)
    if wait:
        entries.append(Label(with_seconds(strings.plain_reason(wait), waited)))
    elif status.reason:
        entries.append(Label(strings.plain_reason(status.reason)))
    if status.licence:
        entries.append(Label(f"Licence: {status.licence}"))
    if held := strings.holds_now(status):
        entries.append(Label(held))
    if entries:
        entries.append(Separator())
    if status.pinned:
        entries.append(Action("Unpin", Command.UNPIN, status.id, enabled=alive))
    else:
        entries.append(Action("Pin", Command.PIN, status.id, enabled=alive))
    entries.append(
        Action(
            "Sleep",
            Command.SLEEP,
            status.id,
            # a model set aside is off the GPU already: nothing for Sleep to do that a user sees
            enabled=state is ModelState.RESIDENT and not status.busy,
        )
    )
    if alive:
        entries.append(
            Action(
                "Wake", Command.WAKE, status.id, enabled=state in (ModelState.RELEASED, ModelState.SLEEPING)
            )
        )
    else:
        entries.append(Action("Restart", Command.RESTART, status.id))
    entries.append(Action("Chat…", Command.CHAT, status.id, enabled=alive))
    if state is ModelState.FAILED and status.failure_code == MODEL_FILE_FAILURE:
        # its file is missing, unreadable or not a GGUF: point at the file, or drop the model
        entries += [
            Separator(),
            Action("Locate file…", Command.LOCATE_FILE, status.id),
            Action("Remove", Command.REMOVE_MODEL, status.id),
        ]
    return tuple(entries)


def menu_entries(
    snapshot: PoolSnapshot, *, start_at_login: bool, waited: Mapping[str, float] | None = None
) -> tuple[Entry, ...]:
    """The whole tray menu for this snapshot, top to bottom (``waited``: as for ``tooltip``)."""
    waited = waited or {}
    entries: list[Entry] = [Label(tooltip(snapshot, waited)), Separator()]
    if snapshot.models:
        for status in snapshot.models:
            sub = model_entries(status, waited.get(status.id))
            entries.append(
                Submenu(model_title(status, snapshot.holder, strings.has_gpu(snapshot)), status.id, sub)
            )
    else:
        entries.append(Label("No models yet: add one"))
    entries += [
        Separator(),
        Action("Open chat", Command.OPEN_CHAT),
        Action("Add model…", Command.ADD_MODEL),
        Action("Get model…", Command.GET_MODEL),
        Action("Settings…", Command.SETTINGS),
        Separator(),
        Action("Start at login", Command.START_AT_LOGIN, checkable=True, checked=start_at_login),
        Action("Show log", Command.SHOW_LOG),
        Separator(),
        Action("Quit", Command.QUIT),
    ]
    return tuple(entries)
