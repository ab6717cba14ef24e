"""The settings contract: the dataclasses every layer codes against.

Each field is declared once with its default and what it means to a person (``meta.FieldMeta``:
label, unit, range, help); validation and the Settings dialogs read both from here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..state import RELEASE_LEVELS, ReleaseLevel
from .meta import META_KEY, FieldMeta, setting

HostShadow = Literal["pinned", "pageable"]
ChatFormat = Literal["auto", "template", "fallback"]
KvCacheType = Literal["f16", "q8_0", "q4_0"]

DAY_S = 24 * 3600.0


@dataclass(frozen=True)
class ModelConfig:
    # stable identifier, used by the API's `model` field: [a-z0-9._-]+
    id: str = field(metadata={META_KEY: FieldMeta("Id (used by the API)")})
    # GGUF file (for a demo model: where its file is expected; see ``demo``)
    path: str = field(metadata={META_KEY: FieldMeta("GGUF file")})
    # a demo model by reference ("smollm2-135m-instruct", "gemma3-270m"): its file is found (and
    # Gemma assembled) when the model starts, and the config file holds this instead of a path
    demo: str = setting("", FieldMeta("Demo model"))
    # a vision projector (mmproj GGUF) for this model: it then reads images (issue 41)
    mmproj: str = setting(
        "",
        FieldMeta(
            "Vision projector",
            "An mmproj GGUF made for this model: with it the model reads images (llama.cpp's libmtmd)",
            special="none (text only)",
        ),
    )
    name: str = setting("", FieldMeta("Name", "The name shown in menus and lists; the id when empty"))
    # 0: auto (core/config/fit.py: the trained context capped at 4096 on a GPU build, 2048 on a CPU
    # one, halved while the KV cache takes more than 1/8 of the free memory)
    n_ctx: int = setting(
        0,
        FieldMeta(
            "Context tokens",
            "Context tokens per conversation sequence; auto: fitted to the device when the model "
            "loads (the trained context, at most 4096, less while its KV cache takes more than 1/8 of the "
            "budget it time-shares with the other models)",
            "tokens",
            0,
            ui_maximum=1 << 20,
            special="auto (fitted to the device)",
        ),
    )
    n_gpu_layers: int = setting(
        -1,
        FieldMeta(
            "Layers on the GPU",
            "-1: all layers, or as many as fit when the weights do not; 0: none (ignored by a CPU build)",
            minimum=-1,
        ),
    )
    n_seq: int = setting(
        4,
        FieldMeta(
            "Conversations kept live",
            "KV sequences (conversations, cached prompts) a worker keeps (least recently used beyond)",
            minimum=1,
            maximum=256,
        ),
    )
    # (each request has the whole n_ctx, so the context's KV is n_ctx x parallel)
    parallel: int = setting(
        0,
        FieldMeta(
            "Answers at once",
            "Requests answered at once, decoded together. Each has the whole context, so the "
            "KV cache is context tokens × this (kept {on the GPU|in memory} while the model is set aside).",
            minimum=0,
            maximum=64,
            special="auto ({4 on a GPU, fewer when the KV cache does not fit|1 on a CPU})",
        ),
    )
    # "": arena.kv_cache_type. A quantised cache turns flash attention on (llama.cpp needs it for
    # a quantised V); its answers are close to f16's, not bitwise the same
    kv_cache_type: KvCacheType | Literal[""] = setting(
        "",
        FieldMeta(
            "KV cache type",
            'K and V of this model\'s KV cache: "f16", "q8_0" (about half the bytes) or "q4_0" (about a '
            "quarter); a quantised cache turns flash attention on",
            choices=("", *get_args(KvCacheType)),  # "": the arena's
            special="the arena's kv_cache_type",
        ),
    )
    cache_prompt: bool = setting(
        True, FieldMeta("Prompt cache", "Keyless requests reuse the longest cached prefix (docs/API.md)")
    )
    chat_template: str | None = setting(
        None,
        FieldMeta("Chat template", "A Jinja override; none: the GGUF's own, or the fallback format"),
    )
    chat_format: ChatFormat = setting(
        "auto",
        FieldMeta(
            "Chat format",
            "auto: the GGUF's template if it has one, else the fallback format",
            choices=get_args(ChatFormat),
        ),
    )
    pinned: bool = setting(False, FieldMeta("Pinned", "Keep {the GPU|its turn} once it has it"))
    idle_sleep_s: float | None = setting(
        600.0,
        FieldMeta(
            "Set aside when idle after",
            "Set the model's weights aside after this long without a request",
            "s",
            0,
            ui_maximum=7 * DAY_S,
            special="never",  # None in the dataclass, false in the file
        ),
    )
    idle_release: ReleaseLevel = setting(
        "weights",
        FieldMeta("When idle, free", "What setting an idle model aside frees", choices=RELEASE_LEVELS),
    )
    host_shadow: HostShadow = setting(
        "pinned",
        FieldMeta(
            "Host copy of the weights", "Pinned host memory restores faster", choices=get_args(HostShadow)
        ),
    )
    # under a byte VRAM budget (not one-model), hold the released weights in this many parts of
    # consecutive layers (the in-place path), so that a model making room for another frees only
    # the parts it needs, from its last layer down; 1: whole buffers (a switch moves all the weights).
    # 32: one layer per part on models of up to 32 layers (a switch moves the overflow rounded up to
    # one layer: 0.523 x an 8B model under a 1.5 x budget, 0.552 x with 16 parts, docs/PERFORMANCE.md)
    weight_parts: int = setting(
        32,
        FieldMeta(
            "Weight parts",
            "The weights of a model set aside are held in this many parts of consecutive layers, so that "
            "making room for another model frees only the parts it needs; 1: whole buffers",
            minimum=1,
            maximum=256,
        ),
    )
    # one VRAM budget, queue and set of leases per GPU
    device: int = setting(
        0,
        FieldMeta(
            "GPU",
            "The GPU this model runs on (its index, as llama.cpp's main_gpu); 0 on a single-GPU machine",
            minimum=0,
            maximum=63,
        ),
    )
    flash_attn: bool = setting(
        False, FieldMeta("Flash attention", "llama.cpp's flash attention for this model's context")
    )
    # its context is made for /v1/embeddings (pooling from the GGUF, else mean)
    embedding: bool = setting(
        False, FieldMeta("Embedding model", "It answers /v1/embeddings and no chat or completion requests")
    )
    max_tokens: int | None = setting(
        None,
        FieldMeta(
            "Longest answer",
            "The most tokens an answer of this model may have, whatever a request asks (none: the context)",
            "tokens",
            1,
        ),
    )
    licence: str = setting("", FieldMeta("Licence", "Shown in model lists (filled for the demo models)"))

    @property
    def display_name(self) -> str:
        return self.name or self.id

    def kv_type(self, default: KvCacheType = "f16") -> KvCacheType:
        """The KV cache type this model uses: its own, or ``default`` (arena.kv_cache_type)."""
        return self.kv_cache_type or default


@dataclass(frozen=True)
class ArenaConfig:
    # None: platformdirs runtime dir /arena (or $TIMESHARE_VRAM_ARENA)
    dir: str | None = setting(
        None, FieldMeta("Folder the models take turns through", special="default (the runtime folder)")
    )
    min_quantum_ms: float = setting(
        250.0,
        FieldMeta(
            "A busy model keeps {the GPU|its turn} at least",
            "A busy model keeps {the GPU|its turn} at least this long before giving way",
            "ms",
            0,
            ui_maximum=60000,
        ),
    )
    wait_timeout_s: float = setting(
        300.0,
        FieldMeta(
            "A request waits for {the GPU|its turn} at most",
            "A request waiting longer for {the GPU|its turn} fails with a clear error",
            "s",
            0,
            strict_minimum=True,
            ui_maximum=DAY_S,
        ),
    )
    # (a killed holder's memory comes back a little after the kernel dropped its flock)
    restore_oom_retry_s: float = setting(
        10.0,
        FieldMeta(
            "Retry a restore short of device memory for",
            "A restore that meets out-of-device-memory keeps {the GPU|its turn} and tries again this long",
            "s",
            0,
            ui_maximum=DAY_S,
        ),
    )
    # (SIGKILL to its process group)
    hung_holder_s: float = setting(
        30.0,
        FieldMeta(
            "Restart {a GPU holder|the active model} that stops answering after",
            "A worker that {holds the GPU|is active} (or heads its queue) while others wait, and answers no "
            "status ping for this long, is killed and restarted; 0: never",
            "s",
            0,
            ui_maximum=DAY_S,
            special="never",
        ),
    )
    # device memory handed from the releasing worker to the restoring one (issue 40): on, where
    # the device can (a CUDA build; docs/INTERFACES.md, "Device memory handed over between workers")
    handover: bool = setting(
        True,
        FieldMeta(
            "Hand {GPU memory|memory} from one model to the next",
            "A switch frees no {GPU memory|memory}: the model that leaves hands its memory to the one "
            "that comes (CUDA only); off: each switch frees and allocates",
        ),
    )
    handover_idle_s: float = setting(
        300.0,
        FieldMeta(
            "Give handed-over {GPU memory|memory} back after",
            "{GPU memory|Memory} kept for the next switch goes back to the driver after this long "
            "without a switch; 0: at once",
            "s",
            0,
            ui_maximum=DAY_S,
        ),
    )
    # several models stay resident when they fit (docs/INTERFACES.md, arena)
    vram_budget: str = setting(
        "auto",
        FieldMeta(
            "{VRAM|Memory} for model weights",
            "auto: what {the GPU|host memory} has free at start, less a margin and what each model "
            "keeps there while asleep; one-model: one model's weights at a time; or a size (20GB, "
            "12000MiB) or a share (80%). Models that fit together stay {on the GPU|in memory} together.",
            choices=("auto", "one-model"),  # the words; a size or a share is also taken
        ),
    )
    # the KV cache type of models that set none (models[].kv_cache_type)
    kv_cache_type: KvCacheType = setting(
        "f16",
        FieldMeta(
            "KV cache type",
            'K and V of the models that set none: "f16", "q8_0" (about half the bytes) or "q4_0" '
            "(about a quarter); a quantised cache turns flash attention on",
            choices=get_args(KvCacheType),
        ),
    )


@dataclass(frozen=True)
class ApiConfig:
    enabled: bool = setting(True, FieldMeta("Serve the API to other programs on this computer"))
    host: str = setting(
        "127.0.0.1",
        FieldMeta("Address", "127.0.0.1: this computer only; 0.0.0.0: every network (needs a key)"),
    )
    port: int = setting(8385, FieldMeta("Port", minimum=1, maximum=65535))
    key: str | None = setting(
        None,
        FieldMeta(
            "Key",
            "A bearer key; required for binds other machines can reach",
            special="none (allowed only on 127.0.0.1)",
        ),
    )
    queue_limit: int = setting(
        16,
        FieldMeta(
            "Waiting requests, at most",
            "More requests waiting for one model are refused (busy) until it catches up",
            "requests per model",
            1,
            ui_maximum=100000,
        ),
    )
    # Guards against DNS rebinding.
    allowed_hosts: tuple[str, ...] = setting(
        (),
        FieldMeta(
            "Other host names",
            "Other names this computer is reached by (comma-separated), or * for any: guards "
            "against web pages that rename themselves to reach it (DNS rebinding)",
            special="only localhost and 127.0.0.1",
        ),
    )
    # A request carrying another Origin is refused with 403.
    allowed_origins: tuple[str, ...] = setting(
        (),
        FieldMeta(
            "Web pages allowed",
            "Web pages that may call the API from a browser (comma-separated), e.g. "
            "http://localhost:3000, or * for any",
            special="none: web pages may not call the API",
        ),
    )
    # The Responses API's stored responses (store: true; core/api/response_store.py), in the data
    # dir: the oldest go first beyond this many, and any older than responses_days.
    responses_kept: int = setting(
        1000,
        FieldMeta(
            "Stored responses, at most",
            "Answers of the Responses API kept so that a client can continue them "
            "(previous_response_id); the oldest go first",
            "responses",
            0,
            ui_maximum=1_000_000,
            special="none: nothing is kept",
        ),
    )
    responses_days: int = setting(
        30,
        FieldMeta(
            "Stored responses are kept for",
            "Stored answers of the Responses API older than this are forgotten",
            "days",
            1,
            ui_maximum=36500,
        ),
    )
    # It serves the same app (every dialect, the same key and guards).
    ollama_listen: str = setting(
        "",
        FieldMeta(
            "Ollama's address too",
            "A second address (HOST:PORT) for programs that expect Ollama at its own address. "
            "Every dialect is also served on the address above.",
            special="off (Ollama's own address: 127.0.0.1:11434)",
        ),
    )
    # an OpenAI image_url part that is an http(s) URL: fetched by Timeshare (bounded in size and
    # time) only when this is on; data: URLs are always taken (issue 41)
    fetch_image_urls: bool = setting(
        False,
        FieldMeta(
            "Fetch image URLs",
            "An image given as an http(s) URL is downloaded by Timeshare (at most 8 MiB, 10 s); "
            "off: such images are refused and clients send them inline (data: URLs, base64)",
        ),
    )


@dataclass(frozen=True)
class GeneralConfig:
    start_at_login: bool = setting(False, FieldMeta("Start Timeshare when I log in"))
    prewake_on_typing: bool = setting(
        True, FieldMeta("Load a model back while I type to it, so it answers sooner")
    )


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
