"""An answer split into reasoning, content and tool calls, as it streams or whole.

``AnswerParser`` takes the answer's text piece by piece (``feed``) and returns what can be said
now: reasoning text, content text and tool calls, in order. Text that may be the start of a
marker (``</think>``, ``<tool_call>``, ``[TOOL_CALLS]``) is held back until it is known. A call
whose object starts with its name (``{"name": ..., "arguments": {``) streams: ``call_start`` with
the name once it is written, ``call_arguments`` pieces of the arguments' JSON text as they come,
``call_end`` with the whole call (its arguments are the text as the model wrote it, so the pieces
add up to them); any other call (arguments as a string, Mistral's, whose ids follow the arguments)
comes whole as ``call``. Text after the calls is dropped. What never parses as a call (broken JSON,
a block that never closes) comes back as content at ``finish``, marker included, so nothing the
model wrote is lost; a call that started streaming and never ended (the answer was cut by
``max_tokens``) is not taken back: ``finish`` ends it with its arguments as far as they were
written (``ParsedCall.partial``), as OpenAI returns a cut call.

Where calls are recognised (``tools`` true):

- ``hermes``: every ``<tool_call>{json}</tool_call>`` block, anywhere in the answer; content is
  the text before the first block.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of calls; an answer that starts with ``[`` too
  (the ``[TOOL_CALLS]`` control token is not part of the text of an answer).
- ``llama3``, ``generic``: an answer that starts with a JSON object (after ``<|python_tag|>`` for
  Llama): one or more call objects ``{"name", "arguments"|"parameters"}``, separated by white
  space, newlines or ``;``.

Reasoning (``thinks``): an answer that starts with ``<think>`` (or all answers, ``starts_thinking``,
when the prompt opened the block) has the text up to ``</think>`` as reasoning; an answer cut off
inside it is all reasoning.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .families import Family

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text (an object as the model wrote it, re-encoded)
    id: str | None = None  # the model's own id (Mistral writes one)
    partial: bool = False  # the answer ended inside it (max_tokens): its arguments as far as written


#: "call": a whole call at once; "call_start" (its name, arguments ""), "call_arguments" (a piece
#: of its arguments' JSON text) ... "call_end" (the whole call, as "call" would have said it): a call
#: whose arguments stream as they are written
EventKind = Literal["reasoning", "content", "call", "call_start", "call_arguments", "call_end"]


@dataclass(frozen=True)
class Event:
    kind: EventKind
    text: str = ""
    call: ParsedCall | None = None


@dataclass
class Answer:
    content: str = ""
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)


def _held(buf: str, marker: str) -> int:
    """The longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


def _held_with_space(buf: str, marker: str) -> int:
    """What to hold back: a possible start of ``marker`` and the white space before it."""
    n = _held(buf, marker)
    rest = buf[: len(buf) - n]
    return n + len(rest) - len(rest.rstrip())


#: a call object's start when its name comes first: ``{"name": "...", "arguments": `` (or parameters)
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at ``text[start]`` ends (None: not yet)."""
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _raw_arguments(body: str) -> str | None:
    """The arguments of a call object as written (an object after a leading name), else None."""
    head = _CALL_HEAD.match(body)
    if head is None or not body[head.end() :].startswith("{"):
        return None
    end = _value_end(body, head.end())
    return body[head.end() : end] if end is not None else None


def _call(obj: object, arguments_keys: tuple[str, ...], raw: str = "") -> ParsedCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        function = obj.get("function")
        if isinstance(function, dict):  # {"type": "function", "function": {...}}
            return _call(function, arguments_keys)
        return None
    args: Any = {}
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            json.loads(args)
            text = args
        except ValueError:
            text = json.dumps(args, ensure_ascii=False)
    else:
        text = json.dumps(args, ensure_ascii=False)
    written = _raw_arguments(raw) if isinstance(args, dict) else None
    if written is not None:  # as the model wrote it: what streamed, piece by piece
        text = written
    call_id = obj.get("id")
    return ParsedCall(name, text, call_id if isinstance(call_id, str) else None)


_DECODER = json.JSONDecoder()


class AnswerParser:
    """One answer's incremental parser (see the module docstring)."""

    def __init__(
        self, family: Family, *, tools: bool, thinks: bool = False, starts_thinking: bool = False
    ) -> None:
        self.family = family
        self.tools = tools
        self._buf = ""
        # "start" (nothing decided yet), "think", "content_start" (after thinking, before any
        # content), "content", "calls", "done"
        self._mode = "think" if starts_thinking else "start" if thinks else "content_start"
        self._thinks = thinks
        self._raw = ""  # the calls part as written (returned as content if no call parses)
        self._in_array = False  # mistral: inside the calls' JSON array
        self._streaming: tuple[str, str] | None = None  # the call being streamed: name, arguments sent
        self._partial = ""  # the streaming call's arguments as written so far
        self._n_calls = 0
        self._space = ""  # white space before a marker (content again if the calls fail)
        self._reasoned = False  # some reasoning text went out (leading white space is dropped)
        self._keys = ("arguments", "parameters")

    # -- feeding --

    def feed(self, text: str) -> list[Event]:
        if self._mode == "calls":
            self._raw += text
        self._buf += text
        out: list[Event] = []
        while True:
            before = (self._mode, len(self._buf))
            self._step(out, final=False)
            if (self._mode, len(self._buf)) == before:
                return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        for _ in range(8):
            self._step(out, final=True)
        if self._mode == "calls":
            if self._streaming is not None:
                self._end_partial(out)
            if self._n_calls == 0 and self._raw.strip():
                out.append(Event("content", self._raw))
        elif self._mode in ("content", "content_start", "start"):
            rest = self._buf if self._mode == "content" else self._buf.lstrip()
            if rest:
                out.append(Event("content", rest))
        elif self._mode == "think" and self._buf:
            out.append(Event("reasoning", self._buf))
        self._buf = ""
        self._mode = "done"
        return out

    # -- the state machine --

    def _step(self, out: list[Event], *, final: bool) -> None:
        mode = self._mode
        if mode == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(_THINK_OPEN):
                self._buf = stripped[len(_THINK_OPEN) :]
                self._mode = "think"
            elif final or (stripped and not _THINK_OPEN.startswith(stripped)):
                self._mode = "content_start"
        elif mode == "think":
            if not self._reasoned:
                self._buf = self._buf.lstrip()
            at = self._buf.find(_THINK_CLOSE)
            if at >= 0:
                self._reason(out, self._buf[:at].rstrip())
                self._buf = self._buf[at + len(_THINK_CLOSE) :]
                self._mode = "content_start"
            else:
                keep = 0 if final else _held_with_space(self._buf, _THINK_CLOSE)
                emit = self._buf[: len(self._buf) - keep]
                if emit:
                    self._reason(out, emit)
                    self._buf = self._buf[len(emit) :]
        elif mode == "content_start":
            stripped = self._buf.lstrip()
            if not stripped:
                return
            self._buf = stripped
            if self.tools and self._starts_calls(stripped, final):
                return
            if self.tools and not final and self._may_start_calls(stripped):
                return  # wait: it could still be the start of a call
            self._mode = "content"
        elif mode == "content":
            self._content(out, final)
        elif mode == "calls":
            self._calls(out)

    def _reason(self, out: list[Event], text: str) -> None:
        if text:
            out.append(Event("reasoning", text))
            self._reasoned = True

    def _may_start_calls(self, text: str) -> bool:
        name = self.family.name
        if name == "hermes":
            return _HERMES_OPEN.startswith(text)
        if name == "mistral":
            return _MISTRAL.startswith(text)
        return _PYTHON_TAG.startswith(text)

    def _starts_calls(self, text: str, final: bool) -> bool:
        """At the start of the content: switch to calls when the answer is a call."""
        name = self.family.name
        lead = ""
        if name == "mistral" and text.startswith(_MISTRAL):
            lead = _MISTRAL
        elif name in ("llama3", "generic") and text.startswith(_PYTHON_TAG):
            lead = _PYTHON_TAG
        if name == "mistral" and not lead and not final and _MISTRAL.startswith(text):
            return True  # perhaps the start of the marker: wait
        body = text[len(lead) :].lstrip()
        opener = {"mistral": "[", "llama3": "{", "generic": "{"}.get(name)
        if (opener is not None and body.startswith(opener)) or (
            name == "hermes" and text.startswith(_HERMES_OPEN)
        ):
            self._raw = self._space + text
            self._space = ""
            self._buf = body if opener is not None else text
            self._mode = "calls"
            return True
        return bool(lead and not body and not final)  # the marker alone so far: wait

    def _content(self, out: list[Event], final: bool) -> None:
        marker = {"hermes": _HERMES_OPEN, "mistral": _MISTRAL}.get(self.family.name) if self.tools else None
        if marker is None:
            if self._buf:
                out.append(Event("content", self._buf))
                self._buf = ""
            return
        at = self._buf.find(marker)
        if at >= 0:
            before = self._buf[:at].rstrip()
            if before:
                out.append(Event("content", before))
            self._space = self._buf[len(before) : at]  # given back if the calls do not parse
            self._buf = self._buf[at:]
            self._mode = "content_start"  # the marker now starts the text
            return
        # white space before a marker is not content: held until something else follows
        keep = 0 if final else _held_with_space(self._buf, marker)
        emit = self._buf[: len(self._buf) - keep]
        if emit:
            out.append(Event("content", emit))
            self._buf = self._buf[len(emit) :]

    def _emit_call(self, out: list[Event], obj: object, raw: str) -> None:
        call = _call(obj, self._keys, raw.strip())
        streamed = self._streaming
        self._streaming = None
        if call is None:
            return
        self._n_calls += 1
        if streamed is None:
            out.append(Event("call", call=call))
            return
        name, sent = streamed
        rest = call.arguments[len(sent) :]
        if call.name == name and call.arguments.startswith(sent) and rest:
            out.append(Event("call_arguments", text=rest))
        out.append(Event("call_end", call=call))

    def _stream_partial(self, out: list[Event], body: str) -> None:
        """A call still being written: its name once known, then its arguments as they come (the
        families whose ids come after the arguments, Mistral, wait for the whole call)."""
        if self.family.name == "mistral":
            return
        head = _CALL_HEAD.match(body.lstrip())
        if head is None:
            return
        rest = body.lstrip()[head.end() :]
        if not rest.startswith("{"):
            return  # arguments as a string: whole at the end
        if self._streaming is None:
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return
            self._streaming = (name, "")
            out.append(Event("call_start", call=ParsedCall(name, "")))
        name, sent = self._streaming
        end = _value_end(rest, 0)
        written = rest if end is None else rest[:end]
        self._partial = written
        # hold back white space at the end (it may belong between the arguments and the brace)
        written = written if end is not None else written.rstrip()
        if len(written) > len(sent):
            out.append(Event("call_arguments", text=written[len(sent) :]))
            self._streaming = (name, written)

    def _end_partial(self, out: list[Event]) -> None:
        """The answer ended inside a streaming call: end it with its arguments as written."""
        assert self._streaming is not None
        name, sent = self._streaming
        self._streaming = None
        written = self._partial.rstrip()
        if written.startswith(sent) and len(written) > len(sent):
            out.append(Event("call_arguments", text=written[len(sent) :]))
        else:
            written = sent
        self._n_calls += 1
        out.append(Event("call_end", call=ParsedCall(name, written, partial=True)))

    def _calls(self, out: list[Event]) -> None:
        if self.family.name == "hermes":
            while True:
                start = self._buf.find(_HERMES_OPEN)
                end = self._buf.find(_HERMES_CLOSE, start) if start >= 0 else -1
                if end < 0:
                    if start >= 0:
                        self._stream_partial(out, self._buf[start + len(_HERMES_OPEN) :])
                    return
                body = self._buf[start + len(_HERMES_OPEN) : end]
                try:
                    obj = json.loads(body)
                except ValueError:
                    obj = None
                self._emit_call(out, obj, body)
                self._buf = self._buf[end + len(_HERMES_CLOSE) :]
        # JSON values one after another: objects, or (mistral) objects inside one array
        while True:
            text = self._buf.lstrip(" \t\r\n;,")
            if self.family.name == "mistral":
                if not self._in_array:
                    if not text.startswith("["):
                        self._buf = text
                        return
                    self._in_array = True
                    text = text[1:].lstrip(" \t\r\n,")
                if text.startswith("]"):
                    self._in_array = False
                    self._buf = ""
                    self._mode = "ended"
                    return
            if not text:
                self._buf = ""
                return
            try:
                obj, end = _DECODER.raw_decode(text)
            except ValueError:
                self._buf = text  # incomplete (or broken: then it stays, and finish says so)
                self._stream_partial(out, text)
                return
            self._emit_call(out, obj, text[:end])
            self._buf = text[end:]


def parse_answer(
    text: str, family: Family, *, tools: bool, thinks: bool = False, starts_thinking: bool = False
) -> Answer:
    """A whole answer, parsed as ``AnswerParser`` streams it."""
    parser = AnswerParser(family, tools=tools, thinks=thinks, starts_thinking=starts_thinking)
    answer = Answer()
    reasoning: list[str] = []
    content: list[str] = []
    for event in [*parser.feed(text), *parser.finish()]:
        if event.kind == "reasoning":
            reasoning.append(event.text)
        elif event.kind == "content":
            content.append(event.text)
        elif event.kind in ("call", "call_end") and event.call is not None:
            answer.calls.append(event.call)
    answer.content = "".join(content)
    if reasoning or (thinks and starts_thinking):
        answer.reasoning = "".join(reasoning).strip("\n")
    if answer.reasoning is not None:
        answer.content = answer.content.lstrip("\n")
    if answer.calls:
        answer.content = answer.content.strip()
    return answer
