"""A worker's tenancy after close: a last status (its budget) reads nothing and warns of nothing
(every worker exit logged "reading the arena's leases failed: [Errno 9] Bad file descriptor")."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from timeshare.core.config.schema import ArenaConfig, ModelConfig
from timeshare.core.wire.spec import WorkerSpec
from timeshare.core.worker.tenancy import ArenaTenancy


def test_the_budget_after_close_is_the_last_one_read_without_a_warning(
    tmp_path: Path, smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = WorkerSpec(
        model=ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, idle_sleep_s=None),
        arena=ArenaConfig(vram_budget="2GiB"),
        arena_dir=str(tmp_path / "arena"),
        kv_dir=str(tmp_path / "kv"),
    )
    tenancy = ArenaTenancy(spec)
    before = tenancy.budget_bytes
    assert before > 0
    tenancy.close()
    with caplog.at_level(logging.WARNING):
        tenancy._budget_read_at = 0.0
        assert tenancy.budget_bytes == before
    assert "leases failed" not in caplog.text
