"""The local OpenAI-compatible HTTP API over the pool (Starlette + uvicorn + sse-starlette).

Endpoints (see docs/API.md):

- ``GET /v1/models``, ``GET /v1/models/{id}``
- ``POST /v1/chat/completions``, ``POST /v1/completions`` (``"stream": true`` answers with SSE and
  ends with ``data: [DONE]``), routed to a model by the ``model`` field
- ``GET /timeshare/v1/status``: the GPU holder, every model's state, switch statistics
- ``POST /timeshare/v1/models/{id}/pin|unpin|sleep|wake``

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. The server binds to
loopback by default; with ``api.key`` set every request needs ``Authorization: Bearer <key>``, and
a non-loopback bind is refused unless a key is set.

Blocking pool calls run on worker threads (anyio), never on the event loop. A client that goes away
cancels its generation: the SSE response notices it (sse-starlette listens for the disconnect), and
the non-streaming path watches the ASGI ``receive`` channel while it waits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import uvicorn
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from . import paths
from .config import ApiConfig, Config, is_loopback
from .errors import (
    ArenaError,
    ConfigError,
    ModelUnavailableError,
    PromptTooLongError,
    QueueFullError,
    TimeshareError,
    TokenTimeoutError,
    UnknownModelError,
)
from .pool import Generation, GenerationResult, Pool
from .protocol import ChatMessage, Usage
from .state import EventKind, PoolEvent, PoolSnapshot, SwitchStats

log = logging.getLogger(__name__)

#: request bodies above this are refused with 413 before they are parsed
MAX_BODY_BYTES = 8 * 1024 * 1024
#: OpenAI's default for /v1/completions
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: OpenAI lets chat run to the end of the context; a local default keeps a runaway answer bounded
DEFAULT_CHAT_MAX_TOKENS = 512

T = TypeVar("T")


# ---- errors ------------------------------------------------------------------------------------


class ApiBindError(TimeshareError):
    """The API could not listen on the configured address."""

    code = "api_bind"


class BadRequest(Exception):
    """A request the API refuses before it reaches the pool (HTTP 400 unless ``status`` says)."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "invalid_request", status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class _ClientGone(Exception):
    """The client disconnected while its request waited; its generation was cancelled."""


_STATUS_BY_CODE = {
    UnknownModelError.code: 404,
    PromptTooLongError.code: 400,
    QueueFullError.code: 429,
    ModelUnavailableError.code: 503,
    TokenTimeoutError.code: 503,
}
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def error_body(message: str, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPE_BY_STATUS.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(message: str, status: int, code: str | None, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(message, status, code, param), status_code=status, headers=headers)


def timeshare_error_status(exc: TimeshareError) -> int:
    return _STATUS_BY_CODE.get(exc.code, 500)


def timeshare_error_response(exc: TimeshareError, param: str | None = None) -> JSONResponse:
    if param is None and isinstance(exc, UnknownModelError):
        param = "model"
    return error_response(str(exc), timeshare_error_status(exc), exc.code, param)


# ---- request parsing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /v1/chat/completions or /v1/completions request."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    conversation: str | None

    def pool_fields(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "conversation": self.conversation,
        }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= float(value) <= high:
        raise BadRequest(f"'{name}' must be a number from {low:g} to {high:g}; got {value!r}.", name)
    return float(value)


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise BadRequest(f"'{name}' must be a whole number of at least 1; got {value!r}.", name)
    return int(value)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest(
            f"'n' = {n!r} is not supported: Timeshare generates one choice per request. "
            "Leave 'n' out (or set it to 1) and send separate requests for more answers.",
            "n",
        )
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise BadRequest("'best_of' other than 1 is not supported; leave it out.", "best_of")
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise BadRequest(
                f"'{name}' is not supported: Timeshare's local models answer with text only.", name
            )
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("'logprobs' is not supported; leave it out.", "logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequest(f"'{name}' is not supported; leave it out or set it to 0.", name)
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported; leave it out.", "logit_bias")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type", "text") != "text"
    ):
        raise BadRequest(
            '\'response_format\' other than {"type": "text"} is not supported; leave it out.',
            "response_format",
        )


def _common(body: Mapping[str, Any], kind: str, default_max_tokens: int) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: the id of a model from GET /v1/models.", "model")
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object.", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    max_tokens = _positive_int(body, "max_tokens")
    if kind == "chat":
        max_tokens = _positive_int(body, "max_completion_tokens") or max_tokens
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) and s for s in stop_raw):
        stop = tuple(stop_raw)
    else:
        raise BadRequest("'stop' must be a string or a list of non-empty strings.", "stop")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest("'seed' must be a whole number.", "seed")
    top_k = body.get("top_k", 40)
    if not _is_int(top_k) or top_k < 0:
        raise BadRequest("'top_k' must be a whole number of at least 0 (0: no limit).", "top_k")
    conversation = body.get("conversation")
    if conversation is not None and (not isinstance(conversation, str) or not conversation):
        raise BadRequest("'conversation' (a Timeshare extension) must be a non-empty string.", "conversation")
    return {
        "kind": kind,
        "model": model,
        "max_tokens": max_tokens or default_max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": int(top_k),
        "seed": seed,
        "stop": stop,
        "stream": stream,
        "include_usage": include_usage,
        "conversation": conversation,
    }


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _message_text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise BadRequest(
                    f"messages[{index}].content: only text parts are supported "
                    '(\'{"type": "text", "text": "..."}\').',
                    f"messages[{index}].content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"messages[{index}].content must be a string.", f"messages[{index}].content")


def parse_chat_request(body: object) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' is required: a non-empty list of {role, content} objects.", "messages")
    messages = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'.", f"messages[{i}]")
        role = _ROLES.get(str(item.get("role")))
        if role is None:
            raise BadRequest(
                f"messages[{i}].role {item.get('role')!r} is not supported: use system, user or assistant.",
                f"messages[{i}].role",
            )
        messages.append(ChatMessage(role=role, content=_message_text(item.get("content"), i)))  # type: ignore[arg-type]
    fields = _common(body, "chat", DEFAULT_CHAT_MAX_TOKENS)
    return GenerationRequest(prompt=None, messages=tuple(messages), **fields)


def parse_completion_request(body: object) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise BadRequest(
            "'prompt' must be one string: batches of prompts and token arrays are not supported; "
            "send one request per prompt.",
            "prompt",
        )
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' is required and must be a string.", "prompt")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported; leave it out.", "echo")
    if body.get("suffix"):
        raise BadRequest("'suffix' is not supported; leave it out.", "suffix")
    fields = _common(body, "completion", DEFAULT_COMPLETION_MAX_TOKENS)
    return GenerationRequest(prompt=prompt, messages=None, **fields)


async def read_json(request: Request) -> object:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise BadRequest(
            f"The request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MiB; send a shorter one.",
            code="request_too_large",
            status=413,
        )
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(
                f"The request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MiB; send a shorter one.",
                code="request_too_large",
                status=413,
            )
        chunks.append(chunk)
    data = b"".join(chunks)
    if not data:
        raise BadRequest("The request body is empty: send a JSON object.", code="invalid_json")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(
            f"The request body is not valid JSON ({exc}); send a JSON object.", code="invalid_json"
        ) from exc


# ---- serialisation -----------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def switch_extras(switch: SwitchStats | None, prompt_tokens_evaluated: int | None = None) -> dict[str, Any]:
    """The ``timeshare`` field added to completion responses: what the request cost in GPU switching."""
    extras: dict[str, Any] = _plain(switch) if switch is not None else {"switched": False}
    if prompt_tokens_evaluated is not None:
        extras["prompt_tokens_evaluated"] = prompt_tokens_evaluated
    return extras


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
                    "last": _plain(t.last),
                }
            return {
                "per_model": per_model,
                "cancelled_by_disconnect": self.cancelled_by_disconnect,
                "recent_cancel_finish_reasons": list(self.cancelled_finish_reasons),
            }


def status_json(snapshot: PoolSnapshot, counter: SwitchCounter) -> dict[str, Any]:
    return {
        "object": "timeshare.status",
        "holder": snapshot.holder,
        "switching": snapshot.switching,
        "models": [_plain(m) for m in snapshot.models],
        "switch_stats": counter.as_json(),
    }


def model_json(status: Any, created: int) -> dict[str, Any]:
    return {
        "id": status.id,
        "object": "model",
        "created": created,
        "owned_by": "timeshare",
        "timeshare": {
            "name": status.name,
            "state": _plain(status.state),
            "pinned": status.pinned,
            "chat_format": status.chat_format,
            "licence": status.licence,
            "n_ctx": status.n_ctx,
            "reason": status.reason,
        },
    }


# ---- the app -----------------------------------------------------------------------------------


class _AuthMiddleware:
    """Pure ASGI (it leaves ``receive`` untouched, so disconnects still reach the handlers)."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.key is None:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if not header:
            message = (
                "This Timeshare API needs a key: send it as 'Authorization: Bearer <key>' "
                "(the key is api.key in Timeshare's config)."
            )
            await error_response(message, 401, "missing_api_key")(scope, receive, send)
            return
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            message = (
                "Incorrect API key: send the key from api.key in Timeshare's config "
                "as 'Authorization: Bearer <key>'."
            )
            await error_response(message, 401, "invalid_api_key")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Handlers:
    def __init__(self, pool: Pool, api_config: ApiConfig, counter: SwitchCounter) -> None:
        self.pool = pool
        self.api_config = api_config
        self.counter = counter
        self.created = int(time.time())
        # waiting for pieces of many queued generations must not starve the control endpoints,
        # which use anyio's default limiter
        self.generation_limiter = anyio.CapacityLimiter(max(256, 8 * api_config.queue_limit))

    # -- blocking calls off the loop --

    async def call(self, func: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(partial(func, *args))

    async def wait_watching(self, request: Request, gen: Generation, func: Callable[[], T]) -> T:
        """Run ``func`` on a thread; on a client disconnect meanwhile, cancel ``gen``, raise _ClientGone."""
        gone = False
        box: list[T] = []
        failure: Exception | None = None
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

            tg.start_soon(watch)
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
        if gone or not box:
            self.record_cancel_later(gen)
            raise _ClientGone
        return box[0]

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
        snapshot = self.pool.snapshot()
        return JSONResponse(
            {"object": "list", "data": [model_json(m, self.created) for m in snapshot.models]}
        )

    async def get_model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        snapshot = self.pool.snapshot()
        status = snapshot.model(model_id)
        if status is None:
            raise UnknownModelError(_unknown_model_message(model_id, snapshot))
        return JSONResponse(model_json(status, self.created))

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, parse_chat_request(await read_json(request)))

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, parse_completion_request(await read_json(request)))

    async def generate(self, request: Request, req: GenerationRequest) -> Response:
        snapshot = self.pool.snapshot()
        if snapshot.model(req.model) is None:
            raise UnknownModelError(_unknown_model_message(req.model, snapshot))
        try:
            gen = await self.call(partial(self.pool.generate, req.model, **req.pool_fields()))
        except ValueError as exc:  # the pool's own argument check
            raise BadRequest(f"{exc}.") from exc
        try:
            if req.stream:
                return await self.stream(request, req, gen)
            result = await self.wait_watching(request, gen, gen.result)
        except _ClientGone:
            return Response(status_code=499)
        except BaseException:
            gen.cancel()
            raise
        return JSONResponse(self.full_response(req, result))

    def full_response(self, req: GenerationRequest, result: GenerationResult) -> dict[str, Any]:
        usage = usage_json(result.usage)
        finish = _finish_reason(result.finish_reason)
        extras = switch_extras(result.switch, result.usage.prompt_tokens_evaluated)
        if req.kind == "chat":
            return {
                "id": _new_id("chatcmpl"),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": req.model,
                "system_fingerprint": None,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": result.text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
                "timeshare": extras,
            }
        return {
            "id": _new_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}],
            "usage": usage,
            "timeshare": extras,
        }

    async def stream(self, request: Request, req: GenerationRequest, gen: Generation) -> Response:
        pieces = iter(gen)
        end = object()

        def pull() -> object:
            return next(pieces, end)

        # Wait for the first piece before answering, so that errors that come before any text
        # (prompt too long, GPU busy, model crashed) get a proper HTTP status instead of a 200 stream.
        first = await self.wait_watching(request, gen, pull)
        chunk_id = _new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        created = int(time.time())

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if req.kind == "chat":
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
                obj = "text_completion"
            return {
                "id": chunk_id,
                "object": obj,
                "created": created,
                "model": req.model,
                "system_fingerprint": None,
                "choices": [choice],
            }

        async def events() -> AsyncIterator[dict[str, str]]:
            finished = False
            try:
                if req.kind == "chat":
                    yield {"data": json.dumps(chunk("", None, role=True))}
                piece = first
                while piece is not end:
                    if piece:
                        yield {"data": json.dumps(chunk(str(piece), None))}
                    piece = await anyio.to_thread.run_sync(
                        pull, abandon_on_cancel=True, limiter=self.generation_limiter
                    )
                result = await anyio.to_thread.run_sync(
                    gen.result, abandon_on_cancel=True, limiter=self.generation_limiter
                )
                finished = True
                final = chunk(None if req.kind == "chat" else "", _finish_reason(result.finish_reason))
                final["timeshare"] = switch_extras(result.switch, result.usage.prompt_tokens_evaluated)
                yield {"data": json.dumps(final)}
                if req.include_usage:
                    usage_chunk = chunk(None, None)
                    usage_chunk["choices"] = []
                    usage_chunk["usage"] = usage_json(result.usage)
                    yield {"data": json.dumps(usage_chunk)}
                yield {"data": "[DONE]"}
            except TimeshareError as exc:
                # the status line has gone out already: report the error in the stream, OpenAI-style
                finished = True
                log.warning("generation on %s failed mid-stream: %s", req.model, exc)
                yield {"data": json.dumps(error_body(str(exc), timeshare_error_status(exc), exc.code))}
            finally:
                if not finished:
                    gen.cancel()
                    self.record_cancel_later(gen)

        return EventSourceResponse(events(), ping=15)

    # -- Timeshare endpoints --

    async def status(self, request: Request) -> Response:
        snapshot = self.pool.snapshot()
        return JSONResponse(status_json(snapshot, self.counter))

    async def model_command(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        command = request.path_params["command"]
        snapshot = self.pool.snapshot()
        if snapshot.model(model_id) is None:
            raise UnknownModelError(_unknown_model_message(model_id, snapshot))
        if command == "pin":
            await self.call(self.pool.pin, model_id, True)
        elif command == "unpin":
            await self.call(self.pool.pin, model_id, False)
        elif command == "wake":
            await self.call(self.pool.wake, model_id)
        elif command == "sleep":
            level: object = "weights+kv"
            if await request.body():
                body = await read_json(request)
                level = body.get("level", level) if isinstance(body, dict) else None
            if level == "weights" or level == "weights+kv" or level == "stop":
                await self.call(partial(self.pool.sleep, model_id, level=level))
            else:
                raise BadRequest('\'level\' must be "weights", "weights+kv" or "stop".', "level")
        else:
            raise HTTPException(404)
        snapshot = self.pool.snapshot()
        status = snapshot.model(model_id)
        return JSONResponse({"ok": True, "command": command, "model": _plain(status)})


def usage_json(usage: Usage) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _unknown_model_message(model_id: str, snapshot: PoolSnapshot) -> str:
    known = ", ".join(m.id for m in snapshot.models) or "none are configured"
    return f"The model {model_id!r} does not exist in this Timeshare; use one of: {known}."


async def _on_bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    return error_response(exc.message, exc.status, exc.code, exc.param)


async def _on_timeshare_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, TimeshareError)
    if timeshare_error_status(exc) >= 500:
        log.warning("%s %s failed: %s", request.method, request.url.path, exc)
    return timeshare_error_response(exc)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = (
            f"There is no endpoint {request.method} {request.url.path}; see GET /v1/models and docs/API.md."
        )
        return error_response(message, 404, "unknown_url")
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}."
        return error_response(message, 405, "method_not_allowed")
    return error_response(str(exc.detail), exc.status_code, None)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("%s %s crashed", request.method, request.url.path, exc_info=exc)
    return error_response(
        f"Internal error in Timeshare ({type(exc).__name__}: {exc}); see its log.", 500, "internal"
    )


def create_app(pool: Pool, api_config: ApiConfig) -> Starlette:
    """The Starlette app over ``pool``. ``app.state.unsubscribe()`` detaches its switch counter."""
    counter = SwitchCounter()
    handlers = _Handlers(pool, api_config, counter)
    routes = [
        Route("/v1/models", handlers.list_models, methods=["GET"]),
        Route("/v1/models/{model_id}", handlers.get_model, methods=["GET"]),
        Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/timeshare/v1/status", handlers.status, methods=["GET"]),
        Route("/timeshare/v1/models/{model_id}/{command}", handlers.model_command, methods=["POST"]),
    ]
    exception_handlers: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        BadRequest: _on_bad_request,
        TimeshareError: _on_timeshare_error,
        HTTPException: _on_http_exception,
        Exception: _on_unexpected,
    }
    app = Starlette(routes=routes, exception_handlers=exception_handlers)
    app.add_middleware(_AuthMiddleware, key=api_config.key)
    app.state.counter = counter
    app.state.unsubscribe = pool.subscribe(counter.on_event)
    return app


# ---- the server ----------------------------------------------------------------------------------


def check_bind_allowed(api_config: ApiConfig) -> None:
    """Refuse a non-loopback bind without a key (anyone on the network could use the models)."""
    if not is_loopback(api_config.host) and not api_config.key:
        raise ConfigError(
            [
                f"api.host: {api_config.host!r} is not a loopback address, and no api.key is set. "
                "Set api.key (clients then send 'Authorization: Bearer <key>') before serving on other "
                "interfaces, or bind to 127.0.0.1."
            ]
        )


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ApiBindError(
            f"Cannot resolve the API host {host!r} ({exc}); check api.host or --host."
        ) from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ApiBindError(
            f"Cannot listen on {host}:{port} ({exc.strerror or exc}); pick another port with --port or "
            "api.port, or stop the program that uses it."
        ) from exc
    sock.set_inheritable(False)
    return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    return f"http://{shown}:{port}"


def write_address_file(url: str, key_required: bool, path: Path | None = None) -> Path:
    """Record the running API's address (mode 0600, atomically) so the CLI finds it without flags."""
    target = path or paths.api_address_file()
    record = {"url": url, "pid": os.getpid(), "key_required": key_required, "started": time.time()}
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def remove_address_file(path: Path | None = None) -> None:
    """Remove the address file if it is still this process's (a newer instance may have replaced it)."""
    target = path or paths.api_address_file()
    try:
        record = json.loads(target.read_text())
    except (OSError, ValueError):
        return
    if isinstance(record, dict) and record.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            target.unlink()


class ApiServer:
    """uvicorn on a background thread (for the tray app and ``timeshare serve``).

    ``start()`` binds (port 0 picks a free port; see ``port`` / ``url``), serves, and records the
    address in ``paths.api_address_file()``; ``stop()`` shuts down and removes the record.
    """

    def __init__(self, pool: Pool, api_config: ApiConfig, *, address_file: Path | None = None) -> None:
        self.pool = pool
        self.api_config = api_config
        self.address_file = address_file
        self.app: Starlette | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._crash: BaseException | None = None
        self.port: int | None = None
        self.url: str | None = None

    def start(self, timeout: float = 15.0) -> str:
        check_bind_allowed(self.api_config)
        self._sock = _bind(self.api_config.host, self.api_config.port)
        self.port = int(self._sock.getsockname()[1])
        self.url = _url(self.api_config.host, self.port)
        self.app = create_app(self.pool, self.api_config)
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=3,
            timeout_keep_alive=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="timeshare-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ApiBindError(
                    f"The API server did not start on {self.url} ({self._crash or 'timed out'})."
                )
            time.sleep(0.02)
        write_address_file(self.url, bool(self.api_config.key), self.address_file)
        log.info("API listening on %s%s", self.url, " (key required)" if self.api_config.key else "")
        return self.url

    def _run(self) -> None:
        assert self._server is not None and self._sock is not None
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # uvicorn exits with SystemExit on startup failures
            self._crash = exc
            log.error("API server stopped: %r", exc)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        remove_address_file(self.address_file)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.app is not None:
            self.app.state.unsubscribe()
            self.app = None


# ---- `timeshare serve` -------------------------------------------------------------------------


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _load(args: argparse.Namespace) -> Config:
    from .config import load_config

    config_path = getattr(args, "config", None)
    return load_config(Path(config_path).expanduser() if config_path else None, must_exist=bool(config_path))


def serve_main(args: argparse.Namespace) -> int:
    """``timeshare serve``: the pool and the API in the foreground until SIGINT/SIGTERM."""
    _setup_logging(bool(getattr(args, "verbose", False)))
    try:
        config = _load(args)
        host = getattr(args, "host", None)
        port = getattr(args, "port", None)
        api_config = dataclasses.replace(
            config.api,
            host=host if host is not None else config.api.host,
            port=port if port is not None else config.api.port,
        )
        if not 0 <= api_config.port <= 65535:
            raise ConfigError([f"--port: {api_config.port} is not a port number (0..65535)"])
        check_bind_allowed(api_config)
    except ConfigError as exc:
        print(f"timeshare serve: {exc}", file=sys.stderr)
        return 2
    if not config.models:
        notice = str(getattr(config, "notice", "") or "")
        print(
            "timeshare serve: no models are configured. "
            f"{notice or f'Add [[models]] to {paths.config_file()}.'} "
            "Serving an empty pool.",
            file=sys.stderr,
        )

    from .pool import Pool

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    pool = Pool(config)
    server = ApiServer(pool, api_config)
    try:
        url = server.start()  # bind first: a port in use fails before any worker is spawned
        pool.start()
        print(
            f"Timeshare API on {url}/v1 — models: {', '.join(m.id for m in config.models) or 'none'}",
            flush=True,
        )
        while not stop.wait(0.5):
            if not server.running:
                print(
                    "timeshare serve: the API server stopped unexpectedly; see the log above.",
                    file=sys.stderr,
                )
                return 1
        log.info("stopping")
        return 0
    except (ArenaError, ConfigError, ApiBindError) as exc:
        print(f"timeshare serve: {exc}", file=sys.stderr)
        return 2
    finally:
        server.stop()
        pool.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


__all__: Sequence[str] = (
    "ApiBindError",
    "ApiServer",
    "BadRequest",
    "check_bind_allowed",
    "create_app",
    "is_loopback",
    "serve_main",
    "write_address_file",
)
