"""Vulkan physical devices (their memory types, queue families, PCI bus id) and a logical device
with buffers bound to memory, copies on a queue: the plumbing shared by the copy baseline
(diagnostics/vkcopy.py) and the hand-over of device memory (devmem/vulkan.py)."""

from __future__ import annotations

import ctypes
from ctypes import byref, c_float, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass

from .api import (
    DEVICE_LOCAL,
    EXT_MEMORY_BUDGET,
    HOST_CACHED,
    HOST_COHERENT,
    HOST_VISIBLE,
    POOL_RESET_COMMAND_BUFFER,
    QUEUE_COMPUTE,
    QUEUE_GRAPHICS,
    QUEUE_TRANSFER,
    ST_BUFFER_CREATE_INFO,
    ST_COMMAND_BUFFER_ALLOCATE_INFO,
    ST_COMMAND_BUFFER_BEGIN_INFO,
    ST_COMMAND_POOL_CREATE_INFO,
    ST_DEVICE_CREATE_INFO,
    ST_DEVICE_QUEUE_CREATE_INFO,
    ST_FENCE_CREATE_INFO,
    ST_MEMORY_ALLOCATE_INFO,
    ST_PHYSICAL_DEVICE_ID_PROPERTIES,
    ST_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES,
    ST_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT,
    ST_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
    ST_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT,
    ST_PHYSICAL_DEVICE_PROPERTIES_2,
    ST_SUBMIT_INFO,
    USAGE_STORAGE,
    USAGE_TRANSFER_DST,
    USAGE_TRANSFER_SRC,
    VK_SUCCESS,
    WHOLE_SIZE,
    BufferCopy,
    BufferCreateInfo,
    CommandBufferAllocateInfo,
    CommandBufferBeginInfo,
    CommandPoolCreateInfo,
    DeviceCreateInfo,
    ExtensionProperties,
    FenceCreateInfo,
    Maintenance3,
    MemoryAllocateInfo,
    MemoryBudgetProperties,
    MemoryProperties,
    MemoryProperties2,
    MemoryRequirements,
    PciBusInfo,
    PhysicalDeviceIdProperties,
    Properties2,
    QueueCreateInfo,
    QueueFamily,
    SubmitInfo,
    Vk,
    VulkanUnavailableError,
)


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


@dataclass
class PhysDev:
    handle: int
    name: str
    kind: int
    pci: str
    max_alloc: int
    types: list[MemoryType]
    families: list[tuple[int, int]]  # (flags, count)
    extensions: frozenset[str] = frozenset()
    #: VkPhysicalDeviceIDProperties as hex: an opaque fd imports only where both match its exporter's
    device_uuid: str = ""
    driver_uuid: str = ""


def describe(vk: Vk, pd: int) -> PhysDev:
    n = c_uint32(0)
    vk.vkEnumerateDeviceExtensionProperties(pd, None, byref(n), None)
    exts = (ExtensionProperties * max(n.value, 1))()
    vk.vkEnumerateDeviceExtensionProperties(pd, None, byref(n), exts)
    names = frozenset(exts[i].extensionName.decode("ascii", "replace") for i in range(n.value))
    has_pci = "VK_EXT_pci_bus_info" in names
    ids = PhysicalDeviceIdProperties(ST_PHYSICAL_DEVICE_ID_PROPERTIES, None)
    m3 = Maintenance3(ST_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES, ctypes.addressof(ids), 0, 0)
    pci = PciBusInfo(ST_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT, ctypes.addressof(ids), 0, 0, 0, 0)
    if has_pci:
        m3.pNext = ctypes.addressof(pci)
    props = Properties2(ST_PHYSICAL_DEVICE_PROPERTIES_2, ctypes.addressof(m3))
    vk.vkGetPhysicalDeviceProperties2(pd, byref(props))
    raw = ctypes.string_at(ctypes.addressof(props) + Properties2.properties.offset, 300)
    kind = int.from_bytes(raw[16:20], "little")
    name = raw[20:276].split(b"\0", 1)[0].decode("utf-8", "replace")
    mem = MemoryProperties()
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
    fams = (QueueFamily * max(nq.value, 1))()
    vk.vkGetPhysicalDeviceQueueFamilyProperties(pd, byref(nq), fams)
    pci_id = (
        f"{pci.pciDomain:04x}:{pci.pciBus & 0xFF:02x}:{pci.pciDevice & 0xFF:02x}.{pci.pciFunction & 0xF:x}"
        if has_pci
        else ""
    )
    return PhysDev(
        pd,
        name,
        kind,
        pci_id,
        int(m3.maxMemoryAllocationSize),
        types,
        [(fams[i].queueFlags, fams[i].queueCount) for i in range(nq.value)],
        names,
        bytes(ids.deviceUUID).hex(),
        bytes(ids.driverUUID).hex(),
    )


def pick_device(devs: list[PhysDev], name: str | None, pci_bus_id: str | None, ordinal: int) -> PhysDev:
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


def queue_families(d: PhysDev) -> list[tuple[int, str]]:
    """The families to try: a dedicated transfer family (DMA engine) first, then the first compute
    family (every graphics/compute queue can copy)."""
    out: list[tuple[int, str]] = []
    for i, (flags, count) in enumerate(d.families):
        if count and flags & QUEUE_TRANSFER and not flags & (QUEUE_COMPUTE | QUEUE_GRAPHICS):
            out.append((i, f"transfer-only family {i}"))
            break
    for i, (flags, count) in enumerate(d.families):
        if count and flags & QUEUE_COMPUTE:
            out.append((i, f"compute family {i}"))
            break
    if not out:
        raise VulkanUnavailableError(f"{d.name} has no queue family that can copy")
    return out


def host_types(d: PhysDev) -> list[MemoryType]:
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


def device_type(d: PhysDev) -> MemoryType:
    local = [t for t in d.types if t.flags & DEVICE_LOCAL]
    if not local:
        raise VulkanUnavailableError(f"{d.name} has no device-local memory type")
    return next((t for t in local if not t.flags & HOST_VISIBLE), local[0])


def heap_free(vk: Vk, d: PhysDev, mtype: MemoryType, own: int) -> tuple[int, int]:
    """(free, total) bytes of ``mtype``'s heap: ``VK_EXT_memory_budget``'s budget less its usage
    (every process's, on NVIDIA's driver, RADV and ANV) where the device has the extension; else
    the heap's size less ``own`` (the caller's allocations: such a device says nothing of other
    processes)."""
    total = mtype.heap_bytes
    if EXT_MEMORY_BUDGET in d.extensions:
        budget = MemoryBudgetProperties(ST_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT, None)
        props = MemoryProperties2(ST_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2, ctypes.addressof(budget))
        vk.vkGetPhysicalDeviceMemoryProperties2(d.handle, byref(props))
        return max(0, int(budget.heapBudget[mtype.heap]) - int(budget.heapUsage[mtype.heap])), total
    return max(0, total - own), total


class Device:
    """A VkDevice with one queue per family tried, buffers and memory made on it (freed by close).
    ``extensions``: device extensions to enable (the caller checked ``d.extensions``)."""

    def __init__(self, vk: Vk, d: PhysDev, families: list[int], extensions: tuple[str, ...] = ()) -> None:
        self.vk = vk
        self.d = d
        prio = (c_float * 1)(1.0)
        infos = (QueueCreateInfo * len(families))(
            *[QueueCreateInfo(ST_DEVICE_QUEUE_CREATE_INFO, None, 0, f, 1, prio) for f in families]
        )
        names = (ctypes.c_char_p * max(len(extensions), 1))(*[e.encode() for e in extensions])
        ci = DeviceCreateInfo(
            ST_DEVICE_CREATE_INFO,
            None,
            0,
            len(families),
            infos,
            0,
            None,
            len(extensions),
            ctypes.cast(names, c_void_p),
            None,
        )
        dev = c_void_p()
        vk.check(vk.vkCreateDevice(d.handle, byref(ci), None, byref(dev)), "vkCreateDevice")
        self.dev = int(dev.value or 0)
        self.buffers: list[int] = []
        self.memories: list[int] = []

    def buffer(self, nbytes: int, usage: int, mtype: MemoryType) -> tuple[int, int]:
        vk = self.vk
        bci = BufferCreateInfo(ST_BUFFER_CREATE_INFO, None, 0, nbytes, usage, 0, 0, None)
        buf = c_uint64()
        vk.check(vk.vkCreateBuffer(self.dev, byref(bci), None, byref(buf)), "vkCreateBuffer")
        self.buffers.append(buf.value)
        req = MemoryRequirements()
        vk.vkGetBufferMemoryRequirements(self.dev, buf.value, byref(req))
        if not req.memoryTypeBits & (1 << mtype.index):
            raise VulkanUnavailableError(f"a transfer buffer cannot live in memory {mtype.describe()}")
        mai = MemoryAllocateInfo(ST_MEMORY_ALLOCATE_INFO, None, req.size, mtype.index)
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
        usage = USAGE_TRANSFER_SRC | USAGE_TRANSFER_DST | USAGE_STORAGE
        bci = BufferCreateInfo(ST_BUFFER_CREATE_INFO, None, 0, nbytes, usage, 0, 0, None)
        buf = c_uint64()
        vk.check(vk.vkCreateBuffer(self.dev, byref(bci), None, byref(buf)), "vkCreateBuffer")
        req = MemoryRequirements()
        vk.vkGetBufferMemoryRequirements(self.dev, buf.value, byref(req))
        mem = c_uint64()
        rc = vk.vkAllocateMemory(
            self.dev,
            byref(MemoryAllocateInfo(ST_MEMORY_ALLOCATE_INFO, None, req.size, mtype.index)),
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


class Copier:
    """One queue of ``family``, a command buffer and a fence: fenced copies one at a time."""

    def __init__(self, dev: Device, family: int) -> None:
        vk = self.vk = dev.vk
        self.dev = dev.dev
        self.queue = c_void_p()
        vk.vkGetDeviceQueue(self.dev, family, 0, byref(self.queue))
        self.pool = c_uint64()
        self.fence = c_uint64()
        info = CommandPoolCreateInfo(ST_COMMAND_POOL_CREATE_INFO, None, POOL_RESET_COMMAND_BUFFER, family)
        vk.check(vk.vkCreateCommandPool(self.dev, byref(info), None, byref(self.pool)), "vkCreateCommandPool")
        try:
            self.cb = c_void_p()
            alloc = CommandBufferAllocateInfo(ST_COMMAND_BUFFER_ALLOCATE_INFO, None, self.pool.value, 0, 1)
            vk.check(
                vk.vkAllocateCommandBuffers(self.dev, byref(alloc), byref(self.cb)),
                "vkAllocateCommandBuffers",
            )
            fci = FenceCreateInfo(ST_FENCE_CREATE_INFO, None, 0)
            vk.check(vk.vkCreateFence(self.dev, byref(fci), None, byref(self.fence)), "vkCreateFence")
        except BaseException:
            self.close()
            raise

    def copy(self, src: int, src_offset: int, dst: int, nbytes: int, dst_offset: int = 0) -> None:
        vk = self.vk
        begin = CommandBufferBeginInfo(ST_COMMAND_BUFFER_BEGIN_INFO, None, 0, None)
        vk.check(vk.vkBeginCommandBuffer(self.cb, byref(begin)), "vkBeginCommandBuffer")  # resets it
        vk.vkCmdCopyBuffer(self.cb, src, dst, 1, byref(BufferCopy(src_offset, dst_offset, nbytes)))
        vk.check(vk.vkEndCommandBuffer(self.cb), "vkEndCommandBuffer")
        cbs = (c_void_p * 1)(self.cb.value)
        submit = SubmitInfo(ST_SUBMIT_INFO, None, 0, None, None, 1, cbs, 0, None)
        vk.check(vk.vkQueueSubmit(self.queue, 1, byref(submit), self.fence.value), "vkQueueSubmit")
        vk.check(vk.vkWaitForFences(self.dev, 1, byref(self.fence), 1, WHOLE_SIZE), "vkWaitForFences")
        vk.check(vk.vkResetFences(self.dev, 1, byref(self.fence)), "vkResetFences")

    def close(self) -> None:
        if self.fence.value:
            self.vk.vkDestroyFence(self.dev, self.fence.value, None)
            self.fence = c_uint64()
        if self.pool.value:
            self.vk.vkDestroyCommandPool(self.dev, self.pool.value, None)
            self.pool = c_uint64()


def physical_devices(vk: Vk, inst: c_void_p) -> list[PhysDev]:
    n = c_uint32(0)
    vk.check(vk.vkEnumeratePhysicalDevices(inst, byref(n), None), "vkEnumeratePhysicalDevices")
    handles = (c_void_p * max(n.value, 1))()
    vk.check(vk.vkEnumeratePhysicalDevices(inst, byref(n), handles), "vkEnumeratePhysicalDevices")
    return [describe(vk, int(handles[i] or 0)) for i in range(n.value)]
