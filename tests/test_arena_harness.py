"""The arena-test harness: the checker on hand-made intervals (so it demonstrably fails), and the
harness on real workers and real models: >= 3 workers under random contention, outputs equal to
the uncontended reference, kill -9 of the holder in the middle of a decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _proc_util import ResidencyWatch, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.dirs import read_holder
from timeshare.core.diagnostics.arena_test import (
    ArenaHarness,
    WorkerPlan,
    model_id_for_path,
    plan_workers,
    run_arena_test,
)
from timeshare.core.diagnostics.arena_test_checks import check_intervals, percentile
from timeshare.core.errors import ModelUnavailableError, TokenTimeoutError
from timeshare.core.observe import read_events
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState


def rec(kind: str, pid: int, start: float, end: float, model: str | None = None, **extra: object) -> dict:
    return {"kind": kind, "model": model or f"m{pid}", "pid": pid, "start": start, "end": end, **extra}


# ---- the checker --------------------------------------------------------------------------------


def test_checker_accepts_a_clean_history() -> None:
    records = [
        rec("token", 1, 0.0, 1.0),
        rec("resident", 1, 0.1, 0.9),
        rec("token", 2, 1.0, 2.0, requested=0.5, handoff=True),
        rec("resident", 2, 1.0, 2.0),  # touching the token's edges is inside
        rec("token", 1, 2.5, 3.0, requested=1.5, handoff=True),
        rec("resident", 1, 2.6, 2.9),
        {"kind": "order", "whatever": 1},  # other kinds are ignored
    ]
    result = check_intervals(records)
    assert result.ok
    assert (result.token_intervals, result.resident_intervals) == (3, 3)
    assert result.handoffs == 2
    assert result.handoff_ms == pytest.approx((500.0, 1000.0))


def test_checker_finds_overlapping_resident_intervals() -> None:
    records = [
        rec("token", 1, 0.0, 1.0),
        rec("resident", 1, 0.0, 1.0),
        rec("token", 2, 1.0, 2.0),
        rec("resident", 2, 0.95, 1.5),  # started restoring before process 1 released
    ]
    result = check_intervals(records)
    assert not result.ok
    assert len(result.overlaps) == 1
    a, b = result.overlaps[0]
    assert {a.pid, b.pid} == {1, 2}
    # ... and that resident interval is also outside process 2's token interval
    assert [i.pid for i in result.outside_token] == [2]


def test_checker_finds_residency_without_the_token() -> None:
    records = [
        rec("token", 1, 0.0, 1.0),
        rec("resident", 1, 0.5, 1.2),  # released after giving the token back
        rec("token", 2, 5.0, 6.0),
        rec("resident", 2, 3.0, 3.5),  # resident with no token at all
        rec("token", 3, 7.0, 8.0, model="a"),
        rec("resident", 3, 7.1, 7.2, model="b"),  # the token of another model in the same pid
    ]
    result = check_intervals(records)
    assert [(i.pid, i.start) for i in result.outside_token] == [(1, 0.5), (2, 3.0), (3, 7.1)]
    assert result.overlaps == ()
    assert not result.ok


def test_checker_finds_token_overlaps_far_apart_in_order() -> None:
    # a long interval overlapping one that starts much later (not just neighbours)
    records = [rec("token", 1, 0.0, 10.0), rec("token", 2, 1.0, 2.0), rec("token", 3, 3.0, 4.0)]
    result = check_intervals(records)
    assert len(result.token_overlaps) == 2
    assert {b.pid for _, b in result.token_overlaps} == {2, 3}


def test_same_process_intervals_never_count_as_overlaps() -> None:
    records = [rec("token", 1, 0.0, 2.0), rec("resident", 1, 0.0, 1.0), rec("resident", 1, 0.5, 2.0)]
    assert check_intervals(records).ok


def test_checker_counts_malformed_records() -> None:
    records = [rec("token", 1, 2.0, 1.0), {"kind": "resident", "pid": "x"}, rec("token", 2, 0.0, 1.0)]
    result = check_intervals(records)
    assert result.malformed == 2 and not result.ok


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.integers(1, 4), st.floats(0.01, 1.0), st.floats(0.0, 0.5), st.floats(0.0, 0.5)),
        min_size=2,
        max_size=30,
    ),
    victim=st.integers(0, 1000),
)
def test_checker_property_clean_schedules_pass_and_any_leak_fails(
    turns: list[tuple[int, float, float, float]], victim: int
) -> None:
    """Random serial schedules (token turns of random pids, residency inside each) pass; moving
    one resident interval's end past its token's end is always caught."""
    records, t = [], 0.0
    for pid, length, lead, tail in turns:
        start, end = t, t + length
        records.append(rec("token", pid, start, end))
        r_start = start + length * lead * 0.5
        records.append(rec("resident", pid, r_start, max(r_start, end - length * tail * 0.5)))
        t = end + 0.001
    assert check_intervals(records).ok
    i = 2 * (victim % len(turns)) + 1  # a resident record
    leaked = dict(
        records[i], end=records[i - 1]["end"] + 0.0005
    )  # still resident after giving the token back
    result = check_intervals([*records[:i], leaked, *records[i + 1 :]])
    assert not result.ok and len(result.outside_token) == 1


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0


def test_plan_workers_reuses_models_with_distinct_ids() -> None:
    plans = plan_workers(5, [("a", "/a.gguf"), ("b", "/b.gguf")])
    assert [p.id for p in plans] == ["a", "b", "a-2", "b-2", "a-3"]
    assert [p.path for p in plans] == ["/a.gguf", "/b.gguf", "/a.gguf", "/b.gguf", "/a.gguf"]
    with pytest.raises(ValueError, match="at least 1"):
        plan_workers(0, [("a", "/a.gguf")])
    with pytest.raises(ValueError, match="no models"):
        plan_workers(2, [])
    assert model_id_for_path("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"


def test_report_text_and_json() -> None:
    from timeshare.core.diagnostics.arena_test_report import ArenaTestReport, Mismatch

    report = ArenaTestReport(
        workers=2,
        models=("a", "b"),
        seconds=3.0,
        requests=4,
        reference_requests=2,
        errors=0,
        handoffs=3,
        overlaps=0,
        outside_token=0,
        token_overlaps=0,
        deadlocks=0,
        outputs_match_reference=False,
        handoff_ms_p50=12.5,
        handoff_ms_p99=40.0,
        token_intervals=5,
        resident_intervals=5,
        malformed_records=0,
        requests_by_worker=(("a", 3), ("b", 1)),
        mismatches=(Mismatch("b", "Hi", " there", " then"),),
    )
    assert not report.ok  # an output differed
    text = report.to_text()
    assert "outputs match        NO" in text and "result               FAILED" in text
    assert "mismatch b 'Hi'" in text and "a: 3, b: 1" in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] is False and data["requests_by_worker"] == {"a": 3, "b": 1}
    assert data["mismatches"][0]["got"] == " then"


# ---- the CLI refuses an unsafe arena ----------------------------------------------------------------


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 280
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeshare", "arena-test", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_cli_refuses_an_unsafe_arena(tmp_path: Path, smollm2_path: Path) -> None:
    unsafe = tmp_path / "shared-arena"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    proc = run_cli("--model", str(smollm2_path), "--json", env={"TIMESHARE_VRAM_ARENA": str(unsafe)})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert str(unsafe) in proc.stderr and "group- or world-writable" in proc.stderr


def test_cli_refuses_bad_arguments(smollm2_path: Path) -> None:
    proc = run_cli("--workers", "0", "--model", str(smollm2_path))
    assert proc.returncode == 2 and "--workers must be at least 1" in proc.stderr
    proc = run_cli("--sample-memory-ms", "-1", "--model", str(smollm2_path))
    assert proc.returncode == 2 and "--sample-memory-ms must be 0 (off) or a positive" in proc.stderr


@pytest.mark.slow
def test_cli_json_run_prints_only_the_report(smollm2_path: Path) -> None:
    proc = run_cli("--workers", "1", "--seconds", "1", "--model", str(smollm2_path), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)  # nothing else on stdout
    assert data["models"] == ["smollm2-135m-instruct.q4_1"]
    assert data["ok"] is True and data["overlaps"] == 0 and data["outside_token"] == 0
    assert "arena-test: starting 1 workers" in proc.stderr


# ---- real workers ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_three_workers_under_random_contention(tmp_path: Path, smollm2_path: Path, gemma3_path: Path) -> None:
    report = run_arena_test(
        [("smollm2-135m-instruct", str(smollm2_path)), ("gemma3-270m", str(gemma3_path))],
        workers=3,
        seconds=4.0,
        work_dir=tmp_path,
        prompts=("The capital of France is", "1, 2, 3, 4,"),
        max_tokens=8,
        sample_memory_ms=50,
    )
    data = report.to_json()
    assert data["workers"] == 3
    assert data["overlaps"] == 0, data
    assert data["outside_token"] == 0, data
    assert data["token_overlaps"] == 0, data
    assert data["deadlocks"] == 0, data
    assert data["errors"] == 0, data
    assert data["outputs_match_reference"] is True, data
    assert data["requests"] > 0 and data["handoffs"] > 0, data
    assert data["resident_intervals"] > 0, data
    # every worker really held the GPU, and its weights were resident only inside its token
    records = read_events(tmp_path / "intervals.jsonl")
    assert {r["model"] for r in records if r["kind"] == "resident"} == {
        "smollm2-135m-instruct",
        "gemma3-270m",
        "smollm2-135m-instruct-2",
    }
    assert data["handoff_ms_p50"] is not None and data["handoff_ms_p99"] >= data["handoff_ms_p50"]
    # the physical check: RSS (CPU build) of each worker, sampled every 50 ms during the contention
    assert data["memory_source"] == "rss" and data["memory_samples"] > 10, data
    assert data["memory_overlaps"] == 0, data  # never two workers with their weights in memory
    assert set(data["memory_threshold_bytes"]) == set(data["models"])
    # ... and it has teeth: a worker that was released and then restored its weights for a while
    # inside the sampling window was seen high
    switched_in = switched_in_while_sampled(records, report.memory_window, period_s=0.05)
    assert switched_in, data  # (4 s of contention always has some)
    assert all(data["memory_high_seen"][m] for m in switched_in), (switched_in, data)
    assert data["ok"] is True
    json.dumps(data)  # the --json report is plain JSON


def switched_in_while_sampled(
    records: list[dict], window: tuple[float, float] | None, period_s: float
) -> set[str]:
    """Workers with a resident interval inside ``window`` that lasted >= 4 sampling periods and
    came after >= 4 periods released (since its previous resident interval or the window's
    start): the sampler must have seen them both low and high."""
    assert window is not None
    start, end = window
    margin = 4 * period_s
    found: set[str] = set()
    last_end: dict[str, float] = {}
    for r in sorted((r for r in records if r["kind"] == "resident"), key=lambda r: r["start"]):
        released_since = max(start, last_end.get(r["model"], start))
        if r["start"] - released_since >= margin and r["end"] - r["start"] >= margin and r["end"] <= end:
            found.add(r["model"])
        last_end[r["model"]] = r["end"]
    return found


@pytest.mark.slow
def test_kill9_of_the_holder_mid_decode(tmp_path: Path, smollm2_path: Path, gemma3_path: Path) -> None:
    plans = [
        WorkerPlan("gemma3-270m", str(gemma3_path)),
        WorkerPlan("smollm2-135m-instruct", str(smollm2_path)),
        WorkerPlan("smollm2-135m-instruct-2", str(smollm2_path)),
    ]
    # max_restarts=0: the killed worker is not restarted, so the others cannot depend on a restart
    harness = ArenaHarness(
        plans, work_dir=tmp_path, arena_dir=tmp_path / "arena", max_tokens=8, deadlock_s=120, max_restarts=0
    )
    watch: ResidencyWatch | None = None
    weights = {p.id: Path(p.path).stat().st_size for p in plans}
    try:
        harness.start()
        pool = harness.pool
        pids = {p.id: pool.snapshot().model(p.id).pid for p in plans}  # type: ignore[union-attr]
        # who holds a lease (/proc/locks) and each worker's RSS, sampled all along: the oracle for
        # "weights only while holding the token", besides the intervals the workers write
        watch = ResidencyWatch(tmp_path / "arena", pids).__enter__()  # type: ignore[arg-type]
        prompt = "The capital of France is"
        expected = harness.generate("smollm2-135m-instruct", prompt)  # uncontended reference
        pool.pin("gemma3-270m")  # the holder will not yield: the waiter can only get in by its death
        counting = pool.generate("gemma3-270m", prompt="1, 2, 3, 4, 5, 6,", sampling=Sampling(max_tokens=400))
        next(iter(counting))  # it is decoding now, with the token
        holder = read_holder(tmp_path / "arena")
        assert holder is not None and holder.model == "gemma3-270m" and holder.pinned
        waiting = pool.generate("smollm2-135m-instruct", prompt=prompt, sampling=Sampling(max_tokens=8))
        arena = Arena(tmp_path / "arena")
        wait_until(
            lambda: any(t.model == "smollm2-135m-instruct" for t in arena.waiters()),
            60,
            "the waiter to queue for the token",
        )
        assert not counting.done, "the holder finished before it could be killed"
        victim = pool.snapshot().model("gemma3-270m")
        assert victim is not None and victim.pid is not None
        os.kill(victim.pid, 9)
        assert waiting.result(timeout=120).text == expected  # the kernel dropped the flock
        with pytest.raises(ModelUnavailableError):
            counting.result(timeout=60)
        # the third worker keeps serving too, with no restart of the dead one
        assert harness.generate("smollm2-135m-instruct-2", prompt) == expected
        snap = pool.snapshot()
        dead = snap.model("gemma3-270m")
        assert dead is not None and dead.state is ModelState.FAILED and dead.restarts == 0
        arena.close()
    finally:
        if watch is not None:
            watch.__exit__()
        harness.stop()
    check = check_intervals(read_events(tmp_path / "intervals.jsonl"))
    assert check.ok, check
    assert check.resident_intervals >= 3
    assert watch is not None
    violations, high_seen = watch.check(weights)
    assert violations == [], violations[:5]
    assert high_seen["gemma3-270m"] and high_seen["smollm2-135m-instruct"], high_seen


@pytest.mark.slow
def test_two_busy_workers_both_make_progress(tmp_path: Path, smollm2_path: Path, gemma3_path: Path) -> None:
    plans = [
        WorkerPlan("smollm2-135m-instruct", str(smollm2_path)),
        WorkerPlan("gemma3-270m", str(gemma3_path)),
    ]
    prompts = ("1, 2, 3, 4, 5, 6,",)
    # requests longer than the quantum: each worker has to yield in the middle of a decode
    harness = ArenaHarness(
        plans, work_dir=tmp_path, arena_dir=tmp_path / "arena", prompts=prompts, max_tokens=12
    )
    try:
        harness.start()
        harness.take_reference()
        # one client per worker, always sending, until both got 2 answers (bounded: 90 s)
        harness.contend(90.0, dedicated=True, until=lambda done: len(done) == 2 and min(done.values()) >= 2)
    finally:
        harness.stop()
    report = harness.report()
    by_worker = dict(report.requests_by_worker)
    assert min(by_worker.values()) >= 2, by_worker  # neither starves
    assert report.handoffs >= 3, report
    assert report.outputs_match_reference, report.mismatches  # also across mid-decode yields
    assert report.ok, report.to_json()


@pytest.mark.slow
def test_pinned_holder_makes_others_wait_visibly_and_time_out_clearly(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    plans = [
        WorkerPlan("gemma3-270m", str(gemma3_path)),
        WorkerPlan("smollm2-135m-instruct", str(smollm2_path)),
    ]
    harness = ArenaHarness(
        plans, work_dir=tmp_path, arena_dir=tmp_path / "arena", max_tokens=4, wait_timeout_s=3.0
    )
    try:
        harness.start()
        pool = harness.pool
        pool.pin("gemma3-270m")
        harness.generate("gemma3-270m", "Hello")  # it takes the GPU and, pinned, keeps it
        holder = read_holder(tmp_path / "arena")
        assert holder is not None and holder.model == "gemma3-270m" and holder.pinned
        gen = pool.generate("smollm2-135m-instruct", prompt="Hello", sampling=Sampling(max_tokens=4))
        reasons: set[str] = set()

        def finished_waiting() -> bool:  # and collect the waiting reasons shown meanwhile
            status = pool.snapshot().model("smollm2-135m-instruct")
            if status is not None and status.reason:
                reasons.add(status.reason)
            return gen.done

        wait_until(finished_waiting, 60, "the waiting request to time out (wait_timeout_s=3)")
        assert any("pinned by gemma3-270m" in r for r in reasons), reasons
        with pytest.raises(TokenTimeoutError) as info:
            gen.result(timeout=60)
        assert "gemma3-270m holds the GPU and is pinned; unpin it or raise arena.wait_timeout_s" in str(
            info.value
        )
        pool.pin("gemma3-270m", False)  # unpinned, it yields to the next request
        assert harness.generate("smollm2-135m-instruct", "Hello") != ""
    finally:
        harness.stop()
    assert check_intervals(read_events(tmp_path / "intervals.jsonl")).ok
