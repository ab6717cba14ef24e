"""Fitting to the budget a model time-shares (issue 39, the H100 run's model b): under an auto
budget the second model is fitted to the arena's budget less what the first keeps at its deepest
level, not to what the first leaves free while parked at the weights level, so it loads with the
same settings as alone and the two switch. Real workers on the CPU build (host memory is the
device; ``$TIMESHARE_HOST_MEMORY`` makes the "card"); the rule itself, with the GPU's numbers, is
tests/test_fit.py::test_the_second_model_is_fitted_to_the_budget_it_time_shares_not_to_what_the_first_leaves_free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _budget_pool_util import WAIT
from _proc_util import wait_until
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.budget import AUTO_MARGIN_MIN, LeaseRecord
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState

A, B = "fit-a", "fit-b"
#: n_ctx and parallel auto (the fit chooses them); q8_0 keeps the KV cache small beside the weights
#: (the fit's KV share is 1/8 of the room: with f16 the second model's n_ctx would halve on a card
#: where the two do not fit together, since on the CPU build a parked model keeps its weights' host
#: shadow in the same memory)
KV_TYPE = "q8_0"
QUESTION = "Name three rivers of France and say where each one meets the sea."


def _start(home: Path, smollm2: Path, budget: str) -> Pool:
    config = Config(
        models=tuple(
            ModelConfig(
                id=m, path=str(smollm2), n_ctx=0, parallel=0, kv_cache_type=KV_TYPE, idle_sleep_s=None
            )
            for m in (A, B)
        ),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget=budget),
    )
    pool = Pool(config, arena_dir=home / "arena", log_dir=home / "log", kv_dir=home / "kv")
    pool.start()
    pool.wait_ready(timeout=WAIT)
    assert all(m.state is not ModelState.FAILED for m in pool.snapshot().models), pool.snapshot()
    return pool


def _answer(pool: Pool, model: str, text: str) -> tuple[str, bool]:
    result = pool.generate(
        model,
        messages=[{"role": "user", "content": text}],
        sampling=Sampling(max_tokens=16, temperature=0.0),
        conversation=f"conv-{model}",
    ).result(timeout=WAIT)
    return result.text, bool(result.switch.switched)


def _reserves(home: Path) -> dict[str, LeaseRecord]:
    arena = Arena(home / "arena")
    try:
        return {x.model: x for x in arena.leases() if x.kind == "reserve"}
    finally:
        arena.close()


def test_the_second_model_loads_as_if_alone_and_the_two_switch_on_a_card_that_holds_one(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1. a roomy machine: each model's answers (a no-switch reference) and what each keeps
    monkeypatch.setenv("TIMESHARE_VRAM_BUDGET", "auto")
    home = tmp_path / "roomy"
    pool = _start(home, smollm2_path, "auto")
    pools.append(pool)
    alone = {m: _answer(pool, m, QUESTION)[0] for m in (A, B)}
    snap = pool.snapshot()
    n_ctx = {m.n_ctx for m in snap.models}
    assert len(n_ctx) == 1 and n_ctx.pop() == 2048  # the CPU build's cap of the trained context
    weights = max(m.weight_bytes for m in snap.models)
    reserves = _reserves(home)
    assert set(reserves) == {A, B} and all(x.deepens > 0 for x in reserves.values())
    kv = max(x.deepens for x in reserves.values())  # what a deep release frees (the KV cache)
    pool.stop()

    # 2. a "card" that holds one model and the other's floor, not both at the weights level: the
    # budget (the card less the margin) is both reserves and one model's weights, less half a KV
    # cache. Before the fit used the budget it time-shares, the second model was fitted to what
    # the first left free at its load (on a GPU: fewer layers, a smaller context)
    budget = weights + sum(x.bytes for x in reserves.values()) - kv // 2
    monkeypatch.setenv("TIMESHARE_HOST_MEMORY", str(AUTO_MARGIN_MIN + budget))
    home = tmp_path / "card"
    pool = _start(home, smollm2_path, "auto")
    pools.append(pool)
    snap = pool.snapshot()
    # both fitted as if alone: the same n_ctx and parallel as on the roomy machine, all layers,
    # each to the budget it time-shares
    assert {(m.n_ctx, m.parallel) for m in snap.models} == {(2048, 1)}, snap
    assert all("budget it time-shares" in m.fit for m in snap.models), [m.fit for m in snap.models]
    # and they switch: each answer equals the model's alone, the other goes deep for it
    for model, other in ((A, B), (B, A), (A, B)):
        text, _ = _answer(pool, model, QUESTION)
        assert text == alone[model]
        wait_until(lambda o=other: pool.snapshot().model(o).kv_bytes == 0, WAIT, f"{other} deep")  # type: ignore[union-attr,misc]
    log = "".join((home / "log" / f"worker-{m}.log").read_text() for m in (A, B))
    assert "fitted to CPU (a time-shared budget of" in log
