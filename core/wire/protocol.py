"""Messages between the pool (app process) and a worker (one process per model).

CONTRACT (agreed between pool and worker; change both sides together):
- Transport: a SOCK_STREAM socketpair; the worker gets its end as ``--ipc-fd N``.
- Frame: 4-byte big-endian unsigned length, then that many bytes of UTF-8 JSON, an object
  ``{"v": PROTOCOL_VERSION, "type": "<MessageClass name>", ...fields}``. Max frame 16 MiB.
- The messages are msgspec Structs, one tagged union on ``type`` (``Message``); a frame decodes
  straight into its Struct with every field's type and constraint checked (a ``Generate`` also
  passes :func:`check_generate`). Unknown keys are ignored (a newer peer may add optional fields),
  except inside ``Sampling``, which refuses them.
- Garbage, a truncated frame, an oversize length, an unknown version/type or an invalid field: the
  receiver answers ``Error(code="protocol")`` when it can and drops the connection if the stream
  cannot be resynced; it never hangs and never crashes. Strings must be Unicode (a lone surrogate
  is refused on both sides), numbers finite.
- Pool → worker requests carry ``req`` (a string id chosen by the pool); worker replies echo it.

Flow: worker starts → ``Hello`` → ``Loading`` (0..n) → ``Ready`` (or ``Error`` + exit) → serves.
A ``WorkerStatus`` is pushed after every change of the worker's state (published by the loop thread).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import select
import socket
import struct
import threading
from typing import Any, Literal

import msgspec

from ..errors import FrameError, ProtocolError
from ..sampling import Sampling, for_front_end
from ..sampling import check as check_sampling
from ..state import WorkerReleaseLevel

PROTOCOL_VERSION = 1
MAX_FRAME = 16 * 1024 * 1024


class _Message(msgspec.Struct, frozen=True, tag=True, tag_field="type"):
    """A frame's body: its class name is its ``type``."""


# ---- pool → worker -------------------------------------------------------------------------


class ToolCall(msgspec.Struct, frozen=True):
    """A call an assistant message made (OpenAI's ``tool_calls[]``)."""

    id: str
    name: str
    arguments: str  # JSON text, as on OpenAI's wire


class ToolSpec(msgspec.Struct, frozen=True):
    """A function the model is told about (OpenAI's ``tools[].function``)."""

    name: str
    description: str = ""
    parameters: Any = None  # its JSON Schema (an object); None: no parameters


class ImagePart(msgspec.Struct, frozen=True):
    """An image in a message or prompt (issue 41): the file's bytes as the client sent them (the
    API checked that they are a whole image of an accepted format and size: core/api/images.py)
    and where it goes: before character ``at`` of the text (0..len(text), in order)."""

    data: bytes
    at: int


#: the most images one request may hold (the API refuses more, naming the part)
MAX_IMAGES = 16
#: the most pixels one image may have (the API checks it from the header; the worker again)
MAX_IMAGE_PIXELS = 50_000_000


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str  # "" for an assistant message that only calls tools
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None  # tool: the function's name
    images: tuple[ImagePart, ...] = ()  # user: the images among its text (a vision model's)


#: a Generate's sampling when none is given: Sampling's own, 256 tokens at most
INTERNAL_SAMPLING = for_front_end("internal")


class Generate(_Message, frozen=True, kw_only=True):
    req: str
    prompt: str | None = None  # completion mode (raw text, no template)
    # completion mode from token ids, as given (no BOS added): a token-array prompt of /v1/completions
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None  # chat mode (template or fallback format)
    tools: tuple[ToolSpec, ...] = ()  # chat mode: the functions the template shows
    sampling: Sampling = INTERNAL_SAMPLING  # carried unchanged from the front end
    conversation: str | None = None  # KV sequence key; None: the prompt cache picks one
    # keyless requests: reuse the prompt cache (None: the model's cache_prompt setting)
    cache_prompt: bool | None = None
    images: tuple[ImagePart, ...] = ()  # completion mode: the images among the prompt's text
    # the prompt tokens' logprobs too (``echo`` with ``logprobs`` on /v1/completions, issue 42):
    # sent in ``PromptLogprobs`` frames before the first Token; the prompt is evaluated whole
    # (every position an output row), in a sequence of its own unless it has a conversation
    prompt_logprobs: bool = False
    # evaluate the prompt and generate nothing (``max_tokens: 0``): Done("length"), no Token
    score_only: bool = False

    @property
    def image_count(self) -> int:
        return len(self.images) + sum(len(m.images) for m in self.messages or ())


class Embed(_Message, frozen=True):
    """Embed texts or token-id lists (core/worker/embed.py); answered by ``Embeddings``, then a
    ``Done`` (usage.prompt_tokens: the tokens embedded).

    With a ``query`` it is a rerank (issue 42): each input is a document (a string), and its
    "vector" in ``Embeddings`` is a reranker's scores for the pair (query, document): its
    classifier's outputs, the first being llama-server's ``relevance_score``;
    usage.prompt_tokens: the tokens of every pair. A model that is not a reranker answers
    ``Error(code="invalid_input")``."""

    req: str
    inputs: tuple[str | tuple[int, ...], ...]
    query: str | None = None


class Cancel(_Message, frozen=True):
    req: str


class Pin(_Message, frozen=True):
    pinned: bool


class Sleep(_Message, frozen=True):
    level: WorkerReleaseLevel = "weights"


class Wake(_Message, frozen=True):
    """Take the GPU token and restore now, ahead of the first request (pre-warm)."""


class Shutdown(_Message, frozen=True):
    save_kv: bool = True  # save every conversation's KV to the kv dir before exiting


class StatusRequest(_Message, frozen=True):
    req: str


# ---- worker → pool -------------------------------------------------------------------------


class Hello(_Message, frozen=True):
    pid: int
    model_id: str
    version: int = PROTOCOL_VERSION


class Loading(_Message, frozen=True):
    stage: str  # "model" | "shadow" | "discovery" ...
    fraction: float = 0.0  # 0..1, for progress bars


class ModelInfo(msgspec.Struct, frozen=True):
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
    parallel: int = 1  # requests the worker answers at once (sequences of its context)
    kv_cache_type: str = "f16"  # K and V's type ("f16", "q8_0", "q4_0")
    kv_bytes: int = 0  # the context's KV cache, every layer (n_ctx × parallel cells)
    n_gpu_layers: int = -1  # as loaded (-1: all; fewer when the fit chose them)
    fit: str = ""  # what the fit chose for settings left unset, and why ("": all were set)
    # the chat format as the API needs it (chatformat.format.ChatFormat), from the template the
    # worker renders with: the tool-call family ("hermes", "llama3", "mistral", "generic"), whether
    # the model thinks first and whether the prompt opens that block itself
    chat_family: str = "generic"
    thinks: bool = False
    starts_thinking: bool = False
    # how a deep release (issue 39) goes for this model: "" in place (the context kept, its KV
    # cells and compute buffers released and back with the weights' parts), else why not
    deep_note: str = ""
    projector_bytes: int = 0  # the vision projector's weights (0: none)
    # how its context pools ("" for a chat model's; "mean", "cls", "last", or "rank": a reranker)
    pooling: str = ""


class Ready(_Message, frozen=True):
    info: ModelInfo


#: What a worker reports of its model: the weights on the device (holding the token), released
#: (KV cache still on the device), sleeping (weights and KV in host memory), or still loading.
WorkerState = Literal["resident", "released", "sleeping", "loading"]


class WorkerStatus(_Message, frozen=True):
    state: WorkerState
    busy: bool
    pinned: bool
    holds_token: bool
    waiting_reason: str = ""  # e.g. "pinned by gemma3-270m"
    # what it holds on its device now (host memory on a CPU build): resident weights + kv_bytes +
    # buffer_bytes + context_bytes (worker/footprint.py says what stays at each level)
    device_bytes: int = 0
    kv_bytes: int = 0  # its KV cache on the device (0 once the context is freed: sleeping)
    buffer_bytes: int = 0  # its compute buffers there (idem)
    context_bytes: int = 0  # the driver context on a GPU (an allowance, not measured); 0 on a CPU build
    host_pinned_bytes: int = 0
    prompt_tokens_evaluated: int = 0  # total prefill tokens since start (for no-re-prefill checks)
    live_conversations: tuple[str, ...] = ()
    lease_bytes: int = 0  # weight bytes leased on the device's budget now
    budget_bytes: int = 0  # the device's weights budget now (0: one model at a time)
    active: int = 0  # requests in the batch now (sequences being decoded or prefilled)
    # the share of its weights on the device now: 1.0 resident, 0.0 released, in between partly
    # released (state "released": it restores what it lost before it computes anything)
    resident_fraction: float = 0.0
    # device memory handed over (issue 40; 0 while off): its cuMemCreate calls since it started,
    # the chunks its last restore mapped (0: its kept mapping was used), the bytes it keeps
    # mapped while released (the arena's, asked back when another worker needs them), the weight
    # bytes its restores did not upload since it started (kept memory that still held them)
    handover_creates: int = 0
    handover_mapped_chunks: int = 0
    handover_kept_bytes: int = 0
    handover_skipped_bytes: int = 0


class LogprobAlt(msgspec.Struct, frozen=True, array_like=True):
    """An alternative token: its text as bytes and its log-probability."""

    piece: bytes
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token's log-probability (log-softmax of the raw logits) and the most likely
    alternatives, most likely first (core/worker/sampler.py measures them)."""

    piece: bytes
    logprob: float
    top: tuple[LogprobAlt, ...] = ()


class Token(_Message, frozen=True, omit_defaults=True):
    req: str
    text: str
    # the tokens whose text this piece completes, when the request asked for logprobs
    logprobs: tuple[TokenLogprobs, ...] = ()


class PromptLogprobs(_Message, frozen=True):
    """Log-probabilities of a ``Generate``'s prompt tokens (``prompt_logprobs``), in order, in
    one or more frames before its first ``Token``: each token's given the tokens before it, with
    the ``top_logprobs`` most likely alternatives. The BOS the worker put before a text prompt is
    left out (as llama-cpp-python leaves it out); otherwise the first entry is the first token's,
    which nothing precedes: it holds logprob 0 and no alternatives. The API writes null for the
    first entry either way (OpenAI's and llama-cpp-python's echo)."""

    req: str
    logprobs: tuple[TokenLogprobs, ...]


class Embeddings(_Message, frozen=True):
    """The vectors of an ``Embed``, in its order (unit length)."""

    req: str
    data: tuple[tuple[float, ...], ...]


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_evaluated: int  # prefilled in this request (0 when the KV cache had the prompt)


class SwitchMeasured(msgspec.Struct, frozen=True):
    """The part of a request's ``state.SwitchStats`` the worker measures or was told with the
    token; the pool adds prompt_tokens_evaluated (``Usage``)."""

    switched: bool
    wait_ms: float = 0.0
    restore_ms: float = 0.0
    first_token_ms: float = 0.0
    restored_bytes: int = 0  # weight bytes the restore moved (a partly released model: what it lost)
    # the previous holder's release, as that worker measured it, carried to this one by the arena
    # with the token (arena.records.TokenGrant.previous_release_ms); 0.0 when none, and from a
    # worker that predates the field
    release_ms: float = 0.0


class Timings(msgspec.Struct, frozen=True):
    """Where a generation's first token went, as its worker measured it (continuous batching,
    issue 24; milliseconds on the worker's monotonic clock, from when its reader thread got the
    request off the pipe)."""

    queue_ms: float = 0.0  # arrival → joined the batch (tokenized, its sequence chosen)
    steps_before: int = 0  # decode steps it waited for (under way at its arrival or begun later)
    prefill_steps: int = 0  # decode steps its prompt was spread over
    prefill_ms: float = 0.0  # its first prefill step began → its last prompt token's step returned
    first_token_ms: float = 0.0  # arrival → its first token was sent
    step_sequences: int = 0  # sequences in its first prefill step (itself included)
    step_prompts: int = 0  # prompts prefilled in that step (itself included)


#: How a generation ended: a stop string or end of sequence, max_tokens reached, or cancelled.
FinishReason = Literal["stop", "length", "cancelled"]


class Done(_Message, frozen=True):
    req: str
    finish_reason: FinishReason
    usage: Usage
    switch: SwitchMeasured
    stop: str = ""  # the stop string that ended it ("": none, e.g. the model's end-of-turn token)
    batch_size: int = 1  # the most requests decoded together while it ran (continuous batching)
    timings: Timings | None = None  # where its first token went (None: an embedding, a cancelled one)


class Released(_Message, frozen=True):
    """The worker released its weights (it yielded the GPU, or was told to sleep)."""

    level: WorkerReleaseLevel
    release_ms: float
    freed_bytes: int
    resident_bytes: int = 0  # weight bytes still on the device (a partial release; 0: all released)


class Error(_Message, frozen=True):
    req: str | None
    code: str  # errors.TimeshareError.code values, or "protocol"
    message: str
    fatal: bool = False  # the worker exits after sending it


class StatusReply(_Message, frozen=True):
    req: str
    status: WorkerStatus = WorkerStatus("loading", False, False, False)


# ---- framing, encoding, validation ---------------------------------------------------------

#: pool → worker
REQUEST_TYPES = (Generate, Embed, Cancel, Pin, Sleep, Wake, Shutdown, StatusRequest)
#: worker → pool
EVENT_TYPES = (
    Hello,
    Loading,
    Ready,
    WorkerStatus,
    Token,
    PromptLogprobs,
    Embeddings,
    Done,
    Released,
    Error,
    StatusReply,
)
Request = Generate | Embed | Cancel | Pin | Sleep | Wake | Shutdown | StatusRequest
Event = (
    Hello
    | Loading
    | Ready
    | WorkerStatus
    | Token
    | PromptLogprobs
    | Embeddings
    | Done
    | Released
    | Error
    | StatusReply
)
Message = Request | Event
#: every message class by its ``type``
MESSAGE_TYPES: dict[str, type[_Message]] = {cls.__name__: cls for cls in (*REQUEST_TYPES, *EVENT_TYPES)}

_HEADER = struct.Struct(">I")
#: how every frame this module encodes begins: such a frame decodes in one step (the fast path)
_PREFIX = b'{"v":%d,' % PROTOCOL_VERSION
_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Message] = msgspec.json.Decoder(Message)


def _floats_in(tp: msgspec.inspect.Type, seen: set[type]) -> bool:
    """Whether a value of this type can hold a float (msgspec encodes NaN and inf as null)."""
    if isinstance(tp, msgspec.inspect.FloatType):
        return True
    if isinstance(tp, msgspec.inspect.StructType):
        if tp.cls in seen:
            return False
        seen.add(tp.cls)
        return any(_floats_in(f.type, seen) for f in tp.fields)
    if isinstance(tp, msgspec.inspect.UnionType):
        return any(_floats_in(t, seen) for t in tp.types)
    if isinstance(tp, (msgspec.inspect.TupleType, msgspec.inspect.VarTupleType)):
        items = tp.item_types if isinstance(tp, msgspec.inspect.TupleType) else (tp.item_type,)
        return any(_floats_in(t, seen) for t in items)
    return False


#: the message classes whose values may hold a float: these are checked for NaN/inf on encode
_WITH_FLOATS = frozenset(
    cls for cls in MESSAGE_TYPES.values() if _floats_in(msgspec.inspect.type_info(cls), set())
)


def _check_finite(value: object, where: str) -> None:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} is not a finite number")
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _check_finite(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}[{i}]")


def encode(msg: object) -> bytes:
    """One frame: 4-byte big-endian length + UTF-8 JSON."""
    cls = type(msg)
    if MESSAGE_TYPES.get(cls.__name__) is not cls:
        raise TypeError(f"{cls.__name__} is not a protocol message")
    try:
        if cls in _WITH_FLOATS:
            _check_finite(msg, cls.__name__)
        body = _encoder.encode(msg)
    except (ValueError, UnicodeEncodeError) as exc:  # NaN/inf, lone surrogates
        raise ProtocolError(f"protocol: a {cls.__name__} message cannot be encoded: {exc}") from None
    payload = _PREFIX + body[1:]
    if len(payload) > MAX_FRAME:
        raise ProtocolError(
            f"protocol: a {cls.__name__} message is {len(payload)} bytes, over the {MAX_FRAME}-byte "
            "frame limit; send a shorter prompt"
        )
    return _HEADER.pack(len(payload)) + payload


# msgspec's validation messages, turned into this module's "<where>: <what>" sentences
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_KINDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "array": "a list",
    "object": "an object",
    "null": "null",
}


def _kind(name: str) -> str:
    options = [_KINDS.get(n.strip(), n.strip()) for n in name.split("|")]
    return " or ".join(options)


def _sentence(exc: msgspec.ValidationError, cls: str) -> str:
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], match["path"] or ""
    where = cls + path
    if m := re.fullmatch(r"Object missing required field `(\w+)`", what):
        return f"{where}.{m[1]}: missing"
    if m := re.fullmatch(r"Expected `([^`]+)`, got `(\w+)`", what):
        return f"{where}: expected {_kind(m[1])}"
    if m := re.fullmatch(r"Expected `(\w+)` (.+)", what):
        return f"{where}: must be {m[2]}"
    if m := re.fullmatch(r"Invalid enum value (.+)", what):
        return f"{where}: expected one of the values this version knows, not {m[1]}"
    if what == "Number out of range":
        return f"{where}: expected a finite number"
    if m := re.fullmatch(r"Object contains unknown field `(\w+)`", what):
        return f"{where}.{m[1]}: unknown field"
    return f"{where}: {what[:1].lower()}{what[1:]}"


def _in_range(number: float) -> bool:
    return abs(number) < 2**64 if isinstance(number, int) else math.isfinite(number)


def _check_json(value: object, where: str) -> None:
    """Refuse strings that are not Unicode (lone surrogates) and numbers that are not finite:
    ``json`` accepts both, the fast path's msgspec refuses both."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{at}: the string is not valid Unicode (lone surrogate)") from None
        elif isinstance(item, int | float) and not isinstance(item, bool) and not _in_range(item):
            raise ValueError(f"{at}: expected a finite number that fits 64 bits")
        elif isinstance(item, dict):
            for key, sub in item.items():
                stack.append((key, at))
                stack.append((sub, f"{at}.{key}"))
        elif isinstance(item, list):
            stack.extend((sub, f"{at}[{i}]") for i, sub in enumerate(item))


def from_dict(obj: object) -> Message:
    """Validate a decoded JSON object and build its message, naming what is wrong. Raises
    FrameError (recoverable)."""
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
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise FrameError(f"protocol: unknown message type {name!r}", recoverable=True, req=req)
    fields = {k: v for k, v in obj.items() if k not in ("v", "type")}
    try:
        _check_json(fields, cls.__name__)
        try:
            msg: Message = msgspec.convert(fields, cls)  # type: ignore[assignment]
        except msgspec.ValidationError as exc:
            raise ValueError(_sentence(exc, cls.__name__)) from None
        if isinstance(msg, Generate):
            check_generate(msg)
    except ValueError as exc:
        raise FrameError(f"protocol: invalid {cls.__name__}: {exc}", recoverable=True, req=req) from None
    return msg


def check_generate(msg: Generate) -> None:
    """What the types cannot express: one of prompt and messages, and ``sampling.check``. Raises
    ValueError."""
    if sum(x is not None for x in (msg.prompt, msg.messages, msg.prompt_tokens)) != 1:
        raise ValueError("give exactly one of prompt or prompt_tokens (completion) and messages (chat)")
    if msg.prompt_tokens is not None and (not msg.prompt_tokens or min(msg.prompt_tokens) < 0):
        raise ValueError("prompt_tokens must be a non-empty list of token ids (whole numbers of at least 0)")
    if msg.messages is not None and not msg.messages:
        raise ValueError("messages is empty: send at least one message")
    if msg.conversation is not None and not msg.conversation:
        raise ValueError("conversation must be a non-empty id or null")
    if msg.images and msg.prompt is None:
        raise ValueError("images outside the messages belong to a completion prompt")
    if msg.image_count > MAX_IMAGES:
        raise ValueError(f"{msg.image_count} images, over the {MAX_IMAGES} one request may hold")
    texts = [(msg.prompt or "", msg.images)] + [(m.content, m.images) for m in msg.messages or ()]
    for text, images in texts:
        at = [i.at for i in images]
        if at != sorted(at) or any(not 0 <= a <= len(text) for a in at):
            raise ValueError("an image's place (at) is outside its text or out of order")
    check_sampling(msg.sampling)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def decode_payload(payload: bytes) -> Message:
    """Decode the body of one frame. Raises FrameError (recoverable).

    A frame as :func:`encode` makes it decodes in one msgspec step; anything else (another
    version, a bad field, not JSON) goes the slow way, which names what is wrong."""
    if payload.startswith(_PREFIX):
        try:
            msg = _decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # the slow path says why
        else:
            if not isinstance(msg, Generate):
                return msg
            try:
                check_generate(msg)
            except ValueError as exc:
                raise FrameError(
                    f"protocol: invalid Generate: {exc}", recoverable=True, req=msg.req
                ) from None
            return msg
    try:
        obj = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"protocol: frame is not UTF-8 JSON ({exc})", recoverable=True) from None
    return from_dict(obj)


def to_dict(msg: object) -> dict[str, Any]:
    """The JSON object of a message: ``{"v": ..., "type": ..., **fields}``."""
    result: dict[str, Any] = json.loads(encode(msg)[_HEADER.size :])
    return result


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, then take messages with ``next``."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max = max_frame
        self._broken = False

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet taken as messages."""
        return len(self._buf)

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

    def unread(self) -> bool:
        """Whether more is on its way to ``recv``: bytes readable on the socket, or fed to the
        decoder and not yet a message. From any thread (a hint: the reader thread may take them
        meanwhile); True at the end of the stream too."""
        if self._decoder.buffered:
            return True
        try:
            readable, _w, _x = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
