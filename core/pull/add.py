"""Adding a pulled model to the config file (what ``timeshare pull`` and "Get model…" do last)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from .. import paths
from ..catalog import model_config_from_entry
from ..config.files import load_config, save_config
from ..config.schema import Config, ModelConfig
from ..errors import ConfigError
from .download import PullResult


def _same_file(a: str, b: Path) -> bool:
    try:
        return (
            Path(a).expanduser().resolve() == b.resolve() or Path(a).expanduser().absolute() == b.absolute()
        )
    except OSError:
        return False


def add_to_config(
    result: PullResult, config_path: str | os.PathLike[str] | None = None, *, model_id: str | None = None
) -> tuple[Config, ModelConfig, bool]:
    """Add the pulled model to the config file (created with the defaults, demo models included,
    when there is none). Returns (the config, the model, whether it was added): a model already
    configured with this file is left as it is. Raises ConfigError (an id in use, a bad file)."""
    target = Path(config_path).expanduser() if config_path is not None else paths.config_file()
    config = load_config(target, check_paths=False)
    same = next((m for m in config.models if _same_file(m.path, result.path)), None)
    if same is not None and (model_id is None or model_id == same.id):
        return config, same, False
    taken = {m.id for m in config.models}
    model = model_config_from_entry(result.entry, taken)
    if model_id is not None:
        if model_id in taken:
            raise ConfigError([f"--id: {model_id!r} is already used by another model: choose another id"])
        model = replace(model, id=model_id)
    model = replace(model, path=str(result.path))
    new = replace(config, models=(*config.models, model))
    save_config(new, target)
    return new, model, True
