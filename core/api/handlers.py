"""The Starlette app: routes, handlers, and the JSON the API answers with (the guard and the key
check in front of them are ``middleware``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .. import paths
from ..config.files import load_config
from ..config.schema import ApiConfig, Config, ModelConfig
from ..errors import ConfigError, InvalidInputError, ModelUnavailableError, TimeshareError
from ..modelnames import resolve_api_model
from ..pool.generation import Generation, GenerationResult
from ..pool.supervisor import Pool
from ..state import USER_SLEEP_LEVEL, EventKind, PoolEvent, PoolSnapshot, SwitchStats, parse_release_level
from ..wire.protocol import TokenLogprobs, Usage
from . import anthropic, ollama, ollama_models, responses, shapes
from .chat_output import ChatOutput
from .dialect import Choice, Turn, listing, start, unknown_model
from .embeddings import embedding_response, parse_embedding_request
from .errors import (
    BadRequestError,
    ClientGoneError,
    error_body,
    error_response,
    timeshare_error_response,
    timeshare_error_status,
)
from .extras import plain, switch_extras
from .images import fetch_url
from .logprobs import CompletionOffsets, chat_logprobs, completion_logprobs
from .middleware import HEALTH_PATH, SHUTTING_DOWN, AuthMiddleware, GuardMiddleware
from .model_files import Files
from .requests import (
    GenerationRequest,
    T,
    parse_chat_request,
    parse_completion_request,
    parse_json,
    read_body,
    read_json,
)
from .rerank import RERANK_PATHS, parse_rerank_request, rerank_response
from .response_store import ResponseStore

log = logging.getLogger(__name__)


# ---- serialisation -----------------------------------------------------------------------------


@dataclass
class _Tally:
    requests: int = 0
    switches: int = 0
    wait_ms: float = 0.0
    restore_ms: float = 0.0
    release_ms: float = 0.0
    last: SwitchStats | None = None


class SwitchCounter:
    """Per-model switch statistics, fed by the pool's REQUEST_DONE events (every generation, whoever sent it).

    The pool's event thread is the only writer; readers take a copy under the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tallies: dict[str, _Tally] = {}
        self.cancelled_by_disconnect = 0
        self.cancelled_finish_reasons: list[str] = []

    def on_event(self, event: PoolEvent) -> None:
        if event.kind is not EventKind.REQUEST_DONE or event.model is None:
            return
        with self._lock:
            tally = self._tallies.setdefault(event.model, _Tally())
            tally.requests += 1
            switch = event.switch
            if switch is not None and switch.switched:
                tally.switches += 1
                tally.wait_ms += switch.wait_ms
                tally.restore_ms += switch.restore_ms
                tally.release_ms += switch.release_ms
            if switch is not None:
                tally.last = switch

    def record_disconnect(self, finish_reason: str) -> None:
        with self._lock:
            self.cancelled_by_disconnect += 1
            self.cancelled_finish_reasons.append(finish_reason)
            del self.cancelled_finish_reasons[:-20]

    def as_json(self) -> dict[str, Any]:
        with self._lock:
            per_model = {}
            for model, t in self._tallies.items():
                n = t.switches or 1
                per_model[model] = {
                    "requests": t.requests,
                    "switches": t.switches,
                    "mean_wait_ms": t.wait_ms / n if t.switches else 0.0,
                    "mean_restore_ms": t.restore_ms / n if t.switches else 0.0,
                    "mean_release_ms": t.release_ms / n if t.switches else 0.0,
                    "last": plain(t.last),
                }
            return {
                "per_model": per_model,
                "cancelled_by_disconnect": self.cancelled_by_disconnect,
                "recent_cancel_finish_reasons": list(self.cancelled_finish_reasons),
            }


def status_json(
    snapshot: PoolSnapshot, counter: SwitchCounter, served: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "served": served or {},  # which dialects, where (the server fills it in)
        "object": "timeshare.status",
        "holder": snapshot.holder,
        "switching": snapshot.switching,
        "devices": [plain(d) for d in snapshot.devices],
        "models": [plain(m) for m in snapshot.models],
        "switch_stats": counter.as_json(),
    }


def capabilities(model: ModelConfig | None, pooling: str = "") -> list[str]:
    """What a model answers (as llama-swap and LM Studio list it): a reranker (``pooling`` "rank",
    as its worker reported or, before it has loaded, its GGUF's header: ``Files.pooling``)
    reranks only; an embedding model embeds only; a chat model chats, completes, calls tools (its
    template's syntax, or the generic JSON format for templates without one) and embeds (mean
    pooling)."""
    if pooling == "rank":
        return ["rerank"]
    if model is not None and model.embedding:
        return ["embedding"]
    found = ["chat", "completion", "tools", "embedding"]
    if model is not None and model.mmproj:
        found.append("vision")  # it reads images (a vision projector, models[].mmproj)
    return found


def model_json(
    status: Any, created: int, model: ModelConfig | None = None, pooling: str = ""
) -> dict[str, Any]:
    """/v1/models' entry of a model; ``pooling``: its pooling (``Files.pooling``)."""
    return {
        "id": status.id,
        "object": "model",
        "created": created,
        "owned_by": "timeshare",
        "capabilities": capabilities(model, pooling),
        "timeshare": {
            "name": status.name,
            "state": plain(status.state),
            "pinned": status.pinned,
            "chat_format": status.chat_format,
            "licence": status.licence,
            "n_ctx": status.n_ctx,
            "reason": status.reason,
        },
    }


# ---- the app -----------------------------------------------------------------------------------


class _Handlers:
    def __init__(
        self, pool: Pool, api_config: ApiConfig, counter: SwitchCounter, config_path: Path | None = None
    ) -> None:
        self.pool = pool
        self.config_path = config_path  # the config file the dialects' model routes edit
        self.files = Files()  # the GGUF headers the listings read (the Ollama routes' too)
        self.served: dict[str, Any] = {}  # which dialects are served where (ApiServer fills it)
        self.api_config = api_config
        self.counter = counter
        self.created = int(time.time())
        # shutting down: new requests get 503, waiting ones a 503 too, streams an error event
        self.closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: asyncio.Event | None = None
        self._streams: set[Generation] = set()
        # waiting for pieces of many queued generations must not starve the control endpoints,
        # which use anyio's default limiter
        self.generation_limiter = anyio.CapacityLimiter(max(256, 8 * api_config.queue_limit))

    # -- shutting down --

    def begin_shutdown(self) -> None:
        """From any thread: answer what waits with 503 and end the streams with an error event."""
        self.closing = True
        loop, closed = self._loop, self._closed
        if loop is not None and closed is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(closed.set)
        for gen in list(self._streams):
            gen.cancel()

    def closed_event(self) -> asyncio.Event:
        """Set once shutting down (created in the server's loop on first use)."""
        if self._closed is None:
            self._loop = asyncio.get_running_loop()
            self._closed = asyncio.Event()
            if self.closing:  # begin_shutdown ran before there was an event to set
                self._closed.set()
        return self._closed

    # -- blocking calls off the loop --

    async def call(self, func: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(partial(func, *args))

    async def wait_watching(self, request: Request, gen: Generation, func: Callable[[], T]) -> T:
        """Run ``func`` on a thread; on a client disconnect meanwhile, cancel ``gen`` and raise
        ClientGoneError; when the server shuts down meanwhile, cancel it and raise
        ModelUnavailableError (a 503)."""
        gone = False
        shut = False
        box: list[T] = []
        failure: Exception | None = None
        closed = self.closed_event()
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal gone
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        gone = True
                        gen.cancel()
                        tg.cancel_scope.cancel()
                        return

            async def watch_shutdown() -> None:
                nonlocal shut
                await closed.wait()
                shut = True
                gen.cancel()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(watch_shutdown)
            try:
                box.append(
                    await anyio.to_thread.run_sync(
                        func, abandon_on_cancel=True, limiter=self.generation_limiter
                    )
                )
            except Exception as exc:  # raised after the group, unwrapped (anyio would group it)
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if shut and not box:
            raise ModelUnavailableError(SHUTTING_DOWN)
        if gone or not box:
            self.record_cancel_later(gen)
            raise ClientGoneError
        return box[0]

    @contextlib.contextmanager
    def streaming(self, *gens: Generation) -> Iterator[None]:
        """While a stream of ``gens`` is being sent: a shutdown ends it (cancelled, an error event)."""
        self._streams.update(gens)
        if self.closing:
            for gen in gens:
                gen.cancel()
        try:
            yield
        finally:
            self._streams.difference_update(gens)

    def record_cancel_later(self, gen: Generation) -> None:
        """Count a disconnect and note how the cancelled generation ended (for the status page)."""

        def wait() -> None:
            try:
                reason = gen.result(timeout=60.0).finish_reason
            except TimeshareError as exc:
                reason = exc.code
            except Exception as exc:  # a log line, never a crash of the API thread
                reason = type(exc).__name__
            self.counter.record_disconnect(reason)
            log.info("client disconnected; its generation ended with %s", reason)

        threading.Thread(target=wait, name="timeshare-api-cancel", daemon=True).start()

    # -- OpenAI endpoints --

    async def list_models(self, request: Request) -> Response:
        listed = listing(self.pool)
        # a model not loaded yet: its GGUF's header (read once per file version) says its pooling
        data = await anyio.to_thread.run_sync(
            lambda: [model_json(m, self.created, config, self.files.pooling(m)) for m, config in listed]
        )
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        snapshot = self.pool.snapshot()
        model_id = resolve_model(snapshot, request.path_params["model_id"])
        status = next(m for m in snapshot.models if m.id == model_id)
        pooling = await anyio.to_thread.run_sync(self.files.pooling, status)
        return JSONResponse(model_json(status, self.created, self.pool.config.model(model_id), pooling))

    async def embeddings(self, request: Request) -> Response:
        req = parse_embedding_request(await read_json(request))
        model_id = resolve_model(self.pool.snapshot(), req.model)
        try:
            gen = await self.call(partial(self.pool.embed, model_id, req.inputs))
        except ValueError as exc:  # the pool's own argument check
            raise BadRequestError(f"{exc}.") from exc
        try:
            result = await self.wait_watching(request, gen, gen.result)
        except ClientGoneError:
            return Response(status_code=499)
        except BaseException:
            gen.cancel()
            raise
        if result.finish_reason == "cancelled":
            raise ModelUnavailableError(
                SHUTTING_DOWN if self.closing else f"{model_id}: the request was cancelled"
            )
        body = await anyio.to_thread.run_sync(
            embedding_response, req, result.embeddings, result.usage.prompt_tokens
        )
        return JSONResponse(body)

    async def rerank(self, request: Request) -> Response:
        req = parse_rerank_request(await read_json(request))
        snapshot = self.pool.snapshot()
        model_id = resolve_model(snapshot, req.model)
        await self.call(self._check_reranker, model_id)
        try:
            gen = await self.call(partial(self.pool.rerank, model_id, req.query, req.documents))
        except ValueError as exc:  # the pool's own argument check
            raise BadRequestError(f"{exc}.") from exc
        try:
            result = await self.wait_watching(request, gen, gen.result)
        except ClientGoneError:
            return Response(status_code=499)
        except InvalidInputError as exc:  # the worker's word: the model is no reranker
            raise BadRequestError(str(exc), "model") from None
        except BaseException:
            gen.cancel()
            raise
        if result.finish_reason == "cancelled":
            raise ModelUnavailableError(
                SHUTTING_DOWN if self.closing else f"{model_id}: the request was cancelled"
            )
        return JSONResponse(rerank_response(req, result.embeddings, result.usage.prompt_tokens))

    def _check_reranker(self, model_id: str) -> None:
        """400 naming the model when it is not a reranker: as its worker reported (its pooling),
        or, before it has loaded, as its GGUF's header says (read once while the file is
        unchanged: the listings' cache; the worker refuses it too)."""
        status = self.pool.snapshot().model(model_id)
        pooling = status.pooling if status is not None else ""
        if not (status is not None and status.chat_format):  # not loaded: the file says
            config = self.pool.config.model(model_id)
            try:
                pooling = self.files.header(config.path).pooling if config is not None else "rank"
            except (OSError, TimeshareError):
                return  # the worker says what is wrong with the file
        if pooling != "rank":
            name = status.name if status is not None and status.name else model_id
            raise BadRequestError(
                f"The model {name!r} is not a reranker: /v1/rerank needs a model whose GGUF pools by "
                "rank (a cross-encoder such as bge-reranker or Qwen3-Reranker).",
                "model",
            )

    async def chat_completions(self, request: Request) -> Response:
        # parsed on a thread: building a response_format grammar is bounded, not free (issue 38)
        fetch = fetch_url if self.api_config.fetch_image_urls else None  # http(s) image URLs
        body = await read_json(request)
        return await self.generate(request, await self.call(parse_chat_request, body, fetch))

    async def completions(self, request: Request) -> Response:
        return await self.generate(
            request, await self.call(parse_completion_request, await read_json(request))
        )

    async def generate(self, request: Request, req: GenerationRequest) -> Response:
        model_id = resolve_model(self.pool.snapshot(), req.model)
        # the turn pipeline (dialect.start): n choices, each with its own shaping of the answer
        # (chat_output: the template's tools, the grammar, tool calls and reasoning)
        turn = await start(self, request, req, model_id=model_id)
        try:
            if req.stream:
                return await self.stream(turn)
            results = await turn.results()
        except ClientGoneError:
            return Response(status_code=499)
        return self.full_response(req, results, [c.output for c in turn.choices])

    def _logprobs(
        self,
        req: GenerationRequest,
        entries: Sequence[TokenLogprobs],
        offsets: CompletionOffsets | None = None,
        *,
        echoed: bool = False,
    ) -> dict[str, Any] | None:
        """The logprobs of ``entries`` in the request's shape (None: not asked for); ``echoed``:
        they begin with an echoed prompt (its first token's logprob is null)."""
        if not req.logprobs:
            return None
        if req.kind == "chat":
            return chat_logprobs(entries)
        return completion_logprobs(entries, offsets, null_first=echoed)

    def full_response(
        self,
        req: GenerationRequest,
        results: Sequence[GenerationResult],
        outputs: Sequence[ChatOutput | None] = (),
    ) -> Response:
        first = results[0]
        usage = usage_out(_choices_usage(results))
        extras = switch_extras(
            first.switch,
            first.usage.prompt_tokens_evaluated,
            max(r.batch_size for r in results),
            first.timings,
        )
        shape: shapes.ChatCompletion | shapes.TextCompletion
        if req.kind == "chat":
            choices = []
            for i, r in enumerate(results):
                finish = _finish_reason(r.finish_reason)
                message = shapes.AssistantMessage("assistant", r.text)
                output = outputs[i] if i < len(outputs) else None
                if output is not None:
                    message = msgspec.convert(output.message(r.text), shapes.AssistantMessage)
                    finish = output.finish_reason(finish)
                choices.append(shapes.ChatChoice(i, message, self._logprobs(req, r.logprobs), finish))
            shape = shapes.ChatCompletion(
                id=_new_id("chatcmpl"),
                object="chat.completion",
                created=int(time.time()),
                model=req.model,
                system_fingerprint=None,
                choices=choices,
                usage=usage,
                timeshare=extras,
            )
        else:
            shape = shapes.TextCompletion(
                id=_new_id("cmpl"),
                object="text_completion",
                created=int(time.time()),
                model=req.model,
                system_fingerprint=None,
                choices=[
                    shapes.TextChoice(
                        i,
                        _echoed(req, r.prompt_logprobs) + r.text if req.echo else r.text,
                        self._logprobs(
                            req,
                            (*r.prompt_logprobs, *r.logprobs) if req.echo else r.logprobs,
                            echoed=req.echo,
                        ),
                        _finish_reason(r.finish_reason),
                    )
                    for i, r in enumerate(results)
                ],
                usage=usage,
                timeshare=extras,
            )
        return Response(shapes.encode(shape), media_type="application/json")

    async def stream(self, turn: Turn) -> Response:
        """The choices' chunks, one choice after the other (each chunk names its choice's index,
        so clients assemble them; the generations themselves run as the pool schedules them)."""
        req = turn.req
        # Wait for the first piece before answering, so that errors that come before any text
        # (prompt too long, GPU busy, model crashed) get a proper HTTP status instead of a 200 stream.
        first = await turn.first()
        chunk_id = _new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        created = int(time.time())

        def chunk(
            index: int,
            text: str | None,
            finish: str | None,
            role: bool = False,
            *,
            logprobs: dict[str, Any] | None = None,
            usage: shapes.UsageOut | None = None,
            extras: dict[str, Any] | None = None,
            delta: shapes.Delta | None = None,
        ) -> dict[str, str]:
            choices: list[shapes.DeltaChoice] | list[shapes.TextChoice]
            if usage is not None:
                choices = []
            elif req.kind == "chat":
                delta = delta or shapes.Delta("assistant" if role else None, text)
                choices = [shapes.DeltaChoice(index, delta, logprobs, finish)]
            else:
                choices = [shapes.TextChoice(index, text or "", logprobs, finish)]
            shape = shapes.Chunk(
                id=chunk_id,
                object="chat.completion.chunk" if req.kind == "chat" else "text_completion",
                created=created,
                model=req.model,
                system_fingerprint=None,
                choices=choices,
                usage=usage,
                timeshare=extras,
            )
            return {"data": shapes.encode(shape).decode()}

        def piece_chunks(choice: Choice, piece: str, offsets: CompletionOffsets) -> Iterator[dict[str, str]]:
            i, output = choice.index, choice.output
            logprobs = self._logprobs(req, choice.piece_logprobs(), offsets)
            if output is None:
                yield chunk(i, piece, None, logprobs=logprobs)
                return
            # tool calls, reasoning: shaped deltas
            deltas = output.deltas(choice.events(piece))
            for k, delta in enumerate(deltas):
                converted = msgspec.convert(delta, shapes.Delta)
                yield chunk(i, None, None, delta=converted, logprobs=logprobs if k == 0 else None)
            if not deltas and logprobs is not None:
                yield chunk(i, None, None, logprobs=logprobs)

        def echo_chunk(choice: Choice, offsets: CompletionOffsets) -> dict[str, str]:
            """``echo``: the prompt, as the choice's first chunk (its tokens' logprobs are all in
            once the choice's first piece has come, or it has ended: they precede any text)."""
            entries = choice.gen.prompt_logprobs()
            return chunk(
                choice.index,
                _echoed(req, entries),
                None,
                logprobs=self._logprobs(req, entries, offsets, echoed=True),
            )

        async def events() -> AsyncIterator[dict[str, str]]:
            with self.streaming(*turn.gens):
                results: list[GenerationResult] = []
                try:
                    for choice in turn.choices:
                        i, output = choice.index, choice.output
                        offsets = CompletionOffsets()
                        echo = req.echo  # the prompt is still to be sent
                        if req.kind == "chat":
                            yield chunk(i, "", None, role=True)
                        if i == 0 and echo:
                            yield echo_chunk(choice, offsets)
                            echo = False
                        if i == 0 and first:
                            for item in piece_chunks(choice, first, offsets):
                                yield item
                        if i > 0 or first is not None:
                            async for piece in turn.rest(i):
                                if echo:
                                    yield echo_chunk(choice, offsets)
                                    echo = False
                                for item in piece_chunks(choice, piece, offsets):
                                    yield item
                        result = await turn.stream_result(i)
                        if echo:
                            yield echo_chunk(choice, offsets)
                        results.append(result)
                        extras = switch_extras(
                            result.switch,
                            result.usage.prompt_tokens_evaluated,
                            result.batch_size,
                            result.timings,
                        )
                        finish = _finish_reason(result.finish_reason)
                        if output is not None:
                            for delta in output.deltas(choice.final_events()):
                                yield chunk(i, None, None, delta=msgspec.convert(delta, shapes.Delta))
                            finish = output.finish_reason(finish)
                        yield chunk(i, None if req.kind == "chat" else "", finish, extras=extras)
                    if req.include_usage:
                        yield chunk(0, None, None, usage=usage_out(_choices_usage(results)))
                    yield {"data": "[DONE]"}
                except TimeshareError as exc:
                    # the status line has gone out already: report the error in the stream, OpenAI-style
                    turn.failed()
                    log.warning("generation on %s failed mid-stream: %s", req.model, exc)
                    yield {"data": json.dumps(error_body(str(exc), timeshare_error_status(exc), exc.code))}
                finally:
                    turn.abandon()

        return StreamResponse(events(), ping=15, send_timeout=SSE_WRITE_TIMEOUT_S)

    def sse(self, events: AsyncIterator[dict[str, str]]) -> Response:
        """The API's server-sent events (a client that stops reading is given up on)."""
        return StreamResponse(events, ping=15, send_timeout=SSE_WRITE_TIMEOUT_S)

    # -- Timeshare endpoints --

    async def status(self, request: Request) -> Response:
        snapshot = self.pool.snapshot()
        return JSONResponse(status_json(snapshot, self.counter, self.served))

    async def model_command(self, request: Request) -> Response:
        command = request.path_params["command"]
        model_id = resolve_model(self.pool.snapshot(), request.path_params["model_id"])
        if command == "pin":
            await self.call(self.pool.pin, model_id, True)
        elif command == "unpin":
            await self.call(self.pool.pin, model_id, False)
        elif command == "wake":
            await self.call(self.pool.wake, model_id)
        elif command == "start":
            # a FAILED or STOPPED model, with a fresh restart budget (503 when it fails at once)
            await self.call(self.pool.start_model, model_id)
        elif command == "sleep":
            level: object = USER_SLEEP_LEVEL
            data = await read_body(request)
            if data:
                body = await anyio.to_thread.run_sync(parse_json, data)
                level = body.get("level", level) if isinstance(body, dict) else None
            try:
                release = parse_release_level(level)
            except ValueError as e:
                raise BadRequestError(str(e), "level") from None
            await self.call(partial(self.pool.sleep, model_id, level=release))
        else:
            raise HTTPException(404)
        snapshot = self.pool.snapshot()
        status = snapshot.model(model_id)
        return JSONResponse({"ok": True, "command": command, "model": plain(status)})


#: a streaming client that takes longer than this to accept one event (it stopped reading, its
#: buffers are full) is given up on: its generation is cancelled and the connection closes
SSE_WRITE_TIMEOUT_S = 30.0


class StreamResponse(EventSourceResponse):
    """The API's server-sent events: a send that waits longer than ``send_timeout`` ends the
    stream; the events' own cleanup then cancels the generation (as a disconnect does)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            log.warning(
                "a streaming client read nothing for %g s: its generation is cancelled", self.send_timeout
            )


def _choices_usage(results: Sequence[GenerationResult]) -> Usage:
    """The usage of n choices: the prompt once (as OpenAI counts it), every choice's tokens."""
    first = results[0].usage
    completion = sum(r.usage.completion_tokens for r in results)
    return Usage(first.prompt_tokens, completion, first.prompt_tokens_evaluated)


def usage_out(usage: Usage) -> shapes.UsageOut:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens
    the KV cache already held (not evaluated again)."""
    cached = max(0, usage.prompt_tokens - usage.prompt_tokens_evaluated)
    return shapes.UsageOut(
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.prompt_tokens + usage.completion_tokens,
        shapes.PromptTokensDetails(cached),
    )


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


#: how a complete answer ends: an end-of-generation token or a stop string, max_tokens or the end
#: of the context, a finished tool call
COMPLETE_FINISH_REASONS = ("stop", "length", "tool_calls", "function_call")


def _finish_reason(reason: str) -> str:
    """The finish_reason of a complete answer. An answer that ended any other way ("cancelled",
    which the pool reports only to the caller that cancelled it) is never passed off as finished:
    ModelUnavailableError (503, or the stream's error event)."""
    if reason in COMPLETE_FINISH_REASONS:
        return reason
    raise ModelUnavailableError(f"the answer ended before it was complete ({reason}); send the request again")


def _echoed(req: GenerationRequest, entries: Sequence[TokenLogprobs]) -> str:
    """The prompt an ``echo`` returns: as sent, or a token-array prompt's tokens as text (their
    pieces, which come with the prompt's entries)."""
    if req.prompt is not None:
        return req.prompt
    return b"".join(e.piece for e in entries).decode("utf-8", errors="replace")


def resolve_model(snapshot: PoolSnapshot, name: str) -> str:
    """The id of the model ``name`` names (its id or display name, any case: modelnames'
    API rule), else UnknownModelError naming the ids."""
    model_id = resolve_api_model(snapshot.models, name)
    if model_id is None:
        raise unknown_model(name, snapshot)
    return model_id


async def _on_bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequestError)
    return error_response(exc.message, exc.status, exc.code, exc.param, path=request.url.path)


async def _on_timeshare_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, TimeshareError)
    if timeshare_error_status(exc) >= 500:
        log.warning("%s %s failed: %s", request.method, request.url.path, exc)
    return timeshare_error_response(exc, path=request.url.path)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = (
            f"There is no endpoint {request.method} {request.url.path}; see GET /v1/models and docs/API.md."
        )
        return error_response(message, 404, "unknown_url", path=request.url.path)
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}."
        return error_response(message, 405, "method_not_allowed", path=request.url.path)
    return error_response(str(exc.detail), exc.status_code, None, path=request.url.path)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("%s %s crashed", request.method, request.url.path, exc_info=exc)
    return error_response(
        f"Internal error in Timeshare ({type(exc).__name__}: {exc}); see its log.",
        500,
        "internal",
        path=request.url.path,
    )


#: ``GET /health`` (answered without a key) names its server in this header: it tells a Timeshare apart
HEALTH_HEADER = "x-served-by"


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"}, headers={HEALTH_HEADER: "timeshare"})


#: ``POST /timeshare/v1/reload``: re-reads the config file and applies it; returns (the file, its config)
ConfigReloader = Callable[[], "tuple[Path, Config]"]


def reload_config(pool: Pool, config_path: Path | None = None) -> tuple[Path, Config]:
    """Re-read the config file (default: the user's) and apply it to ``pool`` (models added,
    removed, restarted as ``Pool.apply_config`` does). Model files are not checked here: a missing
    one makes that model FAILED while the others serve. Raises ConfigError for a bad file."""
    path = config_path or paths.config_file()
    config = load_config(path, check_paths=False)
    pool.apply_config(config)
    return path, config


async def _reload(reloader: ConfigReloader) -> Response:
    try:
        path, config = await anyio.to_thread.run_sync(reloader)
    except ConfigError as exc:
        raise BadRequestError(str(exc), code=exc.code) from exc
    return JSONResponse({"ok": True, "config": str(path), "models": [m.id for m in config.models]})


def create_app(
    pool: Pool,
    api_config: ApiConfig,
    *,
    reload: ConfigReloader | None = None,
    config_path: Path | None = None,
) -> Starlette:
    """The Starlette app over ``pool``. ``app.state.unsubscribe()`` detaches its switch counter.
    ``reload`` serves ``POST /timeshare/v1/reload`` (default: :func:`reload_config` of the user's file);
    ``config_path``: the file Ollama's pull and delete edit (default: the user's)."""
    counter = SwitchCounter()
    handlers = _Handlers(pool, api_config, counter, config_path)
    reloader: ConfigReloader = reload or partial(reload_config, pool, None)

    async def reload_endpoint(request: Request) -> Response:
        return await _reload(reloader)

    routes = [
        Route(HEALTH_PATH, _health, methods=["GET"]),
        Route("/v1/models", handlers.list_models, methods=["GET"]),
        Route("/v1/models/{model_id}", handlers.get_model, methods=["GET"]),
        Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/v1/embeddings", handlers.embeddings, methods=["POST"]),
        # llama-server's four routes (Jina's shape; TEI's with ``texts``)
        *(Route(path, handlers.rerank, methods=["POST"]) for path in RERANK_PATHS),
        Route("/timeshare/v1/status", handlers.status, methods=["GET"]),
        Route("/timeshare/v1/models/{model_id}/{command}", handlers.model_command, methods=["POST"]),
        Route("/timeshare/v1/reload", reload_endpoint, methods=["POST"]),
    ]
    # the other dialects, thin translations onto the same handlers
    routes += anthropic.routes(handlers) + ollama.routes(handlers) + ollama_models.routes(handlers)
    # the Responses API keeps what it answered (store: true) in the data dir, within the bounds
    # (a chain's KV files go with its last stored response)
    store = ResponseStore(
        keep=api_config.responses_kept, days=api_config.responses_days, forget=pool.forget_conversation
    )
    routes += responses.routes(
        handlers, store, handlers.sse, lambda: fetch_url if handlers.api_config.fetch_image_urls else None
    )
    exception_handlers: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        BadRequestError: _on_bad_request,
        TimeshareError: _on_timeshare_error,
        HTTPException: _on_http_exception,
        Exception: _on_unexpected,
    }
    app = Starlette(routes=routes, exception_handlers=exception_handlers)
    app.add_middleware(AuthMiddleware, key=api_config.key)
    # outermost (added last): a CORS preflight carries no key, and a refused Host or Origin gets
    # no further than this
    app.add_middleware(GuardMiddleware, api_config=api_config, closing=lambda: handlers.closing)
    app.state.begin_shutdown = handlers.begin_shutdown
    app.state.counter = counter
    app.state.responses = store
    app.state.served = handlers.served
    app.state.unsubscribe = pool.subscribe(counter.on_event)
    return app
