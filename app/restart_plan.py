"""What saving the settings does to the running models, in words: which models restart and why,
which start or stop, and that the rest apply at once. Qt-free (the app shows the lines it returns
after a save; tests check them without a display). The rule is the pool's own
(``core/pool/configure.restart_fields``, and every model restarts when the GPU sharing settings
change), and the words name the fields as the Settings dialog labels them (``core/config/meta``).
"""

from __future__ import annotations

from ..core.config.meta import describe
from ..core.config.schema import Config, ModelConfig
from ..core.pool.configure import restart_fields


def _label(name: str) -> str:
    try:
        return describe(ModelConfig, name).meta.label.lower()
    except KeyError:
        return name.replace("_", " ")


def _listed(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def restart_lines(old: Config, new: Config) -> list[str]:
    """One sentence per model that saving ``new`` over ``old`` restarts, starts or stops
    ("SmolLM2 restarts: its context size changed."); [] when every change applies at once."""
    lines: list[str] = []
    arena_changed = old.arena != new.arena
    for cfg in new.models:
        before = old.model(cfg.id)
        if before is None:
            lines.append(f"{cfg.display_name} starts: it was added.")
            continue
        changed = sorted(restart_fields(before, cfg))
        if changed:
            lines.append(f"{cfg.display_name} restarts: its {_listed([_label(f) for f in changed])} changed.")
        elif arena_changed:
            lines.append(f"{cfg.display_name} restarts: the GPU sharing settings changed.")
    kept = {m.id for m in new.models}
    lines += [f"{m.display_name} stops: it was removed." for m in old.models if m.id not in kept]
    return lines


def saved_message(old: Config, new: Config) -> str:
    """What the app says after a save: the restarts, or that everything applied at once."""
    lines = restart_lines(old, new)
    if not lines:
        return "Applied at once: no model restarts."
    return " ".join(lines) + " Conversations are kept; an answer being written is cut off."
