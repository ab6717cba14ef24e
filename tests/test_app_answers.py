"""The chat window's answers with real workers on the two demo models (offscreen Qt): a base model's
conversation starts with a length limit and the repetition guard (shown in Answer settings), the
chat defaults are finite, "greedy" is said in words; Retry after a Stop and after a killed worker,
Regenerate after an answer; a Stop keeps the true count of the tokens generated.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _app_util import running_app
from timeshare.app import strings
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig
from timeshare.core.sampling import new_conversation
from timeshare.core.state import ModelState

pytestmark = [pytest.mark.slow, pytest.mark.gui]

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
LONG = "Write a very long story about a dragon who learns to cook."


@pytest.fixture(scope="module")
def pool(smollm2_path: Path, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from timeshare.core.pool.supervisor import Pool

    root = tmp_path_factory.mktemp("pool")
    arena = root / "arena"
    arena.mkdir(mode=0o700)
    config = Config(
        models=(
            ModelConfig(id=SMOL, name="SmolLM2", path=str(smollm2_path), n_ctx=1024),
            ModelConfig(id=GEMMA, name="Gemma", path=str(gemma3_path), n_ctx=1024),
        ),
        api=ApiConfig(enabled=False),
        arena=ArenaConfig(vram_budget="one-model"),
    )
    p = Pool(config, arena_dir=arena, log_dir=root / "log", kv_dir=root / "kv")
    p.start()
    p.wait_ready(timeout=240)
    yield p
    p.stop()


@pytest.fixture
def app(qtbot: Any, pool: Any, tmp_path: Path) -> Iterator[Any]:
    with running_app(qtbot, pool, tmp_path) as ta:
        yield ta


def _finished(qtbot: Any, window: Any, act: Any, timeout: int = 120_000) -> tuple[str, Any, str]:
    with qtbot.waitSignal(window.answer_finished, timeout=timeout) as blocker:
        act()
    return tuple(blocker.args)  # type: ignore[return-value]


def _type_and_send(qtbot: Any, window: Any, text: str) -> None:
    qtbot.keyClicks(window.input, text)
    qtbot.keyClick(window.input, "\r")


def test_a_base_model_starts_with_a_limit_and_the_repetition_guard_shown(qtbot: Any, app: Any) -> None:
    window = app.window
    gemma = app.bridge.snapshot.model(GEMMA)
    assert gemma is not None and strings.is_base_model(gemma)  # no chat template in its file
    assert not strings.is_base_model(app.bridge.snapshot.model(SMOL))
    base, chat = new_conversation(base_model=True), new_conversation()
    assert chat.max_tokens is not None  # the chat window's default "longest answer" is finite

    window.settings_button.click()  # Answer settings
    window.new_conversation(GEMMA)
    panel = window.settings_panel
    assert panel.max_tokens_box.value() == base.max_tokens
    assert base.repeat_penalty > 1.0
    assert panel.repeat_box.value() == pytest.approx(base.repeat_penalty)
    assert panel.repeat_box.text() != "off"
    assert not panel.greedy_note.isHidden() and "most likely next word" in panel.greedy_note.text()
    assert f"up to {base.max_tokens} tokens" in window.settings_summary.text()
    assert "repetition guard" in window.settings_summary.text()

    window.new_conversation(SMOL)
    assert panel.max_tokens_box.value() == chat.max_tokens
    assert panel.repeat_box.text() == "off"
    # switching the conversation's model to the base model brings its defaults (none were changed)
    index = window.model_box.findData(GEMMA)
    window.model_box.setCurrentIndex(index)
    window.model_box.activated.emit(index)
    conv = app.store.get(window.current_conversation())
    assert (conv.max_tokens, conv.repeat_penalty) == (base.max_tokens, base.repeat_penalty)
    assert panel.repeat_box.value() == pytest.approx(base.repeat_penalty)


def test_stop_keeps_the_token_count_and_retry_answers_again(qtbot: Any, app: Any) -> None:
    from PySide6.QtCore import Qt

    window = app.window
    conv = window.new_conversation(SMOL)
    assert not window.retry_button.isEnabled()  # nothing to answer yet
    window.max_tokens = 600

    def send_then_stop() -> None:
        _type_and_send(qtbot, window, LONG)
        stream = window._stream
        assert stream is not None
        qtbot.waitUntil(lambda: len(window._partial) > 40, timeout=90_000)
        # live tokens/s under the answer while it streams
        qtbot.waitUntil(lambda: "tokens/s" in window.transcript.toPlainText(), timeout=30_000)
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)

    from timeshare.core.state import EventKind

    done: list[dict[str, Any]] = []
    unsubscribe = app.pool.subscribe(
        lambda e: done.append(dict(e.extra)) if e.kind == EventKind.REQUEST_DONE else None
    )
    try:
        _, stats, error = _finished(qtbot, window, send_then_stop)
        # the pool publishes REQUEST_DONE on its event thread, maybe a moment after the answer ended
        qtbot.waitUntil(lambda: any(e.get("finish_reason") == "cancelled" for e in done), timeout=60_000)
    finally:
        unsubscribe()
    assert error == "" and stats.finish_reason == "cancelled"
    shown = app.store.messages(conv)[-1].content
    assert stats.completion_tokens > 5 and shown  # the tokens shown, not "0 tokens"
    # the true count (and the decode rate from it): the tokens the worker generated before the Stop
    (worker_said,) = [e for e in done if e.get("finish_reason") == "cancelled"]
    assert stats.completion_tokens == worker_said["completion_tokens"]
    # a count of 0 ("0 tokens"), not a rate that ends in it ("56.0 tokens/s": that failed once)
    assert not re.search(r"(?<![\d.])0 tokens", window.transcript.toPlainText())
    # after a Stop: Retry answers the same message again, replacing the stopped answer
    assert window.retry_button.isEnabled() and window.retry_button.text() == strings.RETRY
    window.max_tokens = 24
    _, stats2, error2 = _finished(qtbot, window, window.retry_button.click)
    assert error2 == "" and stats2.finish_reason in ("stop", "length")
    messages = app.store.messages(conv)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[-1].content and messages[-1].complete
    # after a finished answer the same button regenerates it
    assert window.retry_button.text() == strings.REGENERATE and window.retry_button.isEnabled()
    _, stats3, _ = _finished(qtbot, window, window.retry_button.click)
    assert stats3.finish_reason in ("stop", "length")
    assert [m.role for m in app.store.messages(conv)] == ["user", "assistant"]


def test_retry_after_the_worker_was_killed_mid_answer(qtbot: Any, app: Any) -> None:
    window = app.window
    conv = window.new_conversation(SMOL)
    window.max_tokens = 600

    def send_then_kill() -> None:
        _type_and_send(qtbot, window, LONG)
        qtbot.waitUntil(lambda: len(window._partial) > 20, timeout=90_000)
        status = app.bridge.snapshot.model(SMOL)
        assert status is not None and status.pid is not None
        os.kill(status.pid, signal.SIGKILL)

    _, stats, error = _finished(qtbot, window, send_then_kill)
    assert error and stats is None  # the answer failed: it had streamed part of its text
    assert window.retry_button.isEnabled() and window.retry_button.text() == strings.RETRY
    assert "Retry" in window.statusBar().currentMessage()
    qtbot.waitUntil(
        lambda: app.bridge.snapshot.model(SMOL).state in (ModelState.RELEASED, ModelState.RESIDENT),
        timeout=120_000,
    )
    window.max_tokens = 16
    _, stats2, error2 = _finished(qtbot, window, window.retry_button.click)
    assert error2 == "" and stats2.finish_reason in ("stop", "length")
    last = app.store.messages(conv)[-1]
    assert last.role == "assistant" and last.complete and last.content


CODE = 'def greet(name):\n    return f"hello {name}"'
ANSWER = f"Here it is:\n\n```python\n{CODE}\n```\n\nCall it with a name."


def test_code_is_highlighted_and_copy_links_fill_the_clipboard(
    qtbot: Any, app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    window = app.window
    conv = window.new_conversation(SMOL)
    app.store.add_message(conv, "user", "Write a greeting function.")
    app.store.add_message(conv, "assistant", ANSWER)
    monkeypatch.setenv("TIMESHARE_COLOR_SCHEME", "light")
    window.render_transcript()
    shown = window.transcript.toHtml()
    # Pygments' colours (inline): "def" and the string are styled, and the code sits on its own background
    assert "#f4f6f8" in shown and shown.count("color:#") >= 3
    assert "Copy code" in window.transcript.toPlainText() and "Copy" in window.transcript.toPlainText()
    assert set(window.copies) == {CODE, "Write a greeting function.", ANSWER}
    code_link = window.copies.index(CODE)
    window.transcript.anchorClicked.emit(QUrl(f"copy:{code_link}"))
    assert QGuiApplication.clipboard().text() == CODE
    window.transcript.anchorClicked.emit(QUrl(f"copy:{window.copies.index(ANSWER)}"))
    assert QGuiApplication.clipboard().text() == ANSWER  # a whole message, as Markdown
    # the dark scheme: the code gets dark colours
    monkeypatch.setenv("TIMESHARE_COLOR_SCHEME", "dark")
    window.render_transcript()
    assert "#272822" in window.transcript.toHtml()


def test_the_tray_icon_shows_who_holds_the_gpu(qtbot: Any, app: Any) -> None:
    from timeshare.app import icons
    from timeshare.app.menu_model import TrayState

    smol = icons.paint_state(TrayState.HOLDING, 32, "S").toImage()
    gemma = icons.paint_state(TrayState.HOLDING, 32, "G").toImage()
    assert smol != gemma  # another holder, another icon
    window = app.window
    window.max_tokens = 4
    window.new_conversation(GEMMA)
    _finished(qtbot, window, lambda: _type_and_send(qtbot, window, "Paris is"))
    qtbot.waitUntil(lambda: app.bridge.snapshot.holder == GEMMA, timeout=60_000)
    assert app.tray.holder_initial == "G"  # Gemma


def test_first_run_offers_a_prompt_per_model_and_a_base_model_continues_the_text(
    qtbot: Any, app: Any
) -> None:
    from PySide6.QtCore import QUrl
    from timeshare.app.transcript import TRY_BASE, TRY_CHAT

    window = app.window
    window.max_tokens = 16
    window.reload_conversations()
    assert window.current_conversation() is None  # a first run: no conversation yet
    # a prompt that suits each model: a question for the chat model, a text for the base model
    assert sorted(window.suggestions) == sorted([(SMOL, TRY_CHAT), (GEMMA, TRY_BASE)])
    html = window.transcript.toHtml()
    assert 'href="try:0"' in html and 'href="try:1"' in html
    shown = window.transcript.toPlainText()
    assert "Let Gemma continue" in shown and "Ask SmolLM2" in shown and "take turns" in shown

    index = [model for model, _ in window.suggestions].index(GEMMA)
    with qtbot.waitSignal(window.answer_finished, timeout=120_000) as blocker:
        window.transcript.anchorClicked.emit(QUrl(f"try:{index}"))  # the link clicked
    conv, stats, error = blocker.args
    assert error == "" and stats is not None and app.store.get(conv).model_id == GEMMA
    user, answer = app.store.messages(conv)
    assert user.content == TRY_BASE and answer.content.strip()
    # the text continued, not a chat bubble pair: one text, the continuation right after the prompt
    text = window.transcript.toPlainText()
    assert "Gemma continued your text:" in text and "You\n" not in text
    assert TRY_BASE + answer.content[:20] in text.replace("\u2029", "\n")
    # the base model was given the text itself (completion), not the fallback chat format: its
    # prompt is the few tokens of the sentence, not "User: …\nAssistant:" around it
    assert stats.prompt_tokens <= 10


def test_continuation_text_joins_a_base_models_conversation() -> None:
    from timeshare.core.conversations.chat import continuation_text
    from timeshare.core.conversations.store import Message

    def msg(i: int, role: str, text: str, complete: bool = True) -> Message:
        return Message(i, "c", role, text, 0.0, complete)  # type: ignore[arg-type]

    history = [
        msg(1, "user", "Once upon a time"),
        msg(2, "assistant", ", a dragon cooked."),
        msg(3, "user", "Then"),
    ]
    assert continuation_text(history) == "Once upon a time, a dragon cooked. Then"
    assert continuation_text(history[:1], "A story.") == "A story.\n\nOnce upon a time"
    assert continuation_text([*history, msg(4, "assistant", "", complete=False)]) == continuation_text(
        history
    )
