"""The OpenAI Responses API on the pool: ``POST /v1/responses`` (whole, or the SSE event
sequence), ``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``; a
translation onto the turn pipeline (``dialect``: the GenerationRequest, Sampling, tools path,
structured output and guards every dialect shares), the answer shaped by ``response_output``.

Mapped: ``input`` (a string, or items: messages with text parts and, in a user message,
``input_image`` parts (an ``image_url`` data URL, or http(s) when ``api.fetch_image_urls`` is on:
the one check of ``images``, the same image parts as chat completions'), ``function_call`` and
``function_call_output``; ``reasoning`` items are accepted and not shown to the model again),
``instructions`` (the system message), ``max_output_tokens``, ``temperature``, ``top_p``,
``tools`` (function tools, and ``namespace`` tools of them: each function offered by its name, a
call of one answered with its ``namespace``) with ``tool_choice`` (``allowed_tools`` too) and
``parallel_tool_calls``, ``text.format`` (``json_schema`` / ``json_object``: structured output's
grammar), ``top_logprobs`` with ``include: ["message.output_text.logprobs"]``, ``stream``,
``store`` and ``previous_response_id``, ``metadata`` (kept and answered), and the extensions
every OpenAI route takes (``top_k``, ``min_p``, ``seed``, ``stop``, the penalties).

``store`` (default true) keeps the response (``response_store``); ``previous_response_id``
continues its chain: the history is read back from the store, and the turn goes to the chain's
KV conversation in the worker, so only the new input is evaluated. The first response of a chain
runs on the prompt cache (a client that sends its whole history each time, as the Agents SDK
does, reuses it there); the first turn that continues it makes that cached sequence the chain's
conversation (``cache_prompt`` true on a new conversation: ``Sequences.claim_conversation``).

Refused (400 naming the field): hosted tools (web search, file search, code interpreter, computer
use, image generation, MCP, shell, custom tools), ``background``, ``conversation`` (OpenAI's
Conversations API), ``prompt`` (stored prompt templates), an image by ``file_id``, audio and file
parts, input items of another type, a ``function_call_output`` whose call is not in the conversation, a
``previous_response_id`` that is not stored (never, deleted, past the bounds), whose chain lost an
earlier response, or that belongs to another model. docs/API.md lists every field.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ModelUnavailableError, TimeshareError
from ..modelnames import resolve_api_model
from ..sampling import MAX_STOP, MAX_TOP_LOGPROBS, for_front_end
from ..wire.protocol import ChatMessage, ImagePart, ToolCall
from .dialect import Host, Turn, decode_body, start, unknown_model
from .errors import BadRequestError, ClientGoneError, error_body, timeshare_error_status
from .extras import switch_extras
from .images import Fetcher, ImageBudget, image_from_url, placed
from .requests import GenerationRequest, read_json
from .response_output import Output, new_id
from .response_store import (
    CONVERSATION_PREFIX,
    BrokenChainError,
    ChainTooLongError,
    ResponseStore,
    StoredResponse,
)
from .shapes import MAX_MESSAGES
from .structured import response_format_grammar
from .tools import ToolRequest, parse_tool_request

log = logging.getLogger(__name__)

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]

#: input items in one request (and messages in a chain with its new input)
MAX_INPUT_ITEMS = MAX_MESSAGES
#: the include value that asks for the answer's logprobs
LOGPROBS_INCLUDE = "message.output_text.logprobs"

#: a tool's place in the chat shape's 'tools' (in the tools path's errors)
_TOOL_AT = re.compile(r"tools\[(\d+)\]")

#: OpenAI's hosted tools (tool types and tool_choice types): Timeshare has none of them
HOSTED_TOOLS = {
    "web_search": "web search",
    "web_search_preview": "web search",
    "web_search_preview_2025_03_11": "web search",
    "web_search_2025_08_26": "web search",
    "file_search": "file search",
    "code_interpreter": "the code interpreter",
    "computer_use_preview": "computer use",
    "computer_use": "computer use",
    "computer": "computer use",
    "image_generation": "image generation",
    "mcp": "remote MCP servers",
    "local_shell": "the local shell",
    "shell": "the shell",
    "apply_patch": "apply_patch",
    "custom": "custom (free-form) tools",
    "tool_search": "tool search",
}

#: how a client that sends a hosted tool by default is told not to (the end of the refusal)
CLIENT_HINTS = {
    "web_search": ' (Codex CLI sends it unless its config.toml says web_search = "disabled".)',
}

# ---- the request ---------------------------------------------------------------------------------


class TextFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, frozen=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: Any = None  # ignored: a local model has no such switch


class ResponsesBody(msgspec.Struct, frozen=True, kw_only=True):
    model: NonEmpty
    input: str | list[Any] = msgspec.field(default_factory=list)
    instructions: str | None = None
    previous_response_id: NonEmpty | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    # refused
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # ignored (see docs/API.md)
    reasoning: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Any = None
    # the extensions every OpenAI route takes (llama-server's names)
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, lt=2**32)] | None = None
    stop: str | Annotated[list[NonEmpty], msgspec.Meta(max_length=MAX_STOP)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, msgspec.Meta(ge=-1)] | None = None


_RULES = {
    "model": "'model' is required: the id of a model from GET /v1/models.",
    "input": "'input' must be a string or a list of input items (messages, function_call, "
    "function_call_output).",
    "instructions": "'instructions' must be a string (the system message).",
    "previous_response_id": "'previous_response_id' must be the id of a stored response (resp_...).",
    "store": "'store' must be true or false.",
    "stream": "'stream' must be true or false.",
    "max_output_tokens": "'max_output_tokens' must be a whole number of at least 1.",
    "temperature": "'temperature' must be a number from 0 to 2.",
    "top_p": "'top_p' must be a number above 0, at most 1.",
    "top_logprobs": f"'top_logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS}.",
    "include": "'include' must be a list of strings.",
    "tools": "'tools' must be a list of function tools ({type: 'function', name, parameters}).",
    "tool_choice": "'tool_choice' must be 'none', 'auto', 'required' or "
    '{"type": "function", "name": ...}.',
    "parallel_tool_calls": "'parallel_tool_calls' must be true or false.",
    "text": '\'text\' must be {"format": {"type": "text" | "json_object" | "json_schema", ...}}.',
    "metadata": "'metadata' must map strings to strings.",
    "background": "'background' must be true or false.",
    "truncation": "'truncation' must be 'auto' or 'disabled'.",
    "top_k": "'top_k' must be a whole number of at least 0 (0: no limit).",
    "min_p": "'min_p' must be a number from 0 to 1.",
    "seed": "'seed' must be a whole number from 0 to 2**32 - 1.",
    "stop": f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings.",
    "presence_penalty": "'presence_penalty' must be a number from -2 to 2.",
    "frequency_penalty": "'frequency_penalty' must be a number from -2 to 2.",
    "repeat_penalty": "'repeat_penalty' must be a number above 0 (1: off) and at most 10.",
    "repeat_last_n": "'repeat_last_n' must be a whole number of at least -1 (-1: the whole context).",
}

_ITEM = (
    "an input item is a message ({role, content}), a function_call ({type, call_id, name, "
    "arguments}) or a function_call_output ({type, call_id, output})."
)


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated /v1/responses request, ready for the pool."""

    body: ResponsesBody
    raw_tools: tuple[dict[str, Any], ...]  # the function tools as given (answered in ``tools``)
    input_items: tuple[dict[str, Any], ...]  # this turn's input items (ids given), as stored
    turn_input: tuple[ChatMessage, ...]  # this turn's input as chat messages
    tools: ToolRequest | None
    logprobs: bool
    # the functions of namespace tools: name -> namespace (a call of one is answered with it)
    namespaces: dict[str, str] = field(default_factory=dict)


def _bad(message: str, param: str | None) -> BadRequestError:
    return BadRequestError(message, param)


def _refuse_unsupported(body: ResponsesBody) -> None:
    if body.background:
        raise _bad(
            "'background' is not supported: Timeshare answers while the request is open; send the "
            "request without it (stream it to see the answer as it comes).",
            "background",
        )
    if body.conversation is not None:
        raise _bad(
            "'conversation' (OpenAI's Conversations API) is not supported; continue a stored "
            "response with 'previous_response_id' instead.",
            "conversation",
        )
    if body.prompt is not None:
        raise _bad(
            "'prompt' (a stored prompt template) is not supported; send 'instructions' and 'input'.",
            "prompt",
        )


@dataclass
class _Images:
    """How one request's ``input_image`` parts are read: ``fetch`` for an http(s) URL (None: refused;
    ``api.fetch_image_urls``), and the request's count (the chain's stored images included)."""

    fetch: Fetcher | None = None
    budget: ImageBudget = field(default_factory=ImageBudget)
    earlier: int = 0  # the images of the stored responses previous_response_id continues

    def __post_init__(self) -> None:
        self.budget.count = self.earlier

    def take(self, part: dict[str, Any], at: str) -> bytes:
        """An ``input_image`` part's image: its ``image_url`` (a data: URL, or http(s) when
        fetching is on), checked as every dialect's (core/api/images.py); a ``file_id`` is a 400."""
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise _bad(
                f"{at}.file_id: images by file_id are not supported (Timeshare has no Files API); "
                "send the image in image_url as a data: URL (data:image/png;base64,...).",
                f"{at}.file_id",
            )
        url = part.get("image_url")
        if isinstance(url, dict):  # the chat completions shape ({"url": ...}), which some clients send
            url = url.get("url")
        try:
            self.budget.take(at)
        except BadRequestError as exc:
            if not self.earlier:
                raise
            raise _bad(
                f"{exc.message} (the stored responses previous_response_id continues hold "
                f"{self.earlier} of them)",
                exc.param,
            ) from None
        return image_from_url(url, f"{at}.image_url", self.fetch)


def _content(content: object, where: str, images: _Images | None = None) -> tuple[str, tuple[ImagePart, ...]]:
    """A message's content (a string or parts) as its text and the images among it (``images``:
    how they are read; None: none may be there, a 400 naming the part otherwise)."""
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts.", where)
    parts: list[tuple[str, bytes | None]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str):
                raise _bad(f"{at}.text must be a string.", f"{at}.text")
            parts.append((text, None))
        elif kind == "refusal":
            refusal = part.get("refusal") if isinstance(part, dict) else None
            parts.append((refusal if isinstance(refusal, str) else "", None))
        elif kind == "input_image" and isinstance(part, dict):
            if images is None:
                raise _bad(f"{at}: only user messages may hold images.", f"{at}.type")
            parts.append(("", images.take(part, at)))
        elif kind in ("input_file", "input_audio"):
            raise _bad(
                f"{at}: {kind} parts are not supported: Timeshare's local models read text and "
                "images (input_image); send the text instead.",
                f"{at}.type",
            )
        else:
            raise _bad(
                f"{at}.type {kind!r} is not supported: use input_text parts (input_image for an "
                "image, output_text for an assistant's earlier answer).",
                f"{at}.type",
            )
    return placed(parts)


def _text_parts(content: object, where: str) -> str:
    """A content that holds no image (a function's output) as its text; 400 naming the part
    otherwise."""
    return _content(content, where)[0]


_ROLES: dict[str, Literal["system", "user", "assistant"]] = {
    "user": "user",
    "system": "system",
    "developer": "system",
    "assistant": "assistant",
}


class _History:
    """Chat messages built from input items in order: an assistant's function calls join the
    assistant message before them; a call's output must answer a call the conversation made."""

    def __init__(self, earlier: Sequence[ChatMessage]) -> None:
        self.messages: list[ChatMessage] = []
        self.calls: dict[str, str] = {c.id: c.name for m in earlier for c in m.tool_calls}

    def add(self, message: ChatMessage) -> None:
        self.messages.append(message)

    def add_call(self, call: ToolCall) -> None:
        self.calls[call.id] = call.name
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant":
            self.messages[-1] = msgspec.structs.replace(last, tool_calls=(*last.tool_calls, call))
        else:
            self.messages.append(ChatMessage(role="assistant", content="", tool_calls=(call,)))


def _string_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where}.{name} is required: a non-empty string.", f"{where}.{name}")
    return value


def _input_messages(
    raw: str | list[Any], earlier: Sequence[ChatMessage], fetch: Fetcher | None = None
) -> tuple[tuple[ChatMessage, ...], tuple[dict[str, Any], ...]]:
    """``input`` as chat messages (after ``earlier``, the chain's history) and as the items the
    store lists (each with an id, images as given). ``fetch``: how an http(s) image URL is
    fetched (None: refused). 400 naming the item otherwise."""
    if isinstance(raw, str):
        item = {
            "type": "message",
            "id": new_id("msg"),
            "role": "user",
            "content": [{"type": "input_text", "text": raw}],
        }
        return (ChatMessage(role="user", content=raw),), (item,)
    if len(raw) > MAX_INPUT_ITEMS:
        raise _bad(
            f"'input' holds {len(raw)} items; send at most {MAX_INPUT_ITEMS} (continue a stored "
            "response with previous_response_id instead of sending the whole history).",
            "input",
        )
    history = _History(earlier)
    items: list[dict[str, Any]] = []
    images = _Images(fetch, earlier=sum(len(m.images) for m in earlier))
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object: {_ITEM}", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(
                    f"{where}.role {role!r} is not supported: use user, system, developer or assistant.",
                    f"{where}.role",
                )
            user = _ROLES[role] == "user"
            text, placed_images = _content(item.get("content"), f"{where}.content", images if user else None)
            history.add(ChatMessage(role=_ROLES[role], content=text, images=placed_images))
            items.append({"id": new_id("msg"), **item, "type": "message"})
        elif kind == "function_call":
            call = ToolCall(
                id=_string_field(item, "call_id", where),
                name=_string_field(item, "name", where),
                arguments=_arguments(item.get("arguments", "{}"), where),
            )
            history.add_call(call)
            items.append({"id": new_id("fc"), **item})
        elif kind == "function_call_output":
            call_id = _string_field(item, "call_id", where)
            if call_id not in history.calls:
                raise _bad(
                    f"{where}: function_call_output for call_id {call_id!r}, but no function_call "
                    "with that call_id came before it (in the input, or the stored responses "
                    "previous_response_id continues); send the call too.",
                    f"{where}.call_id",
                )
            output = item.get("output")
            if isinstance(output, list):
                output = _text_parts(output, f"{where}.output")
            if not isinstance(output, str):
                raise _bad(f"{where}.output must be a string (the function's result).", f"{where}.output")
            history.add(
                ChatMessage(role="tool", content=output, tool_call_id=call_id, name=history.calls[call_id])
            )
            items.append({"id": new_id("fco"), **item})
        elif kind == "reasoning":
            items.append(dict(item))  # earlier thinking is not shown to the model again
        elif kind == "item_reference":
            raise _bad(
                f"{where}: item_reference is not supported; send the item itself (or continue its "
                "response with previous_response_id).",
                f"{where}.type",
            )
        else:
            raise _bad(
                f"{where}.type {kind!r} is not supported: {_ITEM} (Timeshare runs no hosted tools).",
                f"{where}.type",
            )
    return tuple(history.messages), tuple(items)


def _arguments(value: object, where: str) -> str:
    if isinstance(value, dict):  # some clients send the object itself
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise _bad(f"{where}.arguments must be a JSON string.", f"{where}.arguments")
    return value


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as the chat shape the tools path reads."""
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _namespace(tool: dict[str, Any], where: str, namespaces: dict[str, str]) -> list[dict[str, Any]]:
    """A ``namespace`` tool (a named group of function tools, as Codex CLI sends its sub-agent and
    MCP tools) as its function tools, each offered under its own name; ``namespaces`` learns the
    namespace of each (a call of one answers it in ``namespace``). 400 naming the field."""
    name, members = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name is required: the namespace's name (a non-empty string).", f"{where}.name")
    if not isinstance(members, list):
        raise _bad(f"{where}.tools must be a list of function tools.", f"{where}.tools")
    chat: list[dict[str, Any]] = []
    for j, member in enumerate(members):
        at = f"{where}.tools[{j}]"
        kind = member.get("type") if isinstance(member, dict) else None
        if not isinstance(member, dict) or kind != "function":
            raise _bad(
                f"{at}.type {kind!r} is not supported: a namespace holds function tools.", f"{at}.type"
            )
        function = _function(member)
        tool_name = function["function"].get("name")
        if isinstance(tool_name, str) and tool_name in namespaces:
            raise _bad(
                f"{at}.name {tool_name!r} is also in namespace {namespaces[tool_name]!r}: the model "
                "calls a tool by its name, so each name may be in one namespace only.",
                f"{at}.name",
            )
        if isinstance(tool_name, str):
            namespaces[tool_name] = name
        chat.append(function)
    return chat


def _tools(
    body: ResponsesBody,
) -> tuple[tuple[dict[str, Any], ...], ToolRequest | None, dict[str, str]]:
    """The tools as given, as the tools path's request, and the namespace of each function tool
    that came in a ``namespace`` tool. 400 naming the field."""
    raw = body.tools or []
    given: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    where: dict[int, str] = {}  # each chat tool's place in 'tools' (a namespace's are inside it)
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(tool, dict) and kind == "namespace":
            members = _namespace(tool, at, namespaces)
            where.update({id(m): f"{at}.tools[{j}]" for j, m in enumerate(members)})
            chat += members
            given.append(tool)
            continue
        if not isinstance(tool, dict) or kind != "function":
            if kind in HOSTED_TOOLS:
                hint = CLIENT_HINTS.get(kind, "")
                raise _bad(
                    f"{at}: the hosted tool {kind!r} ({HOSTED_TOOLS[kind]}) is not supported: "
                    "Timeshare runs local models without OpenAI's hosted tools; give a function "
                    f"tool and run it yourself.{hint}",
                    f"{at}.type",
                )
            raise _bad(
                f"{at}.type {kind!r} is not supported: give function tools (type 'function', "
                "or 'namespace' holding them).",
                f"{at}.type",
            )
        function = _function(tool)
        where[id(function)] = at
        chat.append(function)
        given.append(tool)
    choice = body.tool_choice
    mapped: object = choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            mapped = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind == "allowed_tools":
            mapped, chat = _allowed(choice, chat)
        elif kind in HOSTED_TOOLS:
            raise _bad(
                f"'tool_choice' names the hosted tool {kind!r}, which Timeshare does not have; "
                "name a function tool.",
                "tool_choice",
            )
        else:
            raise _bad(_RULES["tool_choice"], "tool_choice")
    openai: dict[str, Any] = {"tools": chat, "parallel_tool_calls": bool(body.parallel_tool_calls)}
    if mapped is not None:
        openai["tool_choice"] = mapped
    try:
        request = parse_tool_request(openai)
    except BadRequestError as exc:  # name the Responses field (tools[i].name, not .function.name)
        paths = [where[id(t)] for t in chat]

        def field(text: str) -> str:
            text = text.replace(".function", "")
            return _TOOL_AT.sub(
                lambda m: paths[int(m.group(1))] if int(m.group(1)) < len(paths) else m[0], text
            )

        raise BadRequestError(field(exc.message), field(exc.param or "tools")) from None
    return tuple(given), request, namespaces


def _allowed(choice: dict[str, Any], chat: list[dict[str, Any]]) -> tuple[object, list[dict[str, Any]]]:
    """``{"type": "allowed_tools", "mode", "tools"}``: the tools it names, with its mode."""
    mode = choice.get("mode", "auto")
    names = choice.get("tools")
    if mode not in ("auto", "required") or not isinstance(names, list):
        raise _bad(
            '\'tool_choice\' of type allowed_tools needs "mode" ("auto" or "required") and "tools" '
            '(a list of {"type": "function", "name": ...}).',
            "tool_choice",
        )
    allowed = {t.get("name") for t in names if isinstance(t, dict) and t.get("type") == "function"}
    if len(allowed) != len(names):
        raise _bad("'tool_choice'.tools may name function tools only.", "tool_choice")
    known = {t["function"].get("name") for t in chat}
    unknown = sorted(str(n) for n in allowed - known)
    if unknown:
        raise _bad(f"'tool_choice' allows {unknown}, which are not in 'tools'.", "tool_choice")
    return mode, [t for t in chat if t["function"].get("name") in allowed]


def _grammar(body: ResponsesBody) -> str | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return response_format_grammar({"type": "json_object"})
    if fmt.schema is None:
        raise _bad(
            "text.format of type json_schema needs 'schema' (the JSON schema the answer follows).",
            "text.format",
        )
    spec = {"name": fmt.name or "answer", "schema": fmt.schema, "strict": fmt.strict}
    try:
        return response_format_grammar({"type": "json_schema", "json_schema": spec})
    except BadRequestError as exc:
        message = exc.message.replace("response_format.json_schema", "text.format")
        raise BadRequestError(message, "text.format") from None


def parse(
    body: object, earlier: Sequence[ChatMessage] = (), fetch: Fetcher | None = None
) -> ResponsesRequest:
    """A /v1/responses body (``earlier``: the history its previous_response_id's chain holds)
    as the request the pool runs; ``fetch``: how an http(s) image URL is fetched (None: refused;
    ``api.fetch_image_urls``). BadRequestError naming the field."""
    parsed: ResponsesBody = decode_body(body, ResponsesBody, _RULES, _ITEM)
    _refuse_unsupported(parsed)
    include = parsed.include or []
    messages, items = _input_messages(parsed.input, earlier, fetch)
    if not messages and not earlier:
        raise _bad("'input' is empty: give the user's message (a string or input items).", "input")
    raw_tools, tools, namespaces = _tools(parsed)
    return ResponsesRequest(
        body=parsed,
        raw_tools=raw_tools,
        input_items=items,
        turn_input=messages,
        tools=tools,
        logprobs=LOGPROBS_INCLUDE in include or parsed.top_logprobs is not None,
        namespaces=namespaces,
    )


def generation_request(
    r: ResponsesRequest, model_id: str, earlier: Sequence[ChatMessage], conversation: str | None
) -> GenerationRequest:
    """The GenerationRequest of a parsed request on ``model_id``: the instructions, the chain's
    history and the new input; ``conversation``: the chain's KV conversation (None: the prompt
    cache)."""
    body = r.body
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    messages += [*earlier, *r.turn_input]
    if len(messages) > MAX_MESSAGES:
        param = "previous_response_id" if earlier else "input"
        raise _bad(
            f"The conversation holds {len(messages)} messages with its stored history; at most "
            f"{MAX_MESSAGES} fit one request: start a new chain with a summary of it.",
            param,
        )
    stop = body.stop
    try:
        sampling = for_front_end(
            "api_responses",
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop) if stop else None,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repeat_penalty=body.repeat_penalty,
            repeat_last_n=body.repeat_last_n,
            grammar=_grammar(body),
            logprobs=r.logprobs or None,
            top_logprobs=body.top_logprobs or None,
        )
    except ValueError as exc:
        raise BadRequestError(f"{exc}.") from None
    return GenerationRequest(
        kind="chat",
        model=model_id,
        prompt=None,
        messages=tuple(messages),
        sampling=sampling,
        stream=body.stream,
        include_usage=False,
        conversation=conversation,
        # a chain's first continuation makes the cached sequence of the response it follows its
        # conversation (a new conversation with cache_prompt true adopts the prompt cache's)
        cache_prompt=True if conversation is not None else None,
        logprobs=r.logprobs,
    )


# ---- answers -------------------------------------------------------------------------------------


def _usage(result: Any) -> dict[str, Any]:
    usage = result.usage
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": max(0, usage.prompt_tokens - usage.prompt_tokens_evaluated)
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class _Answer:
    """One response being answered: its id, what it echoes, and where it continues."""

    id: str
    created: float
    request: ResponsesRequest
    model_id: str
    previous: StoredResponse | None
    conversation: str  # the chain's KV conversation (named after the first response of the chain)

    def shell(self, status: str, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response object (without usage) in ``status``."""
        body = self.request.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        text_format = msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}
        tools = self.request.tools
        tool_choice: object = (
            body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(self.created),
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model_id,
            "output": output or [],
            "parallel_tool_calls": bool(tools is not None and tools.parallel),
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": text_format},
            "tool_choice": tool_choice,
            "tools": list(self.request.raw_tools),
            "top_logprobs": body.top_logprobs or 0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": body.truncation or "disabled",
            "usage": None,
            "user": None,
            "metadata": dict(body.metadata or {}),
        }

    def final(self, output: Output, result: Any) -> dict[str, Any]:
        """The finished response object (completed or incomplete) for ``result``."""
        if result.finish_reason not in ("stop", "length"):
            raise ModelUnavailableError(
                f"the answer ended before it was complete ({result.finish_reason}); send the request again"
            )
        incomplete = self.incomplete(output, result)
        response = self.shell("incomplete" if incomplete else "completed", output.items)
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["completed_at"] = int(time.time())
        response["usage"] = _usage(result)
        response["timeshare"] = switch_extras(
            result.switch, result.usage.prompt_tokens_evaluated, result.batch_size, result.timings
        )
        return response

    @staticmethod
    def incomplete(output: Output, result: Any) -> bool:
        """Cut short by max_output_tokens (or the end of the context): an answer of whole tool
        calls is complete (what followed them is dropped)."""
        if result.finish_reason != "length":
            return False
        calls = output.calls
        return output.cut or not calls

    def record(self, output: Output, response: dict[str, Any]) -> StoredResponse:
        depth = self.previous.depth + 1 if self.previous is not None else 1
        return StoredResponse(
            id=self.id,
            model=self.model_id,
            created=self.created,
            previous=self.previous.id if self.previous is not None else None,
            conversation=self.conversation,
            depth=depth,
            turn=(*self.request.turn_input, output.message()),
            input_items=self.request.input_items,
            body=response,
        )


class Routes:
    def __init__(
        self,
        host: Host,
        store: ResponseStore,
        sse: Callable[[AsyncIterator[dict[str, str]]], Response],
        fetch: Callable[[], Fetcher | None] = lambda: None,
    ) -> None:
        self.host = host
        self.store = store
        self.sse = sse  # the API's server-sent events response (handlers.StreamResponse)
        self.fetch = fetch  # how an http(s) image URL is fetched now (None: api.fetch_image_urls is off)

    # -- POST /v1/responses --

    async def create(self, request: Request) -> Response:
        body = await read_json(request)
        answer, req = await self.host.call(self._prepare, body)
        try:
            turn = await start(self.host, request, req, answer.request.tools)
        except (
            BadRequestError
        ) as exc:  # the pipeline's "messages" (images for a text model...) is 'input' here
            if exc.param != "messages":
                raise
            raise BadRequestError(exc.message, "input", code=exc.code, status=exc.status) from None
        if req.stream:
            return await self._stream(turn, answer)
        try:
            result = await turn.result()
        except ClientGoneError:
            return Response(status_code=499)
        output = Output(answer.request.logprobs, answer.request.namespaces)
        output.feed(turn.events(result.text) + turn.final_events(), result.logprobs)
        output.finish(answer.incomplete(output, result))
        response = answer.final(output, result)
        if answer.request.body.store:
            await self.host.call(self.store.put, answer.record(output, response))
        return JSONResponse(response)

    def _prepare(self, body: object) -> tuple[_Answer, GenerationRequest]:
        """Blocking (the store, a schema's grammar): the request, its chain and the pool's request."""
        snapshot = self.host.pool.snapshot()
        previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
        chain: list[StoredResponse] = []
        if isinstance(previous_id, str) and previous_id:
            chain = self._chain(previous_id)
        earlier = tuple(m for r in chain for m in r.turn)
        parsed = parse(body, earlier, self.fetch())
        model_id = resolve_api_model(snapshot.models, parsed.body.model)
        if model_id is None:
            raise unknown_model(parsed.body.model, snapshot)
        previous = chain[-1] if chain else None
        if previous is not None and previous.model != model_id:
            raise _bad(
                f"'previous_response_id' {previous.id!r} was answered by {previous.model}, not "
                f"{model_id}: its conversation's KV cache belongs to that model; continue it "
                "with that model, or send the history as input.",
                "previous_response_id",
            )
        rid = new_id("resp")
        conversation = previous.conversation if previous is not None else f"{CONVERSATION_PREFIX}{rid}"
        answer = _Answer(rid, time.time(), parsed, model_id, previous, conversation)
        # the first response of a chain runs on the prompt cache; its continuations in the chain's
        # conversation (see the module docstring)
        req = generation_request(parsed, model_id, earlier, conversation if previous is not None else None)
        return answer, req

    def _chain(self, previous_id: str) -> list[StoredResponse]:
        try:
            chain = self.store.chain(previous_id, MAX_INPUT_ITEMS)
        except BrokenChainError as exc:
            raise _bad(
                f"'previous_response_id' {previous_id!r} continues {exc.missing!r}, which is no "
                "longer stored (deleted, or past api.responses_kept / api.responses_days): its "
                "history is gone; send the conversation as input instead.",
                "previous_response_id",
            ) from None
        except ChainTooLongError:
            raise _bad(
                f"'previous_response_id' {previous_id!r} ends a chain of more than "
                f"{MAX_INPUT_ITEMS} responses; start a new chain with a summary of it.",
                "previous_response_id",
            ) from None
        if not chain:
            raise _bad(
                f"'previous_response_id' {previous_id!r} is not a stored response: it was never "
                "stored (store: false), was deleted, or went past api.responses_kept / "
                "api.responses_days.",
                "previous_response_id",
            )
        return chain

    async def _stream(self, turn: Turn, answer: _Answer) -> Response:
        try:
            first = await turn.first()
        except ClientGoneError:
            return Response(status_code=499)
        host = self.host
        choice = turn.choices[0]
        output = Output(answer.request.logprobs, answer.request.namespaces)

        def sse(event: dict[str, Any]) -> dict[str, str]:
            return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}

        async def events() -> AsyncIterator[dict[str, str]]:
            with host.streaming(turn.gen):
                try:
                    shell = answer.shell("in_progress")
                    yield sse(output.event("response.created", response=shell))
                    yield sse(output.event("response.in_progress", response=shell))
                    if first is not None:
                        for item in output.feed(turn.events(first), choice.piece_logprobs()):
                            yield sse(item)
                        async for piece in turn.rest():
                            for item in output.feed(turn.events(piece), choice.piece_logprobs()):
                                yield sse(item)
                    result = await turn.stream_result()
                    for item in output.feed(turn.final_events()):
                        yield sse(item)
                    incomplete = answer.incomplete(output, result)
                    for item in output.finish(incomplete):
                        yield sse(item)
                    response = answer.final(output, result)
                    if answer.request.body.store:
                        await host.call(self.store.put, answer.record(output, response))
                    kind = "response.incomplete" if incomplete else "response.completed"
                    yield sse(output.event(kind, response=response))
                except TimeshareError as exc:
                    turn.failed()
                    status = timeshare_error_status(exc)
                    log.warning("response on %s failed mid-stream: %s", answer.model_id, exc)
                    error = error_body(str(exc), status, exc.code)["error"]
                    yield sse(output.event("error", code=exc.code, message=str(exc), param=None))
                    failed = answer.shell("failed", output.items)
                    failed["error"] = {"code": error["code"] or "server_error", "message": str(exc)}
                    yield sse(output.event("response.failed", response=failed))
                finally:
                    turn.abandon()

        return self.sse(events())

    # -- GET / DELETE /v1/responses/{id} --

    async def _stored(self, request: Request) -> StoredResponse:
        rid = request.path_params["response_id"]
        record = await self.host.call(self.store.get, rid)
        if record is None:
            raise BadRequestError(
                f"No stored response with id {rid!r} (never stored, deleted, or past api.responses_kept "
                "/ api.responses_days).",
                "response_id",
                code="not_found",
                status=404,
            )
        return record

    async def get(self, request: Request) -> Response:
        record = await self._stored(request)
        return JSONResponse(record.body)

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if not await self.host.call(self.store.delete, rid):
            await self._stored(request)  # the 404
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        record = await self._stored(request)
        items = list(record.input_items)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequestError("'order' must be 'asc' or 'desc'.", "order")
        if order == "desc":
            items.reverse()
        after = request.query_params.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise BadRequestError(f"'after' {after!r} is not an item of this response.", "after")
            items = items[ids.index(after) + 1 :]
        limit_text = request.query_params.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise BadRequestError("'limit' must be a whole number from 1 to 100.", "limit")
        limit = int(limit_text)
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None,
                "has_more": len(items) > limit,
            }
        )


def routes(
    host: Host,
    store: ResponseStore,
    sse: Callable[[AsyncIterator[dict[str, str]]], Response],
    fetch: Callable[[], Fetcher | None] = lambda: None,
) -> list[Route]:
    """``fetch``: how an http(s) image URL is fetched now (None: refused; api.fetch_image_urls)."""
    r = Routes(host, store, sse, fetch)
    return [
        Route("/v1/responses", r.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", r.get, methods=["GET"]),
        Route("/v1/responses/{response_id}", r.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", r.input_items, methods=["GET"]),
    ]
