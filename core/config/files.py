"""The config file: TOML parsing, defaults, loading (also from a command line's ``--config``), and
atomic writes that keep the user's comments."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import ConfigError
from ..util.atomic import atomic_write_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found]

from . import demo
from .schema import Config, ModelConfig
from .validate import no_models_notice, validate

log = logging.getLogger(__name__)


#: arrays and tables nested deeper than this are refused (the config's own keys nest 3 levels)
MAX_CONFIG_DEPTH = 16


def _too_deep(where: str) -> str:
    return (
        f"{where}nests arrays or tables more than {MAX_CONFIG_DEPTH} levels deep; no setting needs "
        "that: fix the file (or move it aside to start from defaults)"
    )


def parse_toml(text: str, *, path: str | Path | None = None) -> dict[str, Any]:
    """Parse TOML text; a syntax error becomes a ConfigError that names the line and column, and
    nesting deeper than MAX_CONFIG_DEPTH one that names the key (tomllib recurses: thousands of
    levels would be a RecursionError)."""
    shown = str(path) if path is not None else None
    try:
        parsed: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            [f"TOML syntax error: {exc} — fix the file (or move it aside to start from defaults)"],
            path=shown,
        ) from exc
    except RecursionError:
        raise ConfigError([_too_deep("")], path=shown) from None
    except ValueError as exc:  # int()'s limit: an integer of more than 4,300 digits
        raise ConfigError(
            [f"holds a number that cannot be read ({exc}); no setting needs one that long: fix the file"],
            path=shown,
        ) from None
    where = _deepest_over_limit(parsed)
    if where is not None:
        short = where if len(where) <= 60 else where[:60] + "..."
        raise ConfigError([_too_deep(f"{short}: " if short else "")], path=shown)
    return parsed


def _deepest_over_limit(value: object) -> str | None:
    """The key path of the first value nested deeper than MAX_CONFIG_DEPTH, or None. Iterative."""
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            return where
        if isinstance(item, dict):
            stack.extend(
                (sub, f"{where}.{key}" if where else str(key), depth + 1) for key, sub in item.items()
            )
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(item))
    return None


def default_config() -> Config:
    """The configuration used when there is no config file: the demo models when installed."""
    try:
        models = demo.demo_model_configs()
    except (demo.DemoUnavailableError, OSError) as exc:
        log.warning("demo models unavailable: %s", exc)
        models = ()
    if not models:
        return Config(notice=no_models_notice(None))
    return Config(models=models)


def load_config(
    path: str | Path | None = None, *, check_paths: bool = True, must_exist: bool = False
) -> Config:
    """Load and validate the config file (default: ``paths.config_file()``).

    A missing file gives :func:`default_config`, unless ``must_exist`` (a path the user named on
    the command line: a typo must not silently serve the defaults). Anything wrong raises
    ConfigError with every problem and the file's path; the file itself is never modified.
    """
    target = Path(path).expanduser() if path is not None else paths.config_file()
    try:
        data = target.read_bytes()
    except FileNotFoundError as exc:
        if must_exist:
            raise ConfigError(
                ["does not exist: check the path given with --config (leave it out to use the default file)"],
                path=str(target),
            ) from exc
        log.info("no config file at %s: using defaults", target)
        return default_config()
    except IsADirectoryError as exc:
        raise ConfigError(["is a directory, not a TOML file"], path=str(target)) from exc
    except OSError as exc:
        raise ConfigError(
            [f"cannot be read ({exc.strerror}): check its permissions"], path=str(target)
        ) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"is not UTF-8 text (bad byte at offset {exc.start}): save it as UTF-8"], path=str(target)
        ) from exc
    raw = parse_toml(text, path=target)
    return validate(raw, path=target, check_paths=check_paths)


def cli_config_path(config_arg: str | Path | None) -> Path:
    """The config file a ``--config`` argument names (``~`` expanded), or the default file without one."""
    return Path(config_arg).expanduser() if config_arg else paths.config_file()


def load_for_cli(config_arg: str | Path | None, *, check_paths: bool = True) -> Config:
    """Load the config for a command line whose ``--config`` gave ``config_arg`` (None: not given).

    A file named there must exist (a typo must not silently serve the defaults); without one, the
    default file is read, or :func:`default_config` used when there is none. Raises ConfigError.
    """
    return load_config(cli_config_path(config_arg), check_paths=check_paths, must_exist=bool(config_arg))


# ---- writing -------------------------------------------------------------------------------

_HEADER = """\
Timeshare configuration. Written by Timeshare's settings; comments you add are kept where
practical. Every key is documented in resources/config.example.toml.
"""


def _section_dict(obj: Any, skip_none: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None and skip_none:
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _model_dict(model: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(model):
        value = getattr(model, f.name)
        if f.name == "idle_sleep_s":
            out[f.name] = False if value is None else value
        elif value is None or (f.name in ("name", "licence", "demo", "mmproj") and value == ""):
            continue
        else:
            out[f.name] = value
    return out


def _file_model(model: Mapping[str, Any]) -> dict[str, Any]:
    """A model as the file holds it: a demo model by its reference, never by its file's path (a
    cache path that clearing the cache would break, or a package path a reinstall moves)."""
    if model.get("demo"):
        return {k: v for k, v in model.items() if k != "path"}
    return dict(model)


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain TOML-ready data (None values left out; ``idle_sleep_s = false`` = never)."""
    return {
        "general": _section_dict(config.general),
        "arena": _section_dict(config.arena),
        "api": _section_dict(config.api),
        "models": [_model_dict(m) for m in config.models],
    }


def config_to_toml(config: Config) -> str:
    """A fresh TOML document for ``config`` (no user comments to keep)."""
    import tomlkit

    doc = tomlkit.document()
    for line in _HEADER.splitlines():
        doc.add(tomlkit.comment(line))
    doc.add(tomlkit.nl())
    data = config_to_dict(config)
    for section in ("general", "arena", "api"):
        table = tomlkit.table()
        for key, value in data[section].items():
            table.add(key, value)
        doc.add(section, table)
    aot = tomlkit.aot()
    for model in data["models"]:
        table = tomlkit.table()
        for key, value in _file_model(model).items():
            table.add(key, value)
        aot.append(table)
    if data["models"]:
        doc.add("models", aot)
    return tomlkit.dumps(doc)


def _update_table(table: Any, wanted: Mapping[str, Any]) -> None:
    """Make a tomlkit table hold exactly ``wanted``, touching only keys that change (keeps comments)."""
    for key in [k for k in table if k not in wanted]:
        del table[key]
    for key, value in wanted.items():
        if key in table and _plain(table[key]) == value and type(_plain(table[key])) is type(value):
            continue
        table[key] = value


def _plain(item: Any) -> Any:
    unwrap = getattr(item, "unwrap", None)
    return unwrap() if callable(unwrap) else item


def _keep_spelling(table: Any, key: str, wanted: dict[str, Any], base_dir: Path) -> None:
    """Keep the user's spelling of a path ("~/models/x.gguf", "models/x.gguf") when it still
    names the same file as the new absolute value."""
    old = _plain(table.get(key)) if key in table else None
    new = wanted.get(key)
    if isinstance(old, str) and isinstance(new, str) and old != new:
        resolved = Path(old).expanduser()
        if not resolved.is_absolute():
            resolved = base_dir / resolved
        if str(resolved) == new:
            wanted[key] = old


def _merge_into_existing(text: str, config: Config, base_dir: Path) -> str | None:
    """Update an existing document in place so comments and layout survive; None if it can't be."""
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    try:
        doc = tomlkit.parse(text)
    except TOMLKitError:
        return None
    data = config_to_dict(config)
    for section in ("general", "arena", "api"):
        if section in doc:
            if not isinstance(doc[section], Mapping):
                return None
            if section == "arena":
                _keep_spelling(doc[section], "dir", data[section], base_dir)
            _update_table(doc[section], data[section])
        else:
            fresh = tomlkit.table()
            for key, value in data[section].items():
                fresh.add(key, value)
            doc[section] = fresh
    old = doc.get("models")
    old_tables: dict[str, Any] = {}
    if old is not None:
        if not isinstance(old, list):
            return None
        for old_table in old:
            if isinstance(old_table, Mapping) and isinstance(old_table.get("id"), str):
                old_tables.setdefault(str(old_table["id"]), old_table)
    new_aot = tomlkit.aot()
    for model in map(_file_model, data["models"]):
        table: Any = old_tables.get(model["id"])
        if table is None:
            table = tomlkit.table()
        else:
            _keep_spelling(table, "path", model, base_dir)
        _update_table(table, model)
        new_aot.append(table)
    if "models" in doc:
        del doc["models"]
    if data["models"]:
        doc["models"] = new_aot
    return tomlkit.dumps(doc)


def save_config(config: Config, path: str | Path | None = None, *, check_paths: bool = False) -> Path:
    """Validate ``config`` and write it atomically (default: ``paths.config_file()``).

    Comments and layout of an existing, parseable file are kept (only changed keys are rewritten;
    models are matched by id); the previous file is kept as ``config.toml.bak``. An invalid config
    raises ConfigError and writes nothing. Returns the path written.
    """
    target = Path(path).expanduser() if path is not None else paths.config_file()
    validate(config_to_dict(config), path=target, check_paths=check_paths)
    text: str | None = None
    try:
        existing = target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        existing = None
    if existing is not None:
        text = _merge_into_existing(existing, config, target.expanduser().resolve().parent)
    if text is None:
        text = config_to_toml(config)
    atomic_write_text(target, text)
    _note_written(target, text)
    log.info("config saved to %s", target)
    return target


# ---- the one writer ----------------------------------------------------------------------

# a lock per config file for this process's threads (each holder also opens its own descriptor
# and flocks it, which alone would exclude them too: the thread lock keeps their wait in-process)
_FILE_LOCKS: dict[str, threading.Lock] = {}
_FILE_LOCKS_LOCK = threading.Lock()


def lock_path(path: Path) -> Path:
    """The lock file beside a config file (``config.toml.lock``): what ``config_lock`` flocks."""
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def config_lock(path: str | Path | None = None) -> Iterator[Path]:
    """Hold the config file's writer lock (default file: ``paths.config_file()``): one thread of
    this process at a time, and one process at a time (an exclusive ``flock`` on
    :func:`lock_path`, which the CLI, the tray and the API all take). Yields the file's path."""
    target = Path(path).expanduser() if path is not None else paths.config_file()
    key = str(target.absolute())
    with _FILE_LOCKS_LOCK:
        lock = _FILE_LOCKS.setdefault(key, threading.Lock())
    with lock:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path(target), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield target
        finally:
            os.close(fd)  # closing the descriptor drops the flock


def update_config(
    change: Callable[[Config], Config],
    path: str | Path | None = None,
    *,
    then: Callable[[Config], None] | None = None,
) -> Config:
    """The one read-modify-write of the config file: under :func:`config_lock`, load the file as
    it is now (``check_paths=False``; the defaults when there is none), ``change`` it, save it
    when it changed, and call ``then`` with the file's config as saved (a pool's
    ``apply_config``) before the lock is let go, so that changes from threads and processes land
    one after another, each on top of the last, and are applied in that order. ``change`` may
    raise (ConfigError...): nothing is written. Returns the config as saved."""
    with config_lock(path) as target:
        current = load_config(target, check_paths=False)
        new = change(current)
        if new != current:
            save_config(new, target)
            new = load_config(target, check_paths=False)
        if then is not None:
            then(new)
        return new


# the texts this process saved, by file: the config watcher does not apply them again
_WRITTEN: dict[str, list[str]] = {}
_WRITTEN_LOCK = threading.Lock()


def _note_written(target: Path, text: str) -> None:
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    with _WRITTEN_LOCK:
        seen = _WRITTEN.setdefault(str(target.expanduser().absolute()), [])
        seen.append(digest)
        del seen[:-8]


def written_by_us(path: Path, digest: str) -> bool:
    """Whether this process saved ``path`` (``save_config``) with the text whose sha256 is ``digest``."""
    with _WRITTEN_LOCK:
        return digest in _WRITTEN.get(str(path.expanduser().absolute()), ())
