"""The Responses API's stored responses (``store: true``), in SQLite (WAL) in the data dir.

Each stored response keeps what a later turn needs to continue it (``previous_response_id``):
its model, the KV conversation of its chain, the response it followed, and its turn as chat
messages (its input, then its output); and what ``GET /v1/responses/{id}`` answers (the response
object, its input items). A chain is read back root first with one recursive query (SQLite
walks it iteratively, so no depth can exhaust a stack), at most ``max_turns`` deep.

Bounded: the oldest responses go first beyond ``keep``, and any older than ``days``
(``api.responses_kept``, ``api.responses_days``); a later response of a chain whose earlier one
went is refused when continued (``BrokenChainError``). The file outlives the process, so stored
responses (and, through the worker's KV files, their conversations' KV) survive a restart.

One connection guarded by a lock, opened on first use: every method is safe from any thread and
blocking (call it off the event loop).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from .. import paths
from ..errors import StoreError
from ..wire.protocol import ChatMessage

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DAY_S = 24 * 3600.0

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    created REAL NOT NULL,
    previous TEXT,
    conversation TEXT NOT NULL,
    depth INTEGER NOT NULL,
    turn TEXT NOT NULL,
    input_items TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX responses_created ON responses(created);
"""

_COLUMNS = "id, model, created, previous, conversation, depth, turn, input_items, body"

_TURN = msgspec.json.Decoder(tuple[ChatMessage, ...])


@dataclass(frozen=True)
class StoredResponse:
    id: str
    model: str  # the model's id
    created: float  # time.time()
    previous: str | None  # the response it continued (None: the first of its chain)
    conversation: str  # the KV conversation of its chain (the worker's sequence key)
    depth: int  # turns in its chain up to and including it (the first: 1)
    turn: tuple[ChatMessage, ...]  # its input, then its output, as chat messages
    input_items: tuple[dict[str, Any], ...]  # its input items, as GET .../input_items lists them
    body: dict[str, Any]  # the response object as it was answered


class BrokenChainError(Exception):
    """An earlier response of a chain is no longer stored (deleted, or gone past the bounds)."""

    def __init__(self, missing: str) -> None:
        super().__init__(missing)
        self.missing = missing


class ChainTooLongError(Exception):
    """A chain holds more turns than the caller allows."""


#: the KV conversation of a chain is named after its first response (``responses-<id>``)
CONVERSATION_PREFIX = "responses-"


class ResponseStore:
    """The stored responses. ``ResponseStore()`` opens ``paths.responses_db()`` when first used.

    ``forget``: called with a chain's KV conversation once no stored response is left in it
    (deleted, or gone past the bounds), after the change is committed, so its KV files go too
    (``Pool.forget_conversation``); what it raises is logged, the store's change stands."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        keep: int = 1000,
        days: float = 30.0,
        forget: Callable[[str], object] | None = None,
    ) -> None:
        self._path = Path(path) if path is not None else None
        self.keep = keep
        self.days = days
        self._forget = forget
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None

    @property
    def path(self) -> Path:
        return self._path if self._path is not None else paths.responses_db()

    # ---- plumbing --------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        """The connection (opened, set up and pruned on first use); call with the lock held."""
        if self._db is not None:
            return self._db
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the stored responses {path}: {exc}") from exc
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{path} was written by a newer Timeshare (schema {version}, this one knows "
                    f"{SCHEMA_VERSION}): upgrade Timeshare, or move the file aside"
                )
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            if version < 1:
                db.executescript("BEGIN;" + _SCHEMA + "PRAGMA user_version=1;COMMIT;")
        except sqlite3.DatabaseError as exc:
            db.close()
            raise StoreError(
                f"{path} is not a usable database of stored responses ({exc}); it was left "
                "untouched: move it aside and start Timeshare again to begin a new one"
            ) from exc
        except BaseException:
            db.close()
            raise
        self._db = db
        self._forgotten(self._prune(db, time.time()))
        return db

    def _failed(self, exc: sqlite3.Error) -> StoreError:
        hint = " — is the disk full?" if "full" in str(exc) else ""
        return StoreError(f"the stored responses {self.path} failed: {exc}{hint}; nothing was changed")

    def _write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._lock:
            db = self._connect()
            try:
                db.execute("BEGIN IMMEDIATE")
                result = fn(db)
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise self._failed(exc) from exc
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return result

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            db = self._connect()
            try:
                return list(db.execute(sql, args).fetchall())
            except sqlite3.Error as exc:
                raise self._failed(exc) from exc

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _prune(self, db: sqlite3.Connection, now: float) -> list[str]:
        """Forget what is past the bounds: older than ``days``, then the oldest beyond ``keep``.
        Returns the KV conversations no stored response is left in."""
        old = "SELECT id FROM responses WHERE created < ?"
        extra = "SELECT id FROM responses ORDER BY created DESC, rowid DESC LIMIT -1 OFFSET ?"
        n_old, orphans = self._remove(db, old, (now - self.days * DAY_S,))
        n_extra, more = self._remove(db, extra, (max(0, self.keep),))
        if n_old + n_extra:
            log.info(
                "forgot %d stored response(s) past the bounds (%d kept, %g days)",
                n_old + n_extra,
                self.keep,
                self.days,
            )
        return orphans + more

    @staticmethod
    def _remove(db: sqlite3.Connection, ids_sql: str, args: tuple[Any, ...]) -> tuple[int, list[str]]:
        """Delete the responses ``ids_sql`` selects: how many went, and the KV conversations no
        stored response is left in."""
        chains_sql = f"SELECT DISTINCT conversation FROM responses WHERE id IN ({ids_sql})"
        chains = [str(row[0]) for row in db.execute(chains_sql, args)]
        gone = int(db.execute(f"DELETE FROM responses WHERE id IN ({ids_sql})", args).rowcount)
        left = "SELECT 1 FROM responses WHERE conversation = ? LIMIT 1"
        return gone, [c for c in chains if db.execute(left, (c,)).fetchone() is None]

    def _forgotten(self, conversations: list[str]) -> None:
        """Hand each KV conversation no response is left in to ``forget`` (after the commit)."""
        if self._forget is None:
            return
        for conversation in conversations:
            try:
                self._forget(conversation)
            except Exception:  # the KV files are a cache: the next start's sweep removes them
                log.exception("forgetting the KV files of %s failed", conversation)

    @staticmethod
    def _record(row: tuple[Any, ...]) -> StoredResponse:
        rid, model, created, previous, conversation, depth, turn, items, body = row
        return StoredResponse(
            id=rid,
            model=model,
            created=float(created),
            previous=previous,
            conversation=conversation,
            depth=int(depth),
            turn=_TURN.decode(turn),
            input_items=tuple(json.loads(items)),
            body=json.loads(body),
        )

    # ---- the stored responses ----------------------------------------------------------------

    def put(self, record: StoredResponse) -> None:
        """Keep ``record`` (nothing when ``keep`` is 0), then forget what is past the bounds."""
        if self.keep <= 0:
            return
        row = (
            record.id,
            record.model,
            record.created,
            record.previous,
            record.conversation,
            record.depth,
            msgspec.json.encode(record.turn).decode(),
            json.dumps(list(record.input_items), ensure_ascii=False),
            json.dumps(record.body, ensure_ascii=False),
        )

        def insert(db: sqlite3.Connection) -> list[str]:
            db.execute(
                f"INSERT OR REPLACE INTO responses ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row
            )
            return self._prune(db, time.time())

        self._forgotten(self._write(insert))

    def get(self, response_id: str) -> StoredResponse | None:
        rows = self._read(f"SELECT {_COLUMNS} FROM responses WHERE id = ?", (response_id,))
        return self._record(rows[0]) if rows else None

    def delete(self, response_id: str) -> bool:
        """Forget one response (and, when it was the last of its chain's, the chain's KV
        conversation through ``forget``); False when it was not stored."""

        def remove(db: sqlite3.Connection) -> tuple[bool, list[str]]:
            there = db.execute("SELECT 1 FROM responses WHERE id = ?", (response_id,)).fetchone() is not None
            return there, self._remove(db, "SELECT ?", (response_id,))[1] if there else []

        there, orphans = self._write(remove)
        self._forgotten(orphans)
        return there

    def gone(self, conversation: str) -> bool:
        """``conversation`` has the shape of a chain's KV conversation and no stored response is
        in it (the pool's start sweeps its KV files: ``Pool.start(conversation_gone=...)``)."""
        if not conversation.startswith(CONVERSATION_PREFIX):
            return False
        return not self._read("SELECT 1 FROM responses WHERE conversation = ? LIMIT 1", (conversation,))

    def count(self) -> int:
        return int(self._read("SELECT count(*) FROM responses")[0][0])

    def chain(self, response_id: str, max_turns: int) -> list[StoredResponse]:
        """The chain that ends with ``response_id``, its first response first ([] when that one is
        not stored). BrokenChainError when an earlier one is gone, ChainTooLongError when it holds
        more than ``max_turns``."""
        rows = self._read(
            f"""
            WITH RECURSIVE chain(id, previous, n) AS (
                SELECT id, previous, 1 FROM responses WHERE id = ?
                UNION ALL
                SELECT r.id, r.previous, chain.n + 1 FROM responses AS r
                JOIN chain ON r.id = chain.previous WHERE chain.n <= ?
            )
            SELECT {", ".join("r." + c.strip() for c in _COLUMNS.split(","))}, chain.n
            FROM chain JOIN responses AS r ON r.id = chain.id ORDER BY chain.n DESC
            """,
            (response_id, max_turns),
        )
        if not rows:
            return []
        if len(rows) > max_turns:
            raise ChainTooLongError(response_id)
        records = [self._record(row[:-1]) for row in rows]
        if records[0].previous is not None:
            raise BrokenChainError(records[0].previous)
        return records
