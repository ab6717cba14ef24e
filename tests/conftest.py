"""Shared fixtures. Every test runs with TIMESHARE_HOME in a temp dir, so nothing touches the
user's real config, data or arena, and with TIMESHARE_VRAM_BUDGET=one-model: a config that leaves
arena.vram_budget at "auto" gets one model at a time on the device, so the tests that assert GPU
switching switch (the budget tests set a budget, or delete the variable)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import llama_cpp
    from _e_worker_util import WorkerHandle
    from timeshare.core.pool.supervisor import Pool

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# also here, not only in the fixture below: module-scoped pools start before any function fixture
os.environ["TIMESHARE_VRAM_BUDGET"] = "one-model"


@pytest.fixture(autouse=True)
def timeshare_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("TIMESHARE_HOME", str(home))
    monkeypatch.delenv("TIMESHARE_VRAM_ARENA", raising=False)
    monkeypatch.setenv("TIMESHARE_VRAM_BUDGET", "one-model")
    yield home


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from timeshare.core.config import demo

    return demo.smollm2_path()


@pytest.fixture(scope="session")
def gemma3_path(demo_cache: Path) -> Path:
    from timeshare.core.config import demo

    return demo.gemma3_path(cache=demo_cache)


@pytest.fixture
def handles() -> Iterator[list[WorkerHandle]]:
    """The worker handles (tests/_e_worker_util.py) a test appends here are closed after it."""
    made: list[WorkerHandle] = []
    yield made
    for h in made:
        h.close()


# ---- residency: a small synthetic Q4_0 model (imported when a test asks: llama_cpp is heavy) ----


@pytest.fixture(scope="session")
def small_q4_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    from _residency_util import make_small_q4_0

    return make_small_q4_0(tmp_path_factory.mktemp("synthetic") / "small-q4_0.gguf", smollm2_path)


@pytest.fixture
def smol(smollm2_path: Path) -> Iterator[llama_cpp.Llama]:
    """SmolLM2 loaded as a CPU worker loads it (see _residency_util.load); a test module may
    define its own ``smol`` (an Engine, a worker) instead."""
    from _residency_util import load

    llm = load(smollm2_path)
    yield llm
    llm.close()


@pytest.fixture
def small_q4(small_q4_path: Path) -> Iterator[llama_cpp.Llama]:
    """The small Q4_0 model loaded as a CPU worker loads it (see _residency_util.load)."""
    from _residency_util import load

    llm = load(small_q4_path)
    yield llm
    llm.close()


@pytest.fixture
def pools() -> Iterator[list[Pool]]:
    """Pools a test started (tests/_budget_pool_util.start_pool), stopped after it."""
    made: list[Pool] = []
    yield made
    for p in made:
        p.stop()
