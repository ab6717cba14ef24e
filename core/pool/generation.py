"""The handle a caller holds for one answer: streamed pieces, then the result."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from ..errors import ProtocolError, TimeshareError
from ..sampling import Sampling
from ..state import SwitchStats
from ..util.stream import TextStream
from ..wire import protocol

# ---- generation handle ---------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationResult:
    model: str
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: protocol.Usage
    switch: SwitchStats
    stop: str = ""  # the stop string that ended it ("": none, e.g. the model's end-of-turn token)
    # per sampled token, when the request asked for logprobs (Sampling.logprobs / top_logprobs)
    logprobs: tuple[protocol.TokenLogprobs, ...] = ()
    # an Embed request's vectors, in its inputs' order (a rerank's: each document's scores)
    embeddings: tuple[tuple[float, ...], ...] = ()
    batch_size: int = 1  # the most requests its worker decoded together while it ran
    timings: protocol.Timings | None = None  # where its first token went, as its worker measured it
    # the prompt tokens' entries (``prompt_logprobs``; see protocol.PromptLogprobs)
    prompt_logprobs: tuple[protocol.TokenLogprobs, ...] = ()


@dataclass
class Dispatch:
    """The pool thread's record of sending one request to its worker (read and written there only)."""

    sent_at: float = 0.0  # time.monotonic() when it was last sent
    load_crashes: int = 0  # the worker died this many times while this request waited for its load
    resent: bool = False  # sent again after its worker crashed before answering it
    crashes: list[float] = field(
        default_factory=list
    )  # monotonic times of its worker's crashes while in flight


class Generation:
    """A request to one model: iterate it for streamed text pieces, or wait for ``result()``.

    The iterator blocks; it ends when the generation ends and raises the worker's error (a
    TimeshareError) if it failed. ``cancel()`` may be called from any thread at any time.

    Its producer is the pool thread (the one writer): :meth:`feed` and :meth:`add_embeddings` as
    the worker's messages come, then :meth:`finish`, :meth:`finish_cancelled` or :meth:`fail`
    (the first of them ends it; later ones are ignored). Consumers only iterate, ``result()``,
    ``piece_logprobs()`` and ``cancel()``.
    """

    def __init__(
        self,
        model: str,
        request: protocol.Generate | protocol.Embed,
        on_cancel: Callable[[Generation], None],
    ) -> None:
        self.model = model
        self.request = request
        self._on_cancel = on_cancel  # posts the cancel to the pool thread
        self._stream = TextStream()
        self._parts: list[str] = []
        self._logprobs: list[protocol.TokenLogprobs] = []
        # each streamed piece's logprob entries, in the pieces' order (see ``piece_logprobs``)
        self._piece_logprobs: collections.deque[tuple[protocol.TokenLogprobs, ...]] = collections.deque()
        self._embeddings: list[tuple[float, ...]] = []
        self._prompt_logprobs: list[protocol.TokenLogprobs] = []
        self._result: GenerationResult | None = None
        self.cancelled = False
        #: time.monotonic() when its first piece of text arrived (None: none yet); a whole answer's
        #: waiter tells from it when the decode of the rest began
        self.first_piece_at: float | None = None
        self.dispatch = Dispatch()  # the pool thread's record of sending it

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

    def piece_logprobs(self) -> tuple[protocol.TokenLogprobs, ...]:
        """The logprob entries of the piece the iterator gave last (call once per piece, from the
        one thread that iterates)."""
        return self._piece_logprobs.popleft() if self._piece_logprobs else ()

    # -- the producer: called on the pool thread only --

    def feed(self, text: str, logprobs: tuple[protocol.TokenLogprobs, ...] = ()) -> None:
        """A piece of the answer (and the logprobs of the tokens it completes) arrived."""
        self._logprobs.extend(logprobs)
        if text:
            if self.first_piece_at is None:
                self.first_piece_at = time.monotonic()
            self._parts.append(text)
            self._piece_logprobs.append(logprobs)
            self._stream.put(text)

    def prompt_logprobs(self) -> tuple[protocol.TokenLogprobs, ...]:
        """The prompt tokens' entries so far: all of them once its first piece has arrived or it
        has ended (the worker sends them before any Token)."""
        return tuple(self._prompt_logprobs)

    def add_prompt_logprobs(self, entries: tuple[protocol.TokenLogprobs, ...]) -> None:
        """Entries of the prompt's tokens arrived (``PromptLogprobs``), in order."""
        self._prompt_logprobs.extend(entries)

    def drop_partial(self) -> None:
        """It is sent again (its worker crashed before any text): what came without text (an
        echo's prompt entries, an Embed's first vectors) comes again with the answer."""
        self._prompt_logprobs.clear()
        self._embeddings.clear()

    def add_embeddings(self, data: tuple[tuple[float, ...], ...]) -> None:
        """Vectors of an Embed request arrived, in its inputs' order."""
        self._embeddings.extend(data)

    def finish(
        self,
        finish_reason: str,
        usage: protocol.Usage,
        switch: SwitchStats,
        stop: str = "",
        batch_size: int = 1,
        timings: protocol.Timings | None = None,
    ) -> None:
        """It ended (``Done``): the result is the text fed, and what the worker reported."""
        if self._stream.done:
            return
        self._result = GenerationResult(
            self.model,
            "".join(self._parts),
            finish_reason,
            usage,
            switch,
            stop,
            tuple(self._logprobs),
            tuple(self._embeddings),
            batch_size,
            timings,
            tuple(self._prompt_logprobs),
        )
        self._stream.close()

    def fail(self, error: TimeshareError) -> None:
        """It failed: the iterator and ``result()`` raise ``error``."""
        self._stream.close(error)

    def finish_cancelled(self) -> None:
        """It was cancelled before its worker answered it (dropped from the queue)."""
        self.finish("cancelled", protocol.Usage(0, 0, 0), SwitchStats(switched=False))


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
    images: Sequence[protocol.ImagePart] = (),
    prompt_logprobs: bool = False,
    score_only: bool = False,
    prompt_tokens: Sequence[int] | None = None,
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
        images=tuple(images),
        prompt_logprobs=prompt_logprobs,
        score_only=score_only,
        prompt_tokens=None if prompt_tokens is None else tuple(int(t) for t in prompt_tokens),
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


def make_embed_request(req: str, model_id: str, inputs: Sequence[str | Sequence[int]]) -> protocol.Embed:
    """The ``Embed`` message for ``Pool.embed``; ValueError when the inputs are malformed."""
    items: list[str | tuple[int, ...]] = []
    for item in inputs:
        if isinstance(item, str):
            items.append(item)
        elif all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item):
            items.append(tuple(int(t) for t in item))
        else:
            raise ValueError(f"invalid request for {model_id}: an input must be a string or token ids")
    if not items or not all(items):
        raise ValueError(f"invalid request for {model_id}: give at least one non-empty input")
    request = protocol.Embed(req=req, inputs=tuple(items))
    try:
        protocol.encode(request)
    except ProtocolError as exc:
        raise ValueError(f"invalid request for {model_id}: {str(exc).removeprefix('protocol: ')}") from None
    return request


def make_rerank_request(req: str, model_id: str, query: str, documents: Sequence[str]) -> protocol.Embed:
    """The ``Embed`` message (with its ``query``) for ``Pool.rerank``; ValueError when the query
    or a document is not a non-empty string, or the frame would be too large."""
    if not isinstance(query, str) or not query:
        raise ValueError(f"invalid request for {model_id}: the query must be a non-empty string")
    if not documents or not all(isinstance(d, str) for d in documents):
        raise ValueError(f"invalid request for {model_id}: give at least one document, each a string")
    request = protocol.Embed(req=req, inputs=tuple(documents), query=query)
    try:
        protocol.encode(request)
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
