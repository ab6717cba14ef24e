"""Fitting a model to the card (issue 39, items 3 and 4): the pure rule that picks ``parallel``,
``n_ctx`` and GPU layers from a device size given to it (core/config/fit.py); the settings'
validation; a context that cannot be allocated reported as out of memory with its numbers; and
real workers on the demo models with ``kv_cache_type`` q8_0 and q4_0, whose status reports what
each holds now (KV, buffers) at each level."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _budget_pool_util import WAIT
from _proc_util import wait_until
from timeshare.core.arena.budget import (
    AUTO,
    GPU_CONTEXT_ALLOWANCE,
    LeaseRecord,
    compute_budget,
    plan_fit,
    time_share_room,
)
from timeshare.core.config.fit import FitInput, fit_model
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig
from timeshare.core.config.validate import validate
from timeshare.core.errors import ConfigError, OutOfDeviceMemoryError
from timeshare.core.gguf.kvcache import KvShape
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState

GB = 10**9
GiB = 2**30
#: a Llama-3-8B-shaped model: 32 layers, 8 KV heads of 128: 128 KiB of f16 KV a token
LLAMA8B = KvShape(layers=32, head_count_kv=8, key_length=128, value_length=128)


def eight_b(free: int, gpu: bool = True, **settings: object) -> FitInput:
    kv_type = str(settings.pop("kv_cache_type", "f16"))
    return FitInput(
        free=free,
        gpu=gpu,
        weight_bytes=4_220_000_000,  # Q4_0
        layers=32,
        kv_token_bytes=LLAMA8B.token_bytes(kv_type),
        trained_ctx=8192,
        model="llama8b",
        kv_cache_type=kv_type,
        **settings,  # type: ignore[arg-type]
    )


# ---- the rule (pure) ---------------------------------------------------------------------------


def test_a_big_card_keeps_four_sequences_of_the_capped_trained_context() -> None:
    fit = fit_model(eight_b(79 * GB))
    assert (fit.parallel, fit.n_ctx, fit.n_gpu_layers) == (4, 4096, -1)
    assert fit.kv_bytes == LLAMA8B.bytes(4096, 4) == 2 * GiB
    assert "parallel 4, n_ctx 4096 (auto" in fit.note


def test_the_second_model_is_fitted_to_the_budget_it_time_shares_not_to_what_the_first_leaves_free() -> None:
    """The H100 run of issue 39: two 8B Q4_0 models on an 8 GiB card, auto budget. Model a loads
    first and parks at the weights level (its KV cache and compute buffers kept); model b must get
    the same settings and all its layers on the GPU, since a goes deep for it."""
    budget = compute_budget(AUTO, total=8 * GiB, free=8 * GiB - 600 * 2**20, pid=1)  # a's context in "others"
    alone = fit_model(eight_b(0, n_ctx=6000, shared=budget.bytes))
    assert alone.n_gpu_layers == -1 and alone.parallel == 1 and alone.need <= budget.bytes
    reserve = alone.kv_bytes + 400 * 10**6 + GPU_CONTEXT_ALLOWANCE  # a parked at the weights level
    parked = LeaseRecord("a", pid=1, bytes=reserve, kind="reserve", deepens=reserve - GPU_CONTEXT_ALLOWANCE)
    room = time_share_room(
        budget, [parked, LeaseRecord("c", pid=3, bytes=10**9)], (2, "b"), GPU_CONTEXT_ALLOWANCE
    )
    # a's floor (its driver context) and b's own; an unpinned holder's weights (c) leave for b
    assert room == budget.bytes - 2 * GPU_CONTEXT_ALLOWANCE
    second = fit_model(eight_b(8 * GiB - 4_220_000_000 - reserve, n_ctx=6000, shared=room))
    assert (second.n_ctx, second.parallel, second.n_gpu_layers) == (alone.n_ctx, alone.parallel, -1)
    assert "budget it time-shares" in second.note
    # the old rule, fitted to what a left free at b's load: fewer layers (part on the CPU)
    assert 0 < fit_model(eight_b(8 * GiB - 4_220_000_000 - reserve, n_ctx=6000)).n_gpu_layers < 32
    # b's need is more than the budget leaves beside a's whole reserve, but fits once a is deep:
    # the load asks for it first (ArenaTenancy.make_room), and the plan sends a deep
    need = second.need + GPU_CONTEXT_ALLOWANCE
    plan = plan_fit(need, [parked], budget, now=1.0, requester=(2, "b"))
    assert need > budget.weights_budget(reserve) and not plan.fits and plan.deepen == (parked,)
    # a pinned model keeps all it has; other budgets fit to the free memory (no time-share room)
    pinned = replace(parked, pinned=True)
    assert time_share_room(budget, [pinned], (2, "b")) == budget.bytes - reserve
    assert time_share_room(replace(budget, kind="one-model"), [parked], (2, "b")) is None


def test_an_8gb_card_halves_parallel_before_the_context() -> None:
    fit = fit_model(eight_b(8 * GiB))
    # 4 x 4096 x 128 KiB = 2 GiB > 1/8 of the room; 2 x 4096 = 1 GiB still is; 1 x 4096 fits
    assert (fit.parallel, fit.n_ctx, fit.n_gpu_layers) == (1, 4096, -1)
    assert fit.kv_bytes <= fit.room // 8
    # q8_0 halves the KV (34 of 64 bytes a block): two sequences fit in the same share
    q8 = fit_model(eight_b(8 * GiB, kv_cache_type="q8_0"))
    assert (q8.parallel, q8.n_ctx) == (2, 4096)
    assert q8.kv_bytes == LLAMA8B.bytes(4096, 2, "q8_0") == 2 * 4096 * 32 * 2 * 1024 * 34 // 32


def test_a_4gb_card_shortens_the_context_and_offloads_what_does_not_fit() -> None:
    fit = fit_model(eight_b(4 * GiB))
    assert (fit.parallel, fit.n_ctx) == (1, 2048)
    assert 0 < fit.n_gpu_layers < 32  # the weights alone exceed the room: some layers on the CPU
    assert f"n_gpu_layers {fit.n_gpu_layers} of 32" in fit.note
    assert fit_model(eight_b(4 * GiB, gpu=False)).n_gpu_layers == -1  # a CPU build: no layers to place


def test_settings_given_are_kept_and_the_cpu_build_starts_smaller() -> None:
    fit = fit_model(eight_b(8 * GiB, parallel=4, n_ctx=8192, n_gpu_layers=99))
    assert (fit.parallel, fit.n_ctx, fit.n_gpu_layers, fit.note) == (4, 8192, 99, "")  # all kept
    # 4 GiB of KV fits the room, the weights beside it do not: n_gpu_layers -1 puts fewer layers
    assert 0 < fit_model(eight_b(8 * GiB, parallel=4, n_ctx=8192)).n_gpu_layers < 32
    cpu = fit_model(eight_b(64 * GB, gpu=False))
    assert (cpu.parallel, cpu.n_ctx) == (1, 2048)
    short = fit_model(
        FitInput(free=64 * GB, gpu=True, weight_bytes=10**8, layers=4, kv_token_bytes=1024, trained_ctx=1024)
    )
    assert short.n_ctx == 1024  # never beyond the trained context


def test_a_model_that_cannot_fit_says_the_numbers_and_the_setting() -> None:
    with pytest.raises(OutOfDeviceMemoryError) as err:
        fit_model(eight_b(8 * GiB, n_ctx=131072, parallel=4))
    text = str(err.value)
    assert text.startswith(
        "out of GPU memory: llama8b's KV cache needs 68.7 GB (n_ctx 131072 × 4 sequences, f16)"
    )
    assert "8.6 GB free" in text and "models[].n_ctx" in text and 'kv_cache_type = "q8_0"' in text
    with pytest.raises(OutOfDeviceMemoryError, match=r"^out of memory: .*in memory"):
        fit_model(eight_b(8 * GiB, gpu=False, n_ctx=131072, parallel=4))
    with pytest.raises(OutOfDeviceMemoryError, match="cannot put even one layer"):
        fit_model(eight_b(600 * 2**20, n_ctx=2048, parallel=1))


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_kv_cache_type_and_gpu_layers_are_refused_with_their_field_path() -> None:
    raw = {
        "arena": {"kv_cache_type": "q5"},
        "models": [
            {"id": "a", "path": "/x.gguf", "kv_cache_type": "q3", "n_gpu_layers": -7, "n_ctx": -1},
        ],
    }
    with pytest.raises(ConfigError) as err:
        validate(raw, check_paths=False)
    problems = "\n".join(err.value.problems)
    assert "models[0].kv_cache_type: must be one of 'f16', 'q8_0', 'q4_0', not 'q3'" in problems
    assert "models[0].n_gpu_layers: must be -1 (all layers, or as many as fit), 0 (CPU only)" in problems
    assert "models[0].n_ctx: must be 0 (auto: fitted to the device) or a number of tokens, not -1" in problems
    assert "arena.kv_cache_type: must be one of 'f16', 'q8_0', 'q4_0', not 'q5'" in problems
    good = validate(
        {"arena": {"kv_cache_type": "q8_0"}, "models": [{"id": "a", "path": "/x.gguf"}]}, check_paths=False
    )
    assert good.arena.kv_cache_type == "q8_0" and good.models[0].kv_type(good.arena.kv_cache_type) == "q8_0"
    assert good.models[0].n_ctx == 0 and good.models[0].parallel == 0  # unset: fitted at load


# ---- llama.cpp's refusal, in words ---------------------------------------------------------------

_CONTEXT_OOM = textwrap.dedent(
    """
    import llama_cpp, resource, sys
    from timeshare.core.config.fit import LoadPlan
    from timeshare.core.config.schema import ModelConfig
    from timeshare.core.errors import OutOfDeviceMemoryError
    from timeshare.core.worker.engine import Engine
    # the KV cache asked for is far more than the address space allowed: its allocation fails
    # (nothing else on the machine feels it)
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
    model = ModelConfig(id="smol", path=sys.argv[1], n_ctx=4_000_000, parallel=1)
    try:
        Engine.load(model, plan=LoadPlan(False, 92_160_000_000, 100_000_000, lambda: 5 * 10**9))
    except OutOfDeviceMemoryError as exc:
        print("OOM", exc)
    """
)


def test_a_context_that_cannot_be_allocated_is_out_of_memory_not_a_damaged_file(smollm2_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CONTEXT_OOM, str(smollm2_path)], capture_output=True, text=True, timeout=300
    )
    out = done.stdout.strip()
    assert out.startswith("OOM out of memory: smol's context (a KV cache of 92.2 GB for n_ctx 4000000 × 1"), (
        out + done.stderr[-2000:]
    )
    assert "5.0 GB of memory is free now" in out and "models[].n_ctx" in out
    assert "damaged" not in out


# ---- real workers: kv_cache_type, and what each holds at each level ------------------------------


def test_quantised_kv_caches_load_answer_and_hold_less(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool]
) -> None:
    models = tuple(
        ModelConfig(id=f"smol-{t}", path=str(smollm2_path), kv_cache_type=t, idle_sleep_s=None)  # type: ignore[arg-type]
        for t in ("f16", "q8_0", "q4_0")
    )
    config = Config(
        models=models, arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget="one-model")
    )
    pool = Pool(config, arena_dir=tmp_path / "arena", log_dir=tmp_path / "log", kv_dir=tmp_path / "kv")
    pools.append(pool)
    pool.start()
    pool.wait_ready(timeout=WAIT)
    answers = {}
    for m in models:
        result = pool.generate(
            m.id, prompt="The capital of France is", sampling=Sampling(max_tokens=8, temperature=0.0)
        )
        answers[m.id] = result.result(timeout=WAIT).text
    assert all(text.strip() for text in answers.values()), answers

    # each previous holder reports its release on its own pipe after it let the GPU go: the next
    # one's answer may come first, so wait until the pool has seen both let go
    def let_go(model_id: str) -> bool:
        status = pool.snapshot().model(model_id)
        return status is not None and status.state is not ModelState.RESIDENT

    wait_until(
        lambda: let_go("smol-f16") and let_go("smol-q8_0"), WAIT, "the earlier holders' release reports"
    )
    snap = pool.snapshot()
    status = {m.id: m for m in snap.models}
    f16, q8, q4 = (status[f"smol-{t}"] for t in ("f16", "q8_0", "q4_0"))
    assert (f16.kv_cache_type, q8.kv_cache_type, q4.kv_cache_type) == ("f16", "q8_0", "q4_0")
    assert f16.n_ctx == 2048 and f16.parallel == 1 and "n_ctx 2048 (auto" in f16.fit  # CPU build's rule
    # the KV each holds, released or resident: q8_0 = 34/64 of f16, q4_0 = 18/64 (SmolLM2: 30
    # layers x 3 KV heads x 64 x 2048 cells)
    assert f16.kv_bytes == 30 * 2 * 3 * 64 * 2 * 2048
    assert q8.kv_bytes * 64 == f16.kv_bytes * 34 and q4.kv_bytes * 64 == f16.kv_bytes * 18
    # released (the last answered holds the weights): the KV and the compute buffers stay
    assert q8.state is ModelState.RELEASED and f16.state is ModelState.RELEASED
    held = f16.held()
    assert held["memory"] == "host" and held["weights"] == 0 and held["context"] == 0
    assert held["buffers"] > 0 and f16.device_bytes == f16.kv_bytes + f16.buffer_bytes
    resident = status["smol-q4_0"]
    if resident.state is ModelState.RESIDENT:
        assert resident.held()["weights"] > 0
    # Ollama's /api/ps says the same: host memory on a CPU build (size_vram 0), part by part
    ps = {m["timeshare"]["id"]: m for m in _api_ps(pool)}
    assert ps["smol-f16"]["size_vram"] == 0 and ps["smol-f16"]["timeshare"]["held"] == f16.held()
    assert ps["smol-q8_0"]["timeshare"]["held"]["kv"] == q8.kv_bytes
    # asleep (weights+kv): the KV cache and compute buffers released (in place here), nothing held
    pool.sleep("smol-f16", level="weights+kv")
    wait_until(
        lambda: (
            (s := pool.snapshot().model("smol-f16")) is not None
            and s.state is ModelState.SLEEPING
            and s.device_bytes == 0
        ),
        WAIT,
        "the sleeping model holds nothing",
    )
    asleep = {m["timeshare"]["id"]: m for m in _api_ps(pool)}["smol-f16"]["timeshare"]["held"]
    assert asleep == {"memory": "host", "total": 0, "weights": 0, "kv": 0, "buffers": 0, "context": 0}


def _api_ps(pool: Pool) -> list[dict[str, Any]]:
    """``GET /api/ps`` of an API over ``pool`` (in process)."""
    from starlette.testclient import TestClient
    from timeshare.core.api.handlers import create_app

    app = create_app(pool, ApiConfig())
    try:
        with TestClient(app, base_url="http://127.0.0.1") as client:
            answer = client.get("/api/ps")
            assert answer.status_code == 200, answer.text
            models: list[dict[str, Any]] = answer.json()["models"]
            return models
    finally:
        app.state.unsubscribe()
