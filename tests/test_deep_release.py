"""Deep release on contention (issue 39, items 1-2): under an auto budget that fits one model's
weights and KV cache but not two, the parked worker releases its KV cache and compute buffers
too when the other needs the room, and gets them back, with the conversation kept, at its next
turn. Real workers on the CPU build (host memory is the device; ``$TIMESHARE_HOST_MEMORY`` makes
the "card"); the answers and the first token's log-probabilities equal those of weights-only
switches (one-model budget) and of no switch at all; only the KV cells in use move."""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import llama_cpp  # before numpy
import pytest
from _budget_pool_util import WAIT
from _proc_util import wait_until
from _residency_util import Greedy, decode_seq, load, same
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.budget import (
    AUTO_MARGIN_MIN,
    BudgetRecord,
    LeaseRecord,
    plan_fit,
)
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.errors import OutOfDeviceMemoryError, ResidencyError
from timeshare.core.pool.supervisor import Pool
from timeshare.core.residency import Residency, _ggml
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState
from timeshare.core.worker.footprint import compute_bytes

A, B = "smol-a", "smol-b"
N_CTX, PARALLEL = 4096, 2  # 8192 cells: a KV cache far larger than the noise of a process's RSS
#: a user turn of about 100 tokens
QUESTION = "Tell me about the history of the city of Lyon, its rivers, its silk and its food. " * 5
FOLLOW_UP = "And what about its bridges?"


# ---- the rule (pure) ---------------------------------------------------------------------------


def _budget(nbytes: int) -> BudgetRecord:
    return BudgetRecord(setting="auto", kind="auto", bytes=nbytes)


def _lease(model: str, nbytes: int, kind: str = "weights", **kw: object) -> LeaseRecord:
    return LeaseRecord(
        model=model, pid=100 + len(model), bytes=nbytes, kind=kind, name=f"{model}-{kind}", **kw
    )  # type: ignore[arg-type]


def test_the_plan_asks_a_parked_workers_kv_cache_after_every_holders_weights() -> None:
    budget = _budget(1000)
    parked = _lease("p", 300, "reserve", deepens=250, used_at=1.0)
    older = _lease("old", 300, "reserve", deepens=250, used_at=0.5)
    holder = _lease("h", 200, used_at=2.0)
    # 1000 - 600 reserved = 400 for weights: 200 leased, a need of 300 lacks 100
    plan = plan_fit(300, [parked, older, holder], budget, now=10.0)
    assert not plan.fits and plan.victims == (holder,) and plan.deepen == ()
    # a need of 500 lacks 300: the holder's weights, then the least recently used KV cache
    plan = plan_fit(500, [parked, older, holder], budget, now=10.0)
    assert plan.victims == (holder,) and plan.deepen == (older,) and plan.possible
    assert plan.asked_to_deepen(older.name) and not plan.asked_to_deepen(parked.name)
    # more than every KV cache frees: never possible (the message says the budget is too small)
    plan = plan_fit(901, [parked, older, holder], budget, now=10.0)
    assert plan.too_large and not plan.possible
    # pinned models keep their KV cache; a worker already deep (deepens 0) has nothing to give
    plan = plan_fit(500, [replace(older, pinned=True), replace(parked, deepens=0), holder], budget, now=10.0)
    assert plan.too_large and plan.deepen == ()
    # the requester's own reserve is never its victim; a byte budget counts no reserves
    plan = plan_fit(500, [parked, older, holder], budget, now=10.0, requester=(older.pid, older.model))
    assert plan.deepen == (parked,)
    fixed = BudgetRecord(setting="400MB", kind="bytes", bytes=400)
    assert plan_fit(500, [parked, holder], fixed, now=10.0).too_large


# ---- the KV level in place (item 2) -----------------------------------------------------------

#: SmolLM2-135M: 30 layers x (K + V) x 192 f16 values per cell
CELL_BYTES = 30 * 2 * 192 * 2


@pytest.mark.parametrize(
    ("backend", "vk_switch", "releases"),
    [
        ("Vulkan0", None, False),
        ("Vulkan0", "0", False),
        ("Vulkan0", "yes", False),  # not "1": the rule stays
        ("Vulkan0", "1", True),
        ("CUDA0", None, True),
        ("CUDA0", "0", True),  # the switch is Vulkan's alone
        ("CPU", None, True),
    ],
)
def test_with_deep_inplace_on_a_vulkan_device_keeps_its_compute_buffers(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, vk_switch: str | None, releases: bool
) -> None:
    """TIMESHARE_DEEP_INPLACE=1 asks for the deep level wholly in place; on a Vulkan device the
    compute buffers stay all the same (released in place, they crashed the next decode on lavapipe:
    kvlevel.VULKAN_COMPUTE_KEPT's note), with the reason in the note, while the KV buffers are still
    found; TIMESHARE_VK_COMPUTE_INPLACE=1 (a measuring run on a real Vulkan driver) lifts that rule
    and nothing else. The rule is the backend's name; the CPU build's real context stands in for
    the device's, and the compute buffers it then finds are the ones a release would free."""
    from timeshare.core.residency.kvlevel import VULKAN_COMPUTE_KEPT, KvLevel

    monkeypatch.setenv("TIMESHARE_DEEP_INPLACE", "1")
    if vk_switch is None:
        monkeypatch.delenv("TIMESHARE_VK_COMPUTE_INPLACE", raising=False)
    else:
        monkeypatch.setenv("TIMESHARE_VK_COMPUTE_INPLACE", vk_switch)
    llm = load(smollm2_path, n_ctx=512, use_mmap=False)
    try:
        level = KvLevel(llm, str(smollm2_path), None, pinned=False)
        level.find(int(llm._ctx.ctx), backend)
        assert level.in_place and level.kv_note == ""
        if releases:
            assert level.buffers_note == "" and level.compute_releasable
        else:
            assert level.buffers_note == VULKAN_COMPUTE_KEPT
            assert f"the compute buffers stay on the device ({VULKAN_COMPUTE_KEPT})" in level.notes()
    finally:
        llm.close()


def test_with_deep_inplace_off_the_kv_level_keeps_the_compute_buffers_and_is_still_bitwise(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIMESHARE_DEEP_INPLACE=0 (a GPU build's default until a run there proves the new way): the
    KV buffer still goes in place, the compute buffers stay (and the budget does not count them),
    the KV cells come back after the weights; the answer equals a weights-only switch's."""
    from timeshare.core.residency.kvlevel import DEEP_UNVERIFIED

    monkeypatch.setenv("TIMESHARE_DEEP_INPLACE", "0")
    llm = load(smollm2_path, n_ctx=4096, use_mmap=False)
    try:
        greedy = Greedy(llm, b"The history of Lyon, its rivers and its silk: " * 4)
        weights_only = greedy.run()
        res = Residency.attach(llm, smollm2_path)
        note = DEEP_UNVERIFIED.format(backend=res.backend)
        assert res.kv_note == "" and res.buffers_note == note and not res.buffers_releasable
        llm.n_tokens = greedy.n_prefix
        llm.eval([greedy.tokens[-1]])
        n_tokens, ctx = llm.n_tokens, llm._ctx
        compute = compute_bytes(ctx.ctx).host
        rel = res.release(kv=True)
        assert rel.level == "weights+kv" and not res.kv_resident and res.context_kept
        assert res.compute_released_bytes == 0 and compute_bytes(ctx.ctx).host == compute
        assert res.kv_upload_note == note
        res.restore()
        assert llm._ctx is ctx and llm.n_tokens == n_tokens
        assert same(greedy.run(), weights_only)
    finally:
        llm.close()


def test_the_kv_level_keeps_the_context_and_moves_only_the_cells_in_use(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = load(smollm2_path, n_ctx=4096, use_mmap=False)
    try:
        greedy = Greedy(llm, b"The history of Lyon, its rivers and its silk: " * 4)
        weights_only = greedy.run()
        res = Residency.attach(llm, smollm2_path)
        assert res.kv_note == "" and res.inplace_view is not None
        res.release()  # a weights-only switch: the reference
        res.restore()
        assert same(greedy.run(), weights_only)
        llm.n_tokens = greedy.n_prefix
        llm.eval([greedy.tokens[-1]])
        n_tokens, ctx = llm.n_tokens, llm._ctx
        compute = compute_bytes(ctx.ctx).host  # the CPU build: host memory is the device
        assert compute > 2**20 and res.buffers_releasable and res.buffers_note == ""
        rel = res.release(kv=True)
        assert rel.level == "weights+kv" and not res.kv_resident
        # the cells in use (n_tokens of them, plus the state's small headers), not n_ctx's 4096
        assert n_tokens * CELL_BYTES <= res.kv_host_bytes < (n_tokens + 8) * CELL_BYTES, res.kv_host_bytes
        # the compute buffers went too (the scheduler itself reports them gone), the context kept
        assert res.context_kept and not res.buffers_kept and res.compute_released_bytes == compute
        assert compute_bytes(ctx.ctx).host < 4096
        reused = llama_cpp.llama_perf_context(ctx.ctx).n_reused
        assert res.kv_upload_note == ""  # the cells go back layer by layer, with the weights
        res.restore()
        kv_steps = res.restore_steps
        # each layer's cells in use, written right after its weights: the state's KV bytes
        assert n_tokens * CELL_BYTES == kv_steps.kv_bytes, kv_steps
        assert llm._ctx is ctx and llm.n_tokens == n_tokens  # the same context object, the KV kept
        assert compute_bytes(ctx.ctx).host == compute and res.compute_released_bytes == 0
        # bitwise: the logits of 8 greedy steps; the first step's graph (one token, as the last
        # decode before the release) is built anew, the next seven reuse it
        assert same(greedy.run(), weights_only)
        assert llama_cpp.llama_perf_context(ctx.ctx).n_reused - reused == 7
        # a KV buffer that comes back at another address: the graphs are built anew, still bitwise
        alloc = _ggml.buft_alloc_buffer
        held: list[int] = []

        def elsewhere(buft: int, size: int) -> int | None:
            buf = alloc(buft, size)
            if size > 2**20 and buf is not None:
                held.append(buf)  # the old block stays taken
                buf = alloc(buft, size)
            return buf

        res.release(kv=True)
        monkeypatch.setattr(_ggml, "buft_alloc_buffer", elsewhere)
        rst = res.restore()
        monkeypatch.setattr(_ggml, "buft_alloc_buffer", alloc)
        for h in held:
            _ggml.buffer_free(h)
        assert rst.graphs_reset and llm._ctx is ctx
        assert same(greedy.run(), weights_only)
        # the KV level alone (the weights kept), its compute buffers back elsewhere and the KV
        # cache where it was: no scheduler reserve, the graph built anew, still bitwise
        res.release(kv=True, keep_bytes=res.weight_bytes)
        assert res.weights_resident and not res.kv_resident and res.compute_released_bytes == compute

        def compute_elsewhere(buft: int, size: int) -> int | None:
            if size == compute:
                held.append(alloc(buft, size) or 0)
            return alloc(buft, size)

        held.clear()
        sched = _ggml.ctx_get_sched(ctx.ctx)
        monkeypatch.setattr(_ggml, "buft_alloc_buffer", compute_elsewhere)
        rst = res.restore()
        monkeypatch.setattr(_ggml, "buft_alloc_buffer", alloc)
        for h in held:
            _ggml.buffer_free(h)
        assert len(held) == 1 and llm._ctx is ctx and rst.graphs_reset and rst.addresses_moved is False, rst
        assert same(greedy.run(), weights_only)
        # no reserve happened: a reserve makes a new scheduler (before the old one is freed)
        assert _ggml.ctx_get_sched(ctx.ctx) == sched
        res.close()
    finally:
        llm.close()


def _two_sequences(llm: llama_cpp.Llama) -> Any:
    """A context of two sequences, each in its own KV stream (as a worker's), with a hole in the
    first one's cells; returns it (the caller closes it)."""
    from llama_cpp import _internals

    params = llm.context_params
    params.n_seq_max, params.kv_unified = 2, False
    ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    a = llm.tokenize(b"The history of Lyon, its rivers and its silk, told in a few words.")
    b = llm.tokenize(b"Bridges of Paris:")
    decode_seq(ctx, a, 0, 0)
    decode_seq(ctx, b, 1, 0)
    mem = llama_cpp.llama_get_memory(ctx.ctx)
    llama_cpp.llama_memory_seq_rm(mem, 0, 6, -1)  # a prompt cache's reuse: cells 6.. freed
    decode_seq(ctx, a[6:9], 0, 6)  # new cells after the freed ones: two runs of cells in stream 0
    return ctx


def _next_logits(ctx: Any, n_vocab: int, token: int, seqs: dict[int, int]) -> list[bytes]:
    """The logits of ``token`` decoded next in each sequence (seq -> its next position)."""
    out = []
    batch = llama_cpp.llama_batch_init(4, 0, 2)
    for seq, pos in seqs.items():
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = token, pos, 1, True
        batch.seq_id[0][0] = seq
        assert llama_cpp.llama_decode(ctx.ctx, batch) == 0
        logits = llama_cpp.llama_get_logits_ith(ctx.ctx, -1)
        out.append(ctypes.string_at(ctypes.cast(logits, ctypes.c_void_p).value, 4 * n_vocab))
    llama_cpp.llama_batch_free(batch)
    return out


def test_two_sequences_come_back_in_their_cells(smollm2_path: Path) -> None:
    """Two sequences in two KV streams, one with a hole in its cells: at the deep level in place
    the metadata stays and each cell comes back where it was, so the next token's logits of both
    are bitwise those of an identical context that was never released."""
    llm = load(smollm2_path, n_ctx=1024, use_mmap=False)
    try:
        n_vocab = llm.n_vocab()
        reference = _two_sequences(llm)
        want = _next_logits(reference, n_vocab, 42, {0: 9, 1: 5})
        reference.close()
        llm._ctx.close()
        llm._ctx = _two_sequences(llm)
        res = Residency.attach(llm, smollm2_path)
        res.release(kv=True)
        assert res.kv_upload_note == "", res.kv_upload_note
        # saved straight from the KV tensors (residency/kvsave.py), read back by the upload
        assert res.release_steps.kv_save_path == "raw" and res.kv_save_note == ""
        res.restore()
        assert res.restore_steps.kv_bytes == (9 + 5) * CELL_BYTES
        assert _next_logits(llm._ctx, n_vocab, 42, {0: 9, 1: 5}) == want
        res.close()
    finally:
        llm.close()


def test_out_of_memory_for_the_compute_buffers_leaves_the_model_deep(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = load(smollm2_path, n_ctx=1024, use_mmap=False)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = Residency.attach(llm, smollm2_path)
        compute = compute_bytes(llm.ctx).host
        res.release(kv=True)
        assert res.compute_released_bytes == compute > 0
        alloc = _ggml.buft_alloc_buffer

        def no_compute(buft: int, size: int) -> int | None:
            return None if size == compute else alloc(buft, size)  # injected: the device is full

        monkeypatch.setattr(_ggml, "buft_alloc_buffer", no_compute)
        with pytest.raises(OutOfDeviceMemoryError, match="compute buffer"):
            res.restore()
        # the KV cache went back to host memory with it: the deep level as a whole, nothing lost
        assert not res.kv_resident and res.context_kept and res.compute_released_bytes == compute
        with pytest.raises(ResidencyError):
            llm.eval([1])
        # the weights' turn to fail: the KV and compute buffers, allocated before them, go again
        weights = max(b.size for b in res.inplace_view.buffers)  # type: ignore[union-attr]

        def no_weights(buft: int, size: int) -> int | None:
            return None if size == weights else alloc(buft, size)

        monkeypatch.setattr(_ggml, "buft_alloc_buffer", no_weights)
        with pytest.raises(OutOfDeviceMemoryError, match="stays released"):
            res.restore()
        assert not res.kv_resident and not res.weights_resident and res.compute_released_bytes == compute
        monkeypatch.setattr(_ggml, "buft_alloc_buffer", alloc)
        res.restore()
        assert res.kv_resident and same(greedy.run(), ref)
        res.close()
    finally:
        llm.close()


# ---- real workers ------------------------------------------------------------------------------


def _config(smollm2: Path, budget: str) -> Config:
    return Config(
        models=tuple(
            ModelConfig(id=m, path=str(smollm2), n_ctx=N_CTX, parallel=PARALLEL, idle_sleep_s=None)
            for m in (A, B)
        ),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget=budget),
    )


def _start(home: Path, smollm2: Path, budget: str) -> Pool:
    pool = Pool(
        _config(smollm2, budget),
        arena_dir=home / "arena",
        log_dir=home / "log",
        kv_dir=home / "kv",
        event_log=str(home / "intervals.jsonl"),
    )
    pool.start()
    pool.wait_ready(timeout=WAIT)
    assert all(m.state is not ModelState.FAILED for m in pool.snapshot().models), pool.snapshot()
    return pool


Turn = tuple[str, tuple[tuple[bytes, float], ...], int, bool]


def _turn(pool: Pool, model: str, text: str) -> Turn:
    """One user turn of ``model``'s conversation: the answer, the first token's top
    log-probabilities, the prompt tokens evaluated and whether it switched."""
    result = pool.generate(
        model,
        messages=[{"role": "user", "content": text}],
        sampling=Sampling(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=5),
        conversation=f"conv-{model}",
    ).result(timeout=WAIT)
    first = result.logprobs[0]
    top = tuple((alt.piece, alt.logprob) for alt in first.top)
    return (
        result.text,
        ((first.piece, first.logprob), *top),
        result.usage.prompt_tokens_evaluated,
        bool(result.switch.switched),
    )


def _turns(pool: Pool) -> list[Turn]:
    return [_turn(pool, A, QUESTION), _turn(pool, B, QUESTION), _turn(pool, A, QUESTION + FOLLOW_UP)]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _leases(home: Path) -> list[LeaseRecord]:
    arena = Arena(home / "arena")
    try:
        return arena.leases()
    finally:
        arena.close()


def _grown_ahead(home: Path, model: str) -> None:
    """Wait until ``model``'s worker grew its KV snapshots' host memory ahead of a deep release."""
    log = home / "log" / f"worker-{model}.log"
    wait_until(
        lambda: "allocated ahead of a release" in log.read_text(), WAIT, f"{model}'s KV host memory grown"
    )


def test_a_parked_worker_releases_its_kv_cache_when_the_other_needs_the_room(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIMESHARE_VRAM_BUDGET")
    # 1. weights-only switches (one model at a time): the reference
    monkeypatch.setenv("TIMESHARE_VRAM_BUDGET", "one-model")
    pool = _start(tmp_path / "one", smollm2_path, "auto")
    pools.append(pool)
    reference = _turns(pool)
    # each turn switched (weights only); the first may come before its model released after its
    # load (a race with the worker's startup that a busy machine loses: the same numerics)
    assert [t[3] for t in reference][1:] == [True, True]
    pool.stop()
    monkeypatch.delenv("TIMESHARE_VRAM_BUDGET")

    # 2. an auto budget on the whole machine: both fit, each measures what it keeps while released
    home = tmp_path / "roomy"
    pool = _start(home, smollm2_path, "auto")
    pools.append(pool)
    assert [t[:3] for t in _turns(pool)] == [t[:3] for t in reference]  # no switch: the same answers
    snap = pool.snapshot()
    weights = max(m.weight_bytes for m in snap.models)
    kv = max(m.kv_bytes for m in snap.models)
    buffers = max(m.buffer_bytes for m in snap.models)  # the compute buffers (host memory here)
    assert buffers > 2**20, snap
    assert kv >= 8192 * 23_040  # SmolLM2-135M: 30 layers x (K + V) x 192 f16 values per cell
    reserves = {x.model: x for x in _leases(home) if x.kind == "reserve"}
    assert set(reserves) == {A, B} and all(x.deepens > 0 for x in reserves.values())
    pool.stop()

    # 3. a "card" with room for one model's weights and KV cache but not two: the budget's
    # margin, the weights of one, both reserves but half of one KV cache
    room = weights + sum(x.bytes for x in reserves.values()) - kv // 2
    monkeypatch.setenv("TIMESHARE_HOST_MEMORY", str(AUTO_MARGIN_MIN + room))
    home = tmp_path / "card"
    pool = _start(home, smollm2_path, "auto")
    pools.append(pool)
    snap = pool.snapshot()
    b_pid = snap.model(B).pid  # type: ignore[union-attr]
    assert b_pid is not None and all(m.state is ModelState.RELEASED for m in snap.models), snap
    parked_rss = _rss(b_pid)  # parked at the weights level: its KV cache and compute buffers kept
    first = _turn(pool, A, QUESTION)  # B's KV cache must go for A's weights to fit
    wait_until(lambda: pool.snapshot().model(B).kv_bytes == 0, WAIT, "b's KV cache released")  # type: ignore[union-attr]
    deep_rss = _rss(b_pid)
    # its KV cache released in place, measured from outside; its compute buffers too (status),
    # though B has not decoded yet: their pages were never touched, so its RSS never held them
    assert parked_rss - deep_rss >= kv * 9 // 10, (parked_rss, deep_rss, kv)
    assert pool.snapshot().model(B).buffer_bytes == 0  # type: ignore[union-attr]
    b_reserve = next(x for x in _leases(home) if x.kind == "reserve" and x.model == B)
    assert b_reserve.deepens == 0 and b_reserve.bytes <= reserves[B].bytes - kv * 9 // 10
    a_pid = pool.snapshot().model(A).pid  # type: ignore[union-attr]
    assert a_pid is not None
    # idle after its answer, A grew the host memory its deep release saves into (off the switch's
    # path, TIMESHARE_KV_AHEAD unset: an auto budget it shares with B)
    _grown_ahead(home, A)
    resident_rss = _rss(a_pid)  # A has decoded: its compute buffers' pages are in its RSS
    second = _turn(pool, B, QUESTION)  # back from the deep level; A goes (weights and KV cache)
    wait_until(lambda: pool.snapshot().model(A).kv_bytes == 0, WAIT, "a's KV cache released")  # type: ignore[union-attr]
    # A's weights, KV cache and compute buffers left (the weights' host shadow stays); of the
    # compute buffers, its RSS held only the pages its turn touched (a ~100-token batch of the
    # 512 they are planned for): the status says they are gone
    gone = weights + kv
    assert resident_rss - _rss(a_pid) >= gone * 9 // 10, (resident_rss, _rss(a_pid), weights, kv, buffers)
    assert pool.snapshot().model(A).buffer_bytes == 0  # type: ignore[union-attr]
    a_reserve = next(x for x in _leases(home) if x.kind == "reserve" and x.model == A)
    assert a_reserve.deepens == 0 and a_reserve.bytes <= reserves[A].bytes - kv * 9 // 10
    _grown_ahead(home, B)
    third = _turn(pool, A, QUESTION + FOLLOW_UP)  # back from the deep level, its conversation kept
    assert [first, second, third] == [(*t[:3], True) for t in reference]  # bitwise the same answers
    moved = []
    for model in (A, B):
        log = (home / "log" / f"worker-{model}.log").read_text()
        moved += [int(n) for n in re.findall(r"KV cache released, (\d+) bytes of it", log)]
    # only the cells in use moved: ~130 tokens of KV (and a few headers), never n_ctx's 8192
    assert len(moved) >= 3 and max(moved) > 0 and all(n < 200 * 23_040 for n in moved), moved
    # no deep release allocated its host memory: each was grown ahead, after the answer
    saves = []
    for model in (A, B):
        log = (home / "log" / f"worker-{model}.log").read_text()
        saves += re.findall(
            r"KV cells saved: (\d+) bytes in [\d.]+ ms \(\w+, [^)\n]*, (none allocated|allocated in)", log
        )
    assert sum(int(n) > 0 for n, _a in saves) >= 2 and all(a == "none allocated" for _n, a in saves), saves
    wait_until(lambda: pool.snapshot().model(A).kv_bytes == kv, WAIT, "a's KV cache back")  # type: ignore[union-attr]
    # B is deep now (A's third turn needed the room), its conversation still in its sequence:
    # a stop saves it from the residency's snapshot of the cells in use
    wait_until(lambda: pool.snapshot().model(B).kv_bytes == 0, WAIT, "b deep again")  # type: ignore[union-attr]
    pool.stop()
    log_b = (home / "log" / f"worker-{B}.log").read_text()
    assert re.search(r"saved the KV of 1 conversation\(s\)", log_b), log_b[-2000:]
    saved = list((home / "kv" / B).glob(f"{B}-*.kv"))
    assert len(saved) == 1 and saved[0].stat().st_size > 100 * 23_040, saved  # ~130 tokens' cells


def test_a_sleep_at_weights_and_kv_goes_in_place_and_wakes_bitwise(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39: ``sleep --level weights+kv`` takes the deep level in place (the KV buffer and the
    compute buffers released, the context and its conversation kept) instead of freeing the
    context, where the deep path is wholly in place (a plain llama cache on this build); the
    answer, the first token's log-probabilities and the tokens evaluated after the wake equal
    those after a weights-only switch."""
    monkeypatch.setenv("TIMESHARE_VRAM_BUDGET", "one-model")
    pool = _start(tmp_path / "switch", smollm2_path, "one-model")
    pools.append(pool)
    reference = _turns(pool)[2]  # A's follow-up, after B took the GPU (weights only)
    assert reference[3]
    pool.stop()

    home = tmp_path / "sleep"
    pool = _start(home, smollm2_path, "one-model")
    pools.append(pool)
    _turn(pool, A, QUESTION)
    log = home / "log" / f"worker-{A}.log"
    compute_lines = log.read_text().count("released the compute buffers of")
    pool.sleep(A, level="weights+kv")

    def asleep_now() -> bool:
        s = pool.snapshot().model(A)
        return s is not None and s.state is ModelState.SLEEPING and s.kv_bytes == 0

    wait_until(asleep_now, WAIT, "A asleep")
    asleep = pool.snapshot().model(A)
    assert asleep is not None and asleep.buffer_bytes == 0 and asleep.device_bytes == 0, asleep
    # in place: the compute buffers released in place (freeing the context says no such line),
    # the conversation kept in its sequence
    text = log.read_text()
    assert text.count("released the compute buffers of") == compute_lines + 1, text[-2000:]
    assert "(weights+kv)" in text
    after = _turn(pool, A, QUESTION + FOLLOW_UP)
    assert after == reference  # bitwise: text, first-token logprobs, tokens evaluated, switched
