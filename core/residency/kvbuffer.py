"""The KV cache's ggml buffers, released and restored in place like the weights' (issue 39, item 2):
the llama context object stays; only the memory under its KV cache goes and comes back.

Finding them: the KV tensor of each layer is the ``view_src`` of the view that the exported
``llama_kv_cache::get_k`` / ``get_v`` make of it (C++ methods of the pinned build, called through
ctypes with a zeroed ``slot_info``: stream 0), which names its buffer. Only a plain unified KV cache
(``llama_get_memory`` is a ``llama_kv_cache``: no sliding window, not recurrent or hybrid) is
handled; anything else keeps the other way (the context freed and made again).

Release: the sequences' cells in use are saved first (``llama_state_seq_get_data``, the portable
way: only the used positions, not ``n_ctx``), the cells emptied (``llama_memory_clear`` of the
metadata), then each buffer is swapped with a tiny placeholder and the placeholder freed (as the
weights' buffers are). Restore: allocate, swap back, point the tensors at the new memory, clear it
(masked cells must hold numbers: a NaN times a zero attention weight is a NaN), then the saved
cells go back through ``llama_state_seq_set_data``. The context's graphs are built anew when a
buffer came back at another address (they hold the cache's views' data pointers)."""

from __future__ import annotations

import ctypes
import itertools
from ctypes import c_int32, c_uint32, c_void_p
from dataclasses import dataclass, field
from typing import Any

import llama_cpp

from ..errors import ResidencyError
from . import _ggml
from .swaps import LiveBuffers

_GET_K = "_ZNK14llama_kv_cache5get_kEP12ggml_contextijRKNS_9slot_infoE"
_GET_V = "_ZNK14llama_kv_cache5get_vEP12ggml_contextijRKNS_9slot_infoE"
_SLOT_INFO_BYTES = 64  # uint32 s0, s1; two std::vector (24 bytes each) on LP64; zeroed: stream 0
#: struct ggml_object (ggml.c): size_t offs, size; ggml_object * next; enum type; char padding[4]
_OBJECT_BYTES = 32
_OBJECT_NEXT = 16
_OBJECT_TYPE = 24
_OBJECT_TENSOR = 0
_MAX_OBJECTS = 1 << 16


def _later_tensors(first: int) -> list[int]:
    """The tensors made after ``first`` in its ggml context (each ggml object is followed by its
    tensor, and names the next object): the KV cache's own views of its tensors (per stream)
    live there and hold data pointers into its buffer."""
    out: list[int] = []
    obj = _ggml.read_ptr(first - _OBJECT_BYTES + _OBJECT_NEXT)
    for _ in range(_MAX_OBJECTS):
        if not obj:
            return out
        if ctypes.c_int.from_address(obj + _OBJECT_TYPE).value == _OBJECT_TENSOR:
            out.append(obj + _OBJECT_BYTES)
        obj = _ggml.read_ptr(obj + _OBJECT_NEXT)
    raise KvBufferUnsupportedError("the KV cache's ggml context has too many objects")


class KvBufferUnsupportedError(Exception):
    """The in-place KV path cannot be used for this context (the reason says why)."""


@dataclass
class KvBuffer:
    ptr: int
    buft: int
    size: int
    base: int
    layout: _ggml.BufferLayout
    tensors: list[tuple[int, int]] = field(default_factory=list)  # (tensor, offset from base)
    views: list[tuple[int, int]] = field(default_factory=list)  # (view, its root tensor)
    released: bool = False


def _method(name: str) -> Any:
    fn = _ggml.bind_optional(name, c_void_p, c_void_p, c_void_p, c_int32, c_uint32, c_void_p)
    if fn is None:
        raise KvBufferUnsupportedError(f"this llama.cpp build does not export {name}")
    return fn


@dataclass(frozen=True)
class KvLayer:
    """One layer's K and V tensors (the cache's own, not views), as the layer-wise restore
    (residency/kvupload.py) writes them."""

    index: int
    k: int
    v: int


class KvBuffers:
    """The KV cache buffers of one context. The loop thread's Residency is its only caller."""

    def __init__(
        self,
        buffers: list[KvBuffer],
        layers: list[KvLayer] | None = None,
        memory: int = 0,
        v_trans: bool = False,
    ) -> None:
        #: their memory (``live.moved``: the last restore put a buffer at another address)
        self.live = LiveBuffers(buffers)
        self.layers = layers or []  # in layer order
        self.memory = memory  # the context's llama_kv_cache (its cells' metadata: kvupload.py)
        self.v_trans = v_trans  # V is stored transposed (no flash attention)

    @classmethod
    def find(cls, model: int, ctx: int) -> KvBuffers:
        """The buffers of ``ctx``'s KV cache; KvBufferUnsupportedError when they cannot be told
        for sure."""
        if int(llama_cpp.llama_model_n_swa(model)) > 0:
            raise KvBufferUnsupportedError("a sliding-window KV cache (two caches) is not handled in place")
        if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
            raise KvBufferUnsupportedError("a recurrent or hybrid model's memory is not handled in place")
        mem = llama_cpp.llama_get_memory(ctx)
        if not mem:
            raise KvBufferUnsupportedError("the context has no KV cache")
        get_k, get_v = _method(_GET_K), _method(_GET_V)
        n_layer = int(llama_cpp.llama_model_n_layer(model))
        lay = _ggml.TensorLayout()
        gctx = _ggml.ggml_init(_ggml.GgmlInitParams(1024 * (2 * n_layer + 4), None, True))
        if not gctx:
            raise KvBufferUnsupportedError("ggml_init failed")
        sinfo = (ctypes.c_uint8 * _SLOT_INFO_BYTES)()
        roots: list[int] = []
        v_trans = False
        try:
            for il in range(n_layer):
                for fn in (get_k, get_v):
                    view = int(fn(mem, gctx, il, 1, ctypes.addressof(sinfo)) or 0)
                    if not view:
                        raise KvBufferUnsupportedError(f"no KV tensor for layer {il}")
                    roots.append(_ggml.view_root(view, lay))
                    if fn is get_v:  # its view of one cell: a transposed V's first dimension is the cells
                        v_trans = ctypes.c_int64.from_address(view + lay.ne).value == 1
        finally:
            _ggml.ggml_free(gctx)
        layers = [KvLayer(il, roots[2 * il], roots[2 * il + 1]) for il in range(n_layer)]
        by_buffer: dict[int, KvBuffer] = {}
        for t in dict.fromkeys(roots):
            buf = _ggml.read_ptr(t + lay.buffer)
            if not buf:
                raise KvBufferUnsupportedError("a KV tensor has no buffer")
            kb = by_buffer.get(buf)
            if kb is None:
                buft = int(_ggml.buffer_get_type(buf) or 0)
                kb = KvBuffer(
                    ptr=buf,
                    buft=buft,
                    size=int(_ggml.buffer_get_size(buf)),
                    base=int(_ggml.buffer_get_base(buf) or 0),
                    layout=_ggml.probe_buffer_layout(buft, reference=buf),
                )
                by_buffer[buf] = kb
            kb.tensors.append((t, _ggml.read_ptr(t + lay.data) - kb.base))
        # the views of the KV tensors that the cache made (and keeps) itself: relocated with them
        root_set = set(roots)
        owner = {t: kb for kb in by_buffer.values() for t, _off in kb.tensors}
        for t in _later_tensors(min(roots)):
            if t in root_set:
                continue
            root = _ggml.view_root(t, lay)
            if root in root_set:
                owner[root].views.append((t, root))
            elif _ggml.read_ptr(t + lay.buffer) in by_buffer:
                raise KvBufferUnsupportedError(
                    "a tensor in the KV buffer is neither a KV tensor nor a view of one"
                )
        for kb in by_buffer.values():  # every byte of the buffer belongs to a tensor found
            spans = sorted((off, off + int(_ggml.buft_get_alloc_size(kb.buft, t))) for t, off in kb.tensors)
            if (
                spans[0][0] < 0
                or spans[-1][1] > kb.size
                or any(a[1] > b[0] for a, b in itertools.pairwise(spans))
            ):
                raise KvBufferUnsupportedError("the KV tensors do not lie apart inside their buffer")
            if sum(e - s for s, e in spans) < kb.size * 0.99:
                covered = sum(e - s for s, e in spans)
                raise KvBufferUnsupportedError(
                    f"the KV tensors found cover {covered} of the {kb.size} bytes of their buffer"
                )
        if not by_buffer:
            raise KvBufferUnsupportedError("no KV buffer found")
        return cls(list(by_buffer.values()), layers, int(mem), v_trans)

    def release(self) -> None:
        """Free the buffers' memory (the tensors' data dangle until :meth:`restore`); the caller
        saved the cells in use and emptied the cache first."""
        if not self.live.release():
            raise ResidencyError(
                "cannot allocate a placeholder for the KV buffer: the KV cache was not released"
            )

    def restore(self) -> None:
        """Allocate the buffers again, point the tensors into them and clear them (zeros).
        OutOfDeviceMemoryError: what this call allocated is freed again, the cache stays released."""

        def relocate(b: KvBuffer) -> None:  # the tensors and their views into the new memory, cleared
            lay = _ggml.TensorLayout()
            for t, off in b.tensors:
                _ggml.write_ptr(t + lay.data, b.base + off)
                _ggml.buffer_init_tensor(b.ptr, t)
            for v, root in b.views:
                _ggml.write_ptr(
                    v + lay.data, _ggml.read_ptr(root + lay.data) + _ggml.read_size(v + lay.view_offs)
                )
            _ggml.buffer_clear(b.ptr, 0)

        self.live.renew("KV cache", relocate)
