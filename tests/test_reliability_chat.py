"""The chat service refuses text that is not Unicode (issue 26): a lone surrogate in a message or
a title is an InvalidTextError whose sentence the chat window shows as it is (str(e)), nothing is
saved and nothing reaches the pool; the store stays intact and usable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timeshare.core.conversations.chat import ChatService
from timeshare.core.conversations.store import Store
from timeshare.core.errors import InvalidTextError, TimeshareError


class _NoPool:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def generate(self, model_id: str, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        raise AssertionError("nothing should reach the pool")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "conv.sqlite3")
    yield s
    s.close()


@pytest.mark.parametrize("text", ["hi \ud800 there", "\udfff", "ok \ud83d", "a\udc00\ud800b"])
def test_a_lone_surrogate_in_a_message_is_refused_in_a_sentence_and_saves_nothing(
    store: Store, text: str
) -> None:
    pool = _NoPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol")
    with pytest.raises(InvalidTextError) as caught:
        chat.send(conv.id, text)
    error = caught.value
    assert isinstance(error, TimeshareError)  # the chat window's `except (TimeshareError, ...)`
    message = str(error)
    assert "the message holds a broken character" in message and "delete it" in message
    bad = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    assert f"U+{ord(text[bad]):04X} at position {bad + 1}" in message
    message.encode("utf-8")  # the sentence itself can be shown
    assert store.messages(conv.id) == [] and pool.calls == []
    assert store.get(conv.id).title == ""  # not titled from the refused text either


def test_a_lone_surrogate_in_a_title_is_refused(store: Store) -> None:
    chat = ChatService(_NoPool(), store)
    with pytest.raises(InvalidTextError, match="the title holds a broken character"):
        chat.new_conversation("smol", "plan \ud800")
    assert store.list_conversations() == []


def test_a_pair_that_makes_a_character_is_fine(store: Store) -> None:
    chat = ChatService(_NoPool(), store)
    conv = chat.new_conversation("smol", "emoji \U0001f600")
    with pytest.raises(AssertionError, match="reach the pool"):  # accepted, so it went on
        chat.send(conv.id, "a smile \U0001f600")
    assert [m.content for m in store.messages(conv.id)] == ["a smile \U0001f600"]
