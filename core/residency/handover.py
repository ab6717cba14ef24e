"""The in-place path's hand-over of device memory (issue 40): the weight buffers' memory is mapped
from chunks handed over between workers instead of allocated through ggml, and unmapped instead
of freed. One :class:`WeightHandover` per :class:`~.inplace.InPlace`, its only caller (the
worker's loop thread); the carriers themselves are residency/carrier.py's.

A restore into kept chunks that still hold the buffer's bytes uploads nothing for it
(:meth:`WeightHandover.intact`): the weights are never written on the device, and only weight
buffers are mapped from handed memory, so a range the holder vouches nobody else mapped since
its release (core/devmem/mapped.py), filled completely before that release
(:meth:`WeightHandover.filled`, after the uploads ended), holds exactly what the upload would
write."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..devmem.device import ChunkDeviceError
from ..devmem.mapped import HandedMemory
from ..errors import OutOfDeviceMemoryError, ResidencyError
from . import _ggml
from .carrier import BaseSlot, Carried, make_carrier, probe_base_slot, uncarry
from .plan import WeightBuffer, out_of_memory

log = logging.getLogger(__name__)


class WeightHandover:
    """The mapped chunks of the weight buffers (None: they are allocated and freed through
    ggml), why not when not, each buffer type's base-pointer slot, the carriers of the buffers
    mapped now and the buffers to unmap."""

    def __init__(self) -> None:
        self.handed: HandedMemory | None = None
        self.note = "not asked for (ResidencyOptions.handover, arena.handover)"
        self._slots: dict[int, BaseSlot] = {}
        self._carried: dict[int, Carried] = {}
        self._unmap_after: list[int] = []
        #: close() moved resident handed buffers into ggml memory at other addresses (graphs stale)
        self.moved_at_close = False
        #: bytes whose upload restores skipped (their kept memory still held them), since start
        self.skipped_bytes = 0
        #: this object closes ``handed`` at :meth:`give_back` (False: a vision projector's, which
        #: maps from its model's memory and gives back only its own buffers)
        self.owner = True

    def setup(
        self, handed: HandedMemory, buffers: list[WeightBuffer], parallel: bool, owner: bool = True
    ) -> None:
        """Use ``handed`` for every weight buffer, or for none (``note`` says why). ``owner``:
        whether :meth:`give_back` closes ``handed`` (the model's, not its projector's)."""
        self.owner = owner
        if parallel:
            self.note = (
                "the buffers are allocated on several threads (Vulkan): its hand-over is "
                "VK_KHR_external_memory_fd (devmem/vulkan.py), not wired into ggml-vulkan's buffers yet"
            )
            return
        slots: dict[int, BaseSlot] = {}
        for b in buffers:
            if b.buft in slots:
                continue
            assert b.layout is not None
            try:
                slots[b.buft] = probe_base_slot(b.buft, b.layout)
            except _ggml.LayoutMismatchError as exc:
                self.note = str(exc)
                return
        self._slots = slots
        self.handed = handed
        self.note = ""

    def stats(self, buffers: list[WeightBuffer]) -> dict[str, object]:
        """What the hand-over of ``buffers`` did (doctor, bench residency, the worker's status)."""
        h = self.handed
        out: dict[str, object] = {"on": h is not None, "note": self.note}
        if h is not None:
            out.update(
                device=h.device.name,
                chunk_bytes=h.chunk_bytes,
                handed_chunks=h.handed_chunks,
                created_chunks=h.created_chunks,
                put_chunks=h.put_chunks,
                creates=h.device.creates,
                mapped_bytes=h.mapped_bytes,
                padding_bytes=h.padding_bytes,
                kept_bytes=h.kept_bytes,
                kept_chunks=h.kept_chunks,
                reused_chunks=h.reused_chunks,
                reclaimed_chunks=h.reclaimed_chunks,
                unkept_chunks=h.unkept_chunks,
                lazy_unmapped_chunks=h.lazy_unmapped_chunks,
                intact_chunks=h.intact_chunks,
                skipped_upload_bytes=self.skipped_bytes,
                reuse_contents=h.reuse_contents,
                maps=h.device.maps,
                unmaps=h.device.unmaps,
                last_mapped_chunks=h.last.mapped,
                lease_padding_bytes=self.padding(buffers),
                source_note=h.source_note,
            )
        return out

    def map(self, todo: list[WeightBuffer], later: int = 0) -> HandedMemory | None:
        """Map handed-over memory for ``todo`` (one request to the holder); None: the buffers
        are allocated through ggml this time (no hand-over, or it failed: ``note``). ``later``:
        the bytes the restore allocates on the device after the weights (HandedMemory.map_all:
        not room for chunks)."""
        handed = self.handed
        if handed is None or not todo:
            return None
        try:
            handed.map_all([(id(b), b.size) for b in todo], later=later)
        except ChunkDeviceError as exc:
            if exc.out_of_memory:
                raise out_of_memory(todo[0], todo) from exc
            self.note = f"the last restore allocated through ggml: {exc}"
            log.warning("%s", self.note)
            return None
        return handed

    def padding(self, bufs: list[WeightBuffer]) -> int:
        """The device memory ``bufs`` hold beyond their bytes when mapped from handed memory: the
        unused part of each one's last chunk (0 without the hand-over)."""
        h = self.handed
        if h is None:
            return 0
        return sum(h.chunks_for(b.size) * h.chunk_bytes - b.size for b in bufs)

    def intact(self, todo: list[WeightBuffer], handed: HandedMemory | None) -> set[int]:
        """The ids of the buffers of ``todo`` (just mapped by :meth:`map`) whose ranges still
        hold their bytes: nothing to upload into them."""
        if handed is None:
            return set()
        return {id(b) for b in todo if handed.filled(id(b))}

    def filled(self, bufs: list[WeightBuffer]) -> None:
        """The uploads into ``bufs`` ended without error: their mapped ranges hold their bytes."""
        if self.handed is not None and bufs:
            self.handed.mark_filled([id(b) for b in bufs if id(b) in self._carried])

    def new_buffer(self, b: WeightBuffer, handed: HandedMemory | None) -> int | None:
        """A buffer of ``b``'s type and size to put under ``b``: a carrier of its mapped range,
        or a fresh ggml allocation; None when there is no room."""
        if handed is None:
            return _ggml.buft_alloc_buffer(b.buft, b.size)
        assert b.layout is not None
        made = make_carrier(b.buft, b.layout, self._slots[b.buft], handed.address(id(b)), b.size)
        if made is None:
            return None
        self._carried[id(b)] = made[1]
        return made[0]

    def uncarry(self, b: WeightBuffer, placeholder: int) -> None:
        """``b`` was just detached into ``placeholder``: a carrier's context gets its own pointer
        back (ggml frees that, never the mapping) and the mapping is unmapped at :meth:`unmap`."""
        carried = self._carried.pop(id(b), None)
        if carried is not None:
            assert b.layout is not None
            uncarry(placeholder, b.layout, self._slots[b.buft], carried)
            self._unmap_after.append(id(b))

    def unmap(self, keep: bool = True) -> None:
        """Unmap the buffers whose carriers went (their chunks go back to the holder)."""
        keys, self._unmap_after = self._unmap_after, []
        if keys and self.handed is not None:
            self.handed.unmap(keys, keep=keep)

    def unmap_unused(
        self, handed: HandedMemory | None, todo: list[WeightBuffer], done: list[WeightBuffer]
    ) -> None:
        """A restore failed: what it mapped and never carried is unmapped too."""
        if handed is not None:
            self._unmap_after.extend(id(x) for x in todo if x not in done and handed.mapped(id(x)))
        self.unmap()

    def give_back(
        self,
        buffers: list[WeightBuffer],
        finish: Callable[[], None],
        free: Callable[[WeightBuffer], None],
        restore: Callable[[list[WeightBuffer]], bool],
    ) -> None:
        """Before close: buffers resident in handed-over memory move into memory ggml allocates
        (``free``-d, then ``restore``-d from the shadow: True when they moved), so the model
        stays usable and ggml never frees a mapping; every chunk goes back to the holder, which
        closes it (the owner's: all of ``handed``; another's only its own buffers').
        ``finish``: the uploads in flight end first."""
        handed = self.handed
        if handed is None:
            return
        carried = [b for b in buffers if id(b) in self._carried]
        self.moved_at_close = False
        try:
            if carried:
                finish()
                for b in carried:
                    free(b)
                self.unmap(keep=False)
                self.handed = None
                try:
                    self.moved_at_close = restore(carried)
                except (OutOfDeviceMemoryError, ResidencyError) as exc:
                    log.warning("closing: the weights stay released (%s)", exc)
        finally:
            self.handed = None
            if self.owner:
                handed.close(keep=False)
