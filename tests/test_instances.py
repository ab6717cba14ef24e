"""One Timeshare per runtime dir (core/instance.py): `timeshare serve` and the tray app hold the
instance lock; a second one says which instance runs and exits non-zero. Real processes, each
with its own TIMESHARE_HOME and an empty pool (no model to load)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from _api_util import run_cli, serve_env, serving, stop_serve_proc
from _proc_util import wait_until
from timeshare.core.errors import InstanceRunningError
from timeshare.core.instance import InstanceLock, running_instance

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock and /proc")


def _empty_config(home: Path, port: int | None = None) -> Path:
    """A config file with no models (an empty pool starts at once)."""
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("[api]\n" + (f"port = {port}\n" if port else ""))
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _address(home: Path) -> dict[str, object]:
    record: dict[str, object] = json.loads((home / "run" / "api.json").read_text())
    return record


# ---- the lock itself ---------------------------------------------------------------------------


def test_the_lock_is_exclusive_and_says_who_holds_it(tmp_path: Path) -> None:
    assert running_instance(tmp_path) is None
    first = InstanceLock.acquire("serve", tmp_path)
    try:
        info = running_instance(tmp_path)
        assert info is not None and info.pid == os.getpid() and info.kind == "serve"
        with pytest.raises(InstanceRunningError) as refused:
            InstanceLock.acquire("tray", tmp_path)
        assert refused.value.pid == os.getpid() and refused.value.kind == "serve"
        assert f"`timeshare serve` (pid {os.getpid()})" in str(refused.value)
        assert str(tmp_path) in str(refused.value)
    finally:
        first.release()
    assert running_instance(tmp_path) is None
    InstanceLock.acquire("tray", tmp_path).release()  # free again


def test_a_killed_holder_frees_the_lock(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from timeshare.core.instance import InstanceLock; "
        "InstanceLock.acquire('serve', Path(sys.argv[1])); print('held', flush=True); time.sleep(600)"
    )
    with subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            info = running_instance(tmp_path)
            assert info is not None and info.pid == holder.pid
            holder.send_signal(signal.SIGKILL)
            holder.wait(30)
        finally:
            if holder.poll() is None:
                holder.kill()
    assert running_instance(tmp_path) is None  # the kernel dropped the flock with the process
    InstanceLock.acquire("serve", tmp_path).release()


# ---- serve against serve -----------------------------------------------------------------------


def test_a_second_serve_on_the_same_runtime_dir_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = _empty_config(home)
    with serving(home, config=config) as first:
        record = _address(home)
        done = run_cli(home, "serve", "--config", str(config), "--port", "0")
        assert done.returncode == 1, done.stderr
        assert "Timeshare is already running" in done.stderr
        assert f"(pid {first.proc.pid})" in done.stderr and first.url in done.stderr
        assert "TIMESHARE_HOME" in done.stderr
        # the first instance still owns its address file, and the CLI still finds it
        assert _address(home) == record
        status = run_cli(home, "status")
        assert status.returncode == 0, status.stderr
    assert first.proc.returncode == 0
    assert not (home / "run" / "api.json").exists()


def test_instances_with_different_runtime_dirs_are_independent(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    with (
        serving(one, config=_empty_config(one)) as first,
        serving(two, config=_empty_config(two)) as second,
    ):
        assert first.url != second.url
        assert run_cli(one, "status").returncode == 0
        assert run_cli(two, "status").returncode == 0
        assert _address(one)["pid"] == first.proc.pid and _address(two)["pid"] == second.proc.pid


def test_a_port_held_by_another_timeshare_says_so(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    with serving(one, config=_empty_config(one)) as first:
        port = first.url.rsplit(":", 1)[1]
        done = run_cli(two, "serve", "--config", str(_empty_config(two)), "--port", port)
        assert done.returncode == 2, done.stderr
        assert f"Cannot listen on 127.0.0.1:{port}" in done.stderr
        assert "another Timeshare" in done.stderr and first.url in done.stderr
        # this runtime dir's address file names a live Timeshare on the port (an instance that
        # predates the lock): the message gives its pid
        (two / "run" / "api.json").write_text((one / "run" / "api.json").read_text())
        done = run_cli(two, "serve", "--config", str(_empty_config(two)), "--port", port)
        assert done.returncode == 2, done.stderr
        assert f"Timeshare (pid {first.proc.pid}, {first.url}) already serves there" in done.stderr


def test_serve_says_when_it_is_ready(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home, config=_empty_config(home)) as served:
        wait_until(lambda: "ready: 0 models at " in served.log_text(), 120, "the ready line")
        assert f"ready: 0 models at {served.url}\n" in served.log_text()
        r = httpx.get(f"{served.url}/health", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


# ---- the tray against serve --------------------------------------------------------------------


def _start_tray(home: Path, log: Path) -> subprocess.Popen[bytes]:
    env = serve_env(home, QT_QPA_PLATFORM="offscreen")
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "timeshare", "tray", "--background"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_the_tray_refuses_to_start_while_serve_runs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _empty_config(home, _free_port())
    with serving(home, config=home / "config" / "config.toml") as served:
        done = subprocess.run(
            [sys.executable, "-m", "timeshare", "tray", "--background"],
            env=serve_env(home, QT_QPA_PLATFORM="offscreen"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0, done.stdout + done.stderr
        assert "Timeshare is already running" in done.stderr
        assert f"`timeshare serve` (pid {served.proc.pid}), API at {served.url}" in done.stderr
        assert _address(home)["pid"] == served.proc.pid


def test_serve_refuses_to_start_while_the_tray_runs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _empty_config(home, _free_port())
    log = tmp_path / "tray.txt"
    tray = _start_tray(home, log)
    try:

        def tray_serves() -> bool:
            assert tray.poll() is None, log.read_text()
            try:
                return _address(home).get("pid") == tray.pid
            except (OSError, ValueError):
                return False

        wait_until(tray_serves, 120, "the tray app to record its API")
        url = _address(home)["url"]
        done = run_cli(home, "serve", "--port", "0")
        assert done.returncode == 1, done.stderr
        assert f"the Timeshare tray app (pid {tray.pid}), API at {url}" in done.stderr
        assert _address(home)["pid"] == tray.pid  # the tray's address file is untouched
        # a second tray still hands over to the first
        second = subprocess.run(
            [sys.executable, "-m", "timeshare", "tray"],
            env=serve_env(home, QT_QPA_PLATFORM="offscreen"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 0, second.stderr
        assert "already running" in second.stdout
    finally:
        rc = stop_serve_proc(tray)  # type: ignore[arg-type]
    assert rc == 0, log.read_text()
    assert not (home / "run" / "api.json").exists()
    # once the tray is gone, serve starts
    with serving(home) as served:
        assert _address(home)["pid"] == served.proc.pid


def test_status_names_a_running_instance_without_an_api(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = _empty_config(home)
    config.write_text("[api]\nenabled = false\n")
    log = tmp_path / "tray.txt"
    tray = _start_tray(home, log)
    try:

        def tray_holds_the_lock() -> bool:
            assert tray.poll() is None, log.read_text()
            info = running_instance(home / "run")
            return info is not None and info.pid == tray.pid

        wait_until(tray_holds_the_lock, 120, "the tray app to take the instance lock")
        done = run_cli(home, "status")
        assert done.returncode == 1
        assert f"Timeshare is running (the Timeshare tray app (pid {tray.pid}))" in done.stderr
        assert "api.enabled = false" in done.stderr
    finally:
        stop_serve_proc(tray)  # type: ignore[arg-type]
