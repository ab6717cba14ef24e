"""What ``timeshare doctor`` and ``timeshare bench residency`` share: the model setup, the
release/restore cycles, and the bitwise check (greedy logits of a few decode steps after a fixed
prompt, replayed from the same KV prefix)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp  # before numpy (a GPU-image segfault otherwise); sorted that way too
import numpy as np

from ..errors import TimeshareError
from ..residency.gguf_check import GgufInfo, check_gguf
from ..residency.hostmem import fix_malloc_mmap_threshold
from ..residency.probe import ProbeResult
from ..residency.reports import ReleaseReport, RestoreReport
from ..residency.residency import Residency
from ..residency.vkenv import prefer_device_local_memory

PROMPT = b"The quick brown fox jumps over the lazy dog. Once upon a time, in a quiet village,"


#: how a check replays: rewinding the KV cache to the prefix, putting a saved state of the prefix
#: back, or embedding (encoders)
REWIND = "rewind"
SAVED_STATE = "saved state"
EMBEDDINGS = "embeddings"


class UncheckableModelError(TimeshareError):
    """A model the bitwise check cannot replay; the message says why."""


def _seq_state(ctx: Any) -> bytes:
    """The state of sequence 0 (its KV cells and recurrent state), as bytes."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))
    buf = (ctypes.c_uint8 * max(size, 1))()
    got = int(llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0))
    return bytes(buf[:got])


def replay_kind(llm: Any, n_replay: int) -> str:
    """How a model's check replays ``n_replay`` tokens (prefix and steps): an encoder (no memory)
    compares embeddings; a recurrent or hybrid model cannot rewind its state (a recurrent state
    holds no earlier position), nor a sliding-window cache shorter than the replay (the cells
    before the window are gone), so the prefix's saved state is put back; other models rewind.
    Raises UncheckableModelError for a model none of these fits (an encoder-decoder)."""
    model = llm._model.model
    if llama_cpp.llama_model_has_encoder(model):
        raise UncheckableModelError(
            "this is an encoder-decoder model (e.g. T5): its decoder needs the encoder's output for "
            "every prompt, which the check's replay does not produce, so it cannot be checked bitwise"
        )
    if not llama_cpp.llama_get_memory(llm.ctx):
        return EMBEDDINGS
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return SAVED_STATE
    n_swa = int(llama_cpp.llama_model_n_swa(model))
    if 0 < n_swa <= n_replay:
        return SAVED_STATE
    return REWIND


class GreedyReplay:
    """Prefills ``prompt`` (all but its last token) once; :meth:`run` goes back to that prefix and
    returns the raw logits bytes of ``steps`` greedy decode steps. The prefix's cells are reused,
    so a restore that lost or changed them (or any weight) shows up as different bytes.

    How it goes back (``kind``, see :func:`replay_kind`): a KV cache rewinds to the prefix; a
    state that cannot rewind (recurrent, hybrid, a sliding window shorter than the replay) is
    saved once after the prefill, compared with the live one before each run (a restore must keep
    it: a difference is a run that is not the same) and put back after it. An encoder (no
    memory) embeds the prompt and returns the vector's bytes."""

    def __init__(self, llm: Any, prompt: bytes = PROMPT, n_prefill: int = 0, steps: int = 8) -> None:
        self.llm = llm
        tokens = list(llm.tokenize(prompt))
        if n_prefill > len(tokens):  # a long prefix (benchmarks): repeat the prompt
            tokens = (tokens * (n_prefill // max(len(tokens), 1) + 1))[:n_prefill]
        self.tokens = tokens
        self.n_vocab = int(llm.n_vocab())
        self.kind = replay_kind(llm, len(tokens) + steps)
        self.prefix_state: bytes | None = None
        self.n_prefix = 0
        if self.kind == EMBEDDINGS:
            return
        llm.eval(tokens[:-1])
        self.n_prefix = int(llm.n_tokens)
        if self.kind == SAVED_STATE:
            self.prefix_state = _seq_state(llm.ctx)

    def run(self, steps: int = 8) -> list[bytes]:
        llm = self.llm
        if self.kind == EMBEDDINGS:
            from ..worker.embed import embed_tokens

            vectors = embed_tokens(
                llm, [self.tokens, self.tokens[: max(1, len(self.tokens) // 2)]], switch=True
            )
            return [np.asarray(v, dtype=np.float64).tobytes() for v in vectors]
        out: list[bytes] = []
        if self.prefix_state is not None and _seq_state(llm.ctx) != self.prefix_state:
            out.append(b"the prefix's state was not kept")  # never equal to a reference
        llm.n_tokens = self.n_prefix  # eval() removes the KV cells after n_tokens first
        token = self.tokens[-1]
        for _ in range(steps):
            llm.eval([token])
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
            out.append(logits.tobytes())
            token = int(logits.argmax())
        if self.prefix_state is not None:
            self._put_back(self.prefix_state)
        return out

    def _put_back(self, state: bytes) -> None:
        ctx = self.llm.ctx
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, -1, -1)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(llama_cpp.llama_state_seq_set_data(ctx, buf, len(state), 0)) != len(state):
            raise TimeshareError(
                "the check could not put the prefix's saved state back (llama.cpp refused it)"
            )
        self.llm.n_tokens = self.n_prefix


@dataclass(frozen=True)
class LoadedModel:
    llm: Any
    info: GgufInfo
    probe: ProbeResult
    load_s: float  # seconds llama.cpp took to load the model


def load_for_check(model: str, cycles: int, *, failure_hint: str = "", **llama_params: Any) -> LoadedModel:
    """The setup of doctor and bench: refuse ``cycles`` < 1, check the file, and load ``model``
    on the device the way the engine does when it wants the mechanism (no mmap on a CPU-only
    build, so host weight buffers play the device). ``llama_params`` go to ``llama_cpp.Llama``;
    a model llama.cpp refuses is a TimeshareError ending in ``failure_hint``."""
    if cycles < 1:
        raise TimeshareError("--cycles must be at least 1")
    # a freed weight buffer must go back to the system, or RSS (the CPU build's "device memory") lies
    fix_malloc_mmap_threshold()
    prefer_device_local_memory()  # before the first Vulkan device initialises (residency/vkenv.py)
    info = check_gguf(model)
    probe = Residency.probe()
    t0 = time.perf_counter()
    try:
        llm = llama_cpp.Llama(
            model,
            n_gpu_layers=-1,
            use_mmap=probe.use_mmap_for_inplace,
            verbose=False,
            **llama_params,
        )
    except ValueError as exc:
        raise TimeshareError(f"llama.cpp could not load {model} ({exc}){failure_hint}") from exc
    return LoadedModel(llm, info, probe, time.perf_counter() - t0)


@dataclass
class Cycles:
    releases: list[ReleaseReport] = field(default_factory=list)
    restores: list[RestoreReport] = field(default_factory=list)
    same: list[bool] = field(default_factory=list)  # the replay after each restore == the reference


def run_cycles(
    res: Residency,
    replay: GreedyReplay,
    reference: list[bytes],
    cycles: int,
    *,
    while_first_released: Callable[[], None] | None = None,
    after_restore: Callable[[], None] | None = None,
) -> Cycles:
    """``cycles`` release/restore cycles, each followed by a replay compared bitwise with
    ``reference``. ``while_first_released`` runs once, between the first release and its restore;
    ``after_restore`` after each restore (before its replay)."""
    out = Cycles()
    for i in range(cycles):
        out.releases.append(res.release())
        if i == 0 and while_first_released is not None:
            while_first_released()
        out.restores.append(res.restore())
        if after_restore is not None:
            after_restore()
        out.same.append(replay.run() == reference)
    return out
