"""The hung-holder watchdog: a worker that holds the GPU while another model waits and answers no
status ping for ``arena.hung_holder_s`` is killed by its pool and restarted; the waiter goes on.

Real workers on the demo models; the hang is a SIGSTOP (a stopped process answers nothing)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
from _proc_util import alive, wait_until
from timeshare.core.arena.dirs import read_holder
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.config.validate import validate
from timeshare.core.errors import ConfigError
from timeshare.core.pool.supervisor import Pool
from timeshare.core.pool.watchdog import tick_period
from timeshare.core.state import EventKind, PoolEvent

WAIT = 600.0  # generous: loaded machines; nothing here is timed
HUNG_S = 5.0
PROMPT = "The capital of France is"


def test_hung_holder_s_is_validated() -> None:
    assert ArenaConfig().hung_holder_s == 30.0
    assert validate({"arena": {"hung_holder_s": 0}}, check_paths=False).arena.hung_holder_s == 0.0
    for bad, problem in ((-1, "must be >= 0"), ("x", "must be a number"), (float("inf"), "must be a finite number")):
        with pytest.raises(ConfigError) as info:
            validate({"arena": {"hung_holder_s": bad}}, check_paths=False)
        assert f"arena.hung_holder_s: {problem}" in str(info.value)


def test_tick_period() -> None:
    assert tick_period(0) == 1.0  # off: it only looks whether it was turned on
    assert tick_period(30) == 1.0
    assert tick_period(2) == pytest.approx(0.4)
    assert tick_period(0.01) == 0.05


def test_a_stopped_holder_is_killed_the_waiter_answered_and_it_comes_back(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    arena = tmp_path / "arena"
    config = Config(
        models=(
            ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512, n_seq=2, idle_sleep_s=None),
            ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=512, n_seq=2, idle_sleep_s=None),
        ),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, hung_holder_s=HUNG_S),
    )
    pool = Pool(
        config,
        arena_dir=arena,
        log_dir=tmp_path / "log",
        kv_dir=tmp_path / "kv",
        restart_backoff_s=0.2,
    )
    events: list[PoolEvent] = []
    pool.subscribe(events.append)
    pool.start()
    stopped: int | None = None
    try:
        pool.wait_ready(timeout=WAIT)

        def answer(model: str) -> str:
            return pool.generate(model, prompt=PROMPT, max_tokens=8).result(timeout=WAIT).text

        gemma_ref = answer("gemma")
        smol_ref = answer("smol")  # smol answers last: it keeps the GPU (nobody asked for it)

        def smol_holds() -> bool:
            record = read_holder(arena)
            return record is not None and record.model == "smol"

        wait_until(smol_holds, WAIT, "smol holding the GPU")
        smol_pid = next(m.pid for m in pool.snapshot().models if m.id == "smol")
        assert smol_pid is not None
        os.kill(smol_pid, signal.SIGSTOP)  # hung: its doorbell never answers, nor its pings
        stopped = smol_pid

        assert answer("gemma") == gemma_ref  # answered once the watchdog killed the holder
        assert not alive(smol_pid)
        killed = [e for e in events if e.kind is EventKind.CRASHED and e.model == "smol"]
        assert len(killed) == 1, [e.message for e in killed]
        why = str(killed[0].extra.get("watchdog", ""))
        assert "held the GPU while gemma waited" in why and "answered no status ping" in why
        assert killed[0].message.startswith("smol was killed: it held the GPU")
        reasons = [m.reason for e in events for m in e.snapshot.models if m.id == "smol"]
        assert any("killed because it held the GPU while gemma waited" in r for r in reasons)

        # the killed model restarts by itself and answers as before
        wait_until(
            lambda: any(e.kind is EventKind.RESTARTED and e.model == "smol" for e in events),
            WAIT,
            "smol restarted",
        )
        assert answer("smol") == smol_ref
        snap = {m.id: m for m in pool.snapshot().models}
        assert snap["smol"].pid not in (None, smol_pid) and snap["smol"].restarts == 1
        assert snap["gemma"].restarts == 0  # the waiter was never touched
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        pool.stop()
