"""The generation loop: one request's prefill, sampling and incremental text, driven through
llama-cpp-python's low-level API (``llama_decode`` of one token, ``llama_sampler_sample``).

``Llama.create_completion`` costs more per token than the GPU does on a fast device: it copies
Python lists, re-detokenizes the whole answer at every token and checks stop strings against all
of it. On an H200 (8B F16) it ran at 43-72 tok/s where a plain low-level loop ran at 175. This
loop does what it did, in the same order, with the same numerics:

- **prefill**: the prefix matching of ``Llama.generate`` (only the tokens after the common prefix
  of the context's ``input_ids`` and the prompt are evaluated; a prompt the context holds exactly,
  with live logits, samples at once), then ``Llama.eval`` in ``n_batch`` chunks: the same batches,
  so the same logits, and ``llm.input_ids``/``n_tokens`` (which the prompt cache and the KV
  snapshots rely on) stay right;
- **sampling**: a ``llama_sampler`` chain built once per request. Greedy (temperature 0) is
  ``greedy`` alone; otherwise ``top_k``, ``top_p``, ``min_p`` 0.05, ``temp``, ``dist(seed)``: the
  chain llama-cpp-python builds (its ``penalties`` and ``typical`` samplers are no-ops at their
  default values and are left out), so a seeded request answers as before;
- **decode**: one token per ``llama_decode`` in a batch allocated once (position ``n_tokens``,
  sequence 0, logits on); the token a generation ends on is not evaluated (as before: the KV holds
  the prompt and every answer token but the last);
- **text**: each token's piece (``llama_token_to_piece``, cached per token id) goes through an
  incremental UTF-8 decoder (a character split across tokens comes out whole; an incomplete one at
  the end is dropped, as llama-cpp-python drops it); stop strings are searched only in the text
  not yet emitted plus the new piece, and a suffix that could start a stop string is held back
  until the next token decides. The answer ends at the earliest stop string (ties: the first in
  the list), which is reported.

Greedy answers are bit-for-bit those of ``create_completion`` (tests/test_decode.py compares them
on both demo models), including its way with a token limit reached inside a multi-byte character:
it samples on until the character is complete (here: at most ``_UTF8_GRACE`` more tokens), so
``completion_tokens`` may exceed ``max_tokens`` by a few. One difference: a request without
``seed`` gets a random one (llama-cpp-python derived it from the previous request's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ..errors import CancelledError
from ..sampling import Sampling
from .protocol import FinishReason
from .sampler import Sampler, TokenLogprob
from .textstream import TextStream

#: a token limit reached inside a multi-byte character: sample up to this many more tokens to
#: finish it (create_completion did the same, without a bound)
_UTF8_GRACE = 4


def usable_n_ctx(llm: Any) -> int:
    """The tokens a context holds: llama.cpp pads n_ctx up to a multiple of 256, but
    llama-cpp-python's ``input_ids`` (which the KV bookkeeping follows) has the size asked for."""
    return min(int(llm.n_ctx()), len(llm.input_ids))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if differ.size else n


@dataclass(frozen=True)
class Decoded:
    finish_reason: FinishReason
    completion_tokens: int  # sampled tokens, the end-of-generation token not counted
    evaluated: int  # prompt tokens this request prefilled
    text: str
    stop: str  # the stop string that ended it, or ""


class Decoder:
    """The loop, for one ``Llama`` (reuses a one-token batch across requests)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._batch: Any = llama_cpp.llama_batch_init(1, 0, 1)
        self._batch.n_seq_id[0] = 1
        self._batch.seq_id[0][0] = 0
        self._batch.logits[0] = 1
        self._pieces: dict[int, bytes] = {}
        self._n_ctx = usable_n_ctx(llm)
        self._n_batch = max(1, int(llm.n_batch))
        self.evaluated = 0  # prompt tokens the current (or last) request prefilled

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None

    def _to_evaluate(self, tokens: list[int]) -> list[int]:
        """``Llama.generate``'s prefix matching: cut the context back to the longest common prefix
        with the prompt (keeping at least the last prompt token to evaluate, unless the context
        holds exactly the prompt with live logits) and return the tokens left to evaluate."""
        llm = self.llm
        n = int(llm.n_tokens)
        if n > 0:
            prefix = common_prefix(llm.input_ids[:n], tokens)
            consumed = prefix == len(tokens)
            if consumed and n == len(tokens) and not llm._requires_eval:
                return []
            reuse = prefix - 1 if consumed else prefix
            if reuse > 0 and llm._ctx.kv_cache_seq_rm(-1, reuse, -1):
                llm.n_tokens = reuse
                llm._requires_eval = True
                return tokens[reuse:]
        llm.reset()
        return tokens

    def _decode_one(self, token: int) -> None:
        llm = self.llm
        n = int(llm.n_tokens)
        batch = self._batch
        batch.n_tokens = 1
        batch.token[0] = token
        batch.pos[0] = n
        rc = int(llama_cpp.llama_decode(llm.ctx, batch))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        llm.input_ids[n] = token
        llm.n_tokens = n + 1
        llm._requires_eval = False

    def run(
        self,
        tokens: list[int],
        sampling: Sampling,
        *,
        stop: Sequence[str],
        emit: Callable[[str], None],
        before_step: Callable[[], None],
        records: Callable[[list[TokenLogprob]], None] | None = None,
    ) -> Decoded:
        """Prefill ``tokens`` (what the context does not hold yet) and generate. ``before_step``
        runs before every prefill chunk and every decode step and may raise CancelledError
        (finish_reason "cancelled"; what was emitted stays the answer)."""
        llm = self.llm
        room = self._n_ctx - len(tokens)
        max_tokens = sampling.max_tokens or 0
        if max_tokens <= 0 or max_tokens >= room:
            max_tokens = room
        text = TextStream(llm, stop, self._pieces)
        sampler = Sampler(llm, sampling)
        eog = llama_cpp.llama_vocab_is_eog
        vocab = llm._model.vocab
        finish: FinishReason = "length"
        self.evaluated = 0
        completion = 0
        try:
            pending = self._to_evaluate(tokens)
            if not pending:
                before_step()
            for i in range(0, len(pending), self._n_batch):
                before_step()
                chunk = pending[i : i + self._n_batch]
                llm.eval(chunk)
                self.evaluated += len(chunk)
            while True:
                token = sampler.sample(llm.ctx)
                if eog(vocab, token):
                    finish = "stop"
                    break
                completion += 1
                piece = text.push(token)
                if piece:
                    if records is not None:
                        records(sampler.take_records())  # the tokens this piece completes
                    emit(piece)
                if text.stop:
                    finish = "stop"
                    break
                if completion >= max_tokens and (
                    not text.incomplete or completion >= min(room, max_tokens + _UTF8_GRACE)
                ):
                    break
                before_step()
                self._decode_one(token)
        except CancelledError:
            finish = "cancelled"
        finally:
            sampler.close()
        if finish != "cancelled" and not text.stop:
            rest = text.flush()
            if rest:
                if records is not None:
                    records(sampler.take_records())
                emit(rest)
        return Decoded(finish, completion, self.evaluated, text.text, text.stop)
