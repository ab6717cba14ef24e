"""``kill -9`` of `timeshare serve` (no handler runs, nothing is cleaned up): its workers must not
outlive it, whatever they were doing (one decoding with the token pinned, one waiting for the
token, one idle), and the next start in the same home
must be clean (it serves the same answers, its workers are new). The workers are found in /proc
(by their command line), not asked of Timeshare. The tray app's case is in test_app_xvfb.py."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from _api_util import SMOL, serving, start_serve, write_config
from _proc_util import alive, wait_until, workers_of

pytestmark = pytest.mark.slow

SMOL2 = "smollm2-second"
SMOL3 = "smollm2-third"
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
    models = [SMOL, SMOL2, SMOL3]
    config = write_config(home / "timeshare.toml", [(m, smollm2_path) for m in models])
    served = start_serve(home, config=config)
    waiter_errors: list[BaseException] = []
    try:
        served.wait_ready(models)
        expected = _complete(served.url, SMOL)
        workers = workers_of(home)
        assert len(workers) == 3, workers  # the oracle sees them: it has teeth
        # SMOL2 decodes a long answer holding the token (pinned: it will not yield), SMOL3 waits
        # for the token, SMOL is idle (released)
        r = httpx.post(f"{served.url}/timeshare/v1/models/{SMOL2}/pin", timeout=60)
        assert r.status_code == 200, r.text
        with httpx.stream(
            "POST",
            f"{served.url}/v1/completions",
            json={"model": SMOL2, "prompt": "1, 2, 3, 4,", "max_tokens": 1500, "stream": True},
            timeout=120,
        ) as stream:
            lines = stream.iter_lines()
            assert any(line.startswith("data: {") for line in lines)

            def wait_for_the_token() -> None:
                try:
                    _complete(served.url, SMOL3)
                except BaseException as exc:  # the server dies under it: expected
                    waiter_errors.append(exc)

            waiter = threading.Thread(target=wait_for_the_token, daemon=True)
            waiter.start()
            served.wait_until(
                lambda s: any(
                    m["id"] == SMOL3 and "waiting for the GPU" in str(m["reason"])
                    for m in s["models"]  # type: ignore[attr-defined]
                ),
                f"{SMOL3} to wait for the token",
                60,
            )
            os.kill(served.proc.pid, signal.SIGKILL)
            assert served.proc.wait(30) == -signal.SIGKILL
        waiter.join(60)
        assert waiter_errors, "the waiting request was answered although its server was killed"
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait(30)
    wait_until(lambda: not any(alive(pid) for pid in workers), 60, f"workers {workers} to exit")
    assert workers_of(home) == []
    # the next start in the same home: the stale address file and arena state do not get in the way
    with serving(home, config=config) as again:
        again.wait_ready(models)
        for m in models:
            assert _complete(again.url, m) == expected, m
        fresh = workers_of(home)
        assert len(fresh) == 3 and not set(fresh) & set(workers), (fresh, workers)
    assert again.proc.returncode == 0, again.log_text()[-3000:]
    wait_until(lambda: workers_of(home) == [], 30, "the second run's workers to exit")
