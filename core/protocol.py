"""Messages between the pool (app process) and a worker (one process per model).

CONTRACT (agreed between pool and worker; change both sides together):
- Transport: a SOCK_STREAM socketpair; the worker gets its end as ``--ipc-fd N``.
- Frame: 4-byte big-endian unsigned length, then that many bytes of UTF-8 JSON, an object
  ``{"v": PROTOCOL_VERSION, "type": "<MessageClass name>", ...fields}``. Max frame 16 MiB.
- Garbage, a truncated frame, an oversize length or an unknown version/type: the receiver answers
  ``Error(code="protocol")`` when it can and drops the connection if the stream cannot be resynced;
  it never hangs and never crashes.
- Pool → worker requests carry ``req`` (a string id chosen by the pool); worker replies echo it.

Flow: worker starts → ``Hello`` → ``Loading`` (0..n) → ``Ready`` (or ``Error`` + exit) → serves.
A ``WorkerStatus`` is pushed after every change of the worker's state (published by the loop thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PROTOCOL_VERSION = 1
MAX_FRAME = 16 * 1024 * 1024


# ---- pool → worker -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Generate:
    req: str
    prompt: str | None = None  # completion mode (raw text, no template)
    messages: tuple[ChatMessage, ...] | None = None  # chat mode (template or fallback format)
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 40
    seed: int | None = None
    stop: tuple[str, ...] = ()
    conversation: str | None = None  # KV sequence key; None: a scratch sequence


@dataclass(frozen=True)
class Cancel:
    req: str


@dataclass(frozen=True)
class Pin:
    pinned: bool


@dataclass(frozen=True)
class Sleep:
    level: Literal["weights", "weights+kv"] = "weights"


@dataclass(frozen=True)
class Wake:
    """Take the GPU token and restore now, ahead of the first request (pre-warm)."""


@dataclass(frozen=True)
class Shutdown:
    save_kv: bool = True  # save every conversation's KV to the kv dir before exiting


@dataclass(frozen=True)
class StatusRequest:
    req: str


# ---- worker → pool -------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    pid: int
    model_id: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Loading:
    stage: str  # "model" | "shadow" | "discovery" ...
    fraction: float = 0.0  # 0..1, for progress bars


@dataclass(frozen=True)
class ModelInfo:
    n_ctx: int
    n_vocab: int
    chat_format: str  # "template" | "fallback"
    residency_path: str  # "inplace" | "rebuild"
    residency_reason: str
    backend: str
    weight_bytes: int
    host_pinned_bytes: int


@dataclass(frozen=True)
class Ready:
    info: ModelInfo


@dataclass(frozen=True)
class WorkerStatus:
    state: Literal["resident", "released", "sleeping", "loading"]
    busy: bool
    pinned: bool
    holds_token: bool
    waiting_reason: str = ""  # e.g. "pinned by gemma3-270m"
    device_bytes: int = 0
    host_pinned_bytes: int = 0
    prompt_tokens_evaluated: int = 0  # total prefill tokens since start (for no-re-prefill checks)
    live_conversations: tuple[str, ...] = ()


@dataclass(frozen=True)
class Token:
    req: str
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_evaluated: int  # prefilled in this request (0 when the KV cache had the prompt)


@dataclass(frozen=True)
class Switch:
    switched: bool
    wait_ms: float = 0.0
    restore_ms: float = 0.0
    first_token_ms: float = 0.0


@dataclass(frozen=True)
class Done:
    req: str
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage
    switch: Switch


@dataclass(frozen=True)
class Released:
    """The worker released its weights (it yielded the GPU, or was told to sleep)."""

    level: str
    release_ms: float
    freed_bytes: int


@dataclass(frozen=True)
class Error:
    req: str | None
    code: str  # errors.TimeshareError.code values, or "protocol"
    message: str
    fatal: bool = False  # the worker exits after sending it


@dataclass(frozen=True)
class StatusReply:
    req: str
    status: WorkerStatus = field(default_factory=lambda: WorkerStatus("loading", False, False, False))
