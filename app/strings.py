"""The words the app shows people: tray notices, the chat window's failure and wait lines.

One table, so they can be reviewed together (and tests/test_app_strings.py greps app/ for the
words that must not be there: HTTP paths, config keys, internal terms). Display names, never ids;
"GPU" only on a machine that has one ("memory" otherwise: :func:`device_word`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..core import words
from ..core.util.units import human_bytes

if TYPE_CHECKING:
    from pathlib import Path

    from ..core.state import ModelStatus, PoolSnapshot

CONFIG_INVALID_TITLE = "Settings file not applied"
#: the dialogs when Timeshare cannot start (the details, paths and pids, under Show Details)
ALREADY_RUNNING = (
    "Timeshare is already running for you (as the tray app, or as a server started from a terminal). "
    "Use that one, or quit it and start Timeshare again."
)
SETTINGS_FILE_BROKEN = (
    "Your settings file has mistakes, so Timeshare did not start. It was not changed: "
    "fix what Show Details lists, then start Timeshare again."
)
CONVERSATIONS_UNREADABLE = "Timeshare cannot open its saved conversations, so it did not start."


def config_invalid(problem: str) -> str:
    return f"Your edit of the settings file has a problem, so Timeshare keeps its current settings: {problem}"


device_word = words.device_word


# ---- a model that cannot answer (chat window) ----------------------------------------------------

FAILED_TITLE = "{name} cannot answer"
MISSING_FILE = "Its file is missing or is not a usable model file."
LOCATE_FILE = "Locate file…"
RESTART = "Restart"
REMOVE = "Remove"
DETAILS = "Details"
UNPIN = "Unpin {holder}"
SEND_DISABLED = "{name} cannot answer until it is restarted or its file is found."
RESTARTING = "Restarting {name}…"


def pinned_wait(name: str, holder: str, has_gpu: bool) -> str:
    return f"{name} waits: {holder} is pinned to {device_word(has_gpu)} and keeps it until you unpin it."


def has_gpu(snapshot: PoolSnapshot) -> bool:
    """Whether the models run on a GPU (a backend other than the CPU has been seen)."""
    return words.has_gpu([m.backend for m in snapshot.models] + [d.name for d in snapshot.devices])


def state_of(status: ModelStatus, gpu: bool = True) -> str:
    """A model's state in the one vocabulary (core/words.py): "on the GPU", "set aside — ready in
    0.1 s", "asleep", "answering", "waiting for the GPU", "stopped", "failed"..."""
    last = status.last_switch
    return words.state_words(
        status.state.value,
        gpu=gpu,
        busy=status.busy,
        resident_fraction=status.resident_fraction,
        restore_ms=last.restore_ms if last is not None and last.switched else None,
    )


def names_for_people(text: str, snapshot: PoolSnapshot) -> str:
    """``text`` (a reason the pool wrote, naming models by id) with display names instead (ids
    of one or two characters are left: they are words too)."""
    models = sorted(snapshot.models, key=lambda m: len(m.id), reverse=True)
    for m in models:
        if m.display_name != m.id and len(m.id) >= 3:
            text = re.sub(rf"(?<![\w.-]){re.escape(m.id)}(?![\w.-])", m.display_name, text)
    return text


# ---- who has the GPU (or, without one, whose turn it is): the words of core/words.py ----------

holds = words.holds
nobody_holds = words.nobody_holds
switching = words.switching
partly_on = words.partly_on
models_together = words.models_together


def holds_now(status: ModelStatus) -> str:
    """What a model's worker holds now: "Holds 4.9 GiB on the GPU (KV 4.0 GiB,
    buffers 0.4 GiB, driver context 0.5 GiB)", "… of memory" on a CPU build; "" when nothing."""
    if status.device_bytes <= 0:
        return ""
    held = status.held()
    parts = [("weights", held["weights"]), ("KV", held["kv"]), ("buffers", held["buffers"])]
    parts.append(("driver context", held["context"]))
    detail = ", ".join(f"{k} {human_bytes(int(v), largest='GiB')}" for k, v in parts if int(v) > 0)
    where = "of memory" if status.on_host else "on the GPU"
    return f"Holds {human_bytes(status.device_bytes, largest='GiB')} {where} ({detail})"


def fitted(status: ModelStatus | None) -> str:
    """What a running model loaded with: "n_ctx 4096 × 1 sequences, KV q8_0 (parallel 1, n_ctx
    4096 (auto: …))"; "" when it is not loaded."""
    if status is None or not status.n_ctx or not status.parallel:
        return ""
    text = f"n_ctx {status.n_ctx} × {status.parallel} sequences, KV {status.kv_cache_type or 'f16'}"
    return f"{text} ({status.fit})" if status.fit else text


def for_people(text: str, snapshot: PoolSnapshot) -> str:
    """A sentence from the pool (model ids, "the GPU") in the GUI's words: display names, and
    "memory" for "the GPU" on a machine without one."""
    text = re.sub(r" \(to start it: [^)]*\)", "", names_for_people(text, snapshot))  # CLI/HTTP advice
    if has_gpu(snapshot):
        return text
    return text.replace("for the GPU", "for its turn").replace("the GPU", "memory")


#: developer details in a reason the pool wrote: they go in the Details section, not the sentence
_DETAIL_PATTERNS = (
    (re.compile(r" ?\((?:last )?exit status -?\d+\)"), ""),
    (re.compile(r"; see its log \S+, then start it again"), "; restart it"),
    # "(it starts with 'hell', not 'GGUF')", "(it starts with the bytes 50 4b 03 04, not 'GGUF'; it
    # looks like a zip archive: unpack it first)": the bytes go, what they look like stays
    (re.compile(r" ?\(it starts with (?:'[^']*'|the bytes [0-9a-f ]+), not 'GGUF'\)"), ""),
    (re.compile(r"\(it starts with (?:'[^']*'|the bytes [0-9a-f ]+), not 'GGUF'; ([^)]*)\)"), r"(\1)"),
    (re.compile(r"(?:model file )?(?<![\w.])(?:/[\w.@+-]+){2,}/?"), "the model file"),  # a path
)


def plain_reason(text: str) -> str:
    """A reason as a sentence for a dialog or a bar: no exit codes, paths or byte dumps (the
    whole text goes in the Details section): "SmolLM2 crashed 3 times within 60 s; restart it"."""
    for pattern, replacement in _DETAIL_PATTERNS:
        text = pattern.sub(replacement, text)
    return text.strip().rstrip(";").strip()


COPIED = "Copied to the clipboard"
SETTINGS_SAVED = "Settings saved"

# ---- Settings → Sharing the GPU ------------------------------------------------------------------

SHARING_TAB = "Sharing the GPU"
CPU_SHARING_TAB = "Sharing memory"  # the same page on a build without a GPU
SHARING_COLUMNS = ["Model", "Now", "Takes"]
BUDGET_LABEL = "Models may use:"
BUDGET_SLIDER_TIP = "How much of the GPU the models' weights may take together, in GB"
BUDGET_NOTE = (
    "Models that fit together stay on the GPU together and answer without a switch; when one does "
    "not fit, the one used least recently steps aside. “auto”: what the GPU has free; "
    "“one-model”: one model at a time."
)


def sharing_tab(gpu: bool) -> str:
    """The Settings page's name: "Sharing the GPU", or "Sharing memory" without a GPU."""
    return SHARING_TAB if gpu else CPU_SHARING_TAB


def budget_slider_tip(gpu: bool) -> str:
    return BUDGET_SLIDER_TIP if gpu else "How much memory the models' weights may take together, in GB"


def budget_note(gpu: bool) -> str:
    if gpu:
        return BUDGET_NOTE
    return (
        "Models that fit together stay in memory together and answer without a switch; when one "
        "does not fit, the one used least recently steps aside. “auto”: what the budget allows; "
        "“one-model”: one model at a time."
    )


ADVANCED = "Advanced"
ADVANCED_COLUMNS = ["Model", "Backend", "Switching method", "On the device", "In host memory"]
#: how a model gives up and takes back the GPU (ModelStatus.residency_path)
SWITCHING_METHODS = {"inplace": "in place (fast)", "rebuild": "rebuilt each time (slower)"}

# ---- answering again (chat window) ---------------------------------------------------------------

RETRY = "Retry"
REGENERATE = "Regenerate"
#: images in the chat window (issue 41)
ATTACH = "Image…"
ATTACH_TIP = "Attach an image to the next message (or paste or drop one into the box)"
ATTACH_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp)"
REMOVE_IMAGES = "Remove images"
NOT_AN_IMAGE = "{name} is not an image this window can read (PNG, JPEG, WebP, GIF or BMP)"


def images_attached(names: list[str]) -> str:
    """The line above the box while images wait to be sent."""
    n = len(names)
    return f"{n} image{'' if n == 1 else 's'} go with the next message: " + ", ".join(names)


def no_vision(model: str) -> str:
    """A message with images for a model that reads text only."""
    return (
        f"{model} does not read images (it has no vision projector): remove the images or pick a vision model"
    )


RETRY_TIP = "Answer the last message again (the answer was cut off, stopped or failed)"
REGENERATE_TIP = "Replace the last answer with a new one"

# ---- answer settings (chat window) ---------------------------------------------------------------

GREEDY = "0 (greedy)"
GREEDY_MEANS = (
    "Greedy (temperature 0): the model always takes its most likely next word, so the same "
    "question gets the same answer every time."
)
TEMPERATURE_TIP = "0: the most likely words, the same answer every time; higher: more varied answers"
REPETITION_GUARD_TIP = (
    "Makes words the answer already used less likely, so the model does not loop on one phrase "
    "(off: 1; a base model's conversations start at 1.3)"
)


def is_base_model(status: ModelStatus | None) -> bool:
    """A base model: no chat template in its file (it continues text rather than answering), so its
    conversations start with a shorter limit and the repetition guard."""
    return status is not None and status.chat_format == "fallback"


GET_MODEL_START = (
    "Pick a suggested model, or type what to look for (words search the hub for models with GGUF "
    "files) and press Look up; then pick a size to download."
)


def search_hits(n: int, query: str) -> str:
    """Get model…: over the hub's answers to a search."""
    return (
        f"{n} {'model' if n == 1 else 'models'} with GGUF files match “{query}” (pick one to see its sizes):"
    )


#: under a search hit until the hub told its GGUF sizes
SIZES_COMING = "sizes: asking the hub…"


def search_none(query: str) -> str:
    return f"No model with GGUF files matches “{query}” on the hub: try fewer or other words."


def pulled(name: str, added: bool, checked: str) -> str:
    """Get model…'s last line: what was downloaded and what became of it."""
    if added:
        return f"{checked}. Added {name}: it is starting now, and you can chat with it from the tray."
    return f"{checked}. It was already set up as {name}: nothing changed."


# ---- the conversation list, editing and export (chat window) -------------------------------------

SEARCH_PLACEHOLDER = "Search conversations"
RESEND = "Resend"
EDITING = "Editing your message: Resend replaces it, and the answers after it, with what the box holds."
EDIT_WHILE_ANSWERING = "Stop the answer first, then edit the message."
EDIT_EMPTY = "The edited message is empty: type the new text, or press Cancel edit."
EXPORT_TIP = "Save this conversation as a Markdown or JSON file"
NOTHING_TO_EXPORT = "There is no conversation to export: pick one in the list."


def no_match(query: str) -> str:
    """The transcript when the search finds no conversation."""
    return f"*No conversation holds “{query}”: clear the search to see them all.*"


def exported(path: Path) -> str:
    return f"Saved the conversation in {path.name}"


def export_failed(path: Path, exc: OSError) -> str:
    return f"Could not save {path.name}: {exc.strerror or exc}. Pick another folder or name."


# ---- closing the window without a tray ----------------------------------------------------------

KEEP_RUNNING_TITLE = "Keep Timeshare running?"
KEEP_RUNNING = (
    "There is no system tray on this desktop. Keep Timeshare (its models and its API) running in "
    "the background? Start Timeshare again to reopen this window."
)
