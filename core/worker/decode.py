"""The generation loop: continuous batching over the live sequences of one llama context, driven
through llama-cpp-python's low-level API (``llama_decode`` of one batch per step,
``Sampler.sample`` per sequence).

``Llama.create_completion`` costs more per token than the GPU does on a fast device: it copies
Python lists, re-detokenizes the whole answer at every token and checks stop strings against all
of it. On an H200 (8B F16) it ran at 43-72 tok/s where a plain low-level loop ran at 175. This
loop does what it did, in the same order, with the same numerics, for several sequences at once:

- **sequences**: the context holds up to ``n_seq_max`` sequences (``parallel``), each in its own
  KV stream (``kv_unified = false``: a sequence's attention never sees the others' cells, so its
  logits do not depend on what else is in the batch; with a unified cache they did, at the last
  bits). A sequence (``Live``) has its seq id, the token ids its KV holds (``ids``, the engine's
  list, kept current here), its Sampler, TextStream, emit callback, token limit and finish reason;
- **prefill**: the prefix matching of ``Llama.generate`` per sequence (only the tokens after the
  common prefix of the sequence's ``ids`` and the prompt are evaluated, the last prompt token
  always, since its logits are needed), in chunks of ``n_batch``: alone, the same batches as
  ``Llama.eval``, so the same logits;
- **steps**: each ``step`` is one ``llama_decode``: one token for every sequence that is decoding,
  then prefill chunks of the sequences that joined, in join order, up to ``n_batch`` tokens in all
  (a joining prompt is chunked and interleaved with the others' decode steps: no stream stalls for
  longer than one chunk); then each sequence whose logits the step produced samples from its own
  output row (``Sampler.sample(ctx, idx)``). Sequences join (``start``) and leave (finished,
  ``cancel``) between steps; the token a generation ends on is not evaluated (the KV holds the
  prompt and every answer token but the last);
- **text**: each token's piece goes through the sequence's ``TextStream`` (incremental UTF-8, stop
  strings; see textstream.py). The answer ends at the earliest stop string, which is reported.

Greedy answers are bit-for-bit those of ``create_completion`` (tests/test_decode.py compares them
on both demo models), alone and in a batch (tests/test_batch.py). Two differences: a request
without ``seed`` gets a random one (llama-cpp-python derived it from the previous request's); and
a token limit reached inside a multi-byte character ends the answer there (``create_completion``
sampled on until the character was complete, past ``max_tokens``): ``completion_tokens`` never
exceeds ``max_tokens``, the text ends on the last whole character and the finish reason is
``length`` (issue 45).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ..errors import CancelledError, ResidencyError
from ..sampling import Sampling
from ..wire.protocol import FinishReason
from .sampler import GrammarDeadEnd, GreedyRows, Sampler, TokenLogprob, row_logprobs
from .textstream import TextStream
from .vision import ImageSpan, Vision, close_spans, snap_to_image_start

#: prompt tokens a sequence whose prompt logprobs are wanted (echo) prefills per step at most: each
#: is an output row (n_vocab floats in llama.cpp's output buffer, which grows to the most rows a
#: decode had and stays: 256 rows of a 128k vocabulary are 128 MiB), and its log-softmax is taken
#: here between two steps while the others wait
PROMPT_LOGPROB_ROWS = 256


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
    batch_size: int = 1  # the most sequences decoded together while it ran
    logprobs: tuple[TokenLogprob, ...] = ()  # the Sampler's records (when logprobs were asked for)


class Live:
    """One live sequence of the batch (see the module docstring). Built by ``Decoder.start``."""

    def __init__(
        self,
        seq_id: int,
        ids: list[int],
        pending: list[int],
        sampler: Sampler,
        text: TextStream,
        emit: Callable[[str], None],
        max_tokens: int,
        room: int,
        tag: object,
        records: Callable[[list[TokenLogprob]], None] | None = None,
        prompt_records: Callable[[list[TokenLogprob]], None] | None = None,
        score_only: bool = False,
        media: dict[int, ImageSpan] | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.ids = ids  # the tokens the sequence's KV holds (the caller's list, kept current)
        self.pending = pending  # prompt tokens still to prefill
        self.sampler = sampler
        self.text = text
        self.emit = emit
        self.max_tokens = max_tokens
        self.room = room
        self.tag = tag  # the caller's
        self.records = records  # gets the Sampler's records of the tokens each piece completes
        #: its prompt's images by start (owned: freed when it leaves the batch); the ones that
        #: ``pending`` still holds are evaluated by the projector (``Decoder._images``)
        self.media = media or {}
        # gets the prompt tokens' records as their rows are evaluated (echo with logprobs: every
        # prompt position is an output; see ``step``); the first prompt token's comes first, with
        # logprob 0 and no alternatives (nothing precedes it), unless it is a BOS the caller added
        self.prompt_records = prompt_records
        self.score_only = score_only  # evaluate the prompt and sample nothing (max_tokens 0)
        self.n_prompt = 0
        self.evaluated = 0
        self.completion = 0
        self.token = -1  # sampled, evaluated at the next step (-1: none)
        self.finish: FinishReason | None = None
        #: why it ended without an answer (its sampler's grammar, its projector's weights)
        self.error: GrammarDeadEnd | ResidencyError | None = None
        self.batch_size = 0  # the most sequences in one step while this one was live
        # where its first token's time went (the worker's ``Timings``; monotonic clock):
        self.first_step = -1  # the Decoder's ``decodes`` before its first prefill step (-1: none yet)
        self.prefill_steps = 0  # steps its prompt was spread over (so far)
        self.prefill_start = 0.0  # its first prefill step began (before the batch was filled)
        self.prefill_end = 0.0  # the step that evaluated its last prompt token returned
        self.step_sequences = 0  # sequences in its first prefill step
        self.step_prompts = 0  # prompts prefilled (in part) in its first prefill step, its own included
        self.skip_first = False  # its prompt begins with a BOS the caller added: no record for it

    @property
    def done(self) -> bool:
        return self.finish is not None

    def emit_piece(self, piece: str) -> None:
        """Emit a piece of text, its tokens' logprob records first (when asked for)."""
        if self.records is not None:
            self.records(self.sampler.take_records())
        self.emit(piece)

    def outcome(self) -> Decoded:
        assert self.finish is not None
        return Decoded(
            self.finish,
            self.completion,
            self.evaluated,
            self.text.text,
            self.text.stop,
            max(1, self.batch_size),
            tuple(self.sampler.records),
        )


class TokenBatch:
    """A llama_batch of ``size`` tokens, one sequence id each, over numpy arrays: a step fills
    whole slices (``token``, ``pos``, ``seq``, ``logits``) instead of one ctypes write per field
    and token. Freed with the object (llama_batch_free is not for it)."""

    def __init__(self, size: int) -> None:
        i32 = ctypes.POINTER(ctypes.c_int32)
        self.token = np.zeros(size, dtype=np.int32)
        self.pos = np.zeros(size, dtype=np.int32)
        self.seq = np.zeros(size, dtype=np.int32)  # token i's one sequence id: seq_id[i] points here
        self.logits = np.zeros(size, dtype=np.int8)
        self.n_seq_id = np.ones(size, dtype=np.int32)
        self.arange = np.arange(size, dtype=np.int32)
        self._seq_ptrs = (i32 * (size + 1))()
        base = self.seq.ctypes.data
        for i in range(size):
            self._seq_ptrs[i] = ctypes.cast(base + 4 * i, i32)
        struct: Any = llama_cpp.llama_batch()
        struct.n_tokens = 0
        struct.token = self.token.ctypes.data_as(i32)
        struct.pos = self.pos.ctypes.data_as(i32)
        struct.n_seq_id = self.n_seq_id.ctypes.data_as(i32)
        struct.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32))
        struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct = struct


class Decoder:
    """The batch of one ``Llama``'s context: its live sequences and the llama_batch (allocated once)."""

    def __init__(self, llm: Any, vision: Vision | None = None) -> None:
        self.llm = llm
        self.vision = vision  # the model's projector: evaluates the images of prompts
        ctx = llm.ctx
        self.n_seq = max(1, int(llama_cpp.llama_n_seq_max(ctx)))
        self._n_ctx = int(llama_cpp.llama_n_ctx_seq(ctx))  # per sequence
        self.n_batch = max(1, int(llm.n_batch))  # tokens per step at most
        self._n_vocab = int(llm.n_vocab())
        self._batch: Any = TokenBatch(self.n_batch)
        self._greedy = GreedyRows(self._n_vocab)
        self._pieces: dict[int, bytes] = {}
        self.live: list[Live] = []  # in join order
        model = llm._model.model
        #: a recurrent or hybrid model: its states cannot be cut back, so each sequence keeps a
        #: checkpoint of its state at the end of its last prompt (``_checkpoint``)
        self.recurrent = bool(
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        )
        self.checkpoints: dict[int, tuple[list[int], Any, int]] = {}
        self.decodes = 0  # llama_decode calls since start (what batching saves, counted)
        # llama.cpp decodes a batch of more than one token with n_threads_batch: a step of decode
        # tokens only (one per sequence) gets the generation threads instead, as one sequence's
        # step does (llama-server's default: the same count for both). On a CPU with every core
        # busy, a step of 4 tokens on llama-cpp-python's default cpu_count threads took 877 ms
        # where its generation threads (cpu_count // 2) took 72 ms (2 cores, load 7); the
        # thread count does not change the numbers (the answers stay bit for bit)
        self._threads = (int(getattr(llm, "n_threads", 0) or 0), int(getattr(llm, "n_threads_batch", 0) or 0))
        self._step_threads: tuple[int, int] | None = None
        self._threads_ctx: Any = None

    def close(self) -> None:
        for live in list(self.live):
            self.cancel(live)
        self._batch = None  # (its arrays are numpy's: freed with it)

    # ---- joining and leaving ----------------------------------------------------------------

    def _to_evaluate(
        self, seq_id: int, ids: list[int], tokens: list[int], media: dict[int, ImageSpan] | None = None
    ) -> list[int]:
        """``Llama.generate``'s prefix matching for one sequence: cut its KV back to the longest
        common prefix with the prompt, keeping at least the last prompt token to evaluate, and
        return the tokens left to evaluate (``ids`` is cut to match). An image of the prompt is
        kept whole or evaluated whole (``media``: a cut inside one moves back to its start)."""
        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        if ids:
            prefix = common_prefix(ids, tokens)
            reuse = snap_to_image_start(min(prefix, len(tokens) - 1), media)
            if reuse > 0 and (reuse >= len(ids) or llama_cpp.llama_memory_seq_rm(memory, seq_id, reuse, -1)):
                del ids[reuse:]
                return tokens[reuse:]
            back = self._back_to_checkpoint(seq_id, ids, tokens, reuse)
            if back is not None:
                return back
        llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
        ids.clear()
        return list(tokens)

    def _checkpoint(self, live: Live) -> None:
        """A recurrent or hybrid model's sequence whose prompt was just prefilled: keep its
        recurrent state (``PARTIAL_ONLY``: not the attention KV cells, which can be cut) with the
        tokens it follows, so that the next prompt that shares them but not the answer (a keyless
        client's next turn: the answer re-tokenizes differently) goes back to it instead of
        evaluating the whole prompt again (a recurrent state cannot be cut back; llama-server
        keeps such checkpoints too)."""
        ctx = self.llm.ctx
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, live.seq_id, flags))
        if size <= 0:
            return
        buf = (ctypes.c_uint8 * size)()
        got = int(llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, live.seq_id, flags))
        if got > 0:
            self.checkpoints[live.seq_id] = (list(live.ids), buf, got)

    def _back_to_checkpoint(
        self, seq_id: int, ids: list[int], tokens: list[int], reuse: int
    ) -> list[int] | None:
        """Put sequence ``seq_id`` back to its checkpoint when the KV cannot be cut to ``reuse``
        (a recurrent state) and the checkpoint's tokens begin both what it holds and the prompt;
        returns the tokens left to evaluate (None: no such checkpoint)."""
        cp = self.checkpoints.get(seq_id)
        if cp is None:
            return None
        held, buf, size = cp
        n = len(held)
        if not 0 < n <= reuse or ids[:n] != held or tokens[:n] != held:
            return None
        ctx = self.llm.ctx
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        if int(llama_cpp.llama_state_seq_set_data_ext(ctx, buf, size, seq_id, flags)) != size:
            return None
        if not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, n, -1):
            return None
        del ids[n:]
        return tokens[n:]

    def start(
        self,
        seq_id: int,
        ids: list[int],
        tokens: list[int],
        sampling: Sampling,
        *,
        stop: Sequence[str],
        emit: Callable[[str], None],
        tag: object = None,
        records: Callable[[list[TokenLogprob]], None] | None = None,
        prompt_records: Callable[[list[TokenLogprob]], None] | None = None,
        score_only: bool = False,
        skip_first: bool = False,
        media: dict[int, ImageSpan] | None = None,
    ) -> Live:
        """A sequence joins the batch at the next step: ``tokens`` is its prompt, ``ids`` the
        tokens sequence ``seq_id``'s KV holds now (cut back to the common prefix, then kept
        current). Needs the context (the weights need not be resident). ``prompt_records``: the
        prompt's logprobs are wanted (the whole prompt is evaluated again, each position an
        output; ``skip_first``: the first prompt token, a BOS the caller added, gets no record);
        ``score_only``: the sequence ends (``length``) once its prompt is evaluated. ``media``: its
        images by start (placeholder ids in ``tokens``: vision.py; the sequence owns them from
        here)."""
        if any(live.seq_id == seq_id for live in self.live):
            raise RuntimeError(f"sequence {seq_id} is already in the batch")
        if media and self.vision is None:
            raise RuntimeError("a prompt with images for a model without a projector")
        room = self._n_ctx - len(tokens)
        max_tokens = sampling.max_tokens or 0
        if max_tokens <= 0 or max_tokens >= room:
            max_tokens = room
        sampler = Sampler(self.llm, sampling)
        try:
            if prompt_records is not None:
                # every prompt position's logits are needed: nothing of the KV is reused
                llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.llm.ctx), seq_id, -1, -1)
                ids.clear()
                pending = list(tokens)
            else:
                pending = self._to_evaluate(seq_id, ids, tokens, media)
        except BaseException:
            sampler.close()
            raise
        text = TextStream(self.llm, stop, self._pieces)
        live = Live(
            seq_id,
            ids,
            pending,
            sampler,
            text,
            emit,
            max_tokens,
            room,
            tag,
            records,
            prompt_records,
            score_only,
            media,
        )
        live.n_prompt = len(tokens)
        live.skip_first = skip_first
        self.live.append(live)
        return live

    def cancel(self, live: Live, finish: FinishReason = "cancelled") -> None:
        """``live`` leaves the batch now (what was emitted stays its answer)."""
        if live in self.live:
            self.live.remove(live)
        if live.finish is None:
            live.finish = finish
        live.sampler.close()
        close_spans(live.media)

    def _finish(self, live: Live, finish: FinishReason) -> None:
        live.finish = finish
        self.live.remove(live)
        live.sampler.close()
        close_spans(live.media)
        if not live.text.stop:
            rest = live.text.flush()
            if rest:
                live.emit_piece(rest)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[Live]:
        """One ``llama_decode`` over the live sequences (see the module docstring); returns those
        that finished in it. Needs the weights resident. Raises RuntimeError when llama_decode
        fails (the sequences' KV is then unknown: the caller cancels them all)."""
        if not self.live:
            return []
        started = time.monotonic()
        imaged, failed = self._images(started)
        b = self._batch
        outputs: list[tuple[Live, int]] = []
        taken: list[tuple[Live, int]] = []  # (sequence, prompt tokens taken)
        # (sequence, its first row, its first position, the tokens taken and the one after them)
        scored: list[tuple[Live, int, int, list[int]]] = []
        size = len(self.live)
        decoding = [live for live in self.live if live.token >= 0]
        n = len(decoding)
        if n:
            # one token per decoding sequence: filled as whole arrays (numpy views of the batch)
            b.token[:n] = [live.token for live in decoding]
            b.pos[:n] = [len(live.ids) for live in decoding]
            b.seq[:n] = [live.seq_id for live in decoding]
            b.logits[:n] = 1
            outputs = [(live, i) for i, live in enumerate(decoding)]
        for live in self.live:
            live.batch_size = max(live.batch_size, size)
        for live in self.live:
            budget = self.n_batch - n
            if budget <= 0:
                break
            if not live.pending:
                continue
            k = min(budget, len(live.pending), self._text_ahead(live))
            if k <= 0:
                continue  # an image comes next: the next step evaluates it
            if live.prompt_records is not None:
                k = min(k, PROMPT_LOGPROB_ROWS)
            last = k == len(live.pending)
            base = len(live.ids)
            b.token[n : n + k] = live.pending[:k]
            b.pos[n : n + k] = b.arange[:k]
            b.pos[n : n + k] += base
            b.seq[n : n + k] = live.seq_id
            if live.prompt_records is not None:
                b.logits[n : n + k] = 1  # each position's row: the logprob of the token after it
                scored.append((live, n, base, list(live.pending[: k + 1])))
            else:
                b.logits[n : n + k] = 0
            n += k
            if last and not live.score_only:
                b.logits[n - 1] = 1
                outputs.append((live, n - 1))
            taken.append((live, k))
        if n == 0:
            return failed  # (only images this step: their sequences' text follows at the next)
        b.struct.n_tokens = n
        self.set_threads(prefill=bool(taken))
        rc = int(llama_cpp.llama_decode(self.llm.ctx, b.struct))
        ended = time.monotonic()
        step = self.decodes
        self.decodes += 1
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        for live in decoding:
            live.ids.append(live.token)
            live.token = -1
        for live, k in taken:
            if live.first_step < 0:
                live.first_step = step
                live.prefill_start = started
                live.step_sequences = size
                live.step_prompts = len(taken)
            if live not in imaged:
                live.prefill_steps += 1
            live.ids.extend(live.pending[:k])
            del live.pending[:k]
            live.evaluated += k
            if not live.pending:
                live.prefill_end = ended
                if self.recurrent:
                    self._checkpoint(live)
        ctx = self.llm.ctx
        for live, row, base, chunk in scored:
            assert live.prompt_records is not None
            records = self._prompt_logprobs(ctx, live, row, chunk)
            if base == 0 and not live.skip_first:
                records.insert(0, TokenLogprob(chunk[0], 0.0, ()))  # nothing precedes it
            live.prompt_records(records)
        finished: list[Live] = failed
        for live, _k in taken:
            if live.score_only and not live.pending:
                self._finish(live, "length")
                finished.append(live)
        # plain greedy sequences: one argmax over their rows (the greedy sampler's token, see
        # sampler.GreedyRows); None where it cannot say (a NaN): the sampler chain decides
        fast = [(live, row) for live, row in outputs if live.sampler.plain_greedy]
        picked: dict[Live, int | None] = {}
        if fast:
            tokens = self._greedy.tokens(ctx, [row for _live, row in fast])
            picked = {live: token for (live, _row), token in zip(fast, tokens, strict=True)}
        for live, row in outputs:
            token = picked.get(live)
            if token is None:
                try:
                    token = live.sampler.sample(ctx, row)
                except GrammarDeadEnd as exc:  # this sequence's grammar: it alone ends, in error
                    live.error = exc
                    self._finish(live, "stop")
                    finished.append(live)
                    continue
            if self.accept(live, token):
                finished.append(live)
        return finished

    def _text_ahead(self, live: Live) -> int:
        """How many of ``live``'s pending tokens come before its next image (all: none)."""
        at = len(live.ids)
        starts = [start - at for start in live.media if start >= at]
        return min(starts, default=len(live.pending))

    def _images(self, started: float) -> tuple[set[Live], list[Live]]:
        """The sequences whose next prompt piece is an image: each puts it into its KV now, in a
        llama_decode of its own (vision.Vision.evaluate; one image per sequence per step, so the
        others' tokens wait at most one image). Raises RuntimeError as a failed step does.
        Returns them, and those that ended in error: the projector's weights could not come
        back (ResidencyError before any decode: that request alone fails, the batch goes on)."""
        done: set[Live] = set()
        failed: list[Live] = []
        if self.vision is None:
            return done, failed
        for live in list(self.live):
            span = live.media.get(len(live.ids)) if live.pending else None
            if span is None:
                continue
            self.set_threads(prefill=True)
            try:
                self.vision.evaluate(self.llm.ctx, span, len(live.ids), live.seq_id, self.n_batch)
            except ResidencyError as exc:
                live.error = exc
                self._finish(live, "stop")
                failed.append(live)
                continue
            if live.first_step < 0:
                live.first_step = self.decodes
                live.prefill_start = started
                live.step_sequences = len(self.live)
                live.step_prompts = 1
            self.decodes += 1
            live.prefill_steps += 1
            live.ids.extend(live.pending[: span.n_tokens])
            del live.pending[: span.n_tokens]
            live.evaluated += span.n_tokens
            done.add(live)
        return done, failed

    def _prompt_logprobs(self, ctx: Any, live: Live, row: int, chunk: list[int]) -> list[TokenLogprob]:
        """The records of the prompt tokens that follow the positions whose rows start at output
        ``row``: ``chunk`` holds the positions' tokens and the one after them (absent after the
        prompt's last token, whose row is the first answer token's)."""
        wanted = chunk[1:]  # the token each row predicts
        if not wanted:
            return []
        first = ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, row), ctypes.c_void_p).value
        last = ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, row + len(wanted) - 1), ctypes.c_void_p).value
        if not first or last != first + 4 * self._n_vocab * (len(wanted) - 1):
            raise RuntimeError("llama.cpp's prompt rows are not whole rows of one buffer")
        buf = (ctypes.c_float * (len(wanted) * self._n_vocab)).from_address(first)
        block = np.frombuffer(memoryview(buf), dtype=np.float32).reshape(len(wanted), self._n_vocab)
        return row_logprobs(block, wanted, live.sampler.top_logprobs)

    def accept(self, live: Live, token: int) -> bool:
        """Take ``live``'s sampled ``token``: it ends the sequence (end of generation, a stop
        string, the token limit: never past it, a character it cuts is dropped) or is evaluated
        at the next step. True when the sequence ended."""
        if llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token):
            self._finish(live, "stop")
            return True
        live.completion += 1
        piece = live.text.push(token)
        if piece:
            live.emit_piece(piece)
        if live.text.stop:
            self._finish(live, "stop")
            return True
        if live.completion >= live.max_tokens:
            self._finish(live, "length")  # the flush drops a character the limit cut
            return True
        live.token = token
        return False

    def set_threads(self, *, prefill: bool) -> None:
        """The thread counts of a step with prompt tokens (``prefill``) or of decode tokens only."""
        gen, batch = self._threads
        if gen <= 0 or batch <= 0:
            return
        want = (gen, batch) if prefill else (gen, gen)
        ctx = self.llm.ctx
        if want != self._step_threads or ctx is not self._threads_ctx:
            llama_cpp.llama_set_n_threads(ctx, *want)
            self._step_threads = want
            self._threads_ctx = ctx  # a rebuilt context starts from the defaults again

    # ---- one sequence alone -----------------------------------------------------------------

    def run(
        self,
        seq_id: int,
        ids: list[int],
        tokens: list[int],
        sampling: Sampling,
        *,
        stop: Sequence[str],
        emit: Callable[[str], None],
        before_step: Callable[[], None],
    ) -> Decoded:
        """Prefill ``tokens`` in sequence ``seq_id`` (what ``ids`` does not hold yet) and generate,
        stepping the batch until this sequence is done. ``before_step`` runs before every step and
        may raise CancelledError (finish_reason "cancelled"; what was emitted stays the answer)."""
        live = self.start(seq_id, ids, tokens, sampling, stop=stop, emit=emit)
        try:
            while not live.done:
                before_step()
                self.step()
        except CancelledError:
            self.cancel(live)
        except BaseException:
            self.cancel(live)
            raise
        return live.outcome()
