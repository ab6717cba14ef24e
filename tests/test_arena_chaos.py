"""``timeshare arena-test --chaos``: real workers under random contention while the harness kills
(kill -9) and stops (SIGSTOP, longer than hung_holder_s, so the pool's watchdog kills a stopped
holder) workers; the pool restarts them. The arena invariant holds, every answered request equals
its uncontended reference (batched ones too: each worker answers two at once), no request is lost,
and every worker answers again afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeshare.core.diagnostics.arena_test_chaos import CHAOS_ERRORS
from timeshare.core.diagnostics.arena_test_checks import check_intervals

SECONDS = 60
HUNG_S = 3.0
STOP_FOR_S = 5.0  # > HUNG_S: a stopped holder with someone waiting is killed by the watchdog
PARALLEL = 2  # the clients outnumber the workers: answers are batched too (and must still match)


def test_killed_holdings_are_checked_up_to_the_kill() -> None:
    """A holder killed before it released left only its "acquired" record: the checker closes it at
    the kill, so an overlap with the next holder is still seen (and none when the next holder took
    the token after the kill)."""
    acquired = {"kind": "acquired", "model": "a", "pid": 1, "start": 1.0, "end": 1.0}
    killed = {"kind": "killed", "model": "a", "pid": 1, "start": 2.0, "end": 2.0}
    after = {"kind": "token", "model": "b", "pid": 2, "start": 2.5, "end": 3.0}
    check = check_intervals([acquired, killed, after])
    assert check.ok and check.killed_intervals == 1 and check.unclosed_intervals == 0
    during = {"kind": "token", "model": "b", "pid": 2, "start": 1.5, "end": 3.0}
    check = check_intervals([acquired, killed, during])
    assert not check.ok and len(check.token_overlaps) == 1
    # released normally: its "token" interval covers it, nothing synthesized
    released = {"kind": "token", "model": "a", "pid": 1, "start": 1.0, "end": 1.2}
    check = check_intervals([acquired, released, killed, after])
    assert check.ok and check.killed_intervals == 0
    assert check_intervals([acquired]).unclosed_intervals == 1


@pytest.mark.slow
def test_chaos_run_loses_nothing_and_keeps_the_invariant(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    arena = tmp_path / "arena"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "timeshare",
            "arena-test",
            "--chaos",
            "--workers",
            "3",
            "--model",
            str(smollm2_path),
            "--model",
            str(gemma3_path),
            "--seconds",
            str(SECONDS),
            "--kill-every",
            "8",
            "--stop-every",
            "12",
            "--stop-for",
            str(STOP_FOR_S),
            "--hung-holder-s",
            str(HUNG_S),
            "--parallel",
            str(PARALLEL),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=1800,  # generous: a loaded CI machine; nothing here is timed
        env={**os.environ, "TIMESHARE_VRAM_ARENA": str(arena)},
    )
    assert proc.stdout, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    summary = {k: v for k, v in data.items() if not k.startswith("memory")}
    # the invariant, from the interval logs (holdings of killed workers checked up to the kill)
    assert data["overlaps"] == 0, summary
    assert data["outside_token"] == 0, summary
    assert data["token_overlaps"] == 0, summary
    assert data["malformed_records"] == 0, summary
    assert data["deadlocks"] == 0, summary
    # every request got an answer or a documented error; answers equal the uncontended reference
    assert data["lost_requests"] == 0, (summary, proc.stderr[-4000:])
    assert data["errors"] == 0, summary
    assert set(data["failed_requests"]) <= set(CHAOS_ERRORS), summary
    assert data["documented_errors"] == list(CHAOS_ERRORS)
    assert data["outputs_match_reference"] is True, summary
    assert data["requests"] > 0 and data["handoffs"] > 0, summary
    assert data["parallel"] == PARALLEL, summary
    # the chaos happened, while the workers contended, and the pool brought every worker back
    assert data["chaos"] is True
    assert data["kills"] >= 3 and data["stops"] >= 2, summary
    assert data["chaos_under_contention"] >= 1, summary
    assert data["crashes"] >= data["kills"], summary  # each kill -9 is seen as a crash
    assert data["restarts"] >= 1, summary
    assert data["watchdog_kills"] >= 1, summary  # a stopped holder outlived hung_holder_s
    assert data["killed_intervals"] >= 1, summary  # a killed holder's holding was checked
    assert all(data["recovered"].values()) and len(data["recovered"]) == 3, summary
    assert data["ok"] is True, summary
    assert proc.returncode == 0, proc.stderr[-4000:]
