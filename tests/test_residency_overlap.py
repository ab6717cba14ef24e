"""Overlapped restore (issue 28, item 2) on the CPU build, with real models: ``restore()`` returns
once the released parts are allocated, the parts upload in layer order on the upload thread, and
the first decode after it waits (the upload gate, an eval callback installed for that decode) at
the first node that reads a part still on its way.

Oracles: the raw logits bytes of 8 greedy decode steps replayed from the same KV prefix, taken
before the residency was attached (the weights never released); the gate's own counters (how
often it was called and waited); the context's cparams field the hook writes (read through the
layout the attach-time probe found). Slow uploads are made by wrapping ``_ggml.tensor_set`` on
the upload thread (the only way to hold a copy back on demand): the wrapper lets part 0's copy
go only once the gate has been called, so the decode must reach a part that is not there yet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp  # before numpy
import pytest
from _residency_util import Greedy, load, make_small_q4_0, same
from timeshare.core.errors import OutOfDeviceMemoryError, ResidencyError
from timeshare.core.residency import Residency, ResidencyOptions, _ggml
from timeshare.core.residency.gate import PartGate
from timeshare.core.residency.overlap import OVERLAP_ENV


@pytest.fixture(scope="module")
def q4_8_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """Random Q4_0 weights in 8 Llama layers: CPU_REPACK (per-tensor uploads) beside plain CPU."""
    return make_small_q4_0(tmp_path_factory.mktemp("synthetic") / "q4_0-8.gguf", smollm2_path, n_layers=8)


def _attach(llm: llama_cpp.Llama, path: Path, parts: int = 8, **kw: Any) -> Residency:
    res = Residency.attach(
        llm, path, ResidencyOptions(mode="inplace", parts=parts, overlap_restore=True, **kw)
    )
    assert res.overlap_available, res.overlap_note
    return res


def _gate(res: Residency) -> PartGate:
    ip = res._inplace
    assert ip is not None and ip.uploads.gate is not None
    return ip.uploads.gate


def _hook_installed(res: Residency, llm: llama_cpp.Llama) -> bool:
    """The context's cparams.cb_eval as the hook layout locates it (non-null: a callback set)."""
    ip = res._inplace
    assert ip is not None and ip.hook is not None
    cparams = int(_ggml.ctx_get_cparams(llm.ctx) or 0)
    return _ggml.read_ptr(cparams + ip.hook.cb_eval) != 0


Hold = Callable[[Callable[[], bool] | None], None]


@pytest.fixture
def held_uploads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hold]:
    """``hold(go)``: from now on each copy of the upload thread waits until ``go()`` is true (and
    then a little more); ``hold(None)``: copies run freely again."""
    real = _ggml.tensor_set
    state: dict[str, Callable[[], bool] | None] = {"go": None}

    def slow_set(tensor: int, data: int, offset: int, size: int) -> None:
        go = state["go"]
        if go is not None and threading.current_thread().name.startswith("residency-upload"):
            deadline = time.monotonic() + 60.0  # a safety net only
            while not go() and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.002)
        real(tensor, data, offset, size)

    monkeypatch.setattr(_ggml, "tensor_set", slow_set)

    def hold(go: Callable[[], bool] | None) -> None:
        state["go"] = go

    yield hold
    state["go"] = None


def _gate_called(res: Residency) -> Callable[[], bool]:
    """True once the current overlapped restore's gate has been called."""
    ip = res._inplace
    assert ip is not None

    def go() -> bool:
        gate = ip.uploads.gate
        return gate is None or gate.stats.calls > 0

    return go


def _overlapped_cycle(
    res: Residency, llm: llama_cpp.Llama, greedy: Greedy, ref: list[Any], keep: int | None = None
) -> PartGate:
    """Release (down to ``keep``), restore overlapped, replay, settle; checks the report, the
    output and that the gate ran and is gone afterwards. Returns the gate."""
    released = res.release(keep_bytes=keep).released_bytes
    rst = res.restore()
    # uploading since the first part's allocation: some may be in already, and none comes back
    assert rst.overlapped and _gate(res).pending_bytes <= rst.pending_bytes <= released
    # the tensors' bytes of the released parts (the report counts what this restore uploads)
    assert rst.bytes <= released
    gate = _gate(res)
    assert _hook_installed(res, llm)
    out = greedy.run()
    res.settle()
    assert same(out, ref)
    assert gate.stats.calls > 0, "uploads were pending and the gate never ran"
    assert gate.left == 0
    assert not _hook_installed(res, llm) and not res.uploads_pending
    calls = gate.stats.calls
    assert same(greedy.run(), ref)
    assert gate.stats.calls == calls  # no callback on the decodes after the first
    return gate


def test_overlapped_restore_smollm2_bitwise(smollm2_path: Path) -> None:
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        assert same(greedy.run(), ref)
        for _ in range(2):  # all parts
            _overlapped_cycle(res, llm, greedy, ref)
        # a partial release: only the released parts upload, and the gate knows only those
        parts = res.parts()
        keep = sum(p.bytes for p in parts[:5])
        gate = _overlapped_cycle(res, llm, greedy, ref, keep=keep)
        assert set(gate._events) == {5, 6, 7}
        res.close()
    finally:
        llm.close()


def test_overlapped_restore_gemma3_bitwise(gemma3_path: Path) -> None:
    llm = load(gemma3_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, gemma3_path)
        _overlapped_cycle(res, llm, greedy, ref)
        _overlapped_cycle(res, llm, greedy, ref, keep=sum(p.bytes for p in res.parts()[:1]))
        res.close()
    finally:
        llm.close()


@pytest.mark.parametrize("coalesce", [True, False], ids=["one-copy", "per-tensor"])
def test_overlapped_restore_repacked_q4_0_bitwise(q4_8_path: Path, coalesce: bool) -> None:
    llm = load(q4_8_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, q4_8_path, parts=4, coalesce_upload=coalesce)
        _overlapped_cycle(res, llm, greedy, ref)
        res.close()
    finally:
        llm.close()


def test_the_gate_waits_for_slow_uploads(smollm2_path: Path, held_uploads: Hold) -> None:
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        for _ in range(2):
            res.release()
            held_uploads(_gate_called(res))  # no copy before the decode has reached the gate
            rst = res.restore()
            assert rst.overlapped
            gate = _gate(res)
            out = greedy.run()
            res.settle()
            held_uploads(None)
            assert same(out, ref)
            st = gate.stats
            assert st.waits >= 1 and 0 in st.waited_parts  # part 0 could not be there at the first node
            assert st.pending_bytes_at_start == rst.pending_bytes  # nothing was in at the first node
            assert res.last_overlap.gate_waits == st.waits
            assert same(greedy.run(), ref)
        res.close()
    finally:
        llm.close()


@pytest.mark.parametrize("keep_parts", [None, 3], ids=["all", "partial"])
def test_release_right_after_an_overlapped_restore(
    smollm2_path: Path, held_uploads: Hold, keep_parts: int | None
) -> None:
    """A release before the first decode, while the uploads are held back: it waits for them
    (every part in before anything is freed), then releases; the model restores and decodes
    bitwise afterwards."""
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        parts = res.parts()
        keep = None if keep_parts is None else sum(p.bytes for p in parts[:keep_parts])
        for _ in range(2):
            res.release()
            let_go = threading.Event()
            held_uploads(let_go.is_set)
            rst = res.restore()
            assert rst.overlapped and res.uploads_pending
            gate = _gate(res)
            assert gate.left == len(gate._events)  # none is in yet
            threading.Timer(0.05, let_go.set).start()
            rel = res.release(keep_bytes=keep)
            held_uploads(None)
            assert gate.left == 0 and gate.stats.calls == 0  # all uploaded, no decode ran
            assert not res.uploads_pending
            assert rel.resident_bytes == (0 if keep is None else keep) == res.resident_bytes
            res.restore()
            assert same(greedy.run(), ref)
            res.settle()
        res.close()
    finally:
        llm.close()


def test_kv_release_then_overlapped_restore(smollm2_path: Path) -> None:
    """A release of the weights and the context (KV snapshot): the restore makes a new context
    and the gate goes into that one."""
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        res.release(kv=True)
        rst = res.restore()
        assert rst.overlapped and _hook_installed(res, llm)
        out = greedy.run()
        res.settle()
        assert same(out, ref) and not _hook_installed(res, llm)
        res.close()
    finally:
        llm.close()


def test_synchronous_restore_has_no_gate(smollm2_path: Path) -> None:
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        res.release()
        rst = res.restore(overlap=False)
        assert not rst.overlapped and rst.pending_bytes == 0 and not res.uploads_pending
        assert not _hook_installed(res, llm)
        steps = res.restore_steps
        assert steps.buffers == 8 and steps.copy_ms and steps.total_ms and steps.alloc_ms is not None
        assert steps.copy_ms > 0 and steps.total_ms >= steps.alloc_ms
        assert same(greedy.run(), ref)
        res.close()
    finally:
        llm.close()


def test_auto_is_off_on_the_cpu_build(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """None (the default) leaves it off on a CPU build (measured slower there), the variable
    overrides the option both ways, and one part has nothing to overlap."""
    llm = load(smollm2_path)
    try:
        res = Residency.attach(llm, smollm2_path, ResidencyOptions(mode="inplace", parts=8))
        assert not res.overlap_available and "CPU build" in res.overlap_note
        res.release()
        assert not res.restore().overlapped
        res.close()
        monkeypatch.setenv(OVERLAP_ENV, "1")
        res = Residency.attach(llm, smollm2_path, ResidencyOptions(mode="inplace", parts=8))
        assert res.overlap_available
        res.close()
        monkeypatch.setenv(OVERLAP_ENV, "0")
        res = Residency.attach(
            llm, smollm2_path, ResidencyOptions(mode="inplace", parts=8, overlap_restore=True)
        )
        assert not res.overlap_available and OVERLAP_ENV in res.overlap_note
        res.close()
        monkeypatch.delenv(OVERLAP_ENV)
        res = Residency.attach(llm, smollm2_path, ResidencyOptions(mode="inplace", overlap_restore=True))
        assert not res.overlap_available and "one layer part" in res.overlap_note
        res.release()
        assert not res.restore().overlapped
        res.close()
    finally:
        llm.close()


def test_split_at_the_first_release(smollm2_path: Path) -> None:
    """``split_at_release`` (a one-model budget's parts): attach moves nothing and may defer the
    shadow; the first release frees the model's own buffers whole (RSS drops by them), the next
    restore allocates the parts (overlapped) and decodes bitwise; partial releases work after it."""
    from _proc_util import rss_of
    from timeshare.core.residency import hostmem

    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = Residency.attach(
            llm,
            smollm2_path,
            ResidencyOptions(
                mode="inplace", parts=8, overlap_restore=True, split_at_release=True, defer_shadow=True
            ),
        )
        ip = res._inplace
        assert ip is not None and ip.split_pending and res.shadow_pending
        assert res.weights_resident and not res.partly_resident and res.resident_bytes == res.weight_bytes
        assert all(p.resident for p in res.parts()) and len(res.parts()) == 8
        assert same(greedy.run(), ref)  # nothing moved at attach
        assert res.fill_shadow()  # (else the restore would build it; its memory would hide the drop)
        hostmem.trim_heap()
        before = rss_of()
        rel = res.release(keep_bytes=res.weight_bytes // 2)  # the first release is whole
        hostmem.trim_heap()
        assert not ip.split_pending and rel.resident_bytes == 0 == res.resident_bytes
        assert not any(p.resident for p in res.parts())
        assert before - rss_of() > 0.9 * sum(o.size for o in ip.originals)
        rst = res.restore()
        assert rst.overlapped and rst.addresses_moved
        out = greedy.run()
        res.settle()
        assert same(out, ref)
        _overlapped_cycle(res, llm, greedy, ref, keep=sum(p.bytes for p in res.parts()[:4]))
        res.close()
    finally:
        llm.close()


def test_split_at_release_never_released(smollm2_path: Path) -> None:
    """A model closed before its first release: no part buffer was ever made."""
    llm = load(smollm2_path)
    res = Residency.attach(
        llm, smollm2_path, ResidencyOptions(mode="inplace", parts=8, split_at_release=True)
    )
    ip = res._inplace
    assert ip is not None and ip.split_pending and ip.part_buffers() == []
    res.close()
    llm.close()


def test_workers_switch_with_overlapped_restores(
    smollm2_path: Path, gemma3_path: Path, tmp_path: Path, handles: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two real workers alternating under the one-model budget with overlapped restores forced on
    (as a CUDA build has them): each holds its weight parts (split at its first release), every
    switched turn restores overlapped, and every answer equals the model's first one."""
    from _e_worker_util import WorkerHandle
    from timeshare.core.config.schema import ArenaConfig, ModelConfig
    from timeshare.core.sampling import Sampling
    from timeshare.core.wire import protocol as p

    monkeypatch.setenv(OVERLAP_ENV, "1")
    arena_dir = tmp_path / "arena"
    arena_dir.mkdir(mode=0o700)
    arena = ArenaConfig(min_quantum_ms=50.0, wait_timeout_s=120.0)
    workers = {}
    for mid, path in (("smol", smollm2_path), ("gemma", gemma3_path)):
        w = WorkerHandle(
            ModelConfig(id=mid, path=str(path), n_ctx=256), tmp_path / mid, arena_dir=arena_dir, arena=arena
        )
        handles.append(w)
        w.ready()
        workers[mid] = w
    sampling = Sampling(max_tokens=8)
    refs = {}
    for mid, w in workers.items():
        refs[mid], done = w.generate(f"{mid}0", prompt="The capital of France is", sampling=sampling)
        assert isinstance(done, p.Done)
    for i in range(1, 3):
        for mid, w in workers.items():
            text, done = w.generate(f"{mid}{i}", prompt="The capital of France is", sampling=sampling)
            assert isinstance(done, p.Done) and done.switch.switched and text == refs[mid], (mid, i)
    for mid, w in workers.items():
        log = w.log_text()
        assert "overlapped restore on" in log, log[-2000:]
        assert log.count("overlapped (") >= 2, (mid, log[-2000:])


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_uploads_start_while_later_parts_allocate(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """The copy engine starts after the first part's allocation, not after the last one's: the
    last part's allocation is held until a copy has begun on the upload thread (which never
    happens before it if the uploads start only once ``restore()`` returns); ``restore_steps``
    then shows the first copy starting before the allocations were over, and the output is
    bitwise."""
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        n_parts = len(res.parts())
        real_alloc, real_set = _ggml.buft_alloc_buffer, _ggml.tensor_set
        copying = threading.Event()
        seen = {"big": 0, "copy_before_last_alloc": False}

        def alloc(buft: int, size: int) -> int | None:
            if size > 1 << 20:  # a part's buffer (placeholders and probes are tiny)
                seen["big"] += 1
                if seen["big"] == n_parts:  # the last part: wait for a copy already running
                    seen["copy_before_last_alloc"] = copying.wait(timeout=30.0)
            return real_alloc(buft, size)

        def upload(tensor: int, data: int, offset: int, size: int) -> None:
            if threading.current_thread().name.startswith("residency-upload"):
                copying.set()
            real_set(tensor, data, offset, size)

        for _ in range(2):
            res.release()
            seen["big"], seen["copy_before_last_alloc"] = 0, False
            copying.clear()
            monkeypatch.setattr(_ggml, "buft_alloc_buffer", alloc)
            monkeypatch.setattr(_ggml, "tensor_set", upload)
            try:
                rst = res.restore(overlap=overlap)
                out = greedy.run()
            finally:
                res.settle()  # the uploads are over before anything can close the model
                monkeypatch.setattr(_ggml, "buft_alloc_buffer", real_alloc)
                monkeypatch.setattr(_ggml, "tensor_set", real_set)
            assert rst.overlapped == overlap
            assert seen["big"] == n_parts and seen["copy_before_last_alloc"]
            assert same(out, ref)
            steps = res.restore_steps
            s = steps.as_dict()
            assert steps.parts == n_parts
            assert 0.0 <= s["first_alloc_ms"] <= s["first_upload_at_ms"] < s["alloc_ms"]
            assert s["upload_gaps_ms"] >= 0.0 and s["copy_ms"] <= s["upload_wall_ms"] + 1e-6
            if overlap:
                assert res.last_overlap.first_upload_at_ms == steps.first_upload_at_ms
                assert res.last_overlap.first_node_at_ms >= s["returned_ms"] > 0.0
        res.close()
    finally:
        llm.close()


@pytest.mark.parametrize("keep_parts", [None, 5], ids=["all", "partial"])
def test_out_of_memory_during_an_overlapped_restore(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, keep_parts: int | None
) -> None:
    """An allocation refused at the third part of an overlapped restore (the first two already
    uploading): OutOfDeviceMemoryError, the model exactly as released as before (the same parts,
    the same resident bytes: a lease stays exact), no gate installed, no upload pending, no
    decode possible; the next restore is overlapped again and bitwise."""
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        parts = res.parts()
        keep = None if keep_parts is None else sum(p.bytes for p in parts[:keep_parts])
        real = _ggml.buft_alloc_buffer
        calls = {"big": 0}

        def failing(buft: int, size: int) -> int | None:
            if size > 1 << 20:
                calls["big"] += 1
                if calls["big"] > 2:
                    return None
            return real(buft, size)

        for _ in range(2):
            res.release(keep_bytes=keep)
            before = ([p.resident for p in res.parts()], res.resident_bytes)
            assert before[1] == (0 if keep is None else keep)
            calls["big"] = 0
            monkeypatch.setattr(_ggml, "buft_alloc_buffer", failing)
            with pytest.raises(OutOfDeviceMemoryError, match="stays released"):
                res.restore(overlap=True)
            monkeypatch.setattr(_ggml, "buft_alloc_buffer", real)
            assert calls["big"] == 3
            assert ([p.resident for p in res.parts()], res.resident_bytes) == before
            assert not res.uploads_pending  # nor a gated context
            ip = res._inplace
            assert ip is not None and ip.uploads.gate is None
            with pytest.raises(ResidencyError):
                llm.eval([1])
            rst = res.restore()
            assert rst.overlapped
            out = greedy.run()
            res.settle()
            assert same(out, ref) and res.resident_bytes == res.weight_bytes
        res.close()
    finally:
        llm.close()


def test_each_overlapped_restore_logs_its_timeline(
    smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """settle() logs one line per overlapped restore carrying ``last_overlap``, which bench api
    reads back from the worker logs (worker_log_overlaps); the timeline is in order."""
    import logging

    from timeshare.core.diagnostics.bench_api_procs import worker_log_overlaps

    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        seen: list[dict[str, float]] = []
        with caplog.at_level(logging.INFO, logger="timeshare.core.residency"):
            for keep in (None, res.weight_bytes // 2):
                _overlapped_cycle(res, llm, greedy, ref, keep)
                assert res.last_overlap is not None
                seen.append(res.last_overlap.as_dict())
        res.close()
    finally:
        llm.close()
    got = worker_log_overlaps(caplog.text)
    assert len(got) == 2
    for line, lo in zip(got, seen, strict=True):
        assert line == {k: round(v, 3) for k, v in lo.items()}
        assert line["gate_calls"] > 0
        assert 0.0 < line["first_upload_at_ms"] <= line["last_upload_end_at_ms"]
        assert line["returned_ms"] <= line["first_node_at_ms"]


def test_uploads_over_before_the_restore_returned(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uploads begin with the first part's allocation, so they can all be over before
    ``restore()`` returns (here: the gate's installation waits for that): the restore still
    reports itself overlapped, with 0 bytes pending; the decode runs gated (nothing to wait for)
    and bitwise, and settles clean."""
    from timeshare.core.residency import evalhook

    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        real_install = evalhook.install
        all_in = {"before_install": False}

        def install(ctx: int, layout: evalhook.HookLayout, cb: int, user: int = 0) -> None:
            gate = _gate(res)
            deadline = time.monotonic() + 30.0  # a safety net only
            while gate.left and time.monotonic() < deadline:
                time.sleep(0.001)
            all_in["before_install"] = gate.left == 0
            real_install(ctx, layout, cb, user)

        monkeypatch.setattr(evalhook, "install", install)
        res.release()
        rst = res.restore()
        monkeypatch.setattr(evalhook, "install", real_install)
        assert all_in["before_install"]
        assert rst.overlapped and rst.pending_bytes == 0 and _hook_installed(res, llm)
        gate = _gate(res)
        out = greedy.run()
        res.settle()
        assert same(out, ref)
        assert gate.stats.calls > 0 and gate.stats.waits == 0 and gate.stats.pending_bytes_at_start == -1
        assert not _hook_installed(res, llm) and not res.uploads_pending
        res.close()
    finally:
        llm.close()


def test_the_deep_level_uploads_each_layers_kv_cells_after_its_part(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39, item 2: at the deep level in place the KV cells in use go up on the upload
    thread, each layer's right after the weights of its part (first layers first), and the gate
    waits for them as for the weights: bitwise the same logits."""
    llm = load(smollm2_path)
    try:
        greedy = Greedy(llm)
        ref = greedy.run()
        res = _attach(llm, smollm2_path)
        ip, kvbuf = res._inplace, res._kvl.buffers
        assert ip is not None and kvbuf is not None
        part_of = {t.ptr: p.index for p in ip.parts for b in p.buffers for t in b.tensors}
        layer_of = {t: layer.index for layer in kvbuf.layers for t in (layer.k, layer.v)}
        first = {p.index: p.first_layer for p in ip.parts}
        order: list[tuple[int, str]] = []  # (layer, "weights" | "kv") of each copy of the upload thread
        real_set, real_2d = _ggml.tensor_set, _ggml.tensor_set_2d

        def note(tensor: int) -> None:
            if not threading.current_thread().name.startswith("residency-upload"):
                return
            if tensor in layer_of:
                order.append((layer_of[tensor], "kv"))
            else:
                root = _ggml.view_root(tensor, _ggml.TensorLayout())
                if root in part_of:
                    order.append((first[part_of[root]], "weights"))

        def set_(tensor: int, data: int, offset: int, size: int) -> None:
            note(tensor)
            real_set(tensor, data, offset, size)

        def set_2d(tensor: int, data: int, offset: int, size: int, n: int, st: int, sd: int) -> None:
            note(tensor)
            real_2d(tensor, data, offset, size, n, st, sd)

        llm.n_tokens = greedy.n_prefix
        llm.eval([greedy.tokens[-1]])
        res.release(kv=True)
        assert res.kv_upload_note == "" and not res.kv_resident
        monkeypatch.setattr(_ggml, "tensor_set", set_)
        monkeypatch.setattr(_ggml, "tensor_set_2d", set_2d)
        rst = res.restore()
        assert rst.overlapped
        gate = _gate(res)
        assert all(layer_of.get(t, -1) >= 0 or t in part_of for t in gate._part_of)
        assert any(t in layer_of for t in gate._part_of)  # the KV tensors are gated too
        out = greedy.run()
        res.settle()
        monkeypatch.setattr(_ggml, "tensor_set", real_set)
        monkeypatch.setattr(_ggml, "tensor_set_2d", real_2d)
        assert same(out, ref)
        # every layer's KV cells went up after its part's weights and before the next part's
        kv_layers = [layer for layer, kind in order if kind == "kv"]
        assert sorted(set(kv_layers)) == [layer.index for layer in kvbuf.layers]
        seen_part, kv_seen = -1, set()
        for layer, kind in order:
            if kind == "weights":
                assert layer >= seen_part
                if layer > seen_part:  # a new part: the layers before it have their KV cells
                    assert kv_seen >= set(range(layer)), (layer, sorted(kv_seen))
                seen_part = layer
            else:
                assert layer >= seen_part  # its part's weights (first layer <= it) came first
                kv_seen.add(layer)
        tl = res.last_overlap
        assert tl is not None and tl.kv_bytes > 0 and tl.kv_last_upload_end_at_ms > 0
        assert tl.kv_last_upload_end_at_ms <= tl.last_upload_end_at_ms + 1e-6
        res.close()
    finally:
        llm.close()
