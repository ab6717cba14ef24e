"""The engine: one loaded GGUF model and its conversations, driven by the worker's loop thread.

Nothing here is thread-safe on purpose: the worker's loop thread is the only caller. Generation
runs in ``decode.Decoder`` (llama.cpp's low-level API; a completion at temperature 0 from an empty
KV cache equals what a plain ``Llama(path, n_ctx=...).create_completion`` produces): the context is
built with the library's defaults (only n_ctx, n_gpu_layers, use_mmap, verbose and the model's
``flash_attn`` differ; the first three do not change numerics, ``flash_attn`` is off unless set).
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

import ctypes
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from ..chatformat.history import normalise, render
from ..chatformat.template import ChatTemplate, TemplateCaps, TemplateError
from ..config.schema import ModelConfig
from ..errors import ChatTemplateError, InvalidSamplingError, ModelFileError, PromptTooLongError
from ..gguf.modelfile import check_model_file
from ..residency import check_gguf
from ..sampling import Sampling
from . import kv_files
from .decode import Decoder, common_prefix, usable_n_ctx
from .device import llama_placement
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


@dataclass(frozen=True)
class GenerationOutcome:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_evaluated: int  # tokens prefilled by this request
    text: str
    stop: str = ""  # the stop string that ended it ("": none, e.g. the model's end-of-turn token)


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

#: A sequence's key: a conversation id (str) or a keyless sequence of the prompt cache (int).
SeqKey = str | int

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
        self.info = EngineInfo(
            n_ctx=usable_n_ctx(llm),
            n_vocab=int(llm.n_vocab()),
            chat_format="template" if template is not None else "fallback",
        )
        # The sequence whose KV is in the context: a conversation id, a keyless sequence (int), or
        # None (scratch: nothing worth keeping, e.g. after a request with cache_prompt false).
        self.live: SeqKey | None = None
        self.kv_dir: Path | None = None  # where a stopped worker left its sequences' KV (see save_kv)
        # While the weights are released the residency hides the context behind a guard; state
        # I/O (which touches only the KV cache) then goes through the context this returns.
        self.state_ctx: Callable[[], Any] | None = None
        self._saved: OrderedDict[SeqKey, KVSnapshot] = OrderedDict()  # LRU: most recent last
        self._next_keyless = 0
        self._live_prompt_len = 0  # KVSnapshot.prompt_len of the live sequence
        self._prompts_loaded = False  # the keyless sequences a stopped worker left in kv_dir
        self._n_swa = max(0, int(llama_cpp.llama_model_n_swa(llm.model)))
        self.prompt_tokens_evaluated = 0  # since start
        self._markers = self._template_markers(template.source if template is not None else "")
        self._decoder = Decoder(llm)
        self._lp_pieces: dict[int, bytes] = {}  # token -> bytes, for logprob entries

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, model: ModelConfig, *, use_mmap: bool = True) -> Engine:
        """Load the GGUF. Raises ModelFileError with a sentence saying what to do."""
        check_model_file(model.path)
        check_gguf(model.path)  # truncation is caught before llama.cpp sees the file
        try:
            llm = llama_cpp.Llama(
                model_path=model.path,
                n_ctx=model.n_ctx,
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
            "loaded %s: n_ctx=%d n_vocab=%d chat=%s",
            model.id,
            engine.info.n_ctx,
            engine.info.n_vocab,
            engine.info.chat_format,
        )
        return engine

    # ---- sequences --------------------------------------------------------------------------

    def _state_ctx(self) -> Any:
        """The llama_context pointer for state I/O (see ``state_ctx``)."""
        return self.state_ctx() if self.state_ctx is not None else self.llm.ctx

    def _live_pos_min(self) -> int:
        """The lowest position the context's KV holds (-1: empty)."""
        memory = llama_cpp.llama_get_memory(self._state_ctx())
        return int(llama_cpp.llama_memory_seq_pos_min(memory, 0))

    def _snapshot(self) -> KVSnapshot:
        ctx = self._state_ctx()
        size = int(llama_cpp.llama_state_get_size(ctx))
        # one copy of the state (it is the whole KV cache: about 1 GB for 7.5k tokens of an 8B
        # model): llama.cpp writes into a bytearray's own memory, which is then kept as it is
        state = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(state)
        n = int(llama_cpp.llama_state_get_data(ctx, buf, size))
        del buf  # releases the export of ``state``, so it may be resized
        if n < size:
            del state[n:]
        n_tokens = int(self.llm.n_tokens)
        ids = tuple(int(t) for t in self.llm.input_ids[:n_tokens])
        return KVSnapshot(n_tokens, ids, state, max(0, self._live_pos_min()), self._live_prompt_len)

    def _load_snapshot(self, snap: KVSnapshot) -> None:
        ctx = self._state_ctx()
        buf = (ctypes.c_uint8 * len(snap.state)).from_buffer(snap.state)  # no copy
        if int(llama_cpp.llama_state_set_data(ctx, buf, len(snap.state))) != len(snap.state):
            raise RuntimeError("llama.cpp refused a KV snapshot")
        self.llm.input_ids[: snap.n_tokens] = snap.input_ids
        self.llm.n_tokens = snap.n_tokens
        self.llm._requires_eval = True
        self._live_prompt_len = snap.prompt_len

    def park(self) -> None:
        """Move the live sequence into the host LRU (before the context is freed)."""
        self._park_live()

    def _park_live(self) -> None:
        """Keep the live sequence's KV as a host snapshot before the context is reused."""
        if self.live is None:
            return
        self._saved[self.live] = self._snapshot()
        self._saved.move_to_end(self.live)
        self.live = None
        self._trim(self.model.n_seq)

    def _trim(self, keep: int) -> None:
        """LRU beyond ``n_seq``: the least recently used conversations go to ``kv_dir`` (so they
        still come back without a re-prefill), or are dropped when there is no kv_dir; keyless
        sequences of the prompt cache are dropped."""
        while len(self._saved) > max(keep, 0):
            evicted, snap = self._saved.popitem(last=False)
            if isinstance(evicted, int):
                log.debug("a cached prompt of %d tokens left the KV cache (n_seq=%d)", snap.n_tokens, keep)
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

    def _switch_to(self, conversation: str | None, *, fresh: bool) -> None:
        if conversation is not None and conversation == self.live:
            return
        self._park_live()
        if conversation is not None:
            if conversation not in self._saved and self.kv_dir is not None:
                self.load_kv(self.kv_dir, conversation)
            self._trim(self.model.n_seq - 1 if conversation not in self._saved else self.model.n_seq)
            snap = self._saved.pop(conversation, None)
            if snap is not None:
                try:
                    self._load_snapshot(snap)
                    log.debug("conversation %s restored from host (%d tokens)", conversation, snap.n_tokens)
                except RuntimeError as exc:  # the request goes on from an empty KV cache
                    log.warning("conversation %s: %s; it is evaluated again", conversation, exc)
                    self.llm.reset()
            self.live = conversation
        if fresh:
            self.llm.reset()

    def _window_holds(self, pos_min: int, reuse: int, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` whose KV starts at ``pos_min`` can be cut back to
        its first ``reuse`` tokens and continued: a model with sliding-window attention (Gemma 3)
        may have dropped positions the new tokens attend to. llama-server's rule: the KV must
        still hold position ``reuse - n_swa``. Continuing the whole sequence is always fine."""
        if reuse <= 0 or reuse >= n_tokens:
            return True
        return pos_min <= max(0, reuse - self._n_swa)

    def _keep_window(self, tokens: Sequence[int]) -> None:
        """Before continuing the live sequence with ``tokens``: start it over from an empty KV
        cache when the reuse llama-cpp-python would make is not possible (``_window_holds``)."""
        n_tokens = int(self.llm.n_tokens)
        reuse = min(common_prefix(self.llm.input_ids[:n_tokens], tokens), len(tokens) - 1)
        if not self._window_holds(self._live_pos_min(), reuse, n_tokens):
            log.info("the sliding window no longer holds position %d: evaluating from scratch", reuse)
            self.llm.reset()

    def _new_keyless(self) -> int:
        self._next_keyless += 1
        return self._next_keyless

    def _use_prompt_cache(self, tokens: Sequence[int]) -> None:
        """Make live the keyless sequence a keyless request with prompt ``tokens`` continues.

        The candidate is the cached keyless sequence (the live one or a host snapshot) with the
        longest common prefix with the prompt (ties: the most recent), less the last prompt token
        (its logits are needed). When the reusable prefix passes the similarity rule (see
        ``PROMPT_CACHE_MIN_TOKENS``) and the sliding window still holds it, the request continues
        that sequence: it takes it over when it extends the sequence's last prompt (the next turn
        of a chat, a growing completion prompt, the same prompt again) or when what it would cut
        off is small (``BRANCH_MIN_FRACTION``), else it branches: it continues a copy and the
        original stays cached (two chats that share only a system prompt). Otherwise it starts a
        fresh sequence from an empty KV cache. A new sequence evicts the least recently used one
        beyond ``n_seq``. Conversations are never candidates."""
        self._load_saved_prompts()
        best: SeqKey | None = None
        best_reuse = 0
        best_prompt_len = 0
        best_len = 0
        limit = len(tokens) - 1
        candidates: list[tuple[SeqKey, Sequence[int], int, int]] = []
        if isinstance(self.live, int):
            n_live = int(self.llm.n_tokens)
            candidates.append((self.live, self.llm.input_ids[:n_live], -1, self._live_prompt_len))
        for key in reversed(self._saved):
            if isinstance(key, int):
                snap = self._saved[key]
                candidates.append((key, snap.input_ids, snap.pos_min, snap.prompt_len))
        for key, ids, pos_min, prompt_len in candidates:
            reuse = min(common_prefix(ids, tokens), limit)
            if reuse <= best_reuse:
                continue
            if pos_min < 0:  # the live sequence: ask the context
                pos_min = self._live_pos_min()
            if self._window_holds(pos_min, reuse, len(ids)):
                best, best_reuse, best_prompt_len, best_len = key, reuse, prompt_len, len(ids)
        if best is None or best_reuse < max(PROMPT_CACHE_MIN_TOKENS, PROMPT_CACHE_MIN_FRACTION * len(tokens)):
            self._park_live()
            self._trim(self.model.n_seq - 1)
            self.llm.reset()
            self.live = self._new_keyless()
        else:
            # the last prompt token is evaluated again, so the same prompt takes the sequence over.
            # A prompt that diverges inside the sequence's last prompt branches (the original stays
            # cached, the request goes on in a copy) only when the part it would cut off is worth
            # the copy: a copy costs a pass over the whole state (the KV of every token), cutting
            # costs re-evaluating the tokens cut off if that sequence comes back
            lost = best_len - best_reuse
            take_over = best_reuse >= best_prompt_len - 1 or lost < max(8, BRANCH_MIN_FRACTION * best_len)
            if best == self.live:
                if not take_over:  # the original stays as a snapshot; the copy goes on in the context
                    self._park_live()
                    self._trim(self.model.n_seq - 1)
                    self.live = self._new_keyless()
            else:
                self._park_live()
                if take_over:
                    snap = self._saved.pop(best)
                    self.live = best
                else:
                    snap = self._saved[best]
                    self._saved.move_to_end(best)
                    self.live = self._new_keyless()
                self._trim(self.model.n_seq - 1)
                self._load_snapshot(snap)
            log.debug(
                "prompt cache: %d of %d prompt tokens reused (%s)",
                best_reuse,
                len(tokens),
                "taken over" if take_over else "branched",
            )
        self._live_prompt_len = len(tokens)

    @property
    def conversations(self) -> tuple[str, ...]:
        """The conversations whose KV is cached, most recent first."""
        keys = ((self.live,) if self.live is not None else ()) + tuple(reversed(self._saved))
        return tuple(k for k in keys if isinstance(k, str))

    @property
    def cached_sequences(self) -> int:
        """How many sequences (conversations and cached prompts) the worker keeps, live included."""
        return len(self._saved) + (1 if self.live is not None else 0)

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by the snapshots of the sequences that are not live."""
        return sum(len(s.state) + 4 * s.n_tokens for s in self._saved.values())

    # ---- KV on disk (stop / start; the file format is kv_files') ------------------------------

    def _identity(self) -> dict[str, object]:
        return kv_files.identity(self.model.path, self.info.n_ctx)

    def save_kv(self, kv_dir: Path) -> int:
        """Write every cached sequence's KV snapshot to ``kv_dir`` (atomic per file): conversations
        by key, cached prompts by rank (older cached-prompt files are replaced). Returns how many."""
        try:
            self._park_live()
        except Exception:  # the others are still worth saving
            log.exception("could not snapshot the live sequence %s", self.live)
            self.live = None
        if kv_dir == self.kv_dir:
            self._load_saved_prompts()  # those this run never needed are kept, within n_seq
        ident = self._identity()
        mid = self.model.id
        count = 0
        stale = kv_files.prompt_files(kv_dir, mid)
        rank = 0
        for key, snap in reversed(self._saved.items()):
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
        if not path.is_file():
            return False
        snap = kv_files.read(path, {"conversation": conversation}, self._identity())
        if snap is None:
            return False
        self._saved[conversation] = snap
        self._saved.move_to_end(conversation)
        log.info("conversation %s: KV loaded from disk (%d tokens)", conversation, snap.n_tokens)
        return True

    def _load_saved_prompts(self) -> None:
        """Once: bring the cached prompts a stopped worker left in ``kv_dir`` back, as the least
        recently used sequences (only as many as ``n_seq`` leaves room for)."""
        if self._prompts_loaded or self.kv_dir is None:
            return
        self._prompts_loaded = True
        room = self.model.n_seq - self.cached_sequences
        loaded = 0
        for rank, path in sorted(kv_files.prompt_files(self.kv_dir, self.model.id).items()):
            if loaded >= room:
                path.unlink(missing_ok=True)
                continue
            snap = kv_files.read(path, {"prompt": rank}, self._identity())
            if snap is None:
                continue
            key = self._new_keyless()
            self._saved[key] = snap
            self._saved.move_to_end(key, last=False)
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
        tokens). An embedding model's context is its own; a chat model's live sequence is first
        kept as a host snapshot (the KV of every conversation stays), then its context embeds in
        that sequence and gives it back empty. Raises PromptTooLongError for an input over the
        batch, InvalidSamplingError for a token id outside the vocabulary."""
        llm = self.llm
        n_vocab = self.info.n_vocab
        token_lists: list[list[int]] = []
        for item in inputs:
            if isinstance(item, str):
                token_lists.append(list(llm.tokenize(item.encode("utf-8"))))
            else:
                bad = [t for t in item if not 0 <= int(t) < n_vocab]
                if bad:
                    raise InvalidSamplingError(
                        f"token {bad[0]} is not in {self.model.display_name}'s vocabulary (0..{n_vocab - 1})"
                    )
                token_lists.append([int(t) for t in item])
        before_step()  # residency first: the context is about to decode
        if self.model.embedding:
            vectors = embed_tokens(llm, token_lists, before_step=before_step)
        else:
            self._park_live()  # the live sequence's KV goes to the host LRU, whole
            try:
                vectors = embed_tokens(llm, token_lists, seq_id=0, switch=True, before_step=before_step)
            finally:
                llm.n_tokens = 0  # sequence 0 is empty now; its logits are the embedding's
                llm._requires_eval = True
        return vectors, sum(len(t) for t in token_lists)

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        req: Generate,
        emit: Callable[[str], None],
        before_step: Callable[[], None] = lambda: None,
        poll: Callable[[], None] = lambda: None,
        logprobs: Callable[[list[TokenLogprobs]], None] | None = None,
    ) -> GenerationOutcome:
        """Run one request. ``before_step`` runs before every decode step and may raise
        CancelledError to stop (finish_reason "cancelled"); ``poll`` runs while the prompt is
        tokenized (no residency needed) and may raise it too. When the request asks for logprobs,
        ``logprobs`` gets the entries of the tokens each piece completes, just before ``emit``
        gets that piece. Raises PromptTooLongError without touching the KV cache of any
        conversation."""
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
        n_prompt = len(tokens)
        if n_prompt >= self.info.n_ctx:
            raise self._too_long(n_prompt)
        before_step()  # residency first: switching sequences touches the context
        cache_prompt = self.model.cache_prompt if req.cache_prompt is None else req.cache_prompt
        if req.conversation is not None:
            # the conversation's own sequence, continued from its longest common prefix
            self._switch_to(req.conversation, fresh=False)
            self._keep_window(tokens)
            self._live_prompt_len = len(tokens)
        elif cache_prompt:
            self._use_prompt_cache(tokens)
        else:
            # From an empty KV cache, exactly like a fresh Llama, so the same request gives the
            # same answer bit for bit (a prefix reused from another request was computed in other
            # batches, which can change the last bits of the logits); nothing is kept afterwards.
            self._switch_to(None, fresh=True)
        try:
            out = self._decoder.run(
                tokens,
                capped(req.sampling, self.model.max_tokens),
                stop=stop,
                emit=emit,
                before_step=before_step,
                records=None if logprobs is None else (lambda rs: logprobs(self._wire_logprobs(rs))),
            )
        finally:
            self.prompt_tokens_evaluated += self._decoder.evaluated
        return GenerationOutcome(
            out.finish_reason, n_prompt, out.completion_tokens, out.evaluated, out.text, out.stop
        )

    def close(self) -> None:
        self._saved.clear()
        self._decoder.close()
        self.llm.close()


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
