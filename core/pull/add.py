"""Adding a pulled model to the config file (what ``timeshare pull`` and "Get model…" do last)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from .. import paths
from ..config.files import update_config
from ..config.schema import Config, ModelConfig
from ..config.validate import MODEL_ID_RE
from ..errors import ConfigError
from ..gguf.catalog import model_config_from_entry
from ..modelnames import pulled_names, repo_label
from .download import PullResult
from .sources import HubSource, quant_label


def _same_file(a: str, b: Path) -> bool:
    try:
        return (
            Path(a).expanduser().resolve() == b.resolve() or Path(a).expanduser().absolute() == b.absolute()
        )
    except OSError:
        return False


def pulled_label(result: PullResult) -> str:
    """What the user pulled, as a display name: a repo's name and the quantisation chosen
    ("SmolLM2-135M-Instruct Q8_0"), or the file's stem for a file named in a repo or a URL."""
    source = result.listing.source
    stem = Path(result.choice.filename.rsplit("/", 1)[-1]).name
    stem = re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", stem, flags=re.IGNORECASE) or stem
    if isinstance(source, HubSource) and source.filename is None:
        quant = quant_label(result.choice.filename)
        return f"{repo_label(source.repo_id)} {quant}" if quant else repo_label(source.repo_id)
    return stem


def add_to_config(
    result: PullResult,
    config_path: str | os.PathLike[str] | None = None,
    *,
    model_id: str | None = None,
    name: str | None = None,
    then: Callable[[Config], None] | None = None,
    mmproj: Path | None = None,
) -> tuple[Config, ModelConfig, bool]:
    """Add the pulled model to the config file (created with the defaults, demo models included,
    when there is none), through the one writer (``files.update_config``: the file as it is now,
    under its lock, so that concurrent pulls each land). Returns (the config, the model, whether
    it was added): a model already configured with this file is left as it is. Its id and display
    name come from what was pulled (:func:`pulled_label`), or ``model_id``/``name``; unique in
    the config. ``then(config)`` runs before the lock is let go (a pool's ``apply_config``).
    ``mmproj``: the vision projector pulled beside it (a model already configured without one
    gets it).
    Raises ConfigError (an id or name in use, a bad file)."""
    target = Path(config_path).expanduser() if config_path is not None else paths.config_file()
    found: list[tuple[ModelConfig, bool]] = []

    def change(config: Config) -> Config:
        found.clear()
        same = next((m for m in config.models if _same_file(m.path, result.path)), None)
        if same is not None and (model_id is None or model_id == same.id):
            if mmproj is not None and not same.mmproj:
                with_proj = replace(same, mmproj=str(mmproj))
                found.append((with_proj, True))
                return replace(config, models=tuple(with_proj if m is same else m for m in config.models))
            found.append((same, False))
            return config
        taken = {m.id for m in config.models}
        if model_id is not None and not MODEL_ID_RE.match(model_id):
            raise ConfigError(
                [f"--id: {model_id!r} may contain only lowercase letters, digits, '.', '_' and '-'"]
            )
        if model_id is not None and model_id in taken:
            raise ConfigError([f"--id: {model_id!r} is already used by another model: choose another id"])
        if name is not None and any(
            name.casefold() in (m.id.casefold(), m.display_name.casefold()) for m in config.models
        ):
            raise ConfigError(
                [f"--name: {name!r} is already the name or id of another model: choose another name"]
            )
        chosen_id, display = pulled_names(pulled_label(result), config.models, model_id=model_id, name=name)
        model = model_config_from_entry(result.entry, taken)
        model = replace(model, id=chosen_id, name=display, path=str(result.path))
        if mmproj is not None:
            model = replace(model, mmproj=str(mmproj))
        found.append((model, True))
        return replace(config, models=(*config.models, model))

    new = update_config(change, target, then=then)
    model, added = found[0]
    return new, new.model(model.id) or model, added
