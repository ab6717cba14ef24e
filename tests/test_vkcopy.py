"""The plain-Vulkan copy baseline (core/diagnostics/vkcopy.py): which device, memory types and
queues it measures, checked on made-up device descriptions; and the real measurement through a
Vulkan loader when TIMESHARE_VULKAN_TEST=1 (lavapipe is enough: no ggml is involved)."""

from __future__ import annotations

import os

import pytest
from timeshare.core.diagnostics import vkcopy
from timeshare.core.vulkan import devices
from timeshare.core.vulkan.api import (
    DEVICE_LOCAL,
    HOST_CACHED,
    HOST_COHERENT,
    HOST_VISIBLE,
    VulkanUnavailableError,
)

GIB = 1 << 30


def _dev(
    name: str, types: list[tuple[int, int, int]], families: list[tuple[int, int]], pci: str = ""
) -> devices.PhysDev:
    return devices.PhysDev(
        handle=1,
        name=name,
        kind=2,
        pci=pci,
        max_alloc=4 * GIB,
        types=[devices.MemoryType(i, flags, heap, size) for i, (flags, heap, size) in enumerate(types)],
        families=families,
    )


# the H200's Vulkan memory types as its driver listed them (doctor, 2026-12-01)
H200_TYPES = [
    (0, 1, 101 * GIB),
    (DEVICE_LOCAL, 0, 150 * GIB),
    (HOST_VISIBLE | HOST_COHERENT, 1, 101 * GIB),
    (HOST_VISIBLE | HOST_COHERENT | HOST_CACHED, 1, 101 * GIB),
    (DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT, 0, 150 * GIB),
]
LAVAPIPE_TYPES = [(DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT | HOST_CACHED, 0, 2 * GIB)]


def test_a_discrete_gpu_copies_system_memory_into_plain_vram() -> None:
    d = _dev("NVIDIA H200", H200_TYPES, [(0x7, 16), (0x4, 2)])
    assert [t.index for t in devices.host_types(d)] == [2, 3]  # never the BAR (type 4)
    assert devices.device_type(d).index == 1  # device-local, not host-visible
    assert [label for _, label in devices.queue_families(d)] == ["transfer-only family 1", "compute family 0"]


def test_a_device_with_one_memory_type_uses_it_both_ways() -> None:
    d = _dev("llvmpipe", LAVAPIPE_TYPES, [(0x7, 1)])
    assert [t.index for t in devices.host_types(d)] == [0]
    assert devices.device_type(d).index == 0
    assert [label for _, label in devices.queue_families(d)] == ["compute family 0"]


def test_the_device_is_found_by_pci_id_then_by_name_and_rank() -> None:
    a = _dev("GPU X", H200_TYPES, [(0x7, 1)], pci="0000:01:00.0")
    b = _dev("GPU X", H200_TYPES, [(0x7, 1)], pci="0000:02:00.0")
    c = _dev("GPU Y", H200_TYPES, [(0x7, 1)])
    devs = [a, b, c]
    assert devices.pick_device(devs, "GPU X", "0000:02:00.0", 0) is b
    assert devices.pick_device(devs, "GPU X", None, 1) is b
    assert devices.pick_device(devs, "GPU Y", "0000:09:00.0", 0) is c
    with pytest.raises(VulkanUnavailableError, match="no Vulkan device named"):
        devices.pick_device(devs, "GPU Z", None, 0)


def test_no_memory_to_copy_from_is_a_clear_error() -> None:
    d = _dev("odd", [(DEVICE_LOCAL, 0, GIB)], [(0x2, 1)])
    assert devices.host_types(d) == []
    d2 = _dev("odd", [(HOST_VISIBLE | HOST_COHERENT, 0, GIB)], [(0x2, 1)])
    with pytest.raises(VulkanUnavailableError, match="no device-local"):
        devices.device_type(d2)
    assert devices.flag_names(0) == "none"
    assert devices.flag_names(DEVICE_LOCAL | HOST_CACHED) == "device-local|host-cached"


@pytest.mark.skipif(
    os.environ.get("TIMESHARE_VULKAN_TEST") != "1", reason="needs a Vulkan loader and TIMESHARE_VULKAN_TEST=1"
)
def test_the_baseline_through_a_real_loader() -> None:
    base = vkcopy.copy_baseline(nbytes=64 << 20, reps=2)
    assert base.nbytes == 64 << 20 and base.gbps > 0
    assert all(len(t.seconds) == 2 for t in base.tries)
    assert base.best in base.tries and base.best.best_s == min(t.best_s for t in base.tries)
    assert {"alloc_ms_per_gib", "free_ms_per_gib"} <= set(base.allocation)
    # a restore's allocations pipelined with its copies, and a free in another process (a fresh
    # interpreter running vkcopy.py --hold) while this one allocates: both measured, both sane
    alloc = base.allocation
    assert alloc["pipelined_8_restore_ms_per_gib"] >= alloc["pipelined_8_copy_ms_per_gib"] > 0, alloc
    assert alloc["cross_process_4_alloc_ms_per_gib"] > 0 and alloc["cross_process_4_free_ms_per_gib"] > 0
    rep = base.report()
    assert rep["bytes"] == base.nbytes and rep["device"] == base.device


def test_a_holding_process_that_fails_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # the two-process measurement's other side exits without allocating (here: `false` in place
    # of the interpreter): an error that says so, nothing allocated on this side
    class _NoDevice:
        d = _dev("GPU X", H200_TYPES, [(0x7, 1)])

        def bound(self, nbytes: int, mtype: devices.MemoryType) -> tuple[int, int]:
            raise AssertionError("nothing is allocated before the other side is ready")

    monkeypatch.setattr(vkcopy.sys, "executable", "false")
    with pytest.raises(VulkanUnavailableError, match="did not allocate"):
        vkcopy._free_while_allocating(_NoDevice(), 0, devices.MemoryType(1, DEVICE_LOCAL, 0, GIB), 64 << 20)  # type: ignore[arg-type]
