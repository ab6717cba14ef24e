"""The deep release's save of the KV cells in use (issue 39, the releasing side): straight from the
KV tensors (residency/kvsave.py) into host memory kept from one release to the next
(residency/kvmemory.py). The oracle is llama.cpp itself: ``llama_state_seq_get_data`` called
directly on the same context must give the same bytes, sequence for sequence, with flash attention
on and off (a transposed V), one sequence and several (some empty), cells in use that do not lie
in one run, and a quantised KV cache. Where the cells cannot be told for sure the state is taken
the portable way, and the model still comes back bitwise. Real SmolLM2-135M on the CPU build (its
KV buffers are host buffers; the same ggml_backend_tensor_get calls run)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp  # before numpy
import pytest
from _residency_util import decode_seq, load
from timeshare.core.residency import Residency
from timeshare.core.residency.kvbuffer import KvBuffers
from timeshare.core.residency.kvmemory import KvHostMemory
from timeshare.core.residency.kvsave import KvSaver, KvSaveUnsupportedError

LYON = b"The history of Lyon, its rivers and its silk, told in a few words for a visitor."
PARIS = b"Bridges of Paris, from the oldest to the newest:"
ROME = b"Rome"


def _context(llm: llama_cpp.Llama, seqs: int, flash: bool, unified: bool = False, kv_type: int = 0) -> Any:
    """A context on ``llm``'s model of ``seqs`` sequences (each in its own KV stream unless
    ``unified``), flash attention on or off, K and V of ``kv_type`` (0: f16)."""
    from llama_cpp import _internals

    params = type(llm.context_params).from_buffer_copy(llm.context_params)
    params.n_seq_max, params.kv_unified = seqs, unified
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    if kv_type:
        params.type_k = params.type_v = kv_type
    return _internals.LlamaContext(model=llm._model, params=params, verbose=False)


def _oracle(ctx: Any) -> dict[int, bytes]:
    """Each sequence with cells, as llama.cpp's own llama_state_seq_get_data writes it."""
    mem = llama_cpp.llama_get_memory(ctx.ctx)
    out = {}
    for s in range(int(llama_cpp.llama_n_seq_max(ctx.ctx))):
        if int(llama_cpp.llama_memory_seq_pos_max(mem, s)) < 0:
            continue
        n = int(llama_cpp.llama_state_seq_get_size(ctx.ctx, s))
        buf = (ctypes.c_uint8 * n)()
        assert int(llama_cpp.llama_state_seq_get_data(ctx.ctx, buf, n, s)) == n
        out[s] = bytes(buf)
    return out


def _raw(llm: llama_cpp.Llama, ctx: Any, memory: KvHostMemory | None = None) -> dict[int, bytes]:
    model = int(llm._model.model)
    memory = memory or KvHostMemory(False)
    snap = KvSaver(KvBuffers.find(model, int(ctx.ctx)), model).take(int(ctx.ctx), memory)
    try:
        assert snap.path == "raw"
        return {s: ctypes.string_at(addr, n) for s, addr, n in snap.segments()}
    finally:
        snap.close()


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Any:
    llm = load(smollm2_path, n_ctx=512)
    yield llm
    llm.close()


def _several(llm: llama_cpp.Llama, ctx: Any) -> None:
    """Four sequences, the third empty; the first with a hole in its cells filled again by later
    tokens (its cells in use are two runs and not in the order of their positions), the fourth
    with cells cleared from its middle."""
    lyon, paris, rome = llm.tokenize(LYON), llm.tokenize(PARIS), llm.tokenize(ROME)
    mem = llama_cpp.llama_get_memory(ctx.ctx)
    decode_seq(ctx, lyon[:12], 0, 0)
    decode_seq(ctx, paris, 1, 0)
    decode_seq(ctx, rome + paris, 3, 0)
    llama_cpp.llama_memory_seq_rm(mem, 0, 4, 8)  # a hole: cells 4..7 of stream 0 freed
    decode_seq(ctx, lyon[12:18], 0, 12)  # four of these land in the hole, two after cell 11
    llama_cpp.llama_memory_seq_rm(mem, 3, 2, 6)  # and one in stream 3, left empty


@pytest.mark.parametrize("flash", [True, False], ids=["flash-attn", "v-transposed"])
def test_the_raw_save_is_llama_cpps_state_byte_for_byte(smol: llama_cpp.Llama, flash: bool) -> None:
    ctx = _context(smol, 1, flash)
    try:
        decode_seq(ctx, smol.tokenize(LYON), 0, 0)
        kvbuf = KvBuffers.find(int(smol._model.model), int(ctx.ctx))
        assert kvbuf.v_trans is not flash
        want = _oracle(ctx)
        assert list(want) == [0] and _raw(smol, ctx) == want
    finally:
        ctx.close()


@pytest.mark.parametrize("flash", [True, False], ids=["flash-attn", "v-transposed"])
def test_several_sequences_with_holes_save_as_llama_cpp_does(smol: llama_cpp.Llama, flash: bool) -> None:
    from timeshare.core.residency.kvlayout import live_positions

    ctx = _context(smol, 4, flash)
    try:
        _several(smol, ctx)
        live = live_positions(int(llama_cpp.llama_get_memory(ctx.ctx)))
        pos0 = live[0][live[0] != -1]
        assert len(pos0) == 14 and list(pos0) != sorted(pos0)  # not in the order of positions
        assert (live[2] == -1).all() and (live[3] != -1).sum() == len(smol.tokenize(ROME + PARIS)) - 4
        want = _oracle(ctx)
        assert sorted(want) == [0, 1, 3]
        assert _raw(smol, ctx) == want
    finally:
        ctx.close()


def test_a_quantised_kv_cache_saves_as_llama_cpp_does(smol: llama_cpp.Llama) -> None:
    q8 = llama_cpp.GGML_TYPE_Q8_0
    for seqs in (1, 4):
        ctx = _context(smol, seqs, True, kv_type=q8)
        try:
            if seqs == 1:
                decode_seq(ctx, smol.tokenize(LYON), 0, 0)
            else:
                _several(smol, ctx)
            want = _oracle(ctx)
            assert want and _raw(smol, ctx) == want
        finally:
            ctx.close()


def test_an_empty_cache_saves_nothing(smol: llama_cpp.Llama) -> None:
    ctx = _context(smol, 2, True)
    try:
        memory = KvHostMemory(False)
        assert _raw(smol, ctx, memory) == {} == _oracle(ctx)
        assert memory.nbytes == 0  # nothing allocated for nothing
    finally:
        ctx.close()


def test_one_stream_of_several_sequences_is_refused_with_the_reason(smol: llama_cpp.Llama) -> None:
    ctx = _context(smol, 2, True, unified=True)
    try:
        decode_seq(ctx, smol.tokenize(PARIS), 0, 0)
        decode_seq(ctx, smol.tokenize(ROME), 1, 0)
        model = int(smol._model.model)
        saver = KvSaver(KvBuffers.find(model, int(ctx.ctx)), model)
        with pytest.raises(KvSaveUnsupportedError, match="one KV stream holds several sequences"):
            saver.take(int(ctx.ctx), KvHostMemory(False))
    finally:
        ctx.close()


def test_a_state_of_another_size_turns_the_raw_save_off_for_good(
    smol: llama_cpp.Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save of a cache compares its sizes with llama_state_seq_get_size (extra data per
    cell, another format): a difference is refused, and stays so."""
    ctx = _context(smol, 1, True)
    try:
        decode_seq(ctx, smol.tokenize(PARIS), 0, 0)
        model = int(smol._model.model)
        saver = KvSaver(KvBuffers.find(model, int(ctx.ctx)), model)
        real = llama_cpp.llama_state_seq_get_size
        monkeypatch.setattr(llama_cpp, "llama_state_seq_get_size", lambda c, s: real(c, s) + 12)
        memory = KvHostMemory(False)
        with pytest.raises(KvSaveUnsupportedError, match=r"not the .* its layout gives"):
            saver.take(int(ctx.ctx), memory)
        monkeypatch.setattr(llama_cpp, "llama_state_seq_get_size", real)
        with pytest.raises(KvSaveUnsupportedError, match=r"not the .* its layout gives"):
            saver.take(int(ctx.ctx), memory)
        assert memory.nbytes == 0
    finally:
        ctx.close()


# ---- through the residency ----------------------------------------------------------------------


def _next_logits(ctx: Any, n_vocab: int, seqs: dict[int, int]) -> list[bytes]:
    """The logits of token 42 decoded next in each sequence (seq -> its next position)."""
    out = []
    for seq, pos in seqs.items():
        decode_seq(ctx, [42], seq, pos)
        logits = llama_cpp.llama_get_logits_ith(ctx.ctx, -1)
        out.append(ctypes.string_at(ctypes.cast(logits, ctypes.c_void_p).value, 4 * n_vocab))
    return out


def _unified(llm: llama_cpp.Llama) -> Any:
    ctx = _context(llm, 2, True, unified=True)
    decode_seq(ctx, llm.tokenize(LYON), 0, 0)
    decode_seq(ctx, llm.tokenize(PARIS), 1, 0)
    return ctx


@pytest.mark.parametrize("flash", [True, False], ids=["flash-attn", "v-transposed"])
def test_a_raw_save_comes_back_bitwise_through_the_deep_level(smollm2_path: Path, flash: bool) -> None:
    """Four sequences (one empty, holes, cells out of position order) saved raw at a deep release
    and written back layer by layer: the next token's logits of each equal those of an identical
    context never released."""
    llm = load(smollm2_path, n_ctx=512, use_mmap=False)
    try:
        n_vocab = llm.n_vocab()
        nxt = {0: 18, 1: len(llm.tokenize(PARIS)), 3: len(llm.tokenize(ROME + PARIS))}
        reference = _context(llm, 4, flash)
        _several(llm, reference)
        want = _next_logits(reference, n_vocab, nxt)
        reference.close()
        llm._ctx.close()
        llm._ctx = _context(llm, 4, flash)
        _several(llm, llm._ctx)
        res = Residency.attach(llm, smollm2_path)
        res.release(kv=True)
        assert res.release_steps.kv_save_path == "raw" and res.kv_upload_note == "", res.deep_note
        res.restore()
        assert res.restore_steps.kv_bytes is not None and res.restore_steps.kv_bytes > 0
        assert _next_logits(llm._ctx, n_vocab, nxt) == want
        res.close()
    finally:
        llm.close()


@pytest.mark.parametrize("why", ["kv_unified", "switched off"])
def test_where_the_raw_save_cannot_be_used_the_state_is_taken_and_comes_back_bitwise(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Two sequences in one KV stream (kv_unified), or TIMESHARE_KV_SAVE_RAW=0: the deep release
    saves through llama_state_seq_get_data, says why once, and the next token's logits of both
    sequences equal those of an identical context never released."""
    if why == "switched off":
        monkeypatch.setenv("TIMESHARE_KV_SAVE_RAW", "0")
    llm = load(smollm2_path, n_ctx=512, use_mmap=False)
    try:
        n_vocab = llm.n_vocab()
        seqs = {0: len(llm.tokenize(LYON)), 1: len(llm.tokenize(PARIS))}
        reference = _unified(llm) if why == "kv_unified" else _context(llm, 2, True)
        if why != "kv_unified":
            decode_seq(reference, llm.tokenize(LYON), 0, 0)
            decode_seq(reference, llm.tokenize(PARIS), 1, 0)
        want = _next_logits(reference, n_vocab, seqs)
        reference.close()
        llm._ctx.close()
        if why == "kv_unified":
            llm._ctx = _unified(llm)
        else:
            llm._ctx = _context(llm, 2, True)
            decode_seq(llm._ctx, llm.tokenize(LYON), 0, 0)
            decode_seq(llm._ctx, llm.tokenize(PARIS), 1, 0)
        res = Residency.attach(llm, smollm2_path)
        res.release(kv=True)
        steps = res.release_steps
        assert steps.kv_save_path == "state" and steps.kv_save_bytes == res.kv_host_bytes > 0
        reason = "one KV stream holds several sequences" if why == "kv_unified" else "TIMESHARE_KV_SAVE_RAW=0"
        assert reason in res.kv_save_note and reason in res.deep_note
        assert "llama_state_seq_get_data" in res.deep_note
        res.restore()
        assert _next_logits(llm._ctx, n_vocab, seqs) == want
        res.close()
    finally:
        llm.close()


def test_the_snapshot_memory_is_kept_grown_at_the_high_water_mark_and_freed_at_close(
    smollm2_path: Path,
) -> None:
    """A deep release saves raw into host memory the next one reuses (the same address for a
    snapshot of the same size), grown only for a bigger one, kept while resident, freed at close."""
    llm = load(smollm2_path, n_ctx=2048, use_mmap=False)
    try:
        llm.eval(llm.tokenize(LYON))
        res = Residency.attach(llm, smollm2_path)
        memory = res.kv_memory
        assert memory.nbytes == 0
        res.release(kv=True)
        first = res.release_steps
        assert res.kv_save_note == "" and first.kv_save_path == "raw"
        assert first.kv_save_ms is not None and first.kv_save_ms >= 0
        assert first.kv_save_bytes == res.kv_host_bytes
        size, address, grown = memory.nbytes, memory.address, memory.grown
        assert grown == 1 and size >= res.kv_host_bytes and address != 0
        res.restore()
        assert memory.nbytes == size  # kept while resident
        res.release(kv=True)  # the same cells: the same memory
        assert res.release_steps.kv_save_bytes == first.kv_save_bytes
        assert (memory.address, memory.grown, memory.nbytes) == (address, 1, size)
        res.restore()
        res.release()  # a weights-only release saves nothing
        assert res.release_steps.kv_save_path is None and memory.nbytes == size
        res.restore()
        llm.eval(llm.tokenize(LYON * 6))  # far more cells than the memory holds
        res.release(kv=True)
        assert res.release_steps.kv_save_bytes == res.kv_host_bytes > size
        assert memory.grown == 2 and memory.nbytes >= res.kv_host_bytes
        res.restore()
        res.close()
        assert memory.nbytes == 0 and memory.address == 0
    finally:
        llm.close()


def test_the_host_memory_lends_one_snapshot_at_a_time_and_grows_ahead() -> None:
    from timeshare.core.errors import ResidencyError
    from timeshare.core.residency.kvmemory import GRAIN

    memory = KvHostMemory(False)
    a = memory.lend(3 * GRAIN)
    assert memory.nbytes == 4 * GRAIN  # 3 and a quarter, in whole grains
    with pytest.raises(ResidencyError, match="lent already"):
        memory.lend(10)
    memory.give_back()
    assert memory.lend(4 * GRAIN) == a and memory.grown == 1
    memory.give_back()
    memory.lend(5 * GRAIN, most=5 * GRAIN + 7)  # never more than the largest snapshot, in grains
    assert memory.nbytes == 6 * GRAIN and memory.grown == 2
    memory.give_back()
    memory.lend(7 * GRAIN)  # a growing conversation: twice what it held (12), not 7 and a quarter (9)
    assert memory.nbytes == 12 * GRAIN and memory.grown == 3
    memory.give_back()
    memory.close()
    assert memory.nbytes == 0


def test_bench_api_deep_reads_the_releasing_side_from_the_workers_log(
    smollm2_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``bench api --deep`` reads each deep release and its KV save from the parked workers' logs
    (the lines the residency really logs, captured here), and its summary gives their medians."""
    import logging

    from timeshare.core.diagnostics.bench_api_deep import deep_releases, summarise_deep

    llm = load(smollm2_path, n_ctx=512, use_mmap=False)
    try:
        llm.eval(llm.tokenize(LYON))
        res = Residency.attach(llm, smollm2_path)
        with caplog.at_level(logging.INFO, logger="timeshare"):
            res.release()  # weights only: no save
            res.restore()
            res.release(kv=True)
        steps = res.release_steps
        res.restore()
        res.close()
    finally:
        llm.close()
    (tmp_path / "worker-a.log").write_text(caplog.text)
    got = deep_releases(tmp_path, ["a", "b"])
    assert len(got) == 1 and got[0]["model"] == "a" and got[0]["kv_save_path"] == "raw"
    assert got[0]["kv_save_bytes"] == steps.kv_save_bytes
    assert got[0]["kv_save_ms"] == pytest.approx(steps.kv_save_ms, abs=0.01)
    assert got[0]["release_ms"] >= got[0]["kv_save_ms"]
    # its first deep release allocated the host memory (nothing grew it ahead here)
    assert got[0]["kv_host_grown"] == steps.kv_host_grown == 1
    assert got[0]["kv_host_alloc_ms"] == pytest.approx(steps.kv_host_alloc_ms, abs=0.01)
    summary = summarise_deep([], [], {"releases": got})
    assert summary["kv_host_allocs_on_release"] == 1 and summary["kv_host_allocs_ahead"] == 0
    assert summary["kv_save_paths"] == ["raw"] and summary["kv_save_ms_median"] == got[0]["kv_save_ms"]
    assert summary["deep_release_ms_median"] == got[0]["release_ms"]
