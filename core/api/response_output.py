"""The Responses API, answer side: an answer's events (``chatformat.parse``: content, reasoning,
tool calls) as the Responses API's output items, and the stream events that build them.

One :class:`Output` per answer, fed the parser's events as the text comes (or all at once for a
whole answer): every step returns the stream events it makes, in the order the official ``openai``
client assembles (``response.output_item.added``, ``response.content_part.added``, the deltas,
their ``.done``, ``response.output_item.done``), and keeps the items for the response object, so a
streamed and a whole answer have the same items.

- content: a ``message`` item (``role`` assistant) with one ``output_text`` part;
- reasoning (a thinking model's ``<think>`` block): a ``reasoning`` item, its text as a
  ``reasoning_text`` content part (``summary`` empty: nothing summarises it);
- a tool call: a ``function_call`` item (``call_id`` ``call_`` and 24 letters and digits; a
  function of a ``namespace`` tool names it in ``namespace``), its arguments streamed as
  ``response.function_call_arguments.delta`` as the model writes them.

Ids: ``msg_``, ``rs_``, ``fc_`` and 32 hexadecimal digits.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Mapping, Sequence
from typing import Any

from ..chatformat.parse import Event
from ..wire.protocol import ChatMessage, TokenLogprobs, ToolCall
from .logprobs import chat_logprobs

_ALNUM = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def logprob_entries(entries: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """The ``logprobs`` of an ``output_text`` part (the chat shape's ``content`` entries)."""
    out: list[dict[str, Any]] = chat_logprobs(entries)["content"]
    return out


class Output:
    """The output items of one answer and the stream events that build them (see the module
    docstring). ``feed`` events as they come, then ``finish``; ``items`` is the response's
    ``output``, ``message`` the turn's output as a chat message (for a later turn's history)."""

    def __init__(self, logprobs: bool = False, namespaces: Mapping[str, str] | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self._namespaces = namespaces or {}  # a namespace tool's functions: name -> namespace
        self._open: dict[str, Any] | None = None  # the item being written
        self._logprobs = logprobs
        self._pending: list[TokenLogprobs] = []  # a piece's logprobs, for its first text delta
        self.sequence = 0  # the last event's sequence_number
        self.cut = False  # a call was cut short (the answer ended inside it)

    # -- events --

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        """A stream event of type ``kind`` with the next ``sequence_number``."""
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **data}

    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        out = [self.event("response.output_item.added", output_index=self._index(), item=_copy(item))]
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": []}
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": ""}
            item["content"].append(dict(part))
            if item["type"] == "message" and self._logprobs:
                item["content"][0]["logprobs"] = []
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(),
                    content_index=0,
                    part=part,
                )
            )
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        wanted = "message" if kind == "content" else "reasoning"
        if self._open is None or self._open["type"] != wanted:
            out += self._close("completed")
            fresh: dict[str, Any]
            if wanted == "message":
                fresh = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant"}
            else:
                fresh = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress"}
            fresh["content"] = []
            out += self._start(fresh)
        item = self._open
        assert item is not None
        if not text:
            return out
        part = item["content"][0]
        part["text"] += text
        if wanted == "reasoning":
            delta = self.event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=self._index(),
                content_index=0,
                delta=text,
            )
            return [*out, delta]
        entries = logprob_entries(self._pending) if self._logprobs else []
        self._pending.clear()
        if entries:
            part["logprobs"].extend(entries)
        delta = self.event(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=self._index(),
            content_index=0,
            delta=text,
            logprobs=entries,
        )
        return [*out, delta]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """End the item being written (its ``.done`` events)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index()
        out: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            item["status"] = "incomplete" if status == "incomplete" or self.cut else "completed"
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            item["status"] = status
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                out.append(
                    self.event(
                        "response.output_text.done",
                        **ids,
                        text=part["text"],
                        logprobs=part.get("logprobs", []),
                    )
                )
            else:
                out.append(self.event("response.reasoning_text.done", **ids, text=part["text"]))
            out.append(self.event("response.content_part.done", **ids, part=dict(part)))
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    def _call_start(self, name: str) -> list[dict[str, Any]]:
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": call_id(),
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        if name in self._namespaces:  # a function of a namespace tool: the client routes it by both
            item["namespace"] = self._namespaces[name]
        return [*self._close("completed"), *self._start(item)]

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None or item["type"] != "function_call" or not text:
            return []
        item["arguments"] += text
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self._index(),
                delta=text,
            )
        ]

    def feed(self, events: Sequence[Event], logprobs: Sequence[TokenLogprobs] = ()) -> list[dict[str, Any]]:
        """The stream events of the answer's next events (``logprobs``: the tokens of the piece
        they came from, given to its first text delta)."""
        if self._logprobs:
            self._pending.extend(logprobs)
        out: list[dict[str, Any]] = []
        for e in events:
            if e.kind in ("content", "reasoning"):
                if e.text:
                    out += self._text(e.kind, e.text)
            elif e.kind == "call_start" and e.call is not None:
                out += self._call_start(e.call.name)
            elif e.kind == "call_arguments":
                out += self._arguments(e.text)
            elif e.kind == "call_end" and e.call is not None:
                item = self._open
                if item is not None and item["type"] == "function_call":
                    # the arguments as the model wrote them (the pieces add up to them)
                    item["arguments"] = e.call.arguments
                    self.cut = self.cut or e.call.partial
                    out += self._close("completed")
            elif e.kind == "call" and e.call is not None:
                out += self._call_start(e.call.name)
                out += self._arguments(e.call.arguments or "{}")
                out += self._close("completed")
        return out

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """The end of the answer: the last item's ``.done`` events (``incomplete``: it was cut
        short). An answer without items gets one empty message."""
        out = self._close("incomplete" if incomplete else "completed")
        if not self.items:
            out += self._text("content", "")  # opens the message
            out += self._close("incomplete" if incomplete else "completed")
        return out

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [item for item in self.items if item["type"] == "function_call"]

    @property
    def text(self) -> str:
        return "".join(
            part.get("text", "")
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )

    def message(self) -> ChatMessage:
        """The answer as the assistant message a later turn's history holds (reasoning left out,
        as the chat templates leave earlier thinking out)."""
        calls = tuple(ToolCall(id=c["call_id"], name=c["name"], arguments=c["arguments"]) for c in self.calls)
        return ChatMessage(role="assistant", content=self.text, tool_calls=calls)


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (the events must not change as the item grows)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
        for part in out["content"]:
            if "logprobs" in part:
                part["logprobs"] = list(part["logprobs"])
    return out
