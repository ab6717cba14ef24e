"""Where Timeshare keeps things on disk.

Everything goes through platformdirs. ``TIMESHARE_HOME`` moves all folders under one directory
(tests, development, portable installs); ``TIMESHARE_VRAM_ARENA`` moves the arena alone.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import platformdirs

from . import envvars

APP_NAME = "timeshare"


def _home_override() -> Path | None:
    value = envvars.HOME.raw()
    return Path(value).expanduser() if value else None


def _ensure(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    return path


def config_dir() -> Path:
    home = _home_override()
    return _ensure(home / "config" if home else Path(platformdirs.user_config_dir(APP_NAME)))


def config_file() -> Path:
    return config_dir() / "config.toml"


def data_dir() -> Path:
    home = _home_override()
    return _ensure(home / "data" if home else Path(platformdirs.user_data_dir(APP_NAME)))


def cache_dir() -> Path:
    home = _home_override()
    return _ensure(home / "cache" if home else Path(platformdirs.user_cache_dir(APP_NAME)))


def log_dir() -> Path:
    home = _home_override()
    return _ensure(home / "log" if home else Path(platformdirs.user_log_dir(APP_NAME)))


def runtime_dir() -> Path:
    """Per-user runtime folder (sockets, the arena, the API address file).

    Without ``XDG_RUNTIME_DIR`` (CI as root, some containers) platformdirs would fall back to a
    shared /tmp path and warn; use a private ``timeshare-<uid>`` folder in the temp dir instead.
    """
    home = _home_override()
    if home:
        return _ensure(home / "run")
    if os.name == "posix" and not envvars.XDG_RUNTIME_DIR.raw():
        return _ensure(Path(tempfile.gettempdir()) / f"{APP_NAME}-{os.getuid()}")
    return _ensure(Path(platformdirs.user_runtime_dir(APP_NAME)))


def arena_dir_override() -> Path | None:
    """``$TIMESHARE_VRAM_ARENA`` (``~`` expanded), the one place it is read; None when unset. It
    wins over ``arena.dir`` in the config (``arena.dirs.resolve_arena_dir`` applies the order)."""
    override = envvars.VRAM_ARENA.raw()
    return Path(override).expanduser() if override else None


def default_arena_dir() -> Path:
    return arena_dir_override() or runtime_dir() / "arena"


def kv_dir() -> Path:
    """KV snapshots of conversations of stopped workers."""
    return _ensure(data_dir() / "kv")


def conversations_db() -> Path:
    return data_dir() / "conversations.sqlite3"


def responses_db() -> Path:
    """The Responses API's stored responses (``core/api/response_store.py``)."""
    return data_dir() / "responses.sqlite3"


def api_address_file() -> Path:
    """Where a running instance records the URL of its API, so the CLI finds it without flags."""
    return runtime_dir() / "api.json"
