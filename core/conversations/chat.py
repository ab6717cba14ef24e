"""Chat: conversations from the store, answered by the pool, saved as they stream.

``ChatService.send`` saves the user message, creates an empty, incomplete assistant message and
asks the pool for an answer, passing the conversation id as the KV-sequence key (the worker keeps
the conversation's tokens in its KV cache, so a follow-up prefills only the new message). A pump
thread owns the streaming: it reads the pool's pieces, hands them to the caller through a queue,
saves the partial text at most every ``flush_interval_s`` and completes the message with its stats
at the end. The messages sent to the model always come from the store, so after a worker crash or
an app restart the conversation simply continues.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..errors import (
    CancelledError,
    ConversationBusyError,
    EmptyMessageError,
    InvalidTextError,
    TimeshareError,
)
from ..sampling import Sampling, for_front_end, new_conversation, unknown_fields
from ..state import SwitchStats
from ..util.stream import TextStream
from ..wire.protocol import ChatMessage, ImagePart
from .store import AnswerStats, Conversation, Message, Store

log = logging.getLogger(__name__)

TITLE_CHARS = 60


# ---- what ChatService needs from the pool (core/pool.py provides it) ------------------------


class UsageLike(Protocol):
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def prompt_tokens_evaluated(self) -> int: ...


class ResultLike(Protocol):
    @property
    def finish_reason(self) -> str: ...
    @property
    def usage(self) -> UsageLike: ...
    @property
    def switch(self) -> SwitchStats | None: ...
    @property
    def stop(self) -> str: ...  # the stop string that ended it ("": none)


class GenerationLike(Protocol):
    def __iter__(self) -> Iterator[str]: ...
    def cancel(self) -> None: ...
    def result(self, timeout: float | None = None) -> ResultLike: ...


class PoolLike(Protocol):
    def generate(
        self,
        model_id: str,
        *,
        prompt: str | None = ...,
        messages: Sequence[ChatMessage] | None = ...,
        sampling: Sampling = ...,
        conversation: str | None = ...,
    ) -> Any: ...

    def forget_conversation(self, conversation: str) -> int: ...


# ---- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatResult:
    conversation_id: str
    message_id: int  # the assistant message in the store
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: AnswerStats  # what was saved with the message


class TurnListener(Protocol):
    """Told of an answer as its pump thread sees it (from that thread: keep it short)."""

    def piece(self, text: str) -> None: ...
    def finished(self, result: ChatResult | None, error: BaseException | None) -> None: ...


class ChatTurn:
    """One answer being generated. Iterate it for text pieces (blocking), or wait for ``result()``.

    The answer is saved whether or not anyone iterates. ``cancel()`` works from any thread; the
    text so far stays saved (complete, finish_reason "cancelled"). The message gets its
    ``AnswerStats`` at the end (a failure: finish_reason "error", error, error_code). ``prewoken``
    (the caller restored the model while the user typed) sets ``prewoken`` on a finished or stopped
    answer that did not switch the GPU.
    """

    def __init__(
        self,
        store: Store,
        conversation: Conversation,
        user_message: Message,
        assistant_message: Message,
        generation: GenerationLike,
        *,
        started: float,
        flush_interval_s: float,
        prewoken: bool = False,
        listener: TurnListener | None = None,
    ) -> None:
        self.conversation_id = conversation.id
        self.model_id = conversation.model_id
        self.user_message = user_message
        self.assistant_message_id = assistant_message.id
        self._store = store
        self._gen = generation
        self._started = started
        self._flush_interval_s = flush_interval_s
        self._prewoken = prewoken
        self._stream = TextStream()
        self._result: ChatResult | None = None
        self._cancelled = False
        # told from the pump thread, so that a front end needs no relay thread of its own
        self._listener = listener
        self._pump = threading.Thread(target=self._run, name=f"chat-{conversation.id[:8]}", daemon=True)
        self._pump.start()

    # ---- caller side -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[str]:
        return iter(self._stream)

    def cancel(self) -> None:
        self._cancelled = True
        self._gen.cancel()

    @property
    def done(self) -> bool:
        return self._stream.done

    def result(self, timeout: float | None = None) -> ChatResult:
        if not self._stream.wait(timeout):
            raise TimeoutError(f"the answer in conversation {self.conversation_id} is not finished yet")
        if self._stream.error is not None:
            raise self._stream.error
        assert self._result is not None
        return self._result

    # ---- pump thread: the only writer of the assistant message while it streams ------------

    def _run(self) -> None:
        parts: list[str] = []
        first_piece_at: float | None = None
        last_flush = time.monotonic()
        flushed_len = 0
        error: BaseException | None = None
        try:
            for piece in self._gen:
                if first_piece_at is None:
                    first_piece_at = time.monotonic()
                parts.append(piece)
                self._stream.put(piece)
                if self._listener is not None:
                    self._listener.piece(piece)
                now = time.monotonic()
                if now - last_flush >= self._flush_interval_s:
                    text = "".join(parts)
                    if len(text) != flushed_len:
                        self._store.update_message(self.assistant_message_id, text, complete=False)
                        flushed_len = len(text)
                    last_flush = now
            result = self._gen.result()
            text = "".join(parts)
            stats = self._stats(result, first_piece_at, time.monotonic())
            if self._prewoken and not stats.switched:
                stats = replace(stats, prewoken=True)
            self._store.update_message(self.assistant_message_id, text, complete=True, stats=stats)
            self._result = ChatResult(
                self.conversation_id, self.assistant_message_id, text, result.finish_reason, stats
            )
        except BaseException as exc:  # the pump must record every failure, then hand it on
            text = "".join(parts)
            if isinstance(exc, CancelledError) or (self._cancelled and isinstance(exc, TimeshareError)):
                stats = AnswerStats("cancelled", model_id=self.model_id, prewoken=self._prewoken)
                self._save_quietly(text, True, stats)
                self._result = ChatResult(
                    self.conversation_id, self.assistant_message_id, text, "cancelled", stats
                )
            else:
                code = getattr(exc, "code", type(exc).__name__)
                stats = AnswerStats("error", model_id=self.model_id, error=str(exc), error_code=str(code))
                # keep what was generated, marked incomplete so the UI shows it was cut off
                self._save_quietly(text, False, stats)
                error = exc
                log.warning("generation in conversation %s failed: %s", self.conversation_id, exc)
        finally:
            self._stream.close(error)
            if self._listener is not None:
                self._listener.finished(self._result if error is None else None, error)

    def _save_quietly(self, text: str, complete: bool, stats: AnswerStats) -> None:
        try:
            self._store.update_message(self.assistant_message_id, text, complete=complete, stats=stats)
        except TimeshareError as exc:  # e.g. the conversation was deleted meanwhile
            log.warning("could not save the answer in conversation %s: %s", self.conversation_id, exc)

    def _stats(self, result: ResultLike, first_piece_at: float | None, ended: float) -> AnswerStats:
        usage = result.usage
        switch = result.switch or SwitchStats(switched=False)
        elapsed = ended - self._started
        gen_time = ended - first_piece_at if first_piece_at is not None else 0.0
        # after a Stop too: the worker counts the tokens generated before it (loop._apply_cancels)
        completion = usage.completion_tokens
        # tokens after the first, over the time after the first: the decode rate, not prefill
        tps = (completion - 1) / gen_time if gen_time > 0 and completion > 1 else 0.0
        return AnswerStats(
            finish_reason=result.finish_reason,
            model_id=self.model_id,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=completion,
            prompt_tokens_evaluated=usage.prompt_tokens_evaluated,
            switched=switch.switched,
            wait_ms=round(switch.wait_ms, 3),
            restore_ms=round(switch.restore_ms, 3),
            first_token_ms=round(switch.first_token_ms, 3),
            ttft_ms=round((first_piece_at - self._started) * 1000.0, 3)
            if first_piece_at is not None
            else None,
            elapsed_ms=round(elapsed * 1000.0, 3),
            tokens_per_s=round(tps, 3),
            stop=result.stop if result.finish_reason == "stop" else "",
        )


class ChatService:
    """Conversations answered by the pool. Thread-safe: the store locks, the pool queues."""

    def __init__(
        self,
        pool: PoolLike,
        store: Store,
        *,
        flush_interval_s: float = 0.5,
        system_prompt: str | None = None,
    ) -> None:
        self.pool = pool
        self.store = store
        self.flush_interval_s = flush_interval_s
        self.system_prompt = system_prompt
        self._lock = threading.Lock()
        self._active: dict[str, ChatTurn] = {}
        self._starting: set[str] = set()  # conversations between the busy check and their turn

    def new_conversation(self, model_id: str, title: str = "", *, base_model: bool = False) -> Conversation:
        """A conversation with the chat window's answer settings, or a base model's
        (``base_model``: no chat template; a shorter limit and the repetition guard)."""
        check_text(title, "the title")
        return self.store.create_conversation(model_id, title, answers=new_conversation(base_model))

    def delete(self, conversation_id: str) -> None:
        """Delete a conversation, its messages and its KV files (every model's)."""
        self.store.delete(conversation_id)
        self.pool.forget_conversation(conversation_id)

    def model_messages(self, conversation_id: str) -> tuple[ChatMessage, ...]:
        """What the model sees: the conversation's system prompt (else the service's), then the
        stored history (empty, unfinished answers left out)."""
        conversation = self.store.get(conversation_id)
        return self._model_messages(conversation, self.store.messages(conversation_id))

    def _model_messages(
        self, conversation: Conversation, history: Sequence[Message]
    ) -> tuple[ChatMessage, ...]:
        out: list[ChatMessage] = []
        system_prompt = conversation.system_prompt.strip() or self.system_prompt
        if system_prompt:
            out.append(ChatMessage("system", system_prompt))
        for m in history:
            if m.role == "assistant" and not m.complete and not m.content:
                continue
            out.append(ChatMessage(m.role, m.content, images=m.images))
        return tuple(out)

    def send(
        self,
        conversation_id: str,
        text: str,
        *,
        prewoken: bool = False,
        listener: TurnListener | None = None,
        continuation: bool = False,
        images: tuple[ImagePart, ...] = (),
        **sampling: Any,
    ) -> ChatTurn:
        """Save ``text`` as the user's message and start the model's answer.
        ``images``: the message's images (each placed in ``text``), saved with it and sent with
        the conversation's history every turn (a vision model keeps them in its KV cache).

        ``sampling``: fields of :class:`~timeshare.core.sampling.Sampling` (the rest come from the
        conversation's settings, ``Store.set_options``, then the "chat_window" row of
        ``sampling.DEFAULTS``); the pool gets the Sampling they make.
        ``prewoken``: the caller restored the model ahead of this request (noted in the stats).
        ``listener``: told of every piece and of the end from the turn's own thread.
        ``continuation``: the model continues the conversation's text (a base model: no chat
        template; see :func:`continuation_text`) instead of answering it as a chat.
        Raises UnknownConversationError, EmptyMessageError, InvalidTextError (text that is not
        Unicode: nothing is saved), and the pool's errors
        (UnknownModelError, ModelUnavailableError, QueueFullError) — in which case the user's
        message stays saved and ``regenerate`` can answer it later.
        """
        if not isinstance(text, str) or (not text.strip() and not images):
            raise EmptyMessageError("the message is empty: type something to send")
        check_text(text, "the message")
        _check_sampling(sampling)
        conversation = self.store.get(conversation_id)
        with self._reserved(conversation_id):
            user = self.store.add_message(conversation_id, "user", text, images=tuple(images))
            if not conversation.title:
                conversation = self.store.rename(conversation_id, _title_from(text))
            history = self.store.messages(conversation_id)
            return self._answer(conversation, user, history, sampling, prewoken, listener, continuation)

    def regenerate(
        self,
        conversation_id: str,
        *,
        prewoken: bool = False,
        listener: TurnListener | None = None,
        continuation: bool = False,
        **sampling: Any,
    ) -> ChatTurn:
        """Answer the last user message again: after a failure, a crash, or to get another answer
        (``continuation``: continue the text again, as :meth:`send`).

        A trailing assistant message (finished or not) is replaced.
        """
        _check_sampling(sampling)
        conversation = self.store.get(conversation_id)
        with self._reserved(conversation_id):
            history = self.store.messages(conversation_id)
            if not any(m.role == "user" for m in history):
                raise EmptyMessageError("there is no message to answer in this conversation: send one first")
            while history and history[-1].role == "assistant":
                self.store.delete_message(history.pop().id)
            # the history as it is now in the store: the trailing answers were just deleted
            return self._answer(
                conversation, history[-1], history, sampling, prewoken, listener, continuation
            )

    def active_turn(self, conversation_id: str) -> ChatTurn | None:
        """The answer still being generated in this conversation, if any."""
        with self._lock:
            turn = self._active.get(conversation_id)
            return turn if turn is not None and not turn.done else None

    @contextlib.contextmanager
    def _reserved(self, conversation_id: str) -> Iterator[None]:
        """Claim the conversation from the busy check until its turn is registered (or fails)."""
        with self._lock:
            turn = self._active.get(conversation_id)
            if conversation_id in self._starting or (turn is not None and not turn.done):
                raise ConversationBusyError(
                    "this conversation is still answering the previous message: wait for it or stop it"
                )
            self._starting.add(conversation_id)
        try:
            yield
        finally:
            with self._lock:
                self._starting.discard(conversation_id)

    def _answer(
        self,
        conversation: Conversation,
        user: Message,
        history: Sequence[Message],
        overrides: dict[str, Any],
        prewoken: bool,
        listener: TurnListener | None,
        continuation: bool = False,
    ) -> ChatTurn:
        if continuation:
            asked: dict[str, Any] = {"prompt": continuation_text(history, conversation.system_prompt)}
        else:
            asked = {"messages": self._model_messages(conversation, history)}
        assistant = self.store.add_message(conversation.id, "assistant", "", complete=False)
        started = time.monotonic()
        try:
            # the conversation's own settings, unless the caller gave others
            fields = {
                "temperature": conversation.temperature,
                "max_tokens": conversation.max_tokens,
                "repeat_penalty": conversation.repeat_penalty,
            }
            sampling = for_front_end("chat_window", **{**fields, **overrides})
            if conversation.max_tokens is None and overrides.get("max_tokens") is None:
                sampling = sampling.replace(max_tokens=None)  # the conversation's "no limit"
            generation = self.pool.generate(
                conversation.model_id, conversation=conversation.id, sampling=sampling, **asked
            )
        except BaseException:
            # nothing was generated: drop the placeholder, keep the user's message
            self.store.delete_message(assistant.id)
            raise
        turn = ChatTurn(
            self.store,
            conversation,
            user,
            assistant,
            generation,
            started=started,
            flush_interval_s=self.flush_interval_s,
            prewoken=prewoken,
            listener=listener,
        )
        with self._lock:
            self._active[conversation.id] = turn
            for cid in [c for c, t in self._active.items() if t.done]:
                del self._active[cid]
        return turn


def continuation_text(history: Sequence[Message], system_prompt: str = "") -> str:
    """A conversation as the one text a base model continues: the system prompt (if any) and a
    blank line, then the messages one after the other (a continuation follows its text exactly;
    a message of the user's after it gets a space where neither side has one); empty, unfinished
    answers left out."""
    text = f"{system_prompt.strip()}\n\n" if system_prompt.strip() else ""
    for m in history:
        if m.role == "system" or (m.role == "assistant" and not m.complete and not m.content):
            continue
        piece = m.content
        if m.role == "user" and text and piece and not text[-1].isspace() and not piece[0].isspace():
            text += " "
        text += piece
    return text


def check_text(text: str, what: str) -> None:
    """Refuse text that cannot be stored or sent as UTF-8 (a lone surrogate) with a sentence
    the chat window shows as it is (InvalidTextError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InvalidTextError(
            f"{what} holds a broken character (U+{code:04X} at position {exc.start + 1}: half of a "
            "surrogate pair, as a damaged paste or input method leaves): delete it and send again"
        ) from None


def _check_sampling(sampling: dict[str, Any]) -> None:
    unknown = unknown_fields(sampling)
    if unknown:
        raise TypeError(unknown)  # as for any unexpected keyword argument


def _title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"
