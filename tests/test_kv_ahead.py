"""The KV snapshots' host memory grown ahead, off the switch's path (issue 39's leftover): the
worker, idle after an answer, grows the memory a deep release saves the KV cells into
(residency/kvmemory.py) to what they take now, so that the release allocates nothing.

Real SmolLM2-135M on the CPU build (pageable memory stands in for pinned: the same rule, the
same calls). The oracle for the bytes saved is llama.cpp itself: ``llama_state_seq_get_data``
called directly on the context before the release. The worker's side (when it grows, the opt-out,
the release's count of allocations) is checked on real workers in tests/test_deep_release.py and
below."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import llama_cpp  # before numpy
import pytest
from _budget_pool_util import WAIT
from _proc_util import wait_until
from _residency_util import load
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.pool.supervisor import Pool
from timeshare.core.residency import Residency
from timeshare.core.residency.kvmemory import GRAIN, KvHostMemory
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState

LYON = b"The history of Lyon, its rivers and its silk, told in a few words for a visitor."


def _oracle(ctx: int) -> dict[int, bytes]:
    """Each sequence with cells, as llama.cpp's own llama_state_seq_get_data writes it."""
    mem = llama_cpp.llama_get_memory(ctx)
    out = {}
    for s in range(int(llama_cpp.llama_n_seq_max(ctx))):
        if int(llama_cpp.llama_memory_seq_pos_max(mem, s)) < 0:
            continue
        n = int(llama_cpp.llama_state_seq_get_size(ctx, s))
        buf = (ctypes.c_uint8 * n)()
        assert int(llama_cpp.llama_state_seq_get_data(ctx, buf, n, s)) == n
        out[s] = bytes(buf)
    return out


def _saved(res: Residency) -> dict[int, bytes]:
    return {seq: state for seq, (state, _pos) in res.parked_states().items()}


# ---- the memory's rule (pure) --------------------------------------------------------------------


def test_growing_ahead_follows_the_lends_rule_and_a_lend_then_allocates_nothing() -> None:
    from timeshare.core.errors import ResidencyError

    ahead, plain = KvHostMemory(False), KvHostMemory(False)
    try:
        for size, most in [(3 * GRAIN, None), (5 * GRAIN, 5 * GRAIN + 7), (7 * GRAIN, None)]:
            grown = ahead.grow_ahead(size, most)
            assert grown == ahead.nbytes > 0  # the same sizes a lend gives
            address = ahead.address
            assert ahead.lend(size, most) == address and ahead.lend_alloc_ms is None  # nothing allocated
            ahead.give_back()
            plain.lend(size, most)
            assert plain.lend_alloc_ms is not None and plain.lend_alloc_ms >= 0
            plain.give_back()
            assert ahead.nbytes == plain.nbytes
        assert [ahead.nbytes, ahead.grown, ahead.grown_ahead] == [12 * GRAIN, 3, 3]
        assert ahead.grow_ahead(12 * GRAIN) == 0 and ahead.grown == 3  # it holds enough: nothing
        # never while a snapshot holds it (a release's save is in it): nothing freed, nothing made
        address = ahead.address
        ahead.lend(GRAIN)
        assert ahead.lent and ahead.grow_ahead(40 * GRAIN) == 0
        assert (ahead.address, ahead.nbytes, ahead.grown) == (address, 12 * GRAIN, 3)
        with pytest.raises(ResidencyError, match="lent already"):
            ahead.lend(GRAIN)
        ahead.give_back()
        assert ahead.grow_ahead(40 * GRAIN, most=41 * GRAIN) == 41 * GRAIN  # never past the whole cache
    finally:
        ahead.close()
        plain.close()
    assert ahead.nbytes == 0


# ---- a real model --------------------------------------------------------------------------------


@pytest.mark.parametrize("way", ["raw", "state"])
def test_after_the_grow_a_deep_release_allocates_nothing_and_saves_llama_cpps_bytes(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """Grown ahead (the cells in use of one conversation), a deep release saves into the memory
    as it is (no allocation: the release steps say so), the bytes llama.cpp's own state gives;
    the conversation then grows past what is kept and the next grow makes room again, so the
    next release allocates nothing either. The raw save and the state's way alike."""
    if way == "state":
        monkeypatch.setenv("TIMESHARE_KV_SAVE_RAW", "0")
    llm = load(smollm2_path, n_ctx=2048)
    try:
        llm.eval(llm.tokenize(LYON))
        res = Residency.attach(llm, smollm2_path)
        memory = res.kv_memory
        assert memory.nbytes == 0
        grown = res.grow_kv_memory()
        want = _oracle(int(llm._ctx.ctx))
        in_use = sum(len(b) for b in want.values())
        assert grown == memory.nbytes >= in_use and memory.grown == memory.grown_ahead == 1
        assert memory.nbytes == KvHostMemory(False).wanted(in_use, None if way == "state" else memory.nbytes)
        assert res.host_held_bytes == res.host_bytes + memory.nbytes  # in the worker's status
        address = memory.address
        res.release(kv=True)
        steps = res.release_steps
        assert steps.kv_save_path == way and steps.kv_save_bytes == in_use
        assert (steps.kv_host_grown, steps.kv_host_alloc_ms) == (0, 0.0)
        assert (memory.address, memory.grown) == (address, 1)
        assert _saved(res) == want
        # released: the memory holds the snapshot, the grow does nothing
        assert res.grow_kv_memory() == 0 and (memory.address, memory.grown) == (address, 1)
        res.restore()
        assert res.grow_kv_memory() == 0  # the same cells: the memory holds them
        llm.eval(llm.tokenize(LYON * 6))  # far more cells than the memory holds
        want = _oracle(int(llm._ctx.ctx))
        in_use = sum(len(b) for b in want.values())
        assert in_use > memory.nbytes
        assert res.grow_kv_memory() == memory.nbytes >= in_use and memory.grown_ahead == 2
        res.release(kv=True)
        steps = res.release_steps
        assert steps.kv_save_bytes == in_use and (steps.kv_host_grown, steps.kv_host_alloc_ms) == (0, 0.0)
        assert _saved(res) == want and memory.grown == 2
        res.restore()
        res.close()
        assert memory.nbytes == 0
    finally:
        llm.close()


def test_without_the_grow_the_first_deep_release_allocates_and_says_so(smollm2_path: Path) -> None:
    """The baseline the grow removes: the first deep release allocates the memory (its release
    steps count it, with its milliseconds), the second finds it."""
    llm = load(smollm2_path, n_ctx=512)
    try:
        llm.eval(llm.tokenize(LYON))
        res = Residency.attach(llm, smollm2_path)
        res.release()  # a weights-only release saves nothing: nothing counted
        assert res.release_steps.kv_host_grown is None
        res.restore()
        res.release(kv=True)
        first = res.release_steps
        assert first.kv_host_grown == 1 and first.kv_host_alloc_ms is not None and first.kv_host_alloc_ms > 0
        res.restore()
        res.release(kv=True)
        assert (res.release_steps.kv_host_grown, res.release_steps.kv_host_alloc_ms) == (0, 0.0)
        res.restore()
        res.close()
    finally:
        llm.close()


def test_on_the_rebuild_path_every_release_saves_into_the_memory_grown_ahead(smollm2_path: Path) -> None:
    from timeshare.core.residency import ResidencyOptions

    llm = load(smollm2_path, n_ctx=512)
    try:
        llm.eval(llm.tokenize(LYON))
        res = Residency.attach(llm, smollm2_path, ResidencyOptions(mode="rebuild"))
        assert res.path == "rebuild"
        want = _oracle(int(llm._ctx.ctx))
        memory = res.kv_memory
        assert res.grow_kv_memory() == memory.nbytes >= sum(len(b) for b in want.values())
        address = memory.address
        res.release()  # the rebuild path saves the KV at every release
        assert (memory.address, memory.grown, memory.grown_ahead) == (address, 1, 1)
        assert res.kv_host_bytes == sum(len(b) for b in want.values())
        res.restore()
        assert _oracle(int(llm._ctx.ctx)) == want  # put back as saved
        res.close()
    finally:
        llm.close()


def test_bench_api_deep_reads_the_grow_ahead_and_the_release_that_allocated_nothing(
    smollm2_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``bench api --deep`` reads from the workers' logs (the lines the residency really logs,
    captured here) each grow ahead and, for each deep release, whether it allocated."""
    import logging

    from timeshare.core.diagnostics.bench_api_deep import deep_releases, kv_host_ahead, summarise_deep

    llm = load(smollm2_path, n_ctx=512)
    try:
        llm.eval(llm.tokenize(LYON))
        res = Residency.attach(llm, smollm2_path)
        with caplog.at_level(logging.INFO, logger="timeshare"):
            grown = res.grow_kv_memory()
            res.release(kv=True)
        res.restore()
        res.close()
    finally:
        llm.close()
    (tmp_path / "worker-a.log").write_text(caplog.text)
    ahead = kv_host_ahead(tmp_path, ["a", "b"])
    assert len(ahead) == 1 and ahead[0]["model"] == "a" and ahead[0]["memory"] == "pageable"
    assert ahead[0]["mb"] == pytest.approx(grown / 1e6, abs=0.1) and ahead[0]["alloc_ms"] >= 0
    got = deep_releases(tmp_path, ["a", "b"])
    assert len(got) == 1 and (got[0]["kv_host_grown"], got[0]["kv_host_alloc_ms"]) == (0, 0.0)
    summary = summarise_deep([], [], {"releases": got, "kv_host_ahead": ahead})
    assert summary["kv_host_allocs_on_release"] == 0 and summary["kv_host_allocs_ahead"] == 1
    assert summary["first_deep_release_ms"] == {"a": got[0]["release_ms"]}


# ---- a real worker: the rule, the opt-out -------------------------------------------------------

M = "smol-kv"
QUESTION = "Tell me about the history of the city of Lyon, its rivers, its silk and its food. " * 5


def _pool(home: Path, smollm2: Path) -> Pool:
    config = Config(
        models=(ModelConfig(id=M, path=str(smollm2), n_ctx=2048, parallel=1, idle_sleep_s=None),),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget="one-model"),
    )
    pool = Pool(config, arena_dir=home / "arena", log_dir=home / "log", kv_dir=home / "kv")
    pool.start()
    pool.wait_ready(timeout=WAIT)
    return pool


@pytest.mark.parametrize("ahead", ["1", "0", "unset"])
def test_the_worker_grows_ahead_when_idle_unless_told_not_to(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch, ahead: str
) -> None:
    """One model alone under a one-model budget (no switch ever sends it deep: by the rule it
    does not grow ahead) answers, then sleeps at the deep level (weights+kv, in place). With
    TIMESHARE_KV_AHEAD=1 it grew the memory while idle after the answer (its status's host
    bytes count it), before the sleep, and the sleep's save allocated nothing; with 0, or unset
    here, nothing was grown and the sleep's save allocated it."""
    if ahead == "unset":
        monkeypatch.delenv("TIMESHARE_KV_AHEAD", raising=False)
    else:
        monkeypatch.setenv("TIMESHARE_KV_AHEAD", ahead)
    home = tmp_path / ahead
    pool = _pool(home, smollm2_path)
    pools.append(pool)
    before = pool.snapshot().model(M).host_pinned_bytes  # type: ignore[union-attr]
    pool.generate(
        M,
        messages=[{"role": "user", "content": QUESTION}],
        sampling=Sampling(max_tokens=8, temperature=0.0),
        conversation="conv",
    ).result(timeout=WAIT)
    log = home / "log" / f"worker-{M}.log"
    if ahead == "1":
        wait_until(lambda: "allocated ahead of a release" in log.read_text(), WAIT, "the grow ahead")
        wait_until(
            lambda: pool.snapshot().model(M).host_pinned_bytes > before,  # type: ignore[union-attr]
            WAIT,
            "the status counting it",
        )
    pool.sleep(M, level="weights+kv")

    def asleep() -> bool:
        s = pool.snapshot().model(M)
        return s is not None and s.state is ModelState.SLEEPING and s.kv_bytes == 0

    wait_until(asleep, WAIT, "asleep")
    wait_until(lambda: "KV cells saved:" in log.read_text(), WAIT, "the save's line")
    text = log.read_text()
    saved = re.findall(
        r"KV cells saved: (\d+) bytes in [\d.]+ ms \(\w+, [^)\n]*, (none allocated|allocated in)", text
    )
    assert len(saved) == 1 and int(saved[0][0]) > 0, text[-3000:]
    if ahead == "1":
        # grown once, while idle after the answer: before the sleep's save, which found it
        assert text.count("allocated ahead of a release") == 1
        assert text.index("allocated ahead of a release") < text.index("KV cells saved:")
        assert saved[0][1] == "none allocated"
    else:
        assert "allocated ahead of a release" not in text and saved[0][1] == "allocated in"
