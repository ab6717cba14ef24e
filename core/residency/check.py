"""The bitwise check shared by ``timeshare doctor`` and ``timeshare bench residency``: greedy
logits of a few decode steps after a fixed prompt, replayed from the same KV prefix."""

from __future__ import annotations

from typing import Any

import llama_cpp  # before numpy (a GPU-image segfault otherwise); sorted that way too
import numpy as np

PROMPT = b"The quick brown fox jumps over the lazy dog. Once upon a time, in a quiet village,"


class GreedyReplay:
    """Prefills ``prompt`` (all but its last token) once; :meth:`run` rewinds to that prefix and
    returns the raw logits bytes of ``steps`` greedy decode steps. The prefix KV cells are reused,
    so a restore that lost or changed them (or any weight) shows up as different bytes."""

    def __init__(self, llm: Any, prompt: bytes = PROMPT, n_prefill: int = 0) -> None:
        self.llm = llm
        tokens = list(llm.tokenize(prompt))
        if n_prefill > len(tokens):  # a long prefix (benchmarks): repeat the prompt
            tokens = (tokens * (n_prefill // max(len(tokens), 1) + 1))[:n_prefill]
        self.tokens = tokens
        llm.eval(tokens[:-1])
        self.n_prefix = int(llm.n_tokens)
        self.n_vocab = int(llm.n_vocab())

    def run(self, steps: int = 8) -> list[bytes]:
        llm = self.llm
        llm.n_tokens = self.n_prefix  # eval() removes the KV cells after n_tokens first
        token = self.tokens[-1]
        out: list[bytes] = []
        for _ in range(steps):
            llm.eval([token])
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
            out.append(logits.tobytes())
            token = int(logits.argmax())
        return out
