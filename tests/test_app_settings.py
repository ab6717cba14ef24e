"""Settings dialog (validation through the config layer, models from file/catalog, edit, remove),
start at login from the tray, the bridge's thread hop, and the no-tray behaviour.

The pool here is a real, unstarted ``Pool`` (no workers: nothing in these tests needs one).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timeshare.core.config import files as config_files
from timeshare.core.config.schema import ApiConfig, Config, ModelConfig
from timeshare.core.errors import ConfigError
from timeshare.core.state import EventKind, ModelState, ModelStatus, PoolEvent, PoolSnapshot

pytestmark = pytest.mark.gui


@pytest.fixture
def pool() -> Iterator[Any]:
    from timeshare.core.pool.supervisor import Pool

    p = Pool(Config(api=ApiConfig(enabled=False)))
    yield p
    p.stop()


@pytest.fixture
def bridge(qtbot: Any, pool: Any) -> Iterator[Any]:
    from timeshare.app.bridge import PoolBridge

    b = PoolBridge(pool)
    yield b
    b.detach()


@pytest.fixture
def config_path(timeshare_home: Path) -> Path:
    from timeshare.core import paths

    return paths.config_file()


def smol_config(smollm2_path: Path) -> Config:
    return Config(
        models=(ModelConfig(id="smol", path=str(smollm2_path), name="SmolLM2", licence="Apache-2.0"),),
        api=ApiConfig(enabled=False),
    )


def dialog_for(qtbot: Any, config: Config, bridge: Any, config_path: Path) -> Any:
    from timeshare.app.settings import SettingsDialog

    dialog = SettingsDialog(config, bridge, config_path)
    qtbot.addWidget(dialog)
    return dialog


def test_invalid_api_settings_show_the_config_layers_message_and_write_nothing(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path
) -> None:
    dialog = dialog_for(qtbot, smol_config(smollm2_path), bridge, config_path)
    saved: list[Config] = []
    dialog.saved.connect(saved.append)
    dialog.api_host.setText("0.0.0.0")  # reachable from other machines, and no key
    assert dialog.save() is False
    assert not config_path.exists() and saved == []
    assert "api.key" in dialog.problems.text() and "set a key" in dialog.problems.text()
    assert not dialog.problems.isHidden()
    assert dialog.api_host.text() == "0.0.0.0"  # nothing typed is lost

    dialog.api_key.setText("s3cret")
    assert dialog.save() is True
    assert dialog.problems.isHidden()
    loaded = config_files.load_config(config_path)
    assert loaded.api.host == "0.0.0.0" and loaded.api.key == "s3cret"
    assert saved == [loaded]


def test_general_settings_round_trip(qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path) -> None:
    dialog = dialog_for(qtbot, smol_config(smollm2_path), bridge, config_path)
    dialog.prewake.setChecked(False)
    dialog.start_at_login.setChecked(True)
    dialog.idle_all.setValue(0)  # never
    dialog.quantum.setValue(500)
    assert dialog.save()
    loaded = config_files.load_config(config_path)
    assert loaded.general.prewake_on_typing is False and loaded.general.start_at_login is True
    assert loaded.models[0].idle_sleep_s is None
    assert loaded.arena.min_quantum_ms == 500


def test_the_settings_fields_come_from_the_config_metadata(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path
) -> None:
    """Initial values, ranges, units and labels are the config layer's (core/config/schema.py): a
    draft that leaves a key out shows the field's default, not a number of the dialog's own."""
    from PySide6.QtWidgets import QLabel
    from timeshare.app.settings_model import ModelDialog
    from timeshare.core.config.meta import describe
    from timeshare.core.config.schema import ArenaConfig

    dialog = dialog_for(qtbot, smol_config(smollm2_path), bridge, config_path)
    for box, cls, name in (
        (dialog.quantum, ArenaConfig, "min_quantum_ms"),
        (dialog.wait_timeout, ArenaConfig, "wait_timeout_s"),
        (dialog.hung_holder, ArenaConfig, "hung_holder_s"),
        (dialog.api_port, ApiConfig, "port"),
        (dialog.api_queue_limit, ApiConfig, "queue_limit"),
    ):
        d = describe(cls, name)
        assert box.value() == d.default, name
        assert (box.minimum(), box.maximum()) == (d.meta.minimum, d.meta.top), name
        assert box.suffix() == (f" {d.meta.unit}" if d.meta.unit else ""), name
        assert box.specialValueText() == d.meta.special, name
    # a form row's label is a QLabel whose buddy is the field
    labels = [w.text() for w in dialog.findChildren(QLabel) if w.buddy() is dialog.quantum]
    # (an unstarted pool: no device seen yet, so the words of a GPU build; see test_app_settings_words)
    assert labels == [describe(ArenaConfig, "min_quantum_ms").meta.worded(gpu=True).label + ":"]

    # a model table without the optional keys shows the defaults
    model = ModelDialog({"id": "m", "path": str(smollm2_path)}, set(), config_path)
    qtbot.addWidget(model)
    for box, name in ((model.n_ctx, "n_ctx"), (model.n_seq, "n_seq"), (model.parallel, "parallel")):
        d = describe(ModelConfig, name)
        assert box.value() == d.default and box.maximum() == d.meta.top, name
    assert model.idle.value() * 60 == describe(ModelConfig, "idle_sleep_s").default
    assert model.chat_format.currentText() == describe(ModelConfig, "chat_format").default
    assert [model.chat_format.itemText(i) for i in range(model.chat_format.count())] == list(
        describe(ModelConfig, "chat_format").meta.choices
    )


def test_api_settings_round_trip_every_api_option(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path
) -> None:
    """The API tab holds every API option of the config (no more, no fewer): queue limit, other
    host names and web origins (comma-separated lists), the Ollama listener; the address clients
    use is shown as it is typed."""
    from timeshare.app.settings import SettingsDialog

    assert {f.name for f in dataclasses.fields(ApiConfig)} == {
        "enabled",
        "host",
        "port",
        "key",
        "queue_limit",
        "allowed_hosts",
        "allowed_origins",
        "ollama_listen",
        "responses_kept",
        "responses_days",
        "fetch_image_urls",
    }  # a new API option needs its field on the tab
    dialog = dialog_for(qtbot, smol_config(smollm2_path), bridge, config_path)
    assert "nothing: the API is off" in dialog.api_url.text()  # smol_config has the API off
    dialog.api_enabled.setChecked(True)
    dialog.api_port.setValue(8123)
    assert dialog.api_url.text().startswith("http://127.0.0.1:8123/v1 (OpenAI)")
    dialog.api_queue_limit.setValue(3)
    dialog.api_allowed_hosts.setText(" ts.lan, box.local ,")
    dialog.api_allowed_origins.setText("http://localhost:3000")
    dialog.api_ollama.setText("127.0.0.1:11434")
    dialog.api_responses_kept.setValue(50)
    dialog.api_responses_days.setValue(7)
    assert not dialog.api_fetch_images.isChecked()  # off by default
    dialog.api_fetch_images.setChecked(True)
    assert dialog.save()
    loaded = config_files.load_config(config_path)
    assert loaded.api.enabled and loaded.api.port == 8123 and loaded.api.queue_limit == 3
    assert loaded.api.allowed_hosts == ("ts.lan", "box.local")
    assert loaded.api.allowed_origins == ("http://localhost:3000",)
    assert loaded.api.ollama_listen == "127.0.0.1:11434"
    assert (loaded.api.responses_kept, loaded.api.responses_days) == (50, 7)
    assert loaded.api.fetch_image_urls is True
    again = SettingsDialog(loaded, bridge, config_path)
    qtbot.addWidget(again)
    assert again.api_allowed_hosts.text() == "ts.lan, box.local" and again.api_queue_limit.value() == 3
    again.api_allowed_hosts.clear()  # empty: the default again
    assert again.save()
    assert config_files.load_config(config_path).api.allowed_hosts == ()


def test_add_file_rejects_a_non_gguf_with_a_sentence(
    qtbot: Any, bridge: Any, config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QMessageBox

    warnings: list[str] = []
    monkeypatch.setattr(QMessageBox, "warning", lambda _p, _t, text, *a: warnings.append(text))
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("these are not weights")
    dialog = dialog_for(qtbot, Config(api=ApiConfig(enabled=False)), bridge, config_path)
    assert dialog.add_file(str(bogus)) is None
    assert dialog.models_table.rowCount() == 0
    assert warnings and "notes.gguf" in warnings[0]
    assert warnings[0] in dialog.problems.text()


def test_add_file_through_the_file_picker_then_save(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QFileDialog

    monkeypatch.setattr(
        QFileDialog, "getOpenFileName", lambda *a, **k: (str(smollm2_path), "GGUF models (*.gguf)")
    )
    dialog = dialog_for(qtbot, Config(api=ApiConfig(enabled=False)), bridge, config_path)
    new_id = dialog.add_file()
    assert new_id and dialog.models_table.rowCount() == 1
    assert dialog.models_table.item(0, 1).text() == new_id
    assert "not started" in dialog.models_table.item(0, 2).text()
    # the same file twice is refused with a message
    assert dialog.add_file(str(smollm2_path)) is None
    assert "already in the list" in dialog.problems.text()
    assert dialog.save()
    loaded = config_files.load_config(config_path)
    assert [m.id for m in loaded.models] == [new_id]
    assert Path(loaded.models[0].path) == smollm2_path


def test_add_from_catalog_shows_the_demo_licences(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path
) -> None:
    from timeshare.core.gguf import catalog

    entries = catalog.scan(["demo"], demo_paths=[smollm2_path])
    assert entries
    dialog = dialog_for(qtbot, Config(api=ApiConfig(enabled=False)), bridge, config_path)
    added = dialog.add_from_catalog(entries)
    assert len(added) == len(entries)
    licences = [dialog.models_table.item(r, 3).text() for r in range(dialog.models_table.rowCount())]
    assert any("apache" in lic.lower() for lic in licences), licences


def test_catalog_dialog_lists_entries(qtbot: Any, smollm2_path: Path) -> None:
    from timeshare.app.settings_catalog import CatalogDialog
    from timeshare.core.gguf import catalog

    entries = catalog.scan(["demo"], demo_paths=[smollm2_path])
    dialog = CatalogDialog(entries)
    qtbot.addWidget(dialog)
    assert dialog.table.rowCount() == len(entries)
    dialog.table.selectRow(0)
    assert dialog.selected() == [entries[0]]


def test_the_catalog_marks_the_models_already_added(qtbot: Any, smollm2_path: Path) -> None:
    from PySide6.QtCore import Qt
    from timeshare.app.settings_catalog import CatalogDialog
    from timeshare.core.gguf import catalog

    entries = catalog.scan(["demo"], demo_paths=[smollm2_path])
    assert entries
    dialog = CatalogDialog(entries, added={str(smollm2_path.resolve())})
    qtbot.addWidget(dialog)
    row = next(i for i, e in enumerate(entries) if Path(e.path).resolve() == smollm2_path.resolve())
    item = dialog.table.item(row, 0)
    assert item.text().endswith("— already added")
    assert not item.flags() & Qt.ItemFlag.ItemIsSelectable
    dialog.table.selectRow(row)
    assert entries[row] not in dialog.selected()  # cannot be picked again


def test_problems_go_once_a_later_action_or_edit_succeeds(
    qtbot: Any,
    bridge: Any,
    config_path: Path,
    tmp_path: Path,
    smollm2_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from PySide6.QtWidgets import QMessageBox

    monkeypatch.setattr(QMessageBox, "warning", lambda *a, **k: None)
    bogus = tmp_path / "hello.gguf"
    bogus.write_text("hello, these are not weights")
    dialog = dialog_for(qtbot, Config(api=ApiConfig(enabled=False)), bridge, config_path)
    dialog.show()
    assert dialog.add_file(str(bogus)) is None
    # worded for people: how the file starts, no Python bytes literal
    assert (
        "it starts with 'hell', not 'GGUF'" in dialog.problems.text() and "b'" not in dialog.problems.text()
    )
    assert dialog.problems.isVisible()
    assert dialog.add_file(str(smollm2_path)) is not None  # the next action worked: the message goes
    assert not dialog.problems.isVisible()
    # adding the same file again says so; an edit of a field then clears it
    assert dialog.add_file(str(smollm2_path)) is None
    assert "already in the list" in dialog.problems.text() and dialog.problems.isVisible()
    dialog.api_host.clear()
    qtbot.keyClicks(dialog.api_host, "127.0.0.1")
    assert not dialog.problems.isVisible()


def test_model_dialog_validates_with_field_messages(
    qtbot: Any, smollm2_path: Path, config_path: Path
) -> None:
    from timeshare.app.settings_model import ModelDialog

    model = config_files.config_to_dict(smol_config(smollm2_path))["models"][0]
    dialog = ModelDialog(model, {"taken"}, config_path)
    qtbot.addWidget(dialog)
    dialog.id_edit.setText("Bad Id")
    dialog.path_edit.setText(str(smollm2_path) + ".missing")
    dialog.accept()
    text = dialog.problems.text()
    assert dialog.result() != dialog.DialogCode.Accepted
    assert "id: 'Bad Id' may contain only lowercase letters" in text
    assert "path:" in text
    dialog.id_edit.setText("taken")
    dialog.path_edit.setText(str(smollm2_path))
    dialog.accept()
    assert "already used by another model" in dialog.problems.text()
    dialog.id_edit.setText("smol-2")
    dialog.idle.setValue(2)  # minutes
    dialog.accept()
    assert dialog.result() == dialog.DialogCode.Accepted
    value = dialog.value()
    assert value["id"] == "smol-2" and value["idle_sleep_s"] == 120.0
    assert value["licence"] == "Apache-2.0"  # kept
    assert dialog.licence.text() == "Apache-2.0"
    # parallel: auto (0) is shown as such and not written; a number is, and the config layer takes it
    assert (
        dialog.parallel.value() == 0 and dialog.parallel.text().startswith("auto") and "parallel" not in value
    )
    dialog.parallel.setValue(3)
    value = dialog.value()
    assert value["parallel"] == 3
    # the config layer takes it (and refuses what is not a count)
    config = smol_config(smollm2_path)
    config = dataclasses.replace(config, models=(dataclasses.replace(config.models[0], parallel=3),))
    config_path.write_text(config_files.config_to_toml(config))
    assert config_files.load_config(config_path).models[0].parallel == 3
    config_path.write_text(config_files.config_to_toml(config).replace("parallel = 3", "parallel = -1"))
    with pytest.raises(ConfigError, match="parallel"):
        config_files.load_config(config_path)


def test_model_dialog_shows_auto_context_and_what_the_worker_loaded_with(
    qtbot: Any, smollm2_path: Path, config_path: Path
) -> None:
    """Issue 39: n_ctx 0 is "auto" (not clamped to 1); one read-only line says what the running
    worker was fitted to."""
    from timeshare.app import strings
    from timeshare.app.settings import ModelDialog

    model = config_files.config_to_dict(smol_config(smollm2_path))["models"][0]
    model["n_ctx"] = 0
    status = ModelStatus(
        id="smol",
        name="",
        path=str(smollm2_path),
        state=ModelState.RELEASED,
        n_ctx=4096,
        parallel=1,
        kv_cache_type="q8_0",
        fit="parallel 1, n_ctx 4096 (auto: KV 12 MB ≤ 1/8 of the 7.6 GB Timeshare may use)",
    )
    dialog = ModelDialog(model, set(), config_path, fitted=strings.fitted(status))
    qtbot.addWidget(dialog)
    assert dialog.n_ctx.value() == 0 and dialog.n_ctx.text().startswith("auto")
    assert dialog.value()["n_ctx"] == 0
    assert dialog.fitted.text() == (
        "n_ctx 4096 × 1 sequences, KV q8_0 (parallel 1, n_ctx 4096 (auto: KV 12 MB ≤ 1/8 of the 7.6 GB "
        "Timeshare may use))"
    )
    assert strings.fitted(None) == ""


def test_edit_and_remove_model(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QDialog, QMessageBox
    from timeshare.app import settings

    def fake_exec(self: Any) -> int:
        self.name_edit.setText("Renamed")
        self.pinned.setChecked(True)
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(settings.ModelDialog, "exec", fake_exec)
    dialog = dialog_for(qtbot, smol_config(smollm2_path), bridge, config_path)
    assert dialog.edit_model(0)
    assert dialog.models_table.item(0, 0).text() == "Renamed"

    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.No)
    assert not dialog.remove_model(0)
    assert dialog.models_table.rowCount() == 1
    assert dialog.save()
    loaded = config_files.load_config(config_path)
    assert loaded.models[0].name == "Renamed" and loaded.models[0].pinned

    dialog = dialog_for(qtbot, loaded, bridge, config_path)
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    assert dialog.remove_model(0)
    assert dialog.save()
    assert config_files.load_config(config_path).models == ()
    assert smollm2_path.is_file()  # removing a model never deletes its file


# ---- bridge -----------------------------------------------------------------------------------


def test_bridge_delivers_pool_thread_events_on_the_gui_thread(qtbot: Any, bridge: Any) -> None:
    from PySide6.QtCore import QThread

    snap = PoolSnapshot(
        models=(ModelStatus(id="a", name="A", path="/a.gguf", state=ModelState.FAILED, reason="bad file"),)
    )
    seen: list[tuple[object, bool]] = []
    bridge.snapshot_changed.connect(lambda s: seen.append((s, QThread.currentThread() is bridge.thread())))
    with qtbot.waitSignal(bridge.notification, timeout=5000) as note:
        # the pool calls subscribers from its event thread; do the same from a plain Python thread
        t = threading.Thread(
            target=bridge._from_pool_thread, args=(PoolEvent(EventKind.FAILED, snap, model="a"),)
        )
        t.start()
        t.join()
    assert seen == [(snap, True)]
    assert bridge.snapshot == snap
    assert note.args == ["A failed", "bad file"]


@pytest.mark.parametrize(
    ("kind", "title"),
    [(EventKind.CRASHED, "A crashed"), (EventKind.RESTARTED, "A restarted"), (EventKind.STATE, None)],
)
def test_notifications_for_crashes_restarts_and_failures(kind: EventKind, title: str | None) -> None:
    from timeshare.app.bridge import notification_for

    snap = PoolSnapshot(models=(ModelStatus(id="a", name="A", path="/a", state=ModelState.STARTING),))
    note = notification_for(PoolEvent(kind, snap, model="a", message="exit code -11"))
    assert (note[0] if note else None) == title
    if note:
        assert note[1] == "exit code -11"


def test_bridge_reports_a_failed_command(qtbot: Any, bridge: Any) -> None:
    # the pool is not started: the pool's own error comes back as a signal, the GUI never blocks
    with qtbot.waitSignal(bridge.command_failed, timeout=5000) as blocker:
        bridge.wake("nothing")
    assert blocker.args[0] == "wake nothing"
    assert "start Timeshare" in blocker.args[1]


# ---- the app without workers: start at login, no tray -----------------------------------------


@pytest.fixture
def bare_app(qtbot: Any, pool: Any, tmp_path: Path, config_path: Path) -> Iterator[Any]:
    from timeshare.app.application import TimeshareApp
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store

    store = Store(tmp_path / "c.sqlite3")
    made: list[Any] = []

    def make(tray: bool) -> Any:
        app = TimeshareApp(
            Config(api=ApiConfig(enabled=False)),
            pool,
            store,
            ChatService(pool, store),
            config_path=config_path,
            tray_available=tray,
        )
        qtbot.addWidget(app.window)
        made.append(app)
        return app

    yield make
    for app in made:
        app.window.detach()
        app.bridge.detach()
        if app.tray is not None:
            app.tray.hide()
    store.close()


def test_start_at_login_from_the_tray(
    qtbot: Any, bare_app: Any, config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from timeshare.app.menu_model import Action, Command

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    entry = tmp_path / "xdg" / "autostart" / "io.github.timeshare.Timeshare.desktop"
    app = bare_app(tray=True)
    app.start(background=True)
    app.handle(Action("Start at login", Command.START_AT_LOGIN, checkable=True))
    assert entry.is_file()
    assert config_files.load_config(config_path).general.start_at_login is True
    app.tray.rebuild_menu()
    login = next(a for a in app.tray.menu.actions() if a.text() == "Start at login")
    assert login.isChecked()
    login.trigger()  # the real menu action turns it off again
    assert not entry.exists()
    assert config_files.load_config(config_path).general.start_at_login is False


def test_settings_saved_with_start_at_login_writes_the_autostart_entry(
    qtbot: Any, bare_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    app = bare_app(tray=True)
    app.start(background=True)
    dialog = app.open_settings()
    dialog.start_at_login.setChecked(True)
    assert dialog.save()
    assert (tmp_path / "xdg" / "autostart" / "io.github.timeshare.Timeshare.desktop").is_file()
    assert app.config.general.start_at_login


def test_without_a_tray_the_chat_window_opens_and_closing_asks_once(qtbot: Any, bare_app: Any) -> None:
    from PySide6.QtWidgets import QMessageBox

    app = bare_app(tray=False)
    app.start(background=False)
    assert app.tray is None and app.window.isVisible()
    quits: list[bool] = []
    app.quit_requested.connect(lambda: quits.append(True))
    app.window.close()
    # the question is not modal: the event loop (and this test) goes on while it waits
    box = app.keep_running_box
    assert box is not None and box.isVisible() and box.windowTitle() == "Keep Timeshare running?"
    assert "no system tray" in box.text() and quits == []
    box.button(QMessageBox.StandardButton.Yes).click()  # keep running
    assert app.keep_running_box is None and quits == []
    app.window.show()
    app.window.close()
    assert app.keep_running_box is None  # asked once: the answer is remembered

    # a later session that answered "no" quits when the window closes
    from timeshare.app import application

    application.save_ui_state({})
    other = bare_app(tray=False)
    other.start(background=False)
    other.quit_requested.connect(lambda: quits.append(True))
    other.quit = lambda: quits.append(True)  # the app's own quit would end the test's event loop
    other.window.close()
    other.keep_running_box.button(QMessageBox.StandardButton.No).click()
    assert quits == [True] and application.load_ui_state() == {"keep_running_without_tray": False}
    other.window.show()
    other.window.close()
    assert quits == [True, True] and other.keep_running_box is None


def test_settings_licence_column_follows_the_config(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path
) -> None:
    config = dataclasses.replace(
        smol_config(smollm2_path),
        models=(dataclasses.replace(smol_config(smollm2_path).models[0], licence="Apache-2.0"),),
    )
    dialog = dialog_for(qtbot, config, bridge, config_path)
    assert dialog.models_table.item(0, 3).text() == "Apache-2.0"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _app_with_api(qtbot: Any, pool: Any, tmp_path: Path, port: int) -> Any:
    from timeshare.app.application import TimeshareApp
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store

    store = Store(tmp_path / "c.sqlite3")
    app = TimeshareApp(
        Config(api=ApiConfig(enabled=True, port=port)),
        pool,
        store,
        ChatService(pool, store),
        tray_available=False,
    )
    qtbot.addWidget(app.window)
    return app


def test_app_serves_the_api_and_shutdown_stops_it(qtbot: Any, pool: Any, tmp_path: Path) -> None:
    import httpx

    port = _free_port()
    app = _app_with_api(qtbot, pool, tmp_path, port)
    app.start(background=False)
    try:
        qtbot.waitUntil(lambda: app.api is not None, timeout=60_000)  # once the window painted
        reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert reply.status_code == 200 and reply.json()["object"] == "list"
    finally:
        app.shutdown()
        app.store.close()
    assert app.api is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def test_api_port_in_use_is_reported_and_the_app_keeps_running(qtbot: Any, pool: Any, tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = int(busy.getsockname()[1])
        app = _app_with_api(qtbot, pool, tmp_path, port)
        app.start(background=False)
        try:
            bar = app.window.statusBar()
            qtbot.waitUntil(lambda: bar.currentMessage().startswith("The API did not start"), timeout=60_000)
            assert app.api is None
            message = bar.currentMessage()
            assert message.startswith("The API did not start") and str(port) in message
            assert app.window.isVisible()
        finally:
            app.shutdown()
            app.store.close()


def test_chat_window_shows_progress_while_a_model_loads(qtbot: Any, bare_app: Any) -> None:
    app = bare_app(tray=True)
    app.start(background=False)
    window = app.window

    def publish(state: ModelState, holder: str | None = None) -> None:
        snap = PoolSnapshot(
            models=(ModelStatus(id="m", name="Model M", path="/m.gguf", state=state, licence="MIT"),),
            holder=holder,
        )
        with qtbot.waitSignal(app.bridge.snapshot_changed, timeout=5000):
            threading.Thread(
                target=app.bridge._from_pool_thread, args=(PoolEvent(EventKind.STATE, snap),)
            ).start()

    publish(ModelState.LOADING)
    assert window.model_box.currentData() == "m"
    assert window.model_box.currentText() == "Model M — loading"
    # the words are in a label beside the bar (an indeterminate bar shows no text)
    assert not window.wait_row.isHidden() and window.wait_label.text().startswith("Loading Model M…")
    assert window.licence.text() == "Licence: MIT"
    publish(ModelState.RESIDENT, holder="m")
    assert window.wait_row.isHidden()
    assert window.model_state.text() == "on the GPU"
    assert window.model_box.currentText() == "Model M — on the GPU"


def test_add_model_from_the_tray_opens_the_catalog(
    qtbot: Any, bare_app: Any, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QDialog
    from timeshare.app import settings
    from timeshare.app.menu_model import Action, Command
    from timeshare.core.gguf import catalog

    # the catalog scans only the demo package here, not this machine's model folders
    real_scan = catalog.scan_report
    monkeypatch.setattr(
        catalog, "scan_report", lambda *a, **k: real_scan(["demo"], demo_paths=[smollm2_path])
    )

    def pick_first(self: Any) -> int:
        self.table.selectRow(0)
        return QDialog.DialogCode.Accepted

    monkeypatch.setattr(settings.CatalogDialog, "exec", pick_first)
    app = bare_app(tray=True)
    app.start(background=True)
    app.handle(Action("Add model…", Command.ADD_MODEL))
    dialog = app.settings_dialog
    assert dialog is not None and dialog.isVisible() and dialog.tabs.currentIndex() == 0
    qtbot.waitUntil(lambda: dialog.models_table.rowCount() == 1, timeout=5000)
    assert dialog.models_table.item(0, 4).text() == str(smollm2_path)
    dialog.reject()


def test_emit_repays_a_stolen_reference_to_true_exactly_when_the_binding_steals(
    qtbot: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PySide6 6.12.0's emit() returns True without owning it: every emit steals a reference to True,
    # and thousands of emits (one per streamed token) abort the interpreter. Allowed versions do not
    # have the bug, so it is simulated here: an emit that gives up one reference to True (Py_DecRef).
    # Every simulated theft is undone at the end, whatever the outcome.
    import ctypes
    import sys

    import PySide6
    from PySide6.QtCore import QObject, Signal
    from timeshare.app import qt_compat

    decref, incref = ctypes.pythonapi.Py_DecRef, ctypes.pythonapi.Py_IncRef
    for fn in (decref, incref):
        fn.argtypes, fn.restype = [ctypes.py_object], None
    stolen = 0

    def stealing_emit(*args: object) -> bool:
        nonlocal stolen
        received.append(args)
        decref(True)
        stolen += 1
        return True

    class Source(QObject):
        text = Signal(int)

    class StealingSignal:
        emit = staticmethod(stealing_emit)

    repaid: list[object] = []
    monkeypatch.setattr(qt_compat, "_repaid", repaid)
    received: list[tuple[object, ...]] = []
    n = 1000
    try:
        # the probe: a stealing emit is recognised (and its own theft repaid), an honest one is not,
        # and with an immortal True (Python 3.12+: the count never moves) nothing can be stolen
        assert qt_compat.emit_steals_a_reference(lambda: stealing_emit())
        assert repaid == [True]
        assert not qt_compat.emit_steals_a_reference(lambda: True)
        assert not qt_compat.emit_steals_a_reference(lambda: stealing_emit(), refcount=lambda: 2**32 - 1)
        probe = qt_compat._Probe()
        assert qt_compat.emit_steals_a_reference(probe.fired.emit) is (PySide6.__version__ == "6.12.0")
        if PySide6.__version__ != "6.12.0":
            assert not qt_compat.EMIT_STEALS_TRUE  # the binding in use is not mistaken for a buggy one

        # a binding with the bug: each emit is repaid with exactly one reference
        monkeypatch.setattr(qt_compat, "EMIT_STEALS_TRUE", True)
        repaid.clear()
        received.clear()
        before = sys.getrefcount(True)
        for i in range(n):
            qt_compat.emit(StealingSignal(), i)  # type: ignore[arg-type]
        drift = sys.getrefcount(True) - before
        assert received == [(i,) for i in range(n)]
        assert repaid == [True] * n
        assert abs(drift) < n // 10  # other threads may hold a few; unrepaid it would be -n

        # a binding without it: emit only emits
        monkeypatch.setattr(qt_compat, "EMIT_STEALS_TRUE", False)
        repaid.clear()
        source = Source()
        got: list[int] = []
        source.text.connect(got.append)
        for i in range(n):
            qt_compat.emit(source.text, i)
        assert got == list(range(n)) and repaid == []
    finally:
        for _ in range(stolen):
            incref(True)


def test_with_a_tray_closing_the_window_keeps_running_without_asking(
    qtbot: Any, bare_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QMessageBox

    def question(*args: Any, **kwargs: Any) -> QMessageBox.StandardButton:
        raise AssertionError("with a tray, closing the window must not ask anything")

    monkeypatch.setattr(QMessageBox, "question", question)
    app = bare_app(tray=True)
    app.start(background=False)
    assert app.window.isVisible() and app.tray.icon.isVisible()
    quits: list[bool] = []
    app.quit_requested.connect(lambda: quits.append(True))
    app.window.close()
    assert not app.window.isVisible() and quits == []
    app.tray.clicked.emit()  # clicking the tray icon brings the window back
    assert app.window.isVisible()


def test_a_model_added_elsewhere_while_settings_is_open_survives_saving_the_draft(
    qtbot: Any, bare_app: Any, config_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    """The "Get model…" dialog (or a reload through the API) saves a config with a new model while
    Settings is open: the open draft adopts it, so saving the draft does not drop it; the user's
    own edits in the draft stay."""
    app = bare_app(tray=True)
    app.start(background=True)
    commands: list[str] = []
    app.bridge.run_command = lambda what, fn: commands.append(what)  # no workers in this test
    first = smol_config(smollm2_path)
    app.apply_config(first)
    dialog = app.open_settings()
    assert [m["id"] for m in dialog.draft["models"]] == ["smol"]
    dialog.api_port.setValue(8123)  # an edit in the open dialog

    gemma = ModelConfig(id="gemma", path=str(gemma3_path), name="Gemma")
    renamed = dataclasses.replace(first.models[0], name="SmolLM2 (renamed elsewhere)")
    elsewhere = dataclasses.replace(first, models=(renamed, gemma))
    config_files.save_config(elsewhere, config_path)
    app.apply_config(elsewhere)  # what the Get-model dialog's config_saved does
    assert [m["id"] for m in dialog.draft["models"]] == ["smol", "gemma"]
    assert dialog.models_table.rowCount() == 2
    assert dialog.draft["models"][0]["name"] == "SmolLM2 (renamed elsewhere)"  # the draft had not changed it

    assert dialog.save() is True
    saved = config_files.load_config(config_path)
    assert [m.id for m in saved.models] == ["smol", "gemma"] and saved.api.port == 8123
    assert saved.models[0].name == "SmolLM2 (renamed elsewhere)"


def test_saving_the_draft_keeps_a_model_another_writer_saved_unseen(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    """An API pull (or `timeshare pull`) saves a model the tray never heard of while Settings is
    open: saving the draft goes through the config's one writer, which merges it in (issue 44)."""
    first = smol_config(smollm2_path)
    config_files.save_config(first, config_path)
    dialog = dialog_for(qtbot, first, bridge, config_path)
    dialog.api_port.setValue(8124)  # an edit in the open dialog
    pulled = ModelConfig(id="pulled", path=str(gemma3_path), name="Pulled")
    config_files.update_config(lambda c: dataclasses.replace(c, models=(*c.models, pulled)), config_path)
    assert dialog.save() is True
    saved = config_files.load_config(config_path)
    assert [m.id for m in saved.models] == ["smol", "pulled"] and saved.api.port == 8124


def test_adopting_changes_from_elsewhere_keeps_what_the_draft_changed(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    first = smol_config(smollm2_path)
    dialog = dialog_for(qtbot, first, bridge, config_path)
    dialog.draft["models"][0]["name"] = "mine"  # edited in the dialog
    theirs = dataclasses.replace(first.models[0], name="theirs")
    assert dialog.adopt_saved_elsewhere(first, dataclasses.replace(first, models=(theirs,))) == []
    assert dialog.draft["models"][0]["name"] == "mine"
    # removed elsewhere while unchanged here: it goes; the draft's own new model stays
    dialog.draft["models"][0] = config_files.config_to_dict(first)["models"][0]
    dialog.draft["models"].append({"id": "gemma", "path": str(gemma3_path)})
    assert dialog.adopt_saved_elsewhere(first, dataclasses.replace(first, models=())) == ["smol"]
    assert [m["id"] for m in dialog.draft["models"]] == ["gemma"]
    # saving the draft itself comes back as a no-op
    saved = dialog.validated()
    assert saved is not None and dialog.adopt_saved_elsewhere(first, saved) == []


def test_the_vram_budget_and_the_hung_holder_timeout_are_settings(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path
) -> None:
    dialog = dialog_for(qtbot, smol_config(smollm2_path), bridge, config_path)
    assert dialog.vram_budget.currentText() == "auto" and dialog.hung_holder.value() == 30.0
    dialog.vram_budget.setEditText("lots")
    assert dialog.save() is False and not config_path.exists()
    assert "arena.vram_budget" in dialog.problems.text()
    dialog.vram_budget.setEditText("12GB")  # typing clears the message
    assert dialog.problems.isHidden()
    dialog.hung_holder.setValue(0)  # shown as "never"
    assert dialog.hung_holder.text() == "never"
    assert dialog.save() is True
    saved = config_files.load_config(config_path)
    assert saved.arena.vram_budget == "12GB" and saved.arena.hung_holder_s == 0
    again = dialog_for(qtbot, saved, bridge, config_path)
    assert again.vram_budget.currentText() == "12GB" and again.hung_holder.value() == 0


def test_the_models_table_shows_names_and_ids_whole(qtbot: Any, bridge: Any, config_path: Path) -> None:
    long_name = "SmolLM2 135M 8k Lc100K Mix1 Ep2 Instruct Q8_0 (pulled from a mirror)"
    long_id = "smollm2-135m-8k-lc100k-mix1-ep2-instruct-q8_0-from-a-mirror"
    model = ModelConfig(id=long_id, name=long_name, path="/models/" + "deep/" * 20 + "x.gguf")
    dialog = dialog_for(qtbot, Config(models=(model,), api=ApiConfig(enabled=False)), bridge, config_path)
    dialog.resize(900, 500)
    dialog.show()
    qtbot.waitExposed(dialog)
    table = dialog.models_table
    metrics = table.fontMetrics()
    for column, text in ((0, long_name), (1, long_id)):
        assert table.item(0, column).text() == text
        assert table.columnWidth(column) >= metrics.horizontalAdvance(text), column  # not cut
    assert table.item(0, 4).toolTip() == model.path  # the elided path whole on hover


def test_sharing_the_gpu_reads_at_a_glance_with_the_rest_under_advanced(
    qtbot: Any, bridge: Any, config_path: Path, smollm2_path: Path
) -> None:
    from timeshare.app import strings

    dialog = dialog_for(qtbot, smol_config(smollm2_path), bridge, config_path)
    tabs = [dialog.tabs.tabText(i) for i in range(dialog.tabs.count())]
    assert tabs[dialog.sharing_index] in ("Sharing the GPU", "Sharing memory") and "Arena" not in tabs
    dialog.show()
    dialog.tabs.setCurrentIndex(dialog.sharing_index)
    smol = ModelStatus(
        id="smol",
        name="SmolLM2",
        path="/m.gguf",
        state=ModelState.RESIDENT,
        backend="CUDA0",
        residency_path="inplace",
        weight_bytes=104_000_000,
    )
    dialog._refresh_arena(PoolSnapshot(models=(smol,), holder="smol"))  # as the bridge hands it on
    # at a glance: who has it, each model's state in words and what it takes; no engineering words
    headers = [dialog.sharing_table.horizontalHeaderItem(i).text() for i in range(3)]
    assert headers == ["Model", "Now", "Takes"]
    assert dialog.sharing_table.item(0, 0).text() == "SmolLM2"
    assert dialog.holder_label.text() == "SmolLM2 holds the GPU now."
    assert dialog.sharing_table.item(0, 1).text() == "on the GPU"
    assert dialog.sharing_table.item(0, 2).text() == "99.2 MiB"  # its weights
    glance = dialog.holder_label.text() + " " + dialog.sharing_table.item(0, 1).text()
    assert not any(w in glance for w in ("Arena", "Host shadow", "inplace", "released", "resident"))
    # the engineering knobs are under Advanced, folded
    assert dialog.advanced.isHidden() and not dialog.quantum.isVisible()
    dialog.advanced_button.click()
    assert not dialog.advanced.isHidden() and dialog.quantum.isVisible()
    assert "Host shadow" not in [dialog.arena_table.horizontalHeaderItem(i).text() for i in range(5)]
    # the budget as a slider in GB: what it says is what is saved
    dialog.budget_slider.setValue(12)
    assert dialog.vram_budget.currentText() == "12GB"
    config = dialog.validated()
    assert config is not None and config.arena.vram_budget == "12GB"
    assert strings.SHARING_TAB == "Sharing the GPU"
    assert dialog.tabs.tabText(dialog.sharing_index) == "Sharing the GPU"
    assert "GPU" in dialog.budget_note.text()

    # a CPU-only build: no "GPU" on the page (its name, the note, the slider, who is active)
    cpu = dataclasses.replace(smol, backend="CPU")
    dialog._refresh_arena(PoolSnapshot(models=(cpu,), holder="smol"))
    assert dialog.tabs.tabText(dialog.sharing_index) == "Sharing memory"
    page = [
        dialog.holder_label.text(),
        dialog.sharing_table.item(0, 1).text(),
        dialog.budget_note.text(),
        dialog.budget_slider.toolTip(),
    ]
    assert not any("GPU" in text for text in page), page
    assert dialog.sharing_table.item(0, 1).text() == "in memory"
