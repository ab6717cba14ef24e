"""The words the app shows people: tray notices, the chat window's failure and wait lines.

One table, so they can be reviewed together (and tests/test_app_strings.py greps app/ for the
words that must not be there: HTTP paths, config keys, internal terms). Display names, never ids;
"GPU" only on a machine that has one ("memory" otherwise: :func:`device_word`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..core.state import resident_percent

if TYPE_CHECKING:
    from ..core.state import PoolSnapshot

CONFIG_INVALID_TITLE = "Settings file not applied"


def config_invalid(problem: str) -> str:
    return f"Your edit of the settings file has a problem, so Timeshare keeps its current settings: {problem}"


def device_word(has_gpu: bool) -> str:
    """What holds a model's weights, in words: "the GPU", or "memory" on a machine without one."""
    return "the GPU" if has_gpu else "memory"


# ---- a model that cannot answer (chat window) ----------------------------------------------------

FAILED_TITLE = "{name} cannot answer"
MISSING_FILE = "Its file is missing or is not a usable model file."
LOCATE_FILE = "Locate file…"
RESTART = "Restart"
REMOVE = "Remove"
UNPIN = "Unpin {holder}"
SEND_DISABLED = "{name} cannot answer until it is restarted or its file is found."
RESTARTING = "Restarting {name}…"


def pinned_wait(name: str, holder: str, has_gpu: bool) -> str:
    return f"{name} waits: {holder} is pinned to {device_word(has_gpu)} and keeps it until you unpin it."


def has_gpu(snapshot: PoolSnapshot) -> bool:
    """Whether the models run on a GPU (a backend other than the CPU has been seen)."""
    backends = [m.backend for m in snapshot.models if m.backend] + [
        d.name for d in snapshot.devices if d.name
    ]
    return any(not b.upper().startswith("CPU") for b in backends) if backends else True


def names_for_people(text: str, snapshot: PoolSnapshot) -> str:
    """``text`` (a reason the pool wrote, naming models by id) with display names instead (ids
    of one or two characters are left: they are words too)."""
    models = sorted(snapshot.models, key=lambda m: len(m.id), reverse=True)
    for m in models:
        if m.display_name != m.id and len(m.id) >= 3:
            text = re.sub(rf"(?<![\w.-]){re.escape(m.id)}(?![\w.-])", m.display_name, text)
    return text


# ---- who has the GPU (or, without one, whose weights are loaded) ---------------------------------


def holds(gpu: bool) -> str:
    """What the holder does: "holds the GPU", or "is loaded" where the models run in memory."""
    return "holds the GPU" if gpu else "is loaded"


def nobody_holds(gpu: bool) -> str:
    return "No model holds the GPU" if gpu else "No model is loaded"


def switching(gpu: bool) -> str:
    return "Switching the GPU" if gpu else "Switching models"


def partly_on(fraction: float, gpu: bool) -> str:
    """A model that made room for another by freeing only some of its layers: "partly on the GPU
    (62 %)", "partly in memory (62 %)" on a machine without a GPU."""
    return f"partly {'on the GPU' if gpu else 'in memory'} ({resident_percent(fraction)} %)"


def models_together(n: int, gpu: bool) -> str:
    return f"{n} models on the GPU" if gpu else f"{n} models in memory"


def for_people(text: str, snapshot: PoolSnapshot) -> str:
    """A sentence from the pool (model ids, "the GPU") in the GUI's words: display names, and
    "memory" for "the GPU" on a machine without one."""
    text = re.sub(r" \(to start it: [^)]*\)", "", names_for_people(text, snapshot))  # CLI/HTTP advice
    return text if has_gpu(snapshot) else text.replace("the GPU", "memory")


def pulled(name: str, added: bool, checked: str) -> str:
    """Get model…'s last line: what was downloaded and what became of it."""
    if added:
        return f"{checked}. Added {name}: it is starting now, and you can chat with it from the tray."
    return f"{checked}. It was already set up as {name}: nothing changed."
