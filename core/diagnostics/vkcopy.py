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
import os
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from ctypes import POINTER, Structure, byref, c_char, c_char_p, c_float, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass, field
from typing import Any, ClassVar

log = logging.getLogger(__name__)

VK_SUCCESS = 0
VK_API_VERSION_1_1 = (1 << 22) | (1 << 12)

_ST_APPLICATION_INFO = 0
_ST_INSTANCE_CREATE_INFO = 1
_ST_DEVICE_QUEUE_CREATE_INFO = 2
_ST_DEVICE_CREATE_INFO = 3
_ST_SUBMIT_INFO = 4
_ST_MEMORY_ALLOCATE_INFO = 5
_ST_FENCE_CREATE_INFO = 8
_ST_BUFFER_CREATE_INFO = 12
_ST_COMMAND_POOL_CREATE_INFO = 39
_ST_COMMAND_BUFFER_ALLOCATE_INFO = 40
_ST_COMMAND_BUFFER_BEGIN_INFO = 42
_ST_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001
_ST_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES = 1000168000
_ST_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT = 1000212000

DEVICE_LOCAL = 0x1
HOST_VISIBLE = 0x2
HOST_COHERENT = 0x4
HOST_CACHED = 0x8
_QUEUE_GRAPHICS = 0x1
_QUEUE_COMPUTE = 0x2
_QUEUE_TRANSFER = 0x4
_POOL_RESET_COMMAND_BUFFER = 0x2
_USAGE_TRANSFER_SRC = 0x1
_USAGE_TRANSFER_DST = 0x2
_USAGE_STORAGE = 0x20
_WHOLE_SIZE = (1 << 64) - 1
_DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}

GIB = 1 << 30


class VulkanUnavailableError(Exception):
    """No Vulkan loader, no device, or a call failed: the message says which."""


class _AppInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("pApplicationName", c_char_p),
        ("applicationVersion", c_uint32),
        ("pEngineName", c_char_p),
        ("engineVersion", c_uint32),
        ("apiVersion", c_uint32),
    ]


class _InstanceCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("pApplicationInfo", POINTER(_AppInfo)),
        ("enabledLayerCount", c_uint32),
        ("ppEnabledLayerNames", c_void_p),
        ("enabledExtensionCount", c_uint32),
        ("ppEnabledExtensionNames", c_void_p),
    ]


class _MemoryType(Structure):
    _fields_ = [("propertyFlags", c_uint32), ("heapIndex", c_uint32)]


class _MemoryHeap(Structure):
    _fields_ = [("size", c_uint64), ("flags", c_uint32)]


class _MemoryProperties(Structure):
    _fields_ = [
        ("memoryTypeCount", c_uint32),
        ("memoryTypes", _MemoryType * 32),
        ("memoryHeapCount", c_uint32),
        ("memoryHeaps", _MemoryHeap * 16),
    ]


class _QueueFamily(Structure):
    _fields_ = [
        ("queueFlags", c_uint32),
        ("queueCount", c_uint32),
        ("timestampValidBits", c_uint32),
        ("minImageTransferGranularity", c_uint32 * 3),
    ]


class _Maintenance3(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("maxPerSetDescriptors", c_uint32),
        ("maxMemoryAllocationSize", c_uint64),
    ]


class _PciBusInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("pciDomain", c_uint32),
        ("pciBus", c_uint32),
        ("pciDevice", c_uint32),
        ("pciFunction", c_uint32),
    ]


class _Properties2(Structure):
    # VkPhysicalDeviceProperties is 824 bytes on LP64; a larger block is harmless (the driver writes
    # the struct it knows, then follows pNext)
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("properties", ctypes.c_ubyte * 1024)]


class _ExtensionProperties(Structure):
    _fields_ = [("extensionName", c_char * 256), ("specVersion", c_uint32)]


class _QueueCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("queueFamilyIndex", c_uint32),
        ("queueCount", c_uint32),
        ("pQueuePriorities", POINTER(c_float)),
    ]


class _DeviceCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("queueCreateInfoCount", c_uint32),
        ("pQueueCreateInfos", POINTER(_QueueCreateInfo)),
        ("enabledLayerCount", c_uint32),
        ("ppEnabledLayerNames", c_void_p),
        ("enabledExtensionCount", c_uint32),
        ("ppEnabledExtensionNames", c_void_p),
        ("pEnabledFeatures", c_void_p),
    ]


class _BufferCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("size", c_uint64),
        ("usage", c_uint32),
        ("sharingMode", c_uint32),
        ("queueFamilyIndexCount", c_uint32),
        ("pQueueFamilyIndices", c_void_p),
    ]


class _MemoryRequirements(Structure):
    _fields_ = [("size", c_uint64), ("alignment", c_uint64), ("memoryTypeBits", c_uint32)]


class _MemoryAllocateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("allocationSize", c_uint64),
        ("memoryTypeIndex", c_uint32),
    ]


class _CommandPoolCreateInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("flags", c_uint32), ("queueFamilyIndex", c_uint32)]


class _CommandBufferAllocateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("commandPool", c_uint64),
        ("level", c_uint32),
        ("commandBufferCount", c_uint32),
    ]


class _CommandBufferBeginInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("flags", c_uint32), ("pInheritanceInfo", c_void_p)]


class _BufferCopy(Structure):
    _fields_ = [("srcOffset", c_uint64), ("dstOffset", c_uint64), ("size", c_uint64)]


class _SubmitInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("waitSemaphoreCount", c_uint32),
        ("pWaitSemaphores", c_void_p),
        ("pWaitDstStageMask", c_void_p),
        ("commandBufferCount", c_uint32),
        ("pCommandBuffers", POINTER(c_void_p)),
        ("signalSemaphoreCount", c_uint32),
        ("pSignalSemaphores", c_void_p),
    ]


class _FenceCreateInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("flags", c_uint32)]


def flag_names(flags: int) -> str:
    names = [
        n
        for bit, n in (
            (DEVICE_LOCAL, "device-local"),
            (HOST_VISIBLE, "host-visible"),
            (HOST_COHERENT, "host-coherent"),
            (HOST_CACHED, "host-cached"),
        )
        if flags & bit
    ]
    return "|".join(names) or "none"


@dataclass(frozen=True)
class MemoryType:
    index: int
    flags: int
    heap: int
    heap_bytes: int

    def describe(self) -> str:
        flags = flag_names(self.flags)
        return f"type {self.index} ({flags}, heap {self.heap} of {self.heap_bytes / 1e9:.1f} GB)"


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


def _load_loader() -> ctypes.CDLL:
    for name in ("libvulkan.so.1", ctypes.util.find_library("vulkan")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise VulkanUnavailableError("no Vulkan loader (libvulkan.so.1) on this system")


class _Vk:
    """The few core entry points, bound with their signatures (the loader exports all of 1.0/1.1)."""

    _SIGS: ClassVar[dict[str, tuple[Any, list[Any]]]] = {
        "vkCreateInstance": (ctypes.c_int, [c_void_p, c_void_p, POINTER(c_void_p)]),
        "vkDestroyInstance": (None, [c_void_p, c_void_p]),
        "vkEnumeratePhysicalDevices": (ctypes.c_int, [c_void_p, POINTER(c_uint32), c_void_p]),
        "vkGetPhysicalDeviceProperties2": (None, [c_void_p, c_void_p]),
        "vkGetPhysicalDeviceMemoryProperties": (None, [c_void_p, c_void_p]),
        "vkGetPhysicalDeviceQueueFamilyProperties": (None, [c_void_p, POINTER(c_uint32), c_void_p]),
        "vkEnumerateDeviceExtensionProperties": (
            ctypes.c_int,
            [c_void_p, c_char_p, POINTER(c_uint32), c_void_p],
        ),
        "vkCreateDevice": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_void_p)]),
        "vkDestroyDevice": (None, [c_void_p, c_void_p]),
        "vkGetDeviceQueue": (None, [c_void_p, c_uint32, c_uint32, POINTER(c_void_p)]),
        "vkCreateBuffer": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkDestroyBuffer": (None, [c_void_p, c_uint64, c_void_p]),
        "vkGetBufferMemoryRequirements": (None, [c_void_p, c_uint64, c_void_p]),
        "vkAllocateMemory": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkFreeMemory": (None, [c_void_p, c_uint64, c_void_p]),
        "vkBindBufferMemory": (ctypes.c_int, [c_void_p, c_uint64, c_uint64, c_uint64]),
        "vkMapMemory": (ctypes.c_int, [c_void_p, c_uint64, c_uint64, c_uint64, c_uint32, POINTER(c_void_p)]),
        "vkUnmapMemory": (None, [c_void_p, c_uint64]),
        "vkCreateCommandPool": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkDestroyCommandPool": (None, [c_void_p, c_uint64, c_void_p]),
        "vkAllocateCommandBuffers": (ctypes.c_int, [c_void_p, c_void_p, POINTER(c_void_p)]),
        "vkBeginCommandBuffer": (ctypes.c_int, [c_void_p, c_void_p]),
        "vkEndCommandBuffer": (ctypes.c_int, [c_void_p]),
        "vkCmdCopyBuffer": (None, [c_void_p, c_uint64, c_uint64, c_uint32, c_void_p]),
        "vkCreateFence": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkDestroyFence": (None, [c_void_p, c_uint64, c_void_p]),
        "vkResetFences": (ctypes.c_int, [c_void_p, c_uint32, POINTER(c_uint64)]),
        "vkWaitForFences": (ctypes.c_int, [c_void_p, c_uint32, POINTER(c_uint64), c_uint32, c_uint64]),
        "vkQueueSubmit": (ctypes.c_int, [c_void_p, c_uint32, c_void_p, c_uint64]),
        "vkDeviceWaitIdle": (ctypes.c_int, [c_void_p]),
    }

    def __init__(self) -> None:
        lib = _load_loader()
        for name, (res, args) in self._SIGS.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise VulkanUnavailableError(
                    f"the Vulkan loader does not export {name} (Vulkan 1.1 needed)"
                ) from exc
            fn.restype = res
            fn.argtypes = args
            setattr(self, name, fn)

    def __getattr__(self, name: str) -> Any:  # typed access to the bound functions
        raise AttributeError(name)

    def check(self, rc: int, what: str) -> None:
        if rc != VK_SUCCESS:
            raise VulkanUnavailableError(f"{what} failed (VkResult {rc})")


@dataclass
class _PhysDev:
    handle: int
    name: str
    kind: int
    pci: str
    max_alloc: int
    types: list[MemoryType]
    families: list[tuple[int, int]]  # (flags, count)


def _describe(vk: _Vk, pd: int) -> _PhysDev:
    n = c_uint32(0)
    vk.vkEnumerateDeviceExtensionProperties(pd, None, byref(n), None)
    exts = (_ExtensionProperties * max(n.value, 1))()
    vk.vkEnumerateDeviceExtensionProperties(pd, None, byref(n), exts)
    has_pci = any(exts[i].extensionName == b"VK_EXT_pci_bus_info" for i in range(n.value))
    m3 = _Maintenance3(_ST_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES, None, 0, 0)
    pci = _PciBusInfo(_ST_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT, None, 0, 0, 0, 0)
    if has_pci:
        m3.pNext = ctypes.addressof(pci)
    props = _Properties2(_ST_PHYSICAL_DEVICE_PROPERTIES_2, ctypes.addressof(m3))
    vk.vkGetPhysicalDeviceProperties2(pd, byref(props))
    raw = ctypes.string_at(ctypes.addressof(props) + _Properties2.properties.offset, 300)
    kind = int.from_bytes(raw[16:20], "little")
    name = raw[20:276].split(b"\0", 1)[0].decode("utf-8", "replace")
    mem = _MemoryProperties()
    vk.vkGetPhysicalDeviceMemoryProperties(pd, byref(mem))
    types = [
        MemoryType(
            i,
            mem.memoryTypes[i].propertyFlags,
            mem.memoryTypes[i].heapIndex,
            int(mem.memoryHeaps[mem.memoryTypes[i].heapIndex].size),
        )
        for i in range(mem.memoryTypeCount)
    ]
    nq = c_uint32(0)
    vk.vkGetPhysicalDeviceQueueFamilyProperties(pd, byref(nq), None)
    fams = (_QueueFamily * max(nq.value, 1))()
    vk.vkGetPhysicalDeviceQueueFamilyProperties(pd, byref(nq), fams)
    pci_id = (
        f"{pci.pciDomain:04x}:{pci.pciBus & 0xFF:02x}:{pci.pciDevice & 0xFF:02x}.{pci.pciFunction & 0xF:x}"
        if has_pci
        else ""
    )
    return _PhysDev(
        pd,
        name,
        kind,
        pci_id,
        int(m3.maxMemoryAllocationSize),
        types,
        [(fams[i].queueFlags, fams[i].queueCount) for i in range(nq.value)],
    )


def _pick_device(devs: list[_PhysDev], name: str | None, pci_bus_id: str | None, ordinal: int) -> _PhysDev:
    if pci_bus_id:
        for d in devs:
            if d.pci and d.pci == pci_bus_id.lower():
                return d
    if name:
        same = [d for d in devs if d.name == name]
        if same:
            return same[min(ordinal, len(same) - 1)]
    if not devs:
        raise VulkanUnavailableError("the Vulkan loader lists no physical device")
    if name or pci_bus_id:
        raise VulkanUnavailableError(
            f"no Vulkan device named {name!r} (PCI {pci_bus_id or '?'}); the loader lists "
            + ", ".join(d.name for d in devs)
        )
    return devs[min(ordinal, len(devs) - 1)]


def _queue_families(d: _PhysDev) -> list[tuple[int, str]]:
    """The families to try: a dedicated transfer family (DMA engine) first, then the first compute
    family (every graphics/compute queue can copy)."""
    out: list[tuple[int, str]] = []
    for i, (flags, count) in enumerate(d.families):
        if count and flags & _QUEUE_TRANSFER and not flags & (_QUEUE_COMPUTE | _QUEUE_GRAPHICS):
            out.append((i, f"transfer-only family {i}"))
            break
    for i, (flags, count) in enumerate(d.families):
        if count and flags & _QUEUE_COMPUTE:
            out.append((i, f"compute family {i}"))
            break
    if not out:
        raise VulkanUnavailableError(f"{d.name} has no queue family that can copy")
    return out


def _host_types(d: _PhysDev) -> list[MemoryType]:
    """Host-visible, host-coherent types in system memory (not device-local), one per flag set;
    every host-visible type when the device has only device-local memory (UMA, lavapipe)."""
    want = HOST_VISIBLE | HOST_COHERENT
    plain = [t for t in d.types if t.flags & want == want and not t.flags & DEVICE_LOCAL]
    pool = plain or [t for t in d.types if t.flags & want == want]
    seen: set[int] = set()
    out = []
    for t in pool:
        if t.flags not in seen:
            seen.add(t.flags)
            out.append(t)
    return out


def _device_type(d: _PhysDev) -> MemoryType:
    local = [t for t in d.types if t.flags & DEVICE_LOCAL]
    if not local:
        raise VulkanUnavailableError(f"{d.name} has no device-local memory type")
    return next((t for t in local if not t.flags & HOST_VISIBLE), local[0])


class _Device:
    """A VkDevice with one queue per family tried, buffers and memory made on it (freed by close)."""

    def __init__(self, vk: _Vk, d: _PhysDev, families: list[int]) -> None:
        self.vk = vk
        self.d = d
        prio = (c_float * 1)(1.0)
        infos = (_QueueCreateInfo * len(families))(
            *[_QueueCreateInfo(_ST_DEVICE_QUEUE_CREATE_INFO, None, 0, f, 1, prio) for f in families]
        )
        ci = _DeviceCreateInfo(_ST_DEVICE_CREATE_INFO, None, 0, len(families), infos, 0, None, 0, None, None)
        dev = c_void_p()
        vk.check(vk.vkCreateDevice(d.handle, byref(ci), None, byref(dev)), "vkCreateDevice")
        self.dev = int(dev.value or 0)
        self.buffers: list[int] = []
        self.memories: list[int] = []

    def buffer(self, nbytes: int, usage: int, mtype: MemoryType) -> tuple[int, int]:
        vk = self.vk
        bci = _BufferCreateInfo(_ST_BUFFER_CREATE_INFO, None, 0, nbytes, usage, 0, 0, None)
        buf = c_uint64()
        vk.check(vk.vkCreateBuffer(self.dev, byref(bci), None, byref(buf)), "vkCreateBuffer")
        self.buffers.append(buf.value)
        req = _MemoryRequirements()
        vk.vkGetBufferMemoryRequirements(self.dev, buf.value, byref(req))
        if not req.memoryTypeBits & (1 << mtype.index):
            raise VulkanUnavailableError(f"a transfer buffer cannot live in memory {mtype.describe()}")
        mai = _MemoryAllocateInfo(_ST_MEMORY_ALLOCATE_INFO, None, req.size, mtype.index)
        mem = c_uint64()
        vk.check(
            vk.vkAllocateMemory(self.dev, byref(mai), None, byref(mem)),
            f"vkAllocateMemory of {req.size / 1e9:.2f} GB in {mtype.describe()}",
        )
        self.memories.append(mem.value)
        vk.check(vk.vkBindBufferMemory(self.dev, buf.value, mem.value, 0), "vkBindBufferMemory")
        return buf.value, mem.value

    def bound(self, nbytes: int, mtype: MemoryType) -> tuple[int, int]:
        """A buffer bound to its own allocation the way ggml-vulkan makes a device buffer (not
        tracked: :meth:`unbind` frees it)."""
        vk = self.vk
        usage = _USAGE_TRANSFER_SRC | _USAGE_TRANSFER_DST | _USAGE_STORAGE
        bci = _BufferCreateInfo(_ST_BUFFER_CREATE_INFO, None, 0, nbytes, usage, 0, 0, None)
        buf = c_uint64()
        vk.check(vk.vkCreateBuffer(self.dev, byref(bci), None, byref(buf)), "vkCreateBuffer")
        req = _MemoryRequirements()
        vk.vkGetBufferMemoryRequirements(self.dev, buf.value, byref(req))
        mem = c_uint64()
        rc = vk.vkAllocateMemory(
            self.dev,
            byref(_MemoryAllocateInfo(_ST_MEMORY_ALLOCATE_INFO, None, req.size, mtype.index)),
            None,
            byref(mem),
        )
        if rc != VK_SUCCESS:
            vk.vkDestroyBuffer(self.dev, buf.value, None)
            vk.check(rc, f"vkAllocateMemory of {req.size / 1e9:.2f} GB")
        vk.check(vk.vkBindBufferMemory(self.dev, buf.value, mem.value, 0), "vkBindBufferMemory")
        return buf.value, mem.value

    def unbind(self, pair: tuple[int, int]) -> None:
        self.vk.vkDestroyBuffer(self.dev, pair[0], None)
        self.vk.vkFreeMemory(self.dev, pair[1], None)

    def free_tracked(self) -> None:
        vk = self.vk
        vk.vkDeviceWaitIdle(self.dev)
        for b in self.buffers:
            vk.vkDestroyBuffer(self.dev, b, None)
        for m in self.memories:
            vk.vkFreeMemory(self.dev, m, None)
        self.buffers, self.memories = [], []

    def close(self) -> None:
        if not self.dev:
            return
        self.free_tracked()
        self.vk.vkDestroyDevice(self.dev, None)
        self.dev = 0


def _timed_copies(dev: _Device, family: int, src: int, dst: int, nbytes: int, reps: int) -> list[float]:
    vk = dev.vk
    queue = c_void_p()
    vk.vkGetDeviceQueue(dev.dev, family, 0, byref(queue))
    pool = c_uint64()
    vk.check(
        vk.vkCreateCommandPool(
            dev.dev,
            byref(_CommandPoolCreateInfo(_ST_COMMAND_POOL_CREATE_INFO, None, 0, family)),
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
                byref(_CommandBufferAllocateInfo(_ST_COMMAND_BUFFER_ALLOCATE_INFO, None, pool.value, 0, 1)),
                byref(cb),
            ),
            "vkAllocateCommandBuffers",
        )
        vk.check(
            vk.vkBeginCommandBuffer(
                cb, byref(_CommandBufferBeginInfo(_ST_COMMAND_BUFFER_BEGIN_INFO, None, 0, None))
            ),
            "vkBeginCommandBuffer",
        )
        region = _BufferCopy(0, 0, nbytes)
        vk.vkCmdCopyBuffer(cb, src, dst, 1, byref(region))
        vk.check(vk.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
        vk.check(
            vk.vkCreateFence(
                dev.dev, byref(_FenceCreateInfo(_ST_FENCE_CREATE_INFO, None, 0)), None, byref(fence)
            ),
            "vkCreateFence",
        )
        cbs = (c_void_p * 1)(cb.value)
        submit = _SubmitInfo(_ST_SUBMIT_INFO, None, 0, None, None, 1, cbs, 0, None)
        times: list[float] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            vk.check(vk.vkQueueSubmit(queue, 1, byref(submit), fence.value), "vkQueueSubmit")
            vk.check(vk.vkWaitForFences(dev.dev, 1, byref(fence), 1, _WHOLE_SIZE), "vkWaitForFences")
            times.append(time.perf_counter() - t0)
            vk.check(vk.vkResetFences(dev.dev, 1, byref(fence)), "vkResetFences")
        return times
    finally:
        if fence.value:
            vk.vkDestroyFence(dev.dev, fence.value, None)
        vk.vkDestroyCommandPool(dev.dev, pool.value, None)


def _allocation_costs(dev: _Device, mtype: MemoryType, nbytes: int, pieces: int = 4) -> dict[str, float]:
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


class _Copier:
    """One queue of ``family``, a command buffer and a fence: fenced copies one at a time."""

    def __init__(self, dev: _Device, family: int) -> None:
        vk = self.vk = dev.vk
        self.dev = dev.dev
        self.queue = c_void_p()
        vk.vkGetDeviceQueue(self.dev, family, 0, byref(self.queue))
        self.pool = c_uint64()
        self.fence = c_uint64()
        info = _CommandPoolCreateInfo(_ST_COMMAND_POOL_CREATE_INFO, None, _POOL_RESET_COMMAND_BUFFER, family)
        vk.check(vk.vkCreateCommandPool(self.dev, byref(info), None, byref(self.pool)), "vkCreateCommandPool")
        try:
            self.cb = c_void_p()
            alloc = _CommandBufferAllocateInfo(_ST_COMMAND_BUFFER_ALLOCATE_INFO, None, self.pool.value, 0, 1)
            vk.check(
                vk.vkAllocateCommandBuffers(self.dev, byref(alloc), byref(self.cb)),
                "vkAllocateCommandBuffers",
            )
            fci = _FenceCreateInfo(_ST_FENCE_CREATE_INFO, None, 0)
            vk.check(vk.vkCreateFence(self.dev, byref(fci), None, byref(self.fence)), "vkCreateFence")
        except BaseException:
            self.close()
            raise

    def copy(self, src: int, src_offset: int, dst: int, nbytes: int) -> None:
        vk = self.vk
        begin = _CommandBufferBeginInfo(_ST_COMMAND_BUFFER_BEGIN_INFO, None, 0, None)
        vk.check(vk.vkBeginCommandBuffer(self.cb, byref(begin)), "vkBeginCommandBuffer")  # resets it
        vk.vkCmdCopyBuffer(self.cb, src, dst, 1, byref(_BufferCopy(src_offset, 0, nbytes)))
        vk.check(vk.vkEndCommandBuffer(self.cb), "vkEndCommandBuffer")
        cbs = (c_void_p * 1)(self.cb.value)
        submit = _SubmitInfo(_ST_SUBMIT_INFO, None, 0, None, None, 1, cbs, 0, None)
        vk.check(vk.vkQueueSubmit(self.queue, 1, byref(submit), self.fence.value), "vkQueueSubmit")
        vk.check(vk.vkWaitForFences(self.dev, 1, byref(self.fence), 1, _WHOLE_SIZE), "vkWaitForFences")
        vk.check(vk.vkResetFences(self.dev, 1, byref(self.fence)), "vkResetFences")

    def close(self) -> None:
        if self.fence.value:
            self.vk.vkDestroyFence(self.dev, self.fence.value, None)
            self.fence = c_uint64()
        if self.pool.value:
            self.vk.vkDestroyCommandPool(self.dev, self.pool.value, None)
            self.pool = c_uint64()


def _pipelined_restore(
    dev: _Device, family: int, src: int, mtype: MemoryType, nbytes: int, pieces: int = 8
) -> dict[str, float]:
    """A restore as it could best go with fresh allocations, in plain Vulkan: ``pieces``
    device-local buffers allocated one after the other on a thread while the caller copies into
    each (from ``src``, fenced) as soon as its allocation is back. Milliseconds per GiB of the
    whole and of the copies in it: the whole near max(alloc, copy) means the driver allocates and
    copies at once (so restore can hide its allocations); near alloc + copy, it does one at a
    time (no ordering in the restore can reach the copy's speed while it allocates)."""
    part = nbytes // pieces // 4096 * 4096
    per_gib = GIB / (part * pieces) * 1000
    copier = _Copier(dev, family)
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
    vk, inst = _instance(b"timeshare-baseline-holder")
    try:
        d = _pick_device(_physical_devices(vk, inst), name, pci, ordinal)
        dev = _Device(vk, d, [_queue_families(d)[0][0]])
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
    dev: _Device, ordinal: int, mtype: MemoryType, nbytes: int, pieces: int = 4, timeout_s: float = 120.0
) -> dict[str, float]:
    """A switch's two sides at once: another process (a fresh interpreter running this file)
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
        [sys.executable, os.path.abspath(__file__), "--hold", *args],
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


def _instance(app_name: bytes) -> tuple[_Vk, c_void_p]:
    vk = _Vk()
    app = _AppInfo(_ST_APPLICATION_INFO, None, app_name, 1, b"timeshare", 1, VK_API_VERSION_1_1)
    ici = _InstanceCreateInfo(_ST_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app), 0, None, 0, None)
    inst = c_void_p()
    vk.check(vk.vkCreateInstance(byref(ici), None, byref(inst)), "vkCreateInstance")
    return vk, inst


def _physical_devices(vk: _Vk, inst: c_void_p) -> list[_PhysDev]:
    n = c_uint32(0)
    vk.check(vk.vkEnumeratePhysicalDevices(inst, byref(n), None), "vkEnumeratePhysicalDevices")
    handles = (c_void_p * max(n.value, 1))()
    vk.check(vk.vkEnumeratePhysicalDevices(inst, byref(n), handles), "vkEnumeratePhysicalDevices")
    return [_describe(vk, int(handles[i] or 0)) for i in range(n.value)]


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
    vk, inst = _instance(b"timeshare-baseline")
    try:
        d = _pick_device(_physical_devices(vk, inst), name, pci_bus_id, ordinal)
        size = min(nbytes, d.max_alloc) if d.max_alloc else nbytes
        families = _queue_families(d)
        dst_type = _device_type(d)
        rebar = max(
            (
                t.heap_bytes
                for t in d.types
                if t.flags & (DEVICE_LOCAL | HOST_VISIBLE) == DEVICE_LOCAL | HOST_VISIBLE
            ),
            default=0,
        )
        dev = _Device(vk, d, [f for f, _ in families])
        try:
            dst, _ = dev.buffer(size, _USAGE_TRANSFER_DST, dst_type)
            tries: list[CopyTry] = []
            paths: list[tuple[MemoryType, int]] = []  # each try's source type and queue family
            for src_type in _host_types(d):
                src, mem = dev.buffer(size, _USAGE_TRANSFER_SRC, src_type)
                ptr = c_void_p()
                vk.check(vk.vkMapMemory(dev.dev, mem, 0, _WHOLE_SIZE, 0, byref(ptr)), "vkMapMemory")
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
                    src, _ = dev.buffer(size, _USAGE_TRANSFER_SRC, src_type)
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
        device_type=_DEVICE_TYPES.get(d.kind, str(d.kind)),
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
