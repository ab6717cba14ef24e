"""Immutable snapshots of the pool's state, and the events that carry them.

The pool owns the state; everyone else (tray, chat window, API, CLI) gets frozen copies. Nothing
here refers to a llama object or a Qt object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, TypeGuard, get_args

#: How far a model lets go of the GPU when idle (``idle_release``) or told to sleep: "weights"
#: releases the weights and keeps the KV cache on the device, "weights+kv" moves the KV cache to
#: host memory too, "stop" ends the worker (its conversations' KV saved to disk).
ReleaseLevel = Literal["weights", "weights+kv", "stop"]
RELEASE_LEVELS: tuple[ReleaseLevel, ...] = get_args(ReleaseLevel)
#: The one mapping of the verbs Ollama and LM Studio users type (shared with the Ollama dialect's
#: ``keep_alive``): ``timeshare unload M`` / ``keep_alive: 0`` = off the GPU, KV cache kept;
#: ``timeshare stop M`` = the worker ends, its KV saved. ``load M`` = start if stopped, then wake.
UNLOAD_LEVEL: ReleaseLevel = "weights"
STOP_LEVEL: ReleaseLevel = "stop"
#: What a user's "sleep" does when it names no level (the tray's Sleep, ``timeshare sleep``,
#: ``POST .../sleep`` without a body): weights and KV cache off the device.
USER_SLEEP_LEVEL: ReleaseLevel = "weights+kv"

#: The levels a worker carries out itself; "stop" is the pool's (it ends the worker).
WorkerReleaseLevel = Literal["weights", "weights+kv"]
WORKER_RELEASE_LEVELS: tuple[WorkerReleaseLevel, ...] = get_args(WorkerReleaseLevel)


def is_release_level(value: object) -> TypeGuard[ReleaseLevel]:
    return isinstance(value, str) and value in RELEASE_LEVELS


def parse_release_level(value: object) -> ReleaseLevel:
    """``value`` as a ReleaseLevel, or ValueError with the one message that names the levels."""
    if is_release_level(value):
        return value
    allowed = ", ".join(repr(level) for level in RELEASE_LEVELS[:-1]) + f" or {RELEASE_LEVELS[-1]!r}"
    raise ValueError(f"unknown release level {value!r}: use {allowed}")


class ModelState(str, enum.Enum):
    STARTING = "starting"  # process spawned, not yet talking
    LOADING = "loading"  # reading the GGUF, building the host shadow
    RESIDENT = "resident"  # weights on the device, holds the GPU token
    RELEASED = "released"  # weights released (host shadow kept), KV cache on the device
    SLEEPING = "sleeping"  # weights and KV in host memory, context freed
    STOPPED = "stopped"  # worker exited on purpose; conversations' KV saved to disk
    FAILED = "failed"  # could not load or crashed past its restart budget; see ``reason``


@dataclass(frozen=True)
class SwitchStats:
    """What a request cost in GPU switching. ``switched`` is False when the model already held the GPU.

    The one switch-cost type: the worker sends it in ``protocol.Done`` (``protocol.SwitchMeasured``:
    switched, wait_ms, restore_ms, first_token_ms, restored_bytes, and release_ms, which its grant
    of the token carried from the previous holder through the arena), the pool adds
    prompt_tokens_evaluated and hands it to results, events and snapshots.
    """

    switched: bool
    wait_ms: float = 0.0  # doorbell rung → token acquired (includes the other model's release)
    restore_ms: float = 0.0
    release_ms: float = 0.0  # the previous holder's release, as it measured it (0: none)
    first_token_ms: float = 0.0  # request received by the worker → first token
    prompt_tokens_evaluated: int = 0  # tokens actually prefilled (0 when the KV cache had them)
    # weight bytes the restore moved: all of them after a whole release, only the lost layer
    # parts after a partial one (a byte budget: models[].weight_parts)
    restored_bytes: int = 0


@dataclass(frozen=True)
class ModelStatus:
    id: str
    name: str
    path: str
    state: ModelState
    busy: bool = False
    pinned: bool = False
    queued: int = 0  # requests waiting in the pool for this model
    active: int = 0  # requests its worker decodes together now (continuous batching)
    parallel: int = 0  # how many it may decode together (0: not loaded yet)
    reason: str = ""  # why FAILED, or what it waits for ("waiting for the GPU: pinned by gemma3-270m")
    # the error code of a FAILED model's failure; "model_file": its file is missing, unreadable or
    # not a GGUF (the tray then offers to locate the file or remove the model)
    failure_code: str = ""
    residency_path: str = ""  # "inplace" | "rebuild" | "" (not loaded yet)
    residency_reason: str = ""  # why the rebuild path was chosen
    deep_note: str = ""  # why a deep release frees the context or keeps its buffers ("": in place)
    backend: str = ""  # "CUDA0", "CPU", ...
    chat_format: str = ""  # "template" (from the GGUF) | "fallback" (plain format, see docs)
    # the rest of the chat format its worker reported (chatformat.format): the tool-call family,
    # whether the model thinks first and whether the prompt opens that block itself
    chat_family: str = ""
    thinks: bool = False
    starts_thinking: bool = False
    # how its context pools, as its worker reported ("" until it loaded, and for a chat model;
    # "rank": a reranker, which answers /v1/rerank only)
    pooling: str = ""
    licence: str = ""  # shown where models are listed (demo models carry theirs)
    vision: bool = False  # it reads images (a vision projector: models[].mmproj)
    projector_bytes: int = 0  # its projector's weights (0: none, or not loaded yet)
    weight_bytes: int = 0  # device weight bytes when resident
    host_pinned_bytes: int = 0  # host shadow + the KV snapshots' memory (kept after a deep release)
    # device memory this worker holds now (host memory on a CPU build): weights on the device +
    # kv_bytes + buffer_bytes + context_bytes. Released: all but the weights; sleeping: the
    # driver context only; stopped: 0
    device_bytes: int = 0
    kv_bytes: int = 0  # its KV cache held there now
    buffer_bytes: int = 0  # its compute buffers held there now
    context_bytes: int = 0  # the driver context on a GPU (an allowance of 512 MiB, not measured)
    kv_cache_type: str = ""  # "f16", "q8_0", "q4_0" ("" until loaded)
    fit: str = ""  # what the fit chose for the settings left unset (core/config/fit.py), and why
    n_ctx: int = 0
    pid: int | None = None
    restarts: int = 0
    last_switch: SwitchStats | None = None
    log_tail: tuple[str, ...] = ()
    device: int = 0  # the GPU it runs on (models[].device)
    holds_gpu: bool = False  # holds a lease on its device's VRAM budget (its weights may be there)
    lease_bytes: int = 0  # the weight bytes of that lease
    # device memory handed over (issue 40; 0 while off): the worker's cuMemCreate calls since it
    # started, the chunks its last restore mapped (0: its kept mapping was used), the bytes it
    # keeps mapped while released, the weight bytes its restores did not upload (its kept memory
    # still held them: nobody else mapped it since its release)
    handover_creates: int = 0
    handover_mapped_chunks: int = 0
    handover_kept_bytes: int = 0
    handover_skipped_bytes: int = 0
    # the share of its weights on the device: 1.0 resident, 0.0 released; in between a RELEASED
    # model that made room for another by freeing only some layer parts ("partly on the GPU")
    resident_fraction: float = 0.0

    @property
    def partly_resident(self) -> bool:
        return 0.0 < self.resident_fraction < 1.0

    @property
    def on_host(self) -> bool:
        """A CPU build: what it holds is host memory, not a GPU's."""
        return self.backend.upper().startswith("CPU")

    def held(self) -> dict[str, int | str]:
        """What its worker holds now (``device_bytes``), part by part, and where: "gpu" or
        "host" (a CPU build)."""
        parts = self.kv_bytes + self.buffer_bytes + self.context_bytes
        return {
            "memory": "host" if self.on_host else "gpu",
            "total": self.device_bytes,
            "weights": max(0, self.device_bytes - parts),
            "kv": self.kv_bytes,
            "buffers": self.buffer_bytes,
            "context": self.context_bytes,
        }

    @property
    def display_name(self) -> str:
        """What people see: the name, or the id when the model has none."""
        return self.name or self.id


def resident_percent(fraction: float) -> int:
    """A partly resident share as people read it: a whole percent from 1 to 99 (never 0 or 100,
    which would say released or resident)."""
    return min(99, max(1, round(fraction * 100)))


@dataclass(frozen=True)
class DeviceStatus:
    """One GPU (or, on a CPU build, host memory) and its VRAM budget, as this pool's workers see
    it. ``budget_bytes`` is None under a one-model budget (one model's weights at a time)."""

    index: int
    name: str = ""  # "CUDA0", "CPU"; "" until a worker on it has loaded
    budget: str = ""  # the setting in force: "auto", "20GiB", "80%", "one-model"
    budget_bytes: int | None = None
    leased_bytes: int = 0  # weight bytes of this pool's holders on it
    holders: tuple[str, ...] = ()  # model ids whose weights may be on it (hold a lease), in order
    note: str = ""  # the budget in force is not the configured one (the first instance's won)


@dataclass(frozen=True)
class PoolSnapshot:
    models: tuple[ModelStatus, ...] = ()
    holder: str | None = None  # the model that most recently took the GPU (of those holding it now)
    switching: bool = False  # a handoff is in progress
    devices: tuple[DeviceStatus, ...] = ()  # per GPU: its budget and who holds it

    def model(self, model_id: str) -> ModelStatus | None:
        return next((m for m in self.models if m.id == model_id), None)


class EventKind(str, enum.Enum):
    STATE = "state"  # a model's state/busy/pinned/holder changed
    CRASHED = "crashed"  # a worker died unexpectedly (a restart follows if the budget allows)
    RESTARTED = "restarted"
    FAILED = "failed"  # a model became FAILED (load error, restart budget spent)
    REQUEST_DONE = "request_done"  # a generation finished; ``switch`` tells what it cost
    MESSAGE = "message"  # anything else worth a line in the log / a tray message


@dataclass(frozen=True)
class PoolEvent:
    kind: EventKind
    snapshot: PoolSnapshot
    model: str | None = None
    message: str = ""
    switch: SwitchStats | None = None
    extra: dict[str, object] = field(default_factory=dict)
