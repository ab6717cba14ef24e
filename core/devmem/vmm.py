"""``CudaVmmDevice``: chunks of CUDA device memory through the driver API's virtual memory
management (libcuda via ctypes), with POSIX file-descriptor handles that pass between processes.

cuMemCreate (``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``), cuMemExportToShareableHandle,
cuMemImportFromShareableHandle, cuMemAddressReserve/Free, cuMemMap, cuMemSetAccess, cuMemUnmap,
cuMemRelease, cuMemGetAllocationGranularity. An allocation lives while a handle, a mapping or an
exported fd of it exists (in any process): so the hand-over holder, which never initialises
CUDA, keeps memory alive by its fds alone.

The calls run on the worker's threads, where llama.cpp's CUDA runtime made the device's primary
context current; a thread with no current context gets the primary context (the same one).
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p

from .device import ChunkDeviceError

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103


class _Location(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp (cuda.h)."""

    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", _Location),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc (cuda.h)."""

    _fields_ = [("location", _Location), ("flags", c_int)]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _driver() -> ctypes.CDLL:
    """libcuda, initialised (cuInit); raises ChunkDeviceError where there is none."""
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise ChunkDeviceError(f"no CUDA driver (libcuda.so.1): {exc}") from exc
            sigs: dict[str, list[object]] = {
                "cuInit": [c_uint],
                "cuGetErrorString": [c_int, POINTER(c_char_p)],
                "cuDeviceGet": [POINTER(c_int), c_int],
                "cuDeviceGetByPCIBusId": [POINTER(c_int), c_char_p],
                "cuDeviceGetAttribute": [POINTER(c_int), c_int, c_int],
                "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
                "cuCtxGetCurrent": [POINTER(c_void_p)],
                "cuCtxSetCurrent": [c_void_p],
                "cuCtxSynchronize": [],
                "cuMemGetInfo_v2": [POINTER(c_size_t), POINTER(c_size_t)],
                "cuMemGetAllocationGranularity": [POINTER(c_size_t), POINTER(_AllocationProp), c_int],
                "cuMemCreate": [POINTER(c_ulonglong), c_size_t, POINTER(_AllocationProp), c_ulonglong],
                "cuMemRelease": [c_ulonglong],
                "cuMemExportToShareableHandle": [c_void_p, c_ulonglong, c_int, c_ulonglong],
                "cuMemImportFromShareableHandle": [POINTER(c_ulonglong), c_void_p, c_int],
                "cuMemAddressReserve": [POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong, c_ulonglong],
                "cuMemAddressFree": [c_ulonglong, c_size_t],
                "cuMemMap": [c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong],
                "cuMemUnmap": [c_ulonglong, c_size_t],
                "cuMemSetAccess": [c_ulonglong, c_size_t, POINTER(_AccessDesc), c_size_t],
            }
            for name, args in sigs.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError as exc:
                    raise ChunkDeviceError(f"the CUDA driver lacks {name}: too old for this path") from exc
                fn.restype = c_int
                fn.argtypes = args
            rc = lib.cuInit(0)
            if rc != CUDA_SUCCESS:
                raise ChunkDeviceError(f"cuInit failed ({rc})")
            _lib = lib
        return _lib


def _err(lib: ctypes.CDLL, rc: int, what: str) -> ChunkDeviceError:
    text = c_char_p()
    lib.cuGetErrorString(rc, byref(text))
    name = text.value.decode() if text.value else f"CUresult {rc}"
    return ChunkDeviceError(f"{what}: {name}", out_of_memory=rc == CUDA_ERROR_OUT_OF_MEMORY)


class CudaVmmDevice:
    """Chunks of one CUDA device. ``pci_bus_id`` (ggml's device id, "0000:01:00.0") finds the
    device as llama.cpp's CUDA backend numbers it; else ``ordinal``. Raises ChunkDeviceError
    (naming why) where the driver or the device cannot do this: no libcuda, no virtual memory
    management, no POSIX fd handles."""

    def __init__(self, pci_bus_id: str = "", ordinal: int = 0) -> None:
        lib = self._lib = _driver()
        dev = c_int()
        if pci_bus_id:
            rc = lib.cuDeviceGetByPCIBusId(byref(dev), pci_bus_id.encode())
            what = f"cuDeviceGetByPCIBusId({pci_bus_id})"
        else:
            rc = lib.cuDeviceGet(byref(dev), ordinal)
            what = f"cuDeviceGet({ordinal})"
        if rc != CUDA_SUCCESS:
            raise _err(lib, rc, what)
        self.ordinal = dev.value
        for attr, what in (
            (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
            (
                CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                "POSIX file-descriptor handles",
            ),
        ):
            value = c_int()
            self._check(lib.cuDeviceGetAttribute(byref(value), attr, self.ordinal), "cuDeviceGetAttribute")
            if not value.value:
                raise ChunkDeviceError(f"CUDA device {self.ordinal} has no {what}")
        self._primary = c_void_p()
        self._check(
            lib.cuDevicePrimaryCtxRetain(byref(self._primary), self.ordinal), "cuDevicePrimaryCtxRetain"
        )
        self._prop = _AllocationProp()
        self._prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal)
        self._access = _AccessDesc(
            _Location(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal), CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        gran = c_size_t()
        self._check(
            lib.cuMemGetAllocationGranularity(
                byref(gran), byref(self._prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        self.granularity = int(gran.value)
        self.name = f"CUDA VMM (device {self.ordinal})"
        self.creates = 0
        self.maps = 0
        self.unmaps = 0
        self._lock = threading.Lock()

    def _check(self, rc: int, what: str) -> None:
        if rc != CUDA_SUCCESS:
            raise _err(self._lib, rc, what)

    def _current(self) -> None:
        """This thread has a current context (the primary one where it had none)."""
        ctx = c_void_p()
        self._check(self._lib.cuCtxGetCurrent(byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            self._check(self._lib.cuCtxSetCurrent(self._primary), "cuCtxSetCurrent")

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device now (cuMemGetInfo)."""
        self._current()
        free, total = c_size_t(), c_size_t()
        self._check(self._lib.cuMemGetInfo_v2(byref(free), byref(total)), "cuMemGetInfo")
        return int(free.value), int(total.value)

    def create(self, nbytes: int) -> int:
        self._current()
        handle = c_ulonglong()
        self._check(
            self._lib.cuMemCreate(byref(handle), nbytes, byref(self._prop), 0), f"cuMemCreate({nbytes})"
        )
        with self._lock:
            self.creates += 1
        return int(handle.value)

    def export(self, handle: int) -> int:
        fd = c_int(-1)
        self._check(
            self._lib.cuMemExportToShareableHandle(
                byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
            "cuMemExportToShareableHandle",
        )
        return int(fd.value)

    def import_fd(self, fd: int) -> int:
        self._current()
        handle = c_ulonglong()
        self._check(
            self._lib.cuMemImportFromShareableHandle(
                byref(handle), c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
            "cuMemImportFromShareableHandle",
        )
        return int(handle.value)

    def release(self, handle: int) -> None:
        self._check(self._lib.cuMemRelease(handle), "cuMemRelease")

    def reserve(self, nbytes: int) -> int:
        self._current()
        ptr = c_ulonglong()
        self._check(
            self._lib.cuMemAddressReserve(byref(ptr), nbytes, self.granularity, 0, 0), "cuMemAddressReserve"
        )
        return int(ptr.value)

    def free_reserve(self, address: int, nbytes: int) -> None:
        self._check(self._lib.cuMemAddressFree(address, nbytes), "cuMemAddressFree")

    def map(self, address: int, nbytes: int, handle: int) -> None:
        self._check(self._lib.cuMemMap(address, nbytes, 0, handle, 0), "cuMemMap")
        with self._lock:
            self.maps += 1

    def set_access(self, address: int, nbytes: int) -> None:
        self._check(self._lib.cuMemSetAccess(address, nbytes, byref(self._access), 1), "cuMemSetAccess")

    def synchronize(self) -> None:
        """Wait for the device's work (a release unmaps nothing a kernel may still read)."""
        self._current()
        self._check(self._lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap one whole mapping (cuMemUnmap takes no part of one). Also called on the reclaim
        thread (kept chunks the holder asks back), which may have no current context yet."""
        self._current()
        self._check(self._lib.cuMemUnmap(address, nbytes), "cuMemUnmap")
        with self._lock:
            self.unmaps += 1
