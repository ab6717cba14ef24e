"""A hung loop thread is detected (issue 26): the watchdog's ping goes through the worker's loop
thread, so a worker whose loop thread hangs while it holds the GPU and another model waits is
killed and restarted, although its process runs and its reader thread still reads (before: the
reader answered the ping and the waiter waited until wait_timeout_s). The hang is injected into
real workers (SmolLM2 and Gemma-3) by a worker command that wraps the real one: once a marker
file exists, the loop thread blocks in its next task."""

from __future__ import annotations

import sys
from pathlib import Path

from _proc_util import alive, wait_until
from timeshare.core.arena.dirs import read_holder
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import EventKind, PoolEvent

WAIT = 600.0  # generous: loaded machines; nothing here is timed
HUNG_S = 5.0
PROMPT = "The capital of France is"

_HANGING_WORKER = """
import os, sys, time
from timeshare.core.worker import loop
marker = sys.argv.pop(1)
real = loop.Worker._dispatch
def dispatch(self, task):
    if self.spec.model.id == "smol" and os.path.exists(marker):
        time.sleep(10**6)  # the loop thread hangs; the process and its reader thread go on
    real(self, task)
loop.Worker._dispatch = dispatch
sys.exit(loop.main(sys.argv[1:]))
"""


def test_a_holder_whose_loop_thread_hangs_is_killed_and_the_waiter_answered(
    tmp_path: Path, smollm2_path: Path, gemma3_path: Path
) -> None:
    arena = tmp_path / "arena"
    marker = tmp_path / "hang-now"
    config = Config(
        models=(
            ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512, idle_sleep_s=None),
            ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=512, idle_sleep_s=None),
        ),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, hung_holder_s=HUNG_S),
    )
    pool = Pool(
        config,
        arena_dir=arena,
        log_dir=tmp_path / "log",
        kv_dir=tmp_path / "kv",
        restart_backoff_s=0.2,
        worker_argv=[sys.executable, "-c", _HANGING_WORKER, str(marker)],
    )
    events: list[PoolEvent] = []
    pool.subscribe(events.append)
    pool.start()
    try:
        pool.wait_ready(timeout=WAIT)

        def answer(model: str) -> str:
            gen = pool.generate(model, prompt=PROMPT, sampling=Sampling(max_tokens=4))
            return gen.result(timeout=WAIT).text

        answer("gemma")
        answer("smol")  # smol answers last: it keeps the GPU (nobody asked for it)
        wait_until(lambda: (r := read_holder(arena)) is not None and r.model == "smol", WAIT, "smol holding")
        smol_pid = pool.snapshot().model("smol").pid  # type: ignore[union-attr]
        assert smol_pid is not None
        marker.touch()  # smol's loop thread hangs at its next task (gemma's ring, or a ping)

        assert answer("gemma")  # answered once the watchdog killed the hung holder
        assert not alive(smol_pid)
        # events reach subscribers on the pool's event thread: the CRASHED one may come a moment later
        wait_until(
            lambda: any(e.kind is EventKind.CRASHED and e.model == "smol" for e in events),
            WAIT,
            "smol's CRASHED event",
        )
        killed = [e for e in events if e.kind is EventKind.CRASHED and e.model == "smol"]
        assert len(killed) == 1, [e.message for e in killed]
        why = str(killed[0].extra.get("watchdog", ""))
        assert "held the GPU while gemma waited" in why and "answered no status ping" in why
    finally:
        pool.stop()
