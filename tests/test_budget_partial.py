"""Partial release under a byte VRAM budget (issue 28) with real workers on the demo models (CPU
build: host memory plays the device): a holder that must make room frees only the layer parts the
other model needs, keeps the rest and its lease of them, and restores only what it lost before it
answers again, with the same greedy output; a pinned model is never partly released; kill -9 of a
partly released holder frees its bytes for the next; three workers contending on such a budget
(``arena-test``). Plus the words the tray and ``timeshare status`` use for it."""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import pytest
from _budget_pool_util import GEMMA, SMOL, WAIT, start_pool
from _proc_util import wait_until
from timeshare.app.menu_model import display_state, model_title
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.budget import compute_budget, parse_budget
from timeshare.core.arena.client import TokenClient
from timeshare.core.diagnostics.arena_test import ArenaHarness, plan_workers
from timeshare.core.diagnostics.budget_check import check_budget
from timeshare.core.errors import VramBudgetError
from timeshare.core.observe import read_events
from timeshare.core.pool.generation import GenerationResult
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState, ModelStatus

from timeshare.client import print_status

PROMPT = "The capital of France is"


# ---- pure: the words -------------------------------------------------------------------------


def test_a_partly_released_model_is_shown_with_its_share() -> None:
    partly = ModelStatus(
        id="a", name="Alpha", path="/a", state=ModelState.RELEASED, holds_gpu=True, resident_fraction=0.623
    )
    assert display_state(partly) == "partly on the GPU (62 %)"
    assert display_state(partly, gpu=False) == "partly in memory (62 %)"
    assert model_title(partly, None, gpu=True) == "Alpha — partly on the GPU (62 %)"
    whole = ModelStatus(id="b", name="B", path="/b", state=ModelState.RELEASED, resident_fraction=0.0)
    assert display_state(whole) == "set aside"  # core/words.py
    almost = ModelStatus(id="c", name="C", path="/c", state=ModelState.RELEASED, resident_fraction=0.999)
    assert display_state(almost) == "partly on the GPU (99 %)"  # never "100 %": it must restore
    waiting = ModelStatus(
        id="d", name="D", path="/d", state=ModelState.RELEASED, busy=True, resident_fraction=0.5
    )
    assert display_state(waiting) == "waiting for the GPU"  # a request waits while it restores what it lost
    out = io.StringIO()
    models = [
        {"id": "a", "state": "released", "resident_fraction": 0.623, "backend": "CUDA0"},
        {"id": "b", "state": "released", "resident_fraction": 0.5, "backend": "CPU"},
        {"id": "c", "state": "resident", "resident_fraction": 1.0, "backend": "CPU"},
    ]
    print_status({"holder": "c", "devices": [], "models": models}, out)
    rows = out.getvalue().splitlines()[2:]
    # one vocabulary per machine (core/words.has_gpu): a GPU anywhere gives the GPU words
    assert "partly on the GPU (62 %)" in rows[0] and "partly on the GPU (50 %)" in rows[1], rows
    cpu_only = io.StringIO()
    print_status({"holder": "c", "devices": [], "models": models[1:]}, cpu_only)
    rows = cpu_only.getvalue().splitlines()[2:]
    assert "partly in memory (50 %)" in rows[0], rows


# ---- real workers --------------------------------------------------------------------------


def answer(pool: Pool, model: str) -> GenerationResult:
    gen = pool.generate(model, prompt=PROMPT, sampling=Sampling(max_tokens=8, temperature=0.0))
    return gen.result(timeout=WAIT)


def model(pool: Pool, model_id: str) -> ModelStatus:
    status = pool.snapshot().model(model_id)
    assert status is not None
    return status


def partly_released(pool: Pool, model_id: str) -> ModelStatus:
    """The model's status once the pool has seen it release part of its weights. Its Released
    report comes on its own pipe, sent after it shrank its lease: the other model may take the room
    and answer (its Done on another pipe) before the pool has read it."""
    wait_until(
        lambda: 0.0 < model(pool, model_id).resident_fraction < 1.0,
        WAIT,
        f"{model_id}'s partial release report",
    )
    return model(pool, model_id)


def partial_budget(smollm2: Path, gemma3: Path) -> str:
    """Gemma's weights and about half of SmolLM2's: either fits whole, never both (the weights
    are a little less than their files)."""
    return str(os.path.getsize(gemma3) + os.path.getsize(smollm2) // 2)


def test_a_holder_frees_only_what_the_other_needs_and_restores_only_what_it_lost(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, pools: list[Pool]
) -> None:
    pool = start_pool(tmp_path, smollm2_path, gemma3_path, partial_budget(smollm2_path, gemma3_path))
    pools.append(pool)
    first = {m: answer(pool, m) for m in (SMOL, GEMMA)}  # smol whole, then gemma: smol frees part
    weights = {m: model(pool, m).weight_bytes for m in (SMOL, GEMMA)}
    assert first[GEMMA].switch.restored_bytes == weights[GEMMA]  # it was released whole after its load
    smol = partly_released(pool, SMOL)
    assert smol.state is ModelState.RELEASED and smol.holds_gpu, smol
    assert 0.0 < smol.resident_fraction < 1.0, smol
    # its lease is exactly the weights it keeps on the device (device_bytes adds its KV cache,
    # compute buffers and context, which stay with a released model: status's held())
    held_weights = smol.held()["weights"]
    assert smol.lease_bytes == held_weights == round(smol.resident_fraction * weights[SMOL]), smol
    assert model(pool, GEMMA).resident_fraction == 1.0
    for m in (SMOL, GEMMA, SMOL, GEMMA):
        got = answer(pool, m)
        assert got.text == first[m].text, m  # bitwise after any pattern of partial release/restore
        assert got.switch.switched and 0 < got.switch.restored_bytes < weights[m], (m, got.switch)
        assert got.switch.release_ms > 0, (m, got.switch)  # the other's partial release, with the token
        other = GEMMA if m == SMOL else SMOL
        assert model(pool, m).resident_fraction == 1.0
        assert 0.0 < partly_released(pool, other).resident_fraction < 1.0  # it made room with a part only
    device = pool.snapshot().devices[0]
    assert sorted(device.holders) == [GEMMA, SMOL]  # both keep a lease
    assert device.budget_bytes is not None and device.leased_bytes <= device.budget_bytes
    pool.stop()  # every lease ends: its token interval, with its sizes, is written
    check = check_budget(read_events(tmp_path / "intervals.jsonl"))
    assert check.violations == 0 and check.max_holders == 2, check


def test_a_pinned_model_is_never_partly_released(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, pools: list[Pool]
) -> None:
    pool = start_pool(tmp_path, smollm2_path, gemma3_path, partial_budget(smollm2_path, gemma3_path))
    pools.append(pool)
    pool.pin(SMOL)
    reference = answer(pool, SMOL).text
    with pytest.raises(VramBudgetError, match="pinned smol"):  # at once: the rest never fits
        answer(pool, GEMMA)
    smol = model(pool, SMOL)
    assert smol.state is ModelState.RESIDENT and smol.resident_fraction == 1.0, smol
    assert smol.lease_bytes == smol.weight_bytes
    got = answer(pool, SMOL)
    assert not got.switch.switched and got.text == reference
    pool.pin(SMOL, False)  # now it makes room with part of its layers
    assert answer(pool, GEMMA).text
    assert 0.0 < partly_released(pool, SMOL).resident_fraction < 1.0


def test_kill9_of_a_partly_released_holder_frees_its_bytes_for_the_next(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, pools: list[Pool]
) -> None:
    budget = partial_budget(smollm2_path, gemma3_path)
    # no restart meanwhile: the killed worker must not take its bytes back before the check
    pool = start_pool(tmp_path, smollm2_path, gemma3_path, budget, restart_backoff_s=600.0)
    pools.append(pool)
    for m in (SMOL, GEMMA):
        answer(pool, m)
    smol, gemma = partly_released(pool, SMOL), model(pool, GEMMA)
    assert 0.0 < smol.resident_fraction < 1.0 and smol.pid is not None, smol
    # the next: a request for exactly the room smol's part takes, from another member of the arena
    arena = Arena(tmp_path / "arena")
    wanted = compute_budget(parse_budget(budget), total=1, free=1, pid=os.getpid())
    probe = TokenClient(arena, "probe", budget=wanted)
    try:
        room = int(budget) - gemma.lease_bytes
        os.kill(smol.pid, signal.SIGSTOP)  # so that it cannot make room itself: only its death can
        try:
            req = probe.request(WAIT, need=room)
            wait_until(lambda: "held by smol" in req.waiting_reason(), WAIT, "the probe waiting for smol")
        finally:
            os.kill(smol.pid, signal.SIGKILL)  # the kernel drops its lease's flock with the process
        grant = req.result(WAIT)
        assert grant.bytes == room
        leases = {x.model: x.bytes for x in arena.leases() if x.kind == "weights"}
        assert leases == {GEMMA: gemma.lease_bytes, "probe": room}  # smol's bytes went with it
        assert model(pool, GEMMA).resident_fraction == 1.0  # gemma was never asked for any
        probe.release()
    finally:
        probe.close()
        arena.close()


def test_three_workers_on_a_budget_that_forces_partial_releases(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    # smol, gemma, smol-2: both smols fit whole, gemma fits only beside part of one of them
    budget = str(os.path.getsize(gemma3_path) + os.path.getsize(smollm2_path) * 6 // 10)
    plans = plan_workers(3, [(SMOL, str(smollm2_path)), (GEMMA, str(gemma3_path))])
    harness = ArenaHarness(
        plans,
        work_dir=tmp_path,
        arena_dir=tmp_path / "arena",
        max_tokens=8,
        min_quantum_ms=20.0,
        budget=budget,
    )

    def enough(done: Mapping[str, int]) -> bool:  # every worker answered twice, some after a partial restore
        partial = any(0.0 < f < 1.0 for f in harness.tally.restored_fraction)
        return partial and len(done) == 3 and min(done.values()) >= 2

    try:
        harness.start()
        harness.take_reference()
        harness.contend(240.0, until=enough)  # bounded; a loaded machine is slow, nothing is timed
    finally:
        harness.stop()
    report = harness.report()
    data = report.to_json()
    assert report.budget_violations == 0 and report.max_holders >= 2, data
    assert report.outputs_match_reference and report.deadlocks == 0 and report.errors == 0, data
    assert min(n for _, n in report.requests_by_worker) >= 2, data  # nobody starved
    assert report.partial_restores > 0, data  # some switches moved only what a partial release took
    assert report.ok, data
