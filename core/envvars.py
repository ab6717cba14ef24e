"""Every environment variable Timeshare reads, declared once (Ollama's envconfig idea).

Nothing else in core/ touches ``os.environ`` (tests/test_layers.py checks it on the syntax tree):
a module reads its variable through the :class:`EnvVar` declared here, a child process's
environment is copied with :func:`environment`, and a library's variable is set before the
library loads through :func:`process_environ`. ``timeshare doctor --env`` prints the table
(:func:`table`).

The class of a variable says who it is for:

- ``product``: a user may set it (folders, the Hugging Face mirror, the CLI's key, debug logs);
- ``escape hatch``: replaces a setting or a measured default when the default does not suit a
  machine (the budget on a shared GPU, overlapped restores, ggml-vulkan's memory type);
- ``test``: tests and benchmarks set it to make a run small or quick; not for users.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["product", "escape hatch", "test"]
KINDS: tuple[Kind, ...] = ("product", "escape hatch", "test")


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # what the value is, in words: "path", "0 or 1", "milliseconds", ...
    default: str  # what applies while it is unset, in words ("" when nothing is said)
    kind: Kind
    help: str  # one line

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value as set (None when unset)."""
        return (os.environ if environ is None else environ).get(self.name)

    def text(self, environ: Mapping[str, str] | None = None) -> str:
        """The value, stripped ("" when unset)."""
        return (self.raw(environ) or "").strip()

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable is in the environment (even empty)."""
        return self.raw(environ) is not None

    def number(self) -> float | None:
        """The value as a number, the default's while unset or empty; None when it is not a
        number (the caller says what then)."""
        try:
            return float(self.text() or self.default)
        except ValueError:
            return None

    def switch(self) -> bool | None:
        """A 0/1 override: True for "1", False for "0", None otherwise (unset: the default rule)."""
        value = self.text()
        return True if value == "1" else False if value == "0" else None


# ---- the registry -----------------------------------------------------------------------------

HOME = EnvVar(
    "TIMESHARE_HOME",
    "path",
    "the platform's folders",
    "product",
    "Moves every folder (config, data, cache, logs, runtime) under this one",
)
VRAM_ARENA = EnvVar(
    "TIMESHARE_VRAM_ARENA",
    "path",
    "arena.dir, else <runtime folder>/arena",
    "product",
    "The arena folder (GPU token, tickets, leases); wins over arena.dir",
)
API_KEY = EnvVar(
    "TIMESHARE_API_KEY",
    "text",
    "no key",
    "product",
    "The key the timeshare command sends to a running instance that requires one",
)
DEBUG = EnvVar(
    "TIMESHARE_DEBUG",
    "any non-empty text",
    "off",
    "product",
    "Debug-level logging in the worker processes",
)
COLOR_SCHEME = EnvVar(
    "TIMESHARE_COLOR_SCHEME",
    "dark or light",
    "the desktop's scheme",
    "escape hatch",
    "The chat window's own colours (code blocks, links) in this scheme, for a desktop that does not say",
)
HF_ENDPOINT = EnvVar(
    "HF_ENDPOINT",
    "URL",
    "https://huggingface.co",  # the default itself (pull/remote.py reads it from here)
    "product",
    "The Hugging Face hub (or a mirror) that timeshare pull asks",
)
HF_HUB_CACHE = EnvVar(
    "HF_HUB_CACHE", "path", "$HF_HOME/hub", "product", "The Hugging Face cache the model catalog scans"
)
HF_HOME = EnvVar(
    "HF_HOME",
    "path",
    "$XDG_CACHE_HOME/huggingface",
    "product",
    "Hugging Face's folder (its hub cache inside)",
)
LLAMA_CACHE = EnvVar(
    "LLAMA_CACHE",
    "path",
    "$XDG_CACHE_HOME/llama.cpp",
    "product",
    "llama.cpp's download cache, scanned by the catalog",
)
OLLAMA_MODELS = EnvVar(
    "OLLAMA_MODELS", "path", "~/.ollama/models", "product", "Ollama's model store, scanned by the catalog"
)
XDG_CACHE_HOME = EnvVar("XDG_CACHE_HOME", "path", "~/.cache", "product", "Where the catalog looks for caches")
XDG_RUNTIME_DIR = EnvVar(
    "XDG_RUNTIME_DIR",
    "path",
    "a private timeshare-<uid> folder in the temp dir",
    "product",
    "The per-user runtime folder (sockets, the arena, the API address file)",
)
VRAM_BUDGET = EnvVar(
    "TIMESHARE_VRAM_BUDGET",
    'size, share, "auto" or "one-model"',
    "arena.vram_budget",
    "escape hatch",
    'Replaces arena.vram_budget where the config leaves it at "auto" (a shared GPU; tests use one-model)',
)
OVERLAP_RESTORE = EnvVar(
    "TIMESHARE_OVERLAP_RESTORE",
    "0 or 1",
    "on for CUDA, off elsewhere",
    "escape hatch",
    "Overlapped restores (the first decode computes each layer part as it arrives) off (0) or on (1)",
)
HANDOVER = EnvVar(
    "TIMESHARE_HANDOVER",
    "0 or 1",
    "arena.handover (on), where the device can: a CUDA build",
    "escape hatch",
    "Device memory handed over between workers (issue 40) off (0) or on (1), whatever arena.handover says "
    "and on any build (1 on a CPU build: the memfd stand-in plays the device, as the tests use it)",
)
HANDOVER_KEEP = EnvVar(
    "TIMESHARE_HANDOVER_KEEP",
    "0, 1 or auto",
    "auto",
    "escape hatch",
    "With the hand-over: a released worker keeps its chunks mapped until another needs them (1), "
    "unmaps them at each release (0), or keeps them only while the device has room for as many bytes "
    "again (auto: on a full card they go back at the release)",
)
HANDOVER_LAZY_UNMAP = EnvVar(
    "TIMESHARE_HANDOVER_LAZY_UNMAP",
    "0 or 1",
    "off",
    "test",
    "With the hand-over: a release that gives its chunks back puts them first and unmaps them on a "
    "thread of its own after the release returned (1), to measure against unmapping them on the "
    "release's path (0)",
)
HANDOVER_INTACT = EnvVar(
    "TIMESHARE_HANDOVER_INTACT",
    "0 or 1",
    "on",
    "escape hatch",
    "With kept mappings: a restore into kept chunks the holder vouches nobody else mapped since the "
    "release skips their upload (1), or uploads every byte as before (0)",
)
HANDOVER_CHUNK = EnvVar(
    "TIMESHARE_HANDOVER_CHUNK",
    "size (256MiB)",
    "64MiB",
    "escape hatch",
    "With the hand-over: the chunk size a new hand-over holder starts with (a multiple of 2 MiB; "
    "larger chunks: fewer map calls, more padding)",
)
HANDOVER_ROOM = EnvVar(
    "TIMESHARE_HANDOVER_ROOM",
    "bytes",
    "the device's free memory less 5 % of it (at least 256 MiB)",
    "test",
    "With the hand-over: what a restoring worker may allocate itself before the holder asks other "
    "workers' kept chunks back (a restore's allocations after the weights, a new context's KV cache "
    "and compute buffers, are taken from it); 0 plays a full card (every switch takes the other's "
    "memory)",
)
DEEP_INPLACE = EnvVar(
    "TIMESHARE_DEEP_INPLACE",
    "0 or 1",
    "on for a CPU build and on CUDA (measured there), off on Vulkan until measured",
    "escape hatch",
    "The deep level's compute buffers released in place and its KV cells uploaded layer by layer "
    "with the weights (1), or the compute buffers kept and the KV cells put back after the weights (0)",
)
VK_COMPUTE_INPLACE = EnvVar(
    "TIMESHARE_VK_COMPUTE_INPLACE",
    "0 or 1",
    "off: a Vulkan device keeps its compute buffers (released in place, they crashed lavapipe)",
    "test",
    "With TIMESHARE_DEEP_INPLACE=1, a Vulkan device releases its compute buffers in place too (1): "
    "to measure on a real Vulkan driver whether lavapipe's crash is lavapipe's",
)
KV_SAVE_RAW = EnvVar(
    "TIMESHARE_KV_SAVE_RAW",
    "0 or 1",
    "on (where the cells can be told for sure: see the worker's deep_note)",
    "escape hatch",
    "A deep release saves the KV cells in use straight from the KV tensors (1), or through "
    "llama_state_seq_get_data (0: the portable way, slower without flash attention); the bytes are the same",
)
KV_AHEAD = EnvVar(
    "TIMESHARE_KV_AHEAD",
    "0 or 1",
    "on where a worker may be asked to go deep (an auto budget shared with another model; rebuild path)",
    "escape hatch",
    "The host memory a deep release saves the KV cells into, grown while the worker is idle after an "
    "answer (1: always) rather than allocated by the release, on the switch's path (0: never; pinned RAM "
    "of the cells in use x1.25 is then held only from the first deep release on)",
)
GRAPH_RESET = EnvVar(
    "TIMESHARE_GRAPH_RESET",
    '"rebuild" or "reserve"',
    "rebuild",
    "escape hatch",
    "After a restore that put a weight buffer at another address: the context's previous graph "
    "dropped, the next decode builds a new one (rebuild), or a scheduler reserve first (reserve: "
    "the way before 2026-12-07, ~20 ms more on an H100)",
)
RESIDENCY_PATH = EnvVar(
    "TIMESHARE_RESIDENCY_PATH",
    '"auto", "inplace" or "rebuild"',
    "auto (in place where the probe passes)",
    "escape hatch",
    "The residency path of every worker: rebuild (the portable one) where the in-place path "
    "misbehaves for a model; a CPU build reproduces a GPU's fallback with it",
)
VK_HOST_VISIBLE_VIDMEM = EnvVar(
    "TIMESHARE_VK_HOST_VISIBLE_VIDMEM",
    "1",
    "device-local memory",
    "escape hatch",
    "Keeps ggml-vulkan's host-visible device memory (Timeshare otherwise sets the next variable)",
)
VK_DISABLE_HOST_VISIBLE_VIDMEM = EnvVar(
    "GGML_VK_DISABLE_HOST_VISIBLE_VIDMEM",
    "any",
    "set to 1 by Timeshare",
    "escape hatch",
    "ggml-vulkan's own switch: device buffers in plain device-local memory (DMA restores)",
)
SHADOW_SLICE_MIB = EnvVar(
    "TIMESHARE_SHADOW_SLICE_MIB",
    "MiB (fractions allowed)",
    "256",
    "test",
    "The slice size of a deferred host shadow (tests use small slices)",
)
SHADOW_SLICE_PAUSE_MS = EnvVar(
    "TIMESHARE_SHADOW_SLICE_PAUSE_MS",
    "milliseconds",
    "0",
    "test",
    "For tests: a pause between two slices of a deferred host shadow's idle build (a window to stop it in)",
)
BATCH_GATHER_MS = EnvVar(
    "TIMESHARE_BATCH_GATHER_MS",
    "milliseconds",
    "5",  # the default itself (worker/loop.py reads it from here)
    "test",
    "How long a step that admits requests waits at most for more of a burst",
)
BATCH_QUIET_MS = EnvVar(
    "TIMESHARE_BATCH_QUIET_MS",
    "milliseconds",
    "1",
    "test",
    "The quiet gap after the latest request that ends a burst's gathering",
)
HOST_MEMORY = EnvVar(
    "TIMESHARE_HOST_MEMORY",
    "size (8GiB)",
    "all of it",
    "test",
    "Caps the host memory a CPU build's device has (its budget and fit): --card SIZE of bench api, "
    "doctor and arena-test sets it there",
)
CPU_THREADS = EnvVar(
    "TIMESHARE_CPU_THREADS",
    "a whole number from 1",
    "half the CPUs for one token, all of them for a batch",
    "escape hatch",
    "The CPU threads of every worker's llama.cpp context, for one token and for a batch alike: on a "
    "CPU other programs keep busy, fewer threads than cores were faster (docs/PERFORMANCE.md)",
)
VULKAN_TEST = EnvVar(
    "TIMESHARE_VULKAN_TEST",
    "1",
    "off",
    "test",
    "Runs the Vulkan tests (tests/test_residency_vulkan.py) on a machine with a Vulkan build",
)

REGISTRY: tuple[EnvVar, ...] = (
    HOME,
    VRAM_ARENA,
    API_KEY,
    DEBUG,
    COLOR_SCHEME,
    HF_ENDPOINT,
    HF_HUB_CACHE,
    HF_HOME,
    LLAMA_CACHE,
    OLLAMA_MODELS,
    XDG_CACHE_HOME,
    XDG_RUNTIME_DIR,
    VRAM_BUDGET,
    OVERLAP_RESTORE,
    HANDOVER,
    HANDOVER_KEEP,
    HANDOVER_LAZY_UNMAP,
    HANDOVER_INTACT,
    HANDOVER_CHUNK,
    HANDOVER_ROOM,
    DEEP_INPLACE,
    VK_COMPUTE_INPLACE,
    KV_SAVE_RAW,
    KV_AHEAD,
    GRAPH_RESET,
    RESIDENCY_PATH,
    VK_HOST_VISIBLE_VIDMEM,
    VK_DISABLE_HOST_VISIBLE_VIDMEM,
    SHADOW_SLICE_MIB,
    SHADOW_SLICE_PAUSE_MS,
    BATCH_GATHER_MS,
    BATCH_QUIET_MS,
    HOST_MEMORY,
    CPU_THREADS,
    VULKAN_TEST,
)


def by_name(name: str) -> EnvVar:
    """The declared variable ``name``; KeyError for one that is not declared."""
    for var in REGISTRY:
        if var.name == name:
            return var
    raise KeyError(f"{name} is not a declared environment variable (core/envvars.py)")


# ---- the environment as a whole -----------------------------------------------------------------


def environment(**overrides: str) -> dict[str, str]:
    """A copy of this process's environment, with ``overrides``: a child process's environment."""
    return {**os.environ, **overrides}


def process_environ() -> MutableMapping[str, str]:
    """This process's environment itself, for setting a library's variable before it loads
    (``residency/vkenv.py``); read a variable through its :class:`EnvVar`."""
    return os.environ


def table() -> list[tuple[str, str, str, str, str, str]]:
    """Every declared variable as (name, kind, type, default, current value, help); the current
    value is "" when unset and hidden for keys."""
    rows: list[tuple[str, str, str, str, str, str]] = []
    for var in REGISTRY:
        raw = var.raw()
        current = "" if raw is None else ("(set)" if var is API_KEY else raw)
        rows.append((var.name, var.kind, var.type, var.default, current, var.help))
    return rows
