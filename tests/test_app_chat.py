"""The app end to end with real workers on the two demo models (offscreen Qt).

Type into the chat window, send, stream, switch model, and watch the tray's holder change; tray
menu actions reach the pool; quitting stops every worker (in-process and as a real `timeshare`
process killed with SIGTERM).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _proc_util import alive
from timeshare.app import strings
from timeshare.app.transcript import answer_line
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig
from timeshare.core.state import ModelState

pytestmark = [pytest.mark.slow, pytest.mark.gui]

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"


def demo_config(smollm2: Path, gemma3: Path | None = None) -> Config:
    models = [
        ModelConfig(
            id=SMOL, name="SmolLM2-135M-Instruct", path=str(smollm2), licence="Apache-2.0", n_ctx=1024
        )
    ]
    if gemma3 is not None:
        models.append(
            ModelConfig(
                id=GEMMA, name="Gemma-3-270M (base)", path=str(gemma3), licence="Gemma Terms", n_ctx=1024
            )
        )
    # one model on the GPU at a time: these tests watch the GPU change hands (the module's pool
    # starts before the per-test TIMESHARE_VRAM_BUDGET of conftest.py is set)
    return Config(
        models=tuple(models), api=ApiConfig(enabled=False), arena=ArenaConfig(vram_budget="one-model")
    )


@pytest.fixture(scope="module")
def pool(smollm2_path: Path, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from timeshare.core.pool.supervisor import Pool

    root = tmp_path_factory.mktemp("pool")
    arena = root / "arena"
    arena.mkdir(mode=0o700)
    p = Pool(
        demo_config(smollm2_path, gemma3_path), arena_dir=arena, log_dir=root / "log", kv_dir=root / "kv"
    )
    p.start()
    p.wait_ready(timeout=240)
    yield p
    p.stop()


@pytest.fixture
def app(qtbot: Any, pool: Any, tmp_path: Path) -> Iterator[Any]:
    from timeshare.app.application import TimeshareApp
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store

    store = Store(tmp_path / "conversations.sqlite3")
    ta = TimeshareApp(
        pool.config,
        pool,
        store,
        ChatService(pool, store),
        config_path=tmp_path / "config.toml",
        tray_available=True,
    )
    ta.start(background=False)
    ta.window.max_tokens = 40  # short answers keep the test fast on a 2-core CI machine
    qtbot.addWidget(ta.window)
    yield ta
    ta.window.detach()
    ta.bridge.detach()  # the pool outlives this test; stop listening to it
    ta.window.hide()
    if ta.tray is not None:
        ta.tray.hide()
    store.close()


def send_and_wait(qtbot: Any, window: Any, text: str, timeout: int = 120_000) -> tuple[str, Any, str]:
    with qtbot.waitSignal(window.answer_finished, timeout=timeout) as blocker:
        qtbot.keyClicks(window.input, text)
        qtbot.keyClick(window.input, "\r")  # Enter sends
    return tuple(blocker.args)  # type: ignore[return-value]


def select_model(window: Any, model_id: str) -> None:
    index = window.model_box.findData(model_id)
    assert index >= 0, f"{model_id} is not in the model selector"
    window.model_box.setCurrentIndex(index)
    window.model_box.activated.emit(index)


def test_chat_streams_switches_model_and_the_tray_follows(qtbot: Any, app: Any) -> None:
    window = app.window
    assert window.isVisible()
    # the licence is shown where models are listed
    select_model(window, SMOL)
    assert window.licence.text() == "Licence: Apache-2.0"

    pieces: list[str] = []
    conv = window.new_conversation(SMOL)
    assert conv is not None

    qtbot.keyClicks(window.input, "What is the capital of France?")
    with qtbot.waitSignal(window.answer_finished, timeout=120_000) as blocker:
        qtbot.keyClick(window.input, "\r")
        assert window._stream is not None  # streaming started synchronously
        window._stream.piece.connect(pieces.append)
        assert not window.send_button.isEnabled() and window.stop_button.isEnabled()
    conv_id, stats, error = blocker.args
    assert error == "" and conv_id == conv
    assert window.input.toPlainText() == ""
    assert stats is not None and stats.finish_reason in ("stop", "length") and stats.completion_tokens > 0
    assert len(pieces) >= 2  # it streamed, piece by piece

    messages = app.store.messages(conv)
    assert [m.role for m in messages] == ["user", "assistant"]
    answer = messages[1].content
    assert answer.strip() and answer == "".join(pieces)
    shown = window.transcript.toPlainText()
    assert "What is the capital of France?" in shown
    assert answer.strip().splitlines()[0][:20] in shown
    assert "tokens/s" in shown and "first token" in shown

    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == SMOL, timeout=30_000)
    holds = strings.holds(strings.has_gpu(app.bridge.snapshot))  # "is active" without a GPU
    assert app.tray.icon.toolTip().startswith(f"SmolLM2-135M-Instruct {holds}")
    assert window.send_button.isEnabled() and not window.stop_button.isEnabled()

    # switch the conversation's model: Gemma takes the GPU, the tray says so
    select_model(window, GEMMA)
    assert app.store.get(conv).model_id == GEMMA
    assert window.licence.text() == "Licence: Gemma Terms"
    _, stats2, error2 = send_and_wait(qtbot, window, "The capital of Italy is")
    assert error2 == ""
    assert stats2 is not None
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == GEMMA, timeout=30_000)
    # SmolLM2 reports its release on its own pipe after it let the GPU go: the pool may see Gemma
    # take it first
    qtbot.waitUntil(lambda: app.bridge.snapshot.model(SMOL).state is not ModelState.RESIDENT, timeout=30_000)
    assert app.tray.icon.toolTip().startswith(f"Gemma-3-270M (base) {holds}")
    assert "1 other set aside" in app.tray.icon.toolTip()
    # Gemma was released (SmolLM2 held the GPU): either the request paid the switch, or picking
    # the model pre-woke it and the switch happened while we typed; the line says which
    assert stats2.switched or stats2.prewoken
    gpu = strings.has_gpu(app.bridge.snapshot)  # "switch", not "GPU switch", on a CPU build
    line = answer_line(stats2, gpu=gpu)
    assert ("switch" in line) if stats2.switched else ("restored while you typed" in line)
    assert line in window.statusBar().currentMessage()
    assert len(app.store.messages(conv)) == 4


def test_send_returns_while_the_pool_thread_is_held(qtbot: Any, app: Any, pool: Any) -> None:
    import threading

    window = app.window
    conv = window.new_conversation(SMOL)
    held = threading.Event()  # the test's own: the pool thread waits on it
    holding = threading.Event()
    timed_out: list[bool] = []

    def hold() -> None:  # runs on the pool thread (posted to its inbox)
        holding.set()
        timed_out.append(not held.wait(30))

    pool._actor.post(hold)
    assert holding.wait(30)
    try:
        qtbot.keyClicks(window.input, "Say hello.")
        with qtbot.waitSignal(window.answer_finished, timeout=120_000) as blocker:
            qtbot.keyClick(window.input, "\r")  # Send: it must not wait for the pool thread
            # back on the GUI thread while the pool thread is still held: the answer is under way
            assert not held.is_set() and not timed_out
            assert window._stream is not None and not window.send_button.isEnabled()
            assert window.stop_button.isEnabled()
            held.set()
    finally:
        held.set()
    assert timed_out == [False]  # the test released the pool thread, not the timeout
    conv_id, stats, error = blocker.args
    assert conv_id == conv and error == ""
    assert stats is not None and stats.completion_tokens > 0
    assert [m.role for m in app.store.messages(conv)] == ["user", "assistant"]


def test_typing_prewakes_the_conversations_model(qtbot: Any, app: Any) -> None:
    window = app.window
    # make sure SmolLM2 is not on the GPU: wake Gemma and wait for the holder to change
    app.bridge.wake(GEMMA)
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == GEMMA, timeout=60_000)
    # focusing the input of a conversation pre-wakes its model
    with qtbot.waitSignal(window.prewake_requested, timeout=5000) as blocker:
        window.new_conversation(SMOL)
    assert blocker.args == [SMOL]
    assert window.model_box.currentData() == SMOL
    # the restore happens while the user is still typing: no request was sent
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == SMOL, timeout=60_000)
    assert app.store.messages(window.current_conversation()) == []

    # typing pre-wakes too (at most once every few seconds per model)
    app.bridge.wake(GEMMA)
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == GEMMA, timeout=60_000)
    window._last_prewake.clear()
    with qtbot.waitSignal(window.prewake_requested, timeout=5000) as blocker:
        qtbot.keyClicks(window.input, "Hel")
    assert blocker.args == [SMOL]
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == SMOL, timeout=60_000)

    # turned off in the settings: typing does not wake anything
    app.config = dataclasses.replace(
        app.config, general=dataclasses.replace(app.config.general, prewake_on_typing=False)
    )
    app.bridge.wake(GEMMA)
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == GEMMA, timeout=60_000)
    woken: list[str] = []
    window.prewake_requested.connect(woken.append)
    window._last_prewake.clear()
    qtbot.keyClicks(window.input, "lo")
    # textChanged reaches the pre-wake in the same thread, inside keyClicks: nothing to wait for
    assert woken == []
    # the control: the same keystroke with the setting back on wakes at once, so the empty list
    # above is the setting's doing, not a signal that had not arrived yet
    app.config = dataclasses.replace(
        app.config, general=dataclasses.replace(app.config.general, prewake_on_typing=True)
    )
    qtbot.keyClicks(window.input, "!")
    assert woken == [SMOL]
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == SMOL, timeout=60_000)


def test_waiting_for_a_pinned_model_is_said_in_the_window_and_the_tray(qtbot: Any, app: Any) -> None:
    import re

    window = app.window
    # the pool's reason in the GUI's words: display names, "memory" without a GPU
    waiting = strings.for_people("waiting for the GPU: pinned by gemma3-270m", app.bridge.snapshot)
    assert "Gemma-3-270M (base)" in waiting and "gemma3-270m" not in waiting
    holds = strings.holds(strings.has_gpu(app.bridge.snapshot))
    # Gemma takes the GPU and keeps it
    app.bridge.pin(GEMMA, True)
    app.bridge.wake(GEMMA)
    qtbot.waitUntil(
        lambda: app.bridge.snapshot.holder == GEMMA and bool(app.bridge.snapshot.model(GEMMA).pinned),
        timeout=120_000,
    )
    try:
        window.new_conversation(SMOL)
        qtbot.keyClicks(window.input, "Hello!")
        with qtbot.waitSignal(window.answer_finished, timeout=180_000) as blocker:
            qtbot.keyClick(window.input, "\r")
            # the window says what the answer waits for, then for how long
            qtbot.waitUntil(lambda: waiting in window.wait_label.text(), timeout=120_000)
            assert window.wait_label.text().startswith(f"SmolLM2-135M-Instruct is {waiting}")
            assert not window.wait_row.isHidden()
            qtbot.waitUntil(
                lambda: re.search(r", \d+ s$", window.wait_label.text()) is not None, timeout=60_000
            )
            # so does the tray: who holds the GPU, who waits and how long
            tip = app.tray.icon.toolTip
            assert tip().startswith(f"Gemma-3-270M (base) {holds} (pinned)")
            pattern = rf"SmolLM2-135M-Instruct {re.escape(waiting)}, \d+ s"
            qtbot.waitUntil(lambda: re.search(pattern, tip()) is not None, timeout=60_000)
            # the window offers Unpin in place: Gemma lets go, the answer comes
            unpin = window.problem_bar.unpin_button
            assert not unpin.isHidden() and unpin.text() == "Unpin Gemma-3-270M (base)"
            unpin.click()
        _, stats, error = blocker.args
        assert error == "" and stats is not None and stats.finish_reason in ("stop", "length")
        # the wait is in its line, whether the request or the pre-wake (typing) took the GPU
        assert stats.switched and stats.wait_ms > 0 and not stats.prewoken
        assert "waited" in answer_line(stats) and "restored while you typed" not in answer_line(stats)
        # the wait line follows the pool's snapshots (its event thread), not the answer's end
        qtbot.waitUntil(window.wait_row.isHidden, timeout=60_000)
        qtbot.waitUntil(lambda: "waiting" not in app.tray.icon.toolTip(), timeout=60_000)
    finally:
        app.bridge.pin(GEMMA, False)
        qtbot.waitUntil(lambda: not app.bridge.snapshot.model(GEMMA).pinned, timeout=60_000)


def test_stop_button_cancels_a_long_answer(qtbot: Any, app: Any) -> None:
    from PySide6.QtCore import Qt

    window = app.window
    window.max_tokens = 900
    conv = window.new_conversation(SMOL)
    qtbot.keyClicks(window.input, "Write a very long story about a dragon.")
    with qtbot.waitSignal(window.answer_finished, timeout=120_000) as blocker:
        qtbot.keyClick(window.input, "\r")
        stream = window._stream
        assert stream is not None
        qtbot.waitUntil(lambda: stream.first_at is not None, timeout=60_000)
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    _, stats, error = blocker.args
    assert error == ""
    assert stats is not None and stats.finish_reason == "cancelled"
    assert stats.completion_tokens < 900
    answer = app.store.messages(conv)[-1]
    assert answer.role == "assistant" and answer.complete
    assert "stopped" in window.transcript.toPlainText()


def test_conversations_new_rename_delete(qtbot: Any, app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from PySide6.QtWidgets import QInputDialog, QMessageBox

    window = app.window
    first = window.new_conversation(SMOL)
    second = window.new_conversation(GEMMA)
    assert window.current_conversation() == second
    assert window.model_box.currentData() == GEMMA
    window.conversations.setCurrentRow(
        next(
            i for i in range(window.conversations.count()) if window.conversations.item(i).data(256) == first
        )
    )
    assert window.model_box.currentData() == SMOL  # the selector follows the conversation

    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("Capitals", True))
    window.rename_conversation()
    assert app.store.get(first).title == "Capitals"
    assert "Capitals" in [window.conversations.item(i).text() for i in range(window.conversations.count())]

    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.No)
    window.delete_conversation()
    assert app.store.get(first).title == "Capitals"  # "No" keeps it
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    window.delete_conversation()
    assert first not in [c.id for c in app.store.list_conversations()]


def test_tray_menu_actions_reach_the_pool(qtbot: Any, app: Any) -> None:
    from PySide6.QtGui import QAction
    from PySide6.QtWidgets import QMenu

    tray = app.tray
    tray.menu.aboutToShow.emit()  # what opening the menu does

    def find(command: str, model: str) -> Any:
        for action in tray.menu.findChildren(QAction):
            if action.objectName() == f"{command}:{model}":
                return action
        raise AssertionError(f"no {command} action for {model}")

    if app.bridge.snapshot.holder == GEMMA:
        app.bridge.wake(SMOL)
        qtbot.waitUntil(lambda: app.bridge.snapshot.holder == SMOL, timeout=60_000)
        tray.menu.aboutToShow.emit()
    find("wake", GEMMA).trigger()
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == GEMMA, timeout=60_000)
    assert app.tray.state.value == "holding"

    tray.menu.aboutToShow.emit()
    find("pin", GEMMA).trigger()
    qtbot.waitUntil(lambda: bool(app.bridge.snapshot.model(GEMMA).pinned), timeout=30_000)
    tray.menu.aboutToShow.emit()
    gemma_menu = next(m for m in tray.menu.findChildren(QMenu) if m.objectName() == f"model:{GEMMA}")
    assert "pinned" in gemma_menu.title()
    assert "(pinned)" in tray.icon.toolTip()
    find("unpin", GEMMA).trigger()
    qtbot.waitUntil(lambda: not app.bridge.snapshot.model(GEMMA).pinned, timeout=30_000)

    # Chat… opens the window on a conversation with that model
    app.window.hide()
    tray.menu.aboutToShow.emit()
    find("chat", SMOL).trigger()
    assert app.window.isVisible() and app.window.model_box.currentData() == SMOL

    # Sleep: the model leaves the GPU
    tray.menu.aboutToShow.emit()
    find("sleep", GEMMA).trigger()
    qtbot.waitUntil(
        lambda: (
            app.bridge.snapshot.model(GEMMA).state in (ModelState.SLEEPING, ModelState.RELEASED)
            and app.bridge.snapshot.holder != GEMMA
        ),
        timeout=60_000,
    )

    # the settings' arena tab shows the live holder and memory per model
    dialog = app.open_settings()
    dialog.tabs.setCurrentIndex(1)
    app.bridge.wake(SMOL)
    qtbot.waitUntil(
        lambda: (
            dialog.holder_label.text()
            in ("SmolLM2-135M-Instruct holds the GPU now.", "SmolLM2-135M-Instruct is active now.")
        ),  # no GPU
        timeout=60_000,
    )
    assert dialog.arena_table.rowCount() == 2
    dialog.reject()


def test_a_crashed_worker_is_announced_and_comes_back(qtbot: Any, app: Any) -> None:
    status = app.bridge.snapshot.model(GEMMA)
    assert status is not None and status.pid is not None
    notes: list[tuple[str, str]] = []
    app.bridge.notification.connect(lambda title, message: notes.append((title, message)))
    os.kill(status.pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: any(t == "Gemma-3-270M (base) crashed" for t, _ in notes), timeout=30_000)
    qtbot.waitUntil(lambda: any(t == "Gemma-3-270M (base) restarted" for t, _ in notes), timeout=60_000)
    qtbot.waitUntil(
        lambda: app.bridge.snapshot.model(GEMMA).state in (ModelState.RELEASED, ModelState.RESIDENT),
        timeout=120_000,
    )
    assert app.bridge.snapshot.model(GEMMA).pid != status.pid
    assert not alive(status.pid)


def test_quit_stops_every_worker(qtbot: Any, smollm2_path: Path, tmp_path: Path) -> None:
    from timeshare.app.application import TimeshareApp
    from timeshare.app.menu_model import Action, Command
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store
    from timeshare.core.pool.supervisor import Pool

    pool = Pool(demo_config(smollm2_path))
    pool.start()
    pool.wait_ready(timeout=120)
    pids = [m.pid for m in pool.snapshot().models]
    assert pids and all(pid is not None and alive(pid) for pid in pids)
    store = Store(tmp_path / "c.sqlite3")
    app = TimeshareApp(pool.config, pool, store, ChatService(pool, store), tray_available=True)
    app.start(background=True)
    assert not app.window.isVisible()  # --background: only the tray
    with qtbot.waitSignal(app.quit_requested, timeout=1000):
        app.handle(Action("Quit", Command.QUIT))
    app.shutdown()
    store.close()
    assert [pid for pid in pids if pid is not None and alive(pid)] == []


def _worker_children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.split(")")[-1].split()[1]) == pid and b"timeshare.core.worker" in cmdline:
            out.append(int(entry.name))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_the_app_leaves_no_orphans(
    smollm2_path: Path, timeshare_home: Path, tmp_path: Path
) -> None:
    config = timeshare_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'[api]\nenabled = false\n\n[[models]]\nid = "{SMOL}"\npath = "{smollm2_path}"\nn_ctx = 512\n'
    )
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    exe = Path(sys.executable).with_name("timeshare")
    log = tmp_path / "app-output.txt"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(exe), "tray", "--background"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while time.monotonic() < deadline and not workers:
            assert proc.poll() is None, log.read_text()
            workers = _worker_children(proc.pid)
            time.sleep(0.2)
        assert workers, "the app did not start a worker"
        # a second launch hands over to the first (single instance) and exits at once
        second = subprocess.run([str(exe), "tray"], env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 0, second.stderr
        assert "already running" in second.stdout
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        output = log.read_text()
        assert rc == 0, output
        assert [pid for pid in workers if alive(pid)] == [], output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
