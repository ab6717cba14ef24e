"""Conversation store: real SQLite files, real threads, a real process killed mid-write."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeshare.core import paths
from timeshare.core.conversations.store import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    SCHEMA_VERSION,
    AnswerStats,
    Store,
)
from timeshare.core.errors import StoreError, UnknownConversationError, UnknownMessageError


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "conv.sqlite3")
    yield s
    s.close()


def test_default_location_wal_and_schema_version() -> None:
    with Store() as s:
        assert s.path == paths.conversations_db()
        s.create_conversation("m")
    db = sqlite3.connect(paths.conversations_db())
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        db.close()


def test_conversations_lifecycle(store: Store) -> None:
    a = store.create_conversation("smol", "first")
    b = store.create_conversation("gemma")
    assert a.id != b.id and len(a.id) == 36
    assert [c.id for c in store.list_conversations()] == [b.id, a.id]  # newest first
    assert [c.id for c in store.list_conversations("smol")] == [a.id]

    store.add_message(a.id, "user", "hello")  # activity moves a conversation to the top
    listed = store.list_conversations()
    assert [c.id for c in listed] == [a.id, b.id]
    assert listed[0].message_count == 1 and listed[0].updated >= listed[0].created

    assert store.rename(a.id, "renamed").title == "renamed"
    assert store.set_model(a.id, "gemma").model_id == "gemma"
    assert store.get(a.id).title == "renamed"

    store.delete(a.id)
    assert [c.id for c in store.list_conversations()] == [b.id]
    with pytest.raises(UnknownConversationError, match="start a new one"):
        store.get(a.id)


def test_messages_in_order_with_stats(store: Store) -> None:
    c = store.create_conversation("smol")
    u = store.add_message(c.id, "user", "hi")
    a = store.add_message(c.id, "assistant", "", complete=False)
    store.update_message(a.id, "Hel", complete=False)
    assert store.message(a.id).content == "Hel" and not store.message(a.id).complete
    assert [m.id for m in store.incomplete_messages()] == [a.id]
    stats = AnswerStats("stop", tokens_per_s=12.5, switched=True)
    store.update_message(a.id, "Hello!", complete=True, stats=stats)
    msgs = store.messages(c.id)
    assert [(m.id, m.role, m.content, m.complete) for m in msgs] == [
        (u.id, "user", "hi", True),
        (a.id, "assistant", "Hello!", True),
    ]
    assert (msgs[0].stats, msgs[1].stats) == (None, stats)
    assert store.incomplete_messages() == []
    store.delete_message(u.id)
    assert [m.id for m in store.messages(c.id)] == [a.id]


def test_stats_rows_written_by_older_versions_read_back(store: Store) -> None:
    c = store.create_conversation("smol")
    old = {
        '{"finish_reason": "cancelled", "model_id": "smol", "prewoken": true}': AnswerStats(
            "cancelled", model_id="smol", prewoken=True
        ),
        '{"finish_reason": "stop", "completion_tokens": 3, "ttft_ms": null, "tokens_per_s": "fast"}': (
            AnswerStats("stop", completion_tokens=3)
        ),
        "{}": None,
        "[1, 2]": None,
        "not json": None,
    }
    ids = {store.add_message(c.id, "assistant", "x").id: text for text in old}
    db = sqlite3.connect(store.path)
    with db:
        db.executemany("UPDATE messages SET stats = ? WHERE id = ?", [(t, i) for i, t in ids.items()])
    db.close()
    assert {ids[m.id]: m.stats for m in store.messages(c.id)} == old


def test_data_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "conv.sqlite3"
    with Store(path) as s:
        c = s.create_conversation("smol", "kept")
        s.add_message(c.id, "user", "remember me")
    with Store(path) as s:
        assert s.get(c.id).title == "kept"
        assert [m.content for m in s.messages(c.id)] == ["remember me"]


def test_deleting_a_conversation_deletes_its_messages(store: Store) -> None:
    c = store.create_conversation("smol")
    m = store.add_message(c.id, "user", "x")
    store.delete(c.id)
    with pytest.raises(UnknownMessageError):
        store.message(m.id)
    with pytest.raises(UnknownMessageError, match="its conversation may be deleted"):
        store.update_message(m.id, "y")


def test_bad_input_is_refused_and_changes_nothing(store: Store) -> None:
    c = store.create_conversation("smol")
    store.add_message(c.id, "user", "keep")
    with pytest.raises(ValueError, match="role must be one of system, user, assistant, not 'robot'"):
        store.add_message(c.id, "robot", "x")
    with pytest.raises(ValueError, match="needs the id of the model"):
        store.create_conversation("")
    with pytest.raises(UnknownConversationError):
        store.add_message("nope", "user", "x")
    with pytest.raises(UnknownConversationError):
        store.messages("nope")
    with pytest.raises(UnknownConversationError):
        store.rename("nope", "t")
    with pytest.raises(UnknownConversationError):
        store.delete("nope")
    with pytest.raises(UnknownMessageError):
        store.update_message(10_000, "x")
    assert [m.content for m in store.messages(c.id)] == ["keep"]
    assert len(store.list_conversations()) == 1


def test_a_file_that_is_not_a_database_is_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "conv.sqlite3"
    garbage = b"this is not sqlite, it is someone's notes\n" * 100
    path.write_bytes(garbage)
    with pytest.raises(StoreError, match=r"is not a usable conversation database .* move it aside"):
        Store(path)
    assert path.read_bytes() == garbage


def test_a_database_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "conv.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.execute("CREATE TABLE future (x)")
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="written by a newer Timeshare"):
        Store(path)
    assert path.read_bytes() == before


def test_threads_write_concurrently(store: Store) -> None:
    c = store.create_conversation("smol")
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(40):
                m = store.add_message(c.id, "user", f"{n}-{i}", complete=False)
                store.update_message(m.id, f"{n}-{i}!", complete=True)
                store.list_conversations()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    msgs = store.messages(c.id)
    assert len(msgs) == 240
    assert {m.content for m in msgs} == {f"{n}-{i}!" for n in range(6) for i in range(40)}
    assert all(m.complete for m in msgs)


def test_two_stores_on_one_file_see_each_other(tmp_path: Path) -> None:
    # the tray and `timeshare serve` may both open the database: WAL lets them
    path = tmp_path / "conv.sqlite3"
    with Store(path) as a, Store(path) as b:
        c = a.create_conversation("smol")
        a.add_message(c.id, "user", "from a")
        assert [m.content for m in b.messages(c.id)] == ["from a"]


def test_a_killed_process_loses_nothing_it_saved(tmp_path: Path) -> None:
    """The chat service saves the partial answer as it streams; a process killed right after a
    save must find that text when the app comes back."""
    path = tmp_path / "conv.sqlite3"
    script = textwrap.dedent(
        f"""
        import os, signal
        from timeshare.core.conversations.store import Store
        s = Store({str(path)!r})
        c = s.create_conversation("smol", "crash")
        s.add_message(c.id, "user", "tell me a story")
        a = s.add_message(c.id, "assistant", "", complete=False)
        s.update_message(a.id, "Once upon a", complete=False)
        print(c.id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    conv_id = proc.stdout.strip()
    with Store(path) as s:
        msgs = s.messages(conv_id)
        assert [(m.role, m.content, m.complete) for m in msgs] == [
            ("user", "tell me a story", True),
            ("assistant", "Once upon a", False),
        ]
        assert [m.id for m in s.incomplete_messages()] == [msgs[1].id]


def test_a_closed_store_raises_a_clear_error(tmp_path: Path) -> None:
    s = Store(tmp_path / "conv.sqlite3")
    c = s.create_conversation("smol")
    s.close()
    with pytest.raises(StoreError, match="is closed"):
        s.add_message(c.id, "user", "late")
    with pytest.raises(StoreError, match="is closed"):
        s.list_conversations()


def test_a_schema_1_database_gains_the_conversation_settings(tmp_path: Path) -> None:
    # a database as Timeshare wrote it before conversations had settings: it opens, keeps its
    # conversations and messages, and they get the default settings
    path = tmp_path / "conv.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE conversations (id TEXT PRIMARY KEY, model_id TEXT NOT NULL,
            title TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
        CREATE INDEX conversations_updated ON conversations(updated DESC);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL DEFAULT '', created REAL NOT NULL,
            complete INTEGER NOT NULL DEFAULT 1 CHECK (complete IN (0, 1)),
            stats TEXT NOT NULL DEFAULT '{}');
        CREATE INDEX messages_conversation ON messages(conversation_id, id);
        INSERT INTO conversations VALUES ('c1', 'smol', 'old one', 1.0, 2.0);
        INSERT INTO messages (conversation_id, role, content, created) VALUES ('c1', 'user', 'hi', 1.5);
        PRAGMA user_version=1;
        """
    )
    db.close()
    with Store(path) as s:
        (conv,) = s.list_conversations()
        assert (conv.id, conv.title, conv.message_count) == ("c1", "old one", 1)
        # old conversations: no length limit (schema 3), no repetition guard (schema 4)
        assert (conv.system_prompt, conv.temperature, conv.max_tokens, conv.repeat_penalty) == (
            "",
            DEFAULT_TEMPERATURE,
            None,
            1.0,
        )
        assert [m.content for m in s.messages("c1")] == ["hi"]
    check = sqlite3.connect(path)
    try:
        assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    finally:
        check.close()


def test_schema_3_turns_the_old_512_token_default_into_no_limit(tmp_path: Path) -> None:
    path = tmp_path / "conversations.db"
    with Store(path) as s:
        kept = s.set_options(s.create_conversation("smol").id, max_tokens=64)
        old = s.create_conversation("smol")
    db = sqlite3.connect(path)
    db.execute("UPDATE conversations SET max_tokens = 512 WHERE id = ?", (old.id,))
    db.execute("ALTER TABLE conversations DROP COLUMN repeat_penalty")  # schema 4's
    db.execute("DROP TABLE message_images")  # schema 5's
    db.execute("PRAGMA user_version=2")  # as schema 2 left it
    db.commit()
    db.close()
    with Store(path) as s:
        assert s.get(old.id).max_tokens is None  # 512 was schema 2's default: now no limit
        assert s.get(kept.id).max_tokens == 64  # a value the user chose stays
        assert s.create_conversation("smol").max_tokens == DEFAULT_MAX_TOKENS == 1024  # a new one: finite
        assert s.set_options(kept.id, max_tokens=0).max_tokens is None  # 0: no limit


def test_conversation_settings_are_kept_and_checked(store: Store, tmp_path: Path) -> None:
    a = store.create_conversation("smol")
    b = store.create_conversation("smol")
    before = store.get(a.id).updated
    changed = store.set_options(a.id, system_prompt="Answer in French.", temperature=0.7, max_tokens=64)
    assert (changed.system_prompt, changed.temperature, changed.max_tokens) == ("Answer in French.", 0.7, 64)
    assert changed.updated == before  # its place in the list stays
    # None leaves a setting as it is
    assert store.set_options(a.id, max_tokens=100).system_prompt == "Answer in French."
    assert store.get(b.id).system_prompt == ""
    for bad in ({"temperature": -0.1}, {"temperature": 2.5}, {"max_tokens": -1}, {"max_tokens": 1.5}):
        with pytest.raises(ValueError):
            store.set_options(a.id, **bad)  # type: ignore[arg-type]
    assert store.get(a.id).max_tokens == 100
    with pytest.raises(UnknownConversationError):
        store.set_options("nope", temperature=1.0)
    store.close()
    with Store(store.path) as again:
        kept = again.get(a.id)
        assert (kept.system_prompt, kept.temperature, kept.max_tokens) == ("Answer in French.", 0.7, 100)


def test_new_conversations_have_a_finite_limit_and_a_base_models_a_repetition_guard(tmp_path: Path) -> None:
    from timeshare.core.sampling import new_conversation

    with Store(tmp_path / "c.db") as s:
        chat = s.create_conversation("smol")
        assert chat.max_tokens is not None and chat.repeat_penalty == 1.0
        base = s.create_conversation("gemma", answers=new_conversation(base_model=True))
        assert base.max_tokens is not None and base.max_tokens < chat.max_tokens
        assert base.repeat_penalty > 1.0
        assert s.get(base.id) == base  # read back as written
        assert s.set_options(base.id, repeat_penalty=1.0).repeat_penalty == 1.0
        with pytest.raises(ValueError, match="repeat_penalty"):
            s.set_options(base.id, repeat_penalty=0.5)


def test_a_user_messages_images_are_kept_with_it(tmp_path: Path) -> None:
    """Issue 41: a message's images (bytes and place) come back with it, in order; deleting the
    message (or its conversation) deletes them."""
    from timeshare.core.wire.protocol import ImagePart

    store = Store(tmp_path / "c.db")
    conv = store.create_conversation("smol")
    images = (ImagePart(b"\x89PNG one", 0), ImagePart(b"\x89PNG two", 5))
    m = store.add_message(conv.id, "user", "hello there", images=images)
    store.add_message(conv.id, "assistant", "hi")
    got = store.messages(conv.id)
    assert got[0].images == images and got[1].images == ()
    store.delete_message(m.id)
    assert store.messages(conv.id)[0].images == ()
    store.close()
