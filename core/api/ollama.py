"""The Ollama API's generation routes on the pool: ``POST /api/chat`` and ``POST /api/generate``
(NDJSON streaming by default, ``"stream": false`` for one object), a thin translation onto the
OpenAI surface's GenerationRequest, Sampling, tools path, structured output and guards
(``dialect``); and ``GET /``, ``HEAD /``, ``GET /api/version``. The model routes (tags, show, ps,
pull, delete, embed) are ``ollama_models``.

What is mapped, ignored and refused is listed in docs/API.md ("Ollama API"); the request rules
are the Structs below, ``options`` the table ``OPTIONS``. Model names: the Timeshare id,
``id:latest`` and the name ``/api/tags`` shows (``resolve``). ``keep_alive``: 0 = release the
model's weights after the answer (sleep level "weights", its KV kept), a duration = the model's
idle timer (``idle_sleep_s``, saved in the config file), negative or over 10 years
(``MAX_IDLE_SLEEP_S``) = no idle release; infinite or NaN = a 400; it never pins. Errors are
Ollama's ``{"error": "..."}`` (``errors.dialect_body``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import anyio.to_thread
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import paths
from ..chatformat.parse import Event
from ..config.files import update_config
from ..config.schema import Config
from ..config.validate import MAX_IDLE_SLEEP_S
from ..errors import TimeshareError, UnknownModelError
from ..pool.generation import GenerationResult
from ..sampling import MAX_STOP, for_front_end
from ..state import ModelState, PoolSnapshot
from ..wire.protocol import ChatMessage, ImagePart, ToolCall
from .dialect import Host, Turn, decode_body, start
from .errors import BadRequestError, ClientGoneError, dialect_body, timeshare_error_status
from .extras import switch_extras
from .images import ImageBudget, image_from_base64
from .requests import GenerationRequest, read_json
from .shapes import MAX_MESSAGES
from .structured import json_object_grammar, schema_grammar
from .tools import ToolRequest, parse_tool_request

#: what GET /api/version answers: the Ollama API version this translation follows
OLLAMA_VERSION = "0.12.0"
#: the tag a Timeshare id is shown with in /api/tags (Ollama's names are name:tag)
TAG = "latest"
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]

# ---- request shapes ------------------------------------------------------------------------------


class FunctionCall(msgspec.Struct, frozen=True):
    name: NonEmpty
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)


class OllamaToolCall(msgspec.Struct, frozen=True):
    function: FunctionCall


class OllamaMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # an earlier answer's reasoning: not shown to the model again


class _Body(msgspec.Struct, frozen=True, kw_only=True):
    model: NonEmpty
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | float | None = None
    think: Any = None  # a thinking model thinks anyway; its reasoning comes back as "thinking"


class ChatBody(_Body, frozen=True, kw_only=True):
    messages: Annotated[list[OllamaMessage], msgspec.Meta(max_length=MAX_MESSAGES)] = msgspec.field(
        default_factory=list
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # Timeshare's extension: OpenAI's tool_choice ("auto" when absent)


class GenerateBody(_Body, frozen=True, kw_only=True):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


_RULES = {
    "model": "'model' is required: a name from GET /api/tags (the Timeshare id, or id:latest).",
    "messages": f"'messages' must be a list of at most {MAX_MESSAGES} {{role, content}} objects.",
    "format": "'format' must be \"json\" or a JSON schema object.",
    "options": "'options' must be an object (see docs/API.md for the options Timeshare maps).",
    "stream": "'stream' must be true or false.",
    "keep_alive": '\'keep_alive\' must be a duration such as "5m", "1h", "300s", a number of '
    "seconds, 0 or -1.",
    "tools": '\'tools\' must be a list of {"type": "function", "function": {...}} objects.',
    "prompt": "'prompt' must be a string.",
    "context": "'context' must be the list of integers an earlier /api/generate answer gave.",
}


_MESSAGE = 'a message is {"role": "system" | "user" | "assistant" | "tool", "content": "..."}.'


def decode(body: object, shape: type[msgspec.Struct]) -> Any:
    """A request body as ``shape``; BadRequestError naming the field otherwise."""
    return decode_body(body, shape, _RULES, _MESSAGE)


# ---- names ---------------------------------------------------------------------------------------


def shown_name(model_id: str) -> str:
    """The name /api/tags shows for a Timeshare id."""
    return model_id if ":" in model_id else f"{model_id}:{TAG}"


def resolve(name: str, snapshot: PoolSnapshot) -> str:
    """The Timeshare id an Ollama client's model name means (the id, ``id:latest``, the name
    /api/tags shows); UnknownModelError naming the known ones otherwise."""
    for m in snapshot.models:
        if name in (m.id, shown_name(m.id)):
            return m.id
    known = ", ".join(shown_name(m.id) for m in snapshot.models) or "none are configured"
    raise UnknownModelError(f"model {name!r} not found; use one of: {known} (GET /api/tags lists them).")


# ---- options -------------------------------------------------------------------------------------

#: Ollama option → Sampling field (the same meaning)
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
}
#: options Timeshare accepts and ignores (the model's own settings decide: never a reload)
IGNORED_OPTIONS = (
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "num_keep",
    "use_mmap",
    "use_mlock",
    "numa",
    "low_vram",
    "f16_kv",
    "vocab_only",
    "typical_p",
    "tfs_z",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "penalize_newline",
)


def sampling_fields(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` as Sampling fields (num_predict and stop included); 400 naming the option."""
    fields: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name in IGNORED_OPTIONS or value is None:
            continue
        if name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool) or value in (0,) or value < -2:
                raise BadRequestError(
                    f"options.num_predict must be a whole number of at least 1, or -1 (no limit) or "
                    f"-2 (fill the context); got {value!r}.",
                    "options.num_predict",
                )
            fields["max_tokens"] = value if value > 0 else None
        elif name == "stop":
            stop = [value] if isinstance(value, str) else value
            if (
                not isinstance(stop, list)
                or not all(isinstance(s, str) and s for s in stop)
                or len(stop) > MAX_STOP
            ):
                raise BadRequestError(
                    f"options.stop must be a list of at most {MAX_STOP} non-empty strings.", "options.stop"
                )
            fields["stop"] = tuple(stop)
        elif name in OPTIONS:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise BadRequestError(f"options.{name} must be a number; got {value!r}.", f"options.{name}")
            fields[OPTIONS[name]] = int(value) if name in ("top_k", "seed", "repeat_last_n") else float(value)
        else:
            raise BadRequestError(
                f"options.{name} is not an option Timeshare knows; see docs/API.md (Ollama API) for "
                "the options it maps and ignores.",
                f"options.{name}",
            )
    return fields


def _sampling(body: _Body, grammar: str | None) -> Any:
    fields = sampling_fields(body.options)
    if grammar is not None:
        fields["grammar"] = grammar
    try:
        return for_front_end("api_ollama", **fields)
    except ValueError as exc:
        raise BadRequestError(f"options: {exc}.", "options") from None


def format_grammar(fmt: str | dict[str, Any] | None) -> str | None:
    """``format``: "json" = one JSON object (llama.cpp's JSON grammar); a schema = its grammar
    (structured output's converter and refusals); "" or absent = text."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json_object_grammar()
    if isinstance(fmt, dict):
        try:
            return schema_grammar(fmt, "format")
        except BadRequestError as exc:
            raise BadRequestError(exc.message, "format") from None
    raise BadRequestError(_RULES["format"], "format")


# ---- keep_alive ----------------------------------------------------------------------------------

_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | float | None) -> float | None:
    """``keep_alive`` in seconds (Go's duration syntax, or a number of seconds); None: absent.
    Infinite or not-a-number values are a 400 (a value too large to be a number too)."""
    if value is None:
        return None
    seconds: float
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = float("inf")
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
                raise BadRequestError(_RULES["keep_alive"], "keep_alive") from None
            negative = text.startswith("-")
            total = sum(abs(float(n)) * _UNIT_S[u] for n, u in parts)
            seconds = -total if negative else total
    if not math.isfinite(seconds):
        raise BadRequestError(
            f"'keep_alive' must be a finite duration; got {value!r}. Send a negative value (or "
            f"anything over {MAX_IDLE_SLEEP_S:.0f} s) to keep the model loaded forever.",
            "keep_alive",
        )
    return seconds


def idle_timer(seconds: float) -> float | None:
    """A non-zero keep_alive as the model's ``idle_sleep_s``: negative, or over the config's
    maximum (MAX_IDLE_SLEEP_S, 10 years), is None (never released on idle)."""
    return None if seconds < 0 or seconds > MAX_IDLE_SLEEP_S else seconds


def _with_idle(config: Config, model_id: str, idle: float | None) -> Config:
    models = tuple(
        dataclasses.replace(m, idle_sleep_s=idle) if m.id == model_id else m for m in config.models
    )
    return dataclasses.replace(config, models=models)


def apply_keep_alive(host: Host, model_id: str, seconds: float | None) -> None:
    """A duration or negative keep_alive as the model's idle timer (blocking; before the answer),
    saved through the config's one writer (``files.update_config``: the file as it is now, under
    its lock, applied to the pool before the next change), so that concurrent changes all land.
    A model the file does not hold changes in the pool only, under the same lock."""
    if seconds is None or seconds == 0:
        return
    wanted = idle_timer(seconds)
    model = host.pool.config.model(model_id)
    if model is None or model.idle_sleep_s == wanted:
        return
    in_file: list[bool] = []

    def change(current: Config) -> Config:
        in_file[:] = [current.model(model_id) is not None]
        return _with_idle(current, model_id, wanted) if in_file[0] else current

    def then(saved: Config) -> None:
        if in_file[0]:
            host.pool.apply_config(saved)
        else:
            host.pool.apply_config(_with_idle(host.pool.config, model_id, wanted))

    update_config(change, host.config_path or paths.config_file(), then=then)


#: how long keep_alive 0 waits for the weights to go before it answers (an answer still being
#: written finishes first)
RELEASE_WAIT_S = 10.0


def release_now(host: Host, model_id: str) -> None:
    """keep_alive 0: let go of the weights now (KV kept), as ``timeshare unload`` does, and answer
    once they have gone (at most :data:`RELEASE_WAIT_S`), so that /api/ps right after shows it."""
    host.pool.sleep(model_id, level="weights")
    gone = (ModelState.RELEASED, ModelState.SLEEPING, ModelState.STOPPED, ModelState.FAILED)
    host.pool.wait_state(model_id, gone, RELEASE_WAIT_S)


# ---- translation ---------------------------------------------------------------------------------


def _images(images: list[Any] | None, where: str, budget: ImageBudget) -> tuple[ImagePart, ...]:
    """Ollama's ``images`` (base64 strings), checked, placed before the text (as Ollama shows a
    message's images ahead of its content)."""
    out: list[ImagePart] = []
    for k, data in enumerate(images or ()):
        at = f"{where}[{k}]"
        budget.take(at)
        out.append(ImagePart(image_from_base64(data, at, None), 0))
    return tuple(out)


def _arguments(value: dict[str, Any] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def chat_messages(messages: list[OllamaMessage]) -> tuple[ChatMessage, ...]:
    """Ollama's chat messages as the pool's (blocking: their images are decoded to be checked)."""
    out: list[ChatMessage] = []
    pending: list[tuple[str, str]] = []  # (call id, name) of the last assistant's calls
    budget = ImageBudget()
    for i, m in enumerate(messages):
        if m.images and m.role != "user":
            where = f"messages[{i}].images"
            raise BadRequestError(f"{where}: only user messages may hold images.", where)
        images = _images(m.images, f"messages[{i}].images", budget)
        if m.role == "tool":
            call_id = next((cid for cid, name in pending if name == m.tool_name), None)
            if call_id is None and pending:
                call_id = pending[0][0]
            pending = [p for p in pending if p[0] != call_id]
            out.append(
                ChatMessage(
                    role="tool", content=m.content, tool_call_id=call_id or f"call_{i}", name=m.tool_name
                )
            )
            continue
        calls = tuple(
            ToolCall(id=f"call_{i}_{j}", name=c.function.name, arguments=_arguments(c.function.arguments))
            for j, c in enumerate(m.tool_calls or ())
        )
        if calls:
            pending = [(c.id, c.name) for c in calls]
        out.append(ChatMessage(role=m.role, content=m.content, tool_calls=calls, images=images))
    return tuple(out)


def tool_request(tools: list[dict[str, Any]] | None, choice: Any = None) -> ToolRequest | None:
    """Ollama's ``tools`` (OpenAI's function tools) through the tools path; ``choice`` is the
    ``tool_choice`` extension (Ollama has none: ``auto``)."""
    if not tools:
        return None
    body: dict[str, Any] = {"tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    return parse_tool_request(body)


class Contexts:
    """/api/generate's ``context``: an answer's conversation so far (its messages), kept under an
    opaque number the client sends back (the last ``limit``); it doubles as the KV conversation,
    so the next turn evaluates only its new tokens."""

    def __init__(self, limit: int = 256) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, tuple[str, tuple[ChatMessage, ...], str]] = OrderedDict()
        self.limit = limit

    def put(self, model_id: str, messages: tuple[ChatMessage, ...], conversation: str) -> list[int]:
        key = secrets.randbits(52) | 1
        with self._lock:
            self._kept[key] = (model_id, messages, conversation)
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)
        return [key]

    def get(self, model_id: str, context: list[int]) -> tuple[tuple[ChatMessage, ...], str]:
        with self._lock:
            kept = self._kept.get(context[-1]) if context else None
        if kept is None or kept[0] != model_id:
            raise BadRequestError(
                "'context' is not one this Timeshare gave for this model (it keeps the last "
                f"{self.limit}, and forgets them when it restarts): send the conversation again "
                "without 'context', or use /api/chat.",
                "context",
            )
        return kept[1], kept[2]


def _request(
    model_id: str,
    body: _Body,
    messages: Any,
    prompt: str | None,
    conversation: str | None,
    images: tuple[ImagePart, ...] = (),
) -> GenerationRequest:
    return GenerationRequest(
        images=images,
        kind="chat" if prompt is None else "completion",
        model=model_id,
        prompt=prompt,
        messages=messages,
        sampling=_sampling(body, format_grammar(body.format)),
        stream=body.stream,
        include_usage=False,
        conversation=conversation,
        cache_prompt=None,
    )


# ---- answers -------------------------------------------------------------------------------------


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _message(events: list[Event]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for e in events:
        if e.kind == "content":
            message["content"] += e.text
        elif e.kind == "reasoning":
            message["thinking"] = message.get("thinking", "") + e.text
        elif e.kind in ("call", "call_end") and e.call is not None:  # (call_start/arguments: parts)
            if e.call.partial:  # cut by num_predict: Ollama's calls carry whole arguments objects
                continue
            try:
                arguments = json.loads(e.call.arguments or "{}")
            except ValueError:
                arguments = {}
            message.setdefault("tool_calls", []).append(
                {"function": {"name": e.call.name, "arguments": arguments}}
            )
    return message


def _stats(turn: Turn, result: GenerationResult) -> dict[str, Any]:
    t = turn.timings
    load_ns = int(result.switch.restore_ms * 1e6) if result.switch.switched else 0
    return {
        "done_reason": "length" if result.finish_reason == "length" else "stop",
        "total_duration": t.total_ns,
        "load_duration": load_ns,
        "prompt_eval_count": result.usage.prompt_tokens_evaluated,
        "prompt_eval_duration": max(0, t.to_first_ns - load_ns),
        "eval_count": result.usage.completion_tokens,
        "eval_duration": t.after_first_ns,
        "timeshare": switch_extras(result.switch, result.usage.prompt_tokens_evaluated)
        | {"prompt_tokens": result.usage.prompt_tokens},
    }


class Routes:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.contexts = Contexts()

    async def root(self, request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def chat(self, request: Request) -> Response:
        body: ChatBody = decode(await read_json(request), ChatBody)
        model_id = resolve(body.model, self.host.pool.snapshot())
        keep = keep_alive_seconds(body.keep_alive)
        if not body.messages:  # Ollama's way to load (or, keep_alive 0, unload) a model
            return await self._load_only(model_id, keep, {"message": {"role": "assistant", "content": ""}})
        messages = await anyio.to_thread.run_sync(chat_messages, body.messages)
        tools = tool_request(body.tools, body.tool_choice)
        req = await anyio.to_thread.run_sync(lambda: _request(model_id, body, messages, None, None))

        def shape(events: list[Event]) -> dict[str, Any]:
            return {"message": _message(events)}

        return await self._answer(request, req, keep, shape, None, tools)

    async def generate(self, request: Request) -> Response:
        body: GenerateBody = decode(await read_json(request), GenerateBody)
        model_id = resolve(body.model, self.host.pool.snapshot())
        keep = keep_alive_seconds(body.keep_alive)
        images = await anyio.to_thread.run_sync(_images, body.images, "images", ImageBudget())
        if body.template:
            raise BadRequestError(
                "'template' is not supported: Timeshare renders prompts with the model's own chat "
                "template (its GGUF's); leave 'template' out, or send 'raw': true with the prompt "
                "already formatted.",
                "template",
            )
        if body.suffix:
            raise BadRequestError("'suffix' (fill-in-the-middle) is not supported; leave it out.", "suffix")
        if not body.prompt and body.context is None:
            return await self._load_only(model_id, keep, {"response": ""})
        if body.raw:
            if body.context:
                raise BadRequestError("'context' goes with templated prompts, not 'raw': true.", "context")
            req = await anyio.to_thread.run_sync(
                lambda: _request(model_id, body, None, body.prompt, None, images)
            )
            history: tuple[ChatMessage, ...] | None = None
        else:
            earlier, conversation = (
                self.contexts.get(model_id, body.context)
                if body.context
                else ((), f"ollama-context-{secrets.token_hex(8)}")
            )
            if body.system is not None:
                earlier = (
                    ChatMessage(role="system", content=body.system),
                    *(m for m in earlier if m.role != "system"),
                )
            messages = (*earlier, ChatMessage(role="user", content=body.prompt, images=images))
            history = messages
            req = await anyio.to_thread.run_sync(
                lambda: _request(model_id, body, messages, None, conversation)
            )

        def shape(events: list[Event]) -> dict[str, Any]:
            return {"response": "".join(e.text for e in events if e.kind == "content")}

        return await self._answer(request, req, keep, shape, history, None)

    async def _load_only(self, model_id: str, keep: float | None, empty: dict[str, Any]) -> Response:
        if keep == 0:
            await self.host.call(release_now, self.host, model_id)
            reason = "unload"
        else:
            await self.host.call(apply_keep_alive, self.host, model_id, keep)
            await self.host.call(self.host.pool.wake, model_id)
            reason = "load"
        return JSONResponse(
            {
                "model": shown_name(model_id),
                "created_at": _now(),
                **empty,
                "done": True,
                "done_reason": reason,
            }
        )

    async def _answer(
        self,
        request: Request,
        req: GenerationRequest,
        keep: float | None,
        shape: Any,
        history: tuple[ChatMessage, ...] | None,
        tools: ToolRequest | None,
    ) -> Response:
        await self.host.call(apply_keep_alive, self.host, req.model, keep)
        turn = await start(self.host, request, req, tools)
        name = shown_name(req.model)

        def finish(result: GenerationResult) -> dict[str, Any]:
            extra: dict[str, Any] = {}
            if history is not None and req.prompt is None:
                answer = ChatMessage(role="assistant", content=result.text)
                kept = (*history, answer)
                extra["context"] = self.contexts.put(req.model, kept, req.conversation or "")
            return {**extra, **_stats(turn, result)}

        async def after() -> None:
            if keep == 0:
                await self.host.call(release_now, self.host, req.model)

        if not req.stream:
            try:
                result = await turn.result()
            except ClientGoneError:
                return Response(status_code=499)
            events = turn.events(result.text) + turn.final_events()
            answer = {"model": name, "created_at": _now(), **shape(events), "done": True, **finish(result)}
            await after()
            return JSONResponse(answer)
        try:
            first = await turn.first()
        except ClientGoneError:
            return Response(status_code=499)
        host = self.host

        def line(obj: dict[str, Any]) -> bytes:
            return json.dumps(obj, ensure_ascii=False).encode() + b"\n"

        def chunk(events: list[Event]) -> bytes | None:
            if not events:
                return None
            return line({"model": name, "created_at": _now(), **shape(events), "done": False})

        async def lines() -> AsyncIterator[bytes]:
            with host.streaming(turn.gen):
                try:
                    if first is not None:
                        out = chunk(turn.events(first))
                        if out:
                            yield out
                        async for piece in turn.rest():
                            out = chunk(turn.events(piece))
                            if out:
                                yield out
                    result = await turn.stream_result()
                    tail = turn.final_events()
                    last = shape(tail) if tail else shape([])
                    yield line({"model": name, "created_at": _now(), **last, "done": True, **finish(result)})
                    await after()
                except TimeshareError as exc:
                    turn.failed()
                    yield line(dialect_body("ollama", str(exc), timeshare_error_status(exc), exc.code))
                finally:
                    turn.abandon()

        return StreamingResponse(lines(), media_type="application/x-ndjson")


def routes(host: Host) -> list[Route]:
    r = Routes(host)
    return [
        Route("/", r.root, methods=["GET", "HEAD"]),
        Route("/api/version", r.version, methods=["GET"]),
        Route("/api/chat", r.chat, methods=["POST"]),
        Route("/api/generate", r.generate, methods=["POST"]),
    ]
