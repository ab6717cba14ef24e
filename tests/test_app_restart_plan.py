"""Saving the settings says which models restart and why (app/restart_plan.py), in the Settings
dialog's words for the fields; the app says it when a save is applied."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from timeshare.app.restart_plan import restart_lines, saved_message
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig

SMOL = ModelConfig(id="smol", name="SmolLM2", path="/m/smol.gguf")
GEMMA = ModelConfig(id="gemma", name="Gemma", path="/m/gemma.gguf")


def test_which_models_restart_and_why() -> None:
    old = Config(models=(SMOL, GEMMA))
    bigger = dataclasses.replace(SMOL, n_ctx=8192)
    lines = restart_lines(old, Config(models=(bigger, GEMMA)))
    assert len(lines) == 1 and lines[0].startswith("SmolLM2 restarts: its ") and "context" in lines[0]
    assert "n_ctx" not in lines[0]  # the dialog's label, not the config key
    # pin and name apply at once
    live = Config(models=(dataclasses.replace(SMOL, pinned=True, name="Smol"), GEMMA))
    assert restart_lines(old, live) == []
    assert saved_message(old, live) == "Applied at once: no model restarts."
    # the GPU sharing settings restart every model; added and removed ones are said too
    shared = Config(models=(SMOL, GEMMA), arena=ArenaConfig(vram_budget="4GB"))
    assert restart_lines(old, shared) == [
        "SmolLM2 restarts: the GPU sharing settings changed.",
        "Gemma restarts: the GPU sharing settings changed.",
    ]
    assert restart_lines(old, Config(models=(SMOL,))) == ["Gemma stops: it was removed."]
    assert restart_lines(Config(models=(SMOL,)), old) == ["Gemma starts: it was added."]


def test_the_app_says_it_after_a_save(qtbot: Any, tmp_path: Path, smollm2_path: Path) -> None:
    from timeshare.app.application import TimeshareApp
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store
    from timeshare.core.pool.supervisor import Pool

    model = ModelConfig(id="smol", name="SmolLM2", path=str(smollm2_path), n_ctx=512)
    config = Config(models=(model,))
    arena = tmp_path / "arena"
    arena.mkdir(mode=0o700)
    pool = Pool(config, arena_dir=arena, log_dir=tmp_path / "log", kv_dir=tmp_path / "kv")
    pool.start()
    store = Store(tmp_path / "c.sqlite3")
    app = TimeshareApp(
        config,
        pool,
        store,
        ChatService(pool, store),
        config_path=tmp_path / "config.toml",
        tray_available=True,
    )
    try:
        app.apply_config(Config(models=(dataclasses.replace(model, n_ctx=1024),)))
        assert app.last_saved_message.startswith("SmolLM2 restarts: its ")
        assert "Conversations are kept" in app.last_saved_message
    finally:
        app.bridge.detach()
        app.window.detach()
        store.close()
        pool.stop()
