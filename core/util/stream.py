"""A stream of text pieces from one producer thread to any number of blocking readers."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

_END = object()


class TextStream:
    """Pieces go in with ``put`` and the stream ends with ``close`` (with the error, if any).

    Iterating blocks for the next piece, stops at the end and then raises the error the stream
    was closed with. Several threads may iterate; each sees the end. ``put`` and ``close`` belong
    to one producer; ``close`` after the first has no effect.
    """

    def __init__(self) -> None:
        self._pieces: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._done = threading.Event()
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the end; False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def put(self, text: str) -> None:
        self._pieces.put(text)

    def close(self, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self.error = error
        self._done.set()
        self._pieces.put(_END)

    def __iter__(self) -> Iterator[str]:
        while True:
            item = self._pieces.get()
            if item is _END:
                self._pieces.put(_END)  # for any other thread iterating too
                if self.error is not None:
                    raise self.error
                return
            assert isinstance(item, str)
            yield item
