"""The KV folder's upkeep (core/kv_folder.py) with a real pool, real SmolLM2 workers that write
their KV files when they stop, and a real SQLite conversations file: a deleted conversation's
files go, a removed model's folder goes, and a start sweeps what belongs to no configured model,
what a crash left half written and the conversations the store no longer holds; the files of
live conversations, of a client's own conversation key and of the prompt cache stay."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from timeshare.core import kv_folder
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.conversations.chat import ChatService
from timeshare.core.conversations.store import Store
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling

pytestmark = pytest.mark.slow

GUARD_S = 120.0  # a hang guard, not a timing assertion
CLIENT_KEY = "my-own-chat"  # an API client's `conversation` (not the store's)


def _pool(tmp_path: Path, models: tuple[ModelConfig, ...]) -> Pool:
    return Pool(
        Config(models=models, arena=ArenaConfig(wait_timeout_s=120.0)),
        arena_dir=tmp_path / "arena",
        log_dir=tmp_path / "log",
        kv_dir=tmp_path / "kv",
    )


def _answer(pool: Pool, conversation: str) -> None:
    gen = pool.generate(
        "smol", prompt="Once upon a time", conversation=conversation, sampling=Sampling(max_tokens=3)
    )
    "".join(gen)


def _conversation_files(folder: Path) -> dict[str, Path]:
    """The conversation files of a model's folder, by their conversation key (read from the
    header, as an independent look at what the worker wrote)."""
    found = {}
    for path in folder.glob("*.kv"):
        header = kv_folder.header_of(path)
        assert header is not None and header["model"] == "smol", path
        found[str(header["conversation"])] = path
    return found


def test_deleted_conversations_removed_models_and_orphans_leave_the_kv_folder(
    smollm2_path: Path, tmp_path: Path
) -> None:
    smol = ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, idle_sleep_s=None)
    store = Store(tmp_path / "conversations.sqlite3")
    kept, deleted, deleted_late = (store.create_conversation("smol").id for _ in range(3))
    folder = tmp_path / "kv" / "smol"

    pool = _pool(tmp_path, (smol,))
    pool.start(conversation_gone=store.gone)
    try:
        pool.wait_ready(timeout=GUARD_S)
        for key in (kept, deleted, deleted_late, CLIENT_KEY):
            _answer(pool, key)
    finally:
        pool.stop()  # the worker writes every conversation's KV file as it stops
    assert set(_conversation_files(folder)) == {kept, deleted, deleted_late, CLIENT_KEY}

    # what a start finds and removes: a model no longer configured whose folder nobody touched
    # for STALE_MODEL_FOLDER_DAYS, a file a crash left half written; a recent unconfigured
    # model's folder (another configuration may share the KV folder) and a file of an unknown
    # kind in the folder are not this start's to remove and stay
    old = time.time() - (kv_folder.STALE_MODEL_FOLDER_DAYS + 1) * 86400.0
    (tmp_path / "kv" / "gone-model").mkdir()
    (tmp_path / "kv" / "gone-model" / "gone-model-0123.kv").write_bytes(b"TSKV2\n....")
    for stale in (tmp_path / "kv" / "gone-model" / "gone-model-0123.kv", tmp_path / "kv" / "gone-model"):
        os.utime(stale, (old, old))
    (tmp_path / "kv" / "other-config").mkdir()
    (tmp_path / "kv" / "other-config" / "other-config-0123.kv").write_bytes(b"TSKV2\n....")
    half = folder / "smol-0123.tmp"
    half.write_bytes(b"TSKV2\n")
    foreign = folder / "notes.txt"
    foreign.write_text("mine")
    store.delete(deleted_late)  # deleted while its file was written: an orphan at the next start

    pool = _pool(tmp_path, (smol,))
    pool.start(conversation_gone=store.gone)
    try:
        pool.wait_ready(timeout=GUARD_S)
        assert not (tmp_path / "kv" / "gone-model").exists()
        assert (tmp_path / "kv" / "other-config" / "other-config-0123.kv").exists()
        assert not half.exists() and foreign.exists()
        assert set(_conversation_files(folder)) == {kept, deleted, CLIENT_KEY}

        ChatService(pool, store).delete(deleted)  # the app's delete: the store's row and its KV
        assert deleted not in {c.id for c in store.list_conversations()}
        assert set(_conversation_files(folder)) == {kept, CLIENT_KEY}

        pool.apply_config(Config(models=(), arena=ArenaConfig(wait_timeout_s=120.0)))
        deadline = time.monotonic() + GUARD_S
        while pool.snapshot().model("smol") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.snapshot().model("smol") is None
        assert not folder.exists()  # removed from the configuration: its KV folder went
    finally:
        pool.stop()
        store.close()


def test_a_conversation_that_was_never_the_stores_is_not_gone(tmp_path: Path) -> None:
    store = Store(tmp_path / "conversations.sqlite3")
    try:
        live = store.create_conversation("smol").id
        assert not store.gone(live)
        assert not store.gone(CLIENT_KEY) and not store.gone("responses-resp_1")
        store.delete(live)
        assert store.gone(live)
    finally:
        store.close()
