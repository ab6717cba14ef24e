"""What ``timeshare doctor`` and ``timeshare bench residency`` share: the model setup, the
release/restore cycles, and the bitwise check (greedy logits of a few decode steps after a fixed
prompt, replayed from the same KV prefix)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp  # before numpy (a GPU-image segfault otherwise); sorted that way too
import numpy as np

from ..errors import TimeshareError
from ..residency.gguf_check import GgufInfo, check_gguf
from ..residency.hostmem import fix_malloc_mmap_threshold
from ..residency.residency import ProbeResult, ReleaseReport, Residency, RestoreReport
from ..residency.vkenv import prefer_device_local_memory

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
