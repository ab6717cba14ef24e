"""The settings contract: the dataclasses every layer codes against."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from ..state import ReleaseLevel

HostShadow = Literal["pinned", "pageable"]
ChatFormat = Literal["auto", "template", "fallback"]


@dataclass(frozen=True)
class ModelConfig:
    id: str  # stable identifier, used by the API's `model` field: [a-z0-9._-]+
    path: str  # GGUF file (for a demo model: where its file is expected; see ``demo``)
    # a demo model by reference ("smollm2-135m-instruct", "gemma3-270m"): its file is found (and
    # Gemma assembled) when the model starts, and the config file holds this instead of a path
    demo: str = ""
    name: str = ""  # display name; defaults to id
    n_ctx: int = 2048  # context tokens per conversation sequence
    n_gpu_layers: int = -1  # -1: all layers (ignored by a CPU build)
    n_seq: int = 4  # KV sequences (conversations, cached prompts) a worker keeps (LRU beyond)
    # requests answered at once (continuous batching; each has the whole n_ctx, so the context's
    # KV is n_ctx x parallel); 0: auto (4 on a GPU build, 1 on a CPU-only one)
    parallel: int = 0
    cache_prompt: bool = True  # keyless requests reuse the longest cached prefix (docs/API.md)
    chat_template: str | None = None  # Jinja override; None: the GGUF's own, or the fallback format
    chat_format: ChatFormat = "auto"  # auto: the GGUF's template if it has one, else the fallback
    pinned: bool = False  # a pinned model keeps the GPU once it has it
    idle_sleep_s: float | None = 600.0  # None: never release on idle
    idle_release: ReleaseLevel = "weights"
    host_shadow: HostShadow = "pinned"
    # under a byte VRAM budget (not one-model), hold the released weights in this many parts of
    # consecutive layers (the in-place path), so that a model making room for another frees only
    # the parts it needs, from its last layer down; 1: whole buffers (a switch moves all the weights).
    # 32: one layer per part on models of up to 32 layers (a switch moves the overflow rounded up to
    # one layer: 0.523 x an 8B model under a 1.5 x budget, 0.552 x with 16 parts, docs/PERFORMANCE.md)
    weight_parts: int = 32
    # the GPU this model runs on (index among the GPUs, as llama.cpp's main_gpu; one VRAM budget,
    # queue and set of leases per GPU); 0 on a single-GPU or CPU-only machine
    device: int = 0
    # llama.cpp's flash attention for this model's context (false: llama-cpp-python's default)
    flash_attn: bool = False
    # an embedding model: its context is made for /v1/embeddings (pooling from the GGUF, else
    # mean) and it answers no chat or completion requests
    embedding: bool = False
    # the most tokens an answer of this model may have, whatever a request asks (None: the context)
    max_tokens: int | None = None
    licence: str = ""  # shown in model lists (filled for the demo models)

    @property
    def display_name(self) -> str:
        return self.name or self.id


@dataclass(frozen=True)
class ArenaConfig:
    dir: str | None = None  # None: platformdirs runtime dir /arena (or $TIMESHARE_VRAM_ARENA)
    min_quantum_ms: float = 250.0  # a busy holder keeps the GPU at least this long before yielding
    wait_timeout_s: float = 300.0  # a request waiting longer for the GPU fails with a clear error
    # a restore that meets out-of-device-memory keeps the token and tries again this long (a killed
    # holder's memory comes back a little after the kernel dropped its flock) before failing
    restore_oom_retry_s: float = 10.0
    # a worker of this pool that holds the GPU (or heads its queue) while others wait, and answers
    # no status ping for this long, is killed (SIGKILL to its process group) and restarted; 0: off
    hung_holder_s: float = 30.0
    # weights on each GPU: "auto" (device total - others' use at start - workers' released
    # footprints - a margin), a size ("20GiB", "12000MB"), a share ("80%") or "one-model" (one at a
    # time); several models stay resident when they fit (docs/INTERFACES.md, arena)
    vram_budget: str = "auto"


@dataclass(frozen=True)
class ApiConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8385
    key: str | None = None  # bearer key; required for non-loopback binds
    queue_limit: int = 16  # per model; beyond it the API answers 429
    # Host header names accepted besides the loopback names (a loopback bind accepts only those);
    # "*" accepts any. Guards against DNS rebinding.
    allowed_hosts: tuple[str, ...] = ()
    # web origins ("http://localhost:3000") whose pages may call the API (CORS); "*" allows any.
    # A request carrying another Origin is refused with 403.
    allowed_origins: tuple[str, ...] = ()
    # a second listener for Ollama-only clients, on Ollama's address ("127.0.0.1:11434"); empty: off.
    # It serves the same app (every dialect, the same key and guards).
    ollama_listen: str = ""


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
    # Not saved: a sentence for the UI/CLI when the pool is empty (no config and no demo models).
    notice: str = field(default="", compare=False)

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)


def suggest_model_id(name: str, taken: Iterable[str] = ()) -> str:
    """A valid, unused model id derived from a display name or file name."""
    base = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "model"
    base = base[:64]
    used = set(taken)
    if base not in used:
        return base
    n = 2
    while f"{base}-{n}" in used:
        n += 1
    return f"{base}-{n}"
