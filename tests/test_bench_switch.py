"""`timeshare bench switch`: a real run on the two demo models (real workers, real arena, a real
fresh process for the reload), checked for structure and internal consistency, never for speed."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from timeshare import cli

TIMESHARE = Path(sys.executable).with_name("timeshare")


@pytest.fixture(scope="module")
def report(smollm2_path: Path, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("bench-switch-home")
    env = {**os.environ, "TIMESHARE_HOME": str(home)}
    env.pop("TIMESHARE_VRAM_ARENA", None)
    proc = subprocess.run(
        [
            str(TIMESHARE),
            "bench",
            "switch",
            "--rounds",
            "2",
            "--json",
            "--model",
            str(smollm2_path),
            "--model",
            str(gemma3_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data: dict[str, Any] = json.loads(proc.stdout)  # stdout carries only the JSON
    return data


def test_structure_and_alternation(report: dict[str, Any]) -> None:
    assert report["rounds"] == 2
    assert [m["role"] for m in report["models"]] == ["A", "B"]
    a, b = (m["id"] for m in report["models"])
    assert a != b
    assert [t["model"] for t in report["turns"]] == [a, b, a, b]
    # every turn had to take the GPU from the other model, and was answered
    assert all(t["switched"] for t in report["turns"])
    assert all(t["completion_tokens"] > 0 for t in report["turns"])
    assert report["summary"]["switched_turns"] == 4
    # the baseline turns continue on the model that holds the GPU
    assert report["no_switch_turns"] and not any(t["switched"] for t in report["no_switch_turns"])
    assert [r["model"] for r in report["restarts"]] == [a, a]
    assert {row["what"] for row in report["table"]} >= {
        "switch: continued turn, the other model held the GPU (median)",
        "process restart: worker stopped, the turn restarts it (median)",
        "fresh process: load + full prefill + first token",
    }


def test_continued_turns_reuse_the_kv_prefix(report: dict[str, Any]) -> None:
    for warm in report["warm"]:
        assert warm["prefilled"] >= warm["prompt_tokens"] - 1  # the first turn prefills everything
    for t in report["turns"] + report["no_switch_turns"]:
        assert 0 < t["prefilled"] < t["prompt_tokens"] // 4, t
    # the restarted worker finds the conversation's KV on disk
    for r in report["restarts"]:
        assert r["prefilled"] < r["prompt_tokens"] // 4, r
    # the fresh process has no KV: it prefills the whole conversation
    reload = report["reload"]
    assert reload is not None, report.get("reload_error")
    assert reload["prefilled"] == reload["prompt_tokens"]
    assert reload["prompt_tokens"] > max(r["prompt_tokens"] for r in report["restarts"])


def test_ratios_come_from_the_measured_numbers(report: dict[str, Any]) -> None:
    s = report["summary"]
    switch = statistics.median(t["client_ttft_ms"] for t in report["turns"] if t["switched"])
    restart = statistics.median(r["client_ttft_ms"] for r in report["restarts"])
    assert s["switch_ttft_ms"] == pytest.approx(switch)
    assert s["restart_ttft_ms"] == pytest.approx(restart)
    assert s["switch_restore_ms"] == pytest.approx(
        statistics.median(t["restore_ms"] for t in report["turns"] if t["switched"])
    )
    assert s["ratio_restart_over_switch"] == pytest.approx(restart / switch)
    assert s["ratio_reload_over_switch"] == pytest.approx(report["reload"]["ttft_ms"] / switch)
    assert s["ratio_reload_process_over_switch"] == pytest.approx(
        report["reload"]["process_ttft_ms"] / switch
    )
    table = {row["what"]: row["x_switch"] for row in report["table"]}
    restart_row = "process restart: worker stopped, the turn restarts it (median)"
    assert table[restart_row] == pytest.approx(restart / switch)
    for value in (switch, restart, report["reload"]["ttft_ms"], report["reload"]["load_ms"]):
        assert value > 0


def test_greedy_output_is_the_same_after_switches(report: dict[str, Any]) -> None:
    ex = report["exactness"]
    assert ex["bitwise_identical"] is True
    assert ex["compared_switched_with_unswitched"] is True
    assert len(ex["checks"]) == 2
    for check in ex["checks"]:
        assert check["reference_switched"] is False and check["after_switched"] is True
        assert check["after_text"] == check["reference_text"] != ""


# ---- bad input: a clear sentence, exit 2, nothing started --------------------------------------


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_one_model_is_refused(smollm2_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["bench", "switch", "--model", str(smollm2_path)], capsys)
    assert rc == 2
    assert "give --model exactly twice (got 1)" in err
    assert out == ""


def test_missing_model_file_is_refused_with_json(
    smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.gguf"
    rc, out, err = _run(
        ["bench", "switch", "--model", str(smollm2_path), "--model", str(missing), "--json"], capsys
    )
    assert rc == 2
    assert json.loads(out)["error"].startswith(f"model file {missing} does not exist")
    assert "must name a .gguf file" in err


def test_non_gguf_file_is_refused(
    smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model\n")
    rc, _out, err = _run(["bench", "switch", "--model", str(bad), "--model", str(smollm2_path)], capsys)
    assert rc == 2
    assert "is not a GGUF file" in err
    assert bad.read_text() == "not a model\n"  # untouched


@pytest.mark.parametrize("rounds", ["0", "-3", "101"])
def test_bad_rounds_are_refused(smollm2_path: Path, rounds: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = _run(
        ["bench", "switch", "--model", str(smollm2_path), "--model", str(smollm2_path), "--rounds", rounds],
        capsys,
    )
    assert rc == 2
    assert "--rounds must be between 1 and 100" in err


def test_without_model_the_demo_models_are_used(capsys: pytest.CaptureFixture[str]) -> None:
    # the defaults resolve (Gemma is assembled into this test's TIMESHARE_HOME) before the
    # rounds are checked, so a bad --rounds proves that both demo paths were found
    rc, out, err = _run(["bench", "switch", "--rounds", "0", "--json"], capsys)
    assert rc == 2
    assert json.loads(out)["error"] == "--rounds must be between 1 and 100 (got 0)"
    assert "demo" not in err


def test_truncated_model_is_reported_and_nothing_is_left_running(
    smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.gguf"
    with smollm2_path.open("rb") as src:
        broken.write_bytes(src.read(1 << 20))  # a GGUF header, most tensor data missing
    rc, out, _err = _run(
        ["bench", "switch", "--json", "--model", str(smollm2_path), "--model", str(broken)], capsys
    )
    assert rc == 2
    message = json.loads(out)["error"]
    assert message.startswith("a model could not be loaded: broken:")
    assert "damaged GGUF file" in message and message.endswith("re-download it")
    assert broken.stat().st_size == 1 << 20  # untouched
    left = subprocess.run(["pgrep", "-f", str(broken)], capture_output=True, text=True, check=False)
    assert left.stdout.strip() == ""  # no worker outlives the benchmark


def test_table_shows_the_ratios(report: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from timeshare.core.diagnostics.bench_switch import _print_table

    _print_table(report)
    text = capsys.readouterr().out
    s = report["summary"]
    assert f"{s['ratio_restart_over_switch']:.2f}" in text
    assert f"{s['ratio_reload_over_switch']:.2f}" in text
    assert "(4 of 4 turns switched)" in text
    assert "equals the one without a switch: True" in text
