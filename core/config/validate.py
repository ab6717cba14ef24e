"""Validation of a parsed config into a :class:`~.schema.Config`, with field-path errors."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from .. import paths
from ..arena.budget import parse_budget
from ..errors import ConfigError
from ..gguf.modelfile import gguf_problem
from . import demo
from .meta import describe
from .schema import (
    ApiConfig,
    ArenaConfig,
    Config,
    GeneralConfig,
    ModelConfig,
)

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
        self._demo_paths: dict[str, str] | None = None

    def demo_of(self, path: str) -> str:
        """The demo id whose file ``path`` names ("" for any other file)."""
        if self._demo_paths is None:
            self._demo_paths = demo.known_paths()
        return self._demo_paths.get(os.path.normpath(path), "")

    def string_list(self, where: str, value: object, check: Any = None) -> tuple[str, ...] | None:
        """An array of non-empty strings; ``check(where_i, text)`` may add a problem per item."""
        if not isinstance(value, (list, tuple)):
            self.problem(where, f"must be an array of strings, not {_type_name(value)}")
            return None
        before = len(self.problems)
        items: list[str] = []
        for i, item in enumerate(value):
            text = self.string(f"{where}[{i}]", item, allow_empty=False)
            if text is not None and check is not None:
                check(f"{where}[{i}]", text)
            if text is not None:
                items.append(text.strip())
        return tuple(items) if len(self.problems) == before else None

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

    def model_path(self, where: str, value: object, model_id: str | None = None) -> str | None:
        text = self.string(where, value, allow_empty=False)
        if text is None:
            return None
        path = Path(text).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        if self.check_paths:
            # the one GGUF file check and its wording (core/gguf/modelfile.py)
            problem = gguf_problem(str(path), model_id=model_id)
            if problem:
                self.problem(where, problem)
                return None
        return str(path)

    def projector_path(self, where: str, value: object) -> str | None:
        """``models[].mmproj``: "" (none) or a file, as ``path`` is found (``~``, relative to the
        config's folder); whether it loads is the worker's to say (the model fails, not the
        config)."""
        text = self.string(where, value)
        if not text:
            return "" if text is not None else None
        path = Path(text).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
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
    if "id" not in raw:
        c.problem(f"{where}.id", "is required")
        ok = False
    if "path" not in raw and "demo" not in raw:
        c.problem(f"{where}.path", 'is required (the model\'s GGUF file; or demo = "<demo model id>")')
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
    demo_id = ""
    if "demo" in raw:
        demo_id = c.choice(f"{where}.demo", raw["demo"], demo.DEMO_IDS) or ""
        ok = ok and bool(demo_id)
    named = values.get("id")
    if demo_id and "path" in raw and isinstance(raw["path"], str) and raw["path"]:
        # both: the file given wins (e.g. the user located another copy), unless it is the demo's own
        given = Path(raw["path"]).expanduser()
        if not given.is_absolute() and c.base_dir is not None:
            given = c.base_dir / given
        if c.demo_of(str(given)) != demo_id:
            demo_id = ""
    if demo_id:
        # the file is found (Gemma assembled) when the model starts: no path check here
        try:
            values["path"] = str(demo.expected_path(demo_id))
        except demo.DemoUnavailableError:
            values["path"] = ""  # the pool reports it as FAILED, with what to install
        values["demo"] = demo_id
    elif "path" in raw:
        values["path"] = c.model_path(f"{where}.path", raw["path"], named)
        ok = ok and values["path"] is not None
        if values["path"]:
            # a demo model's file named by its path (configs written before `demo` existed): the
            # reference survives a cleared cache or a reinstalled package
            values["demo"] = c.demo_of(values["path"])
    checks: dict[str, Any] = {
        "name": lambda w, v: c.string(w, v),
        "n_ctx": lambda w, v: _n_ctx(c, w, v),
        "n_gpu_layers": lambda w, v: _gpu_layers(c, w, v),
        "kv_cache_type": _kv_cache_type(c, ModelConfig),
        "n_seq": _integer(c, ModelConfig, "n_seq"),
        "parallel": _integer(c, ModelConfig, "parallel"),
        "cache_prompt": lambda w, v: c.boolean(w, v),
        "chat_template": lambda w, v: c.string(w, v, allow_empty=False),
        "chat_format": _choice(c, ModelConfig, "chat_format"),
        "pinned": lambda w, v: c.boolean(w, v),
        "idle_sleep_s": _idle_sleep_checker(c),
        "idle_release": _choice(c, ModelConfig, "idle_release"),
        "device": _integer(c, ModelConfig, "device"),
        "host_shadow": _choice(c, ModelConfig, "host_shadow"),
        "weight_parts": _integer(c, ModelConfig, "weight_parts"),
        "flash_attn": lambda w, v: c.boolean(w, v),
        "embedding": lambda w, v: c.boolean(w, v),
        "max_tokens": _integer(c, ModelConfig, "max_tokens"),
        "licence": lambda w, v: c.string(w, v),
        "mmproj": lambda w, v: c.projector_path(w, v),
    }
    checked, all_ok = c.fields(where, raw, checks)
    values.update(checked)
    if not (ok and all_ok):
        return None
    return ModelConfig(**values)


#: the longest idle timer (10 years): longer ones are refused here, and the API's keep_alive maps
#: them to "never" (false); every reader of the config (timers, /api/ps's expires_at) takes this
MAX_IDLE_SLEEP_S = 10 * 365 * 86400.0


def _n_ctx(c: _Checker, where: str, value: object) -> int | None:
    """``models[].n_ctx``: tokens per sequence, or 0 for auto (fitted to the device)."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        c.problem(where, f"must be 0 (auto: fitted to the device) or a number of tokens, not {value}")
        return None
    return c.integer(where, value, minimum=0)


def _gpu_layers(c: _Checker, where: str, value: object) -> int | None:
    """``models[].n_gpu_layers``: -1 (all, or as many as fit), 0 (CPU only) or a number of layers."""
    if isinstance(value, int) and not isinstance(value, bool) and value < -1:
        c.problem(
            where,
            f"must be -1 (all layers, or as many as fit), 0 (CPU only) or a number of layers, not {value}",
        )
        return None
    return c.integer(where, value, minimum=-1)


def _kv_cache_type(c: _Checker, cls: type) -> Callable[[str, object], str | None]:
    """``kv_cache_type``: one of its choices; a model's may also be "" (arena.kv_cache_type: what a
    saved config holds for a model that sets none)."""
    choices = describe(cls, "kv_cache_type").meta.choices
    named = tuple(t for t in choices if t)  # the error names the types, not ""
    return lambda w, v: "" if (v == "" and "" in choices) else c.choice(w, v, named)


def _idle_sleep_checker(c: _Checker) -> Any:
    number = _number(c, ModelConfig, "idle_sleep_s")

    def check(where: str, value: object) -> float | None:
        # TOML has no null: `false` (or "never") means "never release on idle".
        if value is False or value == "never":
            return None
        if value is True:
            c.problem(where, "must be a number of seconds, or false for never")
            return None
        seconds = number(where, value)
        if seconds is not None and seconds > MAX_IDLE_SLEEP_S:
            c.problem(where, f"must be at most {MAX_IDLE_SLEEP_S:.0f} s (10 years); false means never")
            return None
        return seconds

    return check


def _bound(value: float | None) -> int | None:
    return None if value is None else int(value)


def _integer(c: _Checker, cls: type, name: str) -> Callable[[str, object], int | None]:
    """The check of an integer field, its range from the field's metadata (``meta``)."""
    meta = describe(cls, name).meta
    return lambda w, v: c.integer(w, v, minimum=_bound(meta.minimum), maximum=_bound(meta.maximum))


def _number(c: _Checker, cls: type, name: str) -> Callable[[str, object], float | None]:
    """The check of a number field, its lower bound from the field's metadata."""
    meta = describe(cls, name).meta
    low = 0.0 if meta.minimum is None else float(meta.minimum)
    return lambda w, v: c.number(w, v, minimum=low, strict=meta.strict_minimum)


def _choice(c: _Checker, cls: type, name: str) -> Callable[[str, object], str | None]:
    """The check of a field that takes one of its metadata's choices."""
    allowed = describe(cls, name).meta.choices
    return lambda w, v: c.choice(w, v, allowed)


def _check_section(c: _Checker, name: str, raw: object, cls: type, checks: dict[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        c.problem(name, f"must be a table ([{name}]), not {_type_name(raw)}")
        return cls()
    c.unknown_keys(f"{name}.", raw, _fields_of(cls))
    values, _ = c.fields(name, raw, checks)
    return cls(**values)


_HOST_NAME_RE = re.compile(r"^(\*|[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?|\[[0-9a-f:.]+\])$")
_ORIGIN_RE = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s]+$")


def split_listen(text: str) -> tuple[str, int]:
    """A listen address "host:port" ("[::1]:11434" for IPv6) as (host, port); ValueError."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f'{text!r} is not host:port (such as "127.0.0.1:11434")')
    return host.strip("[]"), int(port)


def _listen_address(c: _Checker, where: str, value: object) -> str | None:
    text = c.string(where, value)
    if not text:
        return text
    try:
        split_listen(text)
    except ValueError as exc:
        c.problem(where, f"{exc}; leave it empty to turn the listener off")
        return None
    return text.strip()


def _host_checker(c: _Checker) -> Any:
    def check(where: str, text: str) -> None:
        name = text.strip().lower()
        if not _HOST_NAME_RE.match(name) and not _is_ip(name):
            c.problem(
                where,
                f"{text!r} is not a host name: give the name clients use in their URLs "
                "(e.g. 'timeshare.lan', without a scheme or port), or '*' for any",
            )

    return check


def _origin_checker(c: _Checker) -> Any:
    def check(where: str, text: str) -> None:
        value = text.strip().lower()
        if value != "*" and not _ORIGIN_RE.match(value):
            c.problem(
                where,
                f"{text!r} is not a web origin: give scheme://host[:port] with no path "
                "(e.g. 'http://localhost:3000'), or '*' for any",
            )

    return check


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        return False


def needs_key(host: str, key: str | None) -> bool:
    """The loopback/key rule: a server reachable from other machines (a host that is not loopback)
    must have an API key. Config validation and ``timeshare serve``'s bind check both apply it."""
    return not is_loopback(host) and not key


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
            "min_quantum_ms": _number(c, ArenaConfig, "min_quantum_ms"),
            "wait_timeout_s": _number(c, ArenaConfig, "wait_timeout_s"),
            "restore_oom_retry_s": _number(c, ArenaConfig, "restore_oom_retry_s"),
            "hung_holder_s": _number(c, ArenaConfig, "hung_holder_s"),
            "handover": c.boolean,
            "handover_idle_s": _number(c, ArenaConfig, "handover_idle_s"),
            "vram_budget": lambda w, v: _budget(c, w, v),
            "kv_cache_type": _kv_cache_type(c, ArenaConfig),
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
            "port": _integer(c, ApiConfig, "port"),
            "key": lambda w, v: c.string(w, v, allow_empty=False),
            "queue_limit": _integer(c, ApiConfig, "queue_limit"),
            "responses_kept": _integer(c, ApiConfig, "responses_kept"),
            "responses_days": _integer(c, ApiConfig, "responses_days"),
            "allowed_hosts": lambda w, v: c.string_list(w, v, _host_checker(c)),
            "allowed_origins": lambda w, v: c.string_list(w, v, _origin_checker(c)),
            "ollama_listen": lambda w, v: _listen_address(c, w, v),
            "fetch_image_urls": lambda w, v: c.boolean(w, v),
        },
    )
    api_raw = raw.get("api", {})
    if api.ollama_listen and not api.key and not is_loopback(split_listen(api.ollama_listen)[0]):
        c.problem(
            "api.ollama_listen",
            f"{api.ollama_listen!r} is reachable from other machines: set api.key, or listen on 127.0.0.1",
        )
    if (
        isinstance(api_raw, Mapping)
        and not any(p.startswith(("api.host", "api.key")) for p in c.problems)
        and needs_key(api.host, api.key)
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
        config = replace(config, notice=no_models_notice(path))
    return config


def _budget(c: _Checker, where: str, value: object) -> str | None:
    """``arena.vram_budget``: "auto", "one-model", a size or a share; kept as written."""
    try:
        parse_budget(value)
    except ValueError as exc:
        c.problem(where, str(exc))
        return None
    return str(value).strip()


def no_models_notice(path: str | Path | None) -> str:
    shown = path if path is not None else paths.config_file()
    return NO_MODELS_MESSAGE.format(path=shown)
