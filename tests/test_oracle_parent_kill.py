"""``kill -9`` of `timeshare serve` (no handler runs, nothing is cleaned up): its workers must not
outlive it, whatever they were doing (one decoding, one idle), and the next start in the same home
must be clean (it serves the same answers, its workers are new). The workers are found in /proc
(by their command line), not asked of Timeshare. The tray app's case is in test_app_xvfb.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from _api_util import SMOL, serving, start_serve, write_config
from _proc_util import alive, wait_until, workers_of

pytestmark = pytest.mark.slow

SMOL2 = "smollm2-second"
PROMPT = "The capital of France is"


def _complete(url: str, model: str, max_tokens: int = 8) -> str:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_kill9_of_serve_leaves_no_worker_and_the_next_start_is_clean(
    tmp_path: Path, smollm2_path: Path
) -> None:
    home = tmp_path / "home"
    config = write_config(home / "timeshare.toml", [(SMOL, smollm2_path), (SMOL2, smollm2_path)])
    served = start_serve(home, config=config)
    try:
        served.wait_ready([SMOL, SMOL2])
        expected = _complete(served.url, SMOL)
        workers = workers_of(home)
        assert len(workers) == 2, workers  # the oracle sees them: it has teeth
        # one worker mid-decode (a long streamed answer, its first piece read), the other idle
        with httpx.stream(
            "POST",
            f"{served.url}/v1/completions",
            json={"model": SMOL2, "prompt": "1, 2, 3, 4,", "max_tokens": 1500, "stream": True},
            timeout=120,
        ) as stream:
            lines = stream.iter_lines()
            assert any(line.startswith("data: {") for line in lines)
            os.kill(served.proc.pid, signal.SIGKILL)
            assert served.proc.wait(30) == -signal.SIGKILL
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait(30)
    wait_until(lambda: not any(alive(pid) for pid in workers), 60, f"workers {workers} to exit")
    assert workers_of(home) == []
    # the next start in the same home: the stale address file and arena state do not get in the way
    with serving(home, config=config) as again:
        again.wait_ready([SMOL, SMOL2])
        assert _complete(again.url, SMOL) == expected
        assert _complete(again.url, SMOL2) == expected
        fresh = workers_of(home)
        assert len(fresh) == 2 and not set(fresh) & set(workers), (fresh, workers)
    assert again.proc.returncode == 0, again.log_text()[-3000:]
    wait_until(lambda: workers_of(home) == [], 30, "the second run's workers to exit")
