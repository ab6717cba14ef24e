"""Helpers for the API and CLI tests: a real `timeshare serve` subprocess with its own TIMESHARE_HOME."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
READY_STATES = {"resident", "released", "sleeping"}


def serve_env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["TIMESHARE_HOME"] = str(home)
    env.pop("TIMESHARE_VRAM_ARENA", None)
    env.pop("TIMESHARE_API_KEY", None)
    env.update(extra)
    return env


def seed_gemma_cache(home: Path, gemma3_path: Path) -> None:
    """Let a fresh TIMESHARE_HOME reuse the Gemma GGUF the session assembled (core.demo checks the stamp)."""
    models = home / "cache" / "models"
    models.mkdir(parents=True, exist_ok=True)
    target = models / gemma3_path.name
    if not target.exists():
        target.symlink_to(gemma3_path)
        stamp = gemma3_path.with_suffix(".sha256-ok")
        target.with_suffix(".sha256-ok").write_text(stamp.read_text() if stamp.exists() else "")


def write_config(
    path: Path,
    models: Sequence[tuple[str, Path]],
    *,
    key: str | None = None,
    queue_limit: int | None = None,
    extra_model_lines: str = "",
) -> Path:
    lines = ["[api]"]
    if key is not None:
        lines.append(f'key = "{key}"')
    if queue_limit is not None:
        lines.append(f"queue_limit = {queue_limit}")
    for model_id, model_path in models:
        lines += ["", "[[models]]", f'id = "{model_id}"', f'path = "{model_path}"']
        if extra_model_lines:
            lines.append(extra_model_lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    home: Path
    url: str
    key: str | None
    config: Path | None
    log: Path

    @property
    def env(self) -> dict[str, str]:
        return serve_env(self.home)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self) -> dict[str, object]:
        response = httpx.get(f"{self.url}/timeshare/v1/status", headers=self.headers(), timeout=30)
        response.raise_for_status()
        result: dict[str, object] = response.json()
        return result

    def model_status(self, model_id: str) -> dict[str, object]:
        models = self.status()["models"]
        assert isinstance(models, list)
        return next(m for m in models if m["id"] == model_id)

    def wait_until(self, predicate: object, what: str, timeout: float = 180.0) -> dict[str, object]:
        """Poll the status until ``predicate(status)`` holds (a wait with a deadline, not a timing check)."""
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        status: dict[str, object] = {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"timeshare serve exited:\n{self.log_text()[-4000:]}"
            status = self.status()
            if predicate(status):
                return status
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(status)[:3000]}")

    def wait_ready(self, model_ids: Sequence[str], timeout: float = 240.0) -> None:
        def ready(status: dict[str, object]) -> bool:
            models = {m["id"]: m for m in status["models"]}  # type: ignore[attr-defined]
            failed = [m for m in models.values() if m["state"] == "failed"]
            assert not failed, f"models failed: {failed}\n{self.log_text()[-4000:]}"
            return all(models.get(i, {}).get("state") in READY_STATES for i in model_ids)

        self.wait_until(ready, f"models {list(model_ids)} to load", timeout)


def start_serve(
    home: Path,
    *,
    config: Path | None = None,
    args: Sequence[str] = (),
    key: str | None = None,
    timeout: float = 60,
) -> Served:
    home.mkdir(parents=True, exist_ok=True)
    log = home / "serve.log"
    cmd = [sys.executable, "-m", "timeshare"]
    if config is not None:
        cmd += ["--config", str(config)]
    cmd += ["serve", "--port", "0", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=serve_env(home), stdout=out, stderr=subprocess.STDOUT)
    address = home / "run" / "api.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"timeshare serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            record = json.loads(address.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        if record.get("pid") == proc.pid:
            return Served(proc, home, record["url"], key, config, log)
        time.sleep(0.05)
    stop_serve_proc(proc)
    raise AssertionError(f"timeshare serve wrote no address file in {timeout} s:\n{log.read_text()[-4000:]}")


def stop_serve_proc(proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError("timeshare serve did not exit within a minute of SIGTERM") from None
    return proc.returncode


@contextmanager
def serving(home: Path, **kwargs: object) -> Iterator[Served]:
    served = start_serve(home, **kwargs)  # type: ignore[arg-type]
    try:
        yield served
    finally:
        stop_serve_proc(served.proc)


def run_cli(
    home: Path, *argv: str, env_extra: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeshare", *argv],
        env=serve_env(home, **(env_extra or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@contextmanager
def serving_demo_models(
    home: Path,
    smollm2_path: Path,
    gemma3_path: Path,
    *,
    key: str | None = None,
    queue_limit: int | None = None,
    config_file: bool = True,
) -> Iterator[Served]:
    """`timeshare serve` in ``home`` with both demo models (SMOL, GEMMA) loaded. With
    ``config_file`` a config outside the home names them (with ``key`` and ``queue_limit``);
    without, serve falls back to the demo models. On exit it checks that the server was still
    running when its user was done, and that SIGTERM stopped it with exit 0."""
    seed_gemma_cache(home, gemma3_path)
    config = None
    if config_file:
        config = write_config(
            home / "elsewhere" / "timeshare.toml",
            [(SMOL, smollm2_path), (GEMMA, gemma3_path)],
            key=key,
            queue_limit=queue_limit,
        )
    with serving(home, config=config, key=key) as server:
        server.wait_ready([SMOL, GEMMA])
        yield server
        assert server.proc.poll() is None, server.log_text()[-3000:]
    assert server.proc.returncode == 0, server.log_text()[-3000:]


def woken(model: str) -> tuple[str, str]:
    """What `timeshare wake MODEL` prints once it is back: "on the GPU", or "in memory" on a CPU build."""
    return (f"{model}: woken (now on the GPU)\n", f"{model}: woken (now in memory)\n")
