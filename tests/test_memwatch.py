"""The physical memory check of arena-test: the checker on hand-made samples (so it demonstrably
fails on an overlap), the nvidia-smi stream parser on lines in its real format, and the RSS
sampler on real processes (this one and a child that allocates and frees memory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _proc_util import wait_until
from timeshare.core.diagnostics.memwatch import (
    MIB,
    MemorySampler,
    MemSample,
    check_memory,
    choose_source,
    group_nvidia_smi_lines,
    parse_nvidia_smi_line,
    read_rss,
)

W = {"a": 1000 * MIB, "b": 400 * MIB}
BASE = {"a": 300 * MIB, "b": 200 * MIB}


def s(t: float, **mib: int) -> MemSample:
    return MemSample(t, tuple((k, v * MIB) for k, v in mib.items()))


def alternating(overlap_at: int | None = None) -> list[MemSample]:
    """a and b take turns holding their weights; at ``overlap_at`` both hold them."""
    out = []
    for i in range(12):
        a_in = i % 4 < 2 or i == overlap_at
        b_in = i % 4 >= 2 or i == overlap_at
        out.append(s(i * 0.05, a=300 + (1000 if a_in else 0) + i, b=200 + (400 if b_in else 0) - i))
    return out


# ---- the checker ----------------------------------------------------------------------------------


def test_checker_accepts_alternating_workers_and_sees_both_high() -> None:
    result = check_memory(alternating(), W)
    assert result.ok and result.overlaps == 0
    assert result.samples == 12
    assert dict(result.high_seen) == {"a": True, "b": True}
    assert dict(result.threshold_bytes) == {"a": 500 * MIB, "b": 200 * MIB}
    assert dict(result.baseline_bytes) == {"a": 302 * MIB, "b": 191 * MIB}  # each one's own minimum


def test_checker_counts_a_sample_where_both_held_their_weights() -> None:
    result = check_memory(alternating(overlap_at=5), W)
    assert not result.ok and result.overlaps == 1
    assert [x.t for x in result.overlap_examples] == [pytest.approx(0.25)]


def test_checker_below_half_the_weights_is_not_high() -> None:
    # b grows by less than half its weights (KV, compute buffers) while a holds its weights: no overlap
    samples = [s(0, a=300, b=200), s(1, a=1300, b=399), s(2, a=300, b=200), s(3, a=300, b=401)]
    result = check_memory(samples, W)
    assert result.overlaps == 0
    assert dict(result.high_seen) == {"a": True, "b": True}  # 401 > 200 + 200: high in the last one
    assert check_memory([*samples, s(4, a=1301, b=401)], W).overlaps == 1


def test_checker_workers_that_never_switch_are_never_high() -> None:
    flat = [s(i, a=1300, b=200) for i in range(5)]
    result = check_memory(flat, W)
    assert result.ok and dict(result.high_seen) == {"a": False, "b": False}
    # a worker with no weight bytes is never high; a worker never sampled has no baseline
    result = check_memory(alternating(overlap_at=5), {"a": 1000 * MIB, "b": 0, "c": 5 * MIB})
    assert result.overlaps == 0 and dict(result.high_seen) == {"a": True, "b": False, "c": False}
    assert "c" not in dict(result.baseline_bytes)


def test_checker_missing_workers_count_as_zero_only_when_asked() -> None:
    # nvidia-smi lists only processes holding device memory: a missing worker holds none
    samples = [s(0, a=1300), s(1, b=600), s(2, a=1300, b=600)]
    assert check_memory(samples, W).overlaps == 0  # RSS: no baseline below the peak is known
    result = check_memory(samples, W, missing_as_zero=True)
    assert result.overlaps == 1 and dict(result.baseline_bytes) == {"a": 0, "b": 0}
    assert check_memory([], W).samples == 0 and check_memory([], W).ok


# ---- nvidia-smi's output ----------------------------------------------------------------------------


def test_parse_nvidia_smi_line() -> None:
    assert parse_nvidia_smi_line("12345, 6072\n") == (12345, 6072 * MIB)
    assert parse_nvidia_smi_line("  7, 0") == (7, 0)
    assert parse_nvidia_smi_line("12345, [N/A]\n") == (12345, None)  # a process, memory unknown
    assert parse_nvidia_smi_line("No running processes found\n") is None
    assert parse_nvidia_smi_line("pid, used_gpu_memory [MiB]") is None
    assert parse_nvidia_smi_line("") is None
    assert parse_nvidia_smi_line("1, 2, 3") is None


def test_group_nvidia_smi_lines_into_polls() -> None:
    names = {100: "a", 200: "b"}
    lines = [
        (0.00, "100, 6000\n"),
        (0.00, "200, 500\n"),
        (0.00, "999, 80\n"),  # another process on the GPU: left out
        (0.05, "100, 500\n"),  # pid 100 again: a new poll
        (0.05, "200, 6000\n"),
        (0.10, "No running processes found\n"),
        (0.15, "200, [N/A]\n"),  # memory unknown: b seen but not measured
        (0.20, "200, 500\n"),
        (0.25, "200, 6000\n"),
        (0.25, "\n"),
    ]
    samples = group_nvidia_smi_lines(lines, names)
    assert [x.t for x in samples] == [0.0, 0.05, 0.10, 0.15, 0.20, 0.25]
    assert samples[0].bytes_by == (("a", 6000 * MIB), ("b", 500 * MIB))
    assert samples[1].bytes_by == (("a", 500 * MIB), ("b", 6000 * MIB))
    assert samples[2].bytes_by == ()
    assert samples[3].bytes_by == () and samples[3].unmeasured == ("b",)
    assert samples[4].bytes_by == (("b", 500 * MIB),) and samples[5].bytes_by == (("b", 6000 * MIB),)
    weights = {"a": 5500 * MIB, "b": 5500 * MIB}
    result = check_memory(samples, weights, missing_as_zero=True)
    assert result.overlaps == 0 and dict(result.high_seen) == {"a": True, "b": True}
    assert dict(result.baseline_bytes) == {
        "a": 0,
        "b": 0,
    }  # a missing worker holds nothing; [N/A] is no figure
    both = [(0.3, "100, 6000\n"), (0.3, "200, 6000\n")]
    assert (
        check_memory(group_nvidia_smi_lines(lines + both, names), weights, missing_as_zero=True).overlaps == 1
    )


def test_choose_source_and_bad_settings() -> None:
    assert choose_source(["CPU", "CPU"]) == "rss"
    assert choose_source([]) == "rss"
    with pytest.raises(ValueError, match="at least 1"):
        MemorySampler({"a": os.getpid()}, 0, "rss")
    with pytest.raises(ValueError, match="unknown memory source"):
        MemorySampler({"a": os.getpid()}, 50, "vram")


# ---- the RSS sampler on real processes -----------------------------------------------------------------

CHILD = """
import mmap, sys, time
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
m = mmap.mmap(-1, 64 << 20)
m.write(b"x" * (64 << 20))  # touched: resident
sys.stdout.write("big\\n"); sys.stdout.flush()
sys.stdin.readline()
m.close()  # back to the system
sys.stdout.write("small\\n"); sys.stdout.flush()
sys.stdin.readline()
"""


def test_rss_sampler_sees_a_real_process_take_and_release_memory() -> None:
    assert read_rss(os.getpid()) is not None and read_rss(os.getpid()) > 0  # type: ignore[operator]
    with subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "ready\n"
            sampler = MemorySampler({"child": child.pid, "me": os.getpid()}, 10, "rss")
            sampler.start()

            def sampled_in_this_phase() -> None:
                # a few samples taken after the child reached this phase (low, high, low again);
                # the first may have read the RSS before: count it out. (The sampler's own list:
                # its public view, stop(), ends the sampling.)
                n = len(sampler._samples)
                wait_until(lambda: len(sampler._samples) >= n + 4, 30, f"samples after sample {n}")

            for expect in ("big\n", "small\n"):
                sampled_in_this_phase()
                child.stdin.write("\n")
                child.stdin.flush()
                assert child.stdout.readline() == expect
            sampled_in_this_phase()
            samples = sampler.stop()
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.wait(timeout=30) == 0
        finally:
            if child.poll() is None:
                child.kill()
    assert len(samples) >= 10
    assert all(x.get("child") is not None for x in samples)
    result = check_memory(samples, {"child": 64 * MIB, "me": 64 * MIB})
    assert dict(result.high_seen) == {"child": True, "me": False}
    assert result.overlaps == 0
    # the child was high in the middle only: released at the end
    assert samples[-1].get("child") < dict(result.baseline_bytes)["child"] + 32 * MIB  # type: ignore[operator]
    # a gone process is not measured (no error)
    assert read_rss(child.pid) is None


FAKE_NVIDIA_SMI = """#!/bin/sh
# stands in for nvidia-smi, which cannot exist on a machine without an NVIDIA GPU: it checks the
# arguments the sampler passes and prints polls in the captured format until terminated
[ "$1" = "--query-compute-apps=pid,used_memory" ] && [ "$2" = "--format=csv,noheader,nounits" ] \\
    && [ "$3" = "-lms" ] && [ "$4" = "20" ] || { echo "bad arguments: $*" >&2; exit 2; }
i=0
while true; do
    if [ $((i % 2)) = 0 ]; then printf '100, 6000\\n200, 500\\n'; else printf '100, 500\\n200, 6000\\n'; fi
    i=$((i + 1))
    sleep 0.02  # the poll period of -lms 20
done
"""


def test_nvidia_smi_sampler_streams_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert choose_source(["CUDA0", "CUDA0"]) == "nvidia-smi"
    assert choose_source(["CPU"]) == "rss"
    sampler = MemorySampler({"a": 100, "b": 300}, 20, "nvidia-smi")
    sampler.start()
    # five polls of two lines streamed in (the fake's own `sleep 0.02` is its poll period)
    wait_until(lambda: len(sampler._lines) >= 10, 30, "five polls from the fake nvidia-smi")
    samples = sampler.stop()
    assert len(samples) >= 5
    assert all(x.bytes_by[0][0] == "a" and len(x.bytes_by) == 1 for x in samples)
    assert sampler.other_pids == (200,)  # listed, but no worker's: left out and reported
    result = check_memory(samples, {"a": 5500 * MIB, "b": 5500 * MIB}, missing_as_zero=True)
    assert result.overlaps == 0 and dict(result.high_seen) == {"a": True, "b": False}


def test_arena_report_fails_on_a_memory_overlap_and_says_so() -> None:
    from timeshare.core.diagnostics.arena_test_report import ArenaTestReport

    fields = dict(
        workers=2, models=("a", "b"), seconds=3.0, requests=4, reference_requests=2, errors=0,
        handoffs=3, overlaps=0, outside_token=0, token_overlaps=0, deadlocks=0,
        outputs_match_reference=True, handoff_ms_p50=1.0, handoff_ms_p99=2.0, token_intervals=3,
        resident_intervals=3, malformed_records=0, memory_source="rss", memory_interval_ms=50,
        memory_samples=60, memory_high_seen=(("a", True), ("b", True)),
        memory_threshold_bytes=(("a", 48 * MIB), ("b", 120 * MIB)),
    )  # fmt: skip
    clean = ArenaTestReport(**fields)  # type: ignore[arg-type]
    assert clean.ok and "0 overlaps in 60 samples (rss, every 50 ms" in clean.to_text()
    bad = ArenaTestReport(**{**fields, "memory_overlaps": 2})  # type: ignore[arg-type]
    assert not bad.ok and "result               FAILED" in bad.to_text()
    data = bad.to_json()
    assert data["memory_overlaps"] == 2 and data["memory_high_seen"] == {"a": True, "b": True}
    assert data["memory_threshold_bytes"] == {"a": 48 * MIB, "b": 120 * MIB} and data["ok"] is False
