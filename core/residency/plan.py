"""The in-place path's plan: the weight tensors grouped by the buffers that hold them, the layer
parts those buffers make (runs of consecutive layers), and the rules the plan follows (which buffer
types copy bytes unchanged, how layers are split into runs)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import OutOfDeviceMemoryError
from . import _ggml
from .discovery import Discovery
from .unsupported import InPlaceUnsupportedError, NothingToReleaseError

_LAYER = re.compile(r"blk\.(\d+)\.")
#: buffer types whose bytes ggml_backend_tensor_get can read back unchanged (others repack).
#: Vulkan: the device buffers (VulkanN; Vulkan_Host buffers are host memory and never released)
#: hand out data pointers from the constant vk_ptr_base (0x1000) and find their VkBuffer through
#: the buffer's context at every use, so a swapped context is all a restored buffer needs.
_READABLE_BUFT_PREFIXES = ("CPU", "CUDA", "Vulkan")


@dataclass
class WeightTensor:
    ptr: int
    name: str
    offset: int  # data - buffer base
    nbytes: int
    shadow_offset: int = -1


@dataclass
class WeightBuffer:
    ptr: int
    buft: int
    buft_name: str
    size: int
    base: int
    layout: _ggml.BufferLayout | None = None
    tensors: list[WeightTensor] = field(default_factory=list)
    released: bool = False
    #: the shadow mirrors the buffer's layout and restore uploads it in one copy (buffer types
    #: whose set_tensor is a plain copy); otherwise it is packed and uploaded tensor by tensor
    mirror: bool = False
    shadow_base: int = 0
    whole: int = 0  # a private I8 tensor spanning the buffer, for the one-copy upload
    #: a layer part's buffer, made by the in-place path (its tensors' ``buffer`` field points at
    #: it); False: one of the model's own buffers (parts=1)
    owned: bool = False


@dataclass
class Part:
    """A run of consecutive layers and the buffers (one per buffer type) that hold them."""

    index: int
    first_layer: int
    last_layer: int
    buffers: list[WeightBuffer]

    @property
    def bytes(self) -> int:
        return sum(b.size for b in self.buffers)

    @property
    def resident(self) -> bool:
        return not any(b.released for b in self.buffers)


def layer_of(name: str) -> int | None:
    """The layer index of a tensor named ``blk.<i>.*``; None for the tensors outside the layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def split_runs(sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` index ranges of up to ``n`` runs of consecutive ``sizes``, none empty: each run
    in turn takes entries while that brings its sum nearer to an even share of what is left (so a
    big first entry -- the layer with the embeddings -- leaves the others evenly split)."""
    k = max(1, min(n, len(sizes)))
    runs: list[tuple[int, int]] = []
    lo = 0
    for left in range(k, 1, -1):  # runs still to make, this one included
        target = sum(sizes[lo:]) / left
        acc, hi = sizes[lo], lo + 1
        while hi < len(sizes) - (left - 1) and abs(acc + sizes[hi] - target) <= abs(acc - target):
            acc += sizes[hi]
            hi += 1
        runs.append((lo, hi))
        lo = hi
    runs.append((lo, len(sizes)))
    return runs


def plain_copy(buft_name: str) -> bool:
    """Buffer types whose set_tensor copies bytes unchanged (CPU_REPACK and the like repack)."""
    return (
        buft_name == "CPU"
        or (buft_name.startswith("CUDA") and buft_name[4:].isdigit())
        or (buft_name.startswith("Vulkan") and buft_name[6:].isdigit())
    )


def pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def out_of_memory(b: WeightBuffer, todo: list[WeightBuffer]) -> OutOfDeviceMemoryError:
    """The error of a restore of ``todo`` that found no room for ``b``."""
    need = sum(x.size for x in todo)
    return OutOfDeviceMemoryError(
        f"not enough {b.buft_name} memory to restore the model's weights "
        f"({need / 1e9:.2f} GB needed, a {b.size / 1e9:.2f} GB buffer failed): the model stays "
        "released; free device memory "
        "(release or stop another model) and try again"
    )


def plan_buffers(disc: Discovery, lay: _ggml.TensorLayout, gpu: _ggml.Device | None) -> list[WeightBuffer]:
    """Step 2: the weight buffers to release, each with its tensors (device buffers; on a CPU-only
    build the host weight buffers of a model loaded without mmap), checked to be filled exactly
    by the tensors found and probed for their struct layout. Raises NothingToReleaseError or
    InPlaceUnsupportedError (why the in-place path cannot be used)."""
    by_buf: dict[int, WeightBuffer] = {}
    all_bufs: dict[int, str] = {}
    for t in sorted(disc.weights):
        buf = _ggml.read_ptr(t + lay.buffer)
        buft = int(_ggml.buffer_get_type(buf))
        name = _ggml.buffer_type_name(buft)
        all_bufs[buf] = name
        if gpu is not None and _ggml.buffer_is_host(buf):
            continue  # host weights of a GPU build stay where they are
        if buf not in by_buf:
            by_buf[buf] = WeightBuffer(
                buf, buft, name, int(_ggml.buffer_get_size(buf)), int(_ggml.buffer_get_base(buf) or 0)
            )
        b = by_buf[buf]
        data = _ggml.read_ptr(t + lay.data)
        b.tensors.append(WeightTensor(t, _ggml.tensor_name(t), data - b.base, int(_ggml.ggml_nbytes(t))))
    if gpu is None and any(n == "CPU_Mapped" for n in all_bufs.values()):
        raise NothingToReleaseError(
            "the weights are memory-mapped on a CPU-only build: nothing to release "
            "(load the model with use_mmap=False to use the in-place path)"
        )
    if not by_buf:
        raise InPlaceUnsupportedError("no weight buffer on the device to release (is n_gpu_layers 0?)")
    for b in by_buf.values():
        if not any(b.buft_name.startswith(p) for p in _READABLE_BUFT_PREFIXES):
            raise InPlaceUnsupportedError(
                f"backend buffer type {b.buft_name} is not checked for in-place release"
            )
        _check_complete(b)
    buft_layouts: dict[int, _ggml.BufferLayout] = {}
    for b in by_buf.values():
        if b.buft not in buft_layouts:
            try:
                buft_layouts[b.buft] = _ggml.probe_buffer_layout(b.buft, reference=b.ptr)
            except _ggml.LayoutMismatchError as exc:
                raise InPlaceUnsupportedError(str(exc)) from exc
        b.layout = buft_layouts[b.buft]
        lay_b = b.layout
        if _ggml.read_size(b.ptr + lay_b.size) != b.size:
            raise InPlaceUnsupportedError(
                f"the {b.buft_name} weight buffer's size field is not where the probe found it"
            )
    return list(by_buf.values())


def split_plan(originals: list[WeightBuffer], n: int) -> tuple[list[Part], list[WeightBuffer]] | str:
    """Up to ``n`` parts of consecutive layers with near-equal bytes (the tensors outside the
    layers count with the first layer), and their buffers: one per part and original buffer
    holding any of its tensors, laid out as ggml-alloc lays out a buffer (each tensor at an
    aligned offset, its allocation size padded to the alignment); why not (the in-place
    path's ``parts_note``) when the weights make fewer than two parts."""
    padded: dict[int, int] = {}
    layer_bytes: dict[int, int] = {}
    outside = 0
    for o in originals:
        align = int(_ggml.buft_get_alignment(o.buft))
        for t in o.tensors:
            size = pad(int(_ggml.buft_get_alloc_size(o.buft, t.ptr)), align)
            padded[t.ptr] = size
            layer = layer_of(t.name)
            if layer is None:
                outside += size
            else:
                layer_bytes[layer] = layer_bytes.get(layer, 0) + size
    layers = sorted(layer_bytes)
    if len(layers) < 2:
        return f"{len(layers)} blk.<i> layer(s) among the weights: released whole"
    sizes = [layer_bytes[x] for x in layers]
    sizes[0] += outside
    runs = split_runs(sizes, n)
    part_of = {x: j for j, (lo, hi) in enumerate(runs) for x in layers[lo:hi]}

    def part_index(name: str) -> int:
        layer = layer_of(name)
        return part_of[layers[0] if layer is None else layer]

    parts = [Part(j, layers[lo], layers[hi - 1], []) for j, (lo, hi) in enumerate(runs)]
    units: list[WeightBuffer] = []
    for part in parts:
        for o in originals:
            mine = sorted((t for t in o.tensors if part_index(t.name) == part.index), key=lambda x: x.offset)
            if not mine:
                continue
            u = WeightBuffer(0, o.buft, o.buft_name, 0, 0, layout=o.layout, released=True, owned=True)
            pos = 0
            for t in mine:
                u.tensors.append(WeightTensor(t.ptr, t.name, pos, t.nbytes))
                pos += padded[t.ptr]
            u.size = pos
            part.buffers.append(u)
            units.append(u)
    return parts, units


def _check_complete(b: WeightBuffer) -> None:
    align = int(_ggml.buft_get_alignment(b.buft))
    spans = sorted(
        (t.offset, pad(int(_ggml.buft_get_alloc_size(b.buft, t.ptr)), align), t.name) for t in b.tensors
    )
    pos = 0
    for off, length, name in spans:
        if off != pos:
            raise InPlaceUnsupportedError(
                f"weight buffer {b.buft_name} ({b.size} bytes) is not covered by the tensors the "
                f"warm-up graph showed: {'a gap' if off > pos else 'an overlap'} at byte {pos} "
                f"before {name}"
            )
        pos = off + length
    if pos != b.size:
        raise InPlaceUnsupportedError(
            f"weight buffer {b.buft_name} holds {b.size} bytes but the tensors the warm-up graph showed "
            f"cover {pos}: some weight was not seen, so releasing it would leave a dangling pointer"
        )


def backend_name(buffers: list[WeightBuffer], gpu: _ggml.Device | None) -> str:
    """The name of the device that holds ``buffers`` (``gpu``'s name where none says)."""
    if gpu is None:
        return "CPU"
    for b in buffers:
        dev = _ggml.buft_get_device(b.buft)
        if dev:
            raw = _ggml.dev_name(dev)
            if raw:
                return str(raw.decode())
    return gpu.name
