"""``--card SIZE`` (issue 39, item 5): the CPU build's host-memory card (the workers' device is
capped, so the auto budget and the fit see a machine of SIZE), the argument errors, and the
ballast's arithmetic over a GPU that cannot exist on this machine (a stand-in with a GPU's
memory; the GPU path itself is run on the lent GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _api_util import serve_env
from _proc_util import vm_size_of
from timeshare.core.diagnostics.ballast import hold
from timeshare.core.diagnostics.card import HOST_MEMORY_ENV, CardError, hold_card
from timeshare.core.errors import ConfigError
from timeshare.core.worker.device import device_memory, host_memory

GiB = 2**30


class StandInGpu:
    """80 GiB with ``free`` bytes free; allocations take from it (no GPU on this machine)."""

    api = "stand-in"
    max_piece = GiB

    def __init__(self, free: int, total: int = 80 * GiB) -> None:
        self.free, self.total, self.pieces = free, total, []  # type: list[int]

    def memory(self) -> tuple[int, int]:
        return self.free, self.total

    def allocate(self, nbytes: int) -> bool:
        if nbytes > self.free:
            return False
        self.free -= nbytes
        self.pieces.append(nbytes)
        return True


def test_the_ballast_holds_all_but_the_card_and_refuses_a_card_larger_than_the_gpu() -> None:
    gpu = StandInGpu(free=79 * GiB + 12345)
    report = hold(8 * GiB, 0, lambda _device: gpu)
    # all but the card, to the last piece under 2 MiB
    assert report["ok"] and report["held"] == 71 * GiB and report["free_after"] == 8 * GiB + 12345
    assert max(gpu.pieces) <= GiB  # in pieces: one huge allocation may find no contiguous range
    too_big = hold(100 * GiB, 0, lambda _device: StandInGpu(free=79 * GiB))
    assert not too_big["ok"] and too_big["gpu"]
    assert too_big["reason"] == "a card of 100.0 GiB is larger than GPU 0 (80.0 GiB): give a smaller --card"
    busy = hold(24 * GiB, 0, lambda _device: StandInGpu(free=20 * GiB))
    assert (
        not busy["ok"]
        and "has only 20.0 GiB free of 80.0 GiB, less than the card of 24.0 GiB" in busy["reason"]
    )


def test_without_a_gpu_the_ballast_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "timeshare.core.diagnostics.ballast", "--leave", str(GiB)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    report = json.loads(done.stdout)
    assert done.returncode == 1 and report["ok"] is False and report["gpu"] is False, done.stdout


def test_on_a_cpu_build_the_card_caps_the_host_memory_the_workers_see() -> None:
    assert HOST_MEMORY_ENV not in os.environ
    real_total, _ = host_memory()
    with hold_card("2GiB") as card:
        assert card is not None and card.kind == "host" and card.size == 2 * GiB
        assert os.environ[HOST_MEMORY_ENV] == str(2 * GiB)  # inherited by serve and the workers
        total, free = host_memory()
        assert total == 2 * GiB and free <= 2 * GiB
        mem = device_memory(0)
        assert mem.name == "CPU" and mem.total == 2 * GiB
    assert HOST_MEMORY_ENV not in os.environ and host_memory()[0] == real_total


def _enter(card: str) -> None:
    with hold_card(card):
        pass


def test_card_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CardError, match=r"^--card: 'banana' is not a size"):
        _enter("banana")
    with pytest.raises(CardError, match=r"^--card: a card of .* is larger than this machine's memory"):
        _enter("1000TiB")
    with pytest.raises(CardError, match="more than 0 bytes"):
        _enter("0GiB")
    monkeypatch.setenv(HOST_MEMORY_ENV, "lots")
    with pytest.raises(ConfigError, match=r"\$TIMESHARE_HOST_MEMORY: 'lots' is not a size"):
        host_memory()


def test_doctor_on_a_card_reports_the_budget_of_that_card(tmp_path: Path) -> None:
    env = serve_env(tmp_path / "home")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "timeshare",
            "doctor",
            "--card",
            "3GiB",
            "--budget",
            "auto",
            "--cycles",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["card"]["kind"] == "host" and report["card"]["size"] == 3 * GiB
    budget = report["vram_budget"]
    assert budget["device"] == "CPU" and budget["device_total_bytes"] == 3 * GiB
    assert 0 < budget["budget_bytes"] < 3 * GiB
    bad = subprocess.run(
        [sys.executable, "-m", "timeshare", "doctor", "--card", "9000TiB", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert bad.returncode == 2 and "larger than this machine's memory" in bad.stderr


def test_the_vulkan_ballast_on_lavapipe() -> None:
    """The Vulkan ballast (a Vulkan build without CUDA: the small AMD and Intel cards) on Mesa's
    lavapipe, a CPU Vulkan device, whose memory is this process's: the kernel sees the held bytes
    mapped. lavapipe is refused as a GPU unless asked for (a CPU device is not a card); without
    VK_EXT_memory_budget (lavapipe has none) free memory is the heap less the ballast's own."""
    from timeshare.core.diagnostics.ballast import VulkanGpu

    try:
        with pytest.raises(LookupError, match=r"no Vulkan GPU here \(the loader lists: .*llvmpipe"):
            VulkanGpu(0)
        gpu = VulkanGpu(0, allow_cpu=True)
    except LookupError as exc:
        pytest.skip(f"no Vulkan here: {exc} (apt mesa-vulkan-drivers)")
    try:
        free, total = gpu.memory()
        assert 0 < free <= total
        with pytest.raises(ValueError, match="GPU 5 does not exist: Vulkan lists 1"):
            VulkanGpu(5, allow_cpu=True)
        before = vm_size_of()
        report = hold(free - 96 * 2**20, 0, lambda _device: gpu)
        grew = vm_size_of() - before
        assert report["ok"] and report["api"] == "vulkan", report
        assert report["held"] == 96 * 2**20 and report["free_after"] == free - 96 * 2**20
        assert grew >= 96 * 2**20, grew  # lavapipe's device memory is host memory, mapped here
        assert not hold(total + GiB, 0, lambda _device: gpu)["ok"]
    finally:
        gpu.close()
