"""The in-place path: free a loaded model's device weight buffers and put them back, in place.
:class:`InPlace` coordinates the steps; each lives in a module of its own, with one owner:
discovery (residency/discovery.py), plan (residency/plan.py), host shadow (residency/shadow.py,
``Shadow``), swaps (residency/swaps.py, ``Swaps``), uploads (residency/uploads.py, ``Uploads``)
and the hand-over's carrier calls (residency/handover.py, ``WeightHandover``); the reasons it is
not used in residency/unsupported.py.

1. discovery: a throwaway context with ``cb_eval`` runs one warm-up decode; every ``src`` of a graph
   node whose buffer is used for WEIGHTS is a weight tensor (views lead to their ``view_src``; the
   views themselves are the graph's own, freed with the throwaway context -- the live context's
   are built anew whenever a buffer moved, see context.forget_graphs -- and never written);
2. plan: group by buffer, keep the buffers to release (device buffers; on a CPU-only build the host
   weight buffers of a model loaded without mmap) and check that the tensors found fill each
   buffer exactly as ggml-alloc laid it out -- a tensor the graph did not show would keep a
   dangling pointer, so an incomplete buffer refuses the in-place path;
3. host shadow: the GGUF file bytes of every released tensor (``set_tensor`` repacks them where the
   buffer type wants it), in pinned host memory, filled with parallel reads, spot-checked against
   the loaded weights; at attach, or (``defer_shadow``) later by :meth:`Shadow.fill`:
   pinning and reading a model's weights takes seconds on an 8B model, which a request waiting
   for a just-started worker need not wait for, nor another model whose turn makes this one
   release before its shadow is built (the release then spot-checks the slices left against the
   file, :meth:`Shadow.check_pending`, and they are read from the file afterwards);
4. release: swap ``context``/``size`` of each buffer with a tiny placeholder of the same type and free
   the placeholder (which now owns the device memory);
5. restore: allocate, swap back, relocate every tensor's ``data``, ``init_tensor``, upload.

Layer parts (``parts`` > 1, issue 28): at attach the weights of each released buffer move into up
to ``parts`` buffers of the same type, each holding a run of consecutive layers (``blk.<i>.*``;
the tensors outside the layers join the first layer's part). The model's own buffers are freed
first (their structs keep a tiny placeholder, which the model frees at close), then every part
buffer is allocated, its tensors' ``buffer``/``data`` pointed into it, ``init_tensor``-ed and
uploaded from the host shadow (laid out per part) -- a restore at attach, so the device holds
the model once at any time. The part buffers' structs belong to the in-place path (freed when
the model closes); release and restore then swap placeholders per part, from the last layer down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..devmem.mapped import HandedMemory
from ..errors import OutOfDeviceMemoryError, ResidencyError
from ..util.fileid import FileId
from . import _ggml
from .discovery import Discovery, discover
from .handover import WeightHandover
from .hostmem import HostMemory
from .kvupload import KvUpload
from .options import ResidencyOptions
from .plan import Part, WeightBuffer, backend_name, layer_of, out_of_memory, plan_buffers, split_plan
from .shadow import Shadow
from .swaps import Swaps
from .timeline import ReleaseSteps
from .unsupported import InPlaceUnsupportedError
from .uploads import Uploads, restore_parallel

log = logging.getLogger(__name__)


class InPlace:
    """The in-place path of one model: owns its plan (buffers, parts) and composes its steps'
    owners (``host_shadow``, ``swaps``, ``uploads``, ``handover``), whose order it keeps. Not
    thread-safe: the worker's loop thread is its only caller."""

    def __init__(
        self,
        llm: object,
        model_path: str,
        gpu: _ggml.Device | None,
        options: ResidencyOptions,
        overlap: bool = False,
        handed: HandedMemory | None = None,
        discovery: Discovery | None = None,
        owns_handed: bool = True,
    ) -> None:
        """``overlap``: probe the eval hook an overlapped restore needs (Residency decides
        whether restores may overlap at all). ``handed``: restores map handed-over memory
        (issue 40) instead of allocating, releases unmap it (residency/handover.py);
        ``owns_handed`` False: it is another's (the model's, for its projector), never closed here.
        ``discovery``: the weight tensors found already (a vision projector's, whose clip
        context ran the callback: core/worker/vision.py); None: the warm-up decode of ``llm``
        finds them."""
        want_pinned = options.host_shadow == "pinned"
        verify, coalesce, parallel = options.verify_shadow, options.coalesce_upload, options.parallel_buffers
        parts, defer_shadow = options.parts, options.defer_shadow
        shadow_slice_bytes, split_at_release = options.shadow_slice_bytes, options.split_at_release
        self.path = model_path
        #: the file the weights were loaded from (just before this): what a shadow built after a
        #: release must still read
        file_id = FileId.of(model_path)
        #: per-step times of the last release and restore, milliseconds (doctor reports them)
        self.release_steps = ReleaseSteps()
        self.restore_steps: dict[str, float] = {}
        #: milliseconds of attach's steps (discover, plan); the shadow's: Shadow.steps
        self._attach_steps: dict[str, float] = {}
        self.layout = _ggml.TensorLayout()
        try:
            _ggml.probe_tensor_layout(self.layout)
        except _ggml.LayoutMismatchError as exc:
            raise InPlaceUnsupportedError(str(exc)) from exc
        vulkan = gpu is not None and gpu.name.startswith("Vulkan")
        t0 = time.perf_counter()
        disc = discovery if discovery is not None else discover(llm, self.layout, overlap and not vulkan)
        t1 = time.perf_counter()
        #: where the upload gate goes in the live context (None: restores stay synchronous,
        #: ``overlap_note`` says why)
        self.hook = disc.hook
        self.overlap_note = disc.hook_note if overlap else "off (ResidencyOptions.overlap_restore)"
        if overlap and vulkan:
            self.overlap_note = (
                "Vulkan: restores stay synchronous (ggml-vulkan's uploads and graph computes from two "
                "threads are not checked to be safe, and its graphs cannot be reset: "
                "see context.forget_graphs)"
            )
        #: the uploads of the restore in progress: its gate (overlapped), its parts' uploads
        self.uploads = Uploads(self.layout)
        #: weight tensors the warm-up graph showed, and the names of those found in the model's
        #: tensor lists instead (residency/discovery.complete_from_tensor_lists)
        self.n_weight_tensors_seen = len(disc.weights) - len(disc.listed)
        self.weights_listed = list(disc.listed)
        originals = plan_buffers(disc, self.layout, gpu)
        self._attach_steps = {
            "discover_ms": (t1 - t0) * 1000.0,
            "plan_ms": (time.perf_counter() - t1) * 1000.0,
        }
        #: the model's own weight buffers; with parts > 1 they are emptied by split()
        self.originals = originals
        self.parts_note = ""  # why fewer layer parts than asked for, when so
        if parts > 1 and disc.weight_views and any(b.buft_name.startswith("Vulkan") for b in originals):
            # the split moves the weights without resetting the graphs on Vulkan (see
            # Residency._split): a reused graph's view of a weight would still name the old buffer
            self.parts_note = (
                f"the graphs view the weights ({disc.weight_views} view(s)) and graphs cannot be reset "
                "on Vulkan after the weights move: whole buffers are released"
            )
            parts = 1
        split = split_plan(originals, parts) if parts > 1 else None
        if isinstance(split, str):
            self.parts_note, split = split, None
        if split is not None:
            self.parts, self.buffers = split
        else:
            parts = 1
            self.buffers = originals
            layers = [x for b in originals for t in b.tensors if (x := layer_of(t.name)) is not None]
            self.parts = [Part(0, min(layers, default=0), max(layers, default=0), list(originals))]
        #: split() has still to move the weights into the part buffers
        self.split_pending = parts > 1
        self.backend = backend_name(self.buffers, gpu)
        self.weight_bytes = sum(b.size for b in self.buffers)
        self.tensor_bytes = sum(t.nbytes for b in self.buffers for t in b.tensors)
        #: the split waits for the first release, which frees the model's own buffers and leaves
        #: every part released (the next restore allocates and fills them): no device copy at
        #: attach, and the shadow may be deferred; that first release is whole
        self.split_at_release = split_at_release and self.split_pending
        eager_split = self.split_pending and not self.split_at_release
        #: the GGUF bytes of the released weights in host memory; a deferred shadow is built in
        #: slices of at most shadow_slice_bytes
        self.host_shadow = Shadow(
            model_path,
            file_id,
            self.buffers,
            self.layout,
            gpu,
            want_pinned=want_pinned,
            verify=verify,
            coalesce=coalesce,
            slice_bytes=shadow_slice_bytes if defer_shadow and not eager_split else None,
        )
        #: device memory handed over between workers (issue 40)
        self.handover = WeightHandover()
        #: the handed-over buffers the last restore's uploads are filling (finish_uploads)
        self._filling: list[WeightBuffer] = []
        #: the buffers' swaps: the placeholders to free at the next release, whether one moved
        self.swaps = Swaps(self.layout, self.buffers, parallel, self.handover)
        if handed is not None:
            self.handover.setup(handed, self.buffers, self.swaps.parallel, owner=owns_handed)
        if not defer_shadow or eager_split:  # split() uploads the parts from the shadow
            self.host_shadow.fill()

    # -- shadow: residency/shadow.py -----------------------------------------------------------

    @property
    def shadow(self) -> HostMemory:
        """The host shadow, filled now (all of its slices) if it was deferred (Shadow.memory)."""
        return self.host_shadow.memory

    def pin_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        """Pin the segments of the host shadow a release made pageable (Shadow.pin), once the
        uploads that read them are over. True when none is left."""
        if self.host_shadow.pending:
            return True
        self.finish_uploads()  # pinning replaces the segments the uploads read from
        return self.host_shadow.pin(stop)

    @property
    def attach_steps(self) -> dict[str, float]:
        """Milliseconds of attach's steps (discover, plan) and of the shadow's (alloc, read,
        verify, pin)."""
        return {**self._attach_steps, **self.host_shadow.steps}

    # -- layer parts --------------------------------------------------------------------------

    def split(self, restore: bool = True) -> None:
        """Move the weights from the model's own buffers into the part buffers (parts > 1; once,
        at attach): make each part buffer's struct (holding a placeholder), free the model's
        buffers' memory (their structs keep a placeholder), then restore every part from the
        shadow. Raises OutOfDeviceMemoryError with every part released (the model stays
        released: restore() later), ResidencyError when a placeholder cannot be made (nothing
        changed)."""
        if not self.split_pending:
            return
        self.swaps.make_part_buffers(self.buffers)
        for o in self.originals:
            self.swaps.free(o)  # the model's struct keeps the placeholder, freed at its close
        self.split_pending = False
        if restore:
            self.restore()

    def part_buffers(self) -> list[int]:
        """The part buffers' structs (parts > 1): whoever closes the model frees them with it."""
        return [b.ptr for b in self.buffers if b.owned and b.ptr]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident parts' buffers (``ggml_backend_buffer_get_size``, padding in);
        all of them while a split waits for the first release (the model's own buffers hold the
        weights)."""
        if self.split_pending:
            return self.weight_bytes
        return sum(p.bytes for p in self.parts if p.resident)

    @property
    def resident_padding_bytes(self) -> int:
        """Device memory the resident parts hold beyond :attr:`resident_bytes`: with handed-over
        memory, the unused part of each buffer's last chunk (0 otherwise, and while a split waits
        for the first release: the model's own buffers are ggml's)."""
        if self.split_pending:
            return 0
        return self.handover.padding([b for p in self.parts if p.resident for b in p.buffers])

    def _held(self, p: Part) -> int:
        """The device memory part ``p`` holds while resident (its bytes, and its padding)."""
        return p.bytes + self.handover.padding(p.buffers)

    def parts_to_release(self, keep_bytes: int | None) -> list[Part]:
        """The resident parts a release down to ``keep_bytes`` frees, from the last layer down
        (all of them for None; all, or none when ``keep_bytes`` covers the model, while a split
        waits for the first release). ``keep_bytes`` counts the device memory the parts hold:
        with handed-over memory, the padding of their last chunks too (what a lease covers)."""
        if self.split_pending:
            return list(reversed(self.parts)) if keep_bytes is None or keep_bytes < self.weight_bytes else []
        resident = self.resident_bytes + self.resident_padding_bytes
        out: list[Part] = []
        for p in reversed(self.parts):
            if keep_bytes is not None and resident <= keep_bytes:
                break
            if p.resident:
                out.append(p)
                resident -= self._held(p)
        return out

    # -- release / restore --------------------------------------------------------------------

    def release(self, keep_bytes: int | None = None, final: bool = False) -> int:
        """Release parts from the last layer down until at most ``keep_bytes`` stay resident (all
        with None); returns the bytes released. A placeholder that cannot be made: what this
        call released is restored again and ResidencyError raised. ``final``: never restored
        (the process is ending), so a deferred shadow is not checked against the file."""
        self.finish_uploads()  # an overlapped restore's uploads are over before anything is freed
        self.swaps.free_spent()  # the last restore's placeholders (kept out of its time)
        if not final:
            # a deferred shadow's slices not built yet: checked against the file, which they are
            # read from later -- nothing is released that could not come back
            self.host_shadow.check_pending()
        t0 = time.perf_counter()
        if self.split_pending:  # split_at_release: the model's buffers go, every part is released
            if not self.parts_to_release(keep_bytes):
                return 0
            self.split(restore=False)
            self.release_steps = ReleaseSteps(
                (time.perf_counter() - t0) * 1000, len(self.originals), len(self.parts)
            )
            return self.weight_bytes
        chosen = self.parts_to_release(keep_bytes)
        todo = [b for p in chosen for b in p.buffers if not b.released]
        done: list[WeightBuffer] = []
        try:
            if self.swaps.parallel:
                held: list[int] = []
                try:
                    for b in todo:
                        held.append(self.swaps.detach(b))
                        done.append(b)
                finally:  # what was detached is freed, also when a placeholder failed
                    list(self.swaps.pool().map(_ggml.buffer_free, held))
            else:
                try:
                    for b in todo:
                        self.swaps.free(b)
                        done.append(b)
                finally:
                    self.handover.unmap(keep=not final)
        except ResidencyError:
            self._restore(done)  # undo this call: the lease still covers those bytes
            raise
        self.release_steps = ReleaseSteps((time.perf_counter() - t0) * 1000, len(todo), len(chosen))
        return sum(b.size for b in done)

    def restore(self, overlap: bool = False, kv: KvUpload | None = None, later: int = 0) -> int:
        """Restore every released buffer (parts in layer order); on an allocation failure,
        release again what this call restored and raise OutOfDeviceMemoryError (the model stays
        as released as it was, and intact). Returns the bytes uploaded. ``swaps.moved`` then says
        whether any buffer came back at another address than before.

        Each part's upload runs on the upload thread as soon as its buffers are allocated, so the
        copies overlap the allocations that follow (in parallel mode every buffer is allocated at
        once on the pool's threads and each is uploaded as soon as its allocation is back).

        ``overlap`` (with at least two parts to restore and a usable eval hook): allocate every
        buffer, point its tensors into it and return with the uploads running (the first since
        the first part's allocation); ``uploads.gate`` holds the parts' readiness (made before the
        first upload) and :meth:`finish_uploads` waits for them (anything but a gated decode
        calls it first). Every buffer is allocated before this returns: the caller decides from
        ``swaps.moved`` whether the graphs must be rebuilt, and a graph's views of a weight take their
        data pointer when the graph is allocated, so no address may change after the decode
        started.

        ``kv``: the KV cache's cells of the deep level (its buffers already allocated), written
        on the upload thread right after the weights of each part, the layers of that part (the
        gate waits for them too); the layers of no part restored here are left to the caller
        (``kv.upload_unclaimed``).

        ``later``: the bytes the caller allocates on the device after the weights (a deep
        restore's new context, a projector): handed-over memory does not count them as room to
        create chunks in (WeightHandover.map)."""
        self.finish_uploads()
        self.uploads.kv = kv
        try:
            return self._restore([b for b in self.buffers if b.released], overlap, later)
        finally:
            self.uploads.kv = None

    def _part_groups(self, todo: list[WeightBuffer]) -> list[tuple[Part, list[WeightBuffer]]]:
        mine = {id(b) for b in todo}
        groups = [(p, [b for b in p.buffers if id(b) in mine]) for p in self.parts]
        return [(p, bufs) for p, bufs in groups if bufs]

    def _restore(self, todo: list[WeightBuffer], overlap: bool = False, later: int = 0) -> int:
        """Allocate and relocate the buffers of ``todo`` part by part in layer order, each part's
        upload submitted to the upload thread as soon as its buffers are in place (the copies
        overlap the allocations that follow, overlapped or not: the copy engine starts after the
        first part's allocation, not after the last one's). Overlapped (``background``): the
        gate exists before the first upload is submitted (an upload marks its part ready there)
        and this returns with the uploads running; synchronous: it waits for them."""
        self.uploads.started = t_start = time.perf_counter()
        self.swaps.moved = False
        if self.swaps.parallel:
            nbytes, self.restore_steps = restore_parallel(todo, self.swaps, lambda: self.shadow, t_start)
            return nbytes
        groups = self._part_groups(todo)
        shadow = self.shadow
        self.uploads.begin()
        self._filling = []
        done: list[WeightBuffer] = []
        first_alloc_s = alloc_max_s = 0.0
        held: list[tuple[Part, list[WeightBuffer]]] = []
        try:
            handed = self.handover.map(todo, later)
        except OutOfDeviceMemoryError:
            self.uploads.gate = None
            raise
        # buffers whose kept handed memory still holds their bytes: not uploaded (their part is
        # ready as soon as the rest of it is); with nothing to copy at all the restore stays
        # synchronous (no gate for the next decode to ask)
        skip = frozenset(self.handover.intact(todo, handed))
        copies = len(skip) < len(todo) or self.uploads.kv is not None
        background = overlap and self.hook is not None and len(groups) >= 2 and copies
        gate = self.uploads.make_gate(groups) if background else None
        for part, bufs in groups:
            for b in bufs:
                t_a = time.perf_counter()
                new = self.handover.new_buffer(b, handed)
                if new is None:
                    # the uploads submitted so far end first (they write into buffers given back now)
                    _copy_s, _error = self.uploads.wait()
                    self.uploads.gate = None
                    self.swaps.free_spent()
                    for d in done:
                        self.swaps.free(d)
                    self.handover.unmap_unused(handed, todo, done)  # mapped, never carried
                    raise out_of_memory(b, todo)
                alloc_max_s = max(alloc_max_s, time.perf_counter() - t_a)
                self.swaps.keep_spent(self.swaps.relocate(b, new))
                done.append(b)
            if not first_alloc_s:
                first_alloc_s = time.perf_counter() - t_start
            held.append((part, bufs))
            self.uploads.submit(held, shadow, gate, skip)
        alloc_s = time.perf_counter() - t_start
        nbytes = sum(t.nbytes for b in done if id(b) not in skip for t in b.tensors)
        skipped = sum(t.nbytes for b in done if id(b) in skip for t in b.tensors)
        self.handover.skipped_bytes += skipped
        #: filled once their uploads end without error (finish_uploads)
        self._filling = [b for b in done if id(b) not in skip]
        self.restore_steps = {
            "alloc_ms": alloc_s * 1000,  # allocation and relocation (the copies run meanwhile)
            # before the first copy could start: the first part's allocation and relocation
            "first_alloc_ms": first_alloc_s * 1000,
            "alloc_max_ms": alloc_max_s * 1000,  # the slowest single buffer allocation
            "copy_ms": 0.0,
            "wait_ms": 0.0,
            "total_ms": alloc_s * 1000,
            "buffers": len(done),
            "parts": len(groups),
            "overlapped": float(background),
        }
        if handed is not None:
            rep = handed.last
            self.restore_steps.update(
                handover_ms=rep.ms,
                handed_chunks=float(rep.handed),
                created_chunks=float(rep.created),
                creates_total=float(handed.device.creates),
                mapped_chunks=float(rep.mapped),
                kept_chunks=float(rep.kept),
                intact_chunks=float(rep.intact),
                uploaded_bytes=float(nbytes),
                skipped_upload_bytes=float(skipped),
                later_bytes=float(rep.later),
            )
            if rep.room is not None:
                self.restore_steps["room_bytes"] = float(rep.room)
        if background:
            assert gate is not None
            self.restore_steps["pending_bytes"] = float(gate.pending_bytes)
            return nbytes
        self.finish_uploads()
        return nbytes

    def finish_uploads(self) -> None:
        """Wait for the uploads of the last restore (Uploads.finish: their steps go into
        ``restore_steps``); a no-op when none is pending. Handed-over buffers whose uploads
        ended without error are filled then (WeightHandover.filled: a later restore into their
        kept memory need not upload them)."""
        filling, self._filling = self._filling, []
        self.uploads.finish(self.restore_steps)
        self.handover.filled(filling)

    def _moved_back(self, carried: list[WeightBuffer]) -> bool:
        """Restore ``carried`` (released) into ggml memory; True when a buffer moved."""
        self._restore(carried)
        return self.swaps.moved

    def close(self) -> None:
        try:
            self.finish_uploads()
            self.handover.give_back(self.buffers, self.finish_uploads, self.swaps.free, self._moved_back)
            self.swaps.free_spent()
        finally:
            self.uploads.close()
        self.swaps.close()
        self.host_shadow.close()
