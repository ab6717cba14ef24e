"""One answer, seen from the GUI: ``AnswerStream`` is the ChatTurn's listener. The turn's own pump
thread (the one relay thread of an answer) calls it; it only emits signals, which reach the chat
window's slots queued on the GUI thread. Nothing here touches a widget or waits.

The stream exists before its turn does: the window creates it when Send is pressed, the bridge
starts the turn off the GUI thread and ``attach`` hands it over (a Stop pressed meanwhile cancels
the turn as soon as it exists).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Signal

from .qt_compat import emit

if TYPE_CHECKING:
    from ..core.conversations.chat import ChatResult, ChatTurn


#: the longest the turn's thread waits for ``attach`` (which follows the turn's creation at once)
ATTACH_WAIT_S = 30.0


class AnswerStream(QObject):
    """The listener of one answer (a ChatTurn); its signals reach the GUI thread queued."""

    started = Signal()  # the turn exists: the user's message is saved
    refused = Signal(object)  # the turn could not start (the error)
    piece = Signal(str)
    first_token = Signal()
    finished = Signal(object, object)  # (result or None, error or None)

    def __init__(self) -> None:
        super().__init__()
        self.generation: ChatTurn | None = None
        self.first_at: float | None = None  # when the first piece arrived
        self._lock = threading.Lock()
        self._cancelled = False
        # the pump waits for this before its first signal, so that `started` always comes first
        self._attached = threading.Event()

    def attach(self, turn: ChatTurn) -> None:
        """The turn this stream listens to (from the thread that started it)."""
        with self._lock:
            self.generation = turn
            cancelled = self._cancelled
        emit(self.started)
        self._attached.set()
        if cancelled:
            turn.cancel()

    def cancel(self) -> None:
        """Stop the answer: now if it has started, else as soon as it does."""
        with self._lock:
            self._cancelled = True
            turn = self.generation
        if turn is not None:
            turn.cancel()

    # ---- the turn's pump thread ------------------------------------------------------------

    def piece_arrived(self, text: str) -> None:
        self._attached.wait(ATTACH_WAIT_S)
        if self.first_at is None:
            self.first_at = time.monotonic()
            emit(self.first_token)
        emit(self.piece, text)

    def turn_finished(self, result: ChatResult | None, error: BaseException | None) -> None:
        self._attached.wait(ATTACH_WAIT_S)
        emit(self.finished, result, error)


class StreamListener:
    """Adapts an AnswerStream to ChatTurn's listener protocol (``piece`` and ``finished`` are
    Qt signal names on the stream)."""

    def __init__(self, stream: AnswerStream) -> None:
        self._stream = stream

    def piece(self, text: str) -> None:
        self._stream.piece_arrived(text)

    def finished(self, result: ChatResult | None, error: BaseException | None) -> None:
        self._stream.turn_finished(result, error)
