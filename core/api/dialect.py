"""The turn pipeline every dialect shares (OpenAI's in ``handlers``, ``anthropic``, ``ollama``):
a request translated to a :class:`GenerationRequest`, started on the pool as its choices
(:func:`start`, one :class:`Choice` per ``n``), and its answers streamed or awaited through the
:class:`Turn`: pieces with their logprobs, the text as events (content, reasoning, tool calls),
real timings, the client going away and the server shutting down handled once. A dialect only
translates its JSON to a GenerationRequest and the turn's pieces, events and results back to its
JSON; the pool, the sampler, the tools path (``tools``, ``chat_output``, ``core/chatformat``),
structured output (``structured``) and the guards are shared.

The handlers object of ``handlers.create_app`` is the :class:`Host`: it runs blocking pool calls
off the event loop, watches for a client that goes away (its generation is cancelled) and for
the server shutting down (503).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread
import msgspec
from starlette.requests import Request

from ..chatformat.format import ChatFormat, reported
from ..chatformat.parse import Event
from ..config.schema import ModelConfig
from ..errors import ModelUnavailableError, UnknownModelError
from ..pool.generation import Generation, GenerationResult
from ..pool.supervisor import Pool
from ..state import ModelStatus, PoolSnapshot
from ..wire.protocol import TokenLogprobs
from .chat_output import ChatOutput, prepare_chat
from .errors import BadRequestError
from .middleware import SHUTTING_DOWN
from .model_files import Files
from .requests import GenerationRequest
from .shapes import schema_error_path
from .tools import ToolRequest

T = TypeVar("T")


class Host(Protocol):
    """What a dialect needs of the API's handlers (``handlers._Handlers`` is one)."""

    pool: Pool
    closing: bool
    config_path: Path | None  # the config file (None: the user's)
    files: Files  # what the models' GGUF files say (headers cached), for the listings
    generation_limiter: anyio.CapacityLimiter

    async def call(self, func: Callable[..., T], *args: Any) -> T: ...

    async def wait_watching(self, request: Request, gen: Generation, func: Callable[[], T]) -> T: ...

    def record_cancel_later(self, gen: Generation) -> None: ...

    def streaming(self, *gens: Generation) -> contextlib.AbstractContextManager[None]: ...


def listing(pool: Pool) -> list[tuple[ModelStatus, ModelConfig | None]]:
    """The models every dialect lists (GET /v1/models, /api/tags, /api/ps), in the pool's order:
    each one's status, all from one snapshot, and its configuration (None: removed meanwhile)."""
    config = pool.config
    return [(status, config.model(status.id)) for status in pool.snapshot().models]


def unknown_model(name: str, snapshot: PoolSnapshot) -> UnknownModelError:
    """The OpenAI and Anthropic dialects' answer to a model name that names none."""
    known = ", ".join(m.id for m in snapshot.models) or "none are configured"
    return UnknownModelError(f"The model {name!r} does not exist in this Timeshare; use one of: {known}.")


@dataclass
class Timings:
    """Measured on the API side, around the pool: nanoseconds since the request arrived."""

    started: float = field(default_factory=time.monotonic)
    first_piece: float | None = None
    done: float | None = None

    def mark_first(self) -> None:
        if self.first_piece is None:
            self.first_piece = time.monotonic()

    def mark_done(self) -> None:
        self.mark_first()
        if self.done is None:
            self.done = time.monotonic()

    def ns(self, a: float, b: float | None) -> int:
        return max(0, int(((b if b is not None else time.monotonic()) - a) * 1e9))

    @property
    def total_ns(self) -> int:
        return self.ns(self.started, self.done)

    @property
    def to_first_ns(self) -> int:
        """Request arrived → first piece (queueing, the switch, the prefill, the first token)."""
        return self.ns(self.started, self.first_piece)

    @property
    def after_first_ns(self) -> int:
        """First piece → done (the decode of the rest)."""
        return self.ns(self.first_piece or self.started, self.done)


class Choice:
    """One generation of a :class:`Turn` (a request for ``n`` choices has ``n``, choice ``i``
    sampled with ``seed + i``): its pieces, and the shaping its answer needs (``output``: tool
    calls and reasoning, None: plain text), whose parser splits the text into events."""

    def __init__(self, index: int, gen: Generation, output: ChatOutput | None) -> None:
        self.index = index
        self.gen = gen
        self.output = output
        self.parser = output.parser if output is not None else None
        self.pieces: Iterator[str] = iter(gen)

    def events(self, text: str) -> list[Event]:
        if self.parser is None:
            return [Event("content", text)] if text else []
        return self.parser.feed(text)

    def final_events(self) -> list[Event]:
        return self.parser.finish() if self.parser is not None else []

    def piece_logprobs(self) -> tuple[TokenLogprobs, ...]:
        """The logprob entries of the piece pulled last (once per piece, in order)."""
        return self.gen.piece_logprobs()


_END = object()


class Turn:
    """One request a dialect started, its choices generating on the pool: await :meth:`result`
    (:meth:`results`: every choice's), or stream: :meth:`first` (errors before any text become an
    HTTP status), then inside ``host.streaming(*turn.gens)`` each choice's :meth:`rest` and
    :meth:`stream_result`; :meth:`failed` when an error event ends the stream, :meth:`abandon` at
    its end. :meth:`events` splits text into content, reasoning and tool calls where the request
    had tools or the model thinks (the tools path's ``AnswerParser``), else content. The methods
    without an index are the first choice's (the dialects that have one)."""

    def __init__(
        self, host: Host, request: Request, req: GenerationRequest, choices: Sequence[Choice], started: float
    ) -> None:
        self.host = host
        self.request = request
        self.req = req
        self.choices = list(choices)
        self.gen = self.choices[0].gen
        self.timings = Timings(started)  # the first choice's
        self.finished = False

    @property
    def gens(self) -> list[Generation]:
        return [c.gen for c in self.choices]

    def events(self, text: str) -> list[Event]:
        return self.choices[0].events(text)

    def final_events(self) -> list[Event]:
        return self.choices[0].final_events()

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()

    async def result(self) -> GenerationResult:
        """The first choice's whole answer (see :meth:`results`)."""
        return (await self.results())[0]

    async def results(self) -> list[GenerationResult]:
        """Every choice's whole answer, in order (each waited for watching for a disconnect:
        ClientGoneError, and a shutdown: ModelUnavailableError); any failure cancels them all."""
        results: list[GenerationResult] = []
        try:
            for choice in self.choices:
                results.append(await self.host.wait_watching(self.request, choice.gen, choice.gen.result))
                if choice.index == 0:
                    if self.timings.first_piece is None:  # when the first piece came, not when the whole did
                        self.timings.first_piece = self.gen.first_piece_at
                    self.timings.mark_done()
        except BaseException:
            self.cancel()
            raise
        self.finished = True
        return results

    async def first(self) -> str | None:
        """The first choice's first piece (None: the answer is empty), watched like
        :meth:`results`: errors before any text become a proper HTTP status."""
        pull = partial(next, self.choices[0].pieces, _END)
        try:
            piece = await self.host.wait_watching(self.request, self.gen, pull)
        except BaseException:
            self.cancel()
            raise
        self.timings.mark_first()
        return None if piece is _END else str(piece)

    async def rest(self, index: int = 0) -> AsyncIterator[str]:
        """Choice ``index``'s pieces (the first choice's after :meth:`first`)."""
        pull = partial(next, self.choices[index].pieces, _END)
        while True:
            piece = await anyio.to_thread.run_sync(
                pull, abandon_on_cancel=True, limiter=self.host.generation_limiter
            )
            if piece is _END:
                return
            yield str(piece)

    async def stream_result(self, index: int = 0) -> GenerationResult:
        """Choice ``index``'s result once its pieces are all streamed; a generation the server's
        shutdown cancelled is ModelUnavailableError (the stream's error event), never an answer."""
        gen = self.choices[index].gen
        result = await anyio.to_thread.run_sync(
            gen.result, abandon_on_cancel=True, limiter=self.host.generation_limiter
        )
        if self.host.closing and result.finish_reason == "cancelled":
            raise ModelUnavailableError(SHUTTING_DOWN)
        if index == 0:
            self.timings.mark_done()
        if index == len(self.choices) - 1:
            self.finished = True
        return result

    def failed(self) -> None:
        """An error event ends the stream: the other choices are cancelled (not counted as a
        client that went away)."""
        self.finished = True
        self.cancel()

    def abandon(self) -> None:
        """A stream ended (call in its ``finally``): when it ended early (the client left, it
        stopped reading), cancel what is still generating and count it."""
        if self.finished:
            return
        for gen in self.gens:
            if not gen.done:
                gen.cancel()
                self.host.record_cancel_later(gen)


def reported_format(status: ModelStatus) -> ChatFormat | None:
    """The chat format ``status``'s worker reported since it started (None: it has not loaded
    yet; the tools path then reads it from the model's file, as the worker will)."""
    if not status.chat_format:
        return None
    return reported(status.chat_format, status.chat_family, status.thinks, status.starts_thinking)


async def start(
    host: Host,
    request: Request,
    req: GenerationRequest,
    tools: ToolRequest | None = None,
    *,
    model_id: str | None = None,
) -> Turn:
    """Queue ``req``'s ``n`` choices on the pool with ``tools`` (validated by the tools path),
    each prepared as /v1/chat/completions prepares a chat (``chat_output.prepare_chat``: the
    template's tools, the call grammar, the answer's shaping). ``model_id``: the pool's model
    (default: ``req.model``, which must be a model's id)."""
    started = time.monotonic()
    snapshot = host.pool.snapshot()
    model_id = model_id or req.model
    status = snapshot.model(model_id)
    if status is None:
        raise unknown_model(req.model, snapshot)
    if tools is not None:
        req = dataclasses.replace(req, tools=tools)
    model = host.pool.config.model(model_id)
    if req.image_count and (model is None or not model.mmproj):
        name = model.display_name if model is not None else model_id
        raise BadRequestError(
            f"{name} does not read images: it has no vision projector (models[].mmproj); send text only, "
            "or choose a vision model.",
            "messages" if req.messages is not None else "images",
        )
    fmt = reported_format(status)
    choices: list[Choice] = []
    try:
        for i in range(req.n):
            # one preparation per choice: its output parses that choice's text as it streams
            fields, output = await host.call(prepare_chat, req, model, fmt)
            fields["sampling"] = fields["sampling"].for_choice(i)
            try:
                gen = await host.call(partial(host.pool.generate, model_id, **fields))
            except ValueError as exc:  # the pool's own argument check
                raise BadRequestError(f"{exc}.") from exc
            choices.append(Choice(i, gen, output))
    except BaseException:
        for choice in choices:
            choice.gen.cancel()
        raise
    return Turn(host, request, req, choices, started)


def decode_body(body: object, shape: type[msgspec.Struct], rules: dict[str, str], message: str) -> Any:
    """A dialect's request body as ``shape``; otherwise BadRequestError naming the field: the
    dialect's sentence for a top-level field (``rules``), for a message's field the path, what
    was wrong and ``message`` (what a message of this dialect is)."""
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    try:
        return msgspec.convert(body, shape)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = schema_error_path(exc)
        top = path.split(".")[0].split("[")[0]
        if top == "messages" and path != "messages":
            raise BadRequestError(f"{path}: {text.split(' - at ')[0]}; {message}", path) from None
        sentence = rules.get(top, f"'{path or 'body'}': {text}; see docs/API.md.")
        raise BadRequestError(sentence, top or None) from None
