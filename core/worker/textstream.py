"""Token pieces to text, incrementally, with stop strings: one per sequence (see ``decode``)."""

from __future__ import annotations

import codecs
import ctypes
from collections.abc import Sequence
from typing import Any

import llama_cpp


class TextStream:
    """Token pieces to text, incrementally, with stop strings (see the module docstring)."""

    def __init__(self, llm: Any, stop: Sequence[str], pieces: dict[int, bytes]) -> None:
        self._vocab = llm._model.vocab
        self._bos = int(llm.token_bos())
        self._stops = [s for s in stop if s]
        self._pieces = pieces  # token id -> bytes, shared across requests (the engine keeps it)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._held = ""  # decoded text not emitted yet: it could be the start of a stop string
        self._first = True
        self.stop = ""  # the stop string the text ended on
        self.parts: list[str] = []  # everything emitted

    def piece(self, token: int) -> bytes:
        """A token's text as bytes (llama_token_to_piece; cached per token id)."""
        return self._piece(token)

    def _piece(self, token: int) -> bytes:
        return token_piece(self._vocab, token, self._pieces)

    def push(self, token: int) -> str:
        """Add a sampled token; returns the text that may be emitted now ("" while held). After a
        stop string was found, ``stop`` names it and the text before it has been returned."""
        piece = self._piece(token)
        if self._first:
            self._first = False
            if token == self._bos and piece.startswith(b" "):  # llama-cpp-python's detokenize
                piece = piece[1:]
        window = self._held + self._decoder.decode(piece)
        if not self._stops:
            self._held = ""
            return self._out(window)
        found = -1
        for s in self._stops:
            at = window.find(s)
            if at >= 0 and (found < 0 or at < found):
                found, self.stop = at, s
        if found >= 0:
            self._held = ""
            return self._out(window[:found])
        keep = _held_len(window, self._stops)
        self._held = window[len(window) - keep :] if keep else ""
        return self._out(window[: len(window) - keep])

    @property
    def incomplete(self) -> bool:
        """Whether the text ends inside a multi-byte character (its first bytes are buffered)."""
        return bool(self._decoder.getstate()[0])

    def flush(self) -> str:
        """The answer ended without a stop string: what was held back (an incomplete UTF-8
        sequence at the end is dropped)."""
        rest = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return self._out(rest)

    def _out(self, text: str) -> str:
        if text:
            self.parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.parts)


def token_piece(vocab: Any, token: int, cache: dict[int, bytes]) -> bytes:
    """A token's text as bytes (``llama_token_to_piece``, special tokens as nothing), cached in
    ``cache``."""
    piece = cache.get(token)
    if piece is None:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        piece = buf.raw[: max(n, 0)]
        cache[token] = piece
    return piece


def _held_len(text: str, stops: Sequence[str]) -> int:
    """The longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for i in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:i]):
                best = i
                break
    return best
