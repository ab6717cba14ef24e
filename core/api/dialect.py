"""What the Ollama and Anthropic dialects share: one generation on the pool, from the dialect's
translated :class:`GenerationRequest` to its answer as events (content, reasoning, tool calls)
and real timings. Each dialect (``ollama``, ``anthropic``) only translates its JSON to a
GenerationRequest and these events back to its JSON; the pool, the sampler, the tools path
(``tools``, ``core/chatformat``), structured output (``structured``) and the guards are the
OpenAI surface's own.

The handlers object of ``handlers.create_app`` is the :class:`Host`: it runs blocking pool calls
off the event loop, watches for a client that goes away (its generation is cancelled) and for
the server shutting down (503).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread
import msgspec
from starlette.requests import Request

from ..chatformat.parse import AnswerParser, Event
from ..config.schema import ModelConfig
from ..errors import UnknownModelError
from ..pool.generation import Generation, GenerationResult
from ..pool.supervisor import Pool
from ..state import ModelStatus, PoolSnapshot
from .chat_output import prepare_chat
from .errors import BadRequestError
from .requests import GenerationRequest
from .shapes import schema_error_path
from .tools import ToolRequest

T = TypeVar("T")


class Host(Protocol):
    """What a dialect needs of the API's handlers (``handlers._Handlers`` is one)."""

    pool: Pool
    closing: bool
    config_path: Path | None  # the config file (None: the user's)
    generation_limiter: anyio.CapacityLimiter

    async def call(self, func: Callable[..., T], *args: Any) -> T: ...

    async def wait_watching(self, request: Request, gen: Generation, func: Callable[[], T]) -> T: ...

    def record_cancel_later(self, gen: Generation) -> None: ...

    def streaming(self, gen: Generation) -> contextlib.AbstractContextManager[None]: ...


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


class Turn:
    """One generation a dialect started: iterate :meth:`pieces` (streaming) or await
    :meth:`result`; :meth:`events` splits text into content, reasoning and tool calls where the
    request had tools or the model thinks (the tools path's ``AnswerParser``), else content."""

    def __init__(
        self,
        host: Host,
        request: Request,
        req: GenerationRequest,
        gen: Generation,
        parser: AnswerParser | None,
        started: float,
    ) -> None:
        self.host = host
        self.request = request
        self.req = req
        self.gen = gen
        self.parser = parser
        self.timings = Timings(started)
        self.finished = False
        self._pieces: Iterator[str] = iter(gen)

    def events(self, text: str) -> list[Event]:
        if self.parser is None:
            return [Event("content", text)] if text else []
        return self.parser.feed(text)

    def final_events(self) -> list[Event]:
        return self.parser.finish() if self.parser is not None else []

    async def result(self) -> GenerationResult:
        """The whole answer (waits watching for a disconnect; raises ClientGoneError then)."""
        try:
            result = await self.host.wait_watching(self.request, self.gen, self.gen.result)
        except BaseException:
            self.gen.cancel()
            raise
        if self.timings.first_piece is None:  # when the first piece came, not when the whole did
            self.timings.first_piece = self.gen.first_piece_at
        self.timings.mark_done()
        self.finished = True
        return result

    async def first(self) -> str | None:
        """The first piece (None: the answer is empty), watched like :meth:`result`: errors before
        any text become a proper HTTP status."""
        end = object()

        def pull() -> object:
            return next(self._pieces, end)

        try:
            piece = await self.host.wait_watching(self.request, self.gen, pull)
        except BaseException:
            self.gen.cancel()
            raise
        self.timings.mark_first()
        return None if piece is end else str(piece)

    async def rest(self) -> AsyncIterator[str]:
        """The pieces after :meth:`first`, then ``finished`` (call inside ``host.streaming``)."""
        end = object()

        def pull() -> object:
            return next(self._pieces, end)

        while True:
            piece = await anyio.to_thread.run_sync(
                pull, abandon_on_cancel=True, limiter=self.host.generation_limiter
            )
            if piece is end:
                return
            yield str(piece)

    async def stream_result(self) -> GenerationResult:
        result = await anyio.to_thread.run_sync(
            self.gen.result, abandon_on_cancel=True, limiter=self.host.generation_limiter
        )
        self.timings.mark_done()
        self.finished = True
        return result

    def abandon(self) -> None:
        """A stream ended early (the client left, an error): cancel the generation and count it."""
        if not self.finished:
            self.gen.cancel()
            self.host.record_cancel_later(self.gen)


async def start(
    host: Host, request: Request, req: GenerationRequest, tools: ToolRequest | None = None
) -> Turn:
    """Queue ``req`` on the pool with ``tools`` (validated by the tools path), prepared as
    /v1/chat/completions prepares a chat (``chat_output.prepare_chat``: the template's tools, the
    call grammar, the answer's parser)."""
    started = time.monotonic()
    snapshot = host.pool.snapshot()
    if snapshot.model(req.model) is None:
        raise unknown_model(req.model, snapshot)
    if tools is not None:
        req = dataclasses.replace(req, tools=tools)
    model = host.pool.config.model(req.model)
    fields, output = await host.call(prepare_chat, req, model)
    try:
        gen = await host.call(partial(host.pool.generate, req.model, **fields))
    except ValueError as exc:  # the pool's own argument check
        raise BadRequestError(f"{exc}.") from exc
    parser = None
    if output is not None:
        fmt = output.plan.fmt
        parser = AnswerParser(
            fmt.family, tools=output.plan.parses_calls, thinks=fmt.thinks, starts_thinking=fmt.starts_thinking
        )
    return Turn(host, request, req, gen, parser, started)


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
