"""Two demo-model pools on a VRAM budget, as the budget tests start them (real workers)."""

from __future__ import annotations

from pathlib import Path

from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.pool.supervisor import Pool
from timeshare.core.state import ModelState

SMOL, GEMMA = "smol", "gemma"
WAIT = 300.0  # generous: the machine may be loaded; nothing here is timed


def start_pool(home: Path, smollm2: Path, gemma3: Path, budget: str, **pool_kw: object) -> Pool:
    config = Config(
        models=(
            ModelConfig(id=SMOL, path=str(smollm2), n_ctx=256, idle_sleep_s=None),
            ModelConfig(id=GEMMA, path=str(gemma3), n_ctx=256, idle_sleep_s=None),
        ),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget=budget),
    )
    pool = Pool(
        config,
        arena_dir=home / "arena",
        log_dir=home / "log",
        kv_dir=home / "kv",
        event_log=str(home / "intervals.jsonl"),
        **pool_kw,  # type: ignore[arg-type]
    )
    pool.start()
    pool.wait_ready(timeout=WAIT)
    assert all(m.state is not ModelState.FAILED for m in pool.snapshot().models), pool.snapshot()
    return pool
