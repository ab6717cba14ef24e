"""``MemfdDevice``: the CPU stand-in for a chunk device (memfd_create + mmap).

Named as such everywhere it shows: it proves the hand-over's bookkeeping, its fd passing and the
pointing of a ggml CPU buffer at handed memory on a machine without a GPU; it proves nothing of
a GPU driver. Its rules are CUDA VMM's: an allocation (a memfd) lives while a handle (an fd), a
mapping or a holder's fd of it exists; a mapping is made inside a range reserved once
(``PROT_NONE``) and unmapping puts the reservation back, so the range stays this process's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

from .device import ChunkDeviceError

_PROT_NONE = 0
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

#: the name every chunk's memfd carries (``/proc/<pid>/fd`` and ``maps`` show ``/memfd:<name>``)
MEMFD_PREFIX = "timeshare-chunk"


def _check(addr: int | None, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise ChunkDeviceError(f"{what} failed: {os.strerror(err)}", out_of_memory=err == 12)
    return int(addr)


class MemfdDevice:
    """A chunk device over host memory (memfds): the CPU stand-in for CUDA VMM. ``tag`` goes into
    every memfd's name (``timeshare-chunk-<tag>``), so a test can find its own chunks in
    ``/proc``."""

    def __init__(self, tag: str = "", free_bytes: int | None = None) -> None:
        self.name = "memfd (CPU stand-in)"
        self.granularity = mmap.PAGESIZE
        self.creates = 0
        self.maps = 0
        self.unmaps = 0
        self.memfd_name = f"{MEMFD_PREFIX}-{tag}" if tag else MEMFD_PREFIX
        #: what :meth:`memory` says is free (None: the host's available memory); a test sets 0
        #: to play a card with no room left
        self.free_bytes = free_bytes

    def memory(self) -> tuple[int, int]:
        total = os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE
        if self.free_bytes is not None:
            return self.free_bytes, total
        return os.sysconf("SC_AVPHYS_PAGES") * mmap.PAGESIZE, total

    def create(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.granularity:
            raise ChunkDeviceError(f"{nbytes} bytes is not a multiple of the page size")
        fd = os.memfd_create(self.memfd_name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise ChunkDeviceError(f"memfd of {nbytes} bytes: {exc.strerror}", out_of_memory=True) from exc
        self.creates += 1
        return fd

    def export(self, handle: int) -> int:
        return os.dup(handle)

    def import_fd(self, fd: int) -> int:
        return os.dup(fd)

    def release(self, handle: int) -> None:
        os.close(handle)

    def reserve(self, nbytes: int) -> int:
        return _check(
            _mmap(None, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0),
            f"reserving {nbytes} bytes of address space",
        )

    def free_reserve(self, address: int, nbytes: int) -> None:
        if _munmap(address, nbytes) != 0:
            raise ChunkDeviceError(f"munmap: {os.strerror(ctypes.get_errno())}")

    def map(self, address: int, nbytes: int, handle: int) -> None:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        got = _check(_mmap(address, nbytes, prot, _MAP_SHARED | _MAP_FIXED, handle, 0), "mapping a chunk")
        self.maps += 1
        if got != address:
            raise ChunkDeviceError(f"a chunk was mapped at {got:#x}, not at {address:#x}")

    def set_access(self, address: int, nbytes: int) -> None:
        pass  # mapped read-write already

    def synchronize(self) -> None:
        pass  # the CPU's writes are done when the caller's are

    def unmap(self, address: int, nbytes: int) -> None:
        # the reservation comes back in its place (MAP_FIXED replaces the mapping atomically)
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        _check(_mmap(address, nbytes, _PROT_NONE, flags, -1, 0), "unmapping a chunk")
        self.unmaps += 1
