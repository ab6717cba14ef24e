"""The Anthropic Messages API on the pool: ``POST /v1/messages`` (whole, or the SSE event
sequence) and ``POST /v1/messages/count_tokens``, a thin translation onto the OpenAI surface's
GenerationRequest, Sampling, tools path and guards (``dialect``).

Mapped: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use`` and
``tool_result`` blocks, ``max_tokens`` (required, as Anthropic requires), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``tools`` (``input_schema``), ``tool_choice`` (auto, any,
tool, none; ``disable_parallel_tool_use``), ``output_config.format`` (a JSON schema: structured
output's grammar), ``stream``, ``image`` blocks of user messages (``source`` base64, for a model
with a vision projector: core/api/images.py checks them). Ignored: ``metadata``,
``output_config.effort``, ``service_tier``, ``cache_control``, ``citations``, ``thinking`` blocks in
the history (their text is dropped), ``anthropic-version`` / ``anthropic-beta`` headers. Refused
(400 naming the field): document blocks, images in tool results or given by URL, server tools (a
tool with a ``type``), ``thinking`` enabled, ``container``, ``mcp_servers``. Errors are Anthropic's
shape ``{"type": "error", "error": {"type", "message"}}``
(``errors.dialect_body``); the answer carries Timeshare's switch statistics in ``timeshare``.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any, Literal

import anyio.to_thread
import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..chatformat.parse import Event
from ..errors import TimeshareError
from ..sampling import MAX_STOP, for_front_end
from ..wire.protocol import ChatMessage, ToolCall
from .dialect import Host, Turn, decode_body, start
from .errors import BadRequestError, ClientGoneError, dialect_body, timeshare_error_status
from .extras import switch_extras
from .images import ImageBudget, image_from_base64, placed
from .requests import GenerationRequest, read_json
from .shapes import MAX_MESSAGES
from .structured import schema_grammar
from .tools import ToolRequest, parse_tool_request

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_ALNUM = string.ascii_letters + string.digits

# ---- request shapes ------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class ImageBlock(msgspec.Struct, frozen=True, tag="image", tag_field="type"):
    source: Any = None


class DocumentBlock(msgspec.Struct, frozen=True, tag="document", tag_field="type"):
    source: Any = None


class ThinkingBlock(msgspec.Struct, frozen=True, tag="thinking", tag_field="type"):
    thinking: str = ""


class RedactedThinkingBlock(msgspec.Struct, frozen=True, tag="redacted_thinking", tag_field="type"):
    data: str = ""


class ToolUseBlock(msgspec.Struct, frozen=True, tag="tool_use", tag_field="type"):
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, frozen=True, tag="tool_result", tag_field="type"):
    tool_use_id: NonEmpty
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ToolUseBlock
    | ToolResultBlock
)


class InputMessage(msgspec.Struct, frozen=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    name: NonEmpty
    description: str | None = None
    input_schema: dict[str, Any] = msgspec.field(default_factory=dict)
    type: str | None = None  # "custom" or absent; server tools ("web_search_...") are refused


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, frozen=True, kw_only=True):
    format: OutputFormat | None = None
    effort: Any = None  # ignored


class _Prompt(msgspec.Struct, frozen=True, kw_only=True):
    model: NonEmpty
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = None
    mcp_servers: Any = None
    container: Any = None


class MessagesBody(_Prompt, frozen=True, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: Annotated[list[NonEmpty], msgspec.Meta(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stream: bool = False
    metadata: Any = None  # ignored (user_id)
    output_config: OutputConfig | None = None  # format: structured output (a JSON schema)
    conversation: NonEmpty | None = None  # Timeshare's extension, as on /v1/chat/completions


class CountTokensBody(_Prompt, frozen=True, kw_only=True):
    pass


_RULES = {
    "model": "'model' is required: the id of a model from GET /v1/models.",
    "max_tokens": "'max_tokens' is required (as Anthropic requires): a whole number of at least 1.",
    "messages": f"'messages' is required: a non-empty list of {{role, content}} (at most {MAX_MESSAGES}).",
    "temperature": "'temperature' must be a number from 0 to 1.",
    "top_p": "'top_p' must be a number above 0, at most 1.",
    "top_k": "'top_k' must be a whole number of at least 0.",
    "stop_sequences": f"'stop_sequences' must be a list of at most {MAX_STOP} non-empty strings.",
    "stream": "'stream' must be true or false.",
    "system": "'system' must be a string or a list of text blocks.",
    "tools": "'tools' must be a list of {name, description, input_schema}.",
    "tool_choice": '\'tool_choice\' must be {"type": "auto" | "any" | "tool" | "none"} '
    '(with "name" for "tool").',
}


_MESSAGE = (
    'a message is {"role": "user" | "assistant", "content": a string or a list of text, image, '
    "tool_use and tool_result blocks}."
)


# ---- translation ---------------------------------------------------------------------------------


def _refuse_block(block: object, where: str) -> None:
    if isinstance(block, ImageBlock | DocumentBlock):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        where_ok = " here (only in a user message's content)" if kind == "image" else ""
        raise BadRequestError(
            f"{where}: {kind} blocks are not supported{where_ok}: send the text instead.",
            where,
        )


def _image(block: ImageBlock, where: str, budget: ImageBudget) -> bytes:
    """An image block's bytes (``source``: base64 with its media_type), checked."""
    budget.take(where)
    source = block.source
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":
        raise BadRequestError(
            f"{where}.source: images by URL are not supported; send the image as base64", f"{where}.source"
        )
    if kind != "base64":
        raise BadRequestError(
            f'{where}.source must be {{"type": "base64", "media_type": "image/png", "data": "..."}}',
            f"{where}.source",
        )
    mime = source.get("media_type")
    if not isinstance(mime, str):
        raise BadRequestError(
            f"{where}.source.media_type must be an image type", f"{where}.source.media_type"
        )
    return image_from_base64(source.get("data"), f"{where}.source.data", mime)


def _text_of(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for i, block in enumerate(content):
        _refuse_block(block, f"{where}[{i}]")
        if isinstance(block, TextBlock):
            out.append(block.text)
    return "".join(out)


def _messages(body: _Prompt) -> tuple[ChatMessage, ...]:
    out: list[ChatMessage] = []
    if body.system is not None:
        system = _text_of(body.system, "system")
        if system:
            out.append(ChatMessage(role="system", content=system))
    budget = ImageBudget()
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
            continue
        texts: list[tuple[str, bytes | None]] = []
        calls: list[ToolCall] = []
        for j, block in enumerate(message.content):
            at = f"{where}[{j}]"
            if isinstance(block, ImageBlock) and message.role == "user":
                texts.append(("", _image(block, at, budget)))
                continue
            _refuse_block(block, at)
            if isinstance(block, TextBlock):
                texts.append((block.text, None))
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise BadRequestError(f"{at}: tool_use blocks belong to assistant messages.", at)
                calls.append(
                    ToolCall(
                        id=block.id, name=block.name, arguments=json.dumps(block.input, ensure_ascii=False)
                    )
                )
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise BadRequestError(f"{at}: tool_result blocks belong to user messages.", at)
                result = _text_of(block.content, f"{at}.content")
                if block.is_error:
                    result = f"Error: {result}"
                out.append(ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
            # thinking blocks: the history's reasoning is not shown to the model again
        if calls or texts or message.role == "assistant":
            text, images = placed(texts)
            out.append(ChatMessage(role=message.role, content=text, tool_calls=tuple(calls), images=images))
    return tuple(out)


def _tool_request(body: _Prompt) -> ToolRequest | None:
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type in ("any", "tool"):
            raise BadRequestError("'tool_choice' asks for a tool call but 'tools' is empty.", "tool_choice")
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise BadRequestError(
                f"tools[{i}]: server tools ({tool.type!r}) are not supported; give a custom tool "
                "with name, description and input_schema.",
                f"tools[{i}].type",
            )
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    openai: dict[str, Any] = {"tools": tools}
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise BadRequestError("'tool_choice' of type 'tool' needs the tool's 'name'.", "tool_choice")
            openai["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            openai["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        openai["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    try:
        return parse_tool_request(openai)
    except BadRequestError as exc:  # name the Anthropic field
        param = exc.param or "tools"
        raise BadRequestError(
            exc.message.replace("'tool_choice'", "'tool_choice'").replace(".function", ""),
            param.replace(".function", ""),
        ) from None


def _refuse_unsupported(body: _Prompt) -> None:
    thinking = body.thinking
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise BadRequestError(
            "'thinking' is not supported: a model that thinks does so by itself (its reasoning "
            "comes back as thinking blocks); leave 'thinking' out.",
            "thinking",
        )
    for name in ("mcp_servers", "container"):
        if getattr(body, name) is not None:
            raise BadRequestError(f"'{name}' is not supported by Timeshare; leave it out.", name)


def translate(body: object) -> tuple[GenerationRequest, ToolRequest | None]:
    """A /v1/messages body as the GenerationRequest the pool runs and its tools. BadRequestError
    naming the field."""
    parsed: MessagesBody = decode_body(body, MessagesBody, _RULES, _MESSAGE)
    _refuse_unsupported(parsed)
    grammar = None
    if parsed.output_config is not None and parsed.output_config.format is not None:
        try:
            grammar = schema_grammar(parsed.output_config.format.schema, "output_config.format.schema")
        except BadRequestError as exc:
            raise BadRequestError(exc.message, "output_config.format") from None
    try:
        sampling = for_front_end(
            "api_anthropic",
            grammar=grammar,
            max_tokens=parsed.max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k,
            stop=tuple(parsed.stop_sequences or ()),
        )
    except ValueError as exc:
        raise BadRequestError(f"{exc}.") from None
    req = GenerationRequest(
        kind="chat",
        model=parsed.model,
        prompt=None,
        messages=_messages(parsed),
        sampling=sampling,
        stream=parsed.stream,
        include_usage=False,
        conversation=parsed.conversation,
        cache_prompt=None,
    )
    return req, _tool_request(parsed)


# ---- answers -------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _tool_id() -> str:
    return "toolu_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def stop_reason(
    finish: str, stop: str, called: bool, asked: tuple[str, ...], cut: bool = False
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for how the answer ended: ``max_tokens``
    for a tool_use block cut short (``cut``: its input as far as written); one of the request's
    stop sequences (``asked``), which it names, even after a tool call; ``tool_use`` for an
    answer with whole calls (the text after them is dropped: it may have run to max_tokens);
    ``max_tokens``; else ``end_turn`` (the model's end of turn, or a stop string of the model's
    own format)."""
    if cut:
        return "max_tokens", None
    if stop and stop in asked:
        return "stop_sequence", stop
    if called:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    return "end_turn", None


def _cut(events: list[Event]) -> bool:
    """Whether a call among ``events`` was cut short (the answer ended inside it)."""
    return any(e.kind == "call_end" and e.call is not None and e.call.partial for e in events)


def _usage(result: Any) -> dict[str, int]:
    usage = result.usage
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": max(0, usage.prompt_tokens - usage.prompt_tokens_evaluated),
        "cache_creation_input_tokens": 0,
    }


def _blocks(events: list[Event]) -> list[dict[str, Any]]:
    """Events as Anthropic content blocks (adjacent text joined)."""
    blocks: list[dict[str, Any]] = []
    for event in events:
        if event.kind in ("call_start", "call_arguments"):
            continue  # the whole call follows as call_end
        if event.kind in ("call", "call_end") and event.call is not None:
            try:
                arguments = json.loads(event.call.arguments or "{}")
            except ValueError:
                arguments = {}
            blocks.append({"type": "tool_use", "id": _tool_id(), "name": event.call.name, "input": arguments})
            continue
        kind = "text" if event.kind == "content" else "thinking"
        if blocks and blocks[-1]["type"] == kind:
            blocks[-1][kind] += event.text
        else:
            block: dict[str, Any] = {"type": kind, kind: event.text}
            if kind == "thinking":
                block["signature"] = ""
            blocks.append(block)
    return [b for b in blocks if b["type"] == "tool_use" or b.get(b["type"])]


class Routes:
    def __init__(self, host: Host) -> None:
        self.host = host

    async def messages(self, request: Request) -> Response:
        body = await read_json(request)
        req, tools = await anyio.to_thread.run_sync(translate, body)
        turn = await start(self.host, request, req, tools)
        if req.stream:
            return await self.stream(turn)
        try:
            result = await turn.result()
        except ClientGoneError:
            return Response(status_code=499)
        events = turn.events(result.text) + turn.final_events()
        blocks = _blocks(events)
        called = any(b["type"] == "tool_use" for b in blocks)
        reason, sequence = stop_reason(
            result.finish_reason, result.stop, called, turn.req.sampling.stop, _cut(events)
        )
        if not blocks:
            blocks = [{"type": "text", "text": ""}]
        answer = {
            "id": _id("msg"),
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(result),
            "timeshare": switch_extras(result.switch, result.usage.prompt_tokens_evaluated),
        }
        return JSONResponse(answer)

    async def stream(self, turn: Turn) -> Response:
        try:
            first = await turn.first()
        except ClientGoneError:
            return Response(status_code=499)
        host = self.host
        model = turn.req.model

        def event(name: str, data: dict[str, Any]) -> dict[str, str]:
            return {"event": name, "data": json.dumps({"type": name, **data}, ensure_ascii=False)}

        async def events() -> AsyncIterator[dict[str, str]]:
            index = -1
            open_kind: str | None = None
            called = False
            cut = False

            def close() -> list[dict[str, str]]:
                nonlocal open_kind
                if open_kind is None:
                    return []
                open_kind = None
                return [event("content_block_stop", {"index": index})]

            def shaped(parsed: list[Event]) -> list[dict[str, str]]:
                nonlocal index, open_kind, called, cut
                out: list[dict[str, str]] = []
                for e in parsed:
                    if e.kind == "call_start" and e.call is not None:  # its input streams
                        out += close()
                        index += 1
                        called = True
                        open_kind = "tool_use"
                        block = {"type": "tool_use", "id": _tool_id(), "name": e.call.name, "input": {}}
                        out.append(event("content_block_start", {"index": index, "content_block": block}))
                        continue
                    if e.kind == "call_arguments":
                        delta = {"type": "input_json_delta", "partial_json": e.text}
                        out.append(event("content_block_delta", {"index": index, "delta": delta}))
                        continue
                    if e.kind == "call_end":
                        cut = cut or (e.call is not None and e.call.partial)
                        out += close()
                        continue
                    if e.kind == "call" and e.call is not None:
                        out += close()
                        index += 1
                        called = True
                        block = {"type": "tool_use", "id": _tool_id(), "name": e.call.name, "input": {}}
                        out.append(event("content_block_start", {"index": index, "content_block": block}))
                        delta = {"type": "input_json_delta", "partial_json": e.call.arguments or "{}"}
                        out.append(event("content_block_delta", {"index": index, "delta": delta}))
                        out += close()
                        continue
                    if not e.text:
                        continue
                    kind = "text" if e.kind == "content" else "thinking"
                    if open_kind != kind:
                        out += close()
                        index += 1
                        open_kind = kind
                        block = {"type": kind, kind: ""}
                        if kind == "thinking":
                            block["signature"] = ""
                        out.append(event("content_block_start", {"index": index, "content_block": block}))
                    delta = {"type": f"{kind}_delta", kind: e.text}
                    out.append(event("content_block_delta", {"index": index, "delta": delta}))
                return out

            with host.streaming(turn.gen):
                try:
                    message: dict[str, Any] = {
                        "id": _id("msg"),
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": 0, "output_tokens": 0},
                    }
                    yield event("message_start", {"message": message})
                    yield event("ping", {})
                    if first is not None:
                        for item in shaped(turn.events(first)):
                            yield item
                        async for piece in turn.rest():
                            for item in shaped(turn.events(piece)):
                                yield item
                    result = await turn.stream_result()
                    for item in shaped(turn.final_events()):
                        yield item
                    if index < 0:  # an empty answer still has one (empty) text block
                        index = 0
                        empty = {"index": 0, "content_block": {"type": "text", "text": ""}}
                        yield event("content_block_start", empty)
                        yield event("content_block_stop", {"index": 0})
                    for item in close():
                        yield item
                    reason, sequence = stop_reason(
                        result.finish_reason, result.stop, called, turn.req.sampling.stop, cut
                    )
                    usage = _usage(result)
                    yield event(
                        "message_delta",
                        {
                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": usage,
                            "timeshare": switch_extras(result.switch, result.usage.prompt_tokens_evaluated),
                        },
                    )
                    yield event("message_stop", {})
                except TimeshareError as exc:
                    turn.failed()
                    body = dialect_body("anthropic", str(exc), timeshare_error_status(exc), exc.code)
                    yield {"event": "error", "data": json.dumps(body)}
                finally:
                    turn.abandon()

        return EventSourceResponse(events(), ping=15)

    async def count_tokens(self, request: Request) -> Response:
        body = await read_json(request)
        parsed: CountTokensBody = await anyio.to_thread.run_sync(
            partial(decode_body, body, CountTokensBody, _RULES, _MESSAGE)
        )
        _refuse_unsupported(parsed)
        tools = _tool_request(parsed)
        req = GenerationRequest(
            kind="chat",
            model=parsed.model,
            prompt=None,
            # (on a thread: its images are decoded to be checked)
            messages=await anyio.to_thread.run_sync(_messages, parsed),
            sampling=for_front_end("api_anthropic", max_tokens=1, temperature=0.0),
            stream=False,
            include_usage=False,
            conversation=None,
            cache_prompt=None,
        )
        # the worker renders and tokenizes the prompt exactly as for an answer: a one-token
        # generation's prompt_tokens (its prefill stays in the prompt cache for the real turn)
        turn = await start(self.host, request, req, tools)
        try:
            result = await turn.result()
        except ClientGoneError:
            return Response(status_code=499)
        return JSONResponse({"input_tokens": result.usage.prompt_tokens})


def routes(host: Host) -> list[Route]:
    r = Routes(host)
    return [
        Route("/v1/messages", r.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", r.count_tokens, methods=["POST"]),
    ]
