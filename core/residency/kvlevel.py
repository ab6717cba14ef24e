"""The KV level of one model's residency (the deep release, issue 39): the KV snapshot of the
cells in use (saved straight from the KV tensors where it can: kvsave.py, else through
``llama_state_seq_get_data``) into host memory kept from one release to the next (kvmemory.py),
and in place the KV cache's buffers (kvbuffer.py), the context's compute buffers (computebuf.py)
and the layer-wise upload of the cells with the weights' parts (kvupload.py).

In place the context is kept while its KV cache's memory is released (:attr:`KvLevel.kv_note`
says why not: then the context is freed and made again, its snapshot put back). The rebuild
path holds its KV snapshot itself (residency/rebuild.py).

The Residency (the worker's loop thread) is its only caller, by composition: it keeps the
residency's state and the Llama's ``_ctx`` itself, and hands the contexts over."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from typing import Any

import llama_cpp

from .. import envvars
from ..errors import OutOfDeviceMemoryError, ResidencyError
from . import _ggml, context
from .computebuf import (
    ComputeBufferFinder,
    ComputeBuffers,
    ComputeBufferUnsupportedError,
    forget_graph,
    scheduler_bytes,
)
from .inplace import InPlace
from .kv import KvSnapshot, state_sizes
from .kvbuffer import KvBuffers, KvBufferUnsupportedError
from .kvmemory import KvHostMemory
from .kvsave import KvSaver, KvSaveUnsupportedError
from .kvupload import KvUpload, KvUploadUnsupportedError

log = logging.getLogger(__name__)

#: why a GPU build keeps the compute buffers and puts the KV cells back after the weights
DEEP_UNVERIFIED = "not yet measured bitwise on {backend}: " + envvars.DEEP_INPLACE.name + "=1 turns it on"
#: why a Vulkan device keeps its compute buffers even where TIMESHARE_DEEP_INPLACE=1 asks for the deep level
#: in place (issue 39; lavapipe = Mesa 22.3.6, llama-cpp-python 0.3.36's ggml-vulkan, 2026-12-07). Released in
#: place, the first decode after the deep restore crashed in 5 of 10 three-cycle doctor runs (SmolLM2);
#: releasing and restoring ONLY the compute buffers (scripts/vk_compute_release_check.py, way "release",
#: weights and KV kept) crashed the first replay in 7 of 8 processes: a SIGSEGV in lavapipe's queue thread
#: (libvulkan_lvp.so +0x29c3eb, the same in the doctor's crash and the compute-only one: a loop copying an
#: array of pipe_shader_buffer, i.e. binding storage buffers, whose inlined pipe_resource_reference drops the
#: last reference of the resource a slot still held and destroys it through a NULL screen pointer: that
#: resource was destroyed already) while the loop thread waits on ggml-vulkan's fence (llama_get_logits_ith ->
#: ggml_backend_sched_synchronize); with GGML_VK_SERIALIZE_SUBMISSIONS=1 glibc aborts instead ("unsorted
#: double linked list corrupted"). Not the swap or the graph: swapping the buffers' memory out and back
#: (nothing freed, graph dropped) and dropping the graph alone never crashed (20 rounds in 6 processes, all
#: bitwise). Every way that frees a compute buffer's memory and gives it new memory crashed in some runs,
#: whatever the order (fresh memory put under it before the old is freed: 1 of 3 processes; the old freed a
#: whole replay later: 3 of 4), so the timing decides, not our order. Not ggml-vulkan's descriptor-set cache
#: (it drops every cached binding after any buffer destroy, ggml-vulkan-common.h, and
#: GGML_VK_DISABLE_DESCRIPTOR_REUSE=1 crashed all the same), nor a missing synchronisation (a
#: ggml_backend_sched_synchronize before the frees crashed too); the validation layer reports nothing, and the
#: weights' and KV buffers, freed and renewed the same way, never crashed. So: a reference-count fault in
#: lavapipe's storage-buffer bindings when a buffer that every dispatch used is destroyed and another made (no
#: symbols to name the function); a release frees that memory by definition, so no change of ours avoids it
#: there. Whether a real driver does the same is not measured: scripts/vk_compute_release_check.py, then
#: TIMESHARE_VK_COMPUTE_INPLACE=1 (with TIMESHARE_DEEP_INPLACE=1) under ``timeshare doctor``, tell; until then
#: the rule stays.
VULKAN_COMPUTE_KEPT = "on ggml-vulkan, released in place, they crashed the next decode (measured on lavapipe)"


def vulkan_compute_kept(backend: str) -> str:
    """Why ``backend`` keeps its compute buffers at the deep level in place ("": it may release
    them): a Vulkan device does (:data:`VULKAN_COMPUTE_KEPT`) unless TIMESHARE_VK_COMPUTE_INPLACE=1."""
    if not backend.upper().startswith("VULKAN") or envvars.VK_COMPUTE_INPLACE.switch():
        return ""
    return VULKAN_COMPUTE_KEPT


class KvLevel:
    """The KV level of one loaded model (``llm``), on every path but the rebuild one."""

    def __init__(self, llm: Any, model_path: str, gpu: _ggml.Device | None, pinned: bool) -> None:
        self._llm = llm
        self._model_path = model_path
        self._gpu = gpu
        self._backend = "CPU"
        #: the cells in use while released (until uploaded, on an overlapped restore until settled)
        self.snapshot: KvSnapshot | None = None
        #: the snapshots' host memory (pinned where it can be: ``pinned``), kept from one release
        #: to the next and freed at close
        self.memory = KvHostMemory(pinned)
        # in place: the cells saved straight from the KV tensors (kvsave.py); kv_save_note says
        # why through llama_state_seq_get_data instead
        self._saver: KvSaver | None = None
        self.kv_save_note = ""
        #: the last save: its milliseconds, bytes and way ("raw": kvsave.py, "state"), and what
        #: allocating its host memory took (None: nothing was allocated, the memory held enough)
        self.save_ms: float | None = None
        self.save_bytes = 0
        self.save_path = ""
        self.save_alloc_ms: float | None = None
        # in place: the KV cache's buffers, and the context kept (not freed) while they are
        # released; kv_note says why the context is freed instead
        self.buffers: KvBuffers | None = None
        self._kept: Any = None
        self.kv_note = ""
        # and the context's compute buffers with it: found again at each release (a scheduler
        # reserve replaces them), held while released; buffers_note says why they stay
        self._finder: ComputeBufferFinder | None = None
        self._compute: ComputeBuffers | None = None
        self.buffers_note = ""
        # and its cells come back layer by layer with the weights' parts: planned at the
        # release; kv_upload_note says why the portable way (after the weights) is used instead
        self._upload: KvUpload | None = None
        self._uploading: KvUpload | None = None  # an overlapped restore's, until settled
        self.kv_upload_note = ""
        self._restore_t0 = 0.0
        #: what the owner measured of the KV cache on the device (worker/footprint.py: the GGUF's
        #: shape), for a context whose KV buffers cannot be found (kv_note) when it is freed
        self.kv_hint_bytes = 0
        # the device bytes the freed context held besides the weights (its KV cache and compute
        # buffers): a new context allocates them again after the weights (later_bytes)
        self._freed_context_bytes = 0

    # -- attach ---------------------------------------------------------------------------------

    def find(self, ctx: int, backend: str) -> None:
        """The in-place path's attach: the KV cache's buffers of ``ctx`` (else :attr:`kv_note`)
        and, where the deep level goes in place, its compute buffers (else :attr:`buffers_note`)."""
        self._backend = backend
        try:
            self.buffers = KvBuffers.find(int(self._llm._model.model), ctx)
        except (KvBufferUnsupportedError, _ggml.LayoutMismatchError) as exc:
            self.kv_note = str(exc)
            log.info("the KV level of %s frees the context: %s", self._model_path, exc)
            return
        self._saver = KvSaver(self.buffers, int(self._llm._model.model))
        if not self.deep_inplace():
            self.buffers_note = DEEP_UNVERIFIED.format(backend=backend)
            return
        kept = vulkan_compute_kept(backend)
        if kept:
            self.buffers_note = kept
            return
        try:
            # on a GPU build only the device's buffers (a host one is not what the budget counts)
            self._finder = ComputeBufferFinder.probe(ctx, include_host=self._gpu is None)
        except (ComputeBufferUnsupportedError, _ggml.LayoutMismatchError) as exc:
            self.buffers_note = str(exc)
            log.info("the KV level of %s keeps the compute buffers: %s", self._model_path, exc)

    def deep_inplace(self) -> bool:
        """Whether the deep level goes in place beyond the KV buffer (compute buffers released,
        KV cells uploaded with the weights): on a CPU build and on CUDA (measured bitwise on the
        H100: doctor's KV level, arena-test's outputs equal to the reference), or where
        TIMESHARE_DEEP_INPLACE=1; another GPU backend (Vulkan) keeps the way measured there until
        a run proves the new one bitwise (TIMESHARE_DEEP_INPLACE=0 turns it off everywhere)."""
        override = envvars.DEEP_INPLACE.switch()
        if override is not None:
            return override
        return self._gpu is None or self._gpu.name.upper().startswith("CUDA")

    # -- what it holds --------------------------------------------------------------------------

    @property
    def in_place(self) -> bool:
        """A release keeps the context (its KV buffers found)."""
        return self.buffers is not None

    @property
    def context_kept(self) -> bool:
        return self._kept is not None

    @property
    def buffers_kept(self) -> bool:
        return self._kept is not None and self._compute is None

    @property
    def compute_releasable(self) -> bool:
        """A release frees the compute buffers: with the context, or in place."""
        return self.buffers is None or self._finder is not None

    @property
    def compute_released_bytes(self) -> int:
        return self._compute.live.nbytes if self._compute is not None else 0

    @property
    def snapshot_bytes(self) -> int:
        return self.snapshot.nbytes if self.snapshot is not None else 0

    def notes(self) -> list[str]:
        """What differs from the KV level wholly in place, and why (Residency.deep_note)."""
        notes = []
        if self.buffers is None:
            notes.append(f"the KV level frees the context and makes it again ({self.kv_note})")
        if self.buffers_note:
            notes.append(f"the compute buffers stay on the device ({self.buffers_note})")
        if self.kv_upload_note:
            notes.append(f"the KV cells come back after the weights ({self.kv_upload_note})")
        if self.kv_save_note:
            notes.append(f"the KV cells are saved through llama_state_seq_get_data ({self.kv_save_note})")
        return notes

    def parked_states(self) -> dict[int, tuple[bytes, int]]:
        """The snapshot's sequences: each one's state and lowest position (from the kept
        context's metadata; 0 where the context was freed). Empty without a snapshot."""
        if self.snapshot is None:
            return {}
        mem = llama_cpp.llama_get_memory(self._kept.ctx) if self._kept is not None else None

        def pos_min(seq: int) -> int:
            return int(llama_cpp.llama_memory_seq_pos_min(mem, seq)) if mem else 0

        return {
            seq: (ctypes.string_at(addr, size), pos_min(seq)) for seq, addr, size in self.snapshot.segments()
        }

    # -- release --------------------------------------------------------------------------------

    def release(self, ctx_obj: Any, free_context: bool) -> None:
        """Save the cells in use of ``ctx_obj`` (the Llama's context object) to host memory;
        then, in place and unless ``free_context``, release its KV and compute buffers and keep
        it, else close it. The caller sets the Llama's context aside."""
        t0 = time.perf_counter()
        self.snapshot = self._save(int(ctx_obj.ctx))
        self.save_ms = (time.perf_counter() - t0) * 1000
        self.save_bytes, self.save_path = self.snapshot.nbytes, self.snapshot.path
        self.save_alloc_ms = self.memory.lend_alloc_ms
        alloc = self.save_alloc_ms
        log.info(
            "KV cells saved: %d bytes in %.2f ms (%s, %s host memory of %d bytes, %s)",
            self.save_bytes,
            self.save_ms,
            self.save_path,
            "pinned" if self.memory.pinned else "pageable",
            self.memory.nbytes,
            "none allocated" if alloc is None else f"allocated in {alloc:.2f} ms",
        )
        if self.buffers is not None and not free_context:
            # in place: the context stays with its cells' metadata, its KV buffers' memory goes
            self._plan_upload()
            self.buffers.release()
            self._kept = ctx_obj
            self._release_compute(int(ctx_obj.ctx))
        else:
            self._freed_context_bytes = self._context_bytes(int(ctx_obj.ctx))
            ctx_obj.close()

    def last_save(self) -> tuple[float, int, str, float | None] | None:
        """The last release's save of the cells: milliseconds, bytes, way ("raw" or "state"), and
        the milliseconds its host memory's allocation took (None: none was made)."""
        if self.save_ms is None:
            return None
        return self.save_ms, self.save_bytes, self.save_path, self.save_alloc_ms

    def grow_ahead(self, ctx: int) -> int:
        """Off the switch's path: grow :attr:`memory` to what a deep release of ``ctx``'s cells
        in use would take now (KvHostMemory's rule), so that release allocates nothing; returns
        the bytes allocated. Nothing while a snapshot holds the memory (released, or an
        overlapped restore's upload not settled)."""
        if self.snapshot is not None or self._uploading is not None:  # (a lent memory grows nothing)
            return 0
        size, most = self._snapshot_size(ctx)
        return self.memory.grow_ahead(size, most)

    def _snapshot_size(self, ctx: int) -> tuple[int, int | None]:
        """The bytes a release's save of ``ctx``'s cells in use would take now, and the largest
        snapshot the cache can give (None: not known), as :meth:`_save` would take it."""
        if self._saver is not None and envvars.KV_SAVE_RAW.switch() is not False:
            try:
                plan = self._saver.plan(ctx)
            except KvSaveUnsupportedError:
                pass  # the state's way, as the release will say
            else:
                return sum(seq.size for seq in plan.seqs), plan.most
        return sum(size for _s, size in state_sizes(ctx)), None

    def _save(self, ctx: int) -> KvSnapshot:
        """The cells in use of ``ctx``, straight from the KV tensors where they can be told for
        sure (kv_save_note says why not), else through llama_state_seq_get_data."""
        if self._saver is not None and envvars.KV_SAVE_RAW.switch() is not False:
            try:
                snap = self._saver.take(ctx, self.memory)
            except KvSaveUnsupportedError as exc:
                if str(exc) != self.kv_save_note:
                    log.info("the KV cells of %s are saved through the state: %s", self._model_path, exc)
                self.kv_save_note = str(exc)
            else:
                self.kv_save_note = ""
                return snap
        elif self._saver is not None:
            self.kv_save_note = envvars.KV_SAVE_RAW.name + "=0"
        return KvSnapshot.take(ctx, self.memory)

    def free_kept(self) -> None:
        """A deeper release (``free_context``): the kept context goes too (its released compute
        buffers' placeholders with it); the snapshot goes into a new context the portable way."""
        if self._kept is None:
            return
        self._freed_context_bytes = self._context_bytes(int(self._kept.ctx))
        self._kept.close()
        self._kept = None
        self._compute = None
        self._upload = None

    def _plan_upload(self) -> None:
        """After a release in place: where each saved cell goes back, layer by layer (the
        metadata is kept); the portable way when it cannot be told (kv_upload_note)."""
        self._upload = None
        if self.snapshot is None or self.buffers is None:
            return
        if not self.deep_inplace():
            self.kv_upload_note = DEEP_UNVERIFIED.format(backend=self._backend)
            return
        try:
            self._upload = KvUpload.plan(self.buffers, self.snapshot)
        except (KvUploadUnsupportedError, _ggml.LayoutMismatchError) as exc:
            if str(exc) != self.kv_upload_note:
                log.info("the KV cells of %s come back after the weights: %s", self._model_path, exc)
            self.kv_upload_note = str(exc)
            return
        self.kv_upload_note = ""

    def _release_compute(self, ctx: int) -> None:
        """The kept context's compute buffers go too (found now: a reserve since the last
        release may have replaced them); kept, with the reason in buffers_note, when they cannot
        be found for sure."""
        if self._finder is None:
            return
        try:
            found = self._finder.find(ctx)
            found.release()
        except (ComputeBufferUnsupportedError, _ggml.LayoutMismatchError, ResidencyError) as exc:
            self.buffers_note = str(exc)
            log.warning("the compute buffers of %s stay on the device: %s", self._model_path, exc)
            return
        self._compute = found
        log.info("released the compute buffers of %s: %.1f MB", self._model_path, found.live.nbytes / 1e6)

    def _context_bytes(self, ctx: int) -> int:
        """The device bytes context ``ctx`` holds besides the weights, as a new context made
        again allocates them: its KV buffers (their sizes, released or not; where they cannot be
        found, :attr:`kv_hint_bytes`) and its compute buffers (released in place: their sizes;
        else the scheduler's, ``ggml_backend_sched_get_buffer_size``). A GPU build counts device
        buffers only; on a CPU build host memory is the device."""

        def on_device(buft: int) -> bool:
            return self._gpu is None or not bool(_ggml.buft_is_host(buft))

        if self.buffers is not None:
            kv = sum(b.size for b in self.buffers.live.items if on_device(b.buft))
        else:
            kv = self.kv_hint_bytes
        if self._compute is not None:
            compute = sum(b.size for b in self._compute.live.items if on_device(b.buft))
        else:
            device, host = scheduler_bytes(ctx)
            compute = device if self._gpu is not None else device + host
        return kv + compute

    @property
    def later_bytes(self) -> int:
        """The device bytes a restore allocates after the weights: a context freed at the
        release (its KV cache not in place, or ``free_context``) is made again after them, with
        its KV cache and compute buffers; 0 where the context was kept (:meth:`begin_restore`
        allocates its KV and compute buffers before the weights) or nothing was released."""
        return self._freed_context_bytes

    # -- restore --------------------------------------------------------------------------------

    def begin_restore(self, t0: float) -> KvUpload | None:
        """A restore (started at perf_counter ``t0``) of the deep level in place: allocate the KV
        cache's buffers (cleared) and the compute buffers again, before the weights; returns the
        layer-wise upload of the cells (None: the portable way, after the weights, or nothing to
        do). OutOfDeviceMemoryError: nothing changed."""
        self._restore_t0 = t0
        return self._buffers_back()

    def _buffers_back(self) -> KvUpload | None:
        if self._kept is None or self.buffers is None:  # (kept only while the KV cache is released)
            return None
        if self.buffers.live.released:
            self.buffers.restore()  # OutOfDeviceMemoryError: still released, the snapshot kept
            if self._upload is not None:
                self._upload.reset()
        if self._compute is not None and self._compute.live.released:
            try:
                self._compute.restore()  # the next decode builds its graph anew (no reserve)
            except OutOfDeviceMemoryError:
                self.buffers.release()  # back to the deep level as a whole, the snapshot kept
                raise
        return self._upload

    def buffers_out(self) -> None:
        """Undo :meth:`begin_restore` (the weights could not come back)."""
        if self.buffers is not None and not self.buffers.live.released and self._kept is not None:
            self.buffers.release()
        if self._compute is not None and not self._compute.live.released:
            self._compute.release()

    def context_back(self, weights_moved: bool | None, ip: InPlace | None) -> tuple[Any, bool]:
        """The KV cache back on the device, in its kept context or a new one: returns that
        context object (the caller makes it the Llama's) and whether its graphs were reset (a
        buffer came back at another address). ``ip``: the in-place path's, whose uploads may
        still run (an overlapped restore) and whose restore steps get the KV upload's figures."""
        llm = self._llm
        if self._kept is not None and self.buffers is not None:
            ctx_obj = self._kept
            self._buffers_back()  # (done by begin_restore already: the KV cells may be on their way)
            reset = False
            if self._compute is not None:
                self._compute = None
                reset = True
            if weights_moved is not False:  # as after a weights-only restore: graphs built anew
                context.forget_moved(ctx_obj.ctx, llm)
                reset = True
            elif self.buffers.live.moved:
                # the previous graph's views of the KV cache hold its old addresses: that graph is
                # built anew (and, on CUDA, its captured graph updated: a new graph has a new uid,
                # whose nodes' data pointers ggml-cuda compares); the scheduler's plan stays
                forget_graph(int(ctx_obj.ctx))
                reset = True
            up, self._upload = self._upload, None
            if up is not None:
                up.upload_unclaimed()  # the layers of parts that stayed resident
                if ip is not None and ip.uploads.pending:
                    self._uploading = up  # its snapshot is freed once settled
                else:
                    self._uploaded(up, ip)
            elif self.snapshot is not None:  # the portable way: the metadata emptied, the state put back
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx_obj.ctx), False)
                self.snapshot.apply(ctx_obj.ctx)
                self.snapshot.close()
                self.snapshot = None
            self._kept = None
            return ctx_obj, reset
        ctx = context.new_context(llm, llm._model, self.snapshot, self._model_path, stays_released="")
        self.snapshot = None  # applied and closed
        self._freed_context_bytes = 0  # made again
        llm._stack.enter_context(contextlib.closing(ctx))
        if self.buffers is not None:  # the new context's KV buffers, for the next release in place
            self._saver = None
            try:
                self.buffers = KvBuffers.find(int(llm._model.model), int(ctx.ctx))
            except (KvBufferUnsupportedError, _ggml.LayoutMismatchError) as exc:
                self.buffers = None
                self.kv_note = str(exc)
            else:
                self._saver = KvSaver(self.buffers, int(llm._model.model))
        return ctx, False

    def settled(self, ip: InPlace) -> None:
        """An overlapped restore's uploads are over: its KV upload's figures and snapshot go."""
        up, self._uploading = self._uploading, None
        if up is not None:
            self._uploaded(up, ip)

    def _uploaded(self, up: KvUpload, ip: InPlace | None) -> None:
        """The layer-wise KV upload is over: its figures go into the restore's steps (from the
        start of Residency.restore) and the snapshot is freed."""
        st = up.stats
        if ip is not None:
            ip.restore_steps["kv_bytes"] = float(st.bytes)
            ip.restore_steps["kv_upload_ms"] = st.busy_s * 1000
            if st.first_start:  # on the weights' timeline (from the start of their restore)
                t0 = max(ip.uploads.started, self._restore_t0)  # (no weights restored: this call's)
                ip.restore_steps["kv_first_upload_at_ms"] = (st.first_start - t0) * 1000
                ip.restore_steps["kv_last_upload_end_at_ms"] = (st.last_end - t0) * 1000
        self._drop_snapshot()

    def _drop_snapshot(self) -> None:
        """The snapshot is done with: its memory goes back to :attr:`memory` (kept)."""
        if self.snapshot is not None:
            self.snapshot.close()
            self.snapshot = None

    def close(self) -> None:
        """The model is closed: free the snapshot and its host memory."""
        self._drop_snapshot()
        self.memory.close()
