"""The bridge that runs an answer off the GUI thread: ``AnswerStream`` iterates one ChatService
``ChatTurn`` on a Python thread and only emits signals, which reach the chat window's slots queued
on the GUI thread; nothing here touches a widget.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Signal

from .qt_compat import emit

if TYPE_CHECKING:
    from ..core.conversations.chat import ChatTurn


class AnswerStream(QObject):
    """Iterates one answer (a ChatTurn) on a Python thread; its signals reach the GUI thread queued."""

    piece = Signal(str)
    first_token = Signal()
    finished = Signal(object, object)  # (result or None, error or None)

    def __init__(self, generation: ChatTurn) -> None:
        super().__init__()
        self.generation = generation
        self.first_at: float | None = None  # when the first piece arrived
        self._thread = threading.Thread(target=self._run, name="chat-stream", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            for text in self.generation:
                if self.first_at is None:
                    self.first_at = time.monotonic()
                    emit(self.first_token)
                emit(self.piece, text)
            result = self.generation.result(timeout=30.0)
            emit(self.finished, result, None)
        except Exception as e:
            emit(self.finished, None, e)
