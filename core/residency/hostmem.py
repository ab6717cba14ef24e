"""Host memory for shadows and KV snapshots: pinned where the device offers a host buffer type
(DMA straight from it), pageable otherwise, and a parallel file reader to fill it."""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from . import _ggml

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

#: mallopt(M_MMAP_THRESHOLD) parameter number in glibc
_M_MMAP_THRESHOLD = -3


def fix_malloc_mmap_threshold(threshold: int = 1 << 20) -> bool:
    """Make glibc serve every allocation >= ``threshold`` with its own mmap, so a freed weight
    buffer goes back to the system at once (glibc's dynamic threshold otherwise keeps freed
    large blocks on the heap and RSS does not drop). Call before loading a model. Returns False
    where mallopt does not exist (not glibc)."""
    try:
        mallopt = _libc.mallopt
    except AttributeError:
        return False
    mallopt.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def trim_heap() -> bool:
    """Give the free memory at the top and in the holes of glibc's heap back to the system
    (``malloc_trim(0)``): a weight buffer served from the heap (glibc's dynamic mmap threshold has
    grown, or :func:`fix_malloc_mmap_threshold` came after the load) leaves RSS unchanged when
    freed until the heap is trimmed. Returns False where malloc_trim does not exist (not glibc)."""
    try:
        malloc_trim = _libc.malloc_trim
    except AttributeError:
        return False
    malloc_trim.restype = ctypes.c_int
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return True


def pinned_buffer_type(device: int | None = None) -> int | None:
    """The host buffer type (pinned memory) of ``device`` (a ggml device handle; the first GPU when
    None), or None (CPU-only build, or a device without one).

    Tests replace this name to stand in a buffer type of their own."""
    if device is None:
        gpu = _ggml.first_gpu()
        if gpu is None:
            return None
        device = gpu.handle
    buft = _ggml.dev_host_buffer_type(device)
    return int(buft) if buft else None


def alloc_pinned(buft: int, size: int) -> int | None:
    """A host buffer (a ggml backend buffer) of ``size`` bytes from the host buffer type ``buft``,
    or None. The buffer may be of another type: ggml-vulkan's and ggml-cuda's host buffer types
    hand back a plain CPU buffer when the pinned allocation fails (HostMemory checks the type).

    Tests replace this name to inject a pinned-allocation failure."""
    return _ggml.buft_alloc_buffer(buft, max(size, 1))


def max_pinned_bytes(buft: int) -> int:
    """The largest buffer ``buft`` hands out (``ggml_backend_buft_get_max_size``): ggml-vulkan's host
    buffer type says its suballocation block (1 GiB by default), CUDA's says SIZE_MAX."""
    return int(_ggml.buft_get_max_size(buft))


def pack_parts(parts: Sequence[int], limit: int) -> list[int]:
    """Consecutive ``parts`` packed greedily into segments of at most ``limit`` bytes (a part larger
    than ``limit`` is a segment of its own): no access that stays inside a part straddles two."""
    out: list[int] = []
    cur = 0
    for p in parts:
        if cur and cur + p > limit:
            out.append(cur)
            cur = 0
        cur += p
    if cur or not out:
        out.append(cur)
    return out


def _vulkan_index(name: str) -> int | None:
    if name.startswith("Vulkan") and name[6:].isdigit():
        return int(name[6:])
    return None


@dataclass
class _Segment:
    offset: int
    size: int
    ptr: int
    buffer: int | None  # the ggml host buffer (pinned), or None: our own anonymous mmap
    map_len: int = 0


class HostMemory:
    """``size`` bytes of host memory, addressed by offset (:meth:`address`, :meth:`view`): pinned
    where the device offers a host buffer type that really gives pinned memory, else anonymous
    pageable memory. ``pinned`` is True only when every byte is in memory of the device's own host
    buffer type (the type of each buffer is checked: ggml's host buffer types fall back to a plain
    CPU buffer when the pinned allocation fails); ``note`` says why not, when it was asked for.

    ``parts`` (sizes that sum to ``size``): boundaries no access straddles. The memory is then
    split over several allocations, at part boundaries, where one would exceed what the host
    buffer type hands out (ggml-vulkan: its max allocation) or ``max_segment``: one segment
    otherwise, so the memory is contiguous (``ptr``). ``device``: the ggml device whose host
    buffer type to use (the model's own GPU; the first GPU when None).

    ``lazy``: the segments are planned but not allocated; :meth:`allocate_next` allocates them
    one at a time (a deferred shadow built in slices, between which its owner can stop), and
    ``complete`` says when all are. An address in a segment not allocated yet is refused."""

    def __init__(
        self,
        size: int,
        want_pinned: bool,
        parts: Sequence[int] | None = None,
        device: _ggml.Device | None = None,
        max_segment: int | None = None,
        lazy: bool = False,
    ) -> None:
        self.size = size
        self.pinned = False
        self.pinned_bytes = 0
        self.note = ""
        self._segs: list[_Segment] = []
        self._plan: list[int] = []  # the size of each segment, allocated or not
        self._buft: int | None = None
        self._refused: list[str] = []
        self._to_pin: list[int] = []  # segments made pageable on purpose (allocate_next(pin=False))
        if parts is None:
            parts = [size]
        if sum(parts) != size:
            raise ValueError(f"parts sum to {sum(parts)}, not {size}")
        self._plan_segments(size, want_pinned, parts, device, max_segment)
        starts = [0]
        for n in self._plan[:-1]:
            starts.append(starts[-1] + n)
        self._starts = starts
        if not lazy:
            try:
                while self.allocate_next() is not None:
                    pass
            except BaseException:
                self.close()
                raise

    def _plan_segments(
        self,
        size: int,
        want_pinned: bool,
        parts: Sequence[int],
        device: _ggml.Device | None,
        max_segment: int | None,
    ) -> None:
        buft = pinned_buffer_type(device.handle if device is not None else None) if want_pinned else None
        if want_pinned and buft is None:
            self.note = "no pinned host memory on this backend (CPU-only build): using pageable memory"
        vk_index = _vulkan_index(device.name) if device is not None else None
        if buft is not None and vk_index not in (None, 0):
            # ggml-vulkan registers its pinned memory with device 0 only: a copy to another device
            # does not find it and goes through that device's staging buffer, so pinning here would
            # cost RAM and gain nothing
            where = device.name if device is not None else "?"
            self.note = (
                f"ggml-vulkan's pinned host memory belongs to Vulkan0, and this model is on {where}: "
                "using pageable memory (restores go through ggml-vulkan's staging buffer)"
            )
            buft = None
        self._buft = buft
        limit = max_pinned_bytes(buft) if buft is not None else size
        if max_segment is not None:
            limit = min(limit, max(1, max_segment))
        self._plan = pack_parts(parts, limit) if size > limit else [size]

    @property
    def complete(self) -> bool:
        """Every planned segment is allocated."""
        return len(self._segs) == len(self._plan)

    @property
    def n_segments(self) -> int:
        """Segments planned (allocated or not)."""
        return len(self._plan)

    @property
    def allocated_end(self) -> int:
        """The offset of the first byte in a segment not allocated yet (``size`` when complete):
        segments are allocated in order, so every byte before it is allocated."""
        i = len(self._segs)
        return self._starts[i] if i < len(self._plan) else self.size

    def allocate_next(self, pin: bool = True) -> tuple[int, int] | None:
        """Allocate the next planned segment; its (offset, size), or None when all were. ``pin``
        False: pageable memory now (a fresh mapping costs far less than pinning it), pinned
        later by :meth:`pin_next` (``to_pin`` counts those segments)."""
        i = len(self._segs)
        if i >= len(self._plan):
            return None
        offset, n = self._starts[i], self._plan[i]
        buft = self._buft
        seg = self._pinned(buft, offset, n) if buft is not None and pin else None
        if seg is None:
            seg = self._mmap(offset, n)
            if buft is not None and pin:
                self._refused.append(f"{n / 1e9:.2f} GB")
            elif buft is not None:
                self._to_pin.append(i)
        self._segs.append(seg)
        if self.complete and buft is not None:
            self._finish()
        return offset, n

    @property
    def to_pin(self) -> int:
        """Segments made pageable by ``allocate_next(pin=False)`` and not pinned yet."""
        return len(self._to_pin)

    def pin_next(self) -> bool:
        """Move the first segment made pageable on purpose into pinned memory (same offset and
        bytes; the pageable mapping is freed). False when none is left. A refused pinned
        allocation leaves that segment pageable for good (``note`` says so)."""
        if not self._to_pin or self._buft is None:
            return False
        i = self._to_pin.pop(0)
        old = self._segs[i]
        seg = self._pinned(self._buft, old.offset, old.size)
        if seg is None:
            self._refused.append(f"{old.size / 1e9:.2f} GB")
        else:
            ctypes.memmove(seg.ptr, old.ptr, old.size)
            self._segs[i] = seg
            if old.map_len:
                _libc.munmap(old.ptr, old.map_len)
        if self.complete:
            self._finish()
        return True

    def _finish(self) -> None:
        self.pinned_bytes = sum(s.size for s in self._segs if s.buffer is not None)
        refused = self._refused
        self.pinned = not refused and not self._to_pin
        if refused:
            what = (
                f"{len(refused)} of {len(self._plan)} parts ({', '.join(refused)})"
                if len(self._plan) > 1
                else (f"{self.size / 1e9:.2f} GB")
            )
            note = (
                f"pinned host memory of {what} could not be allocated: using pageable memory there "
                "(restores will be slower; free RAM or lower the number of resident models)"
            )
            if note != self.note:
                self.note = note
                log.warning(note)

    def _pinned(self, buft: int, offset: int, n: int) -> _Segment | None:
        buf = alloc_pinned(buft, n)
        if not buf:
            return None
        if int(_ggml.buffer_get_type(buf) or 0) != buft:
            # the host buffer type fell back to a plain CPU buffer: not pinned, so not ours to keep
            log.info(
                "the host buffer type handed back a %s buffer for %d bytes (pinned allocation refused)",
                _ggml.buffer_type_name(int(_ggml.buffer_get_type(buf) or 0)),
                n,
            )
            _ggml.buffer_free(buf)
            return None
        return _Segment(offset, n, int(_ggml.buffer_get_base(buf)), buf)

    @staticmethod
    def _mmap(offset: int, size: int) -> _Segment:
        length = max(size, 1)
        addr = _libc.mmap(
            None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
        )
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise MemoryError(f"cannot allocate {size / 1e9:.2f} GB of host memory: {os.strerror(err)}")
        return _Segment(offset, size, int(addr), None, length)

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        """(offset, size, address) of each allocation, in order."""
        return [(s.offset, s.size, s.ptr) for s in self._segs]

    @property
    def ptr(self) -> int:
        """The address of byte 0 of contiguous memory (one segment)."""
        if len(self._plan) != 1 or not self._segs:
            raise ValueError(f"this host memory is {len(self._plan)} separate allocations: use address()")
        return self._segs[0].ptr

    def address(self, offset: int, length: int = 1) -> int:
        """The address of byte ``offset``; ``length`` bytes from there must lie in one allocation."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset < 0:
            raise ValueError("host memory address out of range")
        if i >= len(self._segs):
            raise ValueError(f"host memory at {offset} is in a segment not allocated yet")
        seg = self._segs[i]
        if offset + length > seg.offset + max(seg.size, 1) or offset + length > max(self.size, 1):
            raise ValueError(
                f"host memory range {offset}+{length} is out of range or straddles two allocations"
            )
        return seg.ptr + (offset - seg.offset)

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or offset + length > self.size:
            raise ValueError("host memory view out of range")
        addr = self.address(offset, length)
        return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")

    def close(self) -> None:
        for seg in self._segs:
            if seg.buffer:
                _ggml.buffer_free(seg.buffer)
                seg.buffer = None
            if seg.map_len:
                _libc.munmap(seg.ptr, seg.map_len)
                seg.map_len = 0
            seg.ptr = 0
        self._segs = []
        self._plan = []
        self._starts = []

    def __del__(self) -> None:
        if sys.is_finalizing():
            # the backend may be torn down already (cudaFreeHost then aborts); the OS frees it
            return
        self.close()


@dataclass(frozen=True)
class ReadRange:
    file_offset: int
    mem_offset: int
    length: int


def parallel_read(path: str, mem: HostMemory, ranges: Sequence[ReadRange]) -> int:
    """Read ``ranges`` of ``path`` into ``mem`` with several threads (preadv releases the GIL).
    Returns the bytes read; raises ModelFileError-worthy OSError/EOFError on a short file."""
    chunk = 64 << 20
    pieces: list[ReadRange] = []
    for r in ranges:
        done = 0
        while done < r.length:
            n = min(chunk, r.length - done)
            pieces.append(ReadRange(r.file_offset + done, r.mem_offset + done, n))
            done += n
    n_threads = max(1, min(8, (os.cpu_count() or 2), len(pieces)))
    errors: list[BaseException] = []
    lock = threading.Lock()
    cursor = [0]
    fd = os.open(path, os.O_RDONLY)

    def work() -> None:
        while True:
            with lock:
                if errors or cursor[0] >= len(pieces):
                    return
                piece = pieces[cursor[0]]
                cursor[0] += 1
            try:
                done = 0
                while done < piece.length:
                    view = mem.view(piece.mem_offset + done, piece.length - done)
                    n = os.preadv(fd, [view], piece.file_offset + done)
                    if n <= 0:
                        raise EOFError(
                            f"{path} ends at byte {piece.file_offset + done}: the file is truncated"
                        )
                    done += n
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                return

    try:
        workers = [threading.Thread(target=work, name=f"shadow-read-{i}") for i in range(n_threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return sum(p.length for p in pieces)
