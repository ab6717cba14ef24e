"""Request parsing: OpenAI chat and completion bodies into one validated :class:`GenerationRequest`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request

from ..worker.protocol import ChatMessage
from .errors import BadRequestError

#: request bodies above this are refused with 413 before they are parsed
MAX_BODY_BYTES = 8 * 1024 * 1024
#: a body must arrive within this many seconds (a stalled upload would hold its connection)
BODY_TIMEOUT_S = 60.0
#: JSON nested deeper than this is refused (the API's own bodies nest 4 levels)
MAX_JSON_DEPTH = 32
#: JSON values (objects, arrays, strings, numbers ...) in one body; beyond it: 400
MAX_JSON_VALUES = 200_000
#: chat messages in one request
MAX_MESSAGES = 4096
#: stop strings in one request (OpenAI allows 4)
MAX_STOP = 16
#: OpenAI's default for /v1/completions
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: OpenAI lets chat run to the end of the context; a local default keeps a runaway answer bounded
DEFAULT_CHAT_MAX_TOKENS = 512

T = TypeVar("T")
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
    cache_prompt: bool | None  # llama-server's field; None: the model's setting

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
            "cache_prompt": self.cache_prompt,
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
        raise BadRequestError(f"'{name}' must be a number from {low:g} to {high:g}; got {value!r}.", name)
    return float(value)


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise BadRequestError(f"'{name}' must be a whole number of at least 1; got {value!r}.", name)
    return int(value)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequestError(
            f"'n' = {n!r} is not supported: Timeshare generates one choice per request. "
            "Leave 'n' out (or set it to 1) and send separate requests for more answers.",
            "n",
        )
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise BadRequestError("'best_of' other than 1 is not supported; leave it out.", "best_of")
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise BadRequestError(
                f"'{name}' is not supported: Timeshare's local models answer with text only.", name
            )
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise BadRequestError("'logprobs' is not supported; leave it out.", "logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequestError(f"'{name}' is not supported; leave it out or set it to 0.", name)
    if body.get("logit_bias"):
        raise BadRequestError("'logit_bias' is not supported; leave it out.", "logit_bias")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type", "text") != "text"
    ):
        raise BadRequestError(
            '\'response_format\' other than {"type": "text"} is not supported; leave it out.',
            "response_format",
        )


def _common(body: Mapping[str, Any], kind: str, default_max_tokens: int) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' is required: the id of a model from GET /v1/models.", "model")
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be true or false.", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequestError("'stream_options' must be an object.", "stream_options")
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
        raise BadRequestError("'stop' must be a string or a list of non-empty strings.", "stop")
    if len(stop) > MAX_STOP:
        raise BadRequestError(f"'stop' holds {len(stop)} strings; send at most {MAX_STOP}.", "stop")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequestError("'seed' must be a whole number.", "seed")
    top_k = body.get("top_k", 40)
    if not _is_int(top_k) or top_k < 0:
        raise BadRequestError("'top_k' must be a whole number of at least 0 (0: no limit).", "top_k")
    conversation = body.get("conversation")
    if conversation is not None and (not isinstance(conversation, str) or not conversation):
        raise BadRequestError(
            "'conversation' (a Timeshare extension) must be a non-empty string.", "conversation"
        )
    cache_prompt = body.get("cache_prompt")
    if cache_prompt is not None and not isinstance(cache_prompt, bool):
        raise BadRequestError("'cache_prompt' must be true or false.", "cache_prompt")
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
        "cache_prompt": cache_prompt,
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
                raise BadRequestError(
                    f"messages[{index}].content: only text parts are supported "
                    '(\'{"type": "text", "text": "..."}\').',
                    f"messages[{index}].content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequestError(f"messages[{index}].content must be a string.", f"messages[{index}].content")


def parse_chat_request(body: object) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequestError(
            "'messages' is required: a non-empty list of {role, content} objects.", "messages"
        )
    if len(raw) > MAX_MESSAGES:
        raise BadRequestError(
            f"'messages' holds {len(raw)} messages; send at most {MAX_MESSAGES} "
            "(drop or summarise the oldest ones).",
            "messages",
        )
    messages = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise BadRequestError(
                f"messages[{i}] must be an object with 'role' and 'content'.", f"messages[{i}]"
            )
        role = _ROLES.get(str(item.get("role")))
        if role is None:
            raise BadRequestError(
                f"messages[{i}].role {item.get('role')!r} is not supported: use system, user or assistant.",
                f"messages[{i}].role",
            )
        messages.append(ChatMessage(role=role, content=_message_text(item.get("content"), i)))  # type: ignore[arg-type]
    fields = _common(body, "chat", DEFAULT_CHAT_MAX_TOKENS)
    return GenerationRequest(prompt=None, messages=tuple(messages), **fields)


def parse_completion_request(body: object) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise BadRequestError(
            "'prompt' must be one string: batches of prompts and token arrays are not supported; "
            "send one request per prompt.",
            "prompt",
        )
    if not isinstance(prompt, str):
        raise BadRequestError("'prompt' is required and must be a string.", "prompt")
    if not prompt:
        raise BadRequestError("'prompt' is empty: give some text for the model to continue.", "prompt")
    if body.get("echo"):
        raise BadRequestError("'echo' is not supported; leave it out.", "echo")
    if body.get("suffix"):
        raise BadRequestError("'suffix' is not supported; leave it out.", "suffix")
    fields = _common(body, "completion", DEFAULT_COMPLETION_MAX_TOKENS)
    return GenerationRequest(prompt=prompt, messages=None, **fields)


def _too_large() -> BadRequestError:
    return BadRequestError(
        f"The request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MiB; send a shorter one.",
        code="request_too_large",
        status=413,
    )


async def read_body(request: Request) -> bytes:
    """The request body, at most MAX_BODY_BYTES (413 beyond), within BODY_TIMEOUT_S (408 after)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large()
    chunks = []
    size = 0
    try:
        with anyio.fail_after(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _too_large()
                chunks.append(chunk)
    except TimeoutError:
        raise BadRequestError(
            f"The request body did not arrive within {BODY_TIMEOUT_S:g} s; send it again.",
            code="request_timeout",
            status=408,
        ) from None
    return b"".join(chunks)


def _bad_string(where: str) -> BadRequestError:
    shown = where or "the request body"
    return BadRequestError(
        f"{shown}: the string holds a lone surrogate escape (such as \\ud800), which is not Unicode "
        "text; send valid UTF-8 (a character outside the BMP as its surrogate pair).",
        where or None,
        code="invalid_string",
    )


def check_json(value: object) -> None:
    """Refuse (400) JSON nested deeper than MAX_JSON_DEPTH, with more than MAX_JSON_VALUES values,
    or holding a string that cannot be encoded as UTF-8 (a lone surrogate escape): the param
    names the field. Iterative, so no input can exhaust the stack."""
    stack: list[tuple[object, str, int]] = [(value, "", 1)]
    seen = 0
    while stack:
        item, where, depth = stack.pop()
        seen += 1
        if seen > MAX_JSON_VALUES:
            raise BadRequestError(
                f"The request body holds more than {MAX_JSON_VALUES} JSON values; send a smaller one.",
                code="invalid_json",
            )
        if depth > MAX_JSON_DEPTH:
            raise BadRequestError(
                f"The request body nests more than {MAX_JSON_DEPTH} levels deep; no field needs that.",
                where or None,
                code="invalid_json",
            )
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad_string(where) from None
        elif isinstance(item, dict):
            for key, sub in item.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    raise _bad_string(where) from None
                stack.append((sub, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(item))


def parse_json(data: bytes) -> object:
    """A request body as checked JSON (see :func:`check_json`); BadRequestError otherwise."""
    if not data:
        raise BadRequestError("The request body is empty: send a JSON object.", code="invalid_json")
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(
            f"The request body is not valid JSON ({exc}); send a JSON object.", code="invalid_json"
        ) from exc
    except RecursionError:
        raise BadRequestError(
            f"The request body nests more than {MAX_JSON_DEPTH} levels deep; no field needs that.",
            code="invalid_json",
        ) from None
    check_json(value)
    return value


async def read_json(request: Request) -> object:
    """The request body as checked JSON, parsed off the event loop (a large body takes a while)."""
    data = await read_body(request)
    return await anyio.to_thread.run_sync(parse_json, data)
