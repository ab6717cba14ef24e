"""Residency: release/restore of a loaded model's weights on the CPU build, with real models.

On a CPU-only build the model is loaded without mmap, so its host weight buffers play the device:
the in-place path frees and re-creates them for real (CPU and CPU_REPACK buffer types). Every
bitwise check compares the raw logits bytes of 8 greedy decode steps replayed from the same KV
prefix. Faults a CPU machine cannot produce on demand (pinned memory refused, device memory
exhausted) are injected by replacing the allocator functions; each such test says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp  # before numpy
import pytest
from _proc_util import resident_in, rss_of
from _residency_util import Greedy, load, same
from timeshare.core.errors import (
    ModelFileChangedError,
    ModelFileError,
    OutOfDeviceMemoryError,
    ResidencyError,
)
from timeshare.core.residency import (
    Residency,
    ResidencyOptions,
    _ggml,
    check_gguf,
    hostmem,
)
from timeshare.core.residency import inplace as inplace_mod
from timeshare.core.residency.hostmem import fix_malloc_mmap_threshold


def _pos_max(llm: llama_cpp.Llama) -> int:
    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(llm.ctx), 0))


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _cycle_check(llm: llama_cpp.Llama, path: Path, cycles: int = 3, **opts: Any) -> Residency:
    greedy = Greedy(llm)
    reference = greedy.run()
    res = Residency.attach(llm, path, ResidencyOptions(**opts))
    for i in range(cycles):
        ip = res._inplace
        ranges = [(b.base, b.size) for b in ip.buffers] if ip is not None else []
        _LIBC.malloc_trim(0)
        before, before_here = rss_of(), resident_in(ranges)
        rel = res.release()
        assert not res.weights_resident
        # the memory really went back, as the kernel counts it (the model was loaded without mmap:
        # its weight buffers are this process's memory): what the residency took in charge, and
        # what it reports as freed. malloc_trim: in this long-lived test process glibc may have
        # served a buffer from a free hole of its heap (earlier tests' memory), which a free()
        # leaves to glibc (trimmed before and after, so only what the release freed counts); a
        # buffer that was not freed at all is not trimmed either
        _LIBC.malloc_trim(0)
        freed = before - rss_of()
        assert res.weight_bytes > 0 and freed > 0.8 * res.weight_bytes, (i, freed, res.weight_bytes)
        if ranges:
            # the report against the kernel's count in the weight buffers' own address ranges: the
            # whole process's RSS can also fall by what another thread or the collector freed
            # meanwhile (once seen: 29.1 MB for a 14.8 MB release), these ranges cannot
            freed = before_here - resident_in(ranges)
        assert abs(rel.freed_bytes - freed) < 0.2 * res.weight_bytes, (rel.freed_bytes, freed)
        assert rel.level in ("weights", "weights+kv")
        rst = res.restore()
        assert res.weights_resident and res.kv_resident
        assert rst.bytes > 0
        assert same(greedy.run(), reference), f"logits differ after cycle {i + 1}"
    return res


# --- probe and path choice ----------------------------------------------------------------------


def test_probe_on_this_build() -> None:
    probe = Residency.probe()
    assert probe.version == "0.3.36" and probe.version_ok
    assert probe.layout_ok and probe.inplace_possible and probe.reason == ""
    assert probe.backend == "CPU" and not probe.gpu
    assert probe.use_mmap_for_inplace is False  # CPU build: host weight buffers play the device


def test_unpinned_version_takes_the_rebuild_path(
    small_q4: llama_cpp.Llama, small_q4_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama_cpp, "__version__", "0.3.99")
    res = Residency.attach(small_q4, small_q4_path)
    assert res.path == "rebuild"
    assert "0.3.99" in res.reason and "0.3.36" in res.reason
    with pytest.raises(ResidencyError, match=r"0\.3\.99"):
        Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace"))


def test_layout_probe_disagreement_takes_the_rebuild_path(
    small_q4: llama_cpp.Llama, small_q4_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def wrong(*_a: Any, **_k: Any) -> None:  # injected: a ggml build whose struct moved
        raise _ggml.LayoutMismatchError("ggml_tensor layout differs at: data")

    monkeypatch.setattr(_ggml, "probe_tensor_layout", wrong)
    res = Residency.attach(small_q4, small_q4_path)
    assert res.path == "rebuild" and "layout differs" in res.reason


def test_incomplete_discovery_refuses_the_inplace_path(
    small_q4: llama_cpp.Llama, small_q4_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = inplace_mod.discover

    def drop_one(llm: Any, layout: Any, *args: Any) -> Any:  # injected: the warm-up graph "missed" a weight
        disc = real(llm, layout, *args)
        disc.weights.discard(max(disc.weights))
        return disc

    monkeypatch.setattr(inplace_mod, "discover", drop_one)
    res = Residency.attach(small_q4, small_q4_path)
    assert res.path == "rebuild"
    assert "not covered" in res.reason or "was not seen" in res.reason
    # the rebuild path still works for it
    greedy = Greedy(small_q4)
    ref = greedy.run()
    res.release()
    res.restore()
    assert same(greedy.run(), ref)


def test_mmapped_cpu_model_has_nothing_to_release(small_q4_path: Path) -> None:
    llm = load(small_q4_path, use_mmap=True)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = Residency.attach(llm, small_q4_path)
        assert res.path == "none" and "use_mmap=False" in res.reason
        assert res._inplace is None and res.weight_bytes == 0  # no weight buffer is taken in charge
        live = llm.ctx
        rel = res.release()
        # only the context is set aside (so nothing decodes while "released"); the weights stay
        # mapped from the file and the KV cache stays in its context
        assert rel.level == "weights" and not res.weights_resident and res.kv_resident
        assert res.kv_context == live
        assert str(small_q4_path) in Path("/proc/self/maps").read_text()
        # nothing was freed: the RSS did not drop by anything like the weights (it reads 0 here;
        # the bound leaves room for allocator noise, far below any weight matrix of this model)
        assert abs(rel.freed_bytes) < small_q4_path.stat().st_size // 8, rel
        with pytest.raises(ResidencyError, match="restore"):
            llm.eval([1])
        rst = res.restore()
        assert rst.bytes == 0 and rst.level == "weights"  # nothing to upload
        assert res.weights_resident and res.kv_resident and llm.ctx == live  # the same context
        assert same(greedy.run(), ref)
        with pytest.raises(ResidencyError, match="memory-mapped"):
            Residency.attach(llm, small_q4_path, ResidencyOptions(mode="inplace"))
    finally:
        llm.close()


# --- the in-place path --------------------------------------------------------------------------


def test_inplace_smollm2_bitwise(smol: llama_cpp.Llama, smollm2_path: Path) -> None:
    res = _cycle_check(smol, smollm2_path, mode="inplace")
    assert res.path == "inplace" and res.reason == "" and res.backend == "CPU"
    ip = res._inplace
    assert ip is not None
    assert ip.n_weight_tensors_seen == 272  # every tensor of the GGUF was seen by the warm-up graph
    assert res.weight_bytes == sum(b.size for b in ip.buffers) > 90_000_000
    assert ip.tensor_bytes <= res.host_bytes <= res.weight_bytes and not res.host_pinned
    assert "pageable" in res.host_note
    assert ip.host_shadow.verified_tensors > 0  # shadow spot-checked against the loaded weights
    res.close()


def test_inplace_gemma3_bitwise(gemma3_path: Path) -> None:
    llm = load(gemma3_path)
    try:
        res = _cycle_check(llm, gemma3_path, mode="inplace")
        assert res.path == "inplace" and res._inplace is not None
        assert res._inplace.n_weight_tensors_seen == 236
        res.close()
    finally:
        llm.close()


@pytest.fixture
def mmap_threshold_fixed() -> bool:
    """glibc's mmap threshold fixed (as the doctor does) before the model loads: in the full
    suite's long-lived process the dynamic threshold has grown and a >= 1 MB weight buffer can be
    served from a free hole of the heap, whose free() leaves RSS unchanged (malloc_trim does not
    give it back either). With the threshold fixed each weight buffer is its own mmap, so a release
    that frees it lowers RSS and one that frees nothing still fails the check."""
    return fix_malloc_mmap_threshold()


@pytest.mark.parametrize("coalesce", [True, False], ids=["one-copy", "per-tensor"])
def test_inplace_repacked_q4_0_bitwise(
    mmap_threshold_fixed: bool, small_q4: llama_cpp.Llama, small_q4_path: Path, coalesce: bool
) -> None:
    res = _cycle_check(small_q4, small_q4_path, cycles=4, mode="inplace", coalesce_upload=coalesce)
    assert res._inplace is not None
    mirror = {b.buft_name: b.mirror for b in res._inplace.buffers}
    # the file bytes of CPU_REPACK go through its repacking set_tensor, tensor by tensor; the plain
    # CPU buffer is uploaded in one copy from a shadow laid out like the buffer
    assert mirror == {"CPU": coalesce, "CPU_REPACK": False}
    res.close()


@pytest.mark.parametrize("tensor", ["output.weight", "token_embd.weight"], ids=["repacked", "one-copy"])
def test_bitwise_check_can_fail(small_q4: llama_cpp.Llama, small_q4_path: Path, tensor: str) -> None:
    """Negative control: a shadow whose Q4_0 block scales differ from the file gives different
    logits, whether the tensor is uploaded on its own (repacked) or inside its buffer's one copy."""
    greedy = Greedy(small_q4)
    ref = greedy.run()
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace"))
    ip = res._inplace
    assert ip is not None
    target = next(t for b in ip.buffers for t in b.tensors if t.name == tensor)
    view = ip.shadow.view(target.shadow_offset, target.nbytes)
    view[0 : target.nbytes : 18] = bytes([0x3C]) * len(range(0, target.nbytes, 18))  # every block scale
    res.release()
    res.restore()
    assert not same(greedy.run(), ref)
    res.close()


@pytest.mark.parametrize("way", ["rebuild", "reserve"])
def test_restore_rebuilds_graphs_only_when_a_weight_buffer_moved(
    smol: llama_cpp.Llama, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """After a restore, the graphs are built anew (a reused graph, and a captured CUDA graph,
    hold the weights' old addresses) only when a weight buffer came back elsewhere; the restore
    records which. A move is forced by an allocator that never hands back an old address; the
    greedy run after it is bitwise the reference's (a graph replayed with the old addresses would
    read freed memory). ``rebuild`` (the default) drops the previous graph with no scheduler
    reserve; ``reserve`` (TIMESHARE_GRAPH_RESET) reserves as before."""
    from timeshare.core.residency import computebuf
    from timeshare.core.residency import context as context_mod

    monkeypatch.setenv("TIMESHARE_GRAPH_RESET", way)
    greedy = Greedy(smol)
    ref = greedy.run()
    resets: list[str] = []
    forget, drop = context_mod.forget_graphs, computebuf.forget_graph
    monkeypatch.setattr(
        context_mod, "forget_graphs", lambda ctx, llm: (resets.append("reserve"), forget(ctx, llm))[1]
    )
    monkeypatch.setattr(computebuf, "forget_graph", lambda ctx: (resets.append("rebuild"), drop(ctx))[1])
    res = Residency.attach(smol, smollm2_path, ResidencyOptions(mode="inplace"))
    ip = res._inplace
    assert ip is not None
    for _ in range(3):  # the allocator's choice: back at the same place or not, the report says so
        before = [b.base for b in ip.buffers]
        res.release()
        rst = res.restore()
        assert rst.addresses_moved == (before != [b.base for b in ip.buffers])
        assert rst.graphs_reset == rst.addresses_moved == bool(resets)
        assert set(resets) <= {way}
        resets.clear()
        assert same(greedy.run(), ref)

    old = {b.base for b in ip.buffers}
    alloc = _ggml.buft_alloc_buffer

    def elsewhere(buft: int, size: int) -> int | None:
        held: list[int] = []
        buf = alloc(buft, size)
        while buf is not None and int(_ggml.buffer_get_base(buf) or 0) in old:
            held.append(buf)  # kept until a buffer at a new address is found
            buf = alloc(buft, size)
        for h in held:
            _ggml.buffer_free(h)
        return buf

    res.release()
    monkeypatch.setattr(_ggml, "buft_alloc_buffer", elsewhere)
    rst = res.restore()
    monkeypatch.setattr(_ggml, "buft_alloc_buffer", alloc)
    assert rst.addresses_moved is True and rst.graphs_reset and resets == [way]
    assert same(greedy.run(), ref)
    # at the KV level the context stays (issue 39): its compute buffers come back too, so its
    # next graph is always built anew
    res.release(kv=True)
    assert res.context_kept and res._kvl.buffers is not None and res.compute_released_bytes > 0
    rst = res.restore()
    assert rst.graphs_reset
    assert same(greedy.run(), ref)
    res.close()


def test_decoding_while_released_is_refused(smol: llama_cpp.Llama, smollm2_path: Path) -> None:
    res = Residency.attach(smol, smollm2_path)
    live = smol.ctx
    res.release()
    assert res.kv_context == live  # KV snapshots can still read the cache
    with pytest.raises(ResidencyError, match="restore"):
        smol.eval([1, 2])
    with pytest.raises(ResidencyError):
        _ = smol.ctx
    assert smol.tokenize(b"hello")  # the vocabulary is not part of the weights
    assert res.release().ms == 0.0  # idempotent
    res.restore()
    smol.eval([1, 2])
    res.close()


def test_kv_level_release_keeps_the_prefix(smol: llama_cpp.Llama, smollm2_path: Path) -> None:
    greedy = Greedy(smol)
    ref = greedy.run()
    res = Residency.attach(smol, smollm2_path)
    smol.n_tokens = greedy.n_prefix
    smol.eval([greedy.tokens[-1]])  # leave the context where a generation would be
    n_tokens, pos_max = smol.n_tokens, _pos_max(smol)
    rel = res.release(kv=True)
    assert rel.level == "weights+kv" and not res.kv_resident and not res.weights_resident
    assert res.kv_context is None
    res.restore()
    # same llm object, same KV cells, same token count: nothing to re-prefill
    assert smol.n_tokens == n_tokens and _pos_max(smol) == pos_max
    assert same(greedy.run(), ref)
    # weights first, KV later (sleep deepening a yield)
    res.release()
    res.release(kv=True)
    assert not res.kv_resident
    res.restore()
    assert same(greedy.run(), ref)
    res.close()


# --- the rebuild path ---------------------------------------------------------------------------


def test_rebuild_path_bitwise_and_keeps_kv(smol: llama_cpp.Llama, smollm2_path: Path) -> None:
    greedy = Greedy(smol)
    ref = greedy.run()
    res = Residency.attach(smol, smollm2_path, ResidencyOptions(mode="rebuild"))
    assert res.path == "rebuild" and "mode=rebuild" in res.reason
    old_model = smol._model
    for _ in range(2):
        smol.n_tokens = greedy.n_prefix
        pos_max = _pos_max(smol)
        rel = res.release()
        assert rel.level == "weights+kv"
        with pytest.raises(ResidencyError):
            smol.tokenize(b"x")  # the model itself is gone
        res.restore()
        assert _pos_max(smol) == pos_max  # KV cells came back: no re-prefill
        assert smol._model is not old_model
        assert smol.tokenize(b"hello") == smol.tokenizer_.tokenize(b"hello")
        assert same(greedy.run(), ref)
    res.close()


# --- bad input ----------------------------------------------------------------------------------


def test_truncated_gguf_is_a_model_file_error(
    tmp_path: Path, small_q4_path: Path, small_q4: llama_cpp.Llama
) -> None:
    cut = tmp_path / "cut.gguf"
    data = small_q4_path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated") as info:
        check_gguf(cut)
    assert "re-download" in str(info.value)
    with pytest.raises(ModelFileError, match="truncated"):
        Residency.attach(small_q4, cut)
    # the loaded model was not touched
    Greedy(small_q4).run()


def test_corrupt_gguf_is_a_model_file_error(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + os.urandom(4096))
    with pytest.raises(ModelFileError, match="not a GGUF"):
        check_gguf(not_gguf)
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelFileError, match="damaged"):
        check_gguf(damaged)
    with pytest.raises(ModelFileError, match="does not exist"):
        check_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelFileError, match="not a file"):
        check_gguf(tmp_path)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def test_file_changed_before_attach_is_detected(tmp_path: Path, small_q4_path: Path) -> None:
    path = _copy(small_q4_path, tmp_path / "m.gguf")
    llm = load(path)
    try:
        info = check_gguf(path)
        with path.open("r+b") as f:  # same size, different weights (a model replaced in place)
            f.seek(info.data_offset + 64)
            f.write(os.urandom(256))
        with pytest.raises(ModelFileError, match="no longer holds the weights"):
            Residency.attach(llm, path, ResidencyOptions(mode="inplace"))
    finally:
        llm.close()


def test_file_replaced_after_load_refuses_rebuild_restore(tmp_path: Path, small_q4_path: Path) -> None:
    path = _copy(small_q4_path, tmp_path / "m.gguf")
    llm = load(path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = Residency.attach(llm, path, ResidencyOptions(mode="rebuild"))
        st = path.stat()
        original = path.read_bytes()
        data_offset = check_gguf(path).data_offset
        res.release()
        # gone
        path.rename(tmp_path / "away.gguf")
        with pytest.raises(ModelFileChangedError, match="is gone"):
            res.restore()
        (tmp_path / "away.gguf").rename(path)
        # replaced in place: same size, other bytes, newer mtime
        with path.open("r+b") as f:
            f.seek(data_offset + 64)
            f.write(os.urandom(256))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(ModelFileChangedError, match="changed on disk") as info:
            res.restore()
        assert isinstance(info.value, ModelFileError) and isinstance(info.value, ResidencyError)
        assert not res.weights_resident  # still released, nothing half-restored
        with pytest.raises(ResidencyError):
            llm.eval([1])
        # the file the model was loaded from is back: restore works and nothing was lost
        path.write_bytes(original)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        res.restore()
        assert same(greedy.run(), ref)
        res.close()
    finally:
        llm.close()


def test_pinned_memory_refused_falls_back_to_pageable(
    small_q4: llama_cpp.Llama, small_q4_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Injected fault: pretend a GPU host buffer type exists and refuses the allocation (a CPU
    # machine has no pinned memory to run out of).
    monkeypatch.setattr(hostmem, "pinned_buffer_type", lambda device=None: 0x1)
    monkeypatch.setattr(hostmem, "max_pinned_bytes", lambda buft: 1 << 62)
    monkeypatch.setattr(hostmem, "alloc_pinned", lambda buft, size: None)
    greedy = Greedy(small_q4)
    ref = greedy.run()
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace", host_shadow="pinned"))
    assert res.path == "inplace" and not res.host_pinned
    assert "could not be allocated" in res.host_note and "pageable" in res.host_note
    res.release()
    res.restore()
    assert same(greedy.run(), ref)
    res.close()


def test_out_of_device_memory_during_restore(
    small_q4: llama_cpp.Llama, small_q4_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = Greedy(small_q4)
    ref = greedy.run()
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace"))
    assert res._inplace is not None and len(res._inplace.buffers) == 2
    res.release()
    real = _ggml.buft_alloc_buffer
    calls = {"big": 0}

    def second_big_fails(buft: int, size: int) -> int | None:
        # Injected fault: the backend runs out of memory at the second weight buffer, after the
        # first one was restored (which must then be released again).
        if size > 4096:
            calls["big"] += 1
            if calls["big"] >= 2:
                return None
        return real(buft, size)

    monkeypatch.setattr(_ggml, "buft_alloc_buffer", second_big_fails)
    with pytest.raises(OutOfDeviceMemoryError, match="stays released") as info:
        res.restore()
    assert isinstance(info.value, ResidencyError)
    assert not res.weights_resident
    assert all(b.released for b in res._inplace.buffers)  # the first buffer was given back again
    with pytest.raises(ResidencyError):
        small_q4.eval([1])
    monkeypatch.setattr(_ggml, "buft_alloc_buffer", real)
    res.restore()
    assert same(greedy.run(), ref)
    res.close()


# --- doctor and bench end to end ----------------------------------------------------------------


def _timeshare() -> list[str]:
    exe = Path(sys.executable).parent / "timeshare"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "timeshare.cli"]


def test_doctor_json_end_to_end() -> None:
    with subprocess.Popen(
        [*_timeshare(), "doctor", "--json", "--cycles", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        # each step is shown as it starts (on stderr with --json), not all at the end
        first_step = proc.stderr.readline()
        assert first_step.startswith("doctor: loading "), first_step
        assert proc.poll() is None, "the doctor had finished before it showed its first step"
        stdout, rest = proc.communicate(timeout=240)
    stderr = first_step + rest
    assert proc.returncode == 0, stderr[-2000:]
    for step in ("reference", "cycle 1/3", "cycle 3/3", "with the KV cache"):
        assert step in stderr, stderr
    report = json.loads(stdout)  # stdout is only the JSON
    assert report["path"] == "inplace" and report["reason"] == ""
    assert report["backend"] == "CPU" and report["cycles"] == 3
    assert report["bitwise_identical"] is True and report["kv_level_bitwise_identical"] is True
    assert report["weight_bytes"] > 0
    # RSS really dropped by the weight bytes (glibc's mmap threshold fixed in the doctor)
    assert report["released_bytes"] >= 0.95 * report["weight_bytes"]
    for key in ("release_ms", "restore_ms", "restore_gbps"):
        assert report[key] > 0


def test_doctor_reports_a_bad_model_file(tmp_path: Path) -> None:
    out = subprocess.run(
        [*_timeshare(), "doctor", "--json", "--model", str(tmp_path / "nope.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert json.loads(out.stdout)["code"] == "model_file"
    assert "does not exist" in out.stderr


@pytest.mark.parametrize("parts", [1, 2])
def test_bench_residency_end_to_end(small_q4_path: Path, parts: int) -> None:
    out = subprocess.run(
        [
            *_timeshare(),
            "bench",
            "residency",
            "--model",
            str(small_q4_path),
            "--n-ctx",
            "256",
            "--cycles",
            "2",
            "--parts",
            str(parts),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["path"] == "inplace" and r["bitwise_identical"] and r["rebuild_bitwise_identical"]
    assert r["raw_copy_ms"] > 0 and r["reload_model_ctx_ms"] > 0 and r["rebuild_restore_ms"] > 0
    assert r["table"][0]["what"] == "in-place restore (median)"
    assert r["parts"] == parts and len(r["restore_ms_all"]) == len(r["restore_steps_all"]) == 2
    assert len(r["raw_copy_ms_reps"]) == 3 and r["raw_copy_ms"] == min(r["raw_copy_ms_reps"])
    for steps in r["restore_steps_all"]:  # synchronous, every part uploaded by its own copy
        assert steps["overlapped"] == 0.0 and steps["parts"] == parts
        assert steps["first_alloc_ms"] <= steps["first_upload_at_ms"] <= steps["total_ms"]
        assert steps["upload_wall_ms"] >= steps["copy_ms"] - 1e-6
    probe = r["copy_probe"]
    for case in ("reused", "thread_copy", "fresh_copy", "pause_after_free_copy", "pause_after_alloc_copy"):
        assert len(probe[f"{case}_ms"]) == 3 and all(x > 0 for x in probe[f"{case}_ms"])
        assert probe[f"{case}_median_ms"] == sorted(probe[f"{case}_ms"])[1]
    assert probe["bytes"] == r["restore_bytes"]


def test_the_residency_measures_on_the_models_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_at follows llama.cpp's main_gpu numbering (GPUs only, in order). Several GPUs cannot
    exist on these machines, so the device list here is a stand-in (named as such): a CPU, then
    two CUDA devices."""
    from timeshare.core.residency import _ggml

    assert _ggml.gpu_at(0) is None  # this CPU-only build has no GPU
    gpu = _ggml.GGML_BACKEND_DEVICE_TYPE_GPU
    fake = [
        _ggml.Device(1, "CPU", _ggml.GGML_BACKEND_DEVICE_TYPE_CPU),
        _ggml.Device(2, "CUDA0", gpu),
        _ggml.Device(3, "CUDA1", gpu),
    ]
    monkeypatch.setattr(_ggml, "devices", lambda: fake)
    assert _ggml.gpu_at(0) == fake[1] and _ggml.gpu_at(1) == fake[2]
    assert _ggml.gpu_at(7) == fake[1]  # no such GPU (the worker refuses that device before loading)


# --- a deferred host shadow (issue 29: a restarted worker answers first) ------------------------


def _readable_tensors(res: Residency) -> int:
    """The tensors a spot check can compare (repacked layouts cannot be read back as file bytes)."""
    ip = res._inplace
    assert ip is not None
    return len([t for b in ip.buffers if not b.buft_name.endswith("_REPACK") for t in b.tensors])


def test_deferred_shadow_released_first_comes_back_from_the_file_bitwise(
    small_q4: llama_cpp.Llama, small_q4_path: Path
) -> None:
    """A release before the deferred shadow was built reads none of it (it checks the tensors
    against the file); the restore builds it from the file, and the model comes back bitwise."""
    greedy = Greedy(small_q4)
    reference = greedy.run()
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace", defer_shadow=True))
    try:
        assert res.path == "inplace" and res.shadow_pending
        assert res.host_bytes == 0  # nothing allocated for it yet
        assert set(res.attach_steps) >= {"discover_ms", "plan_ms"}
        assert same(greedy.run(), reference)  # the model answers before any shadow exists
        rel = res.release()
        assert not res.weights_resident and res.shadow_pending and res.shadow_fillable
        assert res.host_bytes == 0 and rel.freed_bytes > 0  # nothing read for the release
        ip = res._inplace
        assert ip is not None and ip.host_shadow.from_file
        assert ip.host_shadow.verified_tensors == _readable_tensors(res) > 0  # each checked against the file
        res.restore()  # builds the shadow from the file first
        assert not res.shadow_pending and res.host_bytes > 0
        assert set(res.attach_steps) >= {"shadow_alloc_ms", "shadow_read_ms", "verify_ms"}
        assert same(greedy.run(), reference), "logits differ after the deferred shadow's cycle"
        res.release()
        res.restore()
        assert same(greedy.run(), reference)
    finally:
        res.close()


def test_a_final_release_neither_checks_nor_builds_a_deferred_shadow(
    small_q4: llama_cpp.Llama, small_q4_path: Path
) -> None:
    """A worker that ends frees its device memory before its token goes (release(final=True)):
    no host shadow is checked or built for weights that never come back, and a restore is refused."""
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace", defer_shadow=True))
    try:
        rel = res.release(final=True)
        ip = res._inplace
        assert ip is not None and ip.host_shadow.verified_tensors == 0 and not ip.host_shadow.from_file
        assert rel.freed_bytes > 0 and not res.weights_resident and res.host_bytes == 0
        with pytest.raises(ResidencyError, match="released for good"):
            res.restore()
    finally:
        res.close()


def test_deferred_shadow_filled_on_request(small_q4: llama_cpp.Llama, small_q4_path: Path) -> None:
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace", defer_shadow=True))
    try:
        res.fill_shadow()
        assert not res.shadow_pending and res.host_bytes > 0
        ip = res._inplace
        assert ip is not None and ip.host_shadow.verified_tensors > 0
        res.fill_shadow()  # once
        assert res.host_bytes > 0
    finally:
        res.close()


def test_file_changed_before_a_deferred_shadow_keeps_the_model(tmp_path: Path, small_q4_path: Path) -> None:
    """The spot check runs when the shadow is made: a file changed after the load refuses the
    release (ModelFileError) and the model stays loaded and answering, bitwise as before."""
    path = _copy(small_q4_path, tmp_path / "m.gguf")
    llm = load(path)
    try:
        greedy = Greedy(llm)
        reference = greedy.run()
        res = Residency.attach(llm, path, ResidencyOptions(mode="inplace", defer_shadow=True))
        info = check_gguf(path)
        with path.open("r+b") as f:  # same size, different weights
            f.seek(info.data_offset + 64)
            f.write(os.urandom(256))
        with pytest.raises(ModelFileError, match="no longer holds the weights"):
            res.release()
        assert res.weights_resident and res.shadow_pending and res.host_bytes == 0
        assert same(greedy.run(), reference)
        res.close()
    finally:
        llm.close()


def _rewrite_keeping_identity(path: Path, offset: int, data: bytes) -> bytes:
    """Overwrite ``data`` at ``offset`` and put the modification time back: the file's identity
    (device, inode, size, mtime) stays, so only a comparison of bytes can see the change. Returns
    the bytes it replaced."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(offset)
        old = f.read(len(data))
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return old


def _last_tensor_offset(res: Residency, path: Path) -> tuple[str, int]:
    """The name and file offset of the readable tensor (not repacked) whose shadow slice is built
    last."""
    ip = res._inplace
    assert ip is not None
    readable = [t for b in ip.buffers if not b.buft_name.endswith("_REPACK") for t in b.tensors]
    t = max(readable, key=lambda t: t.shadow_offset)
    info = check_gguf(path)
    meta = _ggml.gguf_open_meta(str(path))
    try:
        tid = int(_ggml.gguf_find_tensor(meta, t.name.encode()))
        return t.name, info.data_offset + int(_ggml.gguf_get_tensor_offset(meta, tid))
    finally:
        _ggml.gguf_free(meta)


def test_a_release_checks_the_shadow_slices_left_against_the_file(tmp_path: Path, smollm2_path: Path) -> None:
    """A release during a half-built deferred shadow reads none of the slices left, but it does
    compare each of their tensors' first and last bytes with the file: a tensor changed on disk
    (the file's identity kept, so only the bytes tell) refuses the release, and the model stays
    loaded and answering, bitwise."""
    path = _copy(smollm2_path, tmp_path / "m.gguf")  # no repacked tensors: all readable
    llm = load(path)
    try:
        greedy = Greedy(llm)
        reference = greedy.run()
        opts = ResidencyOptions(mode="inplace", defer_shadow=True, shadow_slice_bytes=4 << 20)
        res = Residency.attach(llm, path, opts)
        assert res.fill_shadow(lambda: res.shadow_slices[0] >= 2) is False
        name, offset = _last_tensor_offset(res, path)
        _rewrite_keeping_identity(path, offset, os.urandom(64))
        with pytest.raises(ModelFileError, match=f"tensor {name} differs"):
            res.release()
        assert res.weights_resident and res.shadow_pending and res.shadow_slices[0] == 2
        assert same(greedy.run(), reference)
        res.close()
    finally:
        llm.close()


def test_a_file_changed_after_a_release_refuses_the_rest_of_the_shadow_and_keeps_it(
    tmp_path: Path, small_q4_path: Path
) -> None:
    """After a release with the shadow half built, the slices left come from the file: written
    to since (its modification time moved), it is refused (ModelFileChangedError) by the idle
    build and by the restore, and the model stays released with what was built; the same file
    back (bytes and identity) lets the restore finish the shadow, bitwise."""
    path = _copy(small_q4_path, tmp_path / "m.gguf")
    llm = load(path)
    try:
        greedy = Greedy(llm)
        reference = greedy.run()
        opts = ResidencyOptions(mode="inplace", defer_shadow=True, shadow_slice_bytes=64 << 10)
        res = Residency.attach(llm, path, opts)
        assert res.fill_shadow(lambda: res.shadow_slices[0] >= 2) is False
        res.release()
        st = path.stat()
        _name, offset = _last_tensor_offset(res, path)
        old = _rewrite_keeping_identity(path, offset, os.urandom(64))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(ModelFileChangedError, match="was replaced or modified"):
            res.fill_shadow()
        assert res.shadow_pending and res.shadow_slices[0] == 2  # what was built is kept
        with pytest.raises(ModelFileChangedError):
            res.restore()
        assert not res.weights_resident and res.shadow_pending
        _rewrite_keeping_identity(path, offset, old)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        res.restore()
        assert not res.shadow_pending and same(greedy.run(), reference)
        res.close()
    finally:
        llm.close()


def _shadow_bytes(res: Residency) -> dict[str, bytes]:
    """Every released tensor's bytes in the host shadow, by name."""
    ip = res._inplace
    assert ip is not None
    return {t.name: bytes(ip.shadow.view(t.shadow_offset, t.nbytes)) for b in ip.buffers for t in b.tensors}


def test_a_deferred_shadow_in_slices_stops_between_them_and_a_release_builds_the_rest(
    small_q4: llama_cpp.Llama, small_q4_path: Path
) -> None:
    """The slices of a deferred shadow (issue 29: the other model's request must not wait for a
    whole shadow): ``stop`` is asked after each slice; a stopped build leaves the shadow pending
    and the model answering; the release builds only the slices left, then releases. The
    shadow's bytes are those of a shadow made at attach (one slice per buffer), and the model
    comes back bitwise."""
    greedy = Greedy(small_q4)
    reference = greedy.run()
    slice_bytes = 64 << 10
    opts = ResidencyOptions(mode="inplace", defer_shadow=True, shadow_slice_bytes=slice_bytes)
    res = Residency.attach(small_q4, small_q4_path, opts)
    try:
        assert res.shadow_pending and res.shadow_slices == (0, 0)
        asked = []

        def stop() -> bool:
            asked.append(res.shadow_slices[0])
            return len(asked) == 3

        assert res.fill_shadow(stop) is False  # stopped after its third slice
        built, total = res.shadow_slices
        assert asked == [1, 2, 3] and built == 3
        assert total >= 8, f"a {res.weight_bytes} B model in {slice_bytes} B slices makes {total}"
        assert res.shadow_pending and res.host_bytes == 0
        assert same(greedy.run(), reference)  # the model answers with its shadow half made
        assert res.fill_shadow(lambda: True) is False  # one more slice, then stopped again
        assert res.shadow_slices == (4, total)
        res.release()  # reads none of the slices left: checks them against the file
        assert not res.weights_resident and res.shadow_pending
        assert res.shadow_slices == (4, total) and res.host_bytes == 0
        assert res.fill_shadow(lambda: True) is False  # released: a slice from the file alone
        assert res.shadow_slices == (5, total)
        assert res.fill_shadow() is True  # the rest
        assert res.shadow_slices == (total, total) and not res.shadow_pending
        assert res.host_parts == total and res.host_bytes > 0  # one host allocation per slice
        ip = res._inplace
        assert ip is not None and ip.host_shadow.verified_tensors == _readable_tensors(res) > 0  # each once
        res.restore()
        assert same(greedy.run(), reference), "logits differ after a shadow built in slices"
        sliced = _shadow_bytes(res)
    finally:
        res.close()
    whole = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace"))
    try:
        assert whole.shadow_slices[0] == 1 and whole.host_parts < total
        assert _shadow_bytes(whole) == sliced  # the same bytes, only in more allocations
    finally:
        whole.close()
