"""The engine: one loaded GGUF model and its conversations, driven by the worker's loop thread.

Nothing here is thread-safe on purpose: the worker's loop thread is the only caller. Generation
runs in ``decode.Decoder`` (llama.cpp's low-level API; a completion at temperature 0 from an empty
KV cache equals what a plain ``Llama(path, n_ctx=...).create_completion`` produces): the context is
built with the library's defaults (only n_ctx, n_gpu_layers, use_mmap, verbose and the model's
``flash_attn`` differ; the first three do not change numerics, ``flash_attn`` is off unless set;
a context of several sequences also loads the weights unrepacked: see ``batch_invariant``).
The caller's ``before_step`` hook runs before every decode step: that is where the worker drains
its queue (cancel, yield) and makes sure the weights are resident.

Sequences: the worker keeps up to ``n_seq`` token sequences with their KV: the live one in the
context (it continues by llama-cpp-python's prefix matching: only the tokens after the common
prefix are evaluated) and the others as host snapshots of the context state
(``llama_state_get_data``) in an LRU, each with its token ids. A sequence belongs either to a
``conversation`` (the Timeshare extension: the key picks it) or to the prompt cache (keyless
requests: the prompt picks the cached sequence it shares the longest prefix with, see
``_use_prompt_cache``). Conversations evicted beyond ``n_seq`` go to ``kv_dir``; keyless ones are
dropped. When the worker stops, every cached sequence is written to ``kv_dir`` and comes back
after a restart without a re-prefill.

Chat formats: the GGUF's Jinja chat template (``chat_format == "template"``), or for models without
one (e.g. the Gemma-3-270M base model) the fallback format below (``"fallback"``):

    <system text>\\n\\n            (only when there is a system message)
    User: <text>\\n
    Assistant: <text>\\n
    ...
    User: <last text>\\n
    Assistant:

with stop strings ``"\\nUser:"``, ``"\\nAssistant:"`` and ``"\\n\\n\\n"``, so a base model's answer ends
where it would start the next turn.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals

from ..chatformat.history import normalise, render
from ..chatformat.template import ChatTemplate, TemplateCaps, TemplateError
from ..config.schema import ModelConfig
from ..errors import (
    CancelledError,
    ChatTemplateError,
    InvalidInputError,
    InvalidSamplingError,
    ModelFileError,
    PromptTooLongError,
)
from ..gguf.modelfile import check_model_file
from ..residency import check_gguf
from ..sampling import Sampling
from . import kv_files
from .decode import Decoder, Live, common_prefix
from .device import default_parallel, llama_placement
from .embed import embed_tokens
from .kv_files import KVSnapshot
from .protocol import ChatMessage, FinishReason, Generate, LogprobAlt, TokenLogprobs
from .sampler import TokenLogprob
from .textstream import token_piece

log = logging.getLogger(__name__)

#: the lowest logprob written (OpenAI's floor for impossible tokens)
LOGPROB_FLOOR = -9999.0

FALLBACK_STOP = ("\nUser:", "\nAssistant:", "\n\n\n")


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


#: A sequence's key: a conversation id (str) or a keyless sequence of the prompt cache (int).
SeqKey = str | int


@dataclass(eq=False)
class Slot:
    """One sequence of the context (seq id ``seq_id``): whose it is and the tokens its KV holds."""

    seq_id: int
    key: SeqKey | None = None  # None: empty (or, while busy, a scratch sequence kept by nobody)
    ids: list[int] = field(default_factory=list)  # the tokens its KV holds
    prompt_len: int = 0  # the prompt of the last request on it (the tokens after it were generated)
    busy: bool = False  # in the batch
    dirty: bool = False  # its KV may hold cells ``ids`` does not say (emptied when next used)


@dataclass(frozen=True)
class Prepared:
    """A tokenized request, ready to join the batch."""

    req: Generate
    tokens: list[int]
    stop: tuple[str, ...]


#: A keyless request that diverges inside a cached sequence copies it (and leaves the original
#: cached) only when it would otherwise cut off at least this fraction of the sequence (and at
#: least 8 tokens); below that it cuts the sequence back and goes on in it, as llama-server's slot
#: does: a copy costs a pass over the whole KV cache (twice: out to host memory and back), the cut
#: costs re-evaluating what was cut off if that sequence comes back.
BRANCH_MIN_FRACTION = 0.1

#: The prompt cache's similarity rule (llama-server's ``--slot-prompt-similarity`` idea): a keyless
#: request reuses a cached sequence only when the prefix it can reuse is at least
#: ``PROMPT_CACHE_MIN_TOKENS`` tokens and at least ``PROMPT_CACHE_MIN_FRACTION`` of its prompt.
#: Anything less is evaluated from an empty KV cache, so short or unrelated prompts keep the
#: answer of a fresh ``Llama`` bit for bit (a prefix that short costs about one decode step on a
#: GPU anyway: it goes in a single batch).
PROMPT_CACHE_MIN_TOKENS = 64
PROMPT_CACHE_MIN_FRACTION = 0.25

#: Prompts are tokenized in pieces: llama.cpp's special-token split rescans the text after each
#: special token it finds, so one call is quadratic in their number (20k chat messages took 40 s),
#: and one call cannot be cancelled. A piece ends where a special token of the chat template starts
#: (llama.cpp cuts there too, so the tokens are the same) once it holds this many bytes or markers.
_PIECE_BYTES = 4096
_PIECE_MARKERS = 32
#: special-token-like strings in a chat template: <|im_start|>, <start_of_turn>, [INST] ...
_MARKER_CANDIDATE = re.compile(r"<\|[^|<>\s]{1,64}\|>|<[^<>\s{}%|]{1,64}>|\[/?[A-Z_]{2,32}\]")
_SPECIAL_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
#: a piece longer than this many characters per context token is probed first: when its start
#: alone holds more tokens than the context, the prompt is refused without tokenizing it all
_PROBE_CHARS_PER_TOKEN = 8


class Engine:
    """A loaded model. Build it with ``Engine.load``; call only from one thread."""

    def __init__(self, llm: Any, model: ModelConfig, template: ChatTemplate | None) -> None:
        self.llm = llm
        self.model = model
        self.template = template  # the chat template, or None for the fallback format
        ctx = llm.ctx
        self.parallel = max(1, int(llama_cpp.llama_n_seq_max(ctx)))
        self.info = EngineInfo(
            n_ctx=int(llama_cpp.llama_n_ctx_seq(ctx)),  # per sequence: every request has all of it
            n_vocab=int(llm.n_vocab()),
            chat_format="template" if template is not None else "fallback",
            parallel=self.parallel,
        )
        self.kv_dir: Path | None = None  # where a stopped worker left its sequences' KV (see save_kv)
        #: conversations' KV files being read ahead (the worker starts them while the model loads)
        self.read_ahead: dict[str, kv_files.ReadAhead] = {}
        # While the weights are released the residency hides the context behind a guard; state
        # I/O (which touches only the KV cache) then goes through the context this returns.
        self.state_ctx: Callable[[], Any] | None = None
        # the context's sequences (seq ids 0..parallel-1) and the others, as host snapshots
        self._slots = [Slot(i) for i in range(self.parallel)]
        self._saved: dict[SeqKey, KVSnapshot] = {}
        self._used: dict[SeqKey, int] = {}  # when each cached sequence was last used (LRU)
        self._tick = 0
        self._next_keyless = 0
        self._prompts_loaded = False  # the keyless sequences a stopped worker left in kv_dir
        self._n_swa = max(0, int(llama_cpp.llama_model_n_swa(llm.model)))
        self.prompt_tokens_evaluated = 0  # since start
        self._markers = self._template_markers(template.source if template is not None else "")
        self._decoder = Decoder(llm)
        self._last: Slot | None = None
        self._lp_pieces: dict[int, bytes] = {}  # token -> bytes, for logprob entries
        self._lives: dict[Live, Slot] = {}  # the batch's sequences and their slots

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, model: ModelConfig, *, use_mmap: bool = True) -> Engine:
        """Load the GGUF. Raises ModelFileError with a sentence saying what to do."""
        check_model_file(model.path)
        check_gguf(model.path)  # truncation is caught before llama.cpp sees the file
        # an embedding model's sequences let one decode embed several inputs (core/worker/embed.py)
        parallel = model.parallel or default_parallel()
        try:
            with _model_defaults(**batch_invariant(parallel)):
                llm = llama_cpp.Llama(
                    model_path=model.path,
                    n_ctx=model.n_ctx * parallel,  # each sequence has the model's whole n_ctx
                    n_gpu_layers=model.n_gpu_layers,
                    use_mmap=use_mmap,
                    flash_attn=model.flash_attn,
                    verbose=False,
                    # an embedding model's context pools (the GGUF's pooling type; embed.py means a
                    # causal model's tokens itself)
                    embedding=model.embedding,
                    **llama_placement(model.device),  # one GPU: its VRAM budget counts the weights
                )
        except (ValueError, RuntimeError) as exc:
            log.error("llama.cpp failed to load %s: %s", model.path, exc)
            # check_gguf proved the header and the tensor data whole: llama.cpp refused it otherwise
            raise ModelFileError(
                f"model file {model.path} cannot be loaded: llama.cpp could not load it "
                "(unsupported architecture or damaged file); see the worker log"
            ) from None
        if parallel > 1 or model.embedding:
            # an embedding context too: llama-cpp-python makes it of 256 sequences in one unified
            # KV stream, where packed inputs of unlike lengths changed a vector by 2e-3 (embed.py)
            _sequences(llm, parallel)
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
        engine = cls(llm, model, chat_template)
        log.info(
            "loaded %s: n_ctx=%d x %d sequences, n_vocab=%d chat=%s",
            model.id,
            engine.info.n_ctx,
            engine.parallel,
            engine.info.n_vocab,
            engine.info.chat_format,
        )
        return engine

    # ---- sequences --------------------------------------------------------------------------

    def _state_ctx(self) -> Any:
        """The llama_context pointer for state I/O (see ``state_ctx``)."""
        return self.state_ctx() if self.state_ctx is not None else self.llm.ctx

    def _memory(self) -> Any:
        return llama_cpp.llama_get_memory(self._state_ctx())

    def _pos_min(self, slot: Slot) -> int:
        """The lowest position the slot's KV holds (-1: empty)."""
        return int(llama_cpp.llama_memory_seq_pos_min(self._memory(), slot.seq_id))

    def _snapshot(self, slot: Slot) -> KVSnapshot:
        """A host copy of one sequence's KV (``llama_state_seq_get_data``: that sequence only)."""
        ctx = self._state_ctx()
        size = int(llama_cpp.llama_state_seq_get_size(ctx, slot.seq_id))
        # one copy of the state: llama.cpp writes into the buffer's own memory, kept as it is
        state = kv_files.state_buffer(size)
        buf = (ctypes.c_uint8 * size).from_buffer(state)
        n = int(llama_cpp.llama_state_seq_get_data(ctx, buf, size, slot.seq_id))
        del buf  # releases the export of ``state``, so it may be resized
        state = kv_files.truncated(state, n)
        ids = tuple(slot.ids)
        pos_min = self._restored_pos_min(len(ids), self._pos_min(slot))
        return KVSnapshot(len(ids), ids, state, pos_min, slot.prompt_len)

    def _restored_pos_min(self, n_tokens: int, pos_min: int) -> int:
        """The lowest position a snapshot of a sequence of ``n_tokens`` (whose KV starts at
        ``pos_min``) holds once it is restored. ``llama_state_seq_get_data`` leaves out the cells a
        sliding window masks (llama-kv-cache.cpp's state_write: the SWA layers of a sequence keep
        only its last ``n_swa`` positions, however many the context held), so a restored Gemma-3
        sequence longer than the window can be continued, not cut back (``_window_holds``)."""
        pos_min = max(0, pos_min)
        return max(pos_min, n_tokens - self._n_swa) if self._n_swa > 0 else pos_min

    def _load_snapshot(self, slot: Slot, snap: KVSnapshot) -> None:
        """Put a host snapshot into the slot's sequence (whatever it held is dropped)."""
        self._clear(slot)
        ctx = self._state_ctx()
        buf = (ctypes.c_uint8 * len(snap.state)).from_buffer(snap.state)  # no copy
        if int(llama_cpp.llama_state_seq_set_data(ctx, buf, len(snap.state), slot.seq_id)) != len(snap.state):
            raise RuntimeError("llama.cpp refused a KV snapshot")
        slot.ids[:] = snap.input_ids
        slot.prompt_len = snap.prompt_len

    def _clear(self, slot: Slot) -> None:
        """Empty the slot's sequence (its KV cells too)."""
        if slot.ids or slot.dirty:
            llama_cpp.llama_memory_seq_rm(self._memory(), slot.seq_id, -1, -1)
        slot.ids.clear()
        slot.dirty = False
        slot.prompt_len = 0

    def _touch(self, key: SeqKey) -> None:
        self._tick += 1
        self._used[key] = self._tick

    def _slot_of(self, key: SeqKey) -> Slot | None:
        return next((s for s in self._slots if s.key == key), None)

    def _recent(self) -> list[SeqKey]:
        """Every cached sequence's key (in a slot or a host snapshot), most recent first."""
        keys = [s.key for s in self._slots if s.key is not None] + list(self._saved)
        return sorted(keys, key=lambda k: self._used.get(k, 0), reverse=True)

    def park(self) -> None:
        """Move the idle slots' sequences into the host LRU (before the context is freed); the
        sequences of a running batch stay (the residency keeps every sequence's KV)."""
        for slot in self._slots:
            if not slot.busy:
                try:
                    self._park(slot)
                except Exception:  # the others are still worth keeping
                    log.exception("could not snapshot the sequence %s", slot.key)
                    slot.key = None
                    slot.ids.clear()
        self._trim(self.model.n_seq)

    def _park(self, slot: Slot) -> None:
        """Keep the slot's sequence as a host snapshot and empty the slot."""
        if slot.key is not None and slot.ids:
            self._saved[slot.key] = self._snapshot(slot)
        elif slot.key is not None:
            self._used.pop(slot.key, None)
        slot.key = None
        self._clear(slot)

    def _free_slot(self, exclude: Slot | None = None) -> Slot | None:
        """An idle slot for a new sequence, emptied: an empty one, else the least recently used
        one's sequence goes to the host LRU. None when every other slot is in the batch."""
        idle = [s for s in self._slots if not s.busy and s is not exclude]
        if not idle:
            return None
        empty = [s for s in idle if s.key is None]
        slot = (
            empty[0]
            if empty
            else min(idle, key=lambda s: self._used.get(s.key, 0) if s.key is not None else 0)
        )
        self._park(slot)
        return slot

    def _trim(self, keep: int, protect: Slot | None = None) -> None:
        """LRU beyond ``n_seq``: the least recently used sequences (never one in the batch) leave
        the KV cache: conversations go to ``kv_dir`` (so they still come back without a
        re-prefill), or are dropped when there is no kv_dir; keyless sequences of the prompt cache
        are dropped."""
        keep = max(keep, 1)
        while True:
            keys = self._recent()
            if len(keys) <= keep:
                return
            busy = {s.key for s in self._slots if s.busy or s is protect}
            victims = [k for k in keys if k not in busy]
            if not victims:
                return
            evicted = victims[-1]
            slot = self._slot_of(evicted)
            if slot is not None:
                snap = self._snapshot(slot) if isinstance(evicted, str) and slot.ids else None
                slot.key = None
                self._clear(slot)
            else:
                snap = self._saved.pop(evicted)
            self._used.pop(evicted, None)
            if isinstance(evicted, int) or snap is None:
                log.debug("a cached prompt left the KV cache (n_seq=%d)", keep)
                continue
            where = "dropped"
            if self.kv_dir is not None:
                try:
                    target = kv_files.kv_file(self.kv_dir, self.model.id, evicted)
                    kv_files.write(target, self.model.id, {"conversation": evicted}, snap, self._identity())
                    where = f"moved to {self.kv_dir}"
                except OSError as exc:
                    log.warning("could not write the KV of %s to %s: %s", evicted, self.kv_dir, exc)
            log.info("conversation %s left the KV cache (n_seq=%d): %s", evicted, self.model.n_seq, where)

    def _take_slots(self, count: int) -> list[Slot]:
        """Up to ``count`` idle slots, emptied (``_free_slot`` for each: empty ones first), at
        least one."""
        taken: list[Slot] = []
        try:
            while len(taken) < max(1, count):
                slot = self._free_slot()
                if slot is None:
                    break
                slot.busy = True  # not chosen again
                taken.append(slot)
        finally:
            for slot in taken:
                slot.busy = False
        if not taken:
            raise RuntimeError("every sequence of the context is in the batch")  # the worker admits fewer
        return taken

    def _take_slot(self, exclude: Slot | None = None) -> Slot:
        slot = self._free_slot(exclude)
        if slot is None:
            raise RuntimeError("every sequence of the context is in the batch")  # the worker admits fewer
        return slot

    def _claim_conversation(self, conversation: str, tokens: Sequence[int]) -> Slot:
        """The conversation's own sequence, in a slot (from the host LRU or kv_dir when it is not
        in one), to be continued from its longest common prefix with ``tokens``."""
        slot = self._slot_of(conversation)
        if slot is None:
            if conversation not in self._saved and self.kv_dir is not None:
                self.load_kv(self.kv_dir, conversation)
            slot = self._take_slot()
            snap = self._saved.pop(conversation, None)
            if snap is not None:
                try:
                    self._load_snapshot(slot, snap)
                    log.debug("conversation %s restored from host (%d tokens)", conversation, snap.n_tokens)
                except RuntimeError as exc:  # the request goes on from an empty KV cache
                    log.warning("conversation %s: %s; it is evaluated again", conversation, exc)
                    self._clear(slot)
                    slot.dirty = True
            slot.key = conversation
        self._touch(conversation)
        self._trim(self.model.n_seq, protect=slot)
        self._keep_window(slot, tokens)
        return slot

    def _window_holds(self, pos_min: int, reuse: int, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` whose KV starts at ``pos_min`` can be cut back to
        its first ``reuse`` tokens and continued: a model with sliding-window attention (Gemma 3)
        may have dropped positions the new tokens attend to. llama-server's rule: the KV must
        still hold position ``reuse - n_swa``. Continuing the whole sequence is always fine."""
        if reuse <= 0 or reuse >= n_tokens:
            return True
        return pos_min <= max(0, reuse - self._n_swa)

    def _keep_window(self, slot: Slot, tokens: Sequence[int]) -> None:
        """Before continuing the slot's sequence with ``tokens``: start it over from an empty KV
        cache when the reuse the decoder would make is not possible (``_window_holds``)."""
        reuse = min(common_prefix(slot.ids, tokens), len(tokens) - 1)
        if not self._window_holds(self._pos_min(slot), reuse, len(slot.ids)):
            log.info("the sliding window no longer holds position %d: evaluating from scratch", reuse)
            key = slot.key
            self._clear(slot)
            slot.key = key

    def _new_keyless(self) -> int:
        self._next_keyless += 1
        return self._next_keyless

    def _use_prompt_cache(self, tokens: Sequence[int]) -> Slot:
        """The slot a keyless request with prompt ``tokens`` continues.

        The candidate is the cached keyless sequence (idle in a slot, or a host snapshot) with the
        longest common prefix with the prompt (ties: the most recent), less the last prompt token
        (its logits are needed). When the reusable prefix passes the similarity rule (see
        ``PROMPT_CACHE_MIN_TOKENS``) and the sliding window still holds it, the request continues
        that sequence: it takes it over when it extends the sequence's last prompt (the next turn
        of a chat, a growing completion prompt, the same prompt again) or when what it would cut
        off is small (``BRANCH_MIN_FRACTION``), else it branches: it continues a copy and the
        original stays cached (two chats that share only a system prompt). Otherwise it starts a
        fresh sequence from an empty KV cache. A new sequence evicts the least recently used one
        beyond ``n_seq``. Conversations, and sequences in the batch, are never candidates."""
        self._load_saved_prompts()
        best: SeqKey | None = None
        best_reuse = 0
        best_prompt_len = 0
        best_len = 0
        limit = len(tokens) - 1
        for key in self._recent():
            if not isinstance(key, int):
                continue
            slot = self._slot_of(key)
            if slot is not None:
                if slot.busy:
                    continue
                ids: Sequence[int] = slot.ids
                pos_min, prompt_len = -1, slot.prompt_len
            else:
                snap = self._saved[key]
                ids, prompt_len = snap.input_ids, snap.prompt_len
                pos_min = self._restored_pos_min(snap.n_tokens, snap.pos_min)  # (files of older runs)
            reuse = min(common_prefix(ids, tokens), limit)
            if reuse <= best_reuse:
                continue
            if slot is not None:  # in the context: ask it
                pos_min = self._pos_min(slot)
            if self._window_holds(pos_min, reuse, len(ids)):
                best, best_reuse, best_prompt_len, best_len = key, reuse, prompt_len, len(ids)
        if best is None or best_reuse < max(PROMPT_CACHE_MIN_TOKENS, PROMPT_CACHE_MIN_FRACTION * len(tokens)):
            slot = self._take_slot()
            slot.key = self._new_keyless()
        else:
            # the last prompt token is evaluated again, so the same prompt takes the sequence over.
            # A prompt that diverges inside the sequence's last prompt branches (the original stays
            # cached, the request goes on in a copy) only when the part it would cut off is worth
            # the copy: a copy costs a pass over the sequence's KV (twice: out to host memory and
            # back), cutting costs re-evaluating the tokens cut off if that sequence comes back
            lost = best_len - best_reuse
            take_over = best_reuse >= best_prompt_len - 1 or lost < max(8, BRANCH_MIN_FRACTION * best_len)
            source = self._slot_of(best)
            if source is not None:
                if take_over:
                    slot = source
                else:
                    self._touch(best)  # the original stays cached, as the most recent
                    other = self._free_slot(exclude=source)
                    if other is None:  # the original goes to host memory, the copy stays here
                        self._saved[best] = self._snapshot(source)
                        slot = source
                    else:
                        slot = other
                        self._load_snapshot(slot, self._snapshot(source))
                    slot.key = self._new_keyless()
            else:
                if take_over:
                    snap = self._saved.pop(best)
                    new_key: SeqKey = best
                else:
                    snap = self._saved[best]
                    self._touch(best)
                    new_key = self._new_keyless()
                slot = self._take_slot()
                self._load_snapshot(slot, snap)
                slot.key = new_key
            log.debug(
                "prompt cache: %d of %d prompt tokens reused (%s)",
                best_reuse,
                len(tokens),
                "taken over" if take_over else "branched",
            )
        assert slot.key is not None
        # the window rule on what the slot holds now: a copy made through a snapshot holds less
        # than its source did (see _restored_pos_min)
        self._keep_window(slot, tokens)
        self._touch(slot.key)
        self._trim(self.model.n_seq, protect=slot)
        return slot

    @property
    def conversations(self) -> tuple[str, ...]:
        """The conversations whose KV is cached, most recent first."""
        return tuple(k for k in self._recent() if isinstance(k, str))

    @property
    def cached_sequences(self) -> int:
        """How many sequences (conversations and cached prompts) the worker keeps, live included."""
        return len(self._recent())

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by the snapshots of the sequences that are not in a slot."""
        return sum(len(s.state) + 4 * s.n_tokens for s in self._saved.values())

    # ---- KV on disk (stop / start; the file format is kv_files') ------------------------------

    def _identity(self) -> dict[str, object]:
        return kv_files.identity(self.model.path, self.info.n_ctx)

    def save_kv(self, kv_dir: Path) -> int:
        """Write every cached sequence's KV snapshot to ``kv_dir`` (atomic per file): conversations
        by key, cached prompts by rank (older cached-prompt files are replaced). Returns how many."""
        for slot in self._slots:
            try:
                self._park(slot)
            except Exception:  # the others are still worth saving
                log.exception("could not snapshot the sequence %s", slot.key)
                slot.key = None
                slot.ids.clear()
        if kv_dir == self.kv_dir:
            self._load_saved_prompts()  # those this run never needed are kept, within n_seq
        ident = self._identity()
        mid = self.model.id
        count = 0
        stale = kv_files.prompt_files(kv_dir, mid)
        rank = 0
        for key in self._recent():
            snap = self._saved[key]
            if isinstance(key, str):
                kv_files.write(kv_files.kv_file(kv_dir, mid, key), mid, {"conversation": key}, snap, ident)
            else:
                kv_files.write(kv_files.prompt_file(kv_dir, mid, rank), mid, {"prompt": rank}, snap, ident)
                stale.pop(rank, None)
                rank += 1
            count += 1
        for path in stale.values():
            path.unlink(missing_ok=True)
        log.info("saved the KV of %d conversation(s) and cached prompt(s) to %s", count, kv_dir)
        return count

    def load_kv(self, kv_dir: Path, conversation: str) -> bool:
        """Bring a conversation saved by ``save_kv`` back into the host LRU (and delete the file).
        A file from another model file or context size is ignored and removed."""
        path = kv_files.kv_file(kv_dir, self.model.id, conversation)
        ahead = self.read_ahead.pop(conversation, None)
        if ahead is not None and ahead.path != path:
            ahead = None
        if ahead is None and not path.is_file():
            return False
        t0 = time.perf_counter()
        if ahead is not None:
            snap = ahead.result(self._identity())
        else:
            snap = kv_files.read(path, {"conversation": conversation}, self._identity())
        if snap is None:
            return False
        self._saved[conversation] = snap
        self._touch(conversation)
        log.info(
            "conversation %s: KV loaded from disk (%d tokens, %.1f MB in %.0f ms%s)",
            conversation,
            snap.n_tokens,
            len(snap.state) / 1e6,
            (time.perf_counter() - t0) * 1000.0,
            ", read while the model loaded" if ahead is not None else "",
        )
        return True

    def _load_saved_prompts(self) -> None:
        """Once: bring the cached prompts a stopped worker left in ``kv_dir`` back, as the least
        recently used sequences (only as many as ``n_seq`` leaves room for)."""
        if self._prompts_loaded or self.kv_dir is None:
            return
        self._prompts_loaded = True
        room = self.model.n_seq - self.cached_sequences
        loaded = 0
        oldest = min(self._used.values(), default=0)
        for rank, path in sorted(kv_files.prompt_files(self.kv_dir, self.model.id).items()):
            if loaded >= room:
                path.unlink(missing_ok=True)
                continue
            snap = kv_files.read(path, {"prompt": rank}, self._identity())
            if snap is None:
                continue
            key = self._new_keyless()
            self._saved[key] = snap
            self._used[key] = oldest - 1 - loaded  # older than everything this run used
            loaded += 1
        if loaded:
            log.info("%d cached prompt(s) loaded from %s", loaded, self.kv_dir)

    # ---- prompts ----------------------------------------------------------------------------

    def _template_markers(self, template: str) -> re.Pattern[str] | None:
        """The special tokens a chat template writes (found in its text, checked against the
        vocabulary), as one pattern: where a prompt may be cut into pieces (see _PIECE_BYTES)."""
        llm = self.llm
        vocab = llm._model.vocab
        found: set[str] = set()
        for candidate in set(_MARKER_CANDIDATE.findall(template)):
            ids = llm.tokenize(candidate.encode("utf-8"), add_bos=False, special=True)
            if len(ids) == 1 and llama_cpp.llama_vocab_get_attr(vocab, ids[0]) & _SPECIAL_ATTRS:
                found.add(candidate)
        if not found:
            return None
        return re.compile("|".join(re.escape(m) for m in sorted(found, key=len, reverse=True)))

    def _pieces(self, text: str, special: bool) -> list[str]:
        """``text`` cut before special tokens of the template, in pieces of about _PIECE_BYTES."""
        if self._markers is None or not special or len(text) <= _PIECE_BYTES:
            return [text]
        pieces: list[str] = []
        start = 0
        markers = 0
        for match in self._markers.finditer(text):
            cut = match.start()
            markers += 1
            if cut > start and (cut - start >= _PIECE_BYTES or markers > _PIECE_MARKERS):
                pieces.append(text[start:cut])
                start = cut
                markers = 1
        pieces.append(text[start:])
        return pieces

    def _tokenize(
        self, text: str, *, add_bos: bool, special: bool, poll: Callable[[], None] = lambda: None
    ) -> list[int]:
        """``llm.tokenize(text)`` in pieces, linear in the text, with ``poll`` (which may raise
        CancelledError) between pieces; raises PromptTooLongError as soon as the tokens so far
        (or the start of a long piece) fill the context, without tokenizing the rest."""
        llm = self.llm
        n_ctx = self.info.n_ctx
        if llm._model.add_eos_token():  # EOS would end every piece: one call then
            return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))
        tokens: list[int] = []
        pieces = self._pieces(text, special)
        for i, piece in enumerate(pieces):
            poll()
            first = add_bos and i == 0
            probe_chars = _PROBE_CHARS_PER_TOKEN * n_ctx + _PIECE_BYTES
            if len(piece) > probe_chars:
                probe = llm.tokenize(piece[:probe_chars].encode("utf-8"), add_bos=first, special=special)
                if len(tokens) + len(probe) > n_ctx + 8:  # a cut word adds a token or two, no more
                    raise self._too_long(len(tokens) + len(probe) - 8, at_least=True)
                poll()
            tokens += llm.tokenize(piece.encode("utf-8"), add_bos=first, special=special)
            if len(tokens) >= n_ctx:
                raise self._too_long(len(tokens), at_least=i + 1 < len(pieces))
        return tokens

    def _chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]] = (),
        poll: Callable[[], None] = lambda: None,
    ) -> tuple[list[int], list[str]]:
        """Tokens and extra stop strings for a chat request (``tools``: OpenAI tool objects)."""
        history = [chat_message_dict(m) for m in messages]
        if self.template is not None:
            try:
                prompt = render(self.template, history, tools)
            except TemplateError as exc:
                raise ChatTemplateError(
                    f"the chat template of {self.model.display_name} refused these messages: {exc}"
                ) from None
            # the template writes BOS itself (as llama-cpp-python's formatter: added_special)
            tokens = self._tokenize(prompt, add_bos=False, special=True, poll=poll)
            return tokens, [self.template.eos_token]
        # the fallback format shows only user and assistant turns: tool calls and results as text
        plain = [ChatMessage(role=m["role"], content=m["content"]) for m in normalise(history, _NO_TOOLS)]
        return (
            self._tokenize(fallback_prompt(plain), add_bos=True, special=False, poll=poll),
            list(FALLBACK_STOP),
        )

    def _completion_tokens(self, prompt: str, poll: Callable[[], None] = lambda: None) -> list[int]:
        """A completion prompt's tokens, built as ``Llama.create_completion`` builds them for a
        string prompt (BOS or CLS when the vocabulary adds one, EOS or SEP when it adds one)."""
        llm = self.llm
        vocab = llm._model
        bos, cls_id, sep = int(llm.token_bos()), int(vocab.token_cls()), int(vocab.token_sep())
        head = [cls_id if cls_id != -1 else bos]
        if not vocab.add_bos_token() or head == [-1]:
            head = []
        tail = [sep if sep != -1 else int(llm.token_eos())]
        if not vocab.add_eos_token() and sep == -1:
            tail = []
        body = self._tokenize(prompt, add_bos=False, special=True, poll=poll) if prompt else []
        return [*head, *(int(t) for t in body), *tail]

    def _too_long(self, n: int, *, at_least: bool = False) -> PromptTooLongError:
        size = f"at least {n}" if at_least else f"{n}"
        return PromptTooLongError(
            f"the prompt is {size} tokens but {self.model.display_name} holds {self.info.n_ctx} tokens "
            f"of context (the answer needs room too): shorten the prompt or raise n_ctx for this model"
        )

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
        gives them back empty (never while a batch decodes). One decode packs as many inputs as
        there are sequences and tokens in the batch (embed.py). Raises PromptTooLongError for an
        input over the batch, InvalidInputError for a token id outside the vocabulary."""
        llm = self.llm
        n_vocab = self.info.n_vocab
        token_lists: list[list[int]] = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                token_lists.append(list(llm.tokenize(item.encode("utf-8"))))
            else:
                bad = [t for t in item if not 0 <= int(t) < n_vocab]
                if bad:
                    where = "input" if len(inputs) == 1 else f"input[{i}]"
                    raise InvalidInputError(
                        f"{where}: token {bad[0]} is not in {self.model.display_name}'s vocabulary "
                        f"(0..{n_vocab - 1}); send token ids from this model's tokenizer, or text"
                    )
                token_lists.append([int(t) for t in item])
        before_step()  # residency first: the context is about to decode
        # every decode is a batch of prompt tokens: the batch thread count, whatever the last
        # generation step left (Decoder.set_threads)
        self._decoder.set_threads(prefill=True)
        if self.model.embedding:
            seq_ids = [slot.seq_id for slot in self._slots]
            vectors = embed_tokens(llm, token_lists, seq_ids=seq_ids, before_step=before_step)
        else:
            if self._decoder.live:
                raise RuntimeError("embeddings while a batch is decoding")  # the worker runs them between
            slots = self._take_slots(min(len(token_lists), len(self._slots)))
            try:
                vectors = embed_tokens(
                    llm,
                    token_lists,
                    seq_ids=[slot.seq_id for slot in slots],
                    switch=True,
                    before_step=before_step,
                )
            finally:
                for slot in slots:
                    slot.ids.clear()  # the sequence is empty now (embed_tokens removed its cells)
                    slot.dirty = True
        return vectors, sum(len(t) for t in token_lists)

    # ---- generation -------------------------------------------------------------------------

    def prepare(self, req: Generate, poll: Callable[[], None] = lambda: None) -> Prepared:
        """Tokenize a request (no residency needed). ``poll`` runs between pieces and may raise
        CancelledError. Raises PromptTooLongError without touching the KV cache of any sequence."""
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
            tokens, extra_stop = self._chat_prompt(req.messages, tools_of(req), poll)
            stop += extra_stop
        else:
            assert req.prompt is not None
            # the tokens create_completion would make of the string (not tokenized twice)
            tokens = self._completion_tokens(req.prompt, poll)
        if len(tokens) >= self.info.n_ctx:
            raise self._too_long(len(tokens))
        return Prepared(req, tokens, tuple(stop))

    @property
    def free_slots(self) -> int:
        """How many more sequences may join the batch now."""
        return sum(1 for s in self._slots if not s.busy)

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
        return any(s.busy and s.key == conversation for s in self._slots)

    def start(
        self,
        prepared: Prepared,
        emit: Callable[[str], None],
        logprobs: Callable[[list[TokenLogprobs]], None] | None = None,
    ) -> Live:
        """The request joins the batch (at the next ``step``) in the sequence its KV rules pick:
        the conversation's own, the prompt cache's, or (``cache_prompt`` false) an empty one.
        Needs the context (call after making the weights resident)."""
        req = prepared.req
        tokens = prepared.tokens
        if req.conversation is not None and self.busy_with(req.conversation):
            raise RuntimeError(f"conversation {req.conversation} is already being answered")
        cache_prompt = self.model.cache_prompt if req.cache_prompt is None else req.cache_prompt
        if req.conversation is not None:
            # the conversation's own sequence, continued from its longest common prefix
            slot = self._claim_conversation(req.conversation, tokens)
        elif cache_prompt:
            slot = self._use_prompt_cache(tokens)
        else:
            # From an empty KV cache, exactly like a fresh Llama, so the same request gives the
            # same answer bit for bit (a prefix reused from another request was computed in other
            # batches, which can change the last bits of the logits); nothing is kept afterwards.
            slot = self._take_slot()
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
            )
        except BaseException:
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
            self._touch(slot.key)

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
    ) -> GenerationOutcome:
        """Run one request alone (stepping the batch until it is done). ``before_step`` runs before
        every decode step and may raise CancelledError to stop (finish_reason "cancelled");
        ``poll`` runs while the prompt is tokenized (no residency needed) and may raise it too.
        When the request asks for logprobs, ``logprobs`` gets the entries of the tokens each piece
        completes, just before ``emit`` gets that piece. Raises PromptTooLongError without touching
        the KV cache of any conversation."""
        prepared = self.prepare(req, poll)
        before_step()  # residency first: choosing the sequence touches the context
        live = self.start(prepared, emit, logprobs)
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
        self._saved.clear()
        self._decoder.close()
        self.llm.close()


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


def _sequences(llm: Any, parallel: int) -> None:
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
        raise ModelFileError(
            f"the context of {parallel} sequences could not be created ({exc}): lower parallel or n_ctx"
        ) from None
    llm._stack.enter_context(contextlib.closing(ctx))
    llm._ctx = ctx


#: what the fallback format can show of tools: nothing (calls and results become text)
_NO_TOOLS = TemplateCaps(
    tools=False,
    tool_calls=False,
    tool_responses=False,
    object_arguments=True,
    parallel_calls=True,
    nine_char_ids=False,
    thinks=False,
    starts_thinking=False,
)


def chat_message_dict(m: ChatMessage) -> dict[str, Any]:
    """A protocol chat message as the OpenAI-shaped dict core/chatformat takes."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def tools_of(req: Generate) -> list[dict[str, Any]]:
    """A request's tools as the OpenAI tool objects templates take."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in req.tools
    ]


def capped(sampling: Sampling, cap: int | None) -> Sampling:
    """``sampling`` with its answer length limited to a model's ``max_tokens`` setting (None: none)."""
    if cap is None or (sampling.max_tokens is not None and sampling.max_tokens <= cap):
        return sampling
    return sampling.replace(max_tokens=cap)


def fallback_prompt(messages: Sequence[ChatMessage]) -> str:
    """The plain chat format for models without a chat template (see the module docstring)."""
    parts: list[str] = []
    system = [m.content for m in messages if m.role == "system"]
    if system:
        parts.append("\n".join(system).strip() + "\n\n")
    for m in messages:
        if m.role == "user":
            parts.append(f"User: {m.content.strip()}\n")
        elif m.role == "assistant":
            parts.append(f"Assistant: {m.content.strip()}\n")
    parts.append("Assistant:")
    return "".join(parts)
