"""``VulkanChunkDevice``: chunks of a Vulkan device's memory that pass between processes as opaque
POSIX fds (``VK_KHR_external_memory_fd`` on top of external memory, core since Vulkan 1.1; issue 40
item 4), through ctypes on the loader (core/vulkan).

How the chunk protocol maps (:class:`~.device.ChunkHandles`):

- ``create``: a ``VkBuffer`` made for external memory (``VkExternalMemoryBufferCreateInfo``,
  opaque fd) over the whole chunk, ``vkAllocateMemory`` with ``VkExportMemoryAllocateInfo``
  (opaque fd; ``VkMemoryDedicatedAllocateInfo`` naming the buffer where the driver says such
  memory must be dedicated) in the device-local type ggml-vulkan's weight buffers use, and
  ``vkBindBufferMemory``. The handle names the pair: the memory and the buffer bound to it.
- ``export``: ``vkGetMemoryFdKHR``, a new fd per call; each fd is a reference to the memory.
- ``import_fd``: the same buffer, and ``vkAllocateMemory`` with ``VkImportMemoryFdInfoKHR`` of a
  *dup* of the fd (a successful import owns the fd it is given; the caller's stays the caller's).
  Vulkan requires the import's allocation size and memory type to be the export's, on a device of
  the same device and driver UUIDs: every chunk of an arena has one size (``chunk_bytes``, or the
  ``nbytes`` given) and the memory type is chosen the same way in every process.
- ``release``: ``vkDestroyBuffer`` and ``vkFreeMemory``; the memory lives on while an fd (the
  arena's holder) or another process's import refers to it.

What does not map: CUDA VMM reserves an address range once and maps chunks into it, so a ggml
buffer keeps its device address while the physical memory behind it comes and goes
(:class:`~.device.ChunkDevice`: reserve, map, unmap). Core Vulkan has no such thing: a buffer is
bound to one ``VkDeviceMemory`` for its whole life and shaders reach it through descriptors that
name the buffer, not an address. (Sparse binding could rebind a sparse buffer's pages, but
ggml-vulkan's buffers are not sparse.) So this class is a :class:`~.device.ChunkHandles`, not a
``ChunkDevice``: a chunk's "mapping" is its buffer (:meth:`VulkanChunkDevice.buffer`), made with
it, and :class:`~.mapped.HandedMemory` does not take it. Using handed chunks for the weights needs
ggml-vulkan's weight buffers made of our memory on ggml's own ``VkDevice`` (docs/lab/HISTORY.md,
"Vulkan hand-over"); not built. What is built: the chunks, their fds through the arena's holder,
and the probe that proves the hand-over on a device (diagnostics/vkhandover.py).

The ``VkDevice`` is this object's own (one queue, for the uploads and read-backs of the probe).
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import byref, c_uint64, c_void_p
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vulkan.api import (
    BUFFER_CREATE_SPARSE_BINDING,
    EXT_MEMORY_BUDGET,
    EXT_MEMORY_FD,
    EXTERNAL_DEDICATED_ONLY,
    EXTERNAL_EXPORTABLE,
    EXTERNAL_IMPORTABLE,
    FEATURE_COUNT,
    FEATURE_SPARSE_BINDING,
    GET_MEMORY_FD,
    HANDLE_OPAQUE_FD,
    QUEUE_SPARSE_BINDING,
    ST_BUFFER_CREATE_INFO,
    ST_EXPORT_MEMORY_ALLOCATE_INFO,
    ST_EXTERNAL_BUFFER_PROPERTIES,
    ST_EXTERNAL_MEMORY_BUFFER_CREATE_INFO,
    ST_IMPORT_MEMORY_FD_INFO_KHR,
    ST_MEMORY_ALLOCATE_INFO,
    ST_MEMORY_DEDICATED_ALLOCATE_INFO,
    ST_MEMORY_GET_FD_INFO_KHR,
    ST_PHYSICAL_DEVICE_EXTERNAL_BUFFER_INFO,
    USAGE_STORAGE,
    USAGE_TRANSFER_DST,
    USAGE_TRANSFER_SRC,
    VK_SUCCESS,
    WHOLE_SIZE,
    BufferCreateInfo,
    ExportMemoryAllocateInfo,
    ExternalBufferProperties,
    ExternalMemoryBufferCreateInfo,
    ImportMemoryFdInfo,
    MemoryAllocateInfo,
    MemoryDedicatedAllocateInfo,
    MemoryGetFdInfo,
    MemoryRequirements,
    PhysicalDeviceExternalBufferInfo,
    Vk,
    VulkanUnavailableError,
    instance,
)
from ..vulkan.devices import (
    Copier,
    Device,
    MemoryType,
    PhysDev,
    device_type,
    heap_free,
    host_types,
    physical_devices,
    pick_device,
    queue_families,
)
from .device import CHUNK_BYTES, ChunkDeviceError, ChunkHandles

#: what a chunk's buffer may do: be copied into and out of, and be a storage buffer for shaders
#: (ggml-vulkan's device buffers have these three usages)
USAGE = USAGE_TRANSFER_SRC | USAGE_TRANSFER_DST | USAGE_STORAGE
_VK_ERROR_OUT_OF_HOST_MEMORY = -1
_VK_ERROR_OUT_OF_DEVICE_MEMORY = -2


@dataclass
class _Chunk:
    memory: int
    buffer: int
    nbytes: int
    imported: bool


@dataclass(frozen=True)
class Staging:
    """A host-visible buffer mapped into this process: uploads come from it, read-backs land in it."""

    buffer: int
    memory: int
    pointer: int
    nbytes: int


def external_support(vk: Vk, d: PhysDev) -> tuple[int, str]:
    """The external-memory features (``EXTERNAL_*`` bits) an opaque-fd buffer of ``USAGE`` has on
    ``d``, or 0 and why it has none."""
    if EXT_MEMORY_FD not in d.extensions:
        return 0, f"{d.name} has no {EXT_MEMORY_FD} (its driver exports no memory as an fd)"
    info = PhysicalDeviceExternalBufferInfo(
        ST_PHYSICAL_DEVICE_EXTERNAL_BUFFER_INFO, None, 0, USAGE, HANDLE_OPAQUE_FD
    )
    props = ExternalBufferProperties(ST_EXTERNAL_BUFFER_PROPERTIES, None, 0, 0, 0)
    vk.vkGetPhysicalDeviceExternalBufferProperties(d.handle, byref(info), byref(props))
    features = int(props.externalMemoryFeatures)
    want = EXTERNAL_EXPORTABLE | EXTERNAL_IMPORTABLE
    if features & want != want:
        return 0, (
            f"{d.name} cannot export and import a storage buffer's memory as an opaque fd "
            f"(external memory features {features:#x})"
        )
    return features, ""


def sparse_support(vk: Vk, d: PhysDev) -> tuple[bool, str]:
    """Whether a *sparse* buffer can bind opaque-fd chunks at any offset (``vkQueueBindSparse``):
    the Vulkan counterpart of CUDA VMM's mapping, which would let one weight buffer span several
    handed-over chunks (docs/lab/HISTORY.md, "Vulkan hand-over"). Not used yet: reported by the
    probe, so a GPU run says which shape the wiring can take. (True, how) or (False, why not)."""
    feats = (ctypes.c_uint32 * FEATURE_COUNT)()
    vk.vkGetPhysicalDeviceFeatures(d.handle, feats)
    if not feats[FEATURE_SPARSE_BINDING]:
        return False, f"{d.name} has no sparse binding (sparseBinding false)"
    if not any(count and flags & QUEUE_SPARSE_BINDING for flags, count in d.families):
        return False, f"{d.name} has no queue family that binds sparse memory"
    info = PhysicalDeviceExternalBufferInfo(
        ST_PHYSICAL_DEVICE_EXTERNAL_BUFFER_INFO, None, BUFFER_CREATE_SPARSE_BINDING, USAGE, HANDLE_OPAQUE_FD
    )
    props = ExternalBufferProperties(ST_EXTERNAL_BUFFER_PROPERTIES, None, 0, 0, 0)
    vk.vkGetPhysicalDeviceExternalBufferProperties(d.handle, byref(info), byref(props))
    features = int(props.externalMemoryFeatures)
    if not features & EXTERNAL_IMPORTABLE or features & EXTERNAL_DEDICATED_ONLY:
        return (
            False,
            f"{d.name}: a sparse buffer cannot bind imported opaque-fd memory (features {features:#x})",
        )
    return True, "a sparse buffer can bind imported opaque-fd chunks at any offset"


class VulkanChunkDevice:
    """Chunks of one Vulkan device (picked as the copy baseline picks it: PCI bus id, else name and
    rank, else ``ordinal``). Raises ChunkDeviceError naming why the hand-over cannot be used
    here: no Vulkan, no ``VK_KHR_external_memory_fd``, no opaque-fd export for a storage buffer,
    the device-local memory type cannot back one. Thread-safe; :meth:`close` frees what is left."""

    def __init__(
        self,
        name: str | None = None,
        pci_bus_id: str | None = None,
        ordinal: int = 0,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        try:
            vk, inst = instance(b"timeshare-handover")
        except VulkanUnavailableError as exc:
            raise ChunkDeviceError(f"no Vulkan: {exc}") from exc
        self.vk = vk
        self._inst = inst
        self._dev: Device | None = None
        self._copier: Copier | None = None
        try:
            self._open(name, pci_bus_id, ordinal)
        except VulkanUnavailableError as exc:
            self.close()
            raise ChunkDeviceError(str(exc)) from exc
        except BaseException:
            self.close()
            raise
        self.chunk_bytes = chunk_bytes
        self.creates = 0
        self.imports = 0
        self._chunks: dict[int, _Chunk] = {}
        self._staging: list[Staging] = []
        self._lock = threading.Lock()

    def _open(self, name: str | None, pci_bus_id: str | None, ordinal: int) -> None:
        vk = self.vk
        d = self.phys = pick_device(physical_devices(vk, self._inst), name, pci_bus_id, ordinal)
        features, why = external_support(vk, d)
        if not features:
            raise ChunkDeviceError(why)
        #: the driver requires each exported allocation to be dedicated to one buffer (ours is)
        self.dedicated = bool(features & EXTERNAL_DEDICATED_ONLY)
        self.mtype: MemoryType = device_type(d)
        family = queue_families(d)[0][0]
        exts = (EXT_MEMORY_FD,) + ((EXT_MEMORY_BUDGET,) if EXT_MEMORY_BUDGET in d.extensions else ())
        self._dev = Device(vk, d, [family], exts)
        self._get_fd = vk.device_function(self._dev.dev, "vkGetMemoryFdKHR", GET_MEMORY_FD)
        self._copier = Copier(self._dev, family)
        # the device-local type must back an external buffer; its alignment is the granularity
        buf = self._new_buffer(1 << 20)
        try:
            req = MemoryRequirements()
            vk.vkGetBufferMemoryRequirements(self._dev.dev, buf, byref(req))
        finally:
            vk.vkDestroyBuffer(self._dev.dev, buf, None)
        if not req.memoryTypeBits & (1 << self.mtype.index):
            raise ChunkDeviceError(
                f"{d.name}: an opaque-fd buffer cannot live in the device-local {self.mtype.describe()}"
            )
        self.granularity = max(int(req.alignment), 4096)
        #: whether sparse buffers could bind these chunks (:func:`sparse_support`), and how or why not
        self.sparse, self.sparse_note = sparse_support(vk, d)
        self.name = f"Vulkan opaque fd ({d.name})"

    @property
    def device(self) -> int:
        """The ``VkDevice`` handle the chunks' buffers belong to."""
        assert self._dev is not None
        return self._dev.dev

    # -- the chunk protocol ----------------------------------------------------------------------

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device-local heap: ``VK_EXT_memory_budget``'s budget less its
        usage where the device has it; else the heap's size less this object's chunks (a device
        without the extension says nothing of other processes)."""
        with self._lock:
            own = sum(c.nbytes for c in self._chunks.values())
        return heap_free(self.vk, self.phys, self.mtype, own)

    def create(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.granularity:
            raise ChunkDeviceError(f"{nbytes} bytes is not a multiple of {self.granularity}")
        export = ExportMemoryAllocateInfo(ST_EXPORT_MEMORY_ALLOCATE_INFO, None, HANDLE_OPAQUE_FD)
        handle = self._allocate(nbytes, ctypes.addressof(export), export, False, "an exportable allocation")
        with self._lock:
            self.creates += 1
        return handle

    def export(self, handle: int) -> int:
        chunk = self._chunk(handle)
        info = MemoryGetFdInfo(ST_MEMORY_GET_FD_INFO_KHR, None, chunk.memory, HANDLE_OPAQUE_FD)
        fd = ctypes.c_int(-1)
        rc = self._get_fd(self.device, byref(info), byref(fd))
        if rc != VK_SUCCESS or fd.value < 0:
            raise ChunkDeviceError(f"vkGetMemoryFdKHR failed (VkResult {rc})")
        return int(fd.value)

    def import_fd(self, fd: int, nbytes: int | None = None) -> int:
        """A chunk of the memory behind ``fd`` (an opaque fd exported by this driver on this
        device, of ``nbytes``: the chunk size by default). ``fd`` stays the caller's."""
        size = self.chunk_bytes if nbytes is None else nbytes
        own = os.dup(fd)
        info = ImportMemoryFdInfo(ST_IMPORT_MEMORY_FD_INFO_KHR, None, HANDLE_OPAQUE_FD, own)
        try:
            handle = self._allocate(size, ctypes.addressof(info), info, True, "an import of an opaque fd")
        except BaseException:
            os.close(own)  # a failed import does not take the fd
            raise
        with self._lock:
            self.imports += 1
        return handle

    def release(self, handle: int) -> None:
        with self._lock:
            chunk = self._chunks.pop(handle, None)
        if chunk is None:
            raise ChunkDeviceError(f"no chunk {handle:#x} on {self.name}")
        self.vk.vkDestroyBuffer(self.device, chunk.buffer, None)
        self.vk.vkFreeMemory(self.device, chunk.memory, None)

    def synchronize(self) -> None:
        self.vk.vkDeviceWaitIdle(self.device)

    # -- what a chunk is here ----------------------------------------------------------------------

    def buffer(self, handle: int) -> int:
        """The ``VkBuffer`` bound over the whole chunk (its only "mapping")."""
        return self._chunk(handle).buffer

    def chunks(self) -> int:
        """Chunks this object holds now (created or imported, not released)."""
        with self._lock:
            return len(self._chunks)

    def staging(self, nbytes: int) -> Staging:
        """A host-visible, host-coherent buffer of ``nbytes`` mapped here (freed by :meth:`close`)."""
        assert self._dev is not None
        types = host_types(self.phys)
        if not types:
            raise ChunkDeviceError(f"{self.phys.name} has no host-visible, host-coherent memory")
        try:
            buf, mem = self._dev.buffer(nbytes, USAGE_TRANSFER_SRC | USAGE_TRANSFER_DST, types[0])
        except VulkanUnavailableError as exc:
            raise ChunkDeviceError(str(exc)) from exc
        ptr = c_void_p()
        rc = self.vk.vkMapMemory(self.device, mem, 0, WHOLE_SIZE, 0, byref(ptr))
        if rc != VK_SUCCESS:
            raise ChunkDeviceError(f"vkMapMemory failed (VkResult {rc})")
        out = Staging(buf, mem, int(ptr.value or 0), nbytes)
        self._staging.append(out)
        return out

    def upload(self, src: Staging, src_offset: int, handle: int, nbytes: int | None = None) -> None:
        """One fenced copy from ``src`` into the chunk (its first ``nbytes``: all of it by default)."""
        chunk = self._chunk(handle)
        self._copy(src.buffer, src_offset, chunk.buffer, 0, chunk.nbytes if nbytes is None else nbytes)

    def download(self, handle: int, dst: Staging, dst_offset: int = 0, nbytes: int | None = None) -> None:
        """One fenced copy of the chunk (its first ``nbytes``) into ``dst`` at ``dst_offset``."""
        chunk = self._chunk(handle)
        self._copy(chunk.buffer, 0, dst.buffer, dst_offset, chunk.nbytes if nbytes is None else nbytes)

    def close(self) -> None:
        """Release every chunk left, the staging buffers, the device and the instance."""
        if self._dev is not None:
            self.vk.vkDeviceWaitIdle(self._dev.dev)
            for handle in list(getattr(self, "_chunks", {})):
                self.release(handle)
            if self._copier is not None:
                self._copier.close()
                self._copier = None
            for s in getattr(self, "_staging", []):
                self.vk.vkUnmapMemory(self._dev.dev, s.memory)
            self._dev.close()  # frees the staging buffers (tracked by the Device)
            self._dev = None
            self._staging = []
        if self._inst:
            self.vk.vkDestroyInstance(self._inst, None)
            self._inst = c_void_p()

    # -- inside ------------------------------------------------------------------------------------

    def _chunk(self, handle: int) -> _Chunk:
        with self._lock:
            chunk = self._chunks.get(handle)
        if chunk is None:
            raise ChunkDeviceError(f"no chunk {handle:#x} on {self.name}")
        return chunk

    def _new_buffer(self, nbytes: int) -> int:
        assert self._dev is not None
        ext = ExternalMemoryBufferCreateInfo(ST_EXTERNAL_MEMORY_BUFFER_CREATE_INFO, None, HANDLE_OPAQUE_FD)
        bci = BufferCreateInfo(ST_BUFFER_CREATE_INFO, ctypes.addressof(ext), 0, nbytes, USAGE, 0, 0, None)
        buf = c_uint64()
        self.vk.check(self.vk.vkCreateBuffer(self._dev.dev, byref(bci), None, byref(buf)), "vkCreateBuffer")
        return int(buf.value)

    def _allocate(self, nbytes: int, chain: int, keep: object, imported: bool, what: str) -> int:
        """A buffer of ``nbytes`` and memory allocated with the ``chain`` (the export or import
        structure at that address, kept alive by ``keep``) bound to it: its handle."""
        del keep  # referenced by the caller until this returns
        vk = self.vk
        dev = self.device
        buf = self._new_buffer(nbytes)
        try:
            req = MemoryRequirements()
            vk.vkGetBufferMemoryRequirements(dev, buf, byref(req))
            if req.size != nbytes:
                raise ChunkDeviceError(
                    f"a buffer of {nbytes} bytes needs {req.size} on {self.phys.name}: chunks must be a "
                    f"multiple of {self.granularity}"
                )
            dedicated = MemoryDedicatedAllocateInfo(ST_MEMORY_DEDICATED_ALLOCATE_INFO, chain, 0, buf)
            first = ctypes.addressof(dedicated) if self.dedicated else chain
            mai = MemoryAllocateInfo(ST_MEMORY_ALLOCATE_INFO, first, nbytes, self.mtype.index)
            mem = c_uint64()
            rc = vk.vkAllocateMemory(dev, byref(mai), None, byref(mem))
            if rc != VK_SUCCESS:
                oom = rc in (_VK_ERROR_OUT_OF_DEVICE_MEMORY, _VK_ERROR_OUT_OF_HOST_MEMORY)
                raise ChunkDeviceError(
                    f"vkAllocateMemory ({what}, {nbytes} bytes): VkResult {rc}", out_of_memory=oom
                )
            rc = vk.vkBindBufferMemory(dev, buf, mem.value, 0)
            if rc != VK_SUCCESS:
                vk.vkFreeMemory(dev, mem.value, None)
                raise ChunkDeviceError(f"vkBindBufferMemory ({what}): VkResult {rc}")
        except BaseException:
            vk.vkDestroyBuffer(dev, buf, None)
            raise
        with self._lock:
            self._chunks[int(mem.value)] = _Chunk(int(mem.value), buf, nbytes, imported)
        return int(mem.value)

    def _copy(self, src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
        assert self._copier is not None
        with self._lock:  # one command buffer
            try:
                self._copier.copy(src, src_offset, dst, nbytes, dst_offset)
            except VulkanUnavailableError as exc:
                raise ChunkDeviceError(str(exc)) from exc


def can_hand_over(
    name: str | None = None, pci_bus_id: str | None = None, ordinal: int = 0
) -> tuple[bool, str]:
    """The check at start: whether this Vulkan device can hand its memory over (the extension,
    opaque-fd export and import of a storage buffer in its device-local type): (True, the
    device's hand-over name) or (False, why not). Makes and closes a device of its own."""
    try:
        dev = VulkanChunkDevice(name, pci_bus_id, ordinal, 1 << 20)
    except ChunkDeviceError as exc:
        return False, str(exc)
    try:
        return True, dev.name
    finally:
        dev.close()


if TYPE_CHECKING:  # the chunk protocol holds (checked by mypy, never run)
    _handles: ChunkHandles = VulkanChunkDevice()
