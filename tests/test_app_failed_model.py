"""The tray for a model whose file is missing: Timeshare starts, the model shows as failed with
"Locate file…" and "Remove"; both write the config and apply it (a real pool, a real worker)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from timeshare.core.config import files as config_files
from timeshare.core.config.schema import ApiConfig, Config, ModelConfig
from timeshare.core.state import ModelState

pytestmark = [pytest.mark.gui, pytest.mark.slow]

WAIT_MS = 240_000


@pytest.fixture
def app(qtbot: Any, tmp_path: Path, timeshare_home: Path) -> Iterator[Any]:
    from timeshare.app.application import TimeshareApp
    from timeshare.core import paths
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store
    from timeshare.core.pool.supervisor import Pool

    config = Config(
        models=(
            ModelConfig(id="ghost", path=str(tmp_path / "gone" / "ghost.gguf"), idle_sleep_s=None),
            ModelConfig(id="other", path=str(tmp_path / "gone" / "other.gguf")),
        ),
        api=ApiConfig(enabled=False),
    )
    config_path = paths.config_file()
    config_files.save_config(config, config_path)  # as the user has it: the files are gone
    pool = Pool(config, arena_dir=tmp_path / "arena")
    pool.start()
    store = Store(tmp_path / "c.sqlite3")
    made = TimeshareApp(
        config, pool, store, ChatService(pool, store), config_path=config_path, tray_available=True
    )
    qtbot.addWidget(made.window)
    made.start(background=True)
    try:
        yield made
    finally:
        made.shutdown()
        store.close()


def _submenu_texts(app: Any, model_title_start: str) -> list[str]:
    app.tray.rebuild_menu()
    for action in app.tray.menu.actions():
        menu = action.menu()
        if menu is not None and action.text().startswith(model_title_start):
            return [a.text() for a in menu.actions()]
    raise AssertionError(f"no submenu {model_title_start!r}")


def test_locate_file_and_remove_for_a_model_whose_file_is_gone(
    qtbot: Any, app: Any, smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QMessageBox
    from timeshare.app import application
    from timeshare.app.menu_model import Action, Command

    def state(model_id: str) -> ModelState | None:
        status = app.pool.snapshot().model(model_id)
        return None if status is None else status.state

    qtbot.waitUntil(
        lambda: state("ghost") is ModelState.FAILED and state("other") is ModelState.FAILED, timeout=WAIT_MS
    )
    texts = _submenu_texts(app, "ghost")
    assert "Locate file…" in texts and "Remove" in texts and "Restart" in texts
    assert any("the model file does not exist" in t for t in texts)  # the reason (its path: Details)
    assert not any("ghost.gguf" in t for t in texts)

    # Locate file…: the picker, then the model starts from the file chosen
    located = tmp_path / "found" / "smol.gguf"
    located.parent.mkdir()
    located.symlink_to(smollm2_path)
    asked: list[str] = []

    def pick(parent: object, title: str, folder: str, filters: str) -> tuple[str, str]:
        asked.append(title)
        return str(located), filters.split(";;")[0]

    monkeypatch.setattr(application.QFileDialog, "getOpenFileName", staticmethod(pick))
    app.handle(Action("Locate file…", Command.LOCATE_FILE, "ghost"))
    assert asked and "ghost" in asked[0]
    saved = config_files.load_config(app.config_path, check_paths=False)
    assert saved.model("ghost").path == str(located)  # type: ignore[union-attr]
    qtbot.waitUntil(lambda: state("ghost") in (ModelState.RESIDENT, ModelState.RELEASED), timeout=WAIT_MS)

    # a model another writer added meanwhile (an API pull, `timeshare pull`) stays when the tray
    # saves: it changes the file as it is now, through the one writer (issue 44)
    pulled = ModelConfig(id="pulled", path=str(tmp_path / "gone" / "pulled.gguf"))
    config_files.update_config(lambda c: replace(c, models=(*c.models, pulled)), app.config_path)
    # Remove: asked first; "No" keeps it
    answers = [QMessageBox.StandardButton.No, QMessageBox.StandardButton.Yes]
    monkeypatch.setattr(application.QMessageBox, "question", staticmethod(lambda *a: answers.pop(0)))
    app.handle(Action("Remove", Command.REMOVE_MODEL, "other"))
    assert config_files.load_config(app.config_path, check_paths=False).model("other") is not None
    app.handle(Action("Remove", Command.REMOVE_MODEL, "other"))
    saved = config_files.load_config(app.config_path, check_paths=False)
    assert saved.model("other") is None and saved.model("pulled") is not None
    qtbot.waitUntil(lambda: state("other") is None, timeout=WAIT_MS)
    assert state("ghost") in (ModelState.RESIDENT, ModelState.RELEASED)


def test_a_file_that_is_not_a_model_is_refused_with_a_sentence(
    qtbot: Any, app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from timeshare.app import application
    from timeshare.app.menu_model import Action, Command

    bogus = tmp_path / "page.gguf"
    bogus.write_bytes(b"<html>404</html>")
    monkeypatch.setattr(application.QFileDialog, "getOpenFileName", staticmethod(lambda *a: (str(bogus), "")))
    notes: list[tuple[str, str]] = []
    monkeypatch.setattr(app, "notify", lambda title, message, error=False: notes.append((title, message)))
    before = app.config_path.read_text()
    app.handle(Action("Locate file…", Command.LOCATE_FILE, "ghost"))
    assert notes and "not a GGUF file" in notes[0][1]
    assert app.config_path.read_text() == before  # nothing written


def test_the_chat_window_shows_a_failed_model_its_reason_and_fixes_and_saves_nothing(
    qtbot: Any, app: Any
) -> None:
    from PySide6.QtCore import Qt
    from timeshare.app.menu_model import Command

    qtbot.waitUntil(lambda: app.pool.snapshot().model("ghost").state is ModelState.FAILED, timeout=WAIT_MS)
    window = app.window
    window.open_for_model("ghost")
    bar = window.problem_bar
    qtbot.waitUntil(lambda: not bar.isHidden(), timeout=WAIT_MS)  # the snapshot reaches the GUI queued
    assert "ghost cannot answer" in bar.label.text() and "the model file does not exist" in bar.label.text()
    assert "ghost.gguf" not in bar.label.text() and "ghost.gguf does not exist" in bar.details.text()
    assert "timeshare start" not in bar.label.text() and "POST" not in bar.label.text()
    for button in (bar.locate_button, bar.restart_button, bar.remove_button):
        assert not button.isHidden(), button.text()
    assert bar.unpin_button.isHidden()
    assert not window.send_button.isEnabled() and "cannot answer" in window.send_button.toolTip()

    # Enter in the box does not save a message the model cannot answer
    window.input.setPlainText("hello?")
    window.send()
    assert all(not app.store.messages(c.id) for c in app.store.list_conversations())
    assert "cannot answer" in window.statusBar().currentMessage()

    # the fixes are the tray's actions, where the reason is
    with qtbot.waitSignal(window.action_requested) as emitted:
        qtbot.mouseClick(bar.restart_button, Qt.MouseButton.LeftButton)
    assert emitted.args[0].command is Command.RESTART and emitted.args[0].model == "ghost"
