"""The tools path of /v1/chat/completions, answer side: a chat answer's text as OpenAI's message
(``content``, ``tool_calls`` or the legacy ``function_call``, and llama-server's
``reasoning_content``) and ``finish_reason``, whole or as stream deltas in the shape the official
``openai`` client assembles: per call, a first delta with its ``index``, ``id``, ``type`` and
``function.name`` (arguments ""), then pieces of its ``function.arguments`` as the model writes
them (all at once for a call that comes whole, see ``chatformat.parse``).

A call's id is ``call_`` and 24 letters and digits, or for the Mistral family the 9 alphanumerics
its templates insist on (the model's own id when it wrote a valid one).
"""

from __future__ import annotations

import secrets
import string
from typing import Any

from ..chatformat.families import MISTRAL_ID
from ..chatformat.format import ChatFormat
from ..chatformat.parse import AnswerParser, Event, ParsedCall
from ..config.schema import ModelConfig
from .errors import BadRequestError
from .requests import GenerationRequest
from .tools import ToolPlan, prepare

_ALNUM = string.ascii_letters + string.digits


def _random_id(n: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


class ChatOutput:
    """One answer's shaping (see the module docstring); ``feed`` the text pieces as they come
    (streaming), or ``message`` the whole text."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        fmt = plan.fmt
        self.parser = AnswerParser(
            fmt.family,
            tools=plan.parses_calls,
            thinks=fmt.thinks,
            starts_thinking=fmt.starts_thinking,
        )
        self._legacy = plan.request is not None and plan.request.legacy
        self.calls: list[tuple[str, ParsedCall]] = []
        self._open = False  # a call is streaming its arguments
        self._pending_id = ""  # the id of the call being written
        self.content: list[str] = []
        self.reasoning: list[str] = []

    @property
    def needed(self) -> bool:
        """Whether the answer needs shaping at all (tools, or a thinking model)."""
        return self.plan.parses_calls or self.plan.fmt.thinks

    def _call_id(self, call: ParsedCall) -> str:
        if self.plan.fmt.family.name == "mistral":
            return call.id if call.id and MISTRAL_ID.match(call.id) else _random_id(9)
        return f"call_{_random_id(24)}"

    def deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        """The deltas of events of the answer (from :attr:`parser`)."""
        out: list[dict[str, Any]] = []
        for event in events:
            if event.kind == "content":
                self.content.append(event.text)
                out.append({"content": event.text})
            elif event.kind == "reasoning":
                self.reasoning.append(event.text)
                out.append({"reasoning_content": event.text})
            elif event.kind == "call_start" and event.call is not None:
                self._open = not (self._legacy and self.calls)  # functions: one call per answer
                if self._open:
                    out.append(self._head(event.call))
            elif event.kind == "call_arguments":
                if self._open:
                    out.append(self._arguments(event.text))
            elif event.kind == "call_end" and event.call is not None:
                if self._open:
                    self.calls.append((self._pending_id, event.call))
                self._open = False
            elif event.call is not None:  # a whole call
                if self._legacy and self.calls:
                    continue
                out.append(self._head(event.call))
                out.append(self._arguments(event.call.arguments))
                self.calls.append((self._pending_id, event.call))
        return out

    def _head(self, call: ParsedCall) -> dict[str, Any]:
        """The first delta of a call: index, id, type, name (arguments "")."""
        self._pending_id = self._call_id(call)
        name = call.name
        if self._legacy:
            return {"function_call": {"name": name, "arguments": ""}}
        index = len(self.calls)
        head = {"index": index, "id": self._pending_id, "type": "function"}
        return {"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, text: str) -> dict[str, Any]:
        if self._legacy:
            return {"function_call": {"arguments": text}}
        return {"tool_calls": [{"index": len(self.calls), "function": {"arguments": text}}]}

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas a streamed piece of the answer makes."""
        return self.deltas(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back, at the end of the answer."""
        return self.deltas(self.parser.finish())

    def finish_reason(self, reason: str) -> str:
        """``reason`` (the worker's), or the calls' when the answer is whole calls; a call cut by
        ``max_tokens`` keeps "length", as OpenAI answers (its arguments as far as written)."""
        if self.calls and not any(call.partial for _, call in self.calls):
            return "function_call" if self._legacy else "tool_calls"
        return reason

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as OpenAI's assistant message."""
        self.feed(text)
        self.finish()
        return self.assembled()

    def assembled(self) -> dict[str, Any]:
        """The message of what was fed and finished so far."""
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning or (self.plan.fmt.thinks and self.plan.fmt.starts_thinking):
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["content"] = content.strip() or None
            if self._legacy:
                _, call = self.calls[0]
                message["function_call"] = {"name": call.name, "arguments": call.arguments}
            else:
                message["tool_calls"] = [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for call_id, c in self.calls
                ]
        return message


def prepare_chat(
    req: GenerationRequest, model: ModelConfig | None, fmt: ChatFormat | None = None
) -> tuple[dict[str, Any], ChatOutput | None]:
    """``Pool.generate``'s keyword arguments for a chat request on ``model`` (None: unknown here,
    sent as it is), and the shaping its answer needs (None: plain text); ``fmt``: the chat format
    its worker reported (None: not yet). Blocking (see ``tools.prepare``); raises BadRequestError."""
    fields = req.pool_fields()
    if req.kind != "chat" or model is None or req.messages is None:
        if req.tools is not None:
            raise BadRequestError("'tools' go with /v1/chat/completions.", "tools")
        return fields, None
    prepared = prepare(req.messages, req.tools, model, fmt)
    grammar = prepared.plan.grammar
    if grammar is not None:
        if req.sampling.grammar is not None:
            raise BadRequestError(
                "'tools' and a grammar ('response_format' or 'grammar') both constrain the answer; "
                'send one of them (or tool_choice "none").',
                "tools",
            )
        fields["sampling"] = req.sampling.replace(
            grammar=grammar, grammar_triggers=prepared.plan.grammar_triggers
        )
    fields.update(messages=prepared.messages, tools=prepared.tools)
    output = ChatOutput(prepared.plan)
    return fields, output if output.needed else None
