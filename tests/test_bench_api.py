"""`timeshare bench api`: the end-to-end benchmark through a real `timeshare serve`, on the demo
models with short conversations; llama-server is played by tests/_fake_llama_server.py (this
machine has no llama-server build), which exercises the swap and coresident runs for real
processes and HTTP. No timing is asserted: which system is faster is what the bench prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeshare.core.diagnostics import bench_api
from timeshare.core.errors import TimeshareError

FAKE = Path(__file__).parent / "_fake_llama_server.py"
KEYS = {"timeshare_switch", "timeshare_same", "timeshare_plain_client", "worker_restart", "fresh_process"}
SERVER_KEYS = {"llama_swap", "llama_server_coresident"}


def _bench(tmp_path: Path, *argv: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TMPDIR=str(tmp_path))  # the bench's work dir lands in tmp_path
    return subprocess.run(
        [sys.executable, "-m", "timeshare", "bench", "api", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=tmp_path,
    )


def _left_behind(tmp_path: Path) -> list[str]:
    """Processes that still run from the bench: its serve, workers, fresh process, fake servers."""
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(FAKE) in cmdline or f"TIMESHARE_HOME={tmp_path}" in environ or f"TMPDIR={tmp_path}" in environ:
            left.append(f"{proc.name}: {cmdline[:200]}")
    return left


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a whole benchmark on a shared 2-core CPU: minutes
def test_bench_api_runs_every_system_and_plots(tmp_path: Path, smollm2_path: Path, gemma3_path: Path) -> None:
    server = tmp_path / "llama-server"
    server.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    server.chmod(0o755)
    png = tmp_path / "bench.png"
    models = ("--model", str(smollm2_path), "--model", str(gemma3_path))
    args = ("--context", "64", "--rounds", "3", "--json", "--plot", str(png), "--llama-server", str(server))
    out = _bench(tmp_path, *models, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    systems = report["systems"]
    assert set(systems) == KEYS | SERVER_KEYS
    for key, entry in systems.items():
        assert entry["ttft_ms_median"] > 0 and entry["samples"], key
        assert all(s > 0 for s in entry["samples"]) and "skipped" not in entry, key
    assert len(systems["timeshare_switch"]["samples"]) == 6 and len(systems["llama_swap"]["samples"]) == 6
    # every turn of the switch runs took the GPU from the other model (one-model budget); the
    # no-switch turns did not; only the new tokens were evaluated on a switched turn
    assert all(r["switched"] for r in systems["timeshare_switch"]["rows"])
    assert all(r["switched"] for r in systems["timeshare_plain_client"]["rows"])
    assert not any(r["switched"] for r in systems["timeshare_same"]["rows"])
    for r in systems["timeshare_switch"]["rows"]:
        assert 0 < r["prompt_tokens_evaluated"] < r["prompt_tokens"]
    # the restarted worker is model A's, stopped before each of its turns: those turns ran on a new
    # worker (no restore) that read the conversation's KV back from disk (only the new tokens
    # evaluated). Which is faster is the bench's output (its ratios), not asserted here.
    a = report["models"][0]["id"]
    restarts = systems["worker_restart"]["rows"]
    assert restarts and all(r["model"] == a for r in restarts)
    for r in restarts:
        assert not r["restore_ms"], r
        assert 0 < r["prompt_tokens_evaluated"] < r["prompt_tokens"], r
    # the workers' overlapped restores, from their logs: none here (auto is off on the CPU build;
    # reading the lines back: test_residency_overlap.py)
    assert report["overlaps"] == {m["id"]: [] for m in report["models"]}
    summary = report["summary"]
    assert summary["switched_turns"] == summary["switch_turns"] == 6
    assert summary["best_alternative"] in ("worker_restart", "fresh_process", "llama_swap")
    decode = report["decode"]
    assert decode["timeshare"]["tok_s"] > 0 and decode["llama_server"]["tok_s"] > 0 and decode["ratio"] > 0
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.shape[0] > 200 and image.shape[1] > 400
    assert report["plot"] == str(png)
    assert not list(tmp_path.glob("timeshare-bench-api-*")), "the work dir was not removed"
    assert _left_behind(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bench_api_responses_compares_a_continued_response_with_a_conversation(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    """``--responses``: each measured turn of the first model came after a switch, and both the
    previous_response_id chain and the chat conversation evaluated only the new turn."""
    models = ("--model", str(smollm2_path), "--model", str(gemma3_path))
    out = _bench(tmp_path, *models, "--context", "64", "--rounds", "2", "--responses", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    systems = report["systems"]
    assert set(systems) == {"responses_previous_response_id", "chat_conversation"}
    assert report["switched"] and report["ratio"] > 0 and report["target"] == 1.05
    for entry in systems.values():
        assert len(entry["samples"]) == 2 and all(s > 0 for s in entry["samples"])
        for row in entry["rows"]:
            assert row["switched"] and 0 < row["prompt_tokens_evaluated"] < row["prompt_tokens"] - 64, row
    # the two copies of the conversation are the same: the same prompt, the same tokens evaluated
    pairs = zip(
        systems["responses_previous_response_id"]["rows"], systems["chat_conversation"]["rows"], strict=True
    )
    for resp, chat in pairs:
        assert resp["prompt_tokens"] == chat["prompt_tokens"], (resp, chat)
        assert resp["prompt_tokens_evaluated"] == chat["prompt_tokens_evaluated"], (resp, chat)
    assert not list(tmp_path.glob("timeshare-bench-responses-*")), "the work dir was not removed"
    assert _left_behind(tmp_path) == []
    refused = _bench(tmp_path, "--responses", "--switch-only", "--json", timeout=120)
    assert refused.returncode == 2 and "--responses" in json.loads(refused.stdout)["error"]


def test_a_missing_llama_server_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "llama-server"
    out = _bench(tmp_path, "--llama-server", str(missing), "--json", timeout=120)
    assert out.returncode == 2
    error = json.loads(out.stdout)
    assert "no such file" in error["error"] and "llama-server" in error["error"]
    assert "no such file" in out.stderr
    not_exec = tmp_path / "llama-server"
    not_exec.write_text("")
    with pytest.raises(TimeshareError, match="not an executable"):
        bench_api.check_llama_server(str(not_exec))
    assert _left_behind(tmp_path) == []


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(TimeshareError, match=r"pip install 'timeshare\[bench\]'"):
        bench_api.check_plot(str(tmp_path / "x.png"))
    monkeypatch.delitem(sys.modules, "matplotlib")
    with pytest.raises(TimeshareError, match="does not exist"):
        bench_api.check_plot(str(tmp_path / "no" / "x.png"))


def test_bad_arguments_are_refused_before_anything_starts(smollm2_path: Path) -> None:
    with pytest.raises(TimeshareError, match="exactly twice"):
        bench_api.run_api_bench([str(smollm2_path)], context=64, rounds=1)
    with pytest.raises(TimeshareError, match="--rounds"):
        bench_api.run_api_bench([str(smollm2_path)] * 2, context=64, rounds=0)


@pytest.mark.timeout(600)
def test_a_terminated_bench_stops_what_it_started(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    """`timeout N timeshare bench api ...` sends SIGTERM: the bench ends as on Ctrl-C, and its
    serve and workers (each in its own session, which the signal does not reach) are stopped,
    not left holding the GPU."""
    import contextlib
    import signal
    import time

    env = dict(os.environ, TMPDIR=str(tmp_path))
    models = ("--model", str(smollm2_path), "--model", str(gemma3_path))
    bench = subprocess.Popen(
        [sys.executable, "-m", "timeshare", "bench", "api", *models, "--context", "64", "--rounds", "50"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 300
        while not any("core.worker" in p for p in _left_behind(tmp_path)):
            assert bench.poll() is None, "the bench ended before its serve started"
            assert time.monotonic() < deadline, "the bench's serve never started"
            time.sleep(0.5)
        time.sleep(2.0)  # workers starting too
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=180)
    finally:
        if bench.poll() is None:
            bench.kill()
    try:
        assert bench.returncode == 130, err[-2000:]
        assert "interrupted (SIGTERM)" in err
        deadline = time.monotonic() + 60
        while _left_behind(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _left_behind(tmp_path) == []
    finally:  # a failure here must not leave a serve and its workers running
        for line in _left_behind(tmp_path):
            with contextlib.suppress(OSError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_bench_api_deep_compares_the_deep_switch_with_the_weights_only_one(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    """``--deep`` (issue 39): the first model twice under an auto budget on a card (a host-memory
    cap on the CPU build) that sends every parked worker to the deep level; every such turn
    switched from a deep model, beside the weights-only switches of the same run, and the target
    is computed from the KV bytes in use and a raw copy measured in the same run."""
    models = ("--model", str(smollm2_path), "--model", str(gemma3_path))
    out = _bench(tmp_path, *models, "--context", "64", "--rounds", "2", "--switch-only", "--deep", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rows = report["systems"]["timeshare_deep_switch"]["rows"]
    assert len(rows) == 4 and all(r["switched"] and r["deep"] for r in rows), rows
    for r in rows:  # its conversation kept: only the new tokens evaluated
        assert 0 < r["prompt_tokens_evaluated"] < r["prompt_tokens"], r
    deep = report["deep"]
    assert deep["deep_turns"] == 4 and deep["budget_bytes"] > 0 and deep["card_bytes"] > deep["budget_bytes"]
    assert 0 < deep["kv_bytes_in_use_median"] < 200 * 23_040  # SmolLM2's cells in use, not n_ctx's
    assert deep["raw_copy_gbps"] > 0 and deep["target_ms"] > deep["weights_only_ttft_ms_median"]
    assert isinstance(deep["meets_target"], bool)
    # the releasing side: each deep release saved its cells straight from the KV tensors
    assert deep["kv_save_paths"] == ["raw"] and len(deep["releases"]) >= 4, deep["releases"]
    assert 0 <= deep["kv_save_ms_median"] <= deep["deep_release_ms_median"]
    # and said whether it allocated its host memory; the workers grew it ahead, idle after their
    # answers (an auto budget the two share: TIMESHARE_KV_AHEAD's rule), so that (but for a ring
    # that came before a worker was idle: not expected) no release with cells to save did
    assert all(r["kv_host_grown"] in (0, 1) for r in deep["releases"]), deep["releases"]
    assert deep["kv_host_allocs_ahead"] >= 1 and set(deep["first_deep_release_ms"]) == {"deep-a", "deep-b"}
    assert deep["kv_host_allocs_on_release"] == sum(r["kv_host_grown"] for r in deep["releases"])
    assert _left_behind(tmp_path) == []


def test_every_row_is_sized_to_the_card_and_a_model_that_cannot_fit_even_alone_is_said(
    tmp_path: Path,
    smollm2_path: Path,
    gemma3_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 39 (the H100 run's fresh-process row asked n_ctx 6656 x 4 f16 of an 8 GiB card and
    stopped the bench): each model is fitted to the card alone by the workers' rule before any
    row runs, the fresh process loads with that fit, and a model that cannot fit even alone is
    said and skipped while the bench goes on. A CPU "card" (a host-memory cap) whose room holds
    Gemma-3-270M's KV cache for the conversations' n_ctx (18,432 bytes a cell) but not SmolLM2's
    (23,040)."""
    rounds = 1
    n_ctx = bench_api.Conversations([str(smollm2_path), str(gemma3_path)], 64).n_ctx(
        rounds + min(bench_api.RESTARTS, rounds) + 1
    )
    room = n_ctx * (18_432 + 23_040) // 2
    monkeypatch.setenv("TIMESHARE_HOST_MEMORY", str(256 * 2**20 + room))  # the margin (256 MiB) + room
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    said: list[str] = []
    report = bench_api.run_api_bench(
        [str(smollm2_path), str(gemma3_path)], context=64, rounds=rounds, progress=said.append
    )
    fits = report["card_fit"]
    smol, gemma = list(fits)
    assert "unfit" in fits[smol] and "KV cache needs" in fits[smol]["unfit"], fits
    assert fits[gemma] == {
        "n_ctx": n_ctx,  # what the conversations need, kept
        "parallel": 1,  # the CPU build's auto
        "n_gpu_layers": -1,
        "kv_bytes": 18_432 * n_ctx,
        "room": room,
        "note": fits[gemma]["note"],
    }
    assert fits[gemma]["note"].startswith("parallel 1 (auto")
    assert any(f"{smol} on the card alone: does not fit even alone" in line for line in said), said
    assert any(f"{gemma} on the card alone: n_ctx {n_ctx} x parallel 1" in line for line in said), said
    systems = report["systems"]
    # the timeshare systems need both models: skipped with the reason; the bench went on
    for key in ("timeshare_switch", "timeshare_same", "timeshare_plain_client", "worker_restart"):
        assert f"{smol} does not fit the card even alone" in systems[key]["skipped"], key
    rows = systems["fresh_process"]["rows"]
    assert rows and all(r["model"] == gemma and r["fit"] == fits[gemma] for r in rows), rows
    assert all(r["ttft_ms"] > 0 and r["prompt_tokens_evaluated"] == r["prompt_tokens"] for r in rows)
    bench_api.print_table(report)  # the table says both
    table = capsys.readouterr().out
    assert f"{smol} on the card alone (fresh process, llama-server): does not fit even alone" in table
    assert f"{gemma} on the card alone (fresh process, llama-server): n_ctx {n_ctx} x parallel 1" in table
