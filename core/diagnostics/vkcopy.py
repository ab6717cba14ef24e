"""The Vulkan copy baseline: what one fenced host-to-device copy moves on a Vulkan device, measured
with plain Vulkan through the loader (ctypes on ``libvulkan.so.1``), independent of ggml.

Restore is measured against it (``restore_vs_baseline``, as CUDA's restore is measured against a
raw pinned copy). It is one ``vkCmdCopyBuffer`` of ``nbytes`` (at least 1 GiB) from a buffer in
host-visible, host-coherent system memory to a buffer in device-local memory, submitted to a
queue and waited for with a fence: the DMA path that a restore from ggml-vulkan's pinned host
memory takes (``ggml_vk_buffer_write_2d_async`` then records exactly one such copy per buffer).
Every host-visible memory type that is not device-local is tried (with and without
``HOST_CACHED``) on every kind of queue family that can copy (a dedicated transfer family -- the
DMA engine ggml-vulkan uses for synchronous uploads -- and the compute family): the best is the
fastest path this device offers. A memcpy into device-local host-visible memory (ReBAR, which
ggml-vulkan prefers for its device buffers) is a CPU copy over PCIe, not a DMA: on the H200 it
moved about 4.5 GB/s against the DMA's 49 (docs/lab/HISTORY.md), so it is reported
(``rebar_bytes``) but not the baseline.

Only core Vulkan 1.1 is used, no extension, so AMD, Intel, NVIDIA and Mesa's lavapipe take the
same path. Everything it creates is destroyed before it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from ctypes import byref, c_uint64, c_void_p
from dataclasses import dataclass, field
from typing import Any

from ..vulkan.api import (
    DEVICE_LOCAL,
    DEVICE_TYPES,
    GIB,
    HOST_VISIBLE,
    ST_COMMAND_BUFFER_ALLOCATE_INFO,
    ST_COMMAND_BUFFER_BEGIN_INFO,
    ST_COMMAND_POOL_CREATE_INFO,
    ST_FENCE_CREATE_INFO,
    ST_SUBMIT_INFO,
    USAGE_TRANSFER_DST,
    USAGE_TRANSFER_SRC,
    WHOLE_SIZE,
    BufferCopy,
    CommandBufferAllocateInfo,
    CommandBufferBeginInfo,
    CommandPoolCreateInfo,
    FenceCreateInfo,
    SubmitInfo,
    VulkanUnavailableError,
    instance,
)
from ..vulkan.devices import (
    Copier,
    Device,
    MemoryType,
    device_type,
    host_types,
    physical_devices,
    pick_device,
    queue_families,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyTry:
    """One (host memory type, queue family) pair and its fenced copies."""

    src: str
    dst: str
    queue: str
    seconds: tuple[float, ...]

    @property
    def best_s(self) -> float:
        return min(self.seconds)


@dataclass(frozen=True)
class CopyBaseline:
    device: str  # the Vulkan device name
    device_type: str  # discrete, integrated, cpu, ...
    pci_bus_id: str  # "dddd:bb:dd.f" as ggml-vulkan formats it ("" without VK_EXT_pci_bus_info)
    nbytes: int
    gbps: float  # the best try: nbytes / best fenced copy
    best: CopyTry
    tries: tuple[CopyTry, ...]
    max_allocation_bytes: int  # maxMemoryAllocationSize (Vulkan 1.1)
    #: the largest device-local, host-visible heap (ReBAR/resizable BAR or UMA); 0 when none
    rebar_bytes: int
    memory_types: tuple[MemoryType, ...] = field(default=())
    #: device-local allocation and free costs, milliseconds per GiB (see _allocation_costs)
    allocation: dict[str, float] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return {
            "method": "plain Vulkan 1.1 through the loader (ctypes): one fenced vkCmdCopyBuffer "
            "host-visible|host-coherent -> device-local",
            "device": self.device,
            "device_type": self.device_type,
            "pci_bus_id": self.pci_bus_id,
            "bytes": self.nbytes,
            "gbps": self.gbps,
            "best_ms": self.best.best_s * 1000,
            "src_memory": self.best.src,
            "dst_memory": self.best.dst,
            "queue": self.best.queue,
            "tries": [
                {
                    "src": t.src,
                    "queue": t.queue,
                    "best_gbps": self.nbytes / 1e9 / t.best_s,
                    "ms": [round(s * 1000, 3) for s in t.seconds],
                }
                for t in self.tries
            ],
            "max_allocation_bytes": self.max_allocation_bytes,
            "rebar_bytes": self.rebar_bytes,
            "allocation": self.allocation,
            "memory_types": [m.describe() for m in self.memory_types],
        }


def _timed_copies(dev: Device, family: int, src: int, dst: int, nbytes: int, reps: int) -> list[float]:
    vk = dev.vk
    queue = c_void_p()
    vk.vkGetDeviceQueue(dev.dev, family, 0, byref(queue))
    pool = c_uint64()
    vk.check(
        vk.vkCreateCommandPool(
            dev.dev,
            byref(CommandPoolCreateInfo(ST_COMMAND_POOL_CREATE_INFO, None, 0, family)),
            None,
            byref(pool),
        ),
        "vkCreateCommandPool",
    )
    fence = c_uint64()
    try:
        cb = c_void_p()
        vk.check(
            vk.vkAllocateCommandBuffers(
                dev.dev,
                byref(CommandBufferAllocateInfo(ST_COMMAND_BUFFER_ALLOCATE_INFO, None, pool.value, 0, 1)),
                byref(cb),
            ),
            "vkAllocateCommandBuffers",
        )
        vk.check(
            vk.vkBeginCommandBuffer(
                cb, byref(CommandBufferBeginInfo(ST_COMMAND_BUFFER_BEGIN_INFO, None, 0, None))
            ),
            "vkBeginCommandBuffer",
        )
        region = BufferCopy(0, 0, nbytes)
        vk.vkCmdCopyBuffer(cb, src, dst, 1, byref(region))
        vk.check(vk.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
        vk.check(
            vk.vkCreateFence(
                dev.dev, byref(FenceCreateInfo(ST_FENCE_CREATE_INFO, None, 0)), None, byref(fence)
            ),
            "vkCreateFence",
        )
        cbs = (c_void_p * 1)(cb.value)
        submit = SubmitInfo(ST_SUBMIT_INFO, None, 0, None, None, 1, cbs, 0, None)
        times: list[float] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            vk.check(vk.vkQueueSubmit(queue, 1, byref(submit), fence.value), "vkQueueSubmit")
            vk.check(vk.vkWaitForFences(dev.dev, 1, byref(fence), 1, WHOLE_SIZE), "vkWaitForFences")
            times.append(time.perf_counter() - t0)
            vk.check(vk.vkResetFences(dev.dev, 1, byref(fence)), "vkResetFences")
        return times
    finally:
        if fence.value:
            vk.vkDestroyFence(dev.dev, fence.value, None)
        vk.vkDestroyCommandPool(dev.dev, pool.value, None)


def _allocation_costs(dev: Device, mtype: MemoryType, nbytes: int, pieces: int = 4) -> dict[str, float]:
    """Milliseconds per GiB of device-local allocation (create + allocate + bind) and free (destroy
    + free): one allocation of ``nbytes``, then ``pieces`` allocations of ``nbytes / pieces`` one
    after the other and on ``pieces`` threads at once (what restore and release do with several
    weight buffers). A restore cannot be faster than its allocations, a release than its frees."""
    per_gib = GIB / nbytes * 1000
    part = nbytes // pieces // 4096 * 4096
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    one = dev.bound(nbytes, mtype)
    t1 = time.perf_counter()
    dev.unbind(one)
    t2 = time.perf_counter()
    out["alloc_ms_per_gib"] = (t1 - t0) * per_gib
    out["free_ms_per_gib"] = (t2 - t1) * per_gib
    t0 = time.perf_counter()
    pairs = [dev.bound(part, mtype) for _ in range(pieces)]
    t1 = time.perf_counter()
    for pair in pairs:
        dev.unbind(pair)
    t2 = time.perf_counter()
    out[f"serial_{pieces}_alloc_ms_per_gib"] = (t1 - t0) * per_gib
    out[f"serial_{pieces}_free_ms_per_gib"] = (t2 - t1) * per_gib
    with ThreadPoolExecutor(max_workers=pieces) as pool:
        list(pool.map(lambda _i: None, range(pieces)))  # the threads exist before the clock starts
        t0 = time.perf_counter()
        pairs = list(pool.map(lambda _i: dev.bound(part, mtype), range(pieces)))
        t1 = time.perf_counter()
        list(pool.map(dev.unbind, pairs))
        t2 = time.perf_counter()
    out[f"threads_{pieces}_alloc_ms_per_gib"] = (t1 - t0) * per_gib
    out[f"threads_{pieces}_free_ms_per_gib"] = (t2 - t1) * per_gib
    return out


def _pipelined_restore(
    dev: Device, family: int, src: int, mtype: MemoryType, nbytes: int, pieces: int = 8
) -> dict[str, float]:
    """A restore as it could best go with fresh allocations, in plain Vulkan: ``pieces``
    device-local buffers allocated one after the other on a thread while the caller copies into
    each (from ``src``, fenced) as soon as its allocation is back. Milliseconds per GiB of the
    whole and of the copies in it: the whole near max(alloc, copy) means the driver allocates and
    copies at once (so restore can hide its allocations); near alloc + copy, it does one at a
    time (no ordering in the restore can reach the copy's speed while it allocates)."""
    part = nbytes // pieces // 4096 * 4096
    per_gib = GIB / (part * pieces) * 1000
    copier = Copier(dev, family)
    pairs: list[tuple[int, int]] = []
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(lambda: None).result()  # the thread exists before the clock starts
            t0 = time.perf_counter()
            futures = [pool.submit(dev.bound, part, mtype) for _ in range(pieces)]
            copy_s = 0.0
            try:
                for i, f in enumerate(futures):
                    pairs.append(f.result())
                    t1 = time.perf_counter()
                    copier.copy(src, i * part, pairs[-1][0], part)
                    copy_s += time.perf_counter() - t1
                total_s = time.perf_counter() - t0
            finally:  # what was allocated is freed, also after a failure
                for f in futures[len(pairs) :]:
                    with contextlib.suppress(VulkanUnavailableError):
                        pairs.append(f.result())
    finally:
        copier.close()
        for pair in pairs:
            dev.unbind(pair)
    return {
        f"pipelined_{pieces}_restore_ms_per_gib": total_s * per_gib,
        f"pipelined_{pieces}_copy_ms_per_gib": copy_s * per_gib,
    }


def _hold_main(argv: list[str]) -> int:
    """The other process of :func:`_free_while_allocating`: allocate, say ``ready``, wait for a
    line, free, print the free's seconds as JSON."""
    name, pci, ordinal, type_index, part, pieces = (
        argv[0] or None,
        argv[1] or None,
        int(argv[2]),
        int(argv[3]),
        int(argv[4]),
        int(argv[5]),
    )
    vk, inst = instance(b"timeshare-baseline-holder")
    try:
        d = pick_device(physical_devices(vk, inst), name, pci, ordinal)
        dev = Device(vk, d, [queue_families(d)[0][0]])
        try:
            mtype = d.types[type_index]
            pairs = [dev.bound(part, mtype) for _ in range(pieces)]
            print("ready", flush=True)
            sys.stdin.readline()
            t0 = time.perf_counter()
            for pair in pairs:
                dev.unbind(pair)
            print(json.dumps({"free_s": time.perf_counter() - t0}), flush=True)
        finally:
            dev.close()
    finally:
        vk.vkDestroyInstance(inst, None)
    return 0


def _free_while_allocating(
    dev: Device, ordinal: int, mtype: MemoryType, nbytes: int, pieces: int = 4, timeout_s: float = 120.0
) -> dict[str, float]:
    """A switch's two sides at once: another process (a fresh interpreter running this module)
    holds ``pieces`` device-local buffers of ``nbytes / pieces`` and frees them while this one
    allocates as many (what a holder's release and a requester's restore would do if the
    requester did not wait for the free). Milliseconds per GiB of both: this side's allocation
    near the uncontended ``serial_*_alloc_ms_per_gib`` means the driver frees in one process while
    it allocates in another (a streamed hand-over could hide the free); near alloc + free, it
    does one at a time."""
    d = dev.d
    part = nbytes // pieces // 4096 * 4096
    per_gib = GIB / (part * pieces) * 1000
    args = [d.name, d.pci, str(ordinal), str(mtype.index), str(part), str(pieces)]
    child = subprocess.Popen(
        [sys.executable, "-m", f"{__package__}.vkcopy", "--hold", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    pairs: list[tuple[int, int]] = []
    try:
        ready, _, _ = select.select([child.stdout], [], [], timeout_s)
        if not ready or child.stdout.readline().strip() != "ready":
            raise VulkanUnavailableError("the holding process did not allocate its buffers")
        child.stdin.write("go\n")
        child.stdin.flush()
        t0 = time.perf_counter()
        for _ in range(pieces):
            pairs.append(dev.bound(part, mtype))
        alloc_s = time.perf_counter() - t0
        out, _ = child.communicate(timeout=timeout_s)
        free_s = float(json.loads(out.strip().splitlines()[-1])["free_s"])
    except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired) as exc:
        raise VulkanUnavailableError(f"the two-process measurement failed: {exc}") from exc
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
        for pair in pairs:
            dev.unbind(pair)
    return {
        f"cross_process_{pieces}_alloc_ms_per_gib": alloc_s * per_gib,
        f"cross_process_{pieces}_free_ms_per_gib": free_s * per_gib,
    }


def copy_baseline(
    name: str | None = None,
    pci_bus_id: str | None = None,
    ordinal: int = 0,
    nbytes: int = GIB,
    reps: int = 5,
) -> CopyBaseline:
    """Measure the baseline on the Vulkan device that ggml calls ``name`` (its description, the
    Vulkan device name) at ``pci_bus_id`` (preferred when both sides know it); ``ordinal`` picks
    among devices of the same name. ``nbytes`` is clamped to the device's largest allocation.
    Raises VulkanUnavailableError."""
    vk, inst = instance(b"timeshare-baseline")
    try:
        d = pick_device(physical_devices(vk, inst), name, pci_bus_id, ordinal)
        size = min(nbytes, d.max_alloc) if d.max_alloc else nbytes
        families = queue_families(d)
        dst_type = device_type(d)
        rebar = max(
            (
                t.heap_bytes
                for t in d.types
                if t.flags & (DEVICE_LOCAL | HOST_VISIBLE) == DEVICE_LOCAL | HOST_VISIBLE
            ),
            default=0,
        )
        dev = Device(vk, d, [f for f, _ in families])
        try:
            dst, _ = dev.buffer(size, USAGE_TRANSFER_DST, dst_type)
            tries: list[CopyTry] = []
            paths: list[tuple[MemoryType, int]] = []  # each try's source type and queue family
            for src_type in host_types(d):
                src, mem = dev.buffer(size, USAGE_TRANSFER_SRC, src_type)
                ptr = c_void_p()
                vk.check(vk.vkMapMemory(dev.dev, mem, 0, WHOLE_SIZE, 0, byref(ptr)), "vkMapMemory")
                ctypes.memset(ptr.value or 0, 0x5A, size)  # touch every page before timing
                vk.vkUnmapMemory(dev.dev, mem)
                for fam, label in families:
                    secs = _timed_copies(dev, fam, src, dst, size, reps)
                    tries.append(CopyTry(src_type.describe(), dst_type.describe(), label, tuple(secs)))
                    paths.append((src_type, fam))
            dev.free_tracked()
            costs: dict[str, float] = {}
            try:  # not the baseline's business: a failure is logged, the baseline stands
                costs.update(_allocation_costs(dev, dst_type, size))
                if tries:
                    src_type, fam = paths[min(range(len(tries)), key=lambda i: tries[i].best_s)]
                    src, _ = dev.buffer(size, USAGE_TRANSFER_SRC, src_type)
                    costs.update(_pipelined_restore(dev, fam, src, dst_type, size))
                    dev.free_tracked()
                costs.update(_free_while_allocating(dev, ordinal, dst_type, size))
            except VulkanUnavailableError as exc:
                log.info("allocation costs not (all) measured: %s", exc)
        finally:
            dev.close()
    finally:
        vk.vkDestroyInstance(inst, None)
    if not tries:
        raise VulkanUnavailableError(f"{d.name} has no host-visible, host-coherent memory type")
    best = min(tries, key=lambda t: t.best_s)
    return CopyBaseline(
        device=d.name,
        device_type=DEVICE_TYPES.get(d.kind, str(d.kind)),
        pci_bus_id=d.pci,
        nbytes=size,
        gbps=size / 1e9 / best.best_s,
        best=best,
        tries=tuple(tries),
        max_allocation_bytes=d.max_alloc,
        rebar_bytes=rebar,
        memory_types=tuple(d.types),
        allocation=costs,
    )


def baseline_for_ggml_device(dev: Any, nbytes: int = GIB, reps: int = 5) -> CopyBaseline:
    """:func:`copy_baseline` on the Vulkan device behind a ggml device (``residency.GgmlDevice``):
    matched by PCI bus id where both know it, else by Vulkan device name and rank among the
    devices of that name."""
    from ..residency import ggml_device_description, ggml_device_id, ggml_devices

    desc = ggml_device_description(dev.handle)
    same = [d for d in ggml_devices() if d.is_gpu and ggml_device_description(d.handle) == desc]
    ordinal = next((i for i, d in enumerate(same) if d.handle == dev.handle), 0)
    return copy_baseline(desc, ggml_device_id(dev.handle) or None, ordinal, nbytes, reps)


if __name__ == "__main__":  # python -m timeshare.core.diagnostics.vkcopy: the baseline on device 0
    if sys.argv[1:2] == ["--hold"]:  # the other process of _free_while_allocating
        sys.exit(_hold_main(sys.argv[2:]))
    print(json.dumps(copy_baseline().report(), indent=1))
