"""The chat window and the tray while people wait, and the window's per-conversation controls,
driven by snapshots the test publishes (an unstarted ``Pool``: no workers).

What a model waits for and for how long is in the tray's tooltip and the window's line under the
transcript; the answer settings panel edits the conversation in the store; the status bar and the
transcript follow the conversation shown and the names of the models.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timeshare.core.config.schema import ApiConfig, Config
from timeshare.core.conversations.store import AnswerStats
from timeshare.core.state import EventKind, ModelState, ModelStatus, PoolEvent, PoolSnapshot

pytestmark = pytest.mark.gui

PINNED = "waiting for the GPU: pinned by gemma3-270m"  # the pool's reason (ids)
SHOWN = "waiting for the GPU: pinned by Gemma"  # what the GUI shows: display names
WAIT_MS = 30_000  # upper bound for a wait on a loaded machine; nothing is timed


@pytest.fixture
def app(qtbot: Any, tmp_path: Path, timeshare_home: Path) -> Iterator[Any]:
    from timeshare.app.application import TimeshareApp
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store
    from timeshare.core.pool.supervisor import Pool

    pool = Pool(Config(api=ApiConfig(enabled=False)))
    store = Store(tmp_path / "c.sqlite3")
    ta = TimeshareApp(
        Config(api=ApiConfig(enabled=False)),
        pool,
        store,
        ChatService(pool, store),
        config_path=tmp_path / "config.toml",
        tray_available=True,
    )
    qtbot.addWidget(ta.window)
    ta.start(background=False)  # the tray: closing the window asks nothing
    yield ta
    ta.window.detach()
    ta.bridge.detach()
    if ta.tray is not None:
        ta.tray.hide()
    store.close()
    pool.stop()


def model(model_id: str, state: ModelState, name: str = "", **kw: Any) -> ModelStatus:
    return ModelStatus(id=model_id, name=name, path=f"/m/{model_id}.gguf", state=state, **kw)


def publish(qtbot: Any, app: Any, *models: ModelStatus, holder: str | None = None, **extra: object) -> None:
    """A pool event, from another thread as the pool sends them."""
    snap = PoolSnapshot(models=models, holder=holder)
    kind = EventKind.MESSAGE if extra else EventKind.STATE
    event = PoolEvent(kind, snap, model=models[0].id if models else None, extra=dict(extra))
    with qtbot.waitSignal(app.bridge.snapshot_changed, timeout=WAIT_MS):
        threading.Thread(target=app.bridge._from_pool_thread, args=(event,)).start()


def test_a_model_waiting_for_a_pinned_one_says_so_with_its_seconds(qtbot: Any, app: Any) -> None:
    gemma = model("gemma3-270m", ModelState.RESIDENT, "Gemma", pinned=True)
    smol = model("smol", ModelState.RELEASED, "SmolLM2", busy=True, reason=PINNED)
    publish(qtbot, app, smol, gemma, holder="gemma3-270m")
    window = app.window
    assert window.model_box.currentData() == "smol"
    # the window: the words beside the bar, then the seconds counting
    assert not window.wait_row.isHidden()
    assert window.wait_label.text().startswith(f"SmolLM2 is {SHOWN}")
    assert window.model_box.currentText() == "SmolLM2 — waiting for the GPU"
    qtbot.waitUntil(lambda: re.search(r", \d+ s$", window.wait_label.text()) is not None, timeout=WAIT_MS)
    # the tray: who holds the GPU, who waits for it and for how long
    tip = app.tray.icon.toolTip
    assert tip().startswith(f"Gemma holds the GPU (pinned) · SmolLM2 {SHOWN}")
    qtbot.waitUntil(
        lambda: re.search(rf"SmolLM2 {re.escape(SHOWN)}, \d+ s", tip()) is not None, timeout=WAIT_MS
    )
    # the wait is over: the line goes, the tooltip stops counting
    publish(qtbot, app, model("smol", ModelState.RELEASED, "SmolLM2"), gemma, holder="gemma3-270m")
    assert window.wait_row.isHidden()
    assert tip() == "Gemma holds the GPU (pinned) · 1 other set aside"
    assert not app.tray._tick.isActive()


def test_a_load_shows_its_stage_and_fraction(qtbot: Any, app: Any) -> None:
    window = app.window
    loading = model("smol", ModelState.LOADING, "SmolLM2")
    publish(qtbot, app, loading)
    assert window.wait_label.text().startswith("Loading SmolLM2…")
    assert window.progress.maximum() == 0  # no fraction known yet: indeterminate
    publish(qtbot, app, loading, stage="residency", fraction=0.5)
    assert window.wait_label.text().startswith("Loading SmolLM2 (preparing GPU switching)…")
    assert (window.progress.maximum(), window.progress.value()) == (100, 50)
    assert app.tray.icon.toolTip().startswith("No model holds the GPU · SmolLM2 loading")
    publish(qtbot, app, model("smol", ModelState.RESIDENT, "SmolLM2"), holder="smol")
    assert window.wait_row.isHidden()
    assert app.bridge.loading == {}  # loaded: the next load starts from its first stage


def test_answer_settings_are_kept_per_conversation(qtbot: Any, app: Any) -> None:
    publish(qtbot, app, model("smol", ModelState.RELEASED, "SmolLM2"))
    window = app.window
    panel = window.settings_panel
    first = window.new_conversation("smol")
    window.settings_button.click()
    assert not window.settings_panel.isHidden()
    assert window.settings_summary.text() == "Answers: greedy · up to 1024 tokens"
    panel.system_prompt.setPlainText("Answer in French.")
    panel.temperature.setValue(0.7)
    panel.max_tokens_box.setValue(64)
    qtbot.waitUntil(lambda: app.store.get(first).system_prompt == "Answer in French.", timeout=WAIT_MS)
    conv = app.store.get(first)
    assert (conv.temperature, conv.max_tokens) == (0.7, 64)
    assert window.settings_summary.text() == "Answers: temperature 0.7 · up to 64 tokens · system prompt"
    # another conversation has its own settings; coming back shows the first one's
    second = window.new_conversation("smol")
    assert panel.system_prompt.toPlainText() == "" and panel.max_tokens_box.value() == 1024
    panel.system_prompt.setPlainText("Be brief.")
    window.reload_conversations(select=first)  # switching saves what was being typed
    assert app.store.get(second).system_prompt == "Be brief."
    assert panel.system_prompt.toPlainText() == "Answer in French."
    assert (panel.temperature.value(), panel.max_tokens_box.value()) == (0.7, 64)


def test_switching_conversation_clears_the_last_answers_line(qtbot: Any, app: Any) -> None:
    publish(qtbot, app, model("smol", ModelState.RELEASED, "SmolLM2"))
    window = app.window
    first = window.new_conversation("smol")
    window.new_conversation("smol")
    window.statusBar().showMessage("first token 40 ms · 50.0 tokens/s · no GPU switch", 15000)
    window.reload_conversations(select=first)
    assert window.statusBar().currentMessage() == ""


def test_the_transcript_names_models_once_the_pool_knows_them(qtbot: Any, app: Any) -> None:
    # after a restart the pool's first snapshot can be empty: the transcript shows the ids, then
    # the configured names as soon as the models are known
    conv = app.store.create_conversation("smol")
    app.store.add_message(conv.id, "user", "hi")
    stats = AnswerStats("stop", model_id="smol", ttft_ms=40.0, completion_tokens=3, tokens_per_s=20.0)
    app.store.add_message(conv.id, "assistant", "Hello!", stats=stats)
    window = app.window
    window.reload_conversations(select=conv.id)
    assert "smol" in window.transcript.toPlainText()
    publish(qtbot, app, model("smol", ModelState.RELEASED, "SmolLM2-135M-Instruct"))
    assert "SmolLM2-135M-Instruct" in window.transcript.toPlainText()


def test_an_empty_answer_says_which_stop_string_ended_it(qtbot: Any, app: Any) -> None:
    publish(qtbot, app, model("gemma", ModelState.RELEASED, "Gemma"))
    conv = app.store.create_conversation("gemma")
    app.store.add_message(conv.id, "user", "hi")
    stats = AnswerStats("stop", model_id="gemma", completion_tokens=3, stop="\nUser:")
    app.store.add_message(conv.id, "assistant", "", stats=stats)
    window = app.window
    window.reload_conversations(select=conv.id)
    shown = window.transcript.toPlainText()
    assert 'the model stopped at once: it produced the stop string "\\nUser:"' in shown
    assert "0.0 tokens/s" not in shown and "…" not in shown


def test_settings_chosen_before_the_first_conversation_become_its_own(qtbot: Any, app: Any) -> None:
    publish(qtbot, app, model("smol", ModelState.RELEASED, "SmolLM2"))
    window = app.window
    panel = window.settings_panel
    assert window.current_conversation() is None
    assert (panel.temperature.value(), panel.max_tokens_box.value()) == (0.0, 1024)  # the defaults
    panel.system_prompt.setPlainText("Be brief.")
    panel.max_tokens_box.setValue(100)
    conv_id = window.new_conversation()
    conv = app.store.get(conv_id)
    assert (conv.system_prompt, conv.max_tokens) == ("Be brief.", 100)
    assert window.settings_summary.text() == "Answers: greedy · up to 100 tokens · system prompt"
