"""The tray: state -> menu mapping (pure), tooltip, icon state, and the QMenu built from it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
from timeshare.app.menu_model import (
    Action,
    Command,
    Label,
    Separator,
    Submenu,
    TrayState,
    display_state,
    menu_entries,
    tooltip,
    tray_state,
)
from timeshare.app.waits import WaitClock, chat_wait_kind, chat_wait_line, with_seconds
from timeshare.core.state import ModelState, ModelStatus, PoolSnapshot


def status(model_id: str, state: ModelState, name: str = "", **kw: Any) -> ModelStatus:
    return ModelStatus(
        id=model_id, name=name or model_id.upper(), path=f"/m/{model_id}.gguf", state=state, **kw
    )


def three(holder_state: ModelState = ModelState.RESIDENT) -> PoolSnapshot:
    return PoolSnapshot(
        models=(
            status("qwen", holder_state, name="Qwen2.5-7B"),
            status("gemma", ModelState.RELEASED, licence="Gemma Terms of Use"),
            status("smol", ModelState.RELEASED, licence="Apache-2.0"),
        ),
        holder="qwen",
    )


def actions(entries: tuple[object, ...]) -> dict[Command, Action]:
    return {e.command: e for e in entries if isinstance(e, Action)}


def submenu(entries: tuple[object, ...], model: str) -> Submenu:
    found = [e for e in entries if isinstance(e, Submenu) and e.model == model]
    assert len(found) == 1
    return found[0]


# ---- tooltip and icon state -------------------------------------------------------------------


def test_tooltip_names_the_holder_and_counts_the_others() -> None:
    assert tooltip(three()) == "Qwen2.5-7B holds the GPU · 2 others set aside"


def test_tooltip_one_other_and_mixed_states() -> None:
    snap = PoolSnapshot(
        models=(
            status("a", ModelState.RESIDENT, name="A", pinned=True),
            status("b", ModelState.RELEASED),
            status("c", ModelState.SLEEPING),
            status("d", ModelState.FAILED),
        ),
        holder="a",
    )
    assert tooltip(snap) == "A holds the GPU (pinned) · 1 other set aside · 1 asleep · 1 failed"


def test_tooltip_without_holder_and_without_models() -> None:
    snap = PoolSnapshot(models=(status("a", ModelState.RELEASED), status("b", ModelState.LOADING)))
    assert tooltip(snap) == "No model holds the GPU · B loading · 1 set aside"
    assert tooltip(PoolSnapshot()) == "Timeshare · no models configured"
    assert tooltip(PoolSnapshot(models=(status("a", ModelState.RELEASED),), switching=True)).startswith(
        "Switching the GPU"
    )


@pytest.mark.parametrize(
    ("snapshot", "expected"),
    [
        (PoolSnapshot(), TrayState.IDLE),
        (PoolSnapshot(models=(status("a", ModelState.RELEASED),)), TrayState.IDLE),
        (three(), TrayState.HOLDING),
        (PoolSnapshot(models=three().models, holder="qwen", switching=True), TrayState.SWITCHING),
        (PoolSnapshot(models=(status("a", ModelState.LOADING),)), TrayState.SWITCHING),
        (
            PoolSnapshot(models=(*three().models, status("x", ModelState.FAILED)), holder="qwen"),
            TrayState.ERROR,
        ),
    ],
)
def test_tray_state(snapshot: PoolSnapshot, expected: TrayState) -> None:
    assert tray_state(snapshot) is expected


def test_holder_that_is_not_in_the_model_list_counts_as_idle() -> None:
    # the holder record can name a model that was just removed from the config
    snap = PoolSnapshot(models=(status("a", ModelState.RELEASED),), holder="gone")
    assert tray_state(snap) is TrayState.IDLE
    assert tooltip(snap).startswith("No model holds the GPU")


# ---- menu entries -----------------------------------------------------------------------------


def test_menu_has_one_submenu_per_model_then_the_app_actions() -> None:
    entries = menu_entries(three(), start_at_login=False)
    assert entries[0] == Label("Qwen2.5-7B holds the GPU · 2 others set aside")
    subs = [e for e in entries if isinstance(e, Submenu)]
    assert [s.model for s in subs] == ["qwen", "gemma", "smol"]
    assert subs[0].text == "Qwen2.5-7B — on the GPU"
    assert subs[1].text == "GEMMA — set aside"
    top = [e.command for e in entries if isinstance(e, Action)]
    assert top == [
        Command.OPEN_CHAT,
        Command.ADD_MODEL,
        Command.GET_MODEL,
        Command.SETTINGS,
        Command.START_AT_LOGIN,
        Command.SHOW_LOG,
        Command.QUIT,
    ]
    assert isinstance(entries[-2], Separator)


@pytest.mark.parametrize("checked", [True, False])
def test_start_at_login_is_checkable_and_reflects_the_setting(checked: bool) -> None:
    entry = actions(menu_entries(three(), start_at_login=checked))[Command.START_AT_LOGIN]
    assert entry.checkable and entry.checked is checked


def test_resident_model_actions() -> None:
    sub = submenu(menu_entries(three(), start_at_login=False), "qwen")
    acts = actions(sub.entries)
    assert set(acts) == {Command.PIN, Command.SLEEP, Command.WAKE, Command.CHAT}
    assert acts[Command.PIN].enabled and acts[Command.SLEEP].enabled and acts[Command.CHAT].enabled
    assert not acts[Command.WAKE].enabled  # already on the GPU
    assert all(a.model == "qwen" for a in acts.values())


def test_released_model_can_wake_and_shows_its_licence() -> None:
    sub = submenu(menu_entries(three(), start_at_login=False), "smol")
    assert Label("Licence: Apache-2.0") in sub.entries
    acts = actions(sub.entries)
    assert acts[Command.WAKE].enabled
    assert not acts[Command.SLEEP].enabled  # already off the GPU (issue 29)


def test_pinned_model_offers_unpin() -> None:
    snap = PoolSnapshot(models=(status("a", ModelState.RESIDENT, pinned=True),), holder="a")
    sub = submenu(menu_entries(snap, start_at_login=False), "a")
    acts = actions(sub.entries)
    assert Command.UNPIN in acts and Command.PIN not in acts
    assert sub.text.endswith("pinned")


def test_busy_model_shows_answering_and_cannot_be_put_to_sleep() -> None:
    snap = PoolSnapshot(models=(status("a", ModelState.RESIDENT, busy=True),), holder="a")
    sub = submenu(menu_entries(snap, start_at_login=False), "a")
    assert sub.text == "A — answering"
    assert not actions(sub.entries)[Command.SLEEP].enabled


def test_sleeping_model_can_wake_not_sleep() -> None:
    snap = PoolSnapshot(models=(status("a", ModelState.SLEEPING),))
    acts = actions(submenu(menu_entries(snap, start_at_login=False), "a").entries)
    assert acts[Command.WAKE].enabled and not acts[Command.SLEEP].enabled


@pytest.mark.parametrize("state", [ModelState.FAILED, ModelState.STOPPED])
def test_failed_or_stopped_model_offers_restart_and_shows_why(state: ModelState) -> None:
    snap = PoolSnapshot(models=(status("a", state, reason="model file is truncated: re-download it"),))
    sub = submenu(menu_entries(snap, start_at_login=False), "a")
    assert sub.entries[0] == Label("model file is truncated: re-download it")
    acts = actions(sub.entries)
    assert Command.RESTART in acts and acts[Command.RESTART].enabled
    assert Command.WAKE not in acts
    assert (
        not acts[Command.PIN].enabled and not acts[Command.SLEEP].enabled and not acts[Command.CHAT].enabled
    )


def test_a_model_whose_file_failed_offers_locate_and_remove() -> None:
    reason = "model file /m/a.gguf does not exist: check the path, which must name a .gguf file"
    snap = PoolSnapshot(
        models=(
            status("a", ModelState.FAILED, reason=reason, failure_code="model_file"),
            status("b", ModelState.FAILED, reason="b crashed 4 times within 60 s"),
        )
    )
    entries = menu_entries(snap, start_at_login=False)
    sub = submenu(entries, "a")
    plain = "the model file does not exist: check the path, which must name a .gguf file"
    assert sub.entries[0] == Label(plain)  # the path: under Details in the chat window
    acts = actions(sub.entries)
    assert acts[Command.LOCATE_FILE] == Action("Locate file…", Command.LOCATE_FILE, "a")
    assert acts[Command.REMOVE_MODEL] == Action("Remove", Command.REMOVE_MODEL, "a")
    assert acts[Command.RESTART].enabled
    crashed = actions(submenu(entries, "b").entries)  # not a file problem: Restart only
    assert Command.RESTART in crashed and Command.LOCATE_FILE not in crashed


def test_loading_model_allows_chat_but_not_sleep_or_wake() -> None:
    snap = PoolSnapshot(models=(status("a", ModelState.LOADING),))
    acts = actions(submenu(menu_entries(snap, start_at_login=False), "a").entries)
    assert acts[Command.CHAT].enabled
    assert not acts[Command.SLEEP].enabled and not acts[Command.WAKE].enabled


def test_no_models_says_how_to_add_one() -> None:
    entries = menu_entries(PoolSnapshot(), start_at_login=False)
    assert Label("No models yet: add one") in entries
    assert not any(isinstance(e, Submenu) for e in entries)
    assert actions(entries)[Command.ADD_MODEL].enabled


@pytest.mark.parametrize(
    ("state", "busy", "word"),
    [
        (ModelState.RESIDENT, False, "on the GPU"),
        (ModelState.RELEASED, False, "set aside"),
        (ModelState.SLEEPING, False, "asleep"),
        (ModelState.RESIDENT, True, "answering"),
        (ModelState.RELEASED, True, "waiting for the GPU"),  # a request waits for the GPU
        (ModelState.SLEEPING, True, "waking up"),
        (ModelState.STOPPED, False, "stopped"),
        (ModelState.FAILED, False, "failed"),
        (ModelState.LOADING, False, "loading"),
    ],
)
def test_display_state(state: ModelState, busy: bool, word: str) -> None:
    assert display_state(status("a", state, busy=busy)) == word


# ---- the QMenu built from the entries ---------------------------------------------------------


def test_populate_builds_actions_that_report_what_was_picked(qtbot: object) -> None:
    from PySide6.QtWidgets import QMenu
    from timeshare.app.tray import populate

    picked: list[Action] = []
    menu = QMenu()
    populate(menu, menu_entries(three(), start_at_login=True), picked.append)
    texts = [a.text() for a in menu.actions() if not a.isSeparator()]
    assert texts[0] == "Qwen2.5-7B holds the GPU · 2 others set aside"
    assert texts[-7:] == [
        "Open chat",
        "Add model…",
        "Get model…",
        "Settings…",
        "Start at login",
        "Show log",
        "Quit",
    ]
    login = next(a for a in menu.actions() if a.text() == "Start at login")
    assert login.isCheckable() and login.isChecked()

    gemma = next(a.menu() for a in menu.actions() if a.menu() and a.menu().objectName() == "model:gemma")
    assert "Licence: Gemma Terms of Use" in [a.text() for a in gemma.actions()]
    wake = next(a for a in gemma.actions() if a.text() == "Wake")
    wake.trigger()
    assert picked == [Action("Wake", Command.WAKE, "gemma")]

    # rebuilding replaces the old entries instead of appending to them
    populate(menu, menu_entries(PoolSnapshot(), start_at_login=False), picked.append)
    assert "No models yet: add one" in [a.text() for a in menu.actions()]
    assert not any(a.menu() for a in menu.actions())


# ---- what a model waits for, and for how long (app/waits.py) -----------------------------------

PINNED_WAIT = "waiting for the GPU: pinned by qwen"


def pinned_and_waiting() -> PoolSnapshot:
    return PoolSnapshot(
        models=(
            status("qwen", ModelState.RESIDENT, name="Qwen2.5-7B", pinned=True),
            status("gemma", ModelState.RELEASED, name="Gemma", busy=True, reason=PINNED_WAIT),
            status("smol", ModelState.RELEASED),
        ),
        holder="qwen",
    )


def test_the_tooltip_says_what_a_model_waits_for_and_how_long() -> None:
    snap = pinned_and_waiting()
    named = PINNED_WAIT.replace("by qwen", "by Qwen2.5-7B")  # display names in the GUI, not ids
    assert tooltip(snap) == f"Qwen2.5-7B holds the GPU (pinned) · Gemma {named} · 1 other set aside"
    assert tooltip(snap, {"gemma": 12.7}) == (
        f"Qwen2.5-7B holds the GPU (pinned) · Gemma {named}, 12 s · 1 other set aside"
    )
    assert tooltip(snap, {"gemma": 0.4}).count(" s ·") == 0  # under a second: no seconds yet
    # the menu's summary line and the model's submenu say it too
    entries = menu_entries(snap, start_at_login=False, waited={"gemma": 12.7})
    assert entries[0] == Label(tooltip(snap, {"gemma": 12.7}))
    sub = submenu(entries, "gemma")
    assert sub.text == "Gemma — waiting for the GPU" and sub.entries[0] == Label(f"{PINNED_WAIT}, 12 s")


def test_loading_and_restoring_models_are_named_with_their_seconds() -> None:
    snap = PoolSnapshot(
        models=(
            status("a", ModelState.LOADING, name="A"),
            status(
                "b", ModelState.STARTING, name="B", reason="restarting in 2 s after a crash (exit status 9)"
            ),
            status("c", ModelState.SLEEPING, name="C", busy=True),  # has the GPU now, restores
        )
    )
    assert tooltip(snap, {"a": 3.2, "c": 1.0}) == (
        "No model holds the GPU · A loading, 3 s · B restarting in 2 s after a crash · "
        "C restoring to the GPU, 1 s"
    )
    assert submenu(menu_entries(snap, start_at_login=False), "a").entries[0] == Label("loading")


def test_the_wait_clock_counts_each_kind_of_wait_from_its_start() -> None:
    clock = WaitClock()
    snap = pinned_and_waiting()
    assert clock.observe(snap, 100.0) == {"gemma": 0.0}
    assert clock.observe(snap, 112.5) == {"gemma": 12.5}
    # the reason's words change (another waiter ahead left): the same wait goes on
    moved = PoolSnapshot(
        models=(
            snap.models[0],
            dataclasses.replace(snap.models[1], reason="waiting for the GPU: held by qwen"),
        ),
        holder="qwen",
    )
    assert clock.observe(moved, 113.0) == {"gemma": 13.0}
    # answered: no wait; the next one counts from 0
    done = PoolSnapshot(models=(dataclasses.replace(snap.models[1], busy=False, reason=""),))
    assert clock.observe(done, 120.0) == {}
    assert clock.observe(snap, 130.0) == {"gemma": 0.0}
    # a load is a wait of its own kind; a model removed is forgotten
    loading = PoolSnapshot(models=(status("gemma", ModelState.LOADING),))
    assert clock.observe(loading, 131.0) == {"gemma": 0.0}
    assert clock.observe(PoolSnapshot(), 140.0) == {}
    assert clock.mark("gemma", "loading", 141.0) == 0.0


def test_with_seconds() -> None:
    assert with_seconds("Loading A…", 3.9) == "Loading A… 3 s"
    assert with_seconds("waiting for the GPU", 61.0) == "waiting for the GPU, 61 s"
    assert with_seconds("waiting", 0.9) == with_seconds("waiting", None) == "waiting"


def test_the_chat_windows_line_while_the_user_waits() -> None:
    snap = pinned_and_waiting()
    gemma = snap.model("gemma")
    assert gemma is not None
    line = chat_wait_line(gemma, "qwen", answering=True, seconds=12.0)
    assert line == f"Gemma is {PINNED_WAIT}, 12 s"
    # the model has the GPU and restores; then it reads the prompt
    restoring = dataclasses.replace(gemma, reason="")
    assert chat_wait_line(restoring, "gemma", answering=True, seconds=0.2) == "Restoring Gemma to the GPU…"
    holder = dataclasses.replace(gemma, reason="", state=ModelState.RESIDENT)
    assert chat_wait_kind(holder, "gemma", answering=True) == "thinking"
    assert chat_wait_line(holder, "gemma", answering=True, seconds=2.0) == "Gemma is reading the prompt… 2 s"
    # a load shows with or without a request, with its stage in words
    loading = status("smol", ModelState.LOADING, name="SmolLM2")
    assert chat_wait_line(loading, None, answering=False, seconds=3.0, stage="model") == (
        "Loading SmolLM2 (reading the model file)… 3 s"
    )
    # nothing awaited: no line
    assert chat_wait_line(holder, "gemma", answering=False) == ""
    assert chat_wait_line(status("x", ModelState.RELEASED), "qwen", answering=False) == ""


def test_the_wait_words_load_no_qt() -> None:
    code = "import sys, timeshare.app.waits; print(sorted(m for m in sys.modules if 'PySide6' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_open_menu_counts_the_wait_in_place(qtbot: Any) -> None:
    """The menu's wait counter stood still while the menu was open (the tooltip went on)."""
    from PySide6.QtWidgets import QMenu
    from timeshare.app.tray import populate, relabel

    menu = QMenu()
    snap = pinned_and_waiting()
    populate(menu, menu_entries(snap, start_at_login=False, waited={"gemma": 13.0}), lambda a: None)
    assert ", 13 s" in menu.actions()[0].text()
    gemma = next(a for a in menu.actions() if a.menu() is not None and a.text().startswith("Gemma"))
    before = gemma.menu()
    assert relabel(menu, menu_entries(snap, start_at_login=False, waited={"gemma": 37.0}))
    assert ", 37 s" in menu.actions()[0].text() and ", 13 s" not in menu.actions()[0].text()
    assert gemma.menu() is before  # the same submenu (an open one stays open)
    # a model added meanwhile: the items no longer match, the caller rebuilds
    more = dataclasses.replace(snap, models=(*snap.models, status("new", ModelState.LOADING)))
    assert not relabel(menu, menu_entries(more, start_at_login=False))
