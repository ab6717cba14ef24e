"""Logprobs in OpenAI's shapes, from what the worker measured per sampled token (its piece of text
as bytes, the log-softmax of the raw logits at the sampled token, and the most likely
alternatives; see core/worker/sampler.py).

- chat (``logprobs: true``, ``top_logprobs: 0..20``): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}``; a streamed chunk
  carries the entries of its own tokens.
- completions (``logprobs: 0..20``, the number of alternatives): the legacy ``{"tokens",
  "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, offsets in characters
  of the answer text; with ``echo`` the prompt's tokens come first (a leading BOS left out) and
  the offsets count from the prompt's start; the first token's ``token_logprobs`` and
  ``top_logprobs`` are null (nothing precedes it: OpenAI's and llama-cpp-python's echo).

A token whose bytes are not whole UTF-8 (a character split across tokens) has its ``token``
string decoded with replacement characters; ``bytes`` is exact.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any, Protocol


class Alternative(Protocol):
    @property
    def piece(self) -> bytes: ...

    @property
    def logprob(self) -> float: ...


class Entry(Alternative, Protocol):
    @property
    def top(self) -> Sequence[Alternative]: ...


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(entries: Sequence[Entry]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": _text(e.piece),
                "logprob": e.logprob,
                "bytes": list(e.piece),
                "top_logprobs": [
                    {"token": _text(a.piece), "logprob": a.logprob, "bytes": list(a.piece)} for a in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


class CompletionOffsets:
    """``text_offset`` across a streamed answer: the characters decoded before each token."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def next(self, piece: bytes) -> int:
        at = self.chars
        self.chars += len(self._decoder.decode(piece))
        return at


def completion_logprobs(
    entries: Sequence[Entry], offsets: CompletionOffsets | None = None, *, null_first: bool = False
) -> dict[str, Any]:
    """The legacy shape; ``null_first``: the entries begin with an echoed prompt, whose first
    token has no logprob (null in ``token_logprobs`` and ``top_logprobs``)."""
    offsets = offsets or CompletionOffsets()
    top: list[dict[str, float] | None] = []
    for e in entries:
        alternatives: dict[str, float] = {}
        for a in e.top:
            alternatives.setdefault(_text(a.piece), a.logprob)
        top.append(alternatives)
    logprobs: list[float | None] = [e.logprob for e in entries]
    if null_first and entries:
        logprobs[0] = None
        top[0] = None
    return {
        "tokens": [_text(e.piece) for e in entries],
        "token_logprobs": logprobs,
        "top_logprobs": top,
        "text_offset": [offsets.next(e.piece) for e in entries],
    }
