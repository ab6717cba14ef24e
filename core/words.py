"""The words people read for a model's state: one table for the tray, the chat window, Settings,
the CLI and the docs (README's "Model states" table is checked against it by tests/test_words.py).

Qt-free and free of the pool's types, so the CLI (which sees the status as JSON) and the app (which
sees ``ModelStatus``) say the same thing. "GPU" only where there is one: on a CPU-only build a model
whose weights are loaded is "in memory" and a request waits "for its turn".
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: A model's state (``ModelState.value``, the API's ``state``) → what people read, with a GPU.
STATE_WORDS: dict[str, str] = {
    "starting": "starting",
    "loading": "loading",
    "resident": "on the GPU",
    "released": "set aside",
    "sleeping": "asleep",
    "stopped": "stopped",
    "failed": "failed",
}
#: the same where the models run on the CPU (only the GPU's own word differs)
CPU_STATE_WORDS: dict[str, str] = {**STATE_WORDS, "resident": "in memory"}
#: what each state means, in a sentence (README's table and the tooltips)
STATE_MEANINGS: dict[str, str] = {
    "starting": "its process is starting",
    "loading": "reading its model file",
    "resident": "its weights are on the GPU: it answers at once",
    "released": "its weights were moved aside to make room for another model; it is back in a moment",
    "sleeping": "weights and conversation memory moved to host memory; it wakes on the next message",
    "stopped": "its process ended; it starts again on the next message",
    "failed": "it could not start or kept crashing; see why in the tray",
}
#: a model answering now, and one whose request waits for the device
ANSWERING = "answering"
WAITING_GPU = "waiting for the GPU"
WAITING_TURN = "waiting for its turn"
WAKING = "waking up"
#: a model with a vision projector (models[].mmproj): it takes images with the text
READS_IMAGES = "reads images"


def has_gpu(backends: Iterable[str]) -> bool:
    """Whether the models run on a GPU, from the backends seen ("CUDA0", "Vulkan0", "CPU"); True
    while none is known yet (nothing has loaded)."""
    seen = [b for b in backends if b]
    return any(not b.upper().startswith("CPU") for b in seen) if seen else True


def device_word(gpu: bool) -> str:
    """What holds a model's weights: "the GPU", or "memory" on a machine without one."""
    return "the GPU" if gpu else "memory"


#: a choice of words in a text written once for both builds: "{the GPU|its turn}" (core/config
#: schema's labels and help, read by the Settings dialogs through :func:`for_device`)
DEVICE_CHOICE = re.compile(r"\{([^{}|]*)\|([^{}|]*)\}")


def for_device(text: str, gpu: bool) -> str:
    """``text`` with each "{GPU words|CPU words}" choice made: "A request waits for {the GPU|its
    turn} at most" reads "… for the GPU …" where there is one, "… for its turn …" where not."""
    return DEVICE_CHOICE.sub(lambda m: m.group(1) if gpu else m.group(2), text)


def seconds_text(ms: float) -> str:
    """A short duration as people read it: "0.1 s" (never "0.0 s"), "2.4 s", "15 s"."""
    s = max(ms / 1000.0, 0.1)
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def ready_in(restore_ms: float | None) -> str:
    """ " — ready in 0.1 s" after "set aside", from the model's last restore; "" when unknown."""
    return f" — ready in {seconds_text(restore_ms)}" if restore_ms else ""


def partly_on(fraction: float, gpu: bool) -> str:
    """A model that freed only some of its layers to make room: "partly on the GPU (62 %)"."""
    percent = min(99, max(1, round(fraction * 100)))  # never 0 or 100: those say set aside / on
    return f"partly {'on the GPU' if gpu else 'in memory'} ({percent} %)"


def state_words(
    state: str,
    *,
    gpu: bool = True,
    busy: bool = False,
    resident_fraction: float = 0.0,
    restore_ms: float | None = None,
) -> str:
    """One model's state in words: "on the GPU", "answering", "set aside — ready in 0.1 s",
    "partly on the GPU (62 %)", "waiting for the GPU", "asleep", "stopped", "failed"..."""
    if busy and state == "resident":
        return ANSWERING
    if busy and state == "released":
        return WAITING_GPU if gpu else WAITING_TURN
    if busy and state == "sleeping":
        return WAKING
    if state == "released" and 0.0 < resident_fraction < 1.0:
        return partly_on(resident_fraction, gpu)
    word = (STATE_WORDS if gpu else CPU_STATE_WORDS).get(state, state)
    return word + ready_in(restore_ms) if state == "released" else word


def state_count(n: int, state: str, gpu: bool, *, others: bool = False) -> str:
    """ "2 set aside", "1 other asleep" (``others``: besides the model named before)."""
    word = (STATE_WORDS if gpu else CPU_STATE_WORDS).get(state, state)
    if others:
        return f"{n} {'other' if n == 1 else 'others'} {word}"
    return f"{n} {word}"


def holds(gpu: bool) -> str:
    """What the model whose turn it is does: "holds the GPU", or "is active" without a GPU."""
    return "holds the GPU" if gpu else "is active"


def nobody_holds(gpu: bool) -> str:
    return "No model holds the GPU" if gpu else "No model is active"


def switching(gpu: bool) -> str:
    return "Switching the GPU" if gpu else "Switching models"


def waited_for(ms: float, gpu: bool) -> str:
    """ "waited 40 ms for the GPU", "waited 40 ms for its turn"."""
    return f"waited {ms:.0f} ms for {'the GPU' if gpu else 'its turn'}"


def switch_word(gpu: bool) -> str:
    """The name of a handover between models: "GPU switch", or "switch" without a GPU."""
    return "GPU switch" if gpu else "switch"


def models_together(n: int, gpu: bool) -> str:
    return f"{n} models on the GPU" if gpu else f"{n} models in memory"
