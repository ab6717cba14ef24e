"""The OpenAI JSON shapes Timeshare reads and writes, as msgspec Structs: the request bodies of
/v1/chat/completions and /v1/completions, and the completion, chunk and usage objects it answers
with. The field rules (types, ranges, lengths) live here; ``requests.py`` turns a failed rule into
Timeshare's sentence (the field path and what to do), and builds the one ``Sampling``.

Unknown request fields are ignored, as OpenAI's own server does with fields a client adds.
Response Structs with ``omit_defaults`` leave out what OpenAI leaves out (a delta's absent role or
content, a chunk's usage); their required fields are always written, ``null`` included.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ..sampling import MAX_STOP, MAX_TOP_LOGPROBS

#: chat messages in one request
MAX_MESSAGES = 4096

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
#: choices per request (``n``)
MAX_N = 8

# ---- requests ------------------------------------------------------------------------------------


class TextPart(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class ImageUrl(msgspec.Struct, frozen=True):
    url: Any = None  # checked by images.image_from_url (a data: URL, or http(s) when fetched)
    detail: str | None = None  # "auto" | "low" | "high": ignored (the projector decides)


class ImageUrlPart(msgspec.Struct, frozen=True, tag="image_url", tag_field="type"):
    image_url: ImageUrl


ContentPart = TextPart | ImageUrlPart


class RequestMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None  # null: an assistant message that only calls tools
    # tool history (validated in tools.py, which reads them from the body): an assistant's calls,
    # the call a tool message answers, the function's name; the legacy function_call
    tool_calls: Any = None
    tool_call_id: Any = None
    name: Any = None
    function_call: Any = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: Any = False  # read as a truth value, as before there was a schema


class _Body(msgspec.Struct, frozen=True, kw_only=True):
    """The fields both endpoints share."""

    model: NonEmpty
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[NonEmpty], msgspec.Meta(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    conversation: NonEmpty | None = None  # Timeshare's extension: the conversation's KV sequence
    cache_prompt: bool | None = None  # llama-server's field; None: the model's setting
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    response_format: Any = None  # checked by structured.py (its sentences name the part)
    # llama-server's extensions
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    grammar: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None or self.stop == "":
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class ChatBody(_Body, frozen=True, kw_only=True):
    messages: Annotated[list[RequestMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None


class CompletionBody(_Body, frozen=True, kw_only=True):
    prompt: str | list[Any]
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None  # 0: score the prompt only
    logprobs: TopLogprobs | None = None  # the legacy field: how many alternatives per token
    echo: bool = False  # the prompt comes back before the answer (with its logprobs when asked)


# ---- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int


class UsageOut(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionOut(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct, frozen=True):
    id: str
    type: Literal["function"]
    function: FunctionOut


class AssistantMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None  # null: the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionOut | None = None  # the legacy functions' answer
    reasoning_content: str | None = None  # a thinking model's <think> block (llama-server's field)


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None  # logprobs.py's shapes
    finish_reason: str


class TextChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, frozen=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: UsageOut
    timeshare: dict[str, Any]


class TextCompletion(msgspec.Struct, frozen=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[TextChoice]
    usage: UsageOut
    timeshare: dict[str, Any]


class FunctionDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: FunctionDelta | None = None
    reasoning_content: str | None = None


class DeltaChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Chunk(msgspec.Struct, frozen=True, omit_defaults=True):
    """A streamed ``chat.completion.chunk`` (choices of DeltaChoice) or ``text_completion``
    (choices of TextChoice); the last ones carry ``timeshare`` and, when asked for, ``usage``."""

    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[DeltaChoice] | list[TextChoice]
    usage: UsageOut | None = None
    timeshare: dict[str, Any] | None = None


_encoder = msgspec.json.Encoder()


def encode(shape: msgspec.Struct) -> bytes:
    """A response shape as JSON bytes."""
    return _encoder.encode(shape)


def schema_error_path(exc: msgspec.ValidationError) -> str:
    """The field path a msgspec validation error names ("messages[0].role"), or ""."""
    text = str(exc)
    path = text.rsplit("`$.", 1)[1].rstrip("`") if "`$." in text else ""
    if not path and "missing required field" in text:
        path = text.split("`")[1]
    return path
