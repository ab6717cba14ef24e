"""The chat window's conversation tools with a real worker (SmolLM2, offscreen Qt): a message of the
user's edited and sent again replaces it and what followed; the search over conversations finds
words in titles and messages; a conversation exported as Markdown and JSON; long titles wrap in
the list instead of hiding behind a sideways scroll bar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _app_util import running_app
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig

pytestmark = [pytest.mark.slow, pytest.mark.gui]

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def pool(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from timeshare.core.pool.supervisor import Pool

    root = tmp_path_factory.mktemp("pool")
    arena = root / "arena"
    arena.mkdir(mode=0o700)
    config = Config(
        models=(ModelConfig(id=SMOL, name="SmolLM2", path=str(smollm2_path), n_ctx=1024),),
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
    with running_app(qtbot, pool, tmp_path, max_tokens=12) as ta:
        yield ta


def _send(qtbot: Any, window: Any, text: str) -> tuple[Any, ...]:
    with qtbot.waitSignal(window.answer_finished, timeout=120_000) as blocker:
        qtbot.keyClicks(window.input, text)
        qtbot.keyClick(window.input, "\r")
    return tuple(blocker.args)


def test_edit_a_message_and_send_it_again(qtbot: Any, app: Any) -> None:
    from PySide6.QtCore import QUrl

    window = app.window
    conv = window.new_conversation(SMOL)
    _send(qtbot, window, "What is the capital of France?")
    _send(qtbot, window, "And of Italy?")
    first = app.store.messages(conv)[0]
    assert f'href="edit:{first.id}"' in window.transcript.toHtml()  # each message of yours: Edit

    window.transcript.anchorClicked.emit(QUrl(f"edit:{first.id}"))  # the Edit link clicked
    assert window.input.toPlainText() == "What is the capital of France?"
    assert not window.edit_bar.isHidden() and window.send_button.text() == "Resend"
    window.input.clear()
    _, stats, error = _send(qtbot, window, "What is the capital of Spain?")
    assert error == "" and stats is not None

    messages = app.store.messages(conv)
    assert [m.role for m in messages] == ["user", "assistant"]  # the old turns gave way
    assert messages[0].content == "What is the capital of Spain?" and messages[1].content
    assert "Italy" not in window.transcript.toPlainText()
    assert window.edit_bar.isHidden() and window.send_button.text() == "Send"

    # Cancel edit leaves the conversation as it was
    window.transcript.anchorClicked.emit(QUrl(f"edit:{messages[0].id}"))
    window.cancel_edit_button.click()
    assert window.input.toPlainText() == "" and window.editing is None
    assert len(app.store.messages(conv)) == 2


def test_search_finds_words_in_titles_and_messages(qtbot: Any, app: Any) -> None:
    window, store = app.window, app.store
    a = store.create_conversation(SMOL, "Dragons").id
    store.add_message(a, "user", "Tell me about a dragon who cooks")
    b = store.create_conversation(SMOL, "Cooking").id
    store.add_message(b, "user", "A recipe for pancakes, please")
    store.add_message(b, "assistant", "Mix flour, eggs and milk.")
    c = store.create_conversation(SMOL, "Weather").id
    store.add_message(c, "user", "Will it rain tomorrow?")
    window.reload_conversations()

    def shown() -> set[str]:
        items = [window.conversations.item(i) for i in range(window.conversations.count())]
        return {str(item.data(256)) for item in items}

    assert shown() == {a, b, c}
    qtbot.keyClicks(window.search, "FLOUR")  # an answer's word, any case
    qtbot.waitUntil(lambda: shown() == {b})
    assert window.current_conversation() == b
    window.search.clear()
    qtbot.keyClicks(window.search, "dragon cooks")  # every word, anywhere in the conversation
    qtbot.waitUntil(lambda: shown() == {a})
    window.search.clear()
    qtbot.keyClicks(window.search, "nothing like this")
    qtbot.waitUntil(lambda: shown() == set())
    assert "No conversation holds" in window.transcript.toPlainText()
    window.search.clear()
    qtbot.waitUntil(lambda: shown() == {a, b, c})


def test_export_as_markdown_and_json(qtbot: Any, app: Any, tmp_path: Path) -> None:
    window, store = app.window, app.store
    conv = window.new_conversation(SMOL)
    _send(qtbot, window, "Say hello.")
    answer = store.messages(conv)[-1].content

    md = window.export_conversation(tmp_path / "hello")  # no suffix: Markdown
    assert md == tmp_path / "hello.md"
    text = md.read_text()
    assert text.startswith("# Say hello.") and "## You\n\nSay hello." in text
    assert f"## SmolLM2\n\n{answer}" in text
    assert "hello.md" in window.statusBar().currentMessage()

    data = json.loads(window.export_conversation(tmp_path / "hello.json").read_text())
    assert data["format"] == "timeshare-conversation" and data["model"] == SMOL
    assert [(m["role"], m["content"]) for m in data["messages"]] == [
        ("user", "Say hello."),
        ("assistant", answer),
    ]
    assert data["messages"][1]["stats"]["completion_tokens"] > 0
    assert data["answer_settings"]["max_tokens"] == store.get(conv).max_tokens

    # a folder that cannot be written: said in words, nothing half-written
    from PySide6.QtWidgets import QMessageBox

    said: list[str] = []
    original = QMessageBox.warning
    QMessageBox.warning = staticmethod(lambda _p, _t, text, *a: said.append(text))  # type: ignore[method-assign]
    try:
        assert window.export_conversation(tmp_path / "no-such-folder" / "x.md") is None
    finally:
        QMessageBox.warning = original  # type: ignore[method-assign]
    assert said and "Could not save x.md" in said[0]


def test_long_titles_wrap_instead_of_hiding_behind_a_scroll_bar(qtbot: Any, app: Any) -> None:
    window, store = app.window, app.store
    title = "Write a Python function that returns the sum of a list of numbers, in a code block"
    store.create_conversation(SMOL, title)
    window.reload_conversations()
    window.resize(980, 640)
    window.show()
    qtbot.waitExposed(window)
    view = window.conversations
    item = view.item(0)
    assert item.text() == title and item.toolTip() == title
    rect = view.visualItemRect(item)
    assert not view.horizontalScrollBar().isVisible()
    assert rect.width() <= view.viewport().width()
    assert rect.height() > 1.5 * view.fontMetrics().height()  # wrapped on more than one line
