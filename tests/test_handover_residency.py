"""The hand-over in the residency (issue 40), on the CPU build with real llama-cpp-python: a
restore maps chunks another release handed over instead of allocating, the model's CPU weight
buffer pointed at them (the memfd stand-in, ``MemfdDevice``, plays the device: named as such; the
CUDA path is proven on the GPU, scripts/lab/handover_gpu.sh). Bitwise against the logits before
the first release, every time."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import llama_cpp  # before numpy
import pytest
from _handover_util import Worker, alive, close_clients, observer, wait_for
from _residency_util import Greedy, load, same
from timeshare.core.residency import Residency, ResidencyOptions

MODEL = str(Path(__file__).with_name("_handover_model.py"))
CHUNK = 8 << 20


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    close_clients()


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "unmapped"])
def test_restores_map_handed_memory_and_stay_bitwise(
    smol: llama_cpp.Llama, smollm2_path: Path, tmp_path: Path, keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release keeps its mappings (the next restore maps nothing), or, with
    $TIMESHARE_HANDOVER_KEEP=0, unmaps and hands the chunks back (the next restore maps them)."""
    monkeypatch.setenv("TIMESHARE_HANDOVER_KEEP", "1" if keep else "0")
    greedy = Greedy(smol)
    reference = greedy.run()
    holder = observer(tmp_path / "arena", chunk=CHUNK)
    client = observer(tmp_path / "arena")
    res = Residency.attach(smol, smollm2_path, ResidencyOptions(handover=True), chunk_source=client)
    assert res.path == "inplace" and res.handover_note == ""
    assert res.handover["device"] == "memfd (CPU stand-in)"
    chunk = int(res.handover["chunk_bytes"])  # type: ignore[call-overload]
    n = -(-res.weight_bytes // chunk)
    res.release()  # the model's own buffer: freed through ggml (it was never handed memory)
    assert holder.status()["chunks"] == 0
    report = res.restore()
    steps = res.restore_steps
    assert (steps.handed_chunks, steps.created_chunks) == (0, n)  # nothing on hand: allocated
    assert report.addresses_moved is True
    assert same(reference, greedy.run())
    first_address = res.handover["mapped_bytes"]
    maps = res.handover["maps"]
    for _ in range(3):
        res.release()
        st = holder.status()
        assert st["lent_bytes"] == 0  # handed back, not freed: kept mapped, or on hand
        assert (st["kept_bytes"], st["on_hand_bytes"]) == ((n * chunk, 0) if keep else (0, n * chunk))
        assert res.handover["kept_bytes"] == (n * chunk if keep else 0)
        report = res.restore()
        steps = res.restore_steps
        assert steps.created_chunks == 0  # the same memory: no allocation
        if keep:  # still mapped: nothing taken, nothing mapped
            assert (steps.handed_chunks, steps.kept_chunks, steps.mapped_chunks) == (0, n, 0)
        else:
            assert (steps.handed_chunks, steps.kept_chunks, steps.mapped_chunks) == (n, 0, n)
        assert report.addresses_moved is False  # the range reserved once: graphs kept
        assert same(reference, greedy.run())
    assert res.handover["creates"] == n and res.handover["mapped_bytes"] == first_address
    assert res.handover["maps"] == maps + (0 if keep else 3 * n)
    res.close()  # the weights move back into memory ggml allocates; the chunks are closed
    assert same(reference, greedy.run())
    st = holder.status()
    assert st["chunks"] == 0 and st["closed"] == {"drop": n}


def test_a_buffer_type_that_repacks_keeps_the_alloc_path(small_q4_path: Path, tmp_path: Path) -> None:
    llm = load(small_q4_path)
    try:
        greedy = Greedy(llm)
        reference = greedy.run()
        res = Residency.attach(llm, small_q4_path, ResidencyOptions(handover=True), chunk_source=None)
        assert res.path == "inplace"
        assert "CPU_REPACK buffers are not plain memory" in res.handover_note
        assert res.handover["on"] is False
        res.release()
        res.restore()
        assert same(reference, greedy.run())
        res.close()
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("keep", "lazy"),
    [("1", False), ("", False), ("", True)],
    ids=["kept-asked-back", "auto-given-back", "auto-given-back-unmapped-after"],
)
def test_two_model_processes_switch_on_the_same_memory(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: str, lazy: bool
) -> None:
    """No room on the card: each restore takes the other's memory. Kept at each release
    ($TIMESHARE_HANDOVER_KEEP=1), it is asked back from the other at each restore; with the
    default (auto), each release gives it back at once: on hand, nothing asked back (and with
    $TIMESHARE_HANDOVER_LAZY_UNMAP=1 unmapped after the release returned: the same answers)."""
    monkeypatch.setenv("TIMESHARE_HANDOVER_ROOM", "0")
    monkeypatch.setenv("TIMESHARE_HANDOVER_LAZY_UNMAP", "1" if lazy else "0")
    if keep:
        monkeypatch.setenv("TIMESHARE_HANDOVER_KEEP", keep)
    else:
        monkeypatch.delenv("TIMESHARE_HANDOVER_KEEP", raising=False)
    arena = tmp_path / "arena"
    tag = secrets.token_hex(4)
    holder = observer(arena, chunk=CHUNK)
    holder_pid = holder.status()["pid"]
    a = Worker(arena, tag, MODEL, str(smollm2_path))
    b = Worker(arena, tag, MODEL, str(smollm2_path))
    try:
        a("release")
        b("release")  # both released their own (ggml) memory: nothing on hand
        first = a("restore").split()
        n = int(first[2])
        assert first[:2] == ["ok", "0"] and n > 0  # allocated: the arena had nothing
        assert a("check") == "ok"
        for i in range(3):  # alternating switches allocate nothing
            a("release")
            # B's first restore from handed memory moves its buffer into its reserved range
            assert b("restore") == f"ok {n} 0 {i == 0} {n}"
            assert b("check") == "ok"
            b("release")
            assert a("restore") == f"ok {n} 0 False {n}"
            assert a("check") == "ok"
        st = holder.status()
        assert st["by_pid"] == {str(a.pid): n}
        assert st["asked_back"] == st["released"] == (6 * n if keep else 0), st
    finally:
        a.end()
        b.end()
    close_clients()
    wait_for("the holder exits with nothing left to hold", lambda: not alive(holder_pid))


def test_two_model_processes_with_room_keep_their_own_and_map_nothing(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """Room on the card: each keeps its own chunks mapped; the alternating switch maps nothing
    and allocates nothing once each has restored once."""
    arena = tmp_path / "arena"
    tag = secrets.token_hex(4)
    holder = observer(arena, chunk=CHUNK)
    holder_pid = holder.status()["pid"]
    a = Worker(arena, tag, MODEL, str(smollm2_path))
    b = Worker(arena, tag, MODEL, str(smollm2_path))
    try:
        a("release")
        b("release")
        n = int(a("restore").split()[2])
        a("release")
        assert b("restore") == f"ok 0 {n} True {n}"  # allocated its own: A's stay kept
        b("release")
        for _ in range(3):
            assert a("restore") == "ok 0 0 False 0"
            assert a("check") == "ok"
            a("release")
            assert b("restore") == "ok 0 0 False 0"
            assert b("check") == "ok"
            b("release")
        st = holder.status()
        assert st["adopted"] == 2 * n and st["reused"] == 6 * n and st["asked_back"] == 0
    finally:
        a.end()
        b.end()
    close_clients()
    wait_for("the holder exits with nothing left to hold", lambda: not alive(holder_pid))


def test_doctor_reports_the_hand_over(smollm2_path: Path) -> None:
    from timeshare.core.diagnostics.doctor import run_doctor

    report = run_doctor(str(smollm2_path), 2, handover=True)
    assert report["bitwise_identical"] and report["kv_level_bitwise_identical"]
    h = report["handover"]
    assert h["on"] is True and h["device"] == "memfd (CPU stand-in)" and h["note"] == ""
    n = -(-report["weight_bytes"] // h["chunk_bytes"])
    # three restores (two cycles and the KV level): the first allocates, the others find their
    # chunks still mapped (kept since the release: nothing handed over, nothing mapped)
    assert (h["created_chunks"], h["handed_chunks"], h["creates"]) == (n, 0, n)
    assert (h["reused_chunks"], h["maps"]) == (2 * n, n)
    assert [s["restore"].get("created_chunks") for s in report["steps"]] == [n, 0]
    assert [s["restore"].get("mapped_chunks") for s in report["steps"]] == [n, 0]
    assert h["holder"]["adopted"] == n
    off = run_doctor(str(smollm2_path), 1)["handover"]
    assert off["on"] is False and off["possible"] is True and "not asked for" in off["note"]


def test_a_projector_maps_the_models_handed_memory(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vision projector (generated) maps its buffer from its model's handed-over memory: with
    room, a release keeps both, a restore (and the projector's, once a decode is over) uploads
    neither, an image answers bitwise as before; close gives the projector's buffer back first
    (the model's memory stays whole until the model's close) and leaves no chunk at the holder."""
    from _vision_util import alone, ask, png, projector_for
    from timeshare.core.config.schema import ModelConfig
    from timeshare.core.worker.engine import Engine

    monkeypatch.delenv("TIMESHARE_HANDOVER_KEEP", raising=False)  # the default (auto): room here
    holder = observer(tmp_path / "arena", chunk=CHUNK)
    client = observer(tmp_path / "arena")
    proj = projector_for(smollm2_path, tmp_path)
    engine = Engine.load(
        ModelConfig(id="v", path=str(smollm2_path), n_ctx=512, mmproj=str(proj)), use_mmap=False
    )
    res = Residency.attach(
        engine.llm,
        str(smollm2_path),
        ResidencyOptions(handover=True, host_shadow="pageable"),
        chunk_source=client,
    )
    red = png((255, 0, 0))
    try:
        assert engine.vision is not None and res.handover_note == ""
        assert res.attach_projector(engine.vision.watch, proj), res.projector_note
        engine.vision.ready = res.projector_ready
        before = alone(engine, messages=(ask(red),), max_tokens=8)
        for cycle in range(3):
            res.release()
            res.restore()
            res.settle(decoded=True)  # (as after the first decode) the projector's restore starts
            res.projector_ready()
            steps = res.restore_steps
            if cycle:  # from the second: both were kept with their bytes, nothing uploaded
                assert steps.uploaded_bytes == 0 and steps.intact_chunks > 0, steps
            engine.vision.forget_encoded()
            after = alone(engine, messages=(ask(red),), max_tokens=8)
            assert after.logprobs == before.logprobs and after.text == before.text
        proj_ip = res._inpath.projector.ip if res._inpath and res._inpath.projector else None
        assert proj_ip is not None and proj_ip.handover.handed is not None
        assert proj_ip.handover.skipped_bytes > 0  # the projector's restores skipped its upload too
        padding = res.handover["lease_padding_bytes"]
        assert res.resident_lease_bytes == res.resident_bytes + padding  # both buffers' last chunks
    finally:
        res.close()
        engine.close()
    st = holder.status()
    assert st["chunks"] == 0 and st["lent_bytes"] == 0, st
