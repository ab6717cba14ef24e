"""``timeshare bench embed`` (core/diagnostics/bench_embed.py) says what it is doing phase by phase
and how a long wait stands (``timeout 200 timeshare bench embed`` on the GPU ended with nothing
to say where it was), ends a request that takes longer than ``--timeout`` naming it, and stops
the servers it started on a SIGTERM while it waits (timeshare/cli.py's handling, checked here
for this bench's llama-server wait).
It gives llama-server the sequences and CPU threads Timeshare's worker computes with (the CPU
comparison of issue 45 is one of threads). llama-server is played by tests/_fake_llama_server.py;
nothing is measured here."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from timeshare.core.diagnostics import bench_api_procs
from timeshare.core.diagnostics.bench_api_procs import LlamaServer, watched
from timeshare.core.errors import TimeshareError
from timeshare.core.worker.threads import cpu_threads

FAKE = Path(__file__).parent / "_fake_llama_server.py"


def left_behind(tmp_path: Path) -> list[str]:
    """Processes that still run from the bench: its serve, workers, fake llama-server (as
    tests/test_bench_api.py finds them)."""
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"TMPDIR={tmp_path}" in environ or (str(FAKE) in cmdline and str(tmp_path) in cmdline):
            left.append(f"{proc.name}: {cmdline[:200]}")
    return left


def fake_binary(tmp_path: Path) -> Path:
    """An executable "llama-server" that runs the fake."""
    server = tmp_path / "llama-server"
    server.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    server.chmod(0o755)
    return server


def _command(tmp_path: Path, *argv: str) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, TMPDIR=str(tmp_path))  # the bench's work dir lands in tmp_path
    return [sys.executable, "-m", "timeshare", "bench", "embed", *argv], env


def test_watched_says_how_a_wait_stands_and_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_api_procs, "PROGRESS_EVERY_S", 0.05)
    said: list[str] = []
    release = threading.Event()
    with pytest.raises(
        TimeshareError, match=r"^timeshare: 2048 inputs: no answer in 0.4 s \(m: resident, busy\)$"
    ):
        watched(release.wait, "timeshare: 2048 inputs", 0.4, said.append, lambda: "m: resident, busy")
    release.set()
    assert said and all(
        s.startswith("timeshare: 2048 inputs: ") and s.endswith("(m: resident, busy)") for s in said
    )
    assert watched(lambda: 7, "quick", 5.0) == 7

    def fails() -> None:
        raise TimeshareError("/v1/embeddings answered 500")

    with pytest.raises(TimeshareError, match="answered 500"):
        watched(fails, "failing", 5.0)


def test_a_llama_server_that_never_gets_healthy_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_LLAMA_LOADING_S", "3600")
    monkeypatch.setattr(bench_api_procs, "PROGRESS_EVERY_S", 0.1)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    log = tmp_path / "llama-server.log"
    log.write_text("llama_model_load: loading model tensors, this can take a while...\n")
    server = LlamaServer(str(fake_binary(tmp_path)), str(model), 256, False, log)
    said: list[str] = []
    try:
        with pytest.raises(TimeshareError) as info:
            server.wait_healthy(said.append, timeout_s=1.0)
    finally:
        server.stop()
    message = str(info.value)
    assert message.startswith("llama-server was not healthy within 1 s (/health 503")
    assert "loading model tensors" in message  # its log's tail
    assert said and said[0].startswith("llama-server: ") and "/health" in said[-1]


def test_bench_embed_says_each_phase(tmp_path: Path, smollm2_path: Path) -> None:
    cmd, env = _command(
        tmp_path,
        "--model",
        str(smollm2_path),
        "--counts",
        "1,3",
        "--rounds",
        "1",
        "--n-ctx",
        "256",
        "--parallel",
        "2",
    )
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = [line.removeprefix("bench embed: ") for line in done.stderr.splitlines()]
    phases = [
        "timeshare serve, parallel 2: starting, loading SmolLM2-135M-Instruct.Q4_1.gguf",
        "timeshare serve: ready in ",
        "timeshare: warm-up, 1 input ...",
        "timeshare: warm-up, 1 input: ",
        "timeshare: 1 input(s), round 1/1 ...",
        "timeshare: 1 input(s), round 1/1: ",
        "timeshare: 3 input(s), round 1/1: ",
        "timeshare serve: stopping",
    ]
    at = 0
    for phase in phases:  # in this order
        at = next((i for i in range(at, len(lines)) if lines[i].startswith(phase)), -1)
        assert at >= 0, (phase, done.stderr)
    assert "inputs/s" in done.stdout
    assert left_behind(tmp_path) == []


def test_sigterm_ends_the_bench_and_its_servers(tmp_path: Path, smollm2_path: Path) -> None:
    """SIGTERM while it waits for a llama-server that never gets healthy: the bench exits and
    leaves no serve, worker or llama-server behind."""
    server = fake_binary(tmp_path)
    cmd, env = _command(
        tmp_path,
        "--model",
        str(smollm2_path),
        "--counts",
        "1",
        "--rounds",
        "1",
        "--n-ctx",
        "256",
        "--parallel",
        "2",
        "--llama-server",
        str(server),
    )
    env["FAKE_LLAMA_LOADING_S"] = "3600"
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    seen: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "llama-server: " in line and "/health 503" in line:  # its first progress line
                break
        else:
            raise AssertionError("".join(seen))
        t, tb = cpu_threads()
        starting = f"llama-server --embeddings --pooling mean -np 2 -t {t} -tb {tb}: starting"
        assert any(starting in s for s in seen), seen
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert proc.stderr is not None
        rest = proc.stderr.read()
        proc.stderr.close()
    assert proc.returncode != 0, rest
    deadline = time.monotonic() + 30  # the group's SIGKILL is sent; the kernel reaps them
    while left_behind(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_behind(tmp_path) == []


def test_bad_options_are_refused_before_anything_starts(
    tmp_path: Path, smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each option the bench cannot run with: exit 2 naming it, no traceback (``--counts 1,x`` and
    ``--rounds 0`` raised ValueError and StatisticsError, the latter after starting the server),
    and nothing started."""
    from timeshare.core.diagnostics import bench_embed

    bad = [
        ({"timeout": 0.0}, "--timeout takes seconds above 0"),
        ({"timeout": -5.0}, "--timeout takes seconds above 0"),
        ({"counts": "1,x"}, "--counts takes counts from 1 to 2048, e.g. 1,64,2048 (not '1,x')"),
        ({"counts": "0"}, "--counts takes counts from 1 to 2048"),
        ({"counts": "2049"}, "--counts takes counts from 1 to 2048"),
        ({"counts": ","}, "--counts takes counts from 1 to 2048"),
        ({"rounds": 0}, "--rounds takes 1 or more"),
        ({"words": 0}, "--words takes 1 or more"),
        ({"parallel": -1}, "--parallel takes 0 (the build's default) or more"),
        ({"interleave": True}, "--interleave takes turns with llama-server: give --llama-server PATH"),
    ]
    for fields, message in bad:
        assert bench_embed.main(_args(model=str(smollm2_path), **fields)) == 2, fields
        assert f"timeshare bench embed: {message}" in capsys.readouterr().err, fields
    assert left_behind(tmp_path) == []


def test_interleave_takes_turns_with_both_servers_up(tmp_path: Path, smollm2_path: Path) -> None:
    """``--interleave``: llama-server is up before Timeshare's first measured request, each round
    has one request of each, the first alternating, and Timeshare's serve stops only after the
    last; the report has both systems' rows with the load after each request."""
    cmd, env = _command(
        tmp_path,
        "--model",
        str(smollm2_path),
        "--counts",
        "2",
        "--rounds",
        "2",
        "--n-ctx",
        "256",
        "--parallel",
        "2",
        "--llama-server",
        str(fake_binary(tmp_path)),
        "--interleave",
        "--json",
    )
    env["FAKE_LLAMA_N_EMBD"] = "576"  # SmolLM2's: the bench compares the two servers' vectors
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = [line.removeprefix("bench embed: ") for line in done.stderr.splitlines()]
    measured = [
        line.split(" ...")[0] for line in lines if " input(s), round " in line and line.endswith(" ...")
    ]
    assert measured == [
        "timeshare: 2 input(s), round 1/2",
        "llama-server: 2 input(s), round 1/2",
        "llama-server: 2 input(s), round 2/2",
        "timeshare: 2 input(s), round 2/2",
    ]
    healthy = next(i for i, line in enumerate(lines) if line.startswith("llama-server: healthy in"))
    first = lines.index("timeshare: 2 input(s), round 1/2 ...")
    last = max(i for i, line in enumerate(lines) if line.startswith("llama-server: 2 input(s), round"))
    assert healthy < first < last < lines.index("timeshare serve: stopping")
    report = json.loads(done.stdout)
    assert report["interleaved"] is True
    for system in ("timeshare", "llama_server"):
        row = report["systems"][system]["2"]
        assert len(row["seconds"]) == len(row["load_1min"]) == 2
    assert report["systems"]["timeshare"]["2"]["least_cosine_vs_llama_server"] < 1.0
    assert left_behind(tmp_path) == []


def _args(**fields: object) -> argparse.Namespace:
    base: dict[str, object] = dict(
        model=None,
        counts="1",
        words=8,
        rounds=1,
        n_ctx=256,
        parallel=2,
        llama_server=None,
        flash_attn=False,
        json=False,
        timeout=300.0,
        interleave=False,
    )
    return argparse.Namespace(**{**base, **fields})


def test_llama_server_gets_the_workers_sequences_and_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-np`` is the worker's sequences (``--parallel 0``: the build's default, 4 on a GPU build,
    where llama-server got 1 before) and ``-t``/``-tb`` the worker's threads (llama-server's own
    default before: the physical cores for both)."""
    from timeshare.core.diagnostics import bench_embed
    from timeshare.core.worker import device

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    binary = str(fake_binary(tmp_path))
    t, tb = cpu_threads()

    def flags(command: list[str]) -> dict[str, str]:
        return {k: command[command.index(k) + 1] for k in ("-np", "-c", "-t", "-tb")}

    server = bench_embed.start_llama_server(binary, str(model), _args(parallel=3), tmp_path / "a.log")
    server.stop()
    assert flags(server.command) == {"-np": "3", "-c": str(256 * 3), "-t": str(t), "-tb": str(tb)}
    monkeypatch.setattr(device, "default_parallel", lambda: 4)  # a GPU build's default
    server = bench_embed.start_llama_server(binary, str(model), _args(parallel=0), tmp_path / "b.log")
    server.stop()
    assert flags(server.command) == {"-np": "4", "-c": str(256 * 4), "-t": str(t), "-tb": str(tb)}
    monkeypatch.setenv("TIMESHARE_CPU_THREADS", "1")  # the workers' threads: llama-server's too
    server = bench_embed.start_llama_server(binary, str(model), _args(parallel=2), tmp_path / "c.log")
    server.stop()
    assert flags(server.command) == {"-np": "2", "-c": str(256 * 2), "-t": "1", "-tb": "1"}
