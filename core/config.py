"""Configuration: models and settings, TOML in platformdirs' config dir.

The dataclasses below are the contract every layer codes against. Loading, validation with
field-path errors, atomic writes and defaults live here too.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

from . import paths
from .errors import ConfigError
from .modelfile import GGUF_MAGIC

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found]

log = logging.getLogger(__name__)

IdleRelease = Literal["weights", "weights+kv", "stop"]
HostShadow = Literal["pinned", "pageable"]
ChatFormat = Literal["auto", "template", "fallback"]


@dataclass(frozen=True)
class ModelConfig:
    id: str  # stable identifier, used by the API's `model` field: [a-z0-9._-]+
    path: str  # GGUF file
    name: str = ""  # display name; defaults to id
    n_ctx: int = 2048  # context tokens per conversation sequence
    n_gpu_layers: int = -1  # -1: all layers (ignored by a CPU build)
    n_seq: int = 4  # conversations kept live in the worker's KV cache (LRU beyond)
    chat_template: str | None = None  # Jinja override; None: the GGUF's own, or the fallback format
    chat_format: ChatFormat = "auto"  # auto: the GGUF's template if it has one, else the fallback
    pinned: bool = False  # a pinned model keeps the GPU once it has it
    idle_sleep_s: float | None = 600.0  # None: never release on idle
    idle_release: IdleRelease = "weights"
    host_shadow: HostShadow = "pinned"
    licence: str = ""  # shown in model lists (filled for the demo models)

    @property
    def display_name(self) -> str:
        return self.name or self.id


@dataclass(frozen=True)
class ArenaConfig:
    dir: str | None = None  # None: platformdirs runtime dir /arena (or $TIMESHARE_VRAM_ARENA)
    min_quantum_ms: float = 250.0  # a busy holder keeps the GPU at least this long before yielding
    wait_timeout_s: float = 300.0  # a request waiting longer for the GPU fails with a clear error
    # a restore that meets out-of-device-memory keeps the token and tries again this long (a killed
    # holder's memory comes back a little after the kernel dropped its flock) before failing
    restore_oom_retry_s: float = 10.0


@dataclass(frozen=True)
class ApiConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8385
    key: str | None = None  # bearer key; required for non-loopback binds
    queue_limit: int = 16  # per model; beyond it the API answers 429


@dataclass(frozen=True)
class GeneralConfig:
    start_at_login: bool = False
    prewake_on_typing: bool = True  # focusing/typing in a chat pre-wakes its model


@dataclass(frozen=True)
class Config:
    models: tuple[ModelConfig, ...] = ()
    arena: ArenaConfig = field(default_factory=ArenaConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    general: GeneralConfig = field(default_factory=GeneralConfig)
    # Not saved: a sentence for the UI/CLI when the pool is empty (no config and no demo models).
    notice: str = field(default="", compare=False)

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)


# ---- loading and validation ----------------------------------------------------------------

MODEL_ID_RE = re.compile(r"^[a-z0-9._-]+$")

NO_MODELS_MESSAGE = (
    "No models are configured and the demo models are not installed: add a GGUF model in "
    "Settings (or a [[models]] entry in {path}), or install the demo models with `make run`."
)

_SECTIONS = ("general", "arena", "api", "models")


def _fields_of(cls: type) -> dict[str, Any]:
    return {f.name: f for f in fields(cls)}


def _hint(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


class _Checker:
    """Collects every problem of one config (not just the first) as field-path messages."""

    def __init__(self, base_dir: Path | None, check_paths: bool) -> None:
        self.problems: list[str] = []
        self.base_dir = base_dir
        self.check_paths = check_paths

    def problem(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")

    def fields(
        self, where: str, table: Mapping[str, object], checks: Mapping[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """Run ``checks[key](field_path, value)`` for each key present in ``table``; a value is kept
        only when its check added no problem. Returns the kept values and whether all passed."""
        values: dict[str, Any] = {}
        ok = True
        for key, check in checks.items():
            if key in table:
                before = len(self.problems)
                value = check(f"{where}.{key}", table[key])
                if len(self.problems) > before:
                    ok = False
                else:
                    values[key] = value
        return values, ok

    def unknown_keys(self, where: str, table: Mapping[str, object], known: Iterable[str]) -> None:
        known = list(known)
        for key in table:
            if key not in known:
                self.problem(f"{where}{key}", "unknown key" + _hint(key, known))

    def boolean(self, where: str, value: object) -> bool | None:
        if isinstance(value, bool):
            return value
        self.problem(where, f"must be true or false, not {_type_name(value)}")
        return None

    def integer(
        self, where: str, value: object, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(where, f"must be an integer, not {_type_name(value)}")
            return None
        if minimum is not None and value < minimum:
            self.problem(where, "must be > 0" if minimum == 1 else f"must be >= {minimum}")
            return None
        if maximum is not None and value > maximum:
            self.problem(where, f"must be <= {maximum}")
            return None
        return value

    def number(self, where: str, value: object, minimum: float = 0.0, strict: bool = False) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problem(where, f"must be a number, not {_type_name(value)}")
            return None
        if value != value or value in (float("inf"), float("-inf")):
            self.problem(where, "must be a finite number")
            return None
        if (strict and value <= minimum) or value < minimum:
            self.problem(where, f"must be {'>' if strict else '>='} {minimum:g}")
            return None
        return float(value)

    def string(self, where: str, value: object, allow_empty: bool = True) -> str | None:
        if not isinstance(value, str):
            self.problem(where, f"must be a string, not {_type_name(value)}")
            return None
        if not allow_empty and not value.strip():
            self.problem(where, "must not be empty")
            return None
        return value

    def choice(self, where: str, value: object, allowed: tuple[str, ...]) -> str | None:
        if not isinstance(value, str) or value not in allowed:
            shown = f"{value!r}" if isinstance(value, str) else _type_name(value)
            self.problem(where, f"must be one of {', '.join(repr(a) for a in allowed)}, not {shown}")
            return None
        return value

    def model_path(self, where: str, value: object) -> str | None:
        text = self.string(where, value, allow_empty=False)
        if text is None:
            return None
        path = Path(text).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        if self.check_paths:
            if not path.exists():
                self.problem(where, f"{path} does not exist: fix the path or remove this model")
                return None
            if not path.is_file():
                self.problem(where, f"{path} is not a regular file (a GGUF model file is expected)")
                return None
            try:
                with path.open("rb") as f:
                    magic = f.read(4)
            except OSError as exc:
                self.problem(where, f"{path} cannot be read ({exc.strerror}): check its permissions")
                return None
            if magic != GGUF_MAGIC:
                self.problem(
                    where,
                    f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): "
                    "pick the .gguf file itself",
                )
                return None
        return str(path)


def _check_model(c: _Checker, i: int, raw: object) -> ModelConfig | None:
    where = f"models[{i}]"
    if not isinstance(raw, Mapping):
        c.problem(where, f"must be a table ([[models]]), not {_type_name(raw)}")
        return None
    known = _fields_of(ModelConfig)
    c.unknown_keys(f"{where}.", raw, known)
    values: dict[str, Any] = {}
    ok = True
    for key in ("id", "path"):
        if key not in raw:
            c.problem(f"{where}.{key}", "is required")
            ok = False
    if "id" in raw:
        model_id = c.string(f"{where}.id", raw["id"], allow_empty=False)
        if model_id is not None and not MODEL_ID_RE.match(model_id):
            c.problem(
                f"{where}.id",
                f"{model_id!r} may contain only lowercase letters, digits, '.', '_' and '-'",
            )
            model_id = None
        ok = ok and model_id is not None
        values["id"] = model_id
    if "path" in raw:
        values["path"] = c.model_path(f"{where}.path", raw["path"])
        ok = ok and values["path"] is not None
    checks: dict[str, Any] = {
        "name": lambda w, v: c.string(w, v),
        "n_ctx": lambda w, v: c.integer(w, v, minimum=1),
        "n_gpu_layers": lambda w, v: c.integer(w, v, minimum=-1),
        "n_seq": lambda w, v: c.integer(w, v, minimum=1, maximum=256),
        "chat_template": lambda w, v: c.string(w, v, allow_empty=False),
        "chat_format": lambda w, v: c.choice(w, v, get_args(ChatFormat)),
        "pinned": lambda w, v: c.boolean(w, v),
        "idle_sleep_s": _idle_sleep_checker(c),
        "idle_release": lambda w, v: c.choice(w, v, get_args(IdleRelease)),
        "host_shadow": lambda w, v: c.choice(w, v, get_args(HostShadow)),
        "licence": lambda w, v: c.string(w, v),
    }
    checked, all_ok = c.fields(where, raw, checks)
    values.update(checked)
    if not (ok and all_ok):
        return None
    return ModelConfig(**values)


def _idle_sleep_checker(c: _Checker) -> Any:
    def check(where: str, value: object) -> float | None:
        # TOML has no null: `false` (or "never") means "never release on idle".
        if value is False or value == "never":
            return None
        if value is True:
            c.problem(where, "must be a number of seconds, or false for never")
            return None
        return c.number(where, value, minimum=0.0)

    return check


def _check_section(c: _Checker, name: str, raw: object, cls: type, checks: dict[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        c.problem(name, f"must be a table ([{name}]), not {_type_name(raw)}")
        return cls()
    c.unknown_keys(f"{name}.", raw, _fields_of(cls))
    values, _ = c.fields(name, raw, checks)
    return cls(**values)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (a loopback address or a localhost name)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def validate(
    raw: Mapping[str, object],
    *,
    path: str | Path | None = None,
    check_paths: bool = True,
) -> Config:
    """Check a parsed config (a TOML document as a dict) and build a :class:`Config`.

    Raises ConfigError listing every problem as ``field.path: message``. Relative model paths are
    resolved against the config file's folder. ``check_paths=False`` skips the model-file checks
    (used for the example config and for writing a config whose drive is not mounted now).
    """
    where = str(path) if path is not None else None
    base_dir = Path(path).expanduser().resolve().parent if path is not None else None
    c = _Checker(base_dir, check_paths)
    if not isinstance(raw, Mapping):
        raise ConfigError([f"the configuration must be a table, not {_type_name(raw)}"], path=where)
    c.unknown_keys("", raw, _SECTIONS)

    general = _check_section(
        c,
        "general",
        raw.get("general", {}),
        GeneralConfig,
        {"start_at_login": c.boolean, "prewake_on_typing": c.boolean},
    )
    arena = _check_section(
        c,
        "arena",
        raw.get("arena", {}),
        ArenaConfig,
        {
            "dir": lambda w, v: c.string(w, v, allow_empty=False),
            "min_quantum_ms": lambda w, v: c.number(w, v, minimum=0.0),
            "wait_timeout_s": lambda w, v: c.number(w, v, minimum=0.0, strict=True),
            "restore_oom_retry_s": lambda w, v: c.number(w, v, minimum=0.0),
        },
    )
    if isinstance(arena.dir, str):
        arena = replace(arena, dir=str(Path(arena.dir).expanduser()))
    api = _check_section(
        c,
        "api",
        raw.get("api", {}),
        ApiConfig,
        {
            "enabled": c.boolean,
            "host": lambda w, v: c.string(w, v, allow_empty=False),
            "port": lambda w, v: c.integer(w, v, minimum=1, maximum=65535),
            "key": lambda w, v: c.string(w, v, allow_empty=False),
            "queue_limit": lambda w, v: c.integer(w, v, minimum=1),
        },
    )
    api_raw = raw.get("api", {})
    if (
        isinstance(api_raw, Mapping)
        and not any(p.startswith(("api.host", "api.key")) for p in c.problems)
        and not is_loopback(api.host)
        and not api.key
    ):
        c.problem(
            "api.key",
            f"is required when api.host is {api.host!r} (reachable from other machines): "
            "set a key, or bind to 127.0.0.1",
        )

    models: list[ModelConfig] = []
    raw_models = raw.get("models", [])
    if not isinstance(raw_models, list):
        c.problem("models", f"must be an array of tables ([[models]]), not {_type_name(raw_models)}")
        raw_models = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(raw_models):
        model = _check_model(c, i, entry)
        if isinstance(entry, Mapping) and isinstance(entry.get("id"), str):
            model_id = entry["id"]
            if model_id in seen:
                c.problem(f"models[{i}].id", f"{model_id!r} is already used by models[{seen[model_id]}]")
                model = None
            else:
                seen[model_id] = i
        if model is not None:
            models.append(model)

    if c.problems:
        raise ConfigError(c.problems, path=where)
    config = Config(models=tuple(models), arena=arena, api=api, general=general)
    if not models:
        config = replace(config, notice=_no_models_notice(path))
    return config


def _no_models_notice(path: str | Path | None) -> str:
    shown = path if path is not None else paths.config_file()
    return NO_MODELS_MESSAGE.format(path=shown)


def parse_toml(text: str, *, path: str | Path | None = None) -> dict[str, Any]:
    """Parse TOML text; a syntax error becomes a ConfigError that names the line and column."""
    try:
        parsed: dict[str, Any] = tomllib.loads(text)
        return parsed
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            [f"TOML syntax error: {exc} — fix the file (or move it aside to start from defaults)"],
            path=str(path) if path is not None else None,
        ) from exc


def default_config() -> Config:
    """The configuration used when there is no config file: the demo models when installed."""
    from . import demo  # demo imports this module: import it late

    try:
        models = demo.demo_model_configs()
    except (demo.DemoUnavailable, OSError) as exc:
        log.warning("demo models unavailable: %s", exc)
        models = ()
    if not models:
        return Config(notice=_no_models_notice(None))
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
        out[f.name] = value
    return out


def _model_dict(model: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(model):
        value = getattr(model, f.name)
        if f.name == "idle_sleep_s":
            out[f.name] = False if value is None else value
        elif value is None or (f.name in ("name", "licence") and value == ""):
            continue
        else:
            out[f.name] = value
    return out


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
        for key, value in model.items():
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
    for model in data["models"]:
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


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(target: Path, text: str, *, backup: bool = True, mode: int = 0o600) -> None:
    """Write ``text`` to ``target`` so that a crash leaves either the old or the new file, whole.

    A temp file in the same folder is written and fsynced, then renamed over the target. With
    ``backup``, the previous version is kept as ``<name>.bak`` (itself replaced atomically).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    if backup and target.is_file():
        fd, bak_tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".bak-tmp")
        os.close(fd)
        try:
            shutil.copy2(target, bak_tmp)
            os.replace(bak_tmp, target.with_name(target.name + ".bak"))
        finally:
            if os.path.exists(bak_tmp):
                os.unlink(bak_tmp)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(target.parent)


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
    log.info("config saved to %s", target)
    return target


def suggest_model_id(name: str, taken: Iterable[str] = ()) -> str:
    """A valid, unused model id derived from a display name or file name."""
    base = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "model"
    base = base[:64]
    used = set(taken)
    if base not in used:
        return base
    n = 2
    while f"{base}-{n}" in used:
        n += 1
    return f"{base}-{n}"
