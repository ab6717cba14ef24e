"""One sequence's sampler: the llama_sampler chain a request's ``Sampling`` asks for, its grammar,
and its logprob records.

The per-sequence contract shared by the generation loop (``decode``) and the features built on the
sampler (grammar, penalties, logit bias, logprobs): the loop owns the batch and the sequences; for
each sequence whose logits the last ``llama_decode`` produced it calls ``sample(ctx, idx)`` with the
row of that sequence's output in the batch (``llama_get_logits_ith`` semantics; -1 = the last row),
and gets the token, already accepted by the chain and the grammar. What else the Sampler records
per token (``records``: one ``TokenLogprob`` per sampled token when logprobs are asked for) lives
on it, one Sampler per sequence, freed with ``close``.

**The chain** (llama.cpp's order, as llama-server's ``common_sampler`` builds it), each link only
when its setting does something, so that a request with none of them samples exactly as before:

- ``logit_bias`` (when any pair is given), ``penalties`` (when ``Sampling.penalized``: repeat over
  the last ``repeat_last_n`` tokens, -1 = the context, presence, frequency). They count the
  tokens sampled in this answer, as OpenAI's and llama-cpp-python's penalties do (llama-server
  also feeds the prompt to its sampler), so a greedy answer with penalties equals
  ``create_completion``'s with the same penalties;
- temperature 0: ``greedy``; below 0: ``dist(seed)`` on the raw distribution; above 0: ``top_k``
  (0: none), ``top_p``, ``min_p``, ``temp``, ``dist(seed)`` (llama-cpp-python's chain: its
  ``typical`` sampler is a no-op at its default and left out).

Without a grammar the token comes from ``llama_sampler_sample`` itself, except for **plain greedy**
(``plain_greedy``: temperature 0 and nothing else: no bias, penalties, grammar or logprobs): the
chain is then llama.cpp's greedy sampler alone, whose token is the first index of the row's
largest logit (it scans with a strict ``>``, so ties go to the lowest id, and a NaN never wins
unless it is logit 0). ``GreedyRows`` takes it with one numpy ``argmax`` over every such row of
a step (argmax too returns the first maximum), handing back None for a row holding a NaN
(argmax would pick the NaN): that row goes through the chain. Greedy's ``accept`` keeps no state,
so skipping the chain leaves nothing behind. On an 8B model (128k vocabulary) the chain builds
and scans 128k candidates per sequence and step in C; the argmax is a fraction of that.

**Grammar** (GBNF, root ``root``) is applied **by rejection**, as llama-server's
``common_sampler_sample`` does: sample from the chain, check the one token against the grammar,
and only when the grammar rejects it mask the whole vocabulary with the grammar and sample again.
Checking one token is cheap; masking the vocabulary costs a walk of the grammar for each of its
tokens (``grammar_first=True`` does that at every token, for the bench that compares the two).
Both give the same greedy answer. The dist sampler draws once more when a token was rejected, as
llama-server's does, so seeded answers equal llama-server's, not the grammar-first ones.

**Lazy grammar** (``Sampling.grammar_triggers``, llama.cpp's
``llama_sampler_init_grammar_lazy_patterns``): the grammar does nothing until the text generated
so far matches one of the patterns (ECMAScript regexes, searched anywhere in the generated text;
one written ``^...$`` must match the whole text). From then on it applies, and it is fed the text
from the start of the pattern's first non-empty capturing group (the whole match when there is
none) on, tokens cut where that starts. The grammar must accept that text: llama.cpp aborts the
process when it does not (a C++ exception through its C API). Example: trigger
``<tool_call>`` with a grammar ``root ::= "<tool_call>" ...``; or trigger ``(\\{)"name"`` with a
grammar that starts at the brace. Bad patterns are refused here (``ValueError``) before llama.cpp
sees them.

**Logprobs** (``Sampling.logprobs`` or ``top_logprobs`` > 0): for every sampled token, the
log-softmax of the raw logits of the row it was sampled from (before bias, penalties or grammar),
the sampled token's value and the ``top_logprobs`` most likely tokens with theirs, as a
``TokenLogprob`` in ``records`` (an end-of-generation token gets none: it is not part of the
answer). ``take_records`` hands on those since its last call, with the text they made.
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ..chatformat.gbnf_check import GrammarLimitError, check_gbnf
from ..errors import InvalidGrammarError, InvalidSamplingError
from ..sampling import Sampling


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and its most likely alternatives (token, logprob),
    most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class GrammarError(InvalidGrammarError, ValueError):
    """A grammar or trigger pattern llama.cpp cannot use (the message says which)."""


class GrammarDeadEnd(GrammarError):
    """The grammar allows no token where the answer stands (raised by ``Sampler.sample``; the
    generation loop fails that sequence alone)."""


def check_triggers(patterns: Sequence[str]) -> None:
    """Refuse patterns that are not regexes (llama.cpp's std::regex would throw and abort)."""
    for p in patterns:
        if not p:
            raise GrammarError("a grammar trigger pattern may not be empty")
        try:
            re.compile(p)
        except re.error as exc:
            raise GrammarError(f"grammar trigger {p!r} is not a regular expression: {exc}") from None


def row_logprobs(block: Any, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The record of ``tokens[i]`` in row ``i`` of ``block`` (raw logits, one row per token): its
    log-softmax, as ``Sampler`` measures a sampled token's, and the ``top`` most likely tokens
    (the prompt tokens' logprobs of an echo). Computed in float64, a few rows at a time."""
    out: list[TokenLogprob] = []
    n_vocab = int(block.shape[1])
    k = min(top, n_vocab)
    step = 32
    for start in range(0, len(tokens), step):
        x = block[start : start + step].astype(np.float64)
        peak = x.max(axis=1, keepdims=True)
        lse = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=1))
        best = np.argpartition(-x, k - 1, axis=1)[:, :k] if k > 0 else None
        for j in range(x.shape[0]):
            token = int(tokens[start + j])
            alternatives: tuple[tuple[int, float], ...] = ()
            if best is not None:
                row_best = best[j][np.argsort(-x[j, best[j]], kind="stable")]
                alternatives = tuple((int(t), float(x[j, t] - lse[j])) for t in row_best)
            out.append(TokenLogprob(token, float(x[j, token] - lse[j]), alternatives))
    return out


class GreedyRows:
    """The greedy sampler's token for output rows of the last decode, by one argmax (see the
    module docstring); one per context's batch (it keeps a numpy view of the logits buffer while
    its address and the rows asked for stay the same: building the view cost more than the
    argmax)."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._view: tuple[int, int, Any] | None = None  # (base address, rows, the array)

    def _block(self, base: int, rows: int) -> Any:
        view = self._view
        if view is None or view[0] != base or view[1] != rows:
            buf = (ctypes.c_float * (rows * self.n_vocab)).from_address(base)
            view = (base, rows, np.frombuffer(memoryview(buf), dtype=np.float32).reshape(rows, self.n_vocab))
            self._view = view
        return view[2]

    def tokens(self, ctx: Any, rows: Sequence[int]) -> list[int | None]:
        """The token of each of ``rows`` (``llama_get_logits_ith`` indices), None for a row with
        a NaN logit (the chain decides). llama.cpp keeps a decode's outputs in one buffer, in the
        batch's order: one argmax over the block that holds the rows."""
        if not rows:
            return []
        addrs: list[int] = []
        for row in rows:
            addr = ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, row), ctypes.c_void_p).value
            if not addr:
                raise RuntimeError(f"llama.cpp has no logits for output row {row}")
            addrs.append(addr)
        stride = 4 * self.n_vocab
        base = min(addrs)
        at = [(a - base) // stride for a in addrs]
        if any(a - base != k * stride for a, k in zip(addrs, at, strict=True)):
            raise RuntimeError("llama.cpp's output rows are not whole rows of one buffer")
        block = self._block(base, max(at) + 1)
        best = block.argmax(axis=1)
        out: list[int | None] = []
        for k in at:
            token = int(best[k])
            out.append(None if math.isnan(float(block[k, token])) else token)
        return out


class Sampler:
    """A llama_sampler chain for one sequence (free it with ``close``)."""

    def __init__(
        self,
        llm: Any,
        sampling: Sampling,
        *,
        grammar_first: bool = False,
    ) -> None:
        self.records: list[TokenLogprob] = []
        self._taken = 0  # records already handed on by take_records
        self._vocab = llm._model.vocab
        self.rejections = 0  # tokens the grammar rejected (resampled over the masked vocabulary)
        self.grammar: Any = None
        self.chain: Any = None
        self._n_vocab = int(llm.n_vocab())
        self._want_logprobs = sampling.logprobs or sampling.top_logprobs > 0
        self._top = int(sampling.top_logprobs)
        self._grammar_first = grammar_first
        self._stateful = sampling.penalized  # the only link whose accept() keeps state
        temperature, top_k, top_p, seed = sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed
        self.greedy = temperature == 0.0
        seed_u32 = llama_cpp.LLAMA_DEFAULT_SEED if seed is None else int(seed) & 0xFFFFFFFF
        links: list[Any] = []
        if sampling.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(sampling.logit_bias))()
            for i, (token, bias) in enumerate(sampling.logit_bias):
                if not 0 <= token < self._n_vocab:
                    raise InvalidSamplingError(
                        f"logit_bias: token {token} is not in the vocabulary (0..{self._n_vocab - 1})"
                    )
                biases[i].token = int(token)  # type: ignore[assignment]
                biases[i].bias = float(bias) if math.isfinite(bias) else (-math.inf if bias < 0 else math.inf)
            links.append(llama_cpp.llama_sampler_init_logit_bias(self._n_vocab, len(biases), biases))
        if sampling.penalized:
            last_n = int(sampling.repeat_last_n)
            if last_n < 0:
                last_n = int(llm.n_ctx())
            links.append(
                llama_cpp.llama_sampler_init_penalties(
                    self._n_vocab,
                    last_n,
                    float(sampling.repeat_penalty),
                    float(sampling.frequency_penalty),
                    float(sampling.presence_penalty),
                )
            )
        if self.greedy:
            links.append(llama_cpp.llama_sampler_init_greedy())
        elif temperature < 0.0:
            links.append(llama_cpp.llama_sampler_init_dist(seed_u32))
        else:
            links += [
                llama_cpp.llama_sampler_init_top_k(int(top_k)),
                llama_cpp.llama_sampler_init_top_p(float(top_p), 1),
                llama_cpp.llama_sampler_init_min_p(float(sampling.min_p), 1),
                llama_cpp.llama_sampler_init_temp(float(temperature)),
                llama_cpp.llama_sampler_init_dist(seed_u32),
            ]
        self.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not self.chain:
            for link in links:
                llama_cpp.llama_sampler_free(link)
            raise RuntimeError("llama_sampler_chain_init failed")
        for link in links:
            llama_cpp.llama_sampler_chain_add(self.chain, link)  # the chain owns it now
        if sampling.grammar:
            self.grammar = self._init_grammar(llm, sampling.grammar, sampling.grammar_triggers)
        # the chain is llama.cpp's greedy sampler alone and nothing else is asked of the row:
        # its token is ``GreedyRows``' (see the module docstring)
        self.plain_greedy = (
            self.greedy and len(links) == 1 and self.grammar is None and not self._want_logprobs
        )
        # the candidates array of the Python sampling path (grammar): allocated once per sequence
        self._cur: Any = None
        self._cur_view: Any = None
        self._ids: Any = None
        self._one = llama_cpp.llama_token_data()
        self._one_p = llama_cpp.llama_token_data_array(
            data=ctypes.pointer(self._one), size=1, selected=-1, sorted=False
        )

    def _init_grammar(self, llm: Any, grammar: str, triggers: Sequence[str]) -> Any:
        try:
            check_gbnf(grammar)  # what llama.cpp's parser can build without running out of stack
        except GrammarLimitError as exc:
            self.close()
            raise GrammarError(str(exc)) from None
        vocab = llm._model.vocab
        text = grammar.encode("utf-8")
        if triggers:
            check_triggers(triggers)
            encoded = [t.encode("utf-8") for t in triggers]
            patterns = (ctypes.c_char_p * len(encoded))(*encoded)
            no_tokens = (llama_cpp.llama_token * 1)()
            sampler = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                vocab, text, b"root", patterns, len(encoded), no_tokens, 0
            )
        else:
            sampler = llama_cpp.llama_sampler_init_grammar(vocab, text, b"root")
        if not sampler:
            self.close()
            raise GrammarError(
                "the grammar is not valid GBNF with a 'root' rule (llama.cpp's parser refused it; "
                "see its message in the worker log)"
            )
        return sampler

    # ---- sampling ---------------------------------------------------------------------------

    def _candidates(self, ctx: Any, idx: int) -> Any:
        """A fresh llama_token_data_array of row ``idx``'s logits (what llama_sampler_sample builds)."""
        if self._cur is None:
            self._cur = (llama_cpp.llama_token_data * self._n_vocab)()
            self._cur_view = np.ctypeslib.as_array(self._cur)
            self._ids = np.arange(self._n_vocab, dtype=np.int32)
        view = self._cur_view
        view["id"] = self._ids
        view["logit"] = self._logits(ctx, idx)
        view["p"] = 0.0
        return llama_cpp.llama_token_data_array(
            data=ctypes.cast(self._cur, llama_cpp.llama_token_data_p),
            size=self._n_vocab,
            selected=-1,
            sorted=False,
        )

    def _logits(self, ctx: Any, idx: int) -> Any:
        ptr = llama_cpp.llama_get_logits_ith(ctx, idx)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no logits for output row {idx}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _apply(self, sampler: Any, cur: Any) -> None:
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(cur))

    def _selected(self, cur: Any) -> int:
        if not 0 <= cur.selected < cur.size:
            raise RuntimeError("the sampler chain selected no token (every candidate was masked)")
        return int(cur.data[cur.selected].id)

    def _allowed(self, cur: Any) -> int:
        """The token selected after the grammar masked ``cur``; GrammarDeadEnd when the grammar
        (with the request's logit_bias) left no token: the chain then picks a masked one, and
        llama.cpp aborts the process when the grammar is made to accept it."""
        if not 0 <= cur.selected < cur.size or cur.data[cur.selected].logit == -math.inf:
            raise GrammarDeadEnd(
                "the grammar allows no token at this point of the answer (or logit_bias bans every "
                "token it allows), so the answer cannot go on: check the grammar"
            )
        return int(cur.data[cur.selected].id)

    def _grammar_allows(self, token: int) -> bool:
        self._one.id = token  # type: ignore[assignment]
        self._one.logit = 1.0
        self._one.p = 0.0
        one = self._one_p
        one.data = ctypes.pointer(self._one)  # type: ignore[assignment]
        one.size = 1
        one.selected = -1
        one.sorted = False
        self._apply(self.grammar, one)
        return bool(one.data[0].logit != -math.inf)

    def _sample_with_grammar(self, ctx: Any, idx: int) -> int:
        if self._grammar_first:
            cur = self._candidates(ctx, idx)
            self._apply(self.grammar, cur)
            self._apply(self.chain, cur)
            token = self._allowed(cur)
            llama_cpp.llama_sampler_accept(self.chain, token)
        else:
            if self._stateful:
                cur = self._candidates(ctx, idx)
                self._apply(self.chain, cur)
                token = self._selected(cur)
            else:
                # llama_sampler_sample builds the same candidates in C (and accepts the token:
                # a no-op for a chain without penalties, so a rejected token leaves no trace)
                token = int(llama_cpp.llama_sampler_sample(self.chain, ctx, idx))
            if not self._grammar_allows(token):
                self.rejections += 1
                cur = self._candidates(ctx, idx)
                self._apply(self.grammar, cur)
                self._apply(self.chain, cur)
                token = self._allowed(cur)
            if self._stateful:
                llama_cpp.llama_sampler_accept(self.chain, token)
        llama_cpp.llama_sampler_accept(self.grammar, token)
        return token

    def sample(self, ctx: Any, idx: int = -1) -> int:
        """Sample (and accept) a token from output row ``idx`` of the last decode (-1: the last)."""
        if self.grammar is None:
            token = int(llama_cpp.llama_sampler_sample(self.chain, ctx, idx))
        else:
            token = self._sample_with_grammar(ctx, idx)
        if self._want_logprobs and not llama_cpp.llama_vocab_is_eog(self._vocab, token):
            self.records.append(self._logprob(ctx, idx, token))
        return token

    @property
    def top_logprobs(self) -> int:
        """The alternatives per token the request asked for."""
        return self._top

    def take_records(self) -> list[TokenLogprob]:
        """The records since the last call (the loop hands them on with the text it emits)."""
        taken = self.records[self._taken :]
        self._taken = len(self.records)
        return taken

    def _logprob(self, ctx: Any, idx: int, token: int) -> TokenLogprob:
        x = self._logits(ctx, idx).astype(np.float64)
        peak = float(x.max())
        lse = peak + math.log(float(np.exp(x - peak).sum()))
        top: tuple[tuple[int, float], ...] = ()
        k = min(self._top, self._n_vocab)
        if k > 0:
            best = np.argpartition(-x, k - 1)[:k]
            best = best[np.argsort(-x[best], kind="stable")]
            top = tuple((int(t), float(x[t] - lse)) for t in best)
        return TokenLogprob(token, float(x[token] - lse), top)

    def close(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)  # frees the samplers of the chain too
            self.chain = None
        if self.grammar:
            llama_cpp.llama_sampler_free(self.grammar)
            self.grammar = None
