"""The handle a caller holds for one answer: streamed pieces, then the result."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

from ..errors import ProtocolError, TimeshareError
from ..sampling import Sampling
from ..state import SwitchStats
from ..util.stream import TextStream
from ..worker import protocol

# ---- generation handle ---------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationResult:
    model: str
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: protocol.Usage
    switch: SwitchStats
    stop: str = ""  # the stop string that ended it ("": none, e.g. the model's end-of-turn token)


class Generation:
    """A request to one model: iterate it for streamed text pieces, or wait for ``result()``.

    The iterator blocks; it ends when the generation ends and raises the worker's error (a
    TimeshareError) if it failed. ``cancel()`` may be called from any thread at any time.
    """

    def __init__(
        self, model: str, request: protocol.Generate, on_cancel: Callable[[Generation], None]
    ) -> None:
        self.model = model
        self.request = request
        self._on_cancel = on_cancel  # posts the cancel to the pool thread
        self._stream = TextStream()
        self._parts: list[str] = []
        self._result: GenerationResult | None = None
        self.cancelled = False
        # pool-thread bookkeeping
        self._sent_at = 0.0
        self._load_crashes = 0  # the worker died this many times while this request waited for its load

    @property
    def req(self) -> str:
        return self.request.req

    @property
    def done(self) -> bool:
        return self._stream.done

    @property
    def text(self) -> str:
        """The text streamed so far."""
        return "".join(list(self._parts))

    def __iter__(self) -> Iterator[str]:
        return iter(self._stream)

    def cancel(self) -> None:
        """Stop generating; ``result()`` then reports finish_reason "cancelled" (or the text so far)."""
        if self._stream.done or self.cancelled:
            return
        self.cancelled = True
        self._on_cancel(self)

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._stream.wait(timeout):
            raise TimeoutError(f"{self.model} did not finish request {self.req} within {timeout} s")
        if self._stream.error is not None:
            raise self._stream.error
        assert self._result is not None
        return self._result

    # -- called on the pool thread only --

    def _feed(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._stream.put(text)

    def _finish(self, finish_reason: str, usage: protocol.Usage, switch: SwitchStats, stop: str = "") -> None:
        if self._stream.done:
            return
        self._result = GenerationResult(self.model, "".join(self._parts), finish_reason, usage, switch, stop)
        self._stream.close()

    def _fail(self, error: TimeshareError) -> None:
        self._stream.close(error)

    def _finish_cancelled(self) -> None:
        self._finish("cancelled", protocol.Usage(0, 0, 0), SwitchStats(switched=False))


# ---- building a request --------------------------------------------------------------------


def make_request(
    req: str,
    model_id: str,
    *,
    prompt: str | None,
    messages: Sequence[protocol.ChatMessage | Mapping[str, str]] | None,
    sampling: Sampling,
    conversation: str | None,
    cache_prompt: bool | None = None,
    tools: Sequence[protocol.ToolSpec] = (),
) -> protocol.Generate:
    """The ``Generate`` message for ``Pool.generate``'s arguments; ValueError when they are malformed."""
    chat: tuple[protocol.ChatMessage, ...] | None = None
    if messages is not None:
        chat = tuple(_chat_message(m) for m in messages)
    if not isinstance(sampling, Sampling):
        raise ValueError(f"invalid request for {model_id}: sampling must be a Sampling, not {sampling!r}")
    request = protocol.Generate(
        req=req,
        prompt=prompt,
        messages=chat,
        tools=tuple(tools),
        sampling=sampling,
        conversation=conversation,
        cache_prompt=cache_prompt,
    )
    try:
        protocol.check_generate(request)
        if prompt is not None and not prompt:
            # nothing to continue from: a model whose vocabulary adds no BOS would have no token at all
            raise ValueError("the prompt is empty: give some text to complete")
        protocol.encode(request)  # a string that is not Unicode (a lone surrogate) or a frame too big
    except ValueError as exc:
        raise ValueError(f"invalid request for {model_id}: {exc}") from None
    except ProtocolError as exc:
        raise ValueError(f"invalid request for {model_id}: {str(exc).removeprefix('protocol: ')}") from None
    return request


def _chat_message(m: protocol.ChatMessage | Mapping[str, str]) -> protocol.ChatMessage:
    if isinstance(m, protocol.ChatMessage):
        return m
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "user", "assistant") or not isinstance(content, str):
        raise ValueError(
            f"a chat message needs role system/user/assistant and a text content, got {dict(m)!r}"
        )
    return protocol.ChatMessage(cast(Literal["system", "user", "assistant"], role), content)
