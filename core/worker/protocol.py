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

import contextlib
import dataclasses
import json
import math
import socket
import struct
import threading
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from ..errors import FrameError, ProtocolError
from ..state import SwitchStats, WorkerReleaseLevel

PROTOCOL_VERSION = 1
MAX_FRAME = 16 * 1024 * 1024


# ---- pool → worker -------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant message made (OpenAI's ``tool_calls[]``)."""

    id: str
    name: str
    arguments: str  # JSON text, as on OpenAI's wire


@dataclass(frozen=True)
class ToolSpec:
    """A function the model is told about (OpenAI's ``tools[].function``)."""

    name: str
    description: str = ""
    parameters: Any = None  # its JSON Schema (an object); None: no parameters


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant", "tool"]
    content: str  # "" for an assistant message that only calls tools
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None  # tool: the function's name


@dataclass(frozen=True)
class Generate:
    req: str
    prompt: str | None = None  # completion mode (raw text, no template)
    messages: tuple[ChatMessage, ...] | None = None  # chat mode (template or fallback format)
    tools: tuple[ToolSpec, ...] = ()  # chat mode: the functions the template shows
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 40
    seed: int | None = None
    stop: tuple[str, ...] = ()
    conversation: str | None = None  # KV sequence key; None: the prompt cache picks one
    # keyless requests: reuse the prompt cache (None: the model's cache_prompt setting)
    cache_prompt: bool | None = None


@dataclass(frozen=True)
class Cancel:
    req: str


@dataclass(frozen=True)
class Pin:
    pinned: bool


@dataclass(frozen=True)
class Sleep:
    level: WorkerReleaseLevel = "weights"


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
    device: int = 0  # the GPU's index (models[].device); 0 on a CPU build
    device_name: str = ""  # "CUDA0", or "CPU" (host memory plays the device)
    budget_setting: str = ""  # the VRAM budget in force on that device ("one-model", "auto", "20GiB")
    budget_note: str = ""  # set when that is not this model's own setting (the first one won)


@dataclass(frozen=True)
class Ready:
    info: ModelInfo


#: What a worker reports of its model: the weights on the device (holding the token), released
#: (KV cache still on the device), sleeping (weights and KV in host memory), or still loading.
WorkerState = Literal["resident", "released", "sleeping", "loading"]


@dataclass(frozen=True)
class WorkerStatus:
    state: WorkerState
    busy: bool
    pinned: bool
    holds_token: bool
    waiting_reason: str = ""  # e.g. "pinned by gemma3-270m"
    device_bytes: int = 0
    host_pinned_bytes: int = 0
    prompt_tokens_evaluated: int = 0  # total prefill tokens since start (for no-re-prefill checks)
    live_conversations: tuple[str, ...] = ()
    lease_bytes: int = 0  # weight bytes leased on the device's budget now
    budget_bytes: int = 0  # the device's weights budget now (0: one model at a time)


@dataclass(frozen=True)
class Token:
    req: str
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_evaluated: int  # prefilled in this request (0 when the KV cache had the prompt)


#: How a generation ended: a stop string or end of sequence, max_tokens reached, or cancelled.
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class Done:
    req: str
    finish_reason: FinishReason
    usage: Usage
    switch: SwitchStats  # the WIRE_FIELDS the worker measured; the pool fills in the rest
    stop: str = ""  # the stop string that ended it ("": none, e.g. the model's end-of-turn token)


@dataclass(frozen=True)
class Released:
    """The worker released its weights (it yielded the GPU, or was told to sleep)."""

    level: WorkerReleaseLevel
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


# ---- framing, encoding, validation ---------------------------------------------------------

#: pool → worker
REQUEST_TYPES = (Generate, Cancel, Pin, Sleep, Wake, Shutdown, StatusRequest)
#: worker → pool
EVENT_TYPES = (
    Hello,
    Loading,
    Ready,
    WorkerStatus,
    Token,
    Done,
    Released,
    Error,
    StatusReply,
)
Request = Generate | Cancel | Pin | Sleep | Wake | Shutdown | StatusRequest
Event = Hello | Loading | Ready | WorkerStatus | Token | Done | Released | Error | StatusReply
Message = Request | Event

_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in (*REQUEST_TYPES, *EVENT_TYPES)}
#: Dataclasses that travel with only some of their fields (the others keep their defaults on
#: receipt): a ``Done``'s switch carries what the worker measured; release_ms (from the previous
#: holder's ``Released``) and prompt_tokens_evaluated (from ``Usage``) are the pool's to fill in.
WIRE_FIELDS: dict[type, tuple[str, ...]] = {
    SwitchStats: ("switched", "wait_ms", "restore_ms", "first_token_ms"),
}
_HEADER = struct.Struct(">I")
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def _convert(value: object, tp: Any, where: str) -> object:
    """Check a decoded JSON value against a field type and convert it (lists → tuples, objects →
    dataclasses). Raises ValueError naming the field."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        if value is not None:
            raise ValueError(f"{where}: expected null")
        return None
    if origin is Union or origin is types.UnionType:
        errors = []
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[-1] if errors else f"{where}: no type matches")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
            raise ValueError(f"{where}: expected one of {', '.join(repr(a) for a in allowed)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ValueError(f"{where}: expected {len(args)} items")
        return tuple(
            _convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(args, value, strict=True))
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"{where}: expected a finite number")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: the string is not valid Unicode (lone surrogate)") from None
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object")
        return _build(tp, value, where)
    raise ValueError(f"{where}: unsupported type {tp!r}")  # a bug in this module, not in the peer


def _wire_fields(cls: type) -> list[dataclasses.Field[Any]]:
    names = WIRE_FIELDS.get(cls)
    return [f for f in dataclasses.fields(cls) if names is None or f.name in names]


def _to_json(value: object) -> object:
    """``dataclasses.asdict`` that leaves out the fields not on the wire (``WIRE_FIELDS``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in _wire_fields(type(value))}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_json(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _build(cls: type, obj: dict[str, Any], where: str) -> object:
    hints = _hints(cls)
    kwargs: dict[str, object] = {}
    for f in _wire_fields(cls):
        if f.name in obj:
            kwargs[f.name] = _convert(obj[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}.{f.name}: missing")
    # Unknown keys are ignored: a newer peer may add optional fields (see the module docstring).
    return cls(**kwargs)


def to_dict(msg: object) -> dict[str, Any]:
    """The JSON object of a message: ``{"v": ..., "type": ..., **fields}``."""
    cls = type(msg)
    if _BY_NAME.get(cls.__name__) is not cls:
        raise TypeError(f"{cls.__name__} is not a protocol message")
    body = typing.cast(dict[str, Any], _to_json(msg))
    return {"v": PROTOCOL_VERSION, "type": cls.__name__, **body}


def from_dict(obj: object) -> Message:
    """Validate a decoded JSON object and build its message. Raises FrameError (recoverable)."""
    if not isinstance(obj, dict):
        raise FrameError("protocol: a frame must hold a JSON object", recoverable=True)
    req = obj.get("req") if isinstance(obj.get("req"), str) else None
    version = obj.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise FrameError(
            f"protocol: version {version!r} is not supported (this side speaks {PROTOCOL_VERSION}); "
            "install matching Timeshare versions",
            recoverable=True,
            req=req,
        )
    name = obj.get("type")
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise FrameError(f"protocol: unknown message type {name!r}", recoverable=True, req=req)
    fields = {k: v for k, v in obj.items() if k not in ("v", "type")}
    try:
        msg = typing.cast(Message, _build(cls, fields, cls.__name__))
        if isinstance(msg, Generate):
            check_generate(msg)
    except ValueError as exc:
        raise FrameError(f"protocol: invalid {cls.__name__}: {exc}", recoverable=True, req=req) from None
    return msg


def check_generate(msg: Generate) -> None:
    """Semantic checks the types cannot express. Raises ValueError."""
    if (msg.prompt is None) == (msg.messages is None):
        raise ValueError("give exactly one of prompt (completion) and messages (chat)")
    if msg.messages is not None and not msg.messages:
        raise ValueError("messages is empty: send at least one message")
    if msg.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if msg.temperature < 0:
        raise ValueError("temperature must be 0 (greedy) or more")
    if not 0.0 < msg.top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    if msg.top_k < 0:
        raise ValueError("top_k must be 0 (off) or more")
    if msg.seed is not None and not 0 <= msg.seed < 2**32:
        raise ValueError("seed must be in [0, 2**32)")
    if msg.conversation is not None and not msg.conversation:
        raise ValueError("conversation must be a non-empty id or null")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def encode(msg: object) -> bytes:
    """One frame: 4-byte big-endian length + UTF-8 JSON."""
    try:
        text = json.dumps(to_dict(msg), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        payload = text.encode("utf-8")
    except ValueError as exc:  # NaN/inf, lone surrogates
        raise ProtocolError(f"protocol: a {type(msg).__name__} message cannot be encoded: {exc}") from None
    if len(payload) > MAX_FRAME:
        raise ProtocolError(
            f"protocol: a {type(msg).__name__} message is {len(payload)} bytes, over the {MAX_FRAME}-byte "
            "frame limit; send a shorter prompt"
        )
    return _HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> Message:
    """Decode the body of one frame. Raises FrameError (recoverable)."""
    try:
        obj = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"protocol: frame is not UTF-8 JSON ({exc})", recoverable=True) from None
    return from_dict(obj)


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, then take messages with ``next``."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max = max_frame
        self._broken = False

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> Message | None:
        """The next complete message, None if more bytes are needed. Raises FrameError."""
        if self._broken:
            raise FrameError("protocol: the stream is out of sync", recoverable=False)
        if len(self._buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buf)
        if length > self._max:
            self._broken = True
            raise FrameError(
                f"protocol: frame length {length} is "
                f"over the {self._max}-byte limit (garbage on the stream?)",
                recoverable=False,
            )
        end = _HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[_HEADER.size : end])
        del self._buf[:end]
        return decode_payload(payload)

    def eof(self) -> None:
        """The peer closed the stream: raise if it stopped in the middle of a frame."""
        if self._buf and not self._broken:
            n = len(self._buf)
            self._buf.clear()
            raise FrameError(
                f"protocol: stream ended inside a frame ({n} bytes left over)", recoverable=False
            )


class Connection:
    """A framed message stream over a SOCK_STREAM socket. ``send`` is thread-safe; ``recv`` is for
    one reader thread."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self._decoder = FrameDecoder(max_frame)
        self._send_lock = threading.Lock()
        self._eof = False

    @classmethod
    def from_fd(cls, fd: int) -> Connection:
        return cls(socket.socket(fileno=fd))

    def send(self, msg: object) -> None:
        """Send one message. Raises ProtocolError if it cannot be encoded, OSError if the peer is gone."""
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> Message | None:
        """Block until the next message; None on a clean end of stream. Raises FrameError: when
        ``recoverable`` the caller may reply and call recv again, otherwise it must close."""
        while True:
            msg = self._decoder.next()
            if msg is not None:
                return msg
            if self._eof:
                self._decoder.eof()
                return None
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self._eof = True
            else:
                self._decoder.feed(chunk)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
