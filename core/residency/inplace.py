"""The in-place path: free a loaded model's device weight buffers and put them back, in place.
Step 1 lives in residency/discovery.py, the plan's types and rules in residency/plan.py, the
reasons it is not used in residency/unsupported.py; the shadow, swaps and uploads are here.

1. discovery: a throwaway context with ``cb_eval`` runs one warm-up decode; every ``src`` of a graph
   node whose buffer is used for WEIGHTS is a weight tensor (views lead to their ``view_src``; the
   views themselves are the graph's own, freed with the throwaway context -- the live context's
   are built anew whenever a buffer moved, see residency._forget_graphs -- and never written);
2. plan: group by buffer, keep the buffers to release (device buffers; on a CPU-only build the host
   weight buffers of a model loaded without mmap) and check that the tensors found fill each
   buffer exactly as ggml-alloc laid it out -- a tensor the graph did not show would keep a
   dangling pointer, so an incomplete buffer refuses the in-place path;
3. host shadow: the GGUF file bytes of every released tensor (``set_tensor`` repacks them where the
   buffer type wants it), in pinned host memory, filled with parallel reads, spot-checked against
   the loaded weights; at attach, or (``defer_shadow``) later by :meth:`InPlace.fill_shadow`:
   pinning and reading a model's weights takes seconds on an 8B model, which a request waiting
   for a just-started worker need not wait for, nor another model whose turn makes this one
   release before its shadow is built (the release then spot-checks the slices left against the
   file, :meth:`InPlace.check_pending_shadow`, and they are read from the file afterwards);
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

import ctypes
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..devmem.device import ChunkDeviceError
from ..devmem.mapped import HandedMemory
from ..errors import ModelFileChangedError, ModelFileError, OutOfDeviceMemoryError, ResidencyError
from ..util.fileid import FileId
from . import _ggml
from .carrier import BaseSlot, Carried, make_carrier, probe_base_slot, uncarry
from .discovery import Discovery, discover
from .gate import PartGate
from .hostmem import HostMemory, ReadRange, parallel_read
from .kvupload import KvUpload
from .options import ResidencyOptions
from .plan import Part, WeightBuffer, WeightTensor, layer_of, pad, plain_copy, split_runs
from .unsupported import InPlaceUnsupportedError, NothingToReleaseError

log = logging.getLogger(__name__)

_PLACEHOLDER_BYTES = 64
_VERIFY_BYTES = 4096
#: buffer types whose bytes ggml_backend_tensor_get can read back unchanged (others repack).
#: Vulkan: the device buffers (VulkanN; Vulkan_Host buffers are host memory and never released)
#: hand out data pointers from the constant vk_ptr_base (0x1000) and find their VkBuffer through
#: the buffer's context at every use, so a swapped context is all a restored buffer needs.
_READABLE_BUFT_PREFIXES = ("CPU", "CUDA", "Vulkan")


@dataclass
class _ShadowBuild:
    """A host shadow under construction: its memory (segments allocated one slice at a time) and
    what each slice must do once allocated (zero the gaps, read the tensors, spot-check them)."""

    mem: HostMemory
    ranges: list[ReadRange]  # the file's bytes of every tensor, by shadow offset
    gaps: list[tuple[int, int]]  # (offset, length) of the alignment gaps and padding (zeros)
    tensors: list[tuple[WeightBuffer, WeightTensor]]  # the tensors to spot-check
    sliced: bool  # one segment per slice (deferred), or every segment in one slice
    #: a release came before the build was done: the tensors of the slices left were checked
    #: against the file then (the weights they would be compared with are gone now), and the file
    #: must still be this one when each of them is read
    from_file: FileId | None = None
    slices: int = 0  # slices built
    alloc_s: float = 0.0
    read_s: float = 0.0
    verify_s: float = 0.0


class InPlace:
    """Owns the plan, the host shadow and the buffer swaps of one model. Not thread-safe: the
    worker's loop thread is its only caller."""

    def __init__(
        self,
        llm: object,
        model_path: str,
        gpu: _ggml.Device | None,
        options: ResidencyOptions,
        overlap: bool = False,
        handed: HandedMemory | None = None,
        discovery: Discovery | None = None,
    ) -> None:
        """``overlap``: probe the eval hook an overlapped restore needs (Residency decides
        whether restores may overlap at all). ``handed``: restores map handed-over memory
        (issue 40) instead of allocating, releases unmap it (see :meth:`_setup_handover`).
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
        self._file_id = FileId.of(model_path)
        self._coalesce = coalesce
        self._gpu = gpu
        self._parallel_opt = parallel  # None: Vulkan buffers only (see _parallel)
        self._executor: ThreadPoolExecutor | None = None
        #: per-step times of the last release and restore, milliseconds (doctor reports them)
        self.release_steps: dict[str, float] = {}
        self.restore_steps: dict[str, float] = {}
        #: milliseconds of attach's steps (discover, plan) and of the shadow's (alloc, read, verify)
        self.attach_steps: dict[str, float] = {}
        self._whole_ctx = 0
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
                "threads are not checked to be safe, and its graphs cannot be reset: see _forget_graphs)"
            )
        #: the restore in progress: its gate (overlapped), its parts' uploads (futures), the
        #: placeholders to free at the next release
        self.gate: PartGate | None = None
        self._retired_gate: PartGate | None = None
        self._uploads: list[Future[float]] = []
        self._kv: KvUpload | None = None  # the KV cells a deep restore uploads with the parts
        #: (start, end) of each part's upload of the last restore, in order (the upload thread)
        self._upload_spans: list[tuple[float, float]] = []
        self._spent: list[int] = []
        self._uploader_pool: ThreadPoolExecutor | None = None
        self._restore_t0 = 0.0
        #: weight tensors the warm-up graph showed, and the names of those found in the model's
        #: tensor lists instead (residency/discovery.complete_from_tensor_lists)
        self.n_weight_tensors_seen = len(disc.weights) - len(disc.listed)
        self.weights_listed = list(disc.listed)
        originals = self._plan(disc, gpu)
        self.attach_steps = {
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
        split = self._split_plan(originals, parts) if parts > 1 else None
        if split is not None:
            self.parts, self.buffers = split
        else:
            parts = 1
            self.buffers = originals
            layers = [x for b in originals for t in b.tensors if (x := layer_of(t.name)) is not None]
            self.parts = [Part(0, min(layers, default=0), max(layers, default=0), list(originals))]
        #: split() has still to move the weights into the part buffers
        self.split_pending = parts > 1
        self.backend = self._backend_name(gpu)
        self.weight_bytes = sum(b.size for b in self.buffers)
        self.tensor_bytes = sum(t.nbytes for b in self.buffers for t in b.tensors)
        self._want_pinned = want_pinned
        self._verify = verify
        self._shadow: HostMemory | None = None
        self._build: _ShadowBuild | None = None
        #: a deferred shadow is built in slices of at most this many bytes
        #: the split waits for the first release, which frees the model's own buffers and leaves
        #: every part released (the next restore allocates and fills them): no device copy at
        #: attach, and the shadow may be deferred; that first release is whole
        self.split_at_release = split_at_release and self.split_pending
        eager_split = self.split_pending and not self.split_at_release
        self._slice_bytes = shadow_slice_bytes if defer_shadow and not eager_split else None
        self.shadow_note = ""
        self.verified_tensors = 0
        #: tensors of repacking buffers checked by repacking their file bytes (_verify_repacked)
        self.verified_repacked = 0
        self._shadow_slices = (0, 0)
        self.shadow_fill_s = 0.0
        self.moved = False  # the last restore put a buffer at another address than before
        #: device memory handed over between workers (issue 40): the mapped chunks (None: the
        #: buffers are allocated and freed through ggml), why not when not, each buffer type's
        #: base-pointer slot, the carriers of the buffers mapped now, buffers to unmap
        self.handed: HandedMemory | None = None
        self.handover_note = "not asked for (ResidencyOptions.handover, arena.handover)"
        self._slots: dict[int, BaseSlot] = {}
        self._carried: dict[int, Carried] = {}
        self._unmap_after: list[int] = []
        #: close() moved resident handed buffers into ggml memory at other addresses (graphs stale)
        self.moved_at_close = False
        if handed is not None:
            self._setup_handover(handed)
        if not defer_shadow or eager_split:  # split() uploads the parts from the shadow
            self.fill_shadow()

    # -- shadow -------------------------------------------------------------------------------

    @property
    def shadow_pending(self) -> bool:
        """The host shadow is deferred and not filled yet (see :meth:`fill_shadow`)."""
        return self._shadow is None

    @property
    def shadow_from_file(self) -> bool:
        """A release came while the shadow was pending: its slices left are read from the file
        alone (:meth:`check_pending_shadow`)."""
        return self._build is not None and self._build.from_file is not None

    @property
    def shadow(self) -> HostMemory:
        """The host shadow, filled now (all of its slices) if it was deferred: a restore cannot
        wait for seconds of pinning, so the slices left go to pageable memory (pinned later by
        :meth:`pin_shadow`)."""
        mem = self.fill_shadow(pin=False)
        assert mem is not None  # no stop: built to the end
        return mem

    @property
    def shadow_slices(self) -> tuple[int, int]:
        """(built, total) slices of the host shadow: (0, 0) before its build started."""
        if self._build is not None:
            return self._build.slices, self._build.mem.n_segments
        if self._shadow is not None:
            return self._shadow_slices
        return 0, 0

    def fill_shadow(self, stop: Callable[[], bool] | None = None, pin: bool = True) -> HostMemory | None:
        """Allocate the host shadow, fill it from the file and spot-check it against the loaded
        weights (which must be resident: nothing is released before the shadow exists); once. A
        deferred shadow is built in slices (``shadow_slice_bytes`` each: allocation, read, spot
        check); ``stop`` is asked after each slice, and True leaves the rest for a later call
        (returns None then; the shadow stays pending). ``pin`` False (a release that cannot wait
        for the pinning, seconds on an 8B model): the slices left go to pageable memory, pinned
        later by :meth:`pin_shadow`. A file that no longer holds the loaded weights raises
        ModelFileError and leaves no shadow (a later call starts again). After a release
        (:meth:`check_pending_shadow`) the slices left are read from the file alone, which must
        still be the one checked then (ModelFileError otherwise, the shadow still pending)."""
        if self._shadow is not None:
            return self._shadow
        build = self._build
        try:
            if build is None:
                self.verified_tensors = self.verified_repacked = 0
                build = self._build = self._plan_shadow(self._want_pinned)
            while not build.mem.complete:
                self._build_slice(build, pin)
                if not build.mem.complete and stop is not None and stop():
                    return None
        except ModelFileError:
            if build is not None and build.from_file is not None:
                raise  # the weights are released: what was built stays (the file may come back)
            self._build = None
            if build is not None:
                build.mem.close()
            raise
        except BaseException:
            self._build = None
            if build is not None:
                build.mem.close()
            raise
        self._build = None
        mem = build.mem
        self._shadow = mem
        self._shadow_slices = (build.slices, build.mem.n_segments)
        self.attach_steps["shadow_alloc_ms"] = build.alloc_s * 1000.0
        self.attach_steps["shadow_read_ms"] = build.read_s * 1000.0
        self.attach_steps["verify_ms"] = build.verify_s * 1000.0
        self.shadow_fill_s = build.read_s
        self.shadow_note = mem.note
        log.info(
            "host shadow: %.1f MB, read in %.3f s (%.2f GB/s), %d allocation(s) in %d slice(s), pinned=%s",
            mem.size / 1e6,
            build.read_s,
            mem.size / 1e9 / max(build.read_s, 1e-9),
            len(mem.segments),
            build.slices,
            mem.pinned,
        )
        return mem

    @property
    def shadow_to_pin(self) -> int:
        """Segments of a complete shadow that a release made pageable, still to be pinned."""
        return self._shadow.to_pin if self._shadow is not None else 0

    def pin_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        """Pin the segments a release made pageable, one per step (allocation and copy; the
        shadow stays complete throughout, so nothing ever waits for this); ``stop`` is asked
        after each. True when none is left."""
        mem = self._shadow
        if mem is None:
            return True
        self.finish_uploads()  # pinning replaces the segments the uploads read from
        t0 = time.perf_counter()
        while mem.pin_next():
            if mem.to_pin and stop is not None and stop():
                break
        self.attach_steps["shadow_pin_ms"] = (
            self.attach_steps.get("shadow_pin_ms", 0.0) + (time.perf_counter() - t0) * 1000.0
        )
        self.shadow_note = mem.note
        return mem.to_pin == 0

    # -- plan ---------------------------------------------------------------------------------

    def _plan(self, disc: Discovery, gpu: _ggml.Device | None) -> list[WeightBuffer]:
        lay = self.layout
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
            self._check_complete(b)
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

    def _split_plan(
        self, originals: list[WeightBuffer], n: int
    ) -> tuple[list[Part], list[WeightBuffer]] | None:
        """Up to ``n`` parts of consecutive layers with near-equal bytes (the tensors outside the
        layers count with the first layer), and their buffers: one per part and original buffer
        holding any of its tensors, laid out as ggml-alloc lays out a buffer (each tensor at an
        aligned offset, its allocation size padded to the alignment). None (``parts_note`` says
        why) when the weights make fewer than two parts."""
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
            self.parts_note = f"{len(layers)} blk.<i> layer(s) among the weights: released whole"
            return None
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
                mine = sorted(
                    (t for t in o.tensors if part_index(t.name) == part.index), key=lambda x: x.offset
                )
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

    def _check_complete(self, b: WeightBuffer) -> None:
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

    def _backend_name(self, gpu: _ggml.Device | None) -> str:
        if gpu is None:
            return "CPU"
        for b in self.buffers:
            dev = _ggml.buft_get_device(b.buft)
            if dev:
                raw = _ggml.dev_name(dev)
                if raw:
                    return str(raw.decode())
        return gpu.name

    # the shadow's allocation and read (fill_shadow above)

    def _plan_shadow(self, want_pinned: bool) -> _ShadowBuild:
        """Lay the shadow out (each tensor's place in it and in the file) and plan its host
        memory's segments, allocating none yet: per buffer (a mirrored buffer uploads in one copy
        per segment), or, for a deferred shadow, per slice of at most ``_slice_bytes`` cut at
        tensor boundaries."""
        meta = _ggml.gguf_open_meta(self.path)
        if meta is None:
            raise ModelFileError(f"{self.path} is not a readable GGUF file: re-download it")
        try:
            data_off = int(_ggml.gguf_get_data_offset(meta))
            file_size = os.path.getsize(self.path)
            ranges: list[ReadRange] = []
            parts: list[int] = []  # the shadow of each buffer: no upload or read straddles two
            units: list[int] = []  # each tensor's span: no read or spot check straddles two
            offset = 0
            for b in self.buffers:
                b.mirror = self._coalesce and plain_copy(b.buft_name)
                b.shadow_base = offset
                for t in b.tensors:
                    tid = int(_ggml.gguf_find_tensor(meta, t.name.encode()))
                    if tid < 0:
                        raise InPlaceUnsupportedError(
                            f"tensor {t.name} of the loaded model is not in {self.path}"
                        )
                    size = int(_ggml.gguf_get_tensor_size(meta, tid))
                    if size != t.nbytes:
                        raise InPlaceUnsupportedError(
                            f"tensor {t.name} has {t.nbytes} bytes in the model but {size} in the file "
                            "(converted at load time)"
                        )
                    src = data_off + int(_ggml.gguf_get_tensor_offset(meta, tid))
                    if src + size > file_size:
                        raise ModelFileError(
                            f"{self.path} is truncated: tensor {t.name} ends at byte {src + size} but "
                            f"the file has {file_size} bytes; re-download it"
                        )
                    if b.mirror:
                        t.shadow_offset = b.shadow_base + t.offset
                    else:
                        t.shadow_offset = offset
                        offset += size
                        units.append(size)
                    ranges.append(ReadRange(src, t.shadow_offset, size))
                if b.mirror:
                    offset = b.shadow_base + b.size
                    cuts = sorted({0, *(t.offset for t in b.tensors if 0 < t.offset < b.size)})
                    units.extend(hi - lo for lo, hi in zip(cuts, [*cuts[1:], b.size], strict=True))
                parts.append(offset - b.shadow_base)
        finally:
            _ggml.gguf_free(meta)
        gaps: list[tuple[int, int]] = []
        for b in self.buffers:  # alignment gaps and padding of a mirrored buffer upload as zeros
            if b.mirror:
                pos = 0
                for t in sorted(b.tensors, key=lambda x: x.offset):
                    if t.offset > pos:
                        gaps.append((b.shadow_base + pos, t.offset - pos))
                    pos = max(pos, t.offset + t.nbytes)
                if b.size > pos:
                    gaps.append((b.shadow_base + pos, b.size - pos))
        sliced = self._slice_bytes is not None
        mem = HostMemory(
            offset,
            want_pinned,
            units if sliced else parts,
            self._gpu,
            max_segment=self._slice_bytes,
            lazy=True,
        )
        try:
            if not self._whole_ctx:
                self._make_whole_tensors()
        except BaseException:
            mem.close()
            raise
        verify: list[tuple[WeightBuffer, WeightTensor]] = []
        if self._verify:
            for b in self.buffers:
                if not b.buft_name.endswith("_REPACK"):
                    verify.extend((b, t) for t in b.tensors)
                elif b.tensors:  # repacking its file bytes costs a scratch copy: its first and last
                    by_offset = sorted(b.tensors, key=lambda x: x.offset)
                    verify.extend((b, t) for t in {id(x): x for x in (by_offset[0], by_offset[-1])}.values())
        return _ShadowBuild(mem, sorted(ranges, key=lambda r: r.mem_offset), gaps, verify, sliced)

    def check_pending_shadow(self) -> int:
        """Before a release that comes while the host shadow is still to be built (deferred, maybe
        half built): spot-check the tensors of the slices not built yet against the file -- the
        first and last bytes of each, read from the file and from the loaded weights -- so that
        they can be read from the file alone later (idle, or by the next restore), rather than
        before this release (seconds of reading and pinning an 8B model that the model asking for
        the GPU would wait for). Returns the tensors checked (0: no shadow pending). Raises
        ModelFileError when the file no longer holds the loaded weights (nothing changed: the
        release must not go on)."""
        if self._shadow is not None:
            return 0
        build = self._build
        if build is None:
            self.verified_tensors = self.verified_repacked = 0
            build = self._build = self._plan_shadow(self._want_pinned)
        if build.from_file is not None:
            return 0
        try:
            file_id = FileId.of(self.path)
        except OSError as exc:
            raise ModelFileError(f"{self.path} is gone ({exc.strerror}): restart the model") from exc
        lo = build.mem.allocated_end
        # (a repacking buffer cannot read its tensors back as file bytes: its spot check needs
        # the shadow, see _verify_repacked)
        left = [
            (b, t) for b, t in build.tensors if t.shadow_offset >= lo and not b.buft_name.endswith("_REPACK")
        ]
        src = {r.mem_offset: r.file_offset for r in build.ranges}
        t0 = time.perf_counter()
        if file_id != self._file_id:
            raise self._changed(left[0][1].name if left else "?")
        scratch = (ctypes.c_char * _VERIFY_BYTES)()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise ModelFileError(f"cannot read the weights of {self.path}: {exc}") from exc
        try:
            for _b, t in left:
                n = min(_VERIFY_BYTES, t.nbytes)
                for off in {0, t.nbytes - n}:
                    _ggml.tensor_get(t.ptr, scratch, off, n)
                    if ctypes.string_at(scratch, n) != os.pread(fd, n, src[t.shadow_offset] + off):
                        raise self._changed(t.name)
        except OSError as exc:
            raise ModelFileError(f"cannot read the weights of {self.path}: {exc}") from exc
        finally:
            os.close(fd)
        build.verify_s += time.perf_counter() - t0
        self.verified_tensors += len(left)
        build.tensors = [(b, t) for b, t in build.tensors if t.shadow_offset < lo]
        build.from_file = file_id
        return len(left)

    def _changed(self, name: str) -> ModelFileError:
        return ModelFileError(
            f"{self.path} no longer holds the weights the model was loaded from "
            f"(tensor {name} differs): the file was replaced or modified after loading; "
            "restart the model"
        )

    def _build_slice(self, build: _ShadowBuild, pin: bool = True) -> None:
        """Allocate the next slice's segment (all of them, unsliced), zero its gaps, read its
        tensors from the file and spot-check them against the loaded weights (after a release:
        check that the file is still the one they were checked against then)."""
        mem = build.mem
        if build.from_file is not None:
            try:
                same = FileId.of(self.path) == build.from_file
            except OSError:
                same = False
            if not same:
                raise ModelFileChangedError(
                    f"{self.path} was replaced or modified after the model was loaded, and its "
                    "released weights were to be read from it: restart the model"
                )
        t0 = time.perf_counter()
        spans: list[tuple[int, int]] = []
        while (got := mem.allocate_next(pin)) is not None:
            spans.append(got)
            if build.sliced:
                break
        lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
        t1 = time.perf_counter()
        build.alloc_s += t1 - t0
        for off, n in build.gaps:
            if lo <= off < hi:
                ctypes.memset(mem.address(off, n), 0, n)
        mine = [r for r in build.ranges if lo <= r.mem_offset < hi]
        try:
            parallel_read(self.path, mem, sorted(mine, key=lambda r: r.file_offset))
        except (OSError, EOFError) as exc:
            raise ModelFileError(f"cannot read the weights of {self.path}: {exc}") from exc
        t2 = time.perf_counter()
        build.read_s += t2 - t1
        self.verified_tensors += self._verify_tensors(
            mem, [(b, t) for b, t in build.tensors if lo <= t.shadow_offset < hi]
        )
        build.verify_s += time.perf_counter() - t2
        build.slices += 1

    def _make_whole_tensors(self) -> None:
        mirrored = [b for b in self.buffers if b.mirror]
        if not mirrored:
            return
        ctx = _ggml.ggml_init(_ggml.GgmlInitParams(len(mirrored) * 1024 + 4096, None, True))
        if not ctx:
            raise InPlaceUnsupportedError("ggml_init failed")
        self._whole_ctx = int(ctx)
        for b in mirrored:
            b.whole = int(_ggml.ggml_new_tensor_1d(ctx, _ggml.GGML_TYPE_I8, b.size))

    def _verify_tensors(self, mem: HostMemory, tensors: list[tuple[WeightBuffer, WeightTensor]]) -> int:
        """Compare the first and last bytes of each of ``tensors`` (readable ones: repacked
        layouts cannot be read back as file bytes) with the shadow: the file on disk must still
        be the one the model was loaded from."""
        checked = 0
        scratch = (ctypes.c_char * _VERIFY_BYTES)()
        for b, t in tensors:
            if b.buft_name.endswith("_REPACK"):  # counted apart: only a few of them are checked
                self._verify_repacked(b, t, mem)
                self.verified_repacked += 1
                continue
            n = min(_VERIFY_BYTES, t.nbytes)
            for off in {0, t.nbytes - n}:
                _ggml.tensor_get(t.ptr, scratch, off, n)
                if ctypes.string_at(scratch, n) != ctypes.string_at(mem.address(t.shadow_offset + off, n), n):
                    raise self._changed(t.name)
            checked += 1
        return checked

    def _verify_repacked(self, b: WeightBuffer, t: WeightTensor, mem: HostMemory) -> None:
        """A tensor of a repacking buffer (CPU_REPACK: its bytes are not the file's, and the
        buffer cannot read them back): repack its file bytes from the shadow into a scratch tensor
        of the same type, shape and buffer type, and compare the first and last bytes of both
        (host memory, read directly)."""
        lay = self.layout
        ne = (ctypes.c_int64 * 4)(
            *(ctypes.c_int64.from_address(t.ptr + lay.ne + 8 * i).value for i in range(4))
        )
        gtype = ctypes.c_int32.from_address(t.ptr).value  # ggml_tensor.type: the first field
        ctx = _ggml.ggml_init(_ggml.GgmlInitParams(int(_ggml.ggml_tensor_overhead()) * 2 + 256, None, True))
        if not ctx:
            raise InPlaceUnsupportedError("ggml_init failed")
        buf = 0
        try:
            copy = _ggml.ggml_new_tensor(ctx, gtype, 4, ne)
            buf = int(_ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, b.buft) or 0)
            if not copy or not buf or int(_ggml.ggml_nbytes(copy)) != t.nbytes:
                raise InPlaceUnsupportedError(
                    f"cannot make a {b.buft_name} scratch copy of {t.name} to check it"
                )
            _ggml.tensor_set(copy, mem.address(t.shadow_offset, t.nbytes), 0, t.nbytes)
            mine, loaded = _ggml.read_ptr(copy + lay.data), _ggml.read_ptr(t.ptr + lay.data)
            n = min(_VERIFY_BYTES, t.nbytes)
            for off in {0, t.nbytes - n}:
                if ctypes.string_at(mine + off, n) != ctypes.string_at(loaded + off, n):
                    raise self._changed(t.name)
        finally:
            if buf:
                _ggml.buffer_free(buf)
            _ggml.ggml_free(ctx)

    # -- handed-over memory (issue 40) --------------------------------------------------------

    def _setup_handover(self, handed: HandedMemory) -> None:
        """Use ``handed`` for every weight buffer, or for none (``handover_note`` says why)."""
        if self._parallel():
            self.handover_note = (
                "the buffers are allocated on several threads (Vulkan): its hand-over is "
                "VK_KHR_external_memory_fd, not built yet"
            )
            return
        slots: dict[int, BaseSlot] = {}
        for b in self.buffers:
            if b.buft in slots:
                continue
            assert b.layout is not None
            try:
                slots[b.buft] = probe_base_slot(b.buft, b.layout)
            except _ggml.LayoutMismatchError as exc:
                self.handover_note = str(exc)
                return
        self._slots = slots
        self.handed = handed
        self.handover_note = ""

    def handover_stats(self) -> dict[str, object]:
        """What the hand-over did (doctor, bench residency, the worker's status)."""
        h = self.handed
        out: dict[str, object] = {"on": h is not None, "note": self.handover_note}
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
                maps=h.device.maps,
                unmaps=h.device.unmaps,
                last_mapped_chunks=h.last.mapped,
                lease_padding_bytes=sum(h.chunks_for(b.size) * h.chunk_bytes - b.size for b in self.buffers),
                source_note=h.source_note,
            )
        return out

    def _unmap_handed(self, keep: bool = True) -> None:
        """Unmap the buffers whose carriers went (their chunks go back to the holder)."""
        keys, self._unmap_after = self._unmap_after, []
        if keys and self.handed is not None:
            self.handed.unmap(keys, keep=keep)

    # -- release / restore --------------------------------------------------------------------

    def _swap(self, a: int, b: int, lay: _ggml.BufferLayout) -> None:
        ca, cb = _ggml.read_ptr(a + lay.context), _ggml.read_ptr(b + lay.context)
        sa, sb = _ggml.read_size(a + lay.size), _ggml.read_size(b + lay.size)
        _ggml.write_ptr(a + lay.context, cb)
        _ggml.write_ptr(b + lay.context, ca)
        _ggml.write_size(a + lay.size, sb)
        _ggml.write_size(b + lay.size, sa)

    def _parallel(self) -> bool:
        """Allocate and free the weight buffers on several threads: Vulkan, where each
        vkAllocateMemory / vkFreeMemory costs time in proportion to its size (about 20 ms per GiB
        on the H200's driver), so the uploads overlap the allocations that follow them (restore
        191 -> 177 ms there, release 100 -> 90 ms: docs/lab/HISTORY.md); never on CUDA (unchanged)."""
        if self._parallel_opt is not None:
            return self._parallel_opt and len(self.buffers) > 1
        return len(self.buffers) > 1 and all(b.buft_name.startswith("Vulkan") for b in self.buffers)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=min(8, len(self.buffers)), thread_name_prefix="residency-buffers"
            )
        return self._executor

    def _detach_buffer(self, b: WeightBuffer) -> int:
        """Swap ``b`` with a tiny placeholder; returns the placeholder, which now owns the weights'
        memory (freeing it frees them)."""
        assert b.layout is not None
        placeholder = _ggml.buft_alloc_buffer(b.buft, _PLACEHOLDER_BYTES)
        if placeholder is None:
            raise ResidencyError(
                f"cannot allocate a {_PLACEHOLDER_BYTES}-byte {b.buft_name} placeholder buffer: "
                "the model was not released"
            )
        self._swap(b.ptr, placeholder, b.layout)
        b.released = True
        carried = self._carried.pop(id(b), None)
        if carried is not None:  # the placeholder holds the carrier's context: its own pointer back
            uncarry(placeholder, b.layout, self._slots[b.buft], carried)
            self._unmap_after.append(id(b))
        return placeholder

    def _release_buffer(self, b: WeightBuffer) -> None:
        _ggml.buffer_free(self._detach_buffer(b))  # frees the weights' memory

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
        made: list[WeightBuffer] = []

        def unmake() -> None:
            for m in made:
                _ggml.buffer_free(m.ptr)
                m.ptr = 0

        for b in self.buffers:
            ph = _ggml.buft_alloc_buffer(b.buft, _PLACEHOLDER_BYTES)
            if ph is None:
                unmake()
                raise ResidencyError(
                    f"cannot allocate a {_PLACEHOLDER_BYTES}-byte {b.buft_name} buffer for a layer part: "
                    "the model keeps its own buffers"
                )
            b.ptr = ph
            made.append(b)
            _ggml.buffer_set_usage(ph, _ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)  # the scheduler's rules
            assert b.layout is not None
            if _ggml.read_size(ph + b.layout.size) != _PLACEHOLDER_BYTES:
                unmake()
                raise ResidencyError(
                    f"a fresh {b.buft_name} buffer's size field is not where the probe found it: "
                    "the model keeps its own buffers"
                )
        for o in self.originals:
            self._release_buffer(o)  # the model's struct keeps the placeholder, freed at its close
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

    def parts_to_release(self, keep_bytes: int | None) -> list[Part]:
        """The resident parts a release down to ``keep_bytes`` frees, from the last layer down
        (all of them for None; all, or none when ``keep_bytes`` covers the model, while a split
        waits for the first release)."""
        if self.split_pending:
            return list(reversed(self.parts)) if keep_bytes is None or keep_bytes < self.weight_bytes else []
        resident = self.resident_bytes
        out: list[Part] = []
        for p in reversed(self.parts):
            if keep_bytes is not None and resident <= keep_bytes:
                break
            if p.resident:
                out.append(p)
                resident -= p.bytes
        return out

    def release(self, keep_bytes: int | None = None, final: bool = False) -> int:
        """Release parts from the last layer down until at most ``keep_bytes`` stay resident (all
        with None); returns the bytes released. A placeholder that cannot be made: what this
        call released is restored again and ResidencyError raised. ``final``: never restored
        (the process is ending), so a deferred shadow is not checked against the file."""
        self.finish_uploads()  # an overlapped restore's uploads are over before anything is freed
        self._free_spent()  # the last restore's placeholders (kept out of its time)
        if not final:
            # a deferred shadow's slices not built yet: checked against the file, which they are
            # read from later -- nothing is released that could not come back
            self.check_pending_shadow()
        t0 = time.perf_counter()
        if self.split_pending:  # split_at_release: the model's buffers go, every part is released
            if not self.parts_to_release(keep_bytes):
                return 0
            self.split(restore=False)
            self.release_steps = {
                "free_ms": (time.perf_counter() - t0) * 1000,
                "buffers": len(self.originals),
                "parts": len(self.parts),
            }
            return self.weight_bytes
        chosen = self.parts_to_release(keep_bytes)
        todo = [b for p in chosen for b in p.buffers if not b.released]
        done: list[WeightBuffer] = []
        try:
            if self._parallel():
                held: list[int] = []
                try:
                    for b in todo:
                        held.append(self._detach_buffer(b))
                        done.append(b)
                finally:  # what was detached is freed, also when a placeholder failed
                    list(self._pool().map(_ggml.buffer_free, held))
            else:
                try:
                    for b in todo:
                        self._release_buffer(b)
                        done.append(b)
                finally:
                    self._unmap_handed(keep=not final)
        except ResidencyError:
            self._restore(done)  # undo this call: the lease still covers those bytes
            raise
        self.release_steps = {
            "free_ms": (time.perf_counter() - t0) * 1000,
            "buffers": len(todo),
            "parts": len(chosen),
        }
        return sum(b.size for b in done)

    def _out_of_memory(self, b: WeightBuffer, todo: list[WeightBuffer]) -> OutOfDeviceMemoryError:
        need = sum(x.size for x in todo)
        return OutOfDeviceMemoryError(
            f"not enough {b.buft_name} memory to restore the model's weights "
            f"({need / 1e9:.2f} GB needed, a {b.size / 1e9:.2f} GB buffer failed): the model stays "
            "released; free device memory "
            "(release or stop another model) and try again"
        )

    def restore(self, overlap: bool = False, kv: KvUpload | None = None) -> int:
        """Restore every released buffer (parts in layer order); on an allocation failure,
        release again what this call restored and raise OutOfDeviceMemoryError (the model stays
        as released as it was, and intact). Returns the bytes uploaded. ``moved`` then says
        whether any buffer came back at another address than before.

        Each part's upload runs on the upload thread as soon as its buffers are allocated, so the
        copies overlap the allocations that follow (in parallel mode every buffer is allocated at
        once on the pool's threads and each is uploaded as soon as its allocation is back).

        ``overlap`` (with at least two parts to restore and a usable eval hook): allocate every
        buffer, point its tensors into it and return with the uploads running (the first since
        the first part's allocation); :attr:`gate` holds the parts' readiness (made before the
        first upload) and :meth:`finish_uploads` waits for them (anything but a gated decode
        calls it first). Every buffer is allocated before this returns: the caller decides from
        ``moved`` whether the graphs must be rebuilt, and a graph's views of a weight take their
        data pointer when the graph is allocated, so no address may change after the decode
        started.

        ``kv``: the KV cache's cells of the deep level (its buffers already allocated), written
        on the upload thread right after the weights of each part, the layers of that part (the
        gate waits for them too); the layers of no part restored here are left to the caller
        (``kv.upload_unclaimed``)."""
        self.finish_uploads()
        self._kv = kv
        try:
            return self._restore([b for b in self.buffers if b.released], overlap)
        finally:
            self._kv = None

    def _part_groups(self, todo: list[WeightBuffer]) -> list[tuple[Part, list[WeightBuffer]]]:
        mine = {id(b) for b in todo}
        groups = [(p, [b for b in p.buffers if id(b) in mine]) for p in self.parts]
        return [(p, bufs) for p, bufs in groups if bufs]

    def _uploader(self) -> ThreadPoolExecutor:
        if self._uploader_pool is None:
            # one thread: the parts upload in layer order (on CUDA from its own per-thread stream,
            # beside the compute streams of the decoding thread)
            self._uploader_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="residency-upload")
        return self._uploader_pool

    def _restore(self, todo: list[WeightBuffer], overlap: bool = False) -> int:
        """Allocate and relocate the buffers of ``todo`` part by part in layer order, each part's
        upload submitted to the upload thread as soon as its buffers are in place (the copies
        overlap the allocations that follow, overlapped or not: the copy engine starts after the
        first part's allocation, not after the last one's). Overlapped (``background``): the
        gate exists before the first upload is submitted (an upload marks its part ready there)
        and this returns with the uploads running; synchronous: it waits for them."""
        self._restore_t0 = t_start = time.perf_counter()
        self.moved = False
        if self._parallel():
            return self._restore_parallel(todo, t_start)
        groups = self._part_groups(todo)
        background = overlap and self.hook is not None and len(groups) >= 2
        shadow = self.shadow
        self._upload_spans = []
        gate: PartGate | None = None
        if background:
            # the tensors' struct pointers never change: the gate can be made before any allocation
            gate = self.gate = PartGate(
                self.layout,
                [
                    (
                        p.index,
                        p.first_layer,
                        sum(b.size for b in bufs),
                        [t.ptr for b in bufs for t in b.tensors] + self._kv_claim(p),
                    )
                    for p, bufs in groups
                ],
            )
        done: list[WeightBuffer] = []
        first_alloc_s = alloc_max_s = 0.0
        held: list[tuple[Part, list[WeightBuffer]]] = []
        try:
            handed = self._map_handed(todo)
        except OutOfDeviceMemoryError:
            self.gate = None
            raise
        for part, bufs in groups:
            for b in bufs:
                t_a = time.perf_counter()
                new = self._new_buffer(b, handed)
                if new is None:
                    # the uploads submitted so far end first (they write into buffers given back now)
                    _copy_s, _error = self._wait_uploads()
                    self.gate = None
                    self._free_spent()
                    for d in done:
                        self._release_buffer(d)
                    if handed is not None:  # mapped, never carried: unmapped too
                        self._unmap_after.extend(
                            id(x) for x in todo if x not in done and handed.mapped(id(x))
                        )
                    self._unmap_handed()
                    raise self._out_of_memory(b, todo)
                alloc_max_s = max(alloc_max_s, time.perf_counter() - t_a)
                # the placeholder is freed at the next release: on CUDA cudaFree waits for the
                # whole device (the uploads in flight), and it is time a restore need not take
                self._spent.append(self._relocate(b, new))
                done.append(b)
            if not first_alloc_s:
                first_alloc_s = time.perf_counter() - t_start
            held.append((part, bufs))
            self._submit_uploads(held, shadow, gate)
        alloc_s = time.perf_counter() - t_start
        nbytes = sum(t.nbytes for b in done for t in b.tensors)
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
            )
        if background:
            assert gate is not None
            self.restore_steps["pending_bytes"] = float(gate.pending_bytes)
            return nbytes
        self.finish_uploads()
        return nbytes

    def _map_handed(self, todo: list[WeightBuffer]) -> HandedMemory | None:
        """Map handed-over memory for ``todo`` (one request to the holder); None: the buffers
        are allocated through ggml this time (no hand-over, or it failed: ``handover_note``)."""
        handed = self.handed
        if handed is None or not todo:
            return None
        try:
            handed.map_all([(id(b), b.size) for b in todo])
        except ChunkDeviceError as exc:
            if exc.out_of_memory:
                raise self._out_of_memory(todo[0], todo) from exc
            self.handover_note = f"the last restore allocated through ggml: {exc}"
            log.warning("%s", self.handover_note)
            return None
        return handed

    def _new_buffer(self, b: WeightBuffer, handed: HandedMemory | None) -> int | None:
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

    def _submit_uploads(
        self, held: list[tuple[Part, list[WeightBuffer]]], shadow: HostMemory, gate: PartGate | None
    ) -> None:
        """Hand the parts in ``held`` to the upload thread, in order, and empty it (with the KV
        cache's layers of each part, when a deep restore gave them)."""
        for part, bufs in held:
            kv = None
            if self._kv is not None:
                self._kv_claim(part)
                kv = (self._kv, part.first_layer, part.last_layer)
            job = self._uploader().submit(self._upload_part, bufs, shadow, gate, part.index, kv)
            self._uploads.append(job)
        held.clear()

    def _kv_claim(self, part: Part) -> list[int]:
        return self._kv.claim(part.first_layer, part.last_layer) if self._kv is not None else []

    def _restore_parallel(self, todo: list[WeightBuffer], t_start: float) -> int:
        """Vulkan: every buffer allocated at once on the pool's threads, each uploaded (on this
        thread) as soon as its allocation is back."""
        copy_s = 0.0
        futures: list[Future[int | None]] = [
            self._pool().submit(_ggml.buft_alloc_buffer, b.buft, b.size) for b in todo
        ]
        done: list[WeightBuffer] = []
        for i, b in enumerate(todo):
            new = futures[i].result()
            if new is None:
                for f in futures[i + 1 :]:  # the other allocations that came back are not needed
                    extra = f.result()
                    if extra is not None:
                        _ggml.buffer_free(extra)
                for d in done:
                    self._release_buffer(d)
                raise self._out_of_memory(b, todo)
            t1 = time.perf_counter()
            self._attach_buffer(b, new)
            copy_s += time.perf_counter() - t1
            done.append(b)
        total_s = time.perf_counter() - t_start
        self.restore_steps = {
            "alloc_ms": (total_s - copy_s) * 1000,  # allocation (not overlapped with copies) and relocation
            "copy_ms": copy_s * 1000,
            "buffers": len(done),
            "total_ms": total_s * 1000,
        }
        return sum(t.nbytes for b in done for t in b.tensors)

    @property
    def restore_started(self) -> float:
        """``perf_counter()`` at the start of the last restore: the origin of its timeline."""
        return self._restore_t0

    @property
    def uploads_pending(self) -> bool:
        """An overlapped restore's uploads are not all known to be complete (finish_uploads)."""
        return bool(self._uploads)

    def _upload_part(
        self,
        bufs: list[WeightBuffer],
        shadow: HostMemory,
        gate: PartGate | None,
        idx: int,
        kv: tuple[KvUpload, int, int] | None = None,
    ) -> float:
        """One part's uploads (on the upload thread), then its layers' KV cells (``kv``); returns
        their seconds. The gate learns of the part in any case (a failed upload is raised by
        finish_uploads)."""
        t0 = time.perf_counter()
        try:
            for b in bufs:
                self._upload(b, shadow)
            if kv is not None:
                kv[0].upload(kv[1], kv[2])
        finally:
            t1 = time.perf_counter()
            self._upload_spans.append((t0, t1))  # one writer: the upload thread
            if gate is not None:
                gate.set_ready(idx)
        return t1 - t0

    def _wait_uploads(self) -> tuple[float, BaseException | None]:
        copy_s, error = 0.0, None
        for f in self._uploads:
            try:
                copy_s += f.result()
            except BaseException as exc:  # raised once every upload is over
                error = error or exc
        self._uploads = []
        return copy_s, error

    def _free_spent(self) -> None:
        for ph in self._spent:
            _ggml.buffer_free(ph)
        self._spent = []

    def finish_uploads(self) -> None:
        """Wait for the uploads of the last restore; a no-op when none is pending. Then
        ``restore_steps`` has ``copy_ms`` (the upload thread's busy time), ``wait_ms`` (how long
        this call waited), ``first_upload_at_ms`` (from the restore's start to its first copy),
        ``upload_wall_ms`` (first copy's start to last copy's end) and ``upload_gaps_ms`` (the
        upload thread idle in between: waiting for allocations); ``total_ms`` of a synchronous
        restore is its whole time, ``uploads_ms`` of an overlapped one its upload wall time."""
        if not self._uploads:
            return
        t0 = time.perf_counter()
        copy_s, error = self._wait_uploads()
        t1 = time.perf_counter()
        steps = self.restore_steps
        steps["copy_ms"] = copy_s * 1000
        steps["wait_ms"] = (t1 - t0) * 1000
        spans = self._upload_spans
        if spans:
            wall = max(e for _s, e in spans) - spans[0][0]
            steps["first_upload_at_ms"] = (spans[0][0] - self._restore_t0) * 1000
            steps["upload_wall_ms"] = wall * 1000
            steps["upload_gaps_ms"] = max(0.0, wall - copy_s) * 1000
        if steps.get("overlapped"):
            # from the start of the uploads to the end of the last one
            steps["uploads_ms"] = steps.get("upload_wall_ms", 0.0)
            if self.gate is not None and self.gate.stats.first_ask_t:
                st = self.gate.stats
                # when the decode's first node was asked about, and got past its last wait
                steps["first_node_at_ms"] = (st.first_ask_t - self._restore_t0) * 1000
                if st.last_wait_end_t:
                    steps["last_wait_end_at_ms"] = (st.last_wait_end_t - self._restore_t0) * 1000
            if spans:
                steps["last_upload_end_at_ms"] = (max(e for _s, e in spans) - self._restore_t0) * 1000
        else:
            steps["total_ms"] = (time.perf_counter() - self._restore_t0) * 1000
        # kept alive until the next restore: the context may still hold its callback pointer
        # until whoever installed it clears it (Residency.settle)
        self._retired_gate, self.gate = self.gate, None
        if error is not None:
            raise ResidencyError(f"uploading the restored weights failed: {error}") from error

    def _relocate(self, b: WeightBuffer, new: int) -> int:
        """Put the fresh allocation ``new`` under ``b`` and relocate its tensors (no upload);
        returns the placeholder that now holds the tiny memory, for the caller to free."""
        assert b.layout is not None
        lay_t = self.layout
        self._swap(b.ptr, new, b.layout)
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

    def _upload(self, b: WeightBuffer, shadow: HostMemory) -> None:
        """Copy ``b``'s bytes from the host shadow, through the buffer's own set_tensor: a
        mirrored buffer in one copy per host allocation it spans, others tensor by tensor."""
        if b.mirror:
            for off, size, _addr in shadow.segments:
                lo, hi = max(off, b.shadow_base), min(off + size, b.shadow_base + b.size)
                if lo < hi:
                    _ggml.tensor_set(b.whole, shadow.address(lo, hi - lo), lo - b.shadow_base, hi - lo)
        else:
            for t in b.tensors:
                _ggml.tensor_set(t.ptr, shadow.address(t.shadow_offset, t.nbytes), 0, t.nbytes)

    def _attach_buffer(self, b: WeightBuffer, new: int) -> None:
        """Put the fresh allocation ``new`` under ``b``, relocate its tensors and upload them."""
        _ggml.buffer_free(self._relocate(b, new))  # the tiny placeholder memory
        self._upload(b, self.shadow)

    def _give_back_handed(self) -> None:
        """Before close: buffers resident in handed-over memory move into memory ggml allocates
        (released, then restored from the shadow), so the model stays usable and ggml never
        frees a mapping; every chunk goes back to the holder, which closes it."""
        handed = self.handed
        if handed is None:
            return
        carried = [b for b in self.buffers if id(b) in self._carried]
        self.moved_at_close = False
        try:
            if carried:
                self.finish_uploads()
                for b in carried:
                    _ggml.buffer_free(self._detach_buffer(b))
                self._unmap_handed(keep=False)
                self.handed = None
                try:
                    self._restore(carried)
                    self.moved_at_close = self.moved
                except (OutOfDeviceMemoryError, ResidencyError) as exc:
                    log.warning("closing: the weights stay released (%s)", exc)
        finally:
            self.handed = None
            handed.close(keep=False)

    def close(self) -> None:
        try:
            self.finish_uploads()
            self._give_back_handed()
            self._free_spent()
        finally:
            if self._uploader_pool is not None:
                self._uploader_pool.shutdown(wait=True)
                self._uploader_pool = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._shadow is not None:
            self._shadow.close()
            self._shadow = None
        if self._build is not None:
            self._build.mem.close()
            self._build = None
        if self._whole_ctx:
            _ggml.ggml_free(self._whole_ctx)
            self._whole_ctx = 0
