"""Conversations and their messages, in SQLite (WAL) in platformdirs' data dir.

A conversation is bound to one model. Messages are written before and during generation (the
assistant message starts empty and incomplete, is updated as text streams, and is marked complete
with its stats at the end), so a crash loses at most what was generated since the last update.

One connection guarded by a lock: every method is safe from any thread, and calls are short.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from .. import paths
from ..errors import StoreError, UnknownConversationError, UnknownMessageError
from ..sampling import AnswerDefaults, new_conversation
from ..wire.protocol import ImagePart

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")
SCHEMA_VERSION = 5

#: a conversation's answer settings until the user changes them (the chat window's defaults:
#: sampling.DEFAULTS["chat_window"]; a base model's conversation starts with "chat_window_base")
DEFAULT_TEMPERATURE = 0.0  # greedy
DEFAULT_MAX_TOKENS: int | None = new_conversation().max_tokens  # None in a conversation: no limit
DEFAULT_REPEAT_PENALTY = 1.0  # the repetition guard off
#: schema 2's default, which schema 3 turns into "no limit" (the column keeps 0 for it)
_OLD_DEFAULT_MAX_TOKENS = 512

_T = TypeVar("_T")

# Each step takes the schema from version i to i+1 (index i). Append only.
_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        model_id TEXT NOT NULL,
        title TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE INDEX conversations_updated ON conversations(updated DESC);
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        complete INTEGER NOT NULL DEFAULT 1 CHECK (complete IN (0, 1)),
        stats TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX messages_conversation ON messages(conversation_id, id);
    """,
    # 2: per-conversation answer settings (existing conversations get the defaults)
    f"""
    ALTER TABLE conversations ADD COLUMN system_prompt TEXT NOT NULL DEFAULT '';
    ALTER TABLE conversations ADD COLUMN temperature REAL NOT NULL DEFAULT {DEFAULT_TEMPERATURE!r};
    ALTER TABLE conversations ADD COLUMN max_tokens INTEGER NOT NULL DEFAULT {_OLD_DEFAULT_MAX_TOKENS};
    """,
    # 3: no answer length limit by default (0 in the column: none); conversations at schema 2's
    # default (512, which cut long answers off) get no limit, other values are kept
    f"""
    UPDATE conversations SET max_tokens = 0 WHERE max_tokens = {_OLD_DEFAULT_MAX_TOKENS};
    """,
    # 4: the repetition guard (llama.cpp's repeat penalty; 1.0: off, as every answer had it)
    f"""
    ALTER TABLE conversations ADD COLUMN repeat_penalty REAL NOT NULL DEFAULT {DEFAULT_REPEAT_PENALTY!r};
    """,
    # 5: a user message's images (issue 41): the file's bytes and its place in the text
    """
    CREATE TABLE message_images (
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        at INTEGER NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (message_id, position)
    );
    """,
)


@dataclass(frozen=True)
class Conversation:
    id: str
    model_id: str
    title: str
    created: float  # unix seconds
    updated: float
    message_count: int = 0
    # how its answers are made: the system prompt sent first ("" none), sampling temperature (0:
    # greedy), the most tokens an answer may have (None: no limit) and the repetition guard (1.0: off)
    system_prompt: str = ""
    temperature: float = DEFAULT_TEMPERATURE
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    repeat_penalty: float = DEFAULT_REPEAT_PENALTY


@dataclass(frozen=True)
class AnswerStats:
    """What an answer cost, saved with the assistant message when it ends (the ``stats`` column).

    ``finish_reason``: "stop", "length", "cancelled" or "error" (then ``error``, ``error_code``).
    A stopped or failed answer carries only what was known then: the counters stay 0 and
    ``ttft_ms`` None. Times are milliseconds; ``first_token_ms`` is the worker's (request received
    → first token), ``ttft_ms`` ChatService's (request sent → first piece).
    """

    finish_reason: str
    model_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_evaluated: int = 0  # prefilled for this answer (0: the KV cache had the prompt)
    switched: bool = False  # the model had to take the GPU over (see SwitchStats)
    wait_ms: float = 0.0
    restore_ms: float = 0.0
    first_token_ms: float = 0.0
    ttft_ms: float | None = None  # None: no token came
    elapsed_ms: float = 0.0
    tokens_per_s: float = 0.0  # decode rate: the tokens after the first over the time after it
    prewoken: bool = False  # the model was restored while the user typed (and did not switch at send)
    error: str = ""
    error_code: str = ""
    stop: str = ""  # finish_reason "stop": the stop string that ended it ("": its end-of-turn token)

    def to_json(self) -> dict[str, object]:
        """The JSON object saved in the store."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: object) -> AnswerStats | None:
        """Read a saved object back; None when it holds no answer stats (a user message, an answer
        still streaming). Tolerant of older rows: a missing or mistyped field gets its default."""
        if not isinstance(data, dict) or not isinstance(data.get("finish_reason"), str):
            return None

        def number(key: str) -> float | None:
            value = data.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return float(value)
            return None

        def count(key: str) -> int:
            value = number(key)
            return int(value) if value is not None else 0

        def text(key: str) -> str:
            value = data.get(key)
            return value if isinstance(value, str) else ""

        return cls(
            finish_reason=data["finish_reason"],
            model_id=text("model_id"),
            prompt_tokens=count("prompt_tokens"),
            completion_tokens=count("completion_tokens"),
            prompt_tokens_evaluated=count("prompt_tokens_evaluated"),
            switched=data.get("switched") is True,
            wait_ms=number("wait_ms") or 0.0,
            restore_ms=number("restore_ms") or 0.0,
            first_token_ms=number("first_token_ms") or 0.0,
            ttft_ms=number("ttft_ms"),
            elapsed_ms=number("elapsed_ms") or 0.0,
            tokens_per_s=number("tokens_per_s") or 0.0,
            prewoken=data.get("prewoken") is True,
            error=text("error"),
            error_code=text("error_code"),
            stop=text("stop"),
        )


def _stats_json(stats: AnswerStats | None) -> str:
    return json.dumps(stats.to_json() if stats is not None else {})


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: str
    role: Role
    content: str
    created: float
    complete: bool = True  # False: generation was running (or crashed) when this was last written
    stats: AnswerStats | None = None  # an assistant message's, once it ended
    images: tuple[ImagePart, ...] = ()  # a user message's images, in order, each with its place


def _no_conversation(conversation_id: str) -> UnknownConversationError:
    return UnknownConversationError(
        f"there is no conversation {conversation_id!r}: it may have been deleted — start a new one"
    )


def _check_role(role: str) -> Role:
    if role not in ROLES:
        raise ValueError(f"message role must be one of {', '.join(ROLES)}, not {role!r}")
    return role


class Store:
    """The conversation database. ``Store()`` opens ``paths.conversations_db()``."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else paths.conversations_db()
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the conversation database {self.path}: {exc}") from exc
        try:
            self._setup()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(
                f"{self.path} is not a usable conversation database ({exc}); it was left untouched: "
                "move it aside and start Timeshare again to begin a new one"
            ) from exc
        except BaseException:
            self._db.close()
            raise

    # ---- plumbing --------------------------------------------------------------------------

    def _setup(self) -> None:
        db = self._db
        db.row_factory = sqlite3.Row
        # Reading the schema first makes a non-database file fail here, before anything is written.
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} was written by a newer Timeshare (schema {version}, this one knows "
                f"{SCHEMA_VERSION}): upgrade Timeshare, or move the file aside to start a new one"
            )
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            log.warning("SQLite refused WAL mode for %s (got %s)", self.path, mode)
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across app crashes
        for target in range(version, SCHEMA_VERSION):
            # one transaction per step: a crash mid-migration leaves the previous version intact
            db.executescript("BEGIN;" + _MIGRATIONS[target] + f"PRAGMA user_version={target + 1};COMMIT;")
            log.info("conversation database %s migrated to schema %d", self.path, target + 1)

    def _failed(self, exc: sqlite3.Error) -> StoreError:
        if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
            return StoreError(f"the conversation database {self.path} is closed (Timeshare is shutting down)")
        hint = " — is the disk full?" if "full" in str(exc) else ""
        return StoreError(f"the conversation database {self.path} failed: {exc}{hint}; nothing was changed")

    def _write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._failed(exc) from exc
            try:
                result = fn(self._db)
                self._db.execute("COMMIT")
            except BaseException as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise self._failed(exc) from exc
                raise
            return result

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return list(self._db.execute(sql, args).fetchall())
            except sqlite3.Error as exc:
                raise self._failed(exc) from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _conversation(row: sqlite3.Row) -> Conversation:
        return Conversation(
            id=row["id"],
            model_id=row["model_id"],
            title=row["title"],
            created=row["created"],
            updated=row["updated"],
            message_count=row["message_count"],
            system_prompt=row["system_prompt"],
            temperature=row["temperature"],
            max_tokens=row["max_tokens"] or None,
            repeat_penalty=row["repeat_penalty"],
        )

    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
        try:
            stats = json.loads(row["stats"])
        except ValueError:
            stats = None
        return Message(
            id=row["id"],
            conversation_id=row["conversation_id"],
            role=row["role"],
            content=row["content"],
            created=row["created"],
            complete=bool(row["complete"]),
            stats=AnswerStats.from_json(stats),
        )

    # ---- conversations ---------------------------------------------------------------------

    _CONV_SELECT = (
        "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count "
        "FROM conversations c"
    )

    def create_conversation(
        self, model_id: str, title: str = "", *, answers: AnswerDefaults | None = None
    ) -> Conversation:
        """A new conversation with ``model_id``, its answer settings ``answers`` (default: the
        chat window's, ``sampling.new_conversation()``)."""
        if not model_id:
            raise ValueError("a conversation needs the id of the model it talks to")
        answers = answers or new_conversation()
        now = time.time()
        conv_id = str(uuid.uuid4())

        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO conversations (id, model_id, title, created, updated, temperature, "
                "max_tokens, repeat_penalty) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conv_id,
                    model_id,
                    title,
                    now,
                    now,
                    answers.temperature,
                    answers.max_tokens or 0,
                    answers.repeat_penalty,
                ),
            )

        self._write(insert)
        return Conversation(
            conv_id,
            model_id,
            title,
            now,
            now,
            0,
            temperature=answers.temperature,
            max_tokens=answers.max_tokens,
            repeat_penalty=answers.repeat_penalty,
        )

    def list_conversations(self, model_id: str | None = None) -> list[Conversation]:
        """Most recently updated first."""
        if model_id is None:
            rows = self._read(self._CONV_SELECT + " ORDER BY c.updated DESC, c.rowid DESC")
        else:
            rows = self._read(
                self._CONV_SELECT + " WHERE c.model_id = ? ORDER BY c.updated DESC, c.rowid DESC", (model_id,)
            )
        return [self._conversation(r) for r in rows]

    def get(self, conversation_id: str) -> Conversation:
        rows = self._read(self._CONV_SELECT + " WHERE c.id = ?", (conversation_id,))
        if not rows:
            raise _no_conversation(conversation_id)
        return self._conversation(rows[0])

    def _touch(self, db: sqlite3.Connection, conversation_id: str, now: float) -> None:
        cur = db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        if cur.rowcount == 0:
            raise _no_conversation(conversation_id)

    def rename(self, conversation_id: str, title: str) -> Conversation:
        def update(db: sqlite3.Connection) -> None:
            self._touch(db, conversation_id, time.time())
            db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

        self._write(update)
        return self.get(conversation_id)

    def set_model(self, conversation_id: str, model_id: str) -> Conversation:
        """Bind the conversation to another model (its history is prefilled there on the next turn)."""
        if not model_id:
            raise ValueError("a conversation needs the id of the model it talks to")

        def update(db: sqlite3.Connection) -> None:
            self._touch(db, conversation_id, time.time())
            db.execute("UPDATE conversations SET model_id = ? WHERE id = ?", (model_id, conversation_id))

        self._write(update)
        return self.get(conversation_id)

    def set_options(
        self,
        conversation_id: str,
        *,
        system_prompt: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        repeat_penalty: float | None = None,
    ) -> Conversation:
        """Change how the conversation's next answers are made (None: leave that one as it is;
        ``max_tokens`` 0: no limit; ``repeat_penalty`` 1.0: no repetition guard). Raises
        ValueError for a temperature below 0 or above 2, max_tokens below 0, or a repeat_penalty
        outside 1 to 2."""
        sets: list[str] = []
        args: list[Any] = []
        if system_prompt is not None:
            sets.append("system_prompt = ?")
            args.append(system_prompt)
        if temperature is not None:
            if not (isinstance(temperature, (int, float)) and 0.0 <= temperature <= 2.0):
                raise ValueError(f"temperature must be from 0 (greedy) to 2, not {temperature!r}")
            sets.append("temperature = ?")
            args.append(float(temperature))
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
                raise ValueError(
                    f"max_tokens must be a whole number of at least 1 (0: no limit), not {max_tokens!r}"
                )
            sets.append("max_tokens = ?")
            args.append(max_tokens)
        if repeat_penalty is not None:
            if not (isinstance(repeat_penalty, (int, float)) and 1.0 <= repeat_penalty <= 2.0):
                raise ValueError(f"repeat_penalty must be from 1 (off) to 2, not {repeat_penalty!r}")
            sets.append("repeat_penalty = ?")
            args.append(float(repeat_penalty))

        def update(db: sqlite3.Connection) -> None:
            # not "updated": a conversation keeps its place in the list when its settings change
            if not db.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone():
                raise _no_conversation(conversation_id)
            if sets:
                db.execute(
                    f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*args, conversation_id)
                )

        self._write(update)
        return self.get(conversation_id)

    def gone(self, key: str) -> bool:
        """``key`` has the shape of this store's conversation ids (a UUID) and names none of its
        conversations: a deleted one (what a KV file of it is kept for is gone)."""
        try:
            uuid.UUID(key)
        except ValueError:
            return False
        return not self._read("SELECT 1 FROM conversations WHERE id = ?", (key,))

    def delete(self, conversation_id: str) -> None:
        def remove(db: sqlite3.Connection) -> None:
            cur = db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            if cur.rowcount == 0:
                raise UnknownConversationError(f"there is no conversation {conversation_id!r} to delete")

        self._write(remove)

    # ---- messages --------------------------------------------------------------------------

    def messages(self, conversation_id: str) -> list[Message]:
        """The conversation's messages in order (raises UnknownConversationError if it is gone)."""
        if not self._read("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)):
            raise _no_conversation(conversation_id)
        rows = self._read("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        images = self._images_of(conversation_id)
        return [replace(self._message(r), images=images.get(r["id"], ())) for r in rows]

    def _images_of(self, conversation_id: str) -> dict[int, tuple[ImagePart, ...]]:
        rows = self._read(
            "SELECT i.message_id, i.at, i.data FROM message_images i JOIN messages m ON m.id = i.message_id "
            "WHERE m.conversation_id = ? ORDER BY i.message_id, i.position",
            (conversation_id,),
        )
        out: dict[int, list[ImagePart]] = {}
        for r in rows:
            out.setdefault(int(r["message_id"]), []).append(ImagePart(bytes(r["data"]), int(r["at"])))
        return {k: tuple(v) for k, v in out.items()}

    def message(self, message_id: int) -> Message:
        rows = self._read("SELECT * FROM messages WHERE id = ?", (message_id,))
        if not rows:
            raise UnknownMessageError(f"there is no message {message_id}")
        return self._message(rows[0])

    def add_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        *,
        complete: bool = True,
        stats: AnswerStats | None = None,
        images: tuple[ImagePart, ...] = (),
    ) -> Message:
        """``images``: a user message's, each placed in ``content`` (ImagePart.at)."""
        checked = _check_role(role)
        now = time.time()
        stats_json = _stats_json(stats)

        def insert(db: sqlite3.Connection) -> int:
            self._touch(db, conversation_id, now)
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, complete, stats) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, checked, content, now, int(complete), stats_json),
            )
            message_id = int(cur.lastrowid or 0)
            db.executemany(
                "INSERT INTO message_images (message_id, position, at, data) VALUES (?, ?, ?, ?)",
                [(message_id, i, img.at, img.data) for i, img in enumerate(images)],
            )
            return message_id

        message_id = self._write(insert)
        return Message(message_id, conversation_id, checked, content, now, complete, stats, images)

    def update_message(
        self,
        message_id: int,
        content: str,
        complete: bool | None = None,
        stats: AnswerStats | None = None,
    ) -> None:
        """Replace a message's text (and optionally its completeness and stats)."""
        sets = ["content = ?"]
        args: list[Any] = [content]
        if complete is not None:
            sets.append("complete = ?")
            args.append(int(complete))
        if stats is not None:
            sets.append("stats = ?")
            args.append(_stats_json(stats))

        def update(db: sqlite3.Connection) -> None:
            cur = db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))
            if cur.rowcount == 0:
                raise UnknownMessageError(
                    f"there is no message {message_id}: its conversation may be deleted"
                )
            db.execute(
                "UPDATE conversations SET updated = ? WHERE id = "
                "(SELECT conversation_id FROM messages WHERE id = ?)",
                (time.time(), message_id),
            )

        self._write(update)

    def delete_message(self, message_id: int) -> None:
        def remove(db: sqlite3.Connection) -> None:
            cur = db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            if cur.rowcount == 0:
                raise UnknownMessageError(f"there is no message {message_id}")

        self._write(remove)

    def incomplete_messages(self) -> list[Message]:
        """Assistant messages left incomplete (a crash or a kill during generation)."""
        rows = self._read("SELECT * FROM messages WHERE complete = 0 ORDER BY id")
        return [self._message(r) for r in rows]
