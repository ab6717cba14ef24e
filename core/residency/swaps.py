"""The in-place path's buffer swaps: a weight buffer's memory leaves and comes back by swapping
the ``context`` and ``size`` of its ggml buffer struct with those of another buffer of the same
type (steps 4 and 5 of residency/inplace.py).

Release: swap with a tiny placeholder and free the placeholder (which now owns the weights'
memory). Restore: swap with a fresh allocation, relocate every tensor's ``data`` (and, for a layer
part's buffer, its ``buffer``) and ``init_tensor`` it; the placeholder that comes out is freed at
the next release (on CUDA cudaFree waits for the whole device: the uploads in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from ..errors import OutOfDeviceMemoryError, ResidencyError
from . import _ggml
from .plan import WeightBuffer

if TYPE_CHECKING:
    from .handover import WeightHandover

#: bytes of the tiny buffer a released buffer's struct holds
PLACEHOLDER_BYTES = 64


def free_memory(ptr: int, buft: int, layout: _ggml.BufferLayout) -> bool:
    """Free the memory of the live buffer ``ptr`` (of type ``buft``): its struct stays, holding a
    tiny placeholder's memory instead. False: no placeholder could be made (nothing changed)."""
    placeholder = _ggml.buft_alloc_buffer(buft, PLACEHOLDER_BYTES)
    if placeholder is None:
        return False
    _ggml.swap_buffer_memory(ptr, placeholder, layout)
    _ggml.buffer_free(placeholder)  # frees the buffer's memory
    return True


class LiveBuffer(Protocol):
    """A ggml buffer whose memory goes and comes back under its struct (the KV cache's and the
    compute buffers: residency/kvbuffer.py, residency/computebuf.py)."""

    ptr: int
    buft: int
    size: int
    base: int
    layout: _ggml.BufferLayout
    released: bool


_B = TypeVar("_B", bound=LiveBuffer)


def release_again(buffers: Iterable[LiveBuffer]) -> None:
    """A restore failed: the ``buffers`` it gave memory to are released again (each one for which
    a placeholder can be made)."""
    for d in buffers:
        if free_memory(d.ptr, d.buft, d.layout):
            d.released = True


def renew_released(buffers: Sequence[_B], what: str, then: Callable[[_B], None]) -> tuple[list[_B], bool]:
    """Give each released buffer of ``buffers`` fresh memory in turn, note its new base and call
    ``then`` on it (before the next one is allocated); returns those renewed and whether any came
    back at another address. OutOfDeviceMemoryError (naming ``what``): those renewed are released
    again, the buffers stay released."""
    done: list[_B] = []
    moved = False
    for b in buffers:
        if not b.released:
            continue
        if not renew_memory(b.ptr, b.buft, b.size, b.layout):
            release_again(done)
            raise OutOfDeviceMemoryError(
                f"cannot allocate the {b.size}-byte {what} again: free device memory and try again"
            )
        base = int(_ggml.buffer_get_base(b.ptr) or 0)
        moved = moved or base != b.base
        b.base = base
        then(b)
        b.released = False
        done.append(b)
    return done, moved


@dataclass
class LiveBuffers(Generic[_B]):
    """Live buffers whose memory goes and comes back together (the KV cache's, a context's
    compute buffers), and what their last renewal did. Its owner's thread is its only caller."""

    items: list[_B] = field(default_factory=list)
    moved: bool = False  # the last renewal put a buffer at another address

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.items)

    @property
    def released(self) -> bool:
        return any(b.released for b in self.items)

    def release(self) -> bool:
        """Free the memory of each live buffer in turn (:func:`free_memory`). False at the first
        for which no placeholder can be made (those before it stay released)."""
        for b in self.items:
            if b.released:
                continue
            if not free_memory(b.ptr, b.buft, b.layout):
                return False
            b.released = True
        return True

    def renew(self, what: str, then: Callable[[_B], None]) -> list[_B]:
        """:func:`renew_released` of the items, :attr:`moved` noted (False first: also when it
        raises)."""
        self.moved = False
        done, self.moved = renew_released(self.items, what, then)
        return done


def renew_memory(ptr: int, buft: int, size: int, layout: _ggml.BufferLayout) -> bool:
    """Give the released buffer ``ptr`` fresh memory of ``size`` bytes (the tiny placeholder's
    freed). False: no room (nothing changed)."""
    new = _ggml.buft_alloc_buffer(buft, size)
    if new is None:
        return False
    _ggml.swap_buffer_memory(ptr, new, layout)
    _ggml.buffer_free(new)  # now the tiny placeholder
    return True


class Swaps:
    """Owns what the swaps leave behind (the placeholders of the last restore, whether a buffer
    came back at another address) and the threads that allocate and free buffers in parallel.
    Not thread-safe: the in-place path's caller is its only caller."""

    def __init__(
        self,
        layout: _ggml.TensorLayout,
        buffers: list[WeightBuffer],
        parallel: bool | None,
        handover: WeightHandover,
    ) -> None:
        """``parallel``: allocate and free ``buffers`` on several threads (None: Vulkan buffers
        only, see :attr:`parallel`)."""
        self._layout = layout
        self._buffers = buffers
        self._parallel_opt = parallel
        self._handover = handover
        self._executor: ThreadPoolExecutor | None = None
        self._spent: list[int] = []
        self.moved = False  # the last restore put a buffer at another address than before

    @property
    def parallel(self) -> bool:
        """Allocate and free the weight buffers on several threads: Vulkan, where each
        vkAllocateMemory / vkFreeMemory costs time in proportion to its size (about 20 ms per GiB
        on the H200's driver), so the uploads overlap the allocations that follow them (restore
        191 -> 177 ms there, release 100 -> 90 ms: docs/lab/HISTORY.md); never on CUDA (unchanged)."""
        if self._parallel_opt is not None:
            return self._parallel_opt and len(self._buffers) > 1
        return len(self._buffers) > 1 and all(b.buft_name.startswith("Vulkan") for b in self._buffers)

    def pool(self) -> ThreadPoolExecutor:
        """The threads that allocate and free buffers in parallel."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=min(8, len(self._buffers)), thread_name_prefix="residency-buffers"
            )
        return self._executor

    def detach(self, b: WeightBuffer) -> int:
        """Swap ``b`` with a tiny placeholder; returns the placeholder, which now owns the weights'
        memory (freeing it frees them)."""
        assert b.layout is not None
        placeholder = _ggml.buft_alloc_buffer(b.buft, PLACEHOLDER_BYTES)
        if placeholder is None:
            raise ResidencyError(
                f"cannot allocate a {PLACEHOLDER_BYTES}-byte {b.buft_name} placeholder buffer: "
                "the model was not released"
            )
        _ggml.swap_buffer_memory(b.ptr, placeholder, b.layout)
        b.released = True
        self._handover.uncarry(b, placeholder)  # a carrier's context: its own pointer back
        return placeholder

    def free(self, b: WeightBuffer) -> None:
        """Release ``b``: detach it and free the weights' memory."""
        _ggml.buffer_free(self.detach(b))

    def relocate(self, b: WeightBuffer, new: int) -> int:
        """Put the fresh allocation ``new`` under ``b`` and relocate its tensors (no upload);
        returns the placeholder that now holds the tiny memory, for the caller to free."""
        assert b.layout is not None
        lay_t = self._layout
        _ggml.swap_buffer_memory(b.ptr, new, b.layout)
        base = int(_ggml.buffer_get_base(b.ptr) or 0)
        if base != b.base:  # never on Vulkan: its bases are the constant vk_ptr_base
            self.moved = True
        b.base = base
        for t in b.tensors:
            if b.owned:  # a layer part: the tensor moved in from the model's buffer at split()
                _ggml.write_ptr(t.ptr + lay_t.buffer, b.ptr)
            _ggml.write_ptr(t.ptr + lay_t.data, base + t.offset)
            _ggml.buffer_init_tensor(b.ptr, t.ptr)
        if b.mirror:
            _ggml.write_ptr(b.whole + lay_t.buffer, b.ptr)
            _ggml.write_ptr(b.whole + lay_t.data, base)
        b.released = False
        return new

    def keep_spent(self, placeholder: int) -> None:
        """Free ``placeholder`` at the next release (:meth:`free_spent`), not now: on CUDA
        cudaFree waits for the whole device (the uploads in flight), time a restore need not
        take."""
        self._spent.append(placeholder)

    def free_spent(self) -> None:
        for ph in self._spent:
            _ggml.buffer_free(ph)
        self._spent = []

    def make_part_buffers(self, buffers: list[WeightBuffer]) -> None:
        """The structs of the layer parts' ``buffers``: each a placeholder of its type, used for
        weights (the scheduler's rules). ResidencyError when one cannot be made (those made are
        freed again: nothing changed)."""
        made: list[WeightBuffer] = []

        def unmake() -> None:
            for m in made:
                _ggml.buffer_free(m.ptr)
                m.ptr = 0

        for b in buffers:
            ph = _ggml.buft_alloc_buffer(b.buft, PLACEHOLDER_BYTES)
            if ph is None:
                unmake()
                raise ResidencyError(
                    f"cannot allocate a {PLACEHOLDER_BYTES}-byte {b.buft_name} buffer for a layer part: "
                    "the model keeps its own buffers"
                )
            b.ptr = ph
            made.append(b)
            _ggml.buffer_set_usage(ph, _ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)  # the scheduler's rules
            assert b.layout is not None
            if _ggml.read_size(ph + b.layout.size) != PLACEHOLDER_BYTES:
                unmake()
                raise ResidencyError(
                    f"a fresh {b.buft_name} buffer's size field is not where the probe found it: "
                    "the model keeps its own buffers"
                )

    def close(self) -> None:
        """End the threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
