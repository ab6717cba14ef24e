"""The words the app shows people: tray notices, the chat window's failure and wait lines.

One table, so they can be reviewed together (and tests/test_app_strings.py greps app/ for the
words that must not be there: HTTP paths, config keys, internal terms). Display names, never ids;
"GPU" only on a machine that has one ("memory" otherwise: :func:`device_word`).
"""

from __future__ import annotations

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
