"""ctypes bindings to the ggml / gguf functions llama-cpp-python does not expose, and the layout
probes of the ggml structs that the in-place path reads and writes.

Everything here runs in the process that loaded llama_cpp (the same shared libraries). Functions
that allocate are module-level names on purpose: tests inject allocation failures by replacing
them (``buft_alloc_buffer``), which is the only way to make a real allocator fail on demand.
"""

from __future__ import annotations

import ctypes
import logging
import os
from ctypes import c_bool, c_char_p, c_int, c_int64, c_size_t, c_void_p
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

log = logging.getLogger(__name__)

#: the one llama-cpp-python version whose ggml struct layouts the in-place path was checked against
PINNED_VERSION = "0.3.36"

GGML_MAX_SRC = 10
GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1
GGML_BACKEND_DEVICE_TYPE_IGPU = 2
GGML_TYPE_F32 = 0
GGML_TYPE_I8 = 24


@dataclass(frozen=True)
class TensorLayout:
    """Byte offsets of the ggml_tensor fields the in-place path uses (public struct, ggml.h)."""

    buffer: int = 8
    ne: int = 16
    src: int = 152
    view_src: int = 232
    view_offs: int = 240
    data: int = 248
    name: int = 256
    #: ggml.c's ``struct ggml_object`` (``offs`` first) sits right before each tensor of a context
    object_size: int = 32
    #: ``ggml_context.mem_buffer`` (after ``mem_size``): all ggml_get_next_tensor reads of it
    ctx_mem_buffer: int = 8


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets inside the internal ``struct ggml_backend_buffer`` (found by probing)."""

    iface_bytes: int  # the function-pointer block at the start
    context: int
    size: int


class _DevProps(ctypes.Structure):
    """struct ggml_backend_dev_props (ggml-backend.h); the caps block is over-allocated."""

    _fields_ = [
        ("name", c_char_p),
        ("description", c_char_p),
        ("memory_free", c_size_t),
        ("memory_total", c_size_t),
        ("type", c_int),
        ("device_id", c_char_p),
        ("caps", c_bool * 16),
    ]


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", c_bool), ("ctx", c_void_p)]


class GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


def _lib_dir() -> Path:
    return Path(os.path.dirname(os.path.abspath(llama_cpp.__file__))) / "lib"


def _load(name: str) -> ctypes.CDLL | None:
    path = _lib_dir() / f"lib{name}.so"
    if not path.exists():
        return None
    # RTLD_GLOBAL like llama_cpp itself; dlopen hands back the copy that is already loaded.
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


# llama_cpp loads libllama, which pulls libggml and libggml-base in; bind to those same copies.
_LIBS = [lib for lib in (_load("ggml-base"), _load("ggml"), _load("llama")) if lib is not None]


def _fn(name: str, restype: Any, *argtypes: Any) -> Any:
    for lib in _LIBS:
        try:
            f = getattr(lib, name)
        except AttributeError:
            continue
        f.restype = restype
        f.argtypes = list(argtypes)
        return f
    raise OSError(f"symbol {name} not found in the ggml libraries of llama_cpp ({_lib_dir()})")


# tensors
ggml_nbytes = _fn("ggml_nbytes", c_size_t, c_void_p)
ggml_get_name = _fn("ggml_get_name", c_char_p, c_void_p)
ggml_get_data = _fn("ggml_get_data", c_void_p, c_void_p)
ggml_init = _fn("ggml_init", c_void_p, GgmlInitParams)
ggml_free = _fn("ggml_free", None, c_void_p)
ggml_new_tensor_1d = _fn("ggml_new_tensor_1d", c_void_p, c_void_p, c_int, c_int64)
ggml_get_mem_buffer = _fn("ggml_get_mem_buffer", c_void_p, c_void_p)
ggml_new_tensor = _fn("ggml_new_tensor", c_void_p, c_void_p, c_int, c_int, ctypes.POINTER(ctypes.c_int64))
ggml_tensor_overhead = _fn("ggml_tensor_overhead", c_size_t)
ggml_get_next_tensor = _fn("ggml_get_next_tensor", c_void_p, c_void_p, c_void_p)
ggml_add = _fn("ggml_add", c_void_p, c_void_p, c_void_p, c_void_p)
ggml_view_1d = _fn("ggml_view_1d", c_void_p, c_void_p, c_void_p, c_int64, c_size_t)
ggml_set_name = _fn("ggml_set_name", c_void_p, c_void_p, c_char_p)
ggml_backend_alloc_ctx_tensors_from_buft = _fn(
    "ggml_backend_alloc_ctx_tensors_from_buft", c_void_p, c_void_p, c_void_p
)

# buffers and buffer types
buffer_get_size = _fn("ggml_backend_buffer_get_size", c_size_t, c_void_p)
buffer_get_base = _fn("ggml_backend_buffer_get_base", c_void_p, c_void_p)
buffer_get_usage = _fn("ggml_backend_buffer_get_usage", c_int, c_void_p)
buffer_get_type = _fn("ggml_backend_buffer_get_type", c_void_p, c_void_p)
buffer_set_usage = _fn("ggml_backend_buffer_set_usage", None, c_void_p, c_int)
buffer_is_host = _fn("ggml_backend_buffer_is_host", c_bool, c_void_p)
buffer_init_tensor = _fn("ggml_backend_buffer_init_tensor", c_int, c_void_p, c_void_p)
buffer_free = _fn("ggml_backend_buffer_free", None, c_void_p)
buffer_clear = _fn("ggml_backend_buffer_clear", None, c_void_p, ctypes.c_uint8)
buft_name = _fn("ggml_backend_buft_name", c_char_p, c_void_p)
buft_get_alignment = _fn("ggml_backend_buft_get_alignment", c_size_t, c_void_p)
buft_get_alloc_size = _fn("ggml_backend_buft_get_alloc_size", c_size_t, c_void_p, c_void_p)
buft_get_max_size = _fn("ggml_backend_buft_get_max_size", c_size_t, c_void_p)
buft_get_device = _fn("ggml_backend_buft_get_device", c_void_p, c_void_p)
_buft_alloc_buffer = _fn("ggml_backend_buft_alloc_buffer", c_void_p, c_void_p, c_size_t)
tensor_set = _fn("ggml_backend_tensor_set", None, c_void_p, c_void_p, c_size_t, c_size_t)
tensor_get = _fn("ggml_backend_tensor_get", None, c_void_p, c_void_p, c_size_t, c_size_t)
#: (tensor, data, offset, size, n_copies, stride_tensor, stride_data): n_copies rows of ``size``
tensor_set_2d = _fn(
    "ggml_backend_tensor_set_2d", None, c_void_p, c_void_p, c_size_t, c_size_t, c_size_t, c_size_t, c_size_t
)
#: (tensor, data, offset, size, n_copies, stride_tensor, stride_data): n_copies rows of ``size``
#: read from ``offset + i * stride_tensor`` of the tensor to ``data + i * stride_data``
tensor_get_2d = _fn(
    "ggml_backend_tensor_get_2d", None, c_void_p, c_void_p, c_size_t, c_size_t, c_size_t, c_size_t, c_size_t
)

# devices
dev_count = _fn("ggml_backend_dev_count", c_size_t)
dev_get = _fn("ggml_backend_dev_get", c_void_p, c_size_t)
dev_type = _fn("ggml_backend_dev_type", c_int, c_void_p)
dev_name = _fn("ggml_backend_dev_name", c_char_p, c_void_p)
dev_memory = _fn(
    "ggml_backend_dev_memory", None, c_void_p, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)
)
dev_host_buffer_type = _fn("ggml_backend_dev_host_buffer_type", c_void_p, c_void_p)
dev_buffer_type = _fn("ggml_backend_dev_buffer_type", c_void_p, c_void_p)
dev_description = _fn("ggml_backend_dev_description", c_char_p, c_void_p)
_dev_get_props = _fn("ggml_backend_dev_get_props", None, c_void_p, ctypes.POINTER(_DevProps))

# gguf
_gguf_init_from_file = _fn("gguf_init_from_file", c_void_p, c_char_p, _GgufInitParams)
gguf_free = _fn("gguf_free", None, c_void_p)
gguf_find_tensor = _fn("gguf_find_tensor", c_int64, c_void_p, c_char_p)
gguf_get_tensor_offset = _fn("gguf_get_tensor_offset", c_size_t, c_void_p, c_int64)
gguf_get_tensor_size = _fn("gguf_get_tensor_size", c_size_t, c_void_p, c_int64)
gguf_get_data_offset = _fn("gguf_get_data_offset", c_size_t, c_void_p)
gguf_get_n_tensors = _fn("gguf_get_n_tensors", c_int64, c_void_p)


def bind_optional(name: str, restype: Any, *argtypes: Any) -> Any | None:
    """The exported function ``name`` of libggml-base, libggml or libllama (the copies llama_cpp
    loaded), bound to these types; None where none exports it."""
    try:
        return _fn(name, restype, *argtypes)
    except OSError:
        return None


# the scheduler's eval callback (public ggml API) and two of llama_context's C++ accessors, which
# libllama exports (it is built with default symbol visibility): the eval hook of an overlapped
# restore (residency/evalhook.py) finds the context's cparams and scheduler through them
sched_set_eval_callback = _fn("ggml_backend_sched_set_eval_callback", None, c_void_p, c_void_p, c_void_p)
ctx_get_cparams = bind_optional("_ZNK13llama_context11get_cparamsEv", c_void_p, c_void_p)
ctx_get_sched = bind_optional("_ZNK13llama_context9get_schedEv", c_void_p, c_void_p)
ctx_sched_reserve = bind_optional("_ZN13llama_context13sched_reserveEv", None, c_void_p)
# the scheduler's compute buffers (residency/computebuf.py): public ggml API, and the context's
# previous graph (``llama_context::get_gf_res_prev``, ``llm_graph_result::reset``: exported C++)
sched_get_n_backends = _fn("ggml_backend_sched_get_n_backends", c_int, c_void_p)
sched_get_backend = _fn("ggml_backend_sched_get_backend", c_void_p, c_void_p, c_int)
sched_get_buffer_type = _fn("ggml_backend_sched_get_buffer_type", c_void_p, c_void_p, c_void_p)
sched_get_buffer_size = _fn("ggml_backend_sched_get_buffer_size", c_size_t, c_void_p, c_void_p)
buft_is_host = _fn("ggml_backend_buft_is_host", c_bool, c_void_p)
ctx_get_gf_res_prev = bind_optional("_ZN13llama_context15get_gf_res_prevEv", c_void_p, c_void_p)
graph_result_reset = bind_optional("_ZN16llm_graph_result5resetEv", None, c_void_p)


def buft_alloc_buffer(buft: int, size: int) -> int | None:
    """Allocate a backend buffer; None when the backend cannot (out of memory).

    Tests replace this name to inject an allocation failure (a fault a CPU machine cannot cause).
    """
    ptr = _buft_alloc_buffer(buft, size)
    return int(ptr) if ptr else None


def gguf_open_meta(path: str) -> int | None:
    """The metadata of a GGUF file (no tensor data); None when it is not a readable GGUF."""
    ctx = _gguf_init_from_file(os.fsencode(path), _GgufInitParams(True, None))
    return int(ctx) if ctx else None


def read_ptr(addr: int) -> int:
    value = ctypes.c_void_p.from_address(addr).value
    return int(value) if value else 0


def view_root(tensor: int, layout: TensorLayout) -> int:
    """The tensor a view (of a view ...) of ``tensor`` looks at; ``tensor`` itself if it is none."""
    root = tensor
    while True:
        parent = read_ptr(root + layout.view_src)
        if not parent:
            return root
        root = parent


def swap_buffer_memory(a: int, b: int, layout: BufferLayout) -> None:
    """Swap the memory (``context`` and ``size``) of two live backend buffers of one type: each
    struct stays where it is (whoever holds it keeps a valid buffer), its memory changes hands.
    Freeing ``b`` afterwards frees what ``a`` had."""
    ca, cb = read_ptr(a + layout.context), read_ptr(b + layout.context)
    sa, sb = read_size(a + layout.size), read_size(b + layout.size)
    write_ptr(a + layout.context, cb)
    write_ptr(b + layout.context, ca)
    write_size(a + layout.size, sb)
    write_size(b + layout.size, sa)


def write_ptr(addr: int, value: int) -> None:
    ctypes.c_void_p.from_address(addr).value = value or None


def read_size(addr: int) -> int:
    return int(ctypes.c_size_t.from_address(addr).value)


def write_size(addr: int, value: int) -> None:
    ctypes.c_size_t.from_address(addr).value = value


def buffer_type_name(buft: int) -> str:
    raw = buft_name(buft)
    return raw.decode("utf-8", "replace") if raw else "?"


def tensor_name(tensor: int) -> str:
    raw = ggml_get_name(tensor)
    return raw.decode("utf-8", "replace") if raw else ""


@dataclass(frozen=True)
class Device:
    handle: int
    name: str
    kind: int  # GGML_BACKEND_DEVICE_TYPE_*

    @property
    def is_gpu(self) -> bool:
        return self.kind in (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU)


def devices() -> list[Device]:
    out = []
    for i in range(int(dev_count())):
        handle = dev_get(i)
        if not handle:
            continue
        raw = dev_name(handle)
        out.append(Device(int(handle), raw.decode() if raw else f"dev{i}", int(dev_type(handle))))
    return out


def first_gpu() -> Device | None:
    return next((d for d in devices() if d.is_gpu), None)


def gpu_at(index: int) -> Device | None:
    """The ``index``-th GPU as llama.cpp counts them for ``main_gpu`` (the first when there is no
    such GPU; None on a build without one)."""
    gpus = [d for d in devices() if d.is_gpu]
    if not gpus:
        return None
    return gpus[index] if 0 <= index < len(gpus) else gpus[0]


def device_id(dev: int) -> str:
    """The device's id as its backend reports it (a PCI bus id "dddd:bb:dd.f"), or ""."""
    props = _DevProps()
    _dev_get_props(dev, ctypes.byref(props))
    return props.device_id.decode() if props.device_id else ""


def device_description(dev: int) -> str:
    raw = dev_description(dev)
    return raw.decode("utf-8", "replace") if raw else ""


def device_memory(dev: int) -> tuple[int, int]:
    """(free, total) bytes of a device as its backend reports them."""
    free, total = c_size_t(0), c_size_t(0)
    dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


# ---------------------------------------------------------------------------------------------
# layout probes


def next_tensor(tensor: int, layout: TensorLayout) -> int:
    """The tensor created after ``tensor`` in the same ggml context (0: none), found without the
    context: ``ggml_get_next_tensor`` reads only the context's ``mem_buffer``, which is the tensor's
    address less its object's ``offs``."""
    fake_ctx = (ctypes.c_char * 64)()
    base = tensor - read_size(tensor - layout.object_size)
    ctypes.c_void_p.from_address(ctypes.addressof(fake_ctx) + layout.ctx_mem_buffer).value = base
    return int(ggml_get_next_tensor(ctypes.addressof(fake_ctx), tensor) or 0)


class LayoutMismatchError(Exception):
    """A ggml struct does not look the way the in-place path expects (reason in the message)."""


def probe_tensor_layout(layout: TensorLayout = TensorLayout()) -> None:
    """Check every ggml_tensor offset against values public functions produced."""
    params = GgmlInitParams(1 << 20, None, False)
    ctx = ggml_init(params)
    if not ctx:
        raise LayoutMismatchError("ggml_init failed")
    try:
        a = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64)
        b = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64)
        c = ggml_add(ctx, a, b)
        v = ggml_view_1d(ctx, a, 8, 16)
        ggml_set_name(a, b"timeshare-probe")
        mem = ggml_get_mem_buffer(ctx) or 0
        checks = {
            "object.offs": mem + read_size(a - layout.object_size) == a,
            "ctx.mem_buffer": read_ptr(ctx + layout.ctx_mem_buffer) == mem,
            "next tensor": next_tensor(a, layout) == b,
            "src[0]": read_ptr(c + layout.src) == a,
            "src[1]": read_ptr(c + layout.src + 8) == b,
            "view_src": read_ptr(v + layout.view_src) == a,
            "view_offs": read_size(v + layout.view_offs) == 16,
            "data": read_ptr(a + layout.data) == (ggml_get_data(a) or 0),
            "name": ctypes.string_at(a + layout.name, 15) == b"timeshare-probe",
            "ne[0]": ctypes.c_int64.from_address(a + layout.ne).value == 64,
            "buffer(null)": read_ptr(a + layout.buffer) == 0,
        }
    finally:
        ggml_free(ctx)
    # the buffer field of an allocated tensor
    cpu = next((d for d in devices() if d.kind == GGML_BACKEND_DEVICE_TYPE_CPU), None)
    if cpu is not None:
        ctx = ggml_init(GgmlInitParams(1 << 16, None, True))
        try:
            t = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64)
            buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, dev_buffer_type(cpu.handle))
            checks["buffer"] = bool(buf) and read_ptr(t + layout.buffer) == buf
            checks["data(alloc)"] = bool(buf) and read_ptr(t + layout.data) == buffer_get_base(buf)
            if buf:
                buffer_free(buf)
        finally:
            ggml_free(ctx)
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise LayoutMismatchError(
            "ggml_tensor layout differs from ggml.h of llama-cpp-python 0.3.36 at: " + ", ".join(bad)
        )


def probe_buffer_layout(buft: int, reference: int | None = None) -> BufferLayout:
    """Find ``size`` and ``context`` in ``struct ggml_backend_buffer`` with two live buffers of
    known, different sizes from ``buft``; check the function-pointer block is the same in both
    (and in ``reference``, a live buffer of the same type, when given)."""
    sizes = (4096 + 64, 3 * 4096 + 128)
    bufs = [buft_alloc_buffer(buft, s) for s in sizes]
    try:
        if not all(bufs):
            raise LayoutMismatchError(f"cannot allocate probe buffers of type {buffer_type_name(buft)}")
        b0, b1 = int(bufs[0] or 0), int(bufs[1] or 0)
        real = [buffer_get_size(b0), buffer_get_size(b1)]
        candidates = [
            k for k in range(16, 256, 8) if read_size(b0 + k) == real[0] and read_size(b1 + k) == real[1]
        ]
        if len(candidates) != 1:
            raise LayoutMismatchError(
                f"ggml_backend_buffer.size not found uniquely (candidates {candidates})"
            )
        size_off = candidates[0]
        ctx_off = size_off - 8
        iface = ctx_off - 8  # iface block, then buft, then context
        if read_ptr(b0 + iface) != buft:
            raise LayoutMismatchError("ggml_backend_buffer.buft is not the field before context")
        if ctypes.string_at(b0, iface) != ctypes.string_at(b1, iface):
            raise LayoutMismatchError("two buffers of one type have different function tables")
        if reference is not None and ctypes.string_at(reference, iface) != ctypes.string_at(b0, iface):
            raise LayoutMismatchError(
                f"the model's {buffer_type_name(buft)} buffer has a function table that a fresh buffer of "
                "the same type does not have"
            )
        if read_ptr(b0 + ctx_off) == 0:
            raise LayoutMismatchError("ggml_backend_buffer.context is null in a live buffer")
        return BufferLayout(iface_bytes=iface, context=ctx_off, size=size_off)
    finally:
        for b in bufs:
            if b:
                buffer_free(b)
