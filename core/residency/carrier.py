"""A ggml buffer pointed at memory ggml did not allocate: the handed-over chunks of issue 40.

The in-place restore puts a fresh buffer's ``context`` (and ``size``) under the model's buffer
struct. With handed-over memory the fresh buffer is a *carrier*: a tiny buffer of the same type
whose base pointer is rewritten to the mapped range and whose ``size`` to the weights' size. Where
the base pointer lives is found by a probe on two live buffers of the type
(:func:`probe_base_slot`): the context itself (ggml's CPU buffer, whose context is its data
pointer) or a pointer field inside the context (ggml-cuda's ``ggml_backend_cuda_buffer_context
.dev_ptr``); the probe also writes the slot and checks ``ggml_backend_buffer_get_base`` follows.

The carrier's own tiny pointer and size are kept (:class:`Carried`) and written back into the
context before ggml ever frees it (:func:`uncarry`), so ggml frees its tiny allocation and never
the mapping (``cudaFree`` of a VMM address would fail, ``free`` of a memfd mapping would crash):
the mapping is unmapped by the hand-over memory, not by ggml.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _ggml
from .plan import plain_copy

#: the probe's buffers (two sizes, so the fields of each can be told apart)
_PROBE_SIZES = (4096 + 64, 3 * 4096 + 128)
_TINY = 64


@dataclass(frozen=True)
class BaseSlot:
    """Where a buffer type's buffers keep their base pointer: ``offset`` None: the context is the
    pointer (CPU); else the pointer field at ``offset`` inside the context (CUDA's dev_ptr)."""

    offset: int | None


@dataclass(frozen=True)
class Carried:
    """A carrier context's own pointer and size, to write back before ggml frees it."""

    own_base: int
    own_size: int


def probe_base_slot(buft: int, layout: _ggml.BufferLayout) -> BaseSlot:
    """Find (and check by writing it) where buffers of ``buft`` keep their base pointer; raises
    LayoutMismatchError (the hand-over is then not used for this type)."""
    name = _ggml.buffer_type_name(buft)
    if not plain_copy(name):
        raise _ggml.LayoutMismatchError(f"{name} buffers are not plain memory: no hand-over for them")
    bufs = [_ggml.buft_alloc_buffer(buft, s) for s in _PROBE_SIZES]
    try:
        if not all(bufs):
            raise _ggml.LayoutMismatchError(f"cannot allocate probe buffers of type {name}")
        b0, b1 = int(bufs[0] or 0), int(bufs[1] or 0)
        bases = [int(_ggml.buffer_get_base(b) or 0) for b in (b0, b1)]
        ctxs = [_ggml.read_ptr(b + layout.context) for b in (b0, b1)]
        if ctxs == bases:
            slot = BaseSlot(None)
        else:
            found = [
                k
                for k in range(0, 64, 8)
                if all(c and _ggml.read_ptr(c + k) == base for c, base in zip(ctxs, bases, strict=True))
            ]
            if len(found) != 1:
                raise _ggml.LayoutMismatchError(
                    f"the base pointer of a {name} buffer is not found in its context (candidates {found})"
                )
            slot = BaseSlot(found[0])
        # written, get_base follows: the slot is what ggml reads
        _write(b0, layout, slot, bases[1])
        moved = int(_ggml.buffer_get_base(b0) or 0)
        _write(b0, layout, slot, bases[0])
        if moved != bases[1] or int(_ggml.buffer_get_base(b0) or 0) != bases[0]:
            raise _ggml.LayoutMismatchError(f"a {name} buffer's base does not follow its context's pointer")
        return slot
    finally:
        for b in bufs:
            if b:
                _ggml.buffer_free(b)


def _slot_addr(buf: int, layout: _ggml.BufferLayout, slot: BaseSlot) -> int:
    """Where the base pointer of ``buf`` is stored."""
    if slot.offset is None:
        return buf + layout.context
    return _ggml.read_ptr(buf + layout.context) + slot.offset


def _write(buf: int, layout: _ggml.BufferLayout, slot: BaseSlot, base: int) -> None:
    _ggml.write_ptr(_slot_addr(buf, layout, slot), base)


def make_carrier(
    buft: int, layout: _ggml.BufferLayout, slot: BaseSlot, address: int, size: int
) -> tuple[int, Carried] | None:
    """A tiny buffer of ``buft`` pointed at ``address`` with ``size``: (its struct, what to write
    back before freeing its context). None when the tiny buffer cannot be allocated."""
    buf = _ggml.buft_alloc_buffer(buft, _TINY)
    if buf is None:
        return None
    carried = Carried(_ggml.read_ptr(_slot_addr(buf, layout, slot)), _ggml.read_size(buf + layout.size))
    _write(buf, layout, slot, address)
    _ggml.write_size(buf + layout.size, size)
    return buf, carried


def uncarry(buf: int, layout: _ggml.BufferLayout, slot: BaseSlot, carried: Carried) -> None:
    """Write the carrier context's own pointer and size back into ``buf`` (which holds that
    context now): freeing ``buf`` then frees the tiny allocation, never the mapping."""
    _write(buf, layout, slot, carried.own_base)
    _ggml.write_size(buf + layout.size, carried.own_size)
