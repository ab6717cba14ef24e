"""A restore that meets out-of-device-memory is retried, holding the token, for
``arena.restore_oom_retry_s`` (issue 4: after a ``kill -9`` of the holder the kernel drops its flock
at once, the driver frees its memory a little later). Then a clear error, the token given back.

The worker's ``ArenaTenancy`` runs in this process on the real SmolLM2 with the real in-place
residency and a real arena; the only fault is injected: ``_ggml.buft_alloc_buffer`` (the
allocation of a weight buffer) answers "no memory", the one thing a machine with free memory
cannot produce on demand. The reference output comes from the same model before any release."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import pytest
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.client import TokenClient
from timeshare.core.config.schema import ArenaConfig, ModelConfig
from timeshare.core.config.vram_budget import resolve_arena
from timeshare.core.errors import OutOfDeviceMemoryError, TokenTimeoutError
from timeshare.core.residency import _ggml
from timeshare.core.wire.spec import WorkerSpec
from timeshare.core.worker.engine import Engine
from timeshare.core.worker.tenancy import ArenaTenancy

MAX_TOKENS = 12


def _inplace_expected() -> str:
    """Why this build must have the in-place path ("" when it need not): the pinned version of
    llama-cpp-python (read from pyproject.toml) on a CPU-only build, where the host weight buffers
    play the device. A GPU build's backend may be one the in-place path does not know: a skip."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    pinned = re.search(r'"llama-cpp-python==([0-9.]+)"', pyproject)
    assert pinned, "pyproject.toml pins no llama-cpp-python version"
    if llama_cpp.__version__ != pinned.group(1) or llama_cpp.llama_supports_gpu_offload():
        return ""
    return f"the pinned llama-cpp-python {pinned.group(1)} on a CPU build"


Loaded = tuple[ArenaTenancy, Engine, list[int]]


@pytest.fixture()
def loaded(tmp_path: Path, smollm2_path: Path) -> Iterator[Callable[[float], Loaded]]:
    """Load SmolLM2 under the token with ``restore_oom_retry_s`` = the argument, take the greedy
    reference, release: the state of a worker whose model another one displaced."""

    def make(retry_s: float) -> tuple[ArenaTenancy, Engine, list[int]]:
        spec = WorkerSpec(
            model=ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, idle_sleep_s=None),
            arena=resolve_arena(ArenaConfig(restore_oom_retry_s=retry_s)),  # as the pool does
            arena_dir=str(tmp_path / "arena"),
            kv_dir=str(tmp_path / "kv"),
        )
        res = ArenaTenancy(spec)
        res.acquire(lambda: None, None)
        engine = Engine.load(spec.model, use_mmap=res.use_mmap)
        res.attach(engine)
        if res.residency is None or res.path != "inplace":
            expected = _inplace_expected()
            if expected:  # a refusal where the path must work is a failure, not a skip
                pytest.fail(f"{expected} must have the in-place residency, but: {res.reason}")
            pytest.skip(f"the in-place residency is not available here: {res.reason}")
        reference = greedy(engine)
        res.release(kv=False)
        made.append(res)
        return res, engine, reference

    made: list[ArenaTenancy] = []
    yield make
    for res in made:
        res.release(kv=False)
        res.close()


def greedy(engine: Engine) -> list[int]:
    llm = engine.llm
    llm.reset()
    tokens = llm.tokenize(b"The three primary colours are")
    out: list[int] = []
    for tok in llm.generate(tokens, temp=0.0, reset=True):
        out.append(int(tok))
        if len(out) == MAX_TOKENS:
            break
    return out


def failing_big_allocations(monkeypatch: pytest.MonkeyPatch, failures: int | None) -> dict[str, int]:
    """Make the first ``failures`` weight-buffer allocations fail (None: all of them)."""
    real = _ggml.buft_alloc_buffer
    calls = {"failed": 0}

    def alloc(buft: int, size: int) -> int | None:
        if size > 4096 and (failures is None or calls["failed"] < failures):
            calls["failed"] += 1
            return None
        return real(buft, size)

    monkeypatch.setattr(_ggml, "buft_alloc_buffer", alloc)
    return calls


def test_out_of_memory_on_restore_is_retried_holding_the_token(
    loaded: Callable[[float], Loaded], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res, engine, reference = loaded(30.0)
    calls = failing_big_allocations(monkeypatch, failures=3)
    other = TokenClient(Arena(tmp_path / "arena"), "other")
    seen: dict[str, object] = {"polls": 0, "reasons": set(), "other_could_take": False}

    def poll() -> None:
        seen["polls"] = int(seen["polls"]) + 1  # type: ignore[call-overload]
        seen["reasons"].add(res.waiting_reason())  # type: ignore[attr-defined]
        if res.holds_token and not seen["other_could_take"]:
            req = other.request(timeout=0.05)
            try:
                req.result(timeout=1.0)
                seen["other_could_take"] = True
                other.release()
            except TokenTimeoutError:
                pass  # expected: the token is ours while we retry

    acquired = res.ensure(poll, 10.0)
    assert calls["failed"] == 3
    assert res.weights_resident and res.holds_token
    assert acquired.restore_ms > 0
    assert int(seen["polls"]) > 0  # type: ignore[call-overload]
    assert "waiting for device memory to restore the weights" in seen["reasons"]
    assert seen["other_could_take"] is False
    assert res.waiting_reason() == ""
    assert greedy(engine) == reference  # the weights came back whole
    other.close()


def test_out_of_memory_past_the_retry_time_fails_clearly_and_gives_the_token_back(
    loaded: Callable[[float], Loaded], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res, engine, reference = loaded(0.3)
    real = _ggml.buft_alloc_buffer
    calls = failing_big_allocations(monkeypatch, failures=None)
    with pytest.raises(OutOfDeviceMemoryError) as info:
        res.ensure(lambda: None, 10.0)
    message = str(info.value)
    assert "stays released" in message
    assert "arena.restore_oom_retry_s" in message and "times over 0.3 s" in message
    assert info.value.code == "out_of_device_memory"
    assert calls["failed"] >= 2
    assert not res.holds_token and not res.weights_resident
    other = TokenClient(Arena(tmp_path / "arena"), "other")
    other.acquire(timeout=5.0)  # the token was given back
    other.release()
    other.close()
    monkeypatch.setattr(_ggml, "buft_alloc_buffer", real)  # memory is back: the worker restores
    res.ensure(lambda: None, 10.0)
    assert greedy(engine) == reference


def test_no_retry_when_the_retry_time_is_zero(
    loaded: Callable[[float], Loaded], monkeypatch: pytest.MonkeyPatch
) -> None:
    res, _engine, _reference = loaded(0.0)
    calls = failing_big_allocations(monkeypatch, failures=1)
    with pytest.raises(OutOfDeviceMemoryError) as info:
        res.ensure(lambda: None, 10.0)
    assert "tried" not in str(info.value)
    assert calls["failed"] == 1
    assert not res.holds_token
