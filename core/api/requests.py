"""Request parsing: OpenAI chat and completion bodies into one validated :class:`GenerationRequest`
(the shapes and their field rules are ``shapes.py``; a broken rule becomes a sentence here)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import msgspec
from starlette.requests import Request

from ..chatformat.gbnf_check import GrammarLimitError, check_gbnf
from ..sampling import (
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    Sampling,
    for_front_end,
)
from ..wire.protocol import ChatMessage, ImagePart
from .errors import BadRequestError
from .images import Fetcher, ImageBudget, image_from_url, placed
from .shapes import MAX_MESSAGES, MAX_N, ChatBody, CompletionBody, RequestMessage, TextPart
from .structured import response_format_grammar
from .tools import ToolRequest, has_tool_fields, parse_tool_request, tool_message

__all__ = ["MAX_MESSAGES", "GenerationRequest", "parse_chat_request", "parse_completion_request"]

#: request bodies above this are refused with 413 before they are parsed
MAX_BODY_BYTES = 8 * 1024 * 1024
#: a body must arrive within this many seconds (a stalled upload would hold its connection)
BODY_TIMEOUT_S = 60.0
#: JSON nested deeper than this is refused (the API's own bodies nest 4 levels)
MAX_JSON_DEPTH = 32
#: JSON values (objects, arrays, strings, numbers ...) in one body; beyond it: 400
MAX_JSON_VALUES = 200_000

T = TypeVar("T")
# ---- request parsing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /v1/chat/completions or /v1/completions request."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    sampling: Sampling  # what the worker's sampler gets, unchanged
    stream: bool
    include_usage: bool
    conversation: str | None
    cache_prompt: bool | None  # llama-server's field; None: the model's setting
    tools: ToolRequest | None = None  # chat: tools, tool_choice ... (None: none, or tool_choice none)
    n: int = 1  # choices: n generations, choice i sampled with seed + i (Sampling.for_choice)
    images: tuple[ImagePart, ...] = ()  # a completion prompt's images (Ollama's /api/generate)
    logprobs: bool = False  # the answer carries logprobs (Sampling.logprobs / top_logprobs)
    echo: bool = False  # completions: the prompt comes back first (its tokens' logprobs with logprobs)
    score_only: bool = False  # completions' max_tokens 0: the prompt is evaluated, nothing generated
    prompt_tokens: tuple[int, ...] | None = None  # completions: a token-array prompt (prompt is None)

    def pool_fields(self, choice: int = 0) -> dict[str, Any]:
        """``Pool.generate``'s keyword arguments for choice ``choice``."""
        return {
            "prompt": self.prompt,
            "messages": self.messages,
            "sampling": self.sampling.for_choice(choice),
            "conversation": self.conversation,
            "cache_prompt": self.cache_prompt,
            "images": self.images,
            # an echoed token-array prompt's text is its tokens' pieces: they come with the entries
            "prompt_logprobs": self.echo and (self.logprobs or self.prompt_tokens is not None),
            "score_only": self.score_only,
            "prompt_tokens": self.prompt_tokens,
        }

    @property
    def image_count(self) -> int:
        return len(self.images) + sum(len(m.images) for m in self.messages or ())


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise BadRequestError("'best_of' other than 1 is not supported; leave it out.", "best_of")


# ---- a schema error as Timeshare's sentence ------------------------------------------------------

# msgspec says "<what> - at `$.messages[0].role`"; a missing field is named in <what>
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")
_INDEX = re.compile(r"\[(\d+)\]")

_NUMBERS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}


def _value_at(body: object, param: str) -> object:
    value = body
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", param):
        if index:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
        else:
            value = value.get(name) if isinstance(value, dict) else None
    return value


def _sentence(param: str, value: object, what: str) -> str:
    """What to tell a client whose ``param`` (holding ``value``) broke a rule of ``shapes.py``
    (msgspec's own words: ``what``)."""
    top = _INDEX.sub("[]", param)
    if top == "model":
        return "'model' is required: the id of a model from GET /v1/models."
    if top == "messages":
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            return (
                f"'messages' holds {len(value)} messages; send at most {MAX_MESSAGES} "
                "(drop or summarise the oldest ones)."
            )
        return "'messages' is required: a non-empty list of {role, content} objects."
    if top == "messages[]":
        return f"{param} must be an object with 'role' and 'content'."
    if top == "messages[].role":
        return f"{param} {value!r} is not supported: use system, user, assistant or tool."
    if top == "messages[].content":
        if isinstance(value, list):  # a part broke the rule
            return (
                f"{param}: only text and image_url parts are supported "
                '(\'{"type": "text", "text": "..."}\', \'{"type": "image_url", "image_url": {"url": '
                '"data:image/png;base64,..."}}\').'
            )
        return f"{param} must be a string."
    if top in _NUMBERS:
        low, high = _NUMBERS[top]
        return f"'{top}' must be a number from {low:g} to {high:g}; got {value!r}."
    if top in ("max_tokens", "max_completion_tokens"):
        return f"'{top}' must be a whole number of at least 1; got {value!r}."
    if top == "echo":
        return f"'echo' must be true or false; got {value!r}."
    if top == "n":
        return f"'n' must be a whole number from 1 to {MAX_N} (the choices to generate); got {value!r}."
    if top == "logprobs":
        return (
            "'logprobs' must be true or false on /v1/chat/completions, and a whole number from 0 to "
            f"{MAX_TOP_LOGPROBS} (the alternatives per token) on /v1/completions; got {value!r}."
        )
    if top == "top_logprobs":
        return f"'top_logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS}; got {value!r}."
    if top.startswith("logit_bias"):
        return "'logit_bias' must map token ids (as strings) to biases from -100 to 100."
    if top == "repeat_penalty":
        return f"'repeat_penalty' must be a number above 0 (1: off) and at most 10; got {value!r}."
    if top == "repeat_last_n":
        return "'repeat_last_n' must be a whole number of at least -1 (-1: the whole context)."
    if top == "grammar":
        return "'grammar' must be a string: a GBNF grammar with a 'root' rule."
    if top == "top_k":
        return "'top_k' must be a whole number of at least 0 (0: no limit)."
    if top == "seed":
        return "'seed' must be a whole number."
    if top == "stop":
        if isinstance(value, list) and len(value) > MAX_STOP:
            return f"'stop' holds {len(value)} strings; send at most {MAX_STOP}."
        return "'stop' must be a string or a list of non-empty strings."
    if top in ("stream", "cache_prompt"):
        return f"'{top}' must be true or false."
    if top == "stream_options":
        return "'stream_options' must be an object."
    if top == "conversation":
        return "'conversation' (a Timeshare extension) must be a non-empty string."
    if top == "prompt":
        return "'prompt' is required and must be a string."
    return f"'{param}': {what[:1].lower()}{what[1:]}; see docs/API.md."


def _param_of(exc: msgspec.ValidationError) -> tuple[str, str]:
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], (match["path"] or "").lstrip(".")
    missing = _MISSING.fullmatch(what)
    if missing:
        path = f"{path}.{missing['field']}" if path else missing["field"]
    # the error names the field a client sets: a text part's own fields are its content's
    for whole in ("stop", "stream_options"):
        if path.startswith(whole):
            path = whole
    if ".content[" in path:
        path = path[: path.index(".content[") + len(".content")]
    return path, what


def _decode(body: object, shape: type[T]) -> T:
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    _refuse_unsupported(body)
    try:
        return msgspec.convert(body, shape)
    except msgspec.ValidationError as exc:
        param, what = _param_of(exc)
        value = _value_at(body, param)
        if shape is CompletionBody and param == "max_tokens":
            sentence = (
                "'max_tokens' must be a whole number of at least 0 (0: the prompt is scored, nothing "
                f"generated); got {value!r}."
            )
        else:
            sentence = _sentence(param, value, what)
        raise BadRequestError(sentence, param or None) from None


def _request(
    kind: str,
    front_end: str,
    parsed: ChatBody | CompletionBody,
    prompt: str | None,
    messages: tuple[ChatMessage, ...] | None,
    max_tokens: int | None,
) -> GenerationRequest:
    grammar = response_format_grammar(parsed.response_format)
    if grammar is not None and parsed.grammar is not None:
        raise BadRequestError(
            "'grammar' and a JSON 'response_format' both constrain the answer; send one of them.", "grammar"
        )
    if parsed.grammar is not None and not parsed.grammar.strip():
        raise BadRequestError(
            "'grammar' is empty: give a GBNF grammar with a 'root' rule, or leave it out.", "grammar"
        )
    if parsed.grammar is not None:
        try:
            check_gbnf(parsed.grammar, "'grammar'")
        except GrammarLimitError as exc:
            raise BadRequestError(f"{exc}.", "grammar") from None
    if isinstance(parsed, ChatBody):
        if parsed.top_logprobs and not parsed.logprobs:
            raise BadRequestError("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        logprobs, top = bool(parsed.logprobs), parsed.top_logprobs or 0
    else:
        logprobs, top = parsed.logprobs is not None, parsed.logprobs or 0
    try:
        sampling = for_front_end(
            front_end,
            max_tokens=max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k,
            min_p=parsed.min_p,
            seed=parsed.seed,
            stop=parsed.stop_strings,
            presence_penalty=parsed.presence_penalty,
            frequency_penalty=parsed.frequency_penalty,
            repeat_penalty=parsed.repeat_penalty,
            repeat_last_n=parsed.repeat_last_n,
            logit_bias=_logit_bias(parsed.logit_bias),
            grammar=grammar if grammar is not None else parsed.grammar,
            logprobs=logprobs or None,
            top_logprobs=top or None,
        )
    except ValueError as exc:
        raise BadRequestError(f"{exc}.") from None
    return GenerationRequest(
        kind=kind,
        model=parsed.model,
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        stream=parsed.stream,
        include_usage=parsed.include_usage,
        conversation=parsed.conversation,
        cache_prompt=parsed.cache_prompt,
        n=parsed.n or 1,
        logprobs=logprobs,
    )


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"token id": bias}`` as Sampling's pairs (the bias is added to the logit: -100
    bans a token in practice, +100 all but forces it)."""
    if not raw:
        return None
    pairs: list[tuple[int, float]] = []
    for key, bias in raw.items():
        if not key.isdigit():
            raise BadRequestError(
                f'logit_bias: {key!r} is not a token id (the keys are token ids, as strings: "15339").',
                "logit_bias",
            )
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


_ROLES: dict[str, Any] = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _chat_message(
    m: RequestMessage, raw: Mapping[str, Any], index: int, fetch: Fetcher | None, budget: ImageBudget
) -> ChatMessage:
    images: tuple[ImagePart, ...] = ()
    if m.content is None:
        text = ""
    elif isinstance(m.content, str):
        text = m.content
    else:
        parts: list[tuple[str, bytes | None]] = []
        for j, part in enumerate(m.content):
            if isinstance(part, TextPart):
                parts.append((part.text, None))
                continue
            where = f"messages[{index}].content[{j}].image_url"
            if m.role != "user":
                raise BadRequestError(f"{where}: only user messages may hold images.", where)
            budget.take(where)
            parts.append(("", image_from_url(part.image_url.url, f"{where}.url", fetch)))
        text, images = placed(parts)
    if has_tool_fields(raw):  # the tools path (tools.py): calls, results, the legacy forms
        return tool_message(raw, index, text)
    if m.content is None:
        where = f"messages[{index}].content"
        raise BadRequestError(f"{where} must be a string (null only with tool_calls).", where)
    return ChatMessage(role=_ROLES[m.role], content=text, images=images)


def parse_chat_request(body: object, fetch: Fetcher | None = None) -> GenerationRequest:
    """A /v1/chat/completions body as a GenerationRequest; ``fetch``: how an http(s) image URL is
    fetched (None: refused; ``api.fetch_image_urls``)."""
    parsed = _decode(body, ChatBody)
    assert isinstance(body, dict)
    raw = body["messages"]
    budget = ImageBudget()
    messages = tuple(_chat_message(m, raw[i], i, fetch, budget) for i, m in enumerate(parsed.messages))
    max_tokens = parsed.max_completion_tokens or parsed.max_tokens
    request = _request("chat", "api_chat", parsed, None, messages, max_tokens)
    return dataclasses.replace(request, tools=parse_tool_request(body))


def parse_completion_request(body: object) -> GenerationRequest:
    parsed = _decode(body, CompletionBody)
    prompt: object = parsed.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt (lm-evaluation-harness sends its prompts so)
    tokens: tuple[int, ...] | None = None
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        tokens = tuple(int(t) for t in prompt)  # OpenAI's token-array prompt
        prompt = None
    elif isinstance(prompt, list):
        raise BadRequestError(
            "'prompt' must be one string or one list of token ids (whole numbers of at least 0): "
            "batches of prompts are not supported; send one request per prompt.",
            "prompt",
        )
    assert prompt is None or isinstance(prompt, str)
    if prompt is not None and not prompt:
        raise BadRequestError("'prompt' is empty: give some text for the model to continue.", "prompt")
    assert isinstance(body, dict)
    if body.get("suffix"):
        raise BadRequestError("'suffix' is not supported; leave it out.", "suffix")
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise BadRequestError(f"'{name}' goes with /v1/chat/completions; leave it out here.", name)
    score_only = parsed.max_tokens == 0
    # max_tokens 0 (OpenAI's scoring request): nothing is sampled, the Sampling's limit is moot
    request = _request(
        "completion", "api_completion", parsed, prompt, None, 1 if score_only else parsed.max_tokens
    )
    return dataclasses.replace(request, echo=parsed.echo, score_only=score_only, prompt_tokens=tokens)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        elif isinstance(item, _LongInteger):
            raise BadRequestError(
                f"{where or 'the request body'}: an integer of {item.digits} digits; no field takes "
                f"more than {MAX_INT_DIGITS} (send a shorter number).",
                where or None,
                code="invalid_request",
            )
        elif isinstance(item, dict):
            for key, sub in item.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    raise _bad_string(where) from None
                stack.append((sub, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(item))


#: digits of a JSON integer; a longer one is a 400 naming its field, wherever it is (no field takes
#: more than 20, and Python's int() refuses more than 4,300: that was a 500)
MAX_INT_DIGITS = 100
_LONG_DIGITS = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))


class _LongInteger:
    """An integer of the body too long to convert: check_json names its field."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _LongInteger:
    digits = len(text) - text.startswith("-")
    return int(text) if digits <= MAX_INT_DIGITS else _LongInteger(digits)


def parse_json(data: bytes) -> object:
    """A request body as checked JSON (see :func:`check_json`); BadRequestError otherwise."""
    if not data:
        raise BadRequestError("The request body is empty: send a JSON object.", code="invalid_json")
    try:
        # a run of digits longer than an integer may have (in a number or a string): parse its
        # integers one by one, so a long one becomes a marker instead of int()'s ValueError
        value = json.loads(data, parse_int=_parse_int) if _LONG_DIGITS.search(data) else json.loads(data)
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
