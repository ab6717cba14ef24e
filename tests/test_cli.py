"""The CLI end to end: `timeshare status|models|pin|unpin|sleep|wake|chat` as subprocesses against a
real `timeshare serve` with the two demo models, found through the address file it wrote."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _api_util import GEMMA, SMOL, Served, run_cli, seed_gemma_cache, serve_env, serving

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- nothing running ---------------------------------------------------------------------------


def test_nothing_running_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for argv in (["status"], ["models", "--json"], ["pin", SMOL], ["chat", SMOL, "hi"]):
        done = run_cli(home, *argv)
        assert done.returncode == 1, argv
        address = home / "run" / "api.json"
        assert done.stderr.strip() == (
            f"timeshare {argv[0]}: Timeshare is not running (no address in {address}); "
            "start it with `timeshare` or `timeshare serve`."
        )
        assert done.stdout == ""


def test_a_stale_address_file_says_not_running(tmp_path: Path) -> None:
    home = tmp_path / "home"
    address = home / "run" / "api.json"
    address.parent.mkdir(parents=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    address.write_text(json.dumps({"url": f"http://127.0.0.1:{_free_port()}", "pid": int(dead.stdout)}))
    done = run_cli(home, "status")
    assert done.returncode == 1
    assert "Timeshare is not running" in done.stderr and "has exited" in done.stderr
    # a live pid but nothing listening: the connection attempt decides
    address.write_text(json.dumps({"url": f"http://127.0.0.1:{_free_port()}", "pid": os.getpid()}))
    done = run_cli(home, "status")
    assert done.returncode == 1
    assert "Timeshare is not running" in done.stderr and "does not answer" in done.stderr


def test_url_override_that_does_not_answer(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    done = run_cli(tmp_path / "home", "status", "--url", url)
    assert done.returncode == 1
    assert f"Cannot reach Timeshare at {url}" in done.stderr and "--url" in done.stderr


# ---- against a running instance ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("cli-home")
    seed_gemma_cache(home, gemma3_path)
    address = home / "run" / "api.json"
    with serving(home) as server:  # no config file: `timeshare serve` serves the demo models
        assert stat.S_IMODE(address.stat().st_mode) == 0o600
        record = json.loads(address.read_text())
        assert record["key_required"] is False and record["url"] == server.url
        assert server.url.startswith("http://127.0.0.1:")
        server.wait_ready([SMOL, GEMMA])
        yield server
    # SIGTERM: every worker stopped, exit 0, the address file removed
    assert server.proc.returncode == 0, server.log_text()[-3000:]
    assert not address.exists()


def test_models(served: Served) -> None:
    done = run_cli(served.home, "models")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["ID", "NAME"]
    assert {line.split()[0] for line in lines[1:]} == {SMOL, GEMMA}
    gemma_line = next(line for line in lines if line.startswith(GEMMA))
    assert "fallback" in gemma_line and "Gemma Terms of Use" in gemma_line
    done = run_cli(served.home, "models", "--json")
    assert done.returncode == 0
    assert {m["id"] for m in json.loads(done.stdout)["data"]} == {SMOL, GEMMA}


def test_status(served: Served) -> None:
    done = run_cli(served.home, "status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert {m["id"] for m in status["models"]} == {SMOL, GEMMA}
    assert all(m["state"] in ("resident", "released", "sleeping") for m in status["models"])
    done = run_cli(served.home, "status")
    assert done.returncode == 0
    assert done.stdout.startswith("GPU holder: ")
    table = done.stdout.splitlines()[1:]
    assert table[0].split()[:3] == ["MODEL", "STATE", "BUSY"]
    assert {row.split()[0] for row in table[1:]} == {SMOL, GEMMA}


def test_pin_unpin_sleep_wake(served: Served) -> None:
    done = run_cli(served.home, "pin", SMOL)
    assert done.returncode == 0 and done.stdout.startswith(f"{SMOL}: pinned"), done.stderr
    assert served.model_status(SMOL)["pinned"] is True
    done = run_cli(served.home, "unpin", SMOL)
    assert done.returncode == 0 and done.stdout.startswith(f"{SMOL}: unpinned")
    assert served.model_status(SMOL)["pinned"] is False
    done = run_cli(served.home, "sleep", GEMMA)
    assert done.returncode == 0 and done.stdout.startswith(f"{GEMMA}: put to sleep")
    served.wait_until(lambda s: _state(s, GEMMA) == "sleeping", "gemma to sleep", 60)
    done = run_cli(served.home, "wake", GEMMA)
    assert done.returncode == 0 and done.stdout.startswith(f"{GEMMA}: woken")
    served.wait_until(lambda s: s["holder"] == GEMMA, "gemma to take the GPU", 60)


def _state(status: dict[str, object], model: str) -> str:
    return next(m["state"] for m in status["models"] if m["id"] == model)  # type: ignore[attr-defined]


def test_unknown_model(served: Served) -> None:
    for argv in (["pin", "nope"], ["chat", "nope", "hi"]):
        done = run_cli(served.home, *argv)
        assert done.returncode == 1, argv
        assert "'nope' does not exist" in done.stderr and SMOL in done.stderr and "HTTP 404" in done.stderr


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_chat(served: Served, model: str) -> None:
    done = run_cli(served.home, "-v", "chat", model, "What is the capital of France?", "--max-tokens", "24")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), f"{model} answered nothing"
    assert done.stdout.endswith("\n")
    assert f"[{model}: " in done.stderr and "completion tokens" in done.stderr


def test_chat_bad_max_tokens(served: Served) -> None:
    done = run_cli(served.home, "chat", SMOL, "hi", "--max-tokens", "0")
    assert done.returncode == 2 and "--max-tokens must be at least 1" in done.stderr


def test_chat_streams_and_ctrl_c_cancels(served: Served) -> None:
    before = served.status()["switch_stats"]["cancelled_by_disconnect"]  # type: ignore[index]
    with subprocess.Popen(
        [sys.executable, "-m", "timeshare", "chat", GEMMA, "Count: 1, 2, 3, 4,", "--max-tokens", "1500"],
        env=serve_env(served.home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.read1(64)  # type: ignore[attr-defined]
            assert first, "no output before the process ended"
            assert proc.poll() is None, "the answer came only at the end, not streamed"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    served.wait_until(
        lambda s: s["switch_stats"]["cancelled_by_disconnect"] > before,  # type: ignore[index]
        "the server to cancel the abandoned generation",
        60,
    )
    served.wait_until(lambda s: not _busy(s, GEMMA), "gemma to become idle", 60)


def _busy(status: dict[str, object], model: str) -> bool:
    return bool(next(m["busy"] for m in status["models"] if m["id"] == model))  # type: ignore[attr-defined]
