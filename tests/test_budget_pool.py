"""The VRAM budget with real workers on the demo models (CPU build: host memory plays the device):
both resident when they fit, alternation when one fits, three workers contending for a budget of
two, a killed lease holder, a pinned model that leaves no room. Plus the pure pieces the tray and
the status endpoint show."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from _budget_pool_util import GEMMA, SMOL, WAIT, start_pool
from _proc_util import wait_until
from timeshare.app.menu_model import devices_line, tooltip
from timeshare.core.api.handlers import SwitchCounter, status_json
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.dirs import device_arena_dir
from timeshare.core.config.schema import ModelConfig
from timeshare.core.diagnostics.arena_test import run_arena_test
from timeshare.core.diagnostics.budget_check import check_budget, check_memory_budget
from timeshare.core.diagnostics.memwatch import MemSample
from timeshare.core.errors import ConfigError, VramBudgetError
from timeshare.core.observe import read_events
from timeshare.core.pool.devices import device_statuses
from timeshare.core.pool.record import WorkerRecord
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import DeviceStatus, ModelState, ModelStatus, PoolSnapshot
from timeshare.core.worker.device import llama_placement

from timeshare.client import print_status

PROMPT = "The capital of France is"


# ---- pure: what the tray and the status endpoint show, what the checker counts -----------------


def test_tray_and_status_show_the_holders_of_each_device() -> None:
    models = (
        ModelStatus(
            id="a",
            name="Alpha",
            path="/a",
            state=ModelState.RESIDENT,
            holds_gpu=True,
            lease_bytes=4_200_000_000,
        ),
        ModelStatus(
            id="b",
            name="Beta",
            path="/b",
            state=ModelState.RESIDENT,
            holds_gpu=True,
            lease_bytes=4_200_000_000,
        ),
        ModelStatus(id="c", name="Gamma", path="/c", state=ModelState.RELEASED),
    )
    device = DeviceStatus(
        index=0,
        name="CUDA0",
        budget="20GB",
        budget_bytes=20 * 10**9,
        leased_bytes=8_400_000_000,
        holders=("b", "a"),
    )
    snap = PoolSnapshot(models=models, holder="b", devices=(device,))
    assert devices_line(snap) == "2 models on the GPU (8.4 of 20 GB)"
    assert tooltip(snap).startswith("2 models on the GPU (8.4 of 20 GB) · 1 other set aside")
    body = status_json(snap, SwitchCounter())
    assert body["holder"] == "b"  # the most recent holder, for older clients
    assert body["devices"] == [
        {
            "index": 0,
            "name": "CUDA0",
            "budget": "20GB",
            "budget_bytes": 20 * 10**9,
            "leased_bytes": 8_400_000_000,
            "holders": ["b", "a"],
            "note": "",
        }
    ]
    one = PoolSnapshot(models=models[:1], holder="a", devices=(DeviceStatus(0, holders=("a",)),))
    assert devices_line(one) == "" and tooltip(one).startswith("Alpha holds the GPU")


def test_timeshare_status_prints_a_line_per_device() -> None:
    out = io.StringIO()
    device = {"index": 0, "name": "CUDA0", "budget": "20GB", "budget_bytes": 20 * 10**9}
    device |= {"leased_bytes": 8_400_000_000, "holders": ["b", "a"], "note": ""}
    print_status({"holder": "b", "devices": [device], "models": [{"id": "a"}, {"id": "b"}, {"id": "c"}]}, out)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["GPU holder: b", "GPU 0 (CUDA0): budget 20GB = 20.0 GB, 8.4 GB leased by b, a"]
    assert [line.split()[:2] for line in lines[3:]] == [["a", "*"], ["b", "*"], ["c", "?"]]
    one = {"index": 0, "name": "CPU", "budget": "one-model", "budget_bytes": None, "holders": ["a"]}
    out = io.StringIO()
    print_status({"holder": "a", "devices": [one], "models": [{"id": "a"}]}, out)
    assert out.getvalue().splitlines()[1].split()[:2] == ["MODEL", "STATE"]  # the holder says it all


def rec(kind: str, pid: int, start: float, end: float, **extra: object) -> dict[str, object]:
    return {"kind": kind, "model": f"m{pid}", "pid": pid, "start": start, "end": end, **extra}


def test_budget_checker_counts_leases_over_the_budget() -> None:
    ok = [
        rec("token", 1, 0.0, 10.0, bytes=400, budget=1000),
        rec("token", 2, 1.0, 5.0, bytes=600, budget=1000),
        rec("token", 3, 5.0, 9.0, bytes=600, budget=1000),  # after 2 left
    ]
    check = check_budget(ok)
    assert check.violations == 0 and check.max_holders == 2 and check.max_leased_bytes == 1000
    over = [*ok, rec("token", 4, 8.0, 9.5, bytes=100, budget=1000)]
    assert check_budget(over).violations == 1
    # a lease that shrank after its load counts its load bytes until then
    shrunk = [
        rec("token", 1, 0.0, 10.0, bytes=300, budget=1000, load_bytes=1000, shrunk_at=2.0),
        rec("token", 2, 1.0, 3.0, bytes=500, budget=1000),
    ]
    assert check_budget(shrunk).violations == 1
    assert check_budget([shrunk[0], rec("token", 2, 2.0, 3.0, bytes=700, budget=1000)]).violations == 0
    # a lease that a partial release shrank and a request for the rest grew back: each size counts
    # from its moment (sizes: [[at, bytes], ...] from the start)
    resized = rec("token", 1, 0.0, 10.0, bytes=800, budget=1000, sizes=[[0.0, 800], [2.0, 300], [6.0, 800]])
    assert check_budget([resized, rec("token", 2, 2.5, 5.5, bytes=700, budget=1000)]).violations == 0
    assert check_budget([resized, rec("token", 2, 1.5, 5.5, bytes=700, budget=1000)]).violations == 1
    assert check_budget([resized, rec("token", 2, 2.5, 6.5, bytes=700, budget=1000)]).violations == 1
    # a killed holder's resizes (shrunk and resized points) up to the kill
    grown = [
        rec("acquired", 1, 0.0, 0.0, bytes=800, budget=1000),
        rec("shrunk", 1, 2.0, 2.0, bytes=300),
        rec("resized", 1, 6.0, 6.0, bytes=800),
        rec("killed", 1, 8.0, 8.0),
    ]
    assert check_budget([*grown, rec("token", 2, 2.5, 5.5, bytes=700, budget=1000)]).violations == 0
    assert check_budget([*grown, rec("token", 2, 2.5, 7.0, bytes=700, budget=1000)]).violations == 1
    # a holder killed before it released: its acquisition up to the kill
    killed = [
        rec("acquired", 1, 0.0, 0.0, bytes=800, budget=1000),
        rec("killed", 1, 4.0, 4.0),
        rec("token", 2, 3.0, 6.0, bytes=500, budget=1000),
    ]
    assert check_budget(killed).violations == 1
    # one model at a time: any two leases at once
    one = [rec("token", 1, 0.0, 2.0, bytes=5, budget=None), rec("token", 2, 1.0, 3.0, bytes=5, budget=None)]
    assert check_budget(one).violations == 1


def test_memory_budget_check_sums_the_resident_workers() -> None:
    w = {"a": 400, "b": 600, "c": 500}

    def sample(t: float, **high: int) -> MemSample:
        return MemSample(t, tuple((k, 1000 + high.get(k, 0)) for k in w))

    samples = [sample(0.0), sample(1.0, a=400, b=600), sample(2.0, b=600, c=500)]
    check = check_memory_budget(samples, w, 1000)
    assert check.violations == 1 and check.max_resident == 2 and check.max_resident_bytes == 1100
    assert check_memory_budget(samples, w, None).violations == 2  # one model at a time
    # a partly released worker counts what it holds, never more than its weights
    partly = [sample(0.0), sample(1.0, a=400, b=350), sample(2.0, a=900, b=600)]
    check = check_memory_budget(partly, w, 1000)
    assert check.violations == 0 and check.max_resident_bytes == 1000


def test_several_gpus_each_have_their_own_arena_and_line() -> None:
    """No second GPU here: the placement arguments and the per-device views, with stand-in
    numbers (the GPU count is passed in: a mock of two GPUs)."""
    assert llama_placement(1, gpu_count=2) == {"split_mode": 0, "main_gpu": 1}  # LLAMA_SPLIT_MODE_NONE
    assert llama_placement(0, gpu_count=0) == {}  # a CPU build: nothing to place
    base = Path("/run/arena")
    assert device_arena_dir(base, 0) == base and device_arena_dir(base, 2) == base / "device-2"
    workers = []
    for mid, dev, holds, nbytes in (
        ("a", 0, True, 5),
        ("b", 1, True, 7),
        ("c", 1, True, 9),
        ("d", 1, False, 0),
    ):
        w = WorkerRecord(
            config=ModelConfig(id=mid, path="/m.gguf", device=dev), log_path=Path("/l"), pinned=False
        )
        w.gpu_since = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 0.0}[mid]
        workers.append(
            (
                w,
                ModelStatus(
                    id=mid,
                    name=mid,
                    path="/m",
                    state=ModelState.RESIDENT,
                    holds_gpu=holds,
                    lease_bytes=nbytes,
                ),
            )
        )
    devices = device_statuses([w for w, _ in workers], [m for _, m in workers])
    assert [(d.index, d.holders, d.leased_bytes) for d in devices] == [(0, ("a",), 5), (1, ("c", "b"), 16)]
    shown = PoolSnapshot(
        devices=(devices[0], replace(devices[1], budget_bytes=20 * 10**9, leased_bytes=8_400_000_000))
    )
    assert devices_line(shown) == "GPU 1: 2 models (8.4 of 20 GB)"


def test_a_device_that_does_not_exist_is_a_config_error() -> None:
    from timeshare.core.worker.device import device_memory

    with pytest.raises(ConfigError, match="models\\[\\]\\.device = 7"):
        device_memory(7)  # a CPU build has device 0 only; a GPU build names the GPUs it has
    assert device_memory(0).total > 0


def test_the_tools_refuse_a_bad_budget(smollm2_path: Path) -> None:
    for verb in (["arena-test", "--model", str(smollm2_path)], ["bench", "switch"]):
        proc = subprocess.run(
            [sys.executable, "-m", "timeshare", *verb, "--budget", "20 potatoes"],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert proc.returncode == 2 and "'20 potatoes' is not a size" in proc.stderr, (verb, proc.stderr)


# ---- real workers --------------------------------------------------------------------------


def answer(pool: Pool, model: str) -> tuple[str, bool]:
    result = pool.generate(model, prompt=PROMPT, sampling=Sampling(max_tokens=8, temperature=0.0)).result(
        timeout=WAIT
    )
    return result.text, result.switch.switched


def test_a_budget_that_fits_both_keeps_both_resident(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, pools: list[Pool]
) -> None:
    pool = start_pool(tmp_path, smollm2_path, gemma3_path, "2GB")
    pools.append(pool)
    first = {m: answer(pool, m)[0] for m in (SMOL, GEMMA)}  # each takes its lease once
    for model in (SMOL, GEMMA, SMOL, GEMMA):
        text, switched = answer(pool, model)
        assert not switched and text == first[model]
    snap = pool.snapshot()
    (device,) = snap.devices
    assert sorted(device.holders) == [GEMMA, SMOL] and device.budget == "2GB"
    weights = sum(m.weight_bytes for m in snap.models)
    assert device.budget_bytes == 2 * 10**9 and device.leased_bytes == weights > 0
    assert all(m.state is ModelState.RESIDENT and m.holds_gpu for m in snap.models)
    assert snap.holder == GEMMA  # the most recent to take the GPU
    assert check_budget(read_events(tmp_path / "intervals.jsonl")).violations == 0


def test_a_budget_that_fits_one_alternates(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, pools: list[Pool]
) -> None:
    budget = str(os.path.getsize(gemma3_path))  # either model's weights, never both
    pool = start_pool(tmp_path, smollm2_path, gemma3_path, budget)
    pools.append(pool)
    first = {m: answer(pool, m)[0] for m in (SMOL, GEMMA)}
    for model in (SMOL, GEMMA, SMOL, GEMMA):
        text, switched = answer(pool, model)
        assert switched and text == first[model]
        wait_until(
            lambda m=model: pool.snapshot().devices[0].holders == (m,), WAIT, f"{model} alone on the GPU"
        )
    records = read_events(tmp_path / "intervals.jsonl")
    check = check_budget(records)
    assert check.violations == 0 and check.max_holders == 1


def test_pinned_model_leaving_no_room_and_a_killed_lease_holder(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, pools: list[Pool]
) -> None:
    budget = str(os.path.getsize(gemma3_path))
    # no restart meanwhile: the killed worker must not take the GPU back before the check
    pool = start_pool(tmp_path, smollm2_path, gemma3_path, budget, restart_backoff_s=600.0)
    pools.append(pool)
    pool.pin(SMOL)
    answer(pool, SMOL)  # resident and pinned: it never yields
    with pytest.raises(VramBudgetError) as info:  # at once, not after arena.wait_timeout_s
        pool.generate(GEMMA, prompt=PROMPT, sampling=Sampling(max_tokens=8)).result(timeout=WAIT)
    message = str(info.value)
    assert "gemma needs" in message and f"arena.vram_budget = '{budget}'" in message
    assert "pinned smol" in message and "unpin it or raise the budget" in message
    smol = pool.snapshot().model(SMOL)
    assert smol is not None and smol.pid is not None
    os.kill(smol.pid, signal.SIGKILL)  # the kernel drops its lease with the process
    wait_until(lambda: (m := pool.snapshot().model(SMOL)) is not None and m.pid is None, WAIT, "smol's exit")
    text, switched = answer(pool, GEMMA)
    assert text and switched
    assert pool.snapshot().devices[0].holders == (GEMMA,)


def test_three_workers_with_a_budget_of_two(tmp_path: Path, smollm2_path: Path, gemma3_path: Path) -> None:
    # smol, gemma, smol-2: any two fit (the weights are at most the files), all three never do
    budget = str(os.path.getsize(smollm2_path) + os.path.getsize(gemma3_path))
    report = run_arena_test(
        [(SMOL, str(smollm2_path)), (GEMMA, str(gemma3_path))],
        workers=3,
        seconds=8.0,
        work_dir=tmp_path / "work",
        min_quantum_ms=20.0,
        sample_memory_ms=50,
        budget=budget,
    )
    data = report.to_json()
    assert report.budget_violations == 0, data
    assert report.budget_bytes == int(budget), data
    assert report.outputs_match_reference and report.deadlocks == 0 and report.errors == 0, data
    assert all(n > 0 for _, n in report.requests_by_worker), data  # nobody starved
    assert report.max_holders == 2, data  # two resident at once, never three
    assert report.ok, data


def test_an_auto_budget_measures_each_worker_and_keeps_both(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto on a CPU build: host memory is the device. Each worker loads with the device to itself,
    measures what it keeps there while released and holds that as a reserve lease."""
    monkeypatch.delenv("TIMESHARE_VRAM_BUDGET")
    pool = start_pool(tmp_path, smollm2_path, gemma3_path, "auto")
    pools.append(pool)
    for model in (SMOL, GEMMA, SMOL):
        answer(pool, model)
    (device,) = pool.snapshot().devices
    assert device.budget == "auto" and device.name == "CPU" and device.note == ""
    arena = Arena(tmp_path / "arena")
    try:
        record = arena.budget_in_force()
        reserves = [x for x in arena.leases() if x.kind == "reserve"]
    finally:
        arena.close()
    assert record is not None and record.kind == "auto" and record.margin_bytes >= 256 * 2**20
    assert sorted(x.model for x in reserves) == [GEMMA, SMOL]  # each measured itself
    expected = record.bytes - sum(x.bytes for x in reserves)
    wait_until(
        lambda: pool.snapshot().devices[0].budget_bytes == expected, WAIT, "the reserves in the status"
    )
