"""The hand-over through the product (issue 40): two real workers of a Pool with
``arena.handover`` on alternate turns under a one-model budget; after the first handed restore no
switch allocates (the holder's count of chunks the workers created and handed to it stays put),
and every answer is the one given before any switch. CPU build: the memfd stand-in plays the
device (named as such: core/devmem/memfd.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from _budget_pool_util import WAIT
from _proc_util import wait_until
from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState

PROMPT = "The three primary colours are"


def _two_on_handed_memory(
    ids: tuple[str, str],
    tmp_path: Path,
    smollm2_path: Path,
    pools: list[Pool],
    monkeypatch: pytest.MonkeyPatch,
) -> Pool:
    """A started pool of two SmolLM2 workers ``ids`` on a one-model budget with the hand-over on
    (``arena.handover`` alone means CUDA only: on this CPU build $TIMESHARE_HANDOVER=1 asks for the
    memfd stand-in)."""
    monkeypatch.setenv("TIMESHARE_HANDOVER", "1")
    config = Config(
        models=tuple(ModelConfig(id=i, path=str(smollm2_path), n_ctx=256, idle_sleep_s=None) for i in ids),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget="one-model", handover=True),
    )
    pool = Pool(config, arena_dir=tmp_path / "arena", log_dir=tmp_path / "log", kv_dir=tmp_path / "kv")
    pools.append(pool)
    pool.start()
    pool.wait_ready(timeout=WAIT)
    return pool


def test_two_workers_switch_on_handed_memory(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    # no room on the card: each switch has the other's kept chunks asked back
    monkeypatch.setenv("TIMESHARE_HANDOVER_ROOM", "0")
    monkeypatch.setenv("TIMESHARE_HANDOVER_KEEP", "1")  # kept even so: asked back at each switch
    ids = ("smol-a", "smol-b")
    pool = _two_on_handed_memory(ids, tmp_path, smollm2_path, pools, monkeypatch)
    assert all(m.state is not ModelState.FAILED for m in pool.snapshot().models), pool.snapshot()

    def answer(model: str) -> tuple[str, bool]:
        got = pool.generate(model, prompt=PROMPT, sampling=Sampling(max_tokens=8, temperature=0.0))
        result = got.result(timeout=WAIT)
        return result.text, result.switch.switched

    first = {m: answer(m)[0] for m in ids}  # each restored once: from here on memory is handed over
    holder = HandoverClient(tmp_path / "arena", "test", start=False)
    try:
        before = holder.status()
        for model in ids * 3:
            text, switched = answer(model)
            assert switched and text == first[model]
        after = holder.status()
    finally:
        holder.close()
    chunk = before["chunk"]
    weight_bytes = next(m.weight_bytes for m in pool.snapshot().models if m.id == ids[0])
    n = -(-weight_bytes // chunk)
    assert after["adopted"] == before["adopted"]  # 6 switches, nothing allocated
    assert after["given"] - before["given"] == 6 * n  # each switch took the other's chunks
    assert after["released"] - before["released"] == 6 * n  # ... once the other had unmapped them
    assert after["chunks"] <= 2 * n  # never more than the two models' worth held
    # the workers' status: each one's last restore mapped the other's n chunks; its cuMemCreate
    # calls are the first restore's; the lease counts whole chunks (padding is device memory).
    # The previous holder reports its release on its own pipe after it let the token go: the
    # last answer may come first, so wait until the pool has seen it let go
    wait_until(
        lambda: sum(m.holds_gpu for m in pool.snapshot().models) == 1, WAIT, "one model holding the GPU"
    )
    models = {m.id: m for m in pool.snapshot().models}
    assert all(models[i].handover_mapped_chunks == n for i in ids)
    assert sum(models[i].handover_creates for i in ids) == after["adopted"]
    holding = [m for m in models.values() if m.holds_gpu]
    assert len(holding) == 1 and holding[0].lease_bytes == n * chunk == holding[0].weight_bytes


def test_switches_back_with_room_upload_nothing(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room on the card: each worker keeps its chunks mapped while the other computes, so every
    switch back finds its weights still there -- nothing uploaded (the workers' status counts
    the bytes skipped), every answer the one given before any switch."""
    monkeypatch.delenv("TIMESHARE_HANDOVER_ROOM", raising=False)
    ids = ("smol-a", "smol-b")
    pool = _two_on_handed_memory(ids, tmp_path, smollm2_path, pools, monkeypatch)

    def answer(model: str) -> tuple[str, bool, int]:
        got = pool.generate(model, prompt=PROMPT, sampling=Sampling(max_tokens=8, temperature=0.0))
        result = got.result(timeout=WAIT)
        return result.text, result.switch.switched, result.switch.restored_bytes

    first = {m: answer(m)[0] for m in ids}  # each restored once into handed memory

    def skipped() -> dict[str, int]:
        return {m.id: m.handover_skipped_bytes for m in pool.snapshot().models}

    s0 = skipped()
    for model in ids:  # the first switch back into kept memory
        assert answer(model)[2] == 0
    s1 = skipped()
    for model in ids * 2:
        text, switched, restored = answer(model)
        assert switched and text == first[model]
        assert restored == 0  # nothing uploaded
    s2 = skipped()
    models = {m.id: m for m in pool.snapshot().models}
    for i in ids:
        once = s1[i] - s0[i]  # one switch back: the weights' tensor bytes (no padding)
        assert 0 < once <= models[i].weight_bytes
        assert s2[i] - s1[i] == 2 * once


@pytest.mark.parametrize(
    ("setting", "backend", "env", "wanted"),
    [
        (True, "CUDA0", None, True),  # the default: on where the device can hand memory over
        (True, "CUDA1", None, True),
        (True, "Vulkan0", None, False),  # not wired into ggml-vulkan's buffers yet
        (True, "CPU", None, False),  # host memory: nothing to gain (the stand-in is for tests)
        (False, "CUDA0", None, False),  # the user turned it off
        (True, "CUDA0", "0", False),  # the escape hatch, both ways, on any build
        (False, "CPU", "1", True),
        (True, "Vulkan0", "1", True),
        (True, "CUDA0", "yes", True),  # not 0/1: the setting's rule
    ],
)
def test_the_hand_over_is_on_by_default_for_cuda_only_and_the_variable_overrides(
    setting: bool, backend: str, env: str | None, wanted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from timeshare.core.worker.tenancy import handover_wanted

    assert ArenaConfig().handover is True
    if env is None:
        monkeypatch.delenv("TIMESHARE_HANDOVER", raising=False)
    else:
        monkeypatch.setenv("TIMESHARE_HANDOVER", env)
    assert handover_wanted(setting, backend) is wanted


def test_a_cpu_pool_with_the_default_setting_starts_no_holder(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIMESHARE_HANDOVER", raising=False)
    config = Config(
        models=(ModelConfig(id="a", path=str(smollm2_path), n_ctx=256, idle_sleep_s=None),),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT, vram_budget="one-model"),
    )
    assert config.arena.handover
    pool = Pool(config, arena_dir=tmp_path / "arena", log_dir=tmp_path / "log", kv_dir=tmp_path / "kv")
    pools.append(pool)
    pool.start()
    pool.wait_ready(timeout=WAIT)
    assert pool.generate("a", prompt=PROMPT, sampling=Sampling(max_tokens=4)).result(timeout=WAIT).text
    (model,) = pool.snapshot().models
    assert model.handover_mapped_chunks == 0 and model.handover_creates == 0
    # no holder was started for this arena: no socket, no state file beside the token
    assert not [p.name for p in (tmp_path / "arena").rglob("*") if "hand" in p.name], list(
        (tmp_path / "arena").rglob("*")
    )


def test_a_load_gets_the_memory_the_parked_workers_keep(
    tmp_path: Path, smollm2_path: Path, pools: list[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ggml allocates a new model's weights, KV cache and compute buffers itself: before a load,
    the chunks the parked workers keep mapped (room on the card: they keep them) and those on hand
    go back to the driver. The kernel's view: after the third model's load no process maps or
    holds a chunk memfd of the first two's; then the first two still answer as before."""
    monkeypatch.delenv("TIMESHARE_HANDOVER_ROOM", raising=False)
    ids = ("smol-a", "smol-b")
    pool = _two_on_handed_memory(ids, tmp_path, smollm2_path, pools, monkeypatch)

    def answer(model: str) -> str:
        got = pool.generate(model, prompt=PROMPT, sampling=Sampling(max_tokens=8, temperature=0.0))
        return got.result(timeout=WAIT).text

    first = {m: answer(m) for m in ids}
    for m in ids:  # each restored into handed memory, and kept it at its release
        assert answer(m) == first[m]
    holder = HandoverClient(tmp_path / "arena", "test", start=False)
    try:
        kept = holder.status()
        assert kept["kept_bytes"] > 0 and kept["chunks"] > 0, kept
        config = pool.config
        third = ModelConfig(id="smol-c", path=str(smollm2_path), n_ctx=256, idle_sleep_s=None)
        pool.apply_config(replace(config, models=(*config.models, third)))
        wait_until(
            lambda: any(m.id == "smol-c" and m.state is ModelState.RELEASED for m in pool.snapshot().models),
            WAIT,
            "the third model loaded (and released)",
        )
        after = holder.status()
    finally:
        holder.close()
    assert after["closed"].get("trim", 0) >= kept["chunks"], (kept, after)
    assert after["kept_bytes"] == 0 and after["chunks"] == 0, after
    for m in pool.snapshot().models:  # the kernel's view: no worker maps a chunk any more
        assert m.pid is not None
        maps = Path(f"/proc/{m.pid}/maps").read_text()
        assert "/memfd:timeshare-chunk" not in maps, (m.id, [x for x in maps.splitlines() if "memfd" in x])
    assert answer("smol-c") and all(answer(m) == first[m] for m in ids)
