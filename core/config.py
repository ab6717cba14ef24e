"""Configuration: models and settings, TOML in platformdirs' config dir.

The dataclasses below are the contract every layer codes against. Loading, validation with
field-path errors, atomic writes and defaults live here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

IdleRelease = Literal["weights", "weights+kv", "stop"]
HostShadow = Literal["pinned", "pageable"]
ChatFormat = Literal["auto", "template", "fallback"]


@dataclass(frozen=True)
class ModelConfig:
    id: str  # stable identifier, used by the API's `model` field: [a-z0-9._-]+
    path: str  # GGUF file
    name: str = ""  # display name; defaults to id
    n_ctx: int = 2048  # context tokens per conversation sequence
    n_gpu_layers: int = -1  # -1: all layers (ignored by a CPU build)
    n_seq: int = 4  # conversations kept live in the worker's KV cache (LRU beyond)
    chat_template: str | None = None  # Jinja override; None: the GGUF's own, or the fallback format
    chat_format: ChatFormat = "auto"  # auto: the GGUF's template if it has one, else the fallback
    pinned: bool = False  # a pinned model keeps the GPU once it has it
    idle_sleep_s: float | None = 600.0  # None: never release on idle
    idle_release: IdleRelease = "weights"
    host_shadow: HostShadow = "pinned"
    licence: str = ""  # shown in model lists (filled for the demo models)

    @property
    def display_name(self) -> str:
        return self.name or self.id


@dataclass(frozen=True)
class ArenaConfig:
    dir: str | None = None  # None: platformdirs runtime dir /arena (or $TIMESHARE_VRAM_ARENA)
    min_quantum_ms: float = 250.0  # a busy holder keeps the GPU at least this long before yielding
    wait_timeout_s: float = 300.0  # a request waiting longer for the GPU fails with a clear error


@dataclass(frozen=True)
class ApiConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8385
    key: str | None = None  # bearer key; required for non-loopback binds
    queue_limit: int = 16  # per model; beyond it the API answers 429


@dataclass(frozen=True)
class GeneralConfig:
    start_at_login: bool = False
    prewake_on_typing: bool = True  # focusing/typing in a chat pre-wakes its model


@dataclass(frozen=True)
class Config:
    models: tuple[ModelConfig, ...] = ()
    arena: ArenaConfig = field(default_factory=ArenaConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    general: GeneralConfig = field(default_factory=GeneralConfig)

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)
