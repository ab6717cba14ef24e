"""The sequence cache of a loaded model, driven by the worker's loop thread through its Engine.

The worker keeps up to ``n_seq`` token sequences with their KV: the live one in the
context (it continues by llama-cpp-python's prefix matching: only the tokens after the common
prefix are evaluated) and the others as host snapshots of the context state
(``llama_state_get_data``) in an LRU, each with its token ids. A sequence belongs either to a
``conversation`` (the Timeshare extension: the key picks it) or to the prompt cache (keyless
requests: the prompt picks the cached sequence it shares the longest prefix with, see
``use_prompt_cache``). Conversations evicted beyond ``n_seq`` go to ``kv_dir``; keyless ones are
dropped. When the worker stops, every cached sequence is written to ``kv_dir`` and comes back
after a restart without a re-prefill.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp

from ..config.schema import ModelConfig
from . import kv_files
from .decode import common_prefix
from .kv_files import KVSnapshot

log = logging.getLogger(__name__)

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


class Sequences:
    """The context's ``parallel`` sequences (``slots``) and the host snapshots of the others, in an
    LRU of ``model.n_seq``. Not thread-safe: the worker's loop thread is the only caller."""

    def __init__(self, llm: Any, model: ModelConfig, n_ctx: int, parallel: int) -> None:
        self.llm = llm
        self.model = model
        self.n_ctx = n_ctx  # per sequence (the KV files' identity holds it)
        self.kv_dir: Path | None = None  # where a stopped worker left its sequences' KV (see save_kv)
        #: conversations' KV files being read ahead (the worker starts them while the model loads)
        self.read_ahead: dict[str, kv_files.ReadAhead] = {}
        # While the weights are released the residency hides the context behind a guard; state
        # I/O (which touches only the KV cache) then goes through the context this returns.
        self.state_ctx: Callable[[], Any] | None = None
        # the context's sequences (seq ids 0..parallel-1) and the others, as host snapshots
        self.slots = [Slot(i) for i in range(parallel)]
        self._saved: dict[SeqKey, KVSnapshot] = {}
        self._used: dict[SeqKey, int] = {}  # when each cached sequence was last used (LRU)
        self._tick = 0
        self._next_keyless = 0
        self._prompts_loaded = False  # the keyless sequences a stopped worker left in kv_dir
        self._n_swa = max(0, int(llama_cpp.llama_model_n_swa(llm.model)))
        model = llm.model
        #: a recurrent or hybrid model: its state's lowest position is its last one, not a window
        #: (the decoder goes back to the sequence's checkpoint, or evaluates the prompt whole)
        self._recurrent = bool(
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        )

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

    def touch(self, key: SeqKey) -> None:
        self._tick += 1
        self._used[key] = self._tick

    def _slot_of(self, key: SeqKey) -> Slot | None:
        return next((s for s in self.slots if s.key == key), None)

    def _recent(self) -> list[SeqKey]:
        """Every cached sequence's key (in a slot or a host snapshot), most recent first."""
        keys = [s.key for s in self.slots if s.key is not None] + list(self._saved)
        return sorted(keys, key=lambda k: self._used.get(k, 0), reverse=True)

    def park(self) -> None:
        """Move the idle slots' sequences into the host LRU (before the context is freed); the
        sequences of a running batch stay (the residency keeps every sequence's KV)."""
        for slot in self.slots:
            if not slot.busy:
                try:
                    self._park(slot)
                except Exception:  # the others are still worth keeping
                    log.exception("could not snapshot the sequence %s", slot.key)
                    slot.key = None
                    slot.ids.clear()
        self._trim(self.model.n_seq)

    def park_states(self, states: Mapping[int, tuple[bytes, int]]) -> None:
        """Move the slots' sequences into the host LRU from states saved elsewhere (by seq id:
        the state ``llama_state_seq_get_data`` wrote, and its lowest position): the residency's,
        while the KV cache is released and the context cannot be read."""
        for slot in self.slots:
            got = states.get(slot.seq_id)
            if got is None or slot.key is None or not slot.ids:
                continue
            state, pos_min = got
            ids = tuple(slot.ids)
            pos = self._restored_pos_min(len(ids), pos_min)
            self._saved[slot.key] = KVSnapshot(len(ids), ids, bytearray(state), pos, slot.prompt_len)
            slot.key = None
            slot.ids.clear()
            slot.dirty = False
            slot.prompt_len = 0

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
        idle = [s for s in self.slots if not s.busy and s is not exclude]
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
            busy = {s.key for s in self.slots if s.busy or s is protect}
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

    def take_slots(self, count: int) -> list[Slot]:
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

    def take_slot(self, exclude: Slot | None = None) -> Slot:
        slot = self._free_slot(exclude)
        if slot is None:
            raise RuntimeError("every sequence of the context is in the batch")  # the worker admits fewer
        return slot

    def claim_conversation(self, conversation: str, tokens: Sequence[int], adopt: bool = False) -> Slot:
        """The conversation's own sequence, in a slot (from the host LRU or kv_dir when it is not
        in one), to be continued from its longest common prefix with ``tokens``. A conversation
        seen for the first time starts from an empty sequence, or with ``adopt`` from the prompt
        cache (``use_prompt_cache``'s choice without the similarity rule, which becomes the
        conversation's: the Responses
        API's first ``previous_response_id`` turn continues the keyless sequence of the response
        it follows)."""
        slot = self._slot_of(conversation)
        if slot is None:
            if conversation not in self._saved and self.kv_dir is not None:
                self.load_kv(self.kv_dir, conversation)
            if adopt and conversation not in self._saved:
                # the client continues an answer: whatever it shares with a cached sequence counts
                slot = self.use_prompt_cache(tokens, any_prefix=True)
                assert slot.key is not None
                self._used.pop(slot.key, None)
                slot.key = conversation
                self.touch(conversation)
                return slot
            slot = self.take_slot()
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
        self.touch(conversation)
        self._trim(self.model.n_seq, protect=slot)
        self._keep_window(slot, tokens)
        return slot

    def _window_holds(self, pos_min: int, reuse: int, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` whose KV starts at ``pos_min`` can be cut back to
        its first ``reuse`` tokens and continued: a model with sliding-window attention (Gemma 3)
        may have dropped positions the new tokens attend to. llama-server's rule: the KV must
        still hold position ``reuse - n_swa``. Continuing the whole sequence is always fine."""
        if reuse <= 0 or reuse >= n_tokens or self._recurrent:
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

    def use_prompt_cache(self, tokens: Sequence[int], *, any_prefix: bool = False) -> Slot:
        """The slot a keyless request with prompt ``tokens`` continues (``any_prefix``: any
        common prefix is worth reusing, the similarity rule aside: a conversation's adoption).

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
        least = 1 if any_prefix else max(PROMPT_CACHE_MIN_TOKENS, PROMPT_CACHE_MIN_FRACTION * len(tokens))
        if best is None or best_reuse < least:
            slot = self.take_slot()
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
                    self.touch(best)  # the original stays cached, as the most recent
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
                    self.touch(best)
                    new_key = self._new_keyless()
                slot = self.take_slot()
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
        self.touch(slot.key)
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
        return kv_files.identity(self.model.path, self.n_ctx)

    def save_kv(self, kv_dir: Path) -> int:
        """Write every cached sequence's KV snapshot to ``kv_dir`` (atomic per file): conversations
        by key, cached prompts by rank (older cached-prompt files are replaced). Returns how many."""
        for slot in self.slots:
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
        self.touch(conversation)
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

    def drop_snapshots(self) -> None:
        """Forget the host snapshots (the model is closing)."""
        self._saved.clear()
