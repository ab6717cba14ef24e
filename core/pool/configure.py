"""The pool's side of a configuration: its checks, and which changes a running worker takes
without a restart."""

from __future__ import annotations

from dataclasses import asdict

from ..config.schema import Config, ModelConfig
from ..errors import ConfigError

#: ModelConfig fields whose change does not need a worker restart
LIVE_FIELDS = frozenset({"name", "pinned", "idle_sleep_s", "idle_release", "licence"})


def check_config(config: Config) -> None:
    problems = []
    seen: set[str] = set()
    for i, m in enumerate(config.models):
        if not m.id:
            problems.append(f"models[{i}].id: empty; give every model an id")
        elif m.id in seen:
            problems.append(f"models[{i}].id: {m.id!r} is used twice; model ids must be unique")
        seen.add(m.id)
        if not m.path:
            problems.append(f"models[{i}].path: empty; give the path of a .gguf file")
        if m.idle_release not in ("weights", "weights+kv", "stop"):
            problems.append(f"models[{i}].idle_release: {m.idle_release!r}; use weights, weights+kv or stop")
    if config.api.queue_limit < 1:
        problems.append(f"api.queue_limit: {config.api.queue_limit}; it must be at least 1")
    if problems:
        raise ConfigError(problems)


def restart_fields(old: ModelConfig, new: ModelConfig) -> set[str]:
    """The load-time fields that differ between two configs of a model (the worker must restart)."""
    before = asdict(old)
    return {k for k, v in asdict(new).items() if before[k] != v and k not in LIVE_FIELDS}
