"""The in-place path's plan: the weight tensors grouped by the buffers that hold them, the layer
parts those buffers make (runs of consecutive layers), and the rules the plan follows (which buffer
types copy bytes unchanged, how layers are split into runs)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import OutOfDeviceMemoryError
from . import _ggml

_LAYER = re.compile(r"blk\.(\d+)\.")


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
