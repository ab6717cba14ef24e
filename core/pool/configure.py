"""The pool's side of a configuration: refusing what the config layer refuses, and which changes
a running worker takes without a restart."""

from __future__ import annotations

from dataclasses import asdict

from ..config.files import config_to_dict
from ..config.schema import Config, ModelConfig
from ..config.validate import validate

#: ModelConfig fields whose change does not need a worker restart
LIVE_FIELDS = frozenset({"name", "pinned", "idle_sleep_s", "idle_release", "licence"})


def check_config(config: Config) -> None:
    """Raise ConfigError for a configuration the config layer would refuse (duplicate or malformed
    ids, an empty path, an unknown idle_release, a queue_limit below 1 ...).

    A Config built in code never went through ``config.validate``; the pool checks it the same
    way, from the data the config would be saved as. Model files are not checked: a missing or
    broken file makes that model FAILED, with its reason, while the others serve."""
    validate(config_to_dict(config), check_paths=False)


def restart_fields(old: ModelConfig, new: ModelConfig) -> set[str]:
    """The load-time fields that differ between two configs of a model (the worker must restart)."""
    before = asdict(old)
    return {k for k, v in asdict(new).items() if before[k] != v and k not in LIVE_FIELDS}
