"""The compute buffers of a llama context (ggml's scheduler), released and restored in place at the
deep level (issue 39, item 1): the context, its scheduler and the scheduler's reserved allocation
plan all stay; only the memory under the plan goes and comes back, at the same size.

Where they are: ``llama_context::get_sched()`` (an exported C++ accessor) gives the scheduler;
its graph allocator (``ggml_gallocr``, internal to ggml-backend.cpp / ggml-alloc.c) holds one
"vbuffer" per backend, up to 16 chunks of ordinary backend buffers. The offsets of the two
internal structs are those of the pinned build, and :class:`ComputeBufferFinder` checks them at
attach against the public scheduler API (its backends, their buffer types, each buffer's size as
``ggml_backend_sched_get_buffer_size`` sums it); any mismatch keeps the buffers where they are
(the reason says why).

Release: each buffer's memory is swapped with a tiny placeholder's and the placeholder freed, as
for the weights and the KV cache. Restore: a buffer of the same size and type is allocated and
swapped back. Nothing in it needs keeping (a decode writes every intermediate before reading it),
and no graph is reserved again: the allocator's plan (node offsets, sizes) is untouched. The next
decode must only build its graph anew, since the previous one's tensors hold addresses in the old
memory (``llm_graph_result::reset`` of ``llama_context::get_gf_res_prev()``: the next decode then
fails to reuse it and builds and allocates a fresh one, as it does whenever the batch's shape
changes).

A reserve of the scheduler (``llama_context::sched_reserve``: a new scheduler, new buffers) makes
any :class:`ComputeBuffers` found before it stale: they are found again at each release, never
kept across a restore."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from ..errors import ResidencyError
from . import _ggml
from .swaps import PLACEHOLDER_BYTES, LiveBuffers

#: struct ggml_backend_sched (ggml-backend.cpp): bool is_reset, is_alloc; int n_backends;
#: ggml_backend_t backends[GGML_SCHED_MAX_BACKENDS]; ggml_backend_buffer_type_t bufts[...];
#: ggml_gallocr_t galloc; ...
_SCHED_MAX_BACKENDS = 16
_SCHED_N_BACKENDS = 4
_SCHED_BACKENDS = 8
_SCHED_BUFTS = _SCHED_BACKENDS + 8 * _SCHED_MAX_BACKENDS
_SCHED_GALLOC = _SCHED_BUFTS + 8 * _SCHED_MAX_BACKENDS
#: struct ggml_gallocr (ggml-alloc.c): bufts *, vbuffer **buffers, buf_tallocs **, int n_buffers
_GALLOC_BUFTS = 0
_GALLOC_BUFFERS = 8
_GALLOC_N_BUFFERS = 24
#: struct vbuffer: ggml_backend_buffer_t chunks[GGML_VBUFFER_MAX_CHUNKS]
_VBUFFER_MAX_CHUNKS = 16


class ComputeBufferUnsupportedError(Exception):
    """The compute buffers cannot be released in place here (the reason says why)."""


def _int_at(addr: int) -> int:
    return int(ctypes.c_int.from_address(addr).value)


@dataclass
class ComputeBuffer:
    ptr: int  # the ggml_backend_buffer struct (stays; its memory goes and comes back)
    buft: int
    size: int
    base: int
    layout: _ggml.BufferLayout
    released: bool = False


@dataclass
class ComputeBuffers:
    """The compute buffers of one context's scheduler as found now (see the module's docstring:
    valid until the scheduler's next reserve). The loop thread's Residency is its only caller."""

    ctx: int
    #: their memory (``live.moved``: the last restore put a buffer at another address)
    live: LiveBuffers[ComputeBuffer] = field(default_factory=LiveBuffers)

    def release(self) -> None:
        """Free the buffers' memory; no decode may run until :meth:`restore`. ResidencyError
        (a placeholder could not be made): the buffers released so far come back first."""
        if not self.live.release():
            self.restore()
            raise ResidencyError(
                "cannot allocate a placeholder for a compute buffer: the compute buffers were not released"
            )

    def restore(self) -> None:
        """Allocate each released buffer again (same size and type) and make the next decode
        build its graph anew. OutOfDeviceMemoryError: what this call allocated is freed again,
        the buffers stay released."""
        if self.live.renew("compute buffer", lambda _b: None):
            forget_graph(self.ctx)


def scheduler_bytes(ctx: int) -> tuple[int, int]:
    """The bytes of context ``ctx``'s compute buffers as its scheduler reports them
    (``ggml_backend_sched_get_buffer_size``): (in device memory, in host memory), by each buffer
    type's ``ggml_backend_buft_is_host`` (a GPU build's CPU and pinned staging buffers are host
    memory; on a CPU build all of them are). (0, 0) where the build's scheduler cannot be reached."""
    sched = int(_ggml.ctx_get_sched(ctx) or 0) if _ggml.ctx_get_sched is not None else 0
    device = host = 0
    for i in range(int(_ggml.sched_get_n_backends(sched)) if sched else 0):
        backend = _ggml.sched_get_backend(sched, i)
        size = int(_ggml.sched_get_buffer_size(sched, backend))
        if _ggml.buft_is_host(int(_ggml.sched_get_buffer_type(sched, backend) or 0)):
            host += size
        else:
            device += size
    return device, host


def forget_graph(ctx: int) -> None:
    """Make the next decode of ``ctx`` build (and allocate) its graph anew instead of reusing the
    previous one: no scheduler reserve, one graph build."""
    get_prev, reset = _ggml.ctx_get_gf_res_prev, _ggml.graph_result_reset
    if get_prev is None or reset is None:  # checked by ComputeBufferFinder.probe
        raise ResidencyError("this llama.cpp build cannot reset the context's previous graph")
    prev = get_prev(ctx)
    if prev:
        reset(prev)


@dataclass
class ComputeBufferFinder:
    """Finds a context's compute buffers; made by :meth:`probe`, which checks the internal
    layouts once (at attach). ``include_host``: host-memory buffers count too (the CPU build,
    where host memory is the device); on a GPU build only device buffers are released."""

    include_host: bool
    layouts: dict[int, _ggml.BufferLayout] = field(default_factory=dict)

    @classmethod
    def probe(cls, ctx: int, include_host: bool) -> ComputeBufferFinder:
        """ComputeBufferUnsupportedError (or _ggml.LayoutMismatchError) when this build's
        scheduler cannot be read for sure."""
        if _ggml.ctx_get_sched is None:
            raise ComputeBufferUnsupportedError("libllama does not export llama_context::get_sched")
        if _ggml.ctx_get_gf_res_prev is None or _ggml.graph_result_reset is None:
            raise ComputeBufferUnsupportedError(
                "libllama does not export llama_context::get_gf_res_prev and llm_graph_result::reset"
            )
        finder = cls(include_host)
        found = finder.find(ctx)
        if not found.live.items:
            raise ComputeBufferUnsupportedError("the context's scheduler has no compute buffer to release")
        return finder

    def find(self, ctx: int) -> ComputeBuffers:
        """The compute buffers of ``ctx``'s scheduler now (the internal layouts checked against
        the public API each time)."""
        assert _ggml.ctx_get_sched is not None
        sched = int(_ggml.ctx_get_sched(ctx) or 0)
        if not sched:
            raise ComputeBufferUnsupportedError("the context has no scheduler")
        n = int(_ggml.sched_get_n_backends(sched))
        if not 0 < n <= _SCHED_MAX_BACKENDS or _int_at(sched + _SCHED_N_BACKENDS) != n:
            raise ComputeBufferUnsupportedError(
                "ggml_backend_sched's layout is not the pinned build's (n_backends)"
            )
        backends = [int(_ggml.sched_get_backend(sched, i) or 0) for i in range(n)]
        bufts = [int(_ggml.sched_get_buffer_type(sched, b) or 0) for b in backends]
        for i in range(n):
            if (
                _ggml.read_ptr(sched + _SCHED_BACKENDS + 8 * i) != backends[i]
                or _ggml.read_ptr(sched + _SCHED_BUFTS + 8 * i) != bufts[i]
            ):
                raise ComputeBufferUnsupportedError(
                    "ggml_backend_sched's layout is not the pinned build's (backends, buffer types)"
                )
        galloc = _ggml.read_ptr(sched + _SCHED_GALLOC)
        if not galloc or _int_at(galloc + _GALLOC_N_BUFFERS) != n:
            raise ComputeBufferUnsupportedError("ggml_gallocr's layout is not the pinned build's (n_buffers)")
        galloc_bufts = _ggml.read_ptr(galloc + _GALLOC_BUFTS)
        vbuffers = _ggml.read_ptr(galloc + _GALLOC_BUFFERS)
        if not galloc_bufts or not vbuffers:
            raise ComputeBufferUnsupportedError("ggml_gallocr has no buffer arrays")
        out = ComputeBuffers(ctx)
        seen: set[int] = set()
        for i in range(n):
            if _ggml.read_ptr(galloc_bufts + 8 * i) != bufts[i]:
                raise ComputeBufferUnsupportedError(
                    "ggml_gallocr's layout is not the pinned build's (buffer types)"
                )
            vb = _ggml.read_ptr(vbuffers + 8 * i)
            reported = int(_ggml.sched_get_buffer_size(sched, backends[i]))
            if not vb or vb in seen:  # none yet, or shared with an earlier backend (counted there)
                if reported != 0 and not vb:
                    raise ComputeBufferUnsupportedError(
                        "a compute buffer the scheduler reports was not found"
                    )
                continue
            seen.add(vb)
            chunks = []
            for c in range(_VBUFFER_MAX_CHUNKS):
                chunk = _ggml.read_ptr(vb + 8 * c)
                if not chunk:
                    break
                chunks.append(chunk)
            if sum(int(_ggml.buffer_get_size(c)) for c in chunks) != reported or any(
                int(_ggml.buffer_get_type(c) or 0) != bufts[i] for c in chunks
            ):
                raise ComputeBufferUnsupportedError(
                    "the compute buffers found do not add up to what the scheduler reports"
                )
            if not self.include_host and bool(_ggml.buft_is_host(bufts[i])):
                continue
            for chunk in chunks:
                layout = self.layouts.get(bufts[i])
                if layout is None:
                    layout = _ggml.probe_buffer_layout(bufts[i], reference=chunk)
                    self.layouts[bufts[i]] = layout
                size = int(_ggml.buffer_get_size(chunk))
                if size > PLACEHOLDER_BYTES:
                    out.live.items.append(
                        ComputeBuffer(chunk, bufts[i], size, int(_ggml.buffer_get_base(chunk) or 0), layout)
                    )
        return out
