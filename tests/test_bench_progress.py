"""`timeshare bench api` and `bench parallel` say how a request that takes long stands (which
system, row and round, the seconds so far, what the server says), through the helper `bench
embed` uses (`bench_api_procs.watched`). Tiny CPU runs on the demo models with an interval of a
millisecond, so every real request takes longer than it: no timing is asserted, only that the
lines come and name the request; llama-server is played by tests/_fake_llama_server.py."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
from timeshare.core.diagnostics import bench_api, bench_parallel

pytestmark = pytest.mark.slow

FAKE = Path(__file__).parent / "_fake_llama_server.py"
EVERY_S = 0.001  # shorter than any real request


def _fake_llama_server(tmp_path: Path) -> str:
    server = tmp_path / "llama-server"
    server.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    server.chmod(0o755)
    return str(server)


def test_bench_parallel_says_how_a_long_request_stands(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    args = argparse.Namespace(
        concurrency="2",
        tokens=4,
        prompt_words=8,
        n_ctx=256,
        baseline=False,
        llama_server=_fake_llama_server(tmp_path),
        flash_attn=False,
    )
    said: list[str] = []
    report = bench_parallel.run_parallel_bench(str(smollm2_path), args, said.append, progress_every_s=EVERY_S)
    assert set(report["levels"]["2"]) == {"timeshare", "llama_server"}
    waits = [line for line in said if " s so far" in line]
    # each system's streams, named with the seconds so far and the server's word
    ours = re.compile(r"^timeshare, parallel 2: 2 stream\(s\), stream [12]: \d+ s so far \(m: \w+")
    theirs = re.compile(r"^llama-server -np 2: 2 stream\(s\), stream [12]: \d+ s so far \(/health \d+")
    assert any(ours.match(line) for line in waits), said
    assert any(theirs.match(line) for line in waits), said


def test_bench_api_says_how_a_long_turn_stands(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    said: list[str] = []
    report = bench_api.run_api_bench(
        [str(smollm2_path), str(gemma3_path)],
        context=64,
        rounds=1,
        switch_only=True,
        progress=said.append,
        progress_every_s=EVERY_S,
    )
    ids = [m["id"] for m in report["models"]]
    waits = [line for line in said if " s so far" in line]
    for mid in ids:  # the counted turn of each model, by system, model and round
        turn = re.compile(rf"^timeshare_switch {re.escape(mid)} turn 1/1: \d+ s so far \(")
        assert any(turn.match(line) for line in waits), said
