"""Host memory for shadows and KV snapshots: pinned where the device offers a host buffer type
(DMA straight from it), pageable otherwise, and a parallel file reader to fill it."""

from __future__ import annotations

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


def pinned_buffer_type() -> int | None:
    """The host buffer type of the first GPU (pinned memory), or None (CPU-only build)."""
    gpu = _ggml.first_gpu()
    if gpu is None:
        return None
    buft = _ggml.dev_host_buffer_type(gpu.handle)
    return int(buft) if buft else None


def alloc_pinned(size: int) -> int | None:
    """A pinned host buffer (a ggml backend buffer) of ``size`` bytes, or None.

    Tests replace this name to inject a pinned-allocation failure."""
    buft = pinned_buffer_type()
    if buft is None:
        return None
    return _ggml.buft_alloc_buffer(buft, max(size, 1))


class HostMemory:
    """``size`` bytes at ``ptr``: pinned when possible (``pinned``), else anonymous pageable memory;
    ``note`` says why it is not pinned when it was asked to be."""

    def __init__(self, size: int, want_pinned: bool) -> None:
        self.size = size
        self.pinned = False
        self.note = ""
        self._buffer: int | None = None
        self._map_len = 0
        self.ptr = 0
        if want_pinned:
            if pinned_buffer_type() is None:
                self.note = "no pinned host memory on this backend (CPU-only build): using pageable memory"
            else:
                buf = alloc_pinned(size)
                if buf:
                    self._buffer = buf
                    self.ptr = int(_ggml.buffer_get_base(buf))
                    self.pinned = True
                else:
                    self.note = (
                        f"pinned host memory of {size / 1e9:.2f} GB could not be allocated: using pageable "
                        "memory (restores will be slower; free RAM or lower the number of resident models)"
                    )
                    log.warning(self.note)
        if not self.pinned:
            length = max(size, 1)
            addr = _libc.mmap(
                None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
            )
            if addr is None or addr == _MAP_FAILED:
                err = ctypes.get_errno()
                raise MemoryError(f"cannot allocate {size / 1e9:.2f} GB of host memory: {os.strerror(err)}")
            self._map_len = length
            self.ptr = int(addr)

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or offset + length > self.size:
            raise ValueError("host memory view out of range")
        return memoryview((ctypes.c_char * length).from_address(self.ptr + offset)).cast("B")

    def close(self) -> None:
        if self._buffer:
            _ggml.buffer_free(self._buffer)
            self._buffer = None
        if self._map_len:
            _libc.munmap(self.ptr, self._map_len)
            self._map_len = 0
        self.ptr = 0

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
