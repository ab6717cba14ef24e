"""The engine: one loaded GGUF model and its conversations, driven by the worker's loop thread.

Nothing here is thread-safe on purpose: the worker's loop thread is the only caller. Generation
runs in ``decode.Decoder`` (llama.cpp's low-level API; a completion at temperature 0 from an empty
KV cache equals what a plain ``Llama(path, n_ctx=...).create_completion`` produces): the context is
built with the library's defaults (only n_ctx, n_gpu_layers, use_mmap, verbose and the model's
``flash_attn`` differ; the first three do not change numerics, ``flash_attn`` is off unless set;
a context of several sequences also loads the weights unrepacked: see ``batch_invariant``).
The caller's ``before_step`` hook runs before every decode step: that is where the worker drains
its queue (cancel, yield) and makes sure the weights are resident.

The sequence cache (which sequence holds whose KV, the prompt cache, the KV files of a stopped
worker) is ``sequences.Sequences``; prompt building (chat template or the fallback format,
tokenizing in cancellable pieces) is ``prompts.Prompts``. The engine owns one of each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals

from ..chatformat.template import ChatTemplate, TemplateError
from ..config.fit import LoadPlan, auto_n_ctx, memory_words
from ..config.schema import ModelConfig
from ..errors import (
    CancelledError,
    InvalidInputError,
    InvalidSamplingError,
    ModelFileError,
    OutOfDeviceMemoryError,
    TimeshareError,
)
from ..gguf.catalog import read_pooling
from ..gguf.kvcache import DEFAULT_KV_TYPE, KV_TYPES
from ..gguf.modelfile import check_model_file
from ..residency import check_gguf, ggml_devices
from ..sampling import Sampling
from ..util.units import decimal_bytes
from ..wire.protocol import FinishReason, Generate, LogprobAlt, TokenLogprobs
from . import kv_files
from .decode import Decoder, Live
from .device import default_parallel, llama_placement
from .embed import embed_tokens, rank_tokens, rerank_tokens
from .prompts import Media, Prompts, tools_of
from .sampler import TokenLogprob
from .sequences import Sequences, Slot
from .textstream import token_piece
from .threads import cpu_threads
from .vision import Vision, close_spans

log = logging.getLogger(__name__)

#: a pooled context's pooling by llama.cpp's value (``ModelInfo.pooling``)
POOLING = {
    llama_cpp.LLAMA_POOLING_TYPE_NONE: "mean",  # mean pooling done in embed.py
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
    llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank",
}

#: the lowest logprob written (OpenAI's floor for impossible tokens)
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class EngineInfo:
    n_ctx: int
    n_vocab: int
    chat_format: str  # "template" | "fallback"
    parallel: int = 1  # sequences the context decodes together


@dataclass(frozen=True)
class GenerationOutcome:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_evaluated: int  # tokens prefilled by this request
    text: str
    stop: str = ""  # the stop string that ended it ("": none, e.g. the model's end-of-turn token)
    batch_size: int = 1  # the most sequences decoded together while it ran
    logprobs: tuple[TokenLogprob, ...] = ()  # one per sampled token when the request asked for them


@dataclass(frozen=True)
class Prepared:
    """A tokenized request, ready to join the batch."""

    req: Generate
    tokens: list[int]
    stop: tuple[str, ...]
    #: its images, by where they start in ``tokens`` (their placeholder ids: vision.py); the live
    #: sequence owns them once it joined the batch
    media: Media = field(default_factory=dict)


class Engine:
    """A loaded model. Build it with ``Engine.load``; call only from one thread."""

    def __init__(
        self, llm: Any, model: ModelConfig, template: ChatTemplate | None, vision: Vision | None = None
    ) -> None:
        self.llm = llm
        self.model = model
        self.template = template  # the chat template, or None for the fallback format
        self.vision = vision  # the vision projector (models[].mmproj), None: text only
        ctx = llm.ctx
        self.parallel = max(1, int(llama_cpp.llama_n_seq_max(ctx)))
        self.info = EngineInfo(
            n_ctx=int(llama_cpp.llama_n_ctx_seq(ctx)),  # per sequence: every request has all of it
            n_vocab=int(llm.n_vocab()),
            chat_format="template" if template is not None else "fallback",
            parallel=self.parallel,
        )
        self.sequences = Sequences(llm, model, self.info.n_ctx, self.parallel)
        self.prompts = Prompts(llm, model, template, self.info.n_ctx, vision)
        self.prompt_tokens_evaluated = 0  # since start
        #: a reranker (rank pooling): it answers /v1/rerank only (``rerank``)
        self.reranker = int(llama_cpp.llama_pooling_type(ctx)) == llama_cpp.LLAMA_POOLING_TYPE_RANK
        self._decoder = Decoder(llm, vision)
        self._last: Slot | None = None
        self._lp_pieces: dict[int, bytes] = {}  # token -> bytes, for logprob entries
        self._lives: dict[Live, Slot] = {}  # the batch's sequences and their slots

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, model: ModelConfig, *, use_mmap: bool = True, plan: LoadPlan | None = None) -> Engine:
        """Load the GGUF. Raises ModelFileError with a sentence saying what to do, and
        OutOfDeviceMemoryError when the context or the weights could not be allocated (``plan``:
        what the worker's fit asked of its device, for the numbers in that sentence).

        ``model.kv_cache_type`` ("" is f16 here: the worker resolves the global default) sets K
        and V; a quantised one turns flash attention on, which llama.cpp needs for a quantised V."""
        check_model_file(model.path)
        check_gguf(model.path)  # truncation is caught before llama.cpp sees the file
        if not model.embedding and read_pooling(model.path) == "rank":
            # a reranker (issue 42): its graph ends in a classifier, it has no logits to sample;
            # its context pools, as an embedding model's does, whatever the entry says
            log.info("%s pools by rank (a reranker): loaded for /v1/rerank only", model.id)
            model = dataclasses.replace(model, embedding=True)
        # an embedding model's sequences let one decode embed several inputs (core/worker/embed.py)
        parallel = model.parallel or default_parallel()
        n_ctx = model.n_ctx or auto_n_ctx(0, plan.gpu if plan is not None else False)
        kv_type = model.kv_type()
        ggml_type = KV_TYPES[kv_type][2]
        quantised_kv = kv_type != DEFAULT_KV_TYPE
        if quantised_kv and not model.flash_attn:
            log.info(
                "%s: kv_cache_type %s turns flash attention on (a quantised V needs it)", model.id, kv_type
            )
        n_threads, n_threads_batch = cpu_threads()  # llama-cpp-python's defaults, written once
        try:
            with _model_defaults(**batch_invariant(parallel)):
                llm = llama_cpp.Llama(
                    model_path=model.path,
                    n_ctx=n_ctx * parallel,  # each sequence has the model's whole n_ctx
                    n_gpu_layers=model.n_gpu_layers,
                    use_mmap=use_mmap,
                    flash_attn=model.flash_attn or quantised_kv,
                    type_k=ggml_type if quantised_kv else None,
                    type_v=ggml_type if quantised_kv else None,
                    verbose=False,
                    n_threads=n_threads,
                    n_threads_batch=n_threads_batch,
                    # an embedding model's context pools (the GGUF's pooling type; embed.py means a
                    # causal model's tokens itself)
                    embedding=model.embedding,
                    **llama_placement(model.device),  # one GPU: its VRAM budget counts the weights
                )
        except (ValueError, RuntimeError) as exc:
            log.error("llama.cpp failed to load %s: %s", model.path, exc)
            # check_gguf proved the header and the tensor data whole: what is left is memory (the
            # context: KV cache and compute buffers; or the weights' buffers) or the architecture
            raise load_failure(model, str(exc), plan, n_ctx, parallel, kv_type) from None
        if parallel > 1 or model.embedding:
            # an embedding context too: llama-cpp-python makes it of 256 sequences in one unified
            # KV stream, where packed inputs of unlike lengths changed a vector by 2e-3 (embed.py)
            make_sequences(llm, parallel, model, plan, n_ctx, kv_type)
        chat_template = None
        want = model.chat_format
        template = (
            None if model.embedding else model.chat_template or llm.metadata.get("tokenizer.chat_template")
        )
        if want == "template" and not template and not model.embedding:
            log.warning("%s has no chat template; using the fallback format", model.id)
        if template and want != "fallback":
            eos_id = llm.token_eos()
            bos_id = llm.token_bos()
            try:
                chat_template = ChatTemplate(
                    template,
                    eos_token=llm._model.token_get_text(eos_id) if eos_id != -1 else "",
                    bos_token=llm._model.token_get_text(bos_id) if bos_id != -1 else "",
                )
            except TemplateError as exc:
                llm.close()
                raise ModelFileError(
                    f'{exc} ({model.id}); fix the model\'s chat_template or set chat_format = "fallback"'
                ) from None
        vision = None
        if model.mmproj and not model.embedding:
            try:
                vision = load_projector(llm, model)
            except BaseException:
                llm.close()
                raise
        engine = cls(llm, model, chat_template, vision)
        log.info(
            "loaded %s: n_ctx=%d x %d sequences, n_vocab=%d chat=%s, CPU threads %d/%d (one token/batch)",
            model.id,
            engine.info.n_ctx,
            engine.parallel,
            engine.info.n_vocab,
            engine.info.chat_format,
            n_threads,
            n_threads_batch,
        )
        return engine

    # ---- the sequence cache (sequences.Sequences) ------------------------------------------

    @property
    def kv_dir(self) -> Path | None:
        """Where a stopped worker left its sequences' KV (see save_kv)."""
        return self.sequences.kv_dir

    @kv_dir.setter
    def kv_dir(self, value: Path | None) -> None:
        self.sequences.kv_dir = value

    @property
    def read_ahead(self) -> dict[str, kv_files.ReadAhead]:
        """Conversations' KV files being read ahead (the worker starts them while the model loads)."""
        return self.sequences.read_ahead

    @property
    def state_ctx(self) -> Callable[[], Any] | None:
        """While the weights are released the residency hides the context behind a guard; state
        I/O (which touches only the KV cache) then goes through the context this returns."""
        return self.sequences.state_ctx

    @state_ctx.setter
    def state_ctx(self, value: Callable[[], Any] | None) -> None:
        self.sequences.state_ctx = value

    def park(self) -> None:
        """Move the idle sequences into the host LRU (see Sequences.park)."""
        self.sequences.park()

    def park_states(self, states: Mapping[int, tuple[bytes, int]]) -> None:
        """Move the sequences into the host LRU from states saved elsewhere (Sequences.park_states)."""
        self.sequences.park_states(states)

    @property
    def conversations(self) -> tuple[str, ...]:
        """The conversations whose KV is cached, most recent first."""
        return self.sequences.conversations

    @property
    def cached_sequences(self) -> int:
        """How many sequences (conversations and cached prompts) the worker keeps, live included."""
        return self.sequences.cached_sequences

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by the snapshots of the sequences that are not in a slot."""
        return self.sequences.snapshot_bytes

    def save_kv(self, kv_dir: Path) -> int:
        """Write every cached sequence's KV to ``kv_dir`` (see Sequences.save_kv)."""
        return self.sequences.save_kv(kv_dir)

    def load_kv(self, kv_dir: Path, conversation: str) -> bool:
        """Bring a conversation saved by ``save_kv`` back (see Sequences.load_kv)."""
        return self.sequences.load_kv(kv_dir, conversation)

    # ---- logprobs ----------------------------------------------------------------------------

    def _wire_logprobs(self, records: Sequence[TokenLogprob]) -> list[TokenLogprobs]:
        """Sampler records as protocol entries, with each token's text as bytes (logprobs below
        -9999 are written as -9999, OpenAI's floor, so the wire stays finite)."""
        vocab = self.llm._model.vocab
        cache = self._lp_pieces

        def piece(token: int) -> bytes:
            return token_piece(vocab, token, cache)

        return [
            TokenLogprobs(
                piece(r.token),
                max(r.logprob, LOGPROB_FLOOR),
                tuple(LogprobAlt(piece(t), max(lp, LOGPROB_FLOOR)) for t, lp in r.top),
            )
            for r in records
        ]

    # ---- embeddings -------------------------------------------------------------------------

    def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        before_step: Callable[[], None] = lambda: None,
    ) -> tuple[list[list[float]], int]:
        """Unit vectors for texts or token lists (see ``embed``), and the tokens they took. Texts
        are tokenized as ``Llama.embed`` does (BOS when the vocabulary adds one, no special
        tokens). An embedding model's context is its own, all its sequences embed; a chat model
        embeds in as many idle sequences as there are inputs (empty ones first, then the least
        recently used, each first kept as a host snapshot: the KV of every conversation stays) and
        gives them back empty; between two steps of a batch, in the sequences the batch leaves
        idle (RuntimeError when there is none). One decode packs as many inputs as
        there are sequences and tokens in the batch (embed.py). Raises PromptTooLongError for an
        input over the batch, InvalidInputError for a token id outside the vocabulary and for a
        reranker."""
        if self.reranker:
            raise InvalidInputError(
                f"{self.model.display_name} is a reranker (pooling rank): it scores documents "
                "against a query on /v1/rerank and has no embeddings; embed with another model"
            )
        llm = self.llm
        n_vocab = self.info.n_vocab
        for i, item in enumerate(inputs):
            if not isinstance(item, str):
                bad = [t for t in item if not 0 <= int(t) < n_vocab]
                if bad:
                    where = "input" if len(inputs) == 1 else f"input[{i}]"
                    raise InvalidInputError(
                        f"{where}: token {bad[0]} is not in {self.model.display_name}'s vocabulary "
                        f"(0..{n_vocab - 1}); send token ids from this model's tokenizer, or text"
                    )
        step = self._embed_step(before_step)
        step()  # residency first: the rebuild path's release frees the vocabulary the texts need
        token_lists = [
            list(llm.tokenize(item.encode("utf-8"))) if isinstance(item, str) else [int(t) for t in item]
            for item in inputs
        ]
        if self.model.embedding:
            seq_ids = [slot.seq_id for slot in self.sequences.slots]
            vectors = embed_tokens(llm, token_lists, seq_ids=seq_ids, before_step=step)
        else:
            # idle sequences only: beside a batch (between two of its steps) those not in it
            slots = self.sequences.take_slots(min(len(token_lists), self.free_slots))
            try:
                vectors = embed_tokens(
                    llm,
                    token_lists,
                    seq_ids=[slot.seq_id for slot in slots],
                    switch=True,
                    before_step=step,
                )
            finally:
                for slot in slots:
                    slot.ids.clear()  # the sequence is empty now (embed_tokens removed its cells)
                    slot.dirty = True
        return vectors, sum(len(t) for t in token_lists)

    @property
    def pooling(self) -> str:
        """How the context pools, for ``ModelInfo.pooling``: "" for a chat model (embeddings, when
        asked, are mean-pooled in ``embed``), else the GGUF's ("mean", "cls", "last", "rank")."""
        if not self.model.embedding:
            return ""
        return POOLING.get(int(llama_cpp.llama_pooling_type(self.llm.ctx)), "mean")

    def rerank(
        self,
        query: str,
        documents: Sequence[str | Sequence[int]],
        before_step: Callable[[], None] = lambda: None,
    ) -> tuple[list[list[float]], int]:
        """A reranker's scores for each document against ``query`` (the classifier's outputs, the
        first one llama-server's ``relevance_score``), in the documents' order, and the tokens
        evaluated. Each pair is formatted as llama-server formats it (``embed.rerank_tokens``) and
        the pairs are packed into decodes as embeddings are (``embed.rank_tokens``: every
        sequence of the context, one pair each). Raises InvalidInputError when the model is not
        a reranker, PromptTooLongError for a pair over the batch."""
        if not self.reranker:
            raise InvalidInputError(
                f"{self.model.display_name} is not a reranker: /v1/rerank needs a model whose GGUF "
                "pools by rank (a cross-encoder such as bge-reranker or Qwen3-Reranker); "
                "use /v1/embeddings or chat with this one"
            )
        texts: list[str] = []
        for i, document in enumerate(documents):
            if not isinstance(document, str):
                raise InvalidInputError(f"documents[{i}] must be a string: a reranker reads text")
            texts.append(document)
        step = self._embed_step(before_step)
        step()  # residency first: the rebuild path's release frees the vocabulary and template
        pairs = [rerank_tokens(self.llm, query, text) for text in texts]
        seq_ids = [slot.seq_id for slot in self.sequences.slots]
        scores = rank_tokens(self.llm, pairs, seq_ids=seq_ids, before_step=step)
        return scores, sum(len(t) for t in pairs)

    def _embed_step(self, before_step: Callable[[], None]) -> Callable[[], None]:
        """What runs before an embedding's or a rerank's tokenizing and before each of its decodes:
        the caller's ``before_step`` (the worker makes the weights resident there, as before a
        generation step: nothing here touches the model before it), then the batch thread count
        (every decode is a batch of prompt tokens, whatever the last generation step left; a
        context made again by a restore starts from the defaults: Decoder.set_threads)."""

        def step() -> None:
            before_step()
            self._decoder.set_threads(prefill=True)

        return step

    # ---- generation -------------------------------------------------------------------------

    def prepare(self, req: Generate, poll: Callable[[], None] = lambda: None) -> Prepared:
        """Tokenize a request (no residency needed). ``poll`` runs between pieces and may raise
        CancelledError. Raises PromptTooLongError without touching the KV cache of any sequence."""
        if self.reranker:
            raise InvalidSamplingError(
                f"{self.model.display_name} is a reranker (pooling rank): it answers /v1/rerank only"
            )
        if self.model.embedding:
            raise InvalidSamplingError(
                f"{self.model.display_name} is an embedding model (embedding = true): "
                "it answers /v1/embeddings only"
            )
        stop = list(req.sampling.stop)
        tokens: list[int]
        if req.messages is not None:
            # the template's end-of-turn token is an end-of-generation token of the vocabulary:
            # the decoder stops on it (create_completion's stopping criterion checked the same id)
            tokens, extra_stop, media = self.prompts.chat_prompt(req.messages, tools_of(req), poll)
            stop += extra_stop
        elif req.prompt_tokens is not None:
            # token ids as given (a token-array prompt): no BOS added
            n_vocab = self.info.n_vocab
            bad = [t for t in req.prompt_tokens if not 0 <= t < n_vocab]
            if bad:
                raise InvalidInputError(
                    f"prompt: token {bad[0]} is not in {self.model.display_name}'s vocabulary "
                    f"(0..{n_vocab - 1}); send token ids from this model's tokenizer, or text"
                )
            tokens, media = list(req.prompt_tokens), {}
        else:
            assert req.prompt is not None
            # the tokens create_completion would make of the string (not tokenized twice)
            tokens, media = self.prompts.completion_prompt(req.prompt, req.images, poll)
        if len(tokens) >= self.info.n_ctx:
            close_spans(media)
            raise self.prompts.too_long(len(tokens))
        if media and req.prompt_logprobs:
            close_spans(media)
            raise InvalidInputError("the prompt's logprobs (echo) are not given for a prompt with images")
        if media and tokens[-1] < 0:
            close_spans(media)
            # (libmtmd's image decode gives no logits: the first answer token needs a text token's)
            raise InvalidInputError("the prompt ends with an image: put some text after it")
        return Prepared(req, tokens, tuple(stop), media)

    @property
    def free_slots(self) -> int:
        """How many more sequences may join the batch now."""
        return sum(1 for s in self.sequences.slots if not s.busy)

    @property
    def active(self) -> list[Live]:
        """The sequences in the batch, in join order."""
        return list(self._decoder.live)

    @property
    def decodes(self) -> int:
        """llama_decode calls since the model loaded."""
        return self._decoder.decodes

    def busy_with(self, conversation: str) -> bool:
        """Whether that conversation's sequence is in the batch (it is never decoded twice at once)."""
        return any(s.busy and s.key == conversation for s in self.sequences.slots)

    def start(
        self,
        prepared: Prepared,
        emit: Callable[[str], None],
        logprobs: Callable[[list[TokenLogprobs]], None] | None = None,
        prompt_logprobs: Callable[[list[TokenLogprobs]], None] | None = None,
    ) -> Live:
        """The request joins the batch (at the next ``step``) in the sequence its KV rules pick:
        the conversation's own, the prompt cache's, or (``cache_prompt`` false, or its prompt's
        logprobs wanted: every position evaluated) an empty one. ``prompt_logprobs`` gets the
        prompt tokens' entries (``req.prompt_logprobs``) as their rows are evaluated. Needs the
        context (call after making the weights resident)."""
        req = prepared.req
        tokens = prepared.tokens
        if req.conversation is not None and self.busy_with(req.conversation):
            raise RuntimeError(f"conversation {req.conversation} is already being answered")
        cache_prompt = self.model.cache_prompt if req.cache_prompt is None else req.cache_prompt
        if req.conversation is not None:
            # the conversation's own sequence, continued from its longest common prefix
            # (a new one with cache_prompt true starts from the prompt cache: Sequences.claim_conversation)
            slot = self.sequences.claim_conversation(req.conversation, tokens, adopt=req.cache_prompt is True)
        elif cache_prompt and not req.prompt_logprobs:
            slot = self.sequences.use_prompt_cache(tokens)
        else:
            # From an empty KV cache, exactly like a fresh Llama, so the same request gives the
            # same answer bit for bit (a prefix reused from another request was computed in other
            # batches, which can change the last bits of the logits); nothing is kept afterwards.
            slot = self.sequences.take_slot()
        slot.prompt_len = len(tokens)
        slot.busy = True
        try:
            live = self._decoder.start(
                slot.seq_id,
                slot.ids,
                tokens,
                capped(req.sampling, self.model.max_tokens),
                stop=prepared.stop,
                emit=emit,
                records=None if logprobs is None else (lambda rs: logprobs(self._wire_logprobs(rs))),
                media=prepared.media,
                prompt_records=(
                    None
                    if prompt_logprobs is None or not req.prompt_logprobs
                    else (lambda rs: prompt_logprobs(self._wire_logprobs(rs)))
                ),
                score_only=req.score_only,
                # a BOS the tokenizer put before a text prompt has no entry (the client sent none)
                skip_first=req.prompt is not None and bool(tokens) and tokens[0] == int(self.llm.token_bos()),
            )
        except BaseException:
            close_spans(prepared.media)
            self._end(slot)
            raise
        self._lives[live] = slot
        return live

    def step(self) -> list[Live]:
        """One decode step of the batch; returns the sequences that finished in it (their
        ``outcome(live)`` is ready). Needs the weights resident. A failed llama_decode ends every
        sequence of the batch (their KV is unknown) and raises RuntimeError."""
        try:
            done = self._decoder.step()
        except BaseException:
            for live in list(self._decoder.live):
                slot = self._lives[live]
                self.cancel(live)
                slot.key = None
                slot.ids.clear()
                slot.dirty = True
            raise
        for live in done:
            self._leave(live)
        return done

    def cancel(self, live: Live) -> None:
        """``live`` leaves the batch now (finish_reason "cancelled")."""
        self._decoder.cancel(live)
        self._leave(live)

    def _leave(self, live: Live) -> None:
        slot = self._lives.pop(live, None)
        if slot is not None:
            self.prompt_tokens_evaluated += live.evaluated
            self._end(slot)

    def _end(self, slot: Slot) -> None:
        slot.busy = False
        self._last = slot
        if slot.key is not None:  # (a scratch sequence is nobody's: emptied when next used)
            self.sequences.touch(slot.key)

    def kv_tokens(self) -> tuple[int, ...]:
        """The tokens the KV of the last finished request's sequence holds (its prompt and every
        answer token but the last), until another request uses that sequence."""
        return tuple(self._last.ids) if self._last is not None else ()

    def outcome(self, live: Live) -> GenerationOutcome:
        out = live.outcome()
        return GenerationOutcome(
            out.finish_reason,
            live.n_prompt,
            out.completion_tokens,
            out.evaluated,
            out.text,
            out.stop,
            out.batch_size,
            out.logprobs,
        )

    def generate(
        self,
        req: Generate,
        emit: Callable[[str], None],
        before_step: Callable[[], None] = lambda: None,
        poll: Callable[[], None] = lambda: None,
        logprobs: Callable[[list[TokenLogprobs]], None] | None = None,
        prompt_logprobs: Callable[[list[TokenLogprobs]], None] | None = None,
    ) -> GenerationOutcome:
        """Run one request alone (stepping the batch until it is done). ``before_step`` runs before
        every decode step and may raise CancelledError to stop (finish_reason "cancelled");
        ``poll`` runs while the prompt is tokenized (no residency needed) and may raise it too.
        When the request asks for logprobs, ``logprobs`` gets the entries of the tokens each piece
        completes, just before ``emit`` gets that piece. Raises PromptTooLongError without touching
        the KV cache of any conversation."""
        prepared = self.prepare(req, poll)
        before_step()  # residency first: choosing the sequence touches the context
        live = self.start(prepared, emit, logprobs, prompt_logprobs)
        try:
            while not live.done:
                before_step()
                self.step()
        except CancelledError:
            self.cancel(live)
        except BaseException:
            if not live.done:
                self.cancel(live)
            raise
        return self.outcome(live)

    def close(self) -> None:
        self.sequences.drop_snapshots()
        self._decoder.close()
        if self.vision is not None:
            self.vision.close()
        self.llm.close()


def load_projector(llm: Any, model: ModelConfig) -> Vision:
    """The model's vision projector, on its device (the GPU the model's layers are on; the CPU
    when it has none or ``n_gpu_layers`` is 0). Raises ModelFileError naming the file."""
    check_model_file(model.mmproj)
    gpus = [d for d in ggml_devices() if d.is_gpu]
    on_gpu = bool(gpus) and model.n_gpu_layers != 0 and model.device < len(gpus)
    return Vision(
        llm,
        model.mmproj,
        n_threads=max(1, int(getattr(llm, "n_threads_batch", 1) or 1)),
        device=gpus[model.device].handle if on_gpu else None,
        use_gpu=on_gpu,
    )


def batch_invariant(parallel: int) -> dict[str, Any]:
    """The model parameters a context of ``parallel`` sequences loads its weights with, so that a
    sequence's numbers do not depend on what else is in its batch.

    llama.cpp's CPU backend repacks some weight types into interleaved layouts ("extra" buffer
    types, CPU_REPACK: Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2; more on ARM), and its matmul over a
    repacked weight computes the rows of a ubatch in groups of four with one kernel (gemm) and the
    rows left over with another (gemv), whose float sums differ in the last bits. Alone, a
    sequence's rows fall the same way every time; in a batch its rows sit after (and, split
    equally per sequence by a non-unified KV cache, between) other sequences' rows, so they go
    through the other kernel: Gemma-3-270M Q4_K_M's greedy answers joining a batch differed from
    their solo ones at the 4th token (tests/test_batch_gemma.py). Without repacking, every weight
    row is computed by the same vec_dot (one row) or tinyBLAS (several) kernel whatever its
    neighbours, and the answers are the solo ones. The price: prefill on a CPU without the repacked
    kernels (docs/PERFORMANCE.md). One sequence keeps llama.cpp's defaults (nothing to vary)."""
    return {} if parallel <= 1 else {"use_extra_bufts": False}


@contextlib.contextmanager
def _model_defaults(**fields: Any) -> Iterator[None]:
    """llama-cpp-python's ``Llama`` sets only the model parameters it has arguments for, on top of
    ``llama_model_default_params()``: for the constructor's duration that function returns the
    defaults with ``fields`` set (``llm.model_params`` keeps them, so the residency's reload makes
    the same). The worker's loop thread is the only one loading a model."""
    if not fields:
        yield
        return
    module: Any = llama_cpp.llama_cpp
    real = module.llama_model_default_params

    def defaults() -> Any:
        params = real()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    module.llama_model_default_params = defaults
    try:
        yield
    finally:
        module.llama_model_default_params = real


def load_failure(
    model: ModelConfig, reason: str, plan: LoadPlan | None, n_ctx: int, parallel: int, kv_type: str
) -> TimeshareError:
    """The error for llama.cpp's refusal to load ``model`` (its ValueError's ``reason``): a context
    that could not be created is out of memory (its KV cache and compute buffers are what it
    allocates), as are weights larger than the device's free memory; anything else, the file's
    architecture. A whole file was proved by check_gguf, so never "damaged"."""
    gpu = plan.gpu if plan is not None else bool(llama_placement(model.device))
    free = plan.free_now() if plan is not None else None
    words = memory_words(gpu)
    free_text = f"; {decimal_bytes(free)} of {words} is free now" if free is not None else ""
    if "llama_context" in reason:
        kv = f"a KV cache of {decimal_bytes(plan.kv_bytes)} " if plan is not None and plan.kv_bytes else ""
        return OutOfDeviceMemoryError(
            f"out of {words}: {model.id}'s context ({kv}for n_ctx {n_ctx} × {parallel} sequences, "
            f"{kv_type}, and its compute buffers) could not be allocated{free_text}: lower "
            f'models[].n_ctx or parallel, set kv_cache_type = "q8_0" or "q4_0"'
            + (", or lower n_gpu_layers" if gpu else "")
        )
    if plan is not None and free is not None and plan.weight_bytes > free:
        return OutOfDeviceMemoryError(
            f"out of {words}: {model.id}'s weights take {decimal_bytes(plan.weight_bytes)}{free_text}: "
            + ("lower n_gpu_layers, " if gpu else "")
            + "use a smaller quantisation, or stop what else uses it"
        )
    return ModelFileError(
        f"model file {model.path} cannot be loaded: llama.cpp refused it ({reason}): its architecture "
        "may be one this build does not support; see the worker log"
    )


def make_sequences(
    llm: Any,
    parallel: int,
    model: ModelConfig,
    plan: LoadPlan | None = None,
    n_ctx: int = 0,
    kv_type: str = DEFAULT_KV_TYPE,
) -> None:
    """Give ``llm`` a context of ``parallel`` sequences, each in its own KV stream (``kv_unified``
    false: a sequence's logits do not depend on the others in the batch; with a unified cache 3 of
    4 greedy answers differed from their solo runs). llama-cpp-python's constructor takes neither
    setting: its context is replaced by one made with them (``context_params`` keeps them, so the
    residency's rebuilds make the same)."""
    params = llm.context_params
    params.n_seq_max = parallel
    params.kv_unified = False
    llm._ctx.close()  # first: the two KV caches never exist at once
    try:
        ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=llm.verbose)
    except ValueError as exc:
        llm.close()
        raise load_failure(model, str(exc), plan, n_ctx, parallel, kv_type) from None
    llm._stack.enter_context(contextlib.closing(ctx))
    llm._ctx = ctx


def capped(sampling: Sampling, cap: int | None) -> Sampling:
    """``sampling`` with its answer length limited to a model's ``max_tokens`` setting (None: none)."""
    if cap is None or (sampling.max_tokens is not None and sampling.max_tokens <= cap):
        return sampling
    return sampling.replace(max_tokens=cap)
