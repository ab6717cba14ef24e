"""Residency of one loaded llama-cpp-python model: release its weights (and, deeper, its KV cache)
to host memory and restore them, through the in-place path where this build allows it and the
rebuild path everywhere else.

The worker's loop thread is the only caller of a ``Residency`` (one owner, no locks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import astuple
from typing import Any

import llama_cpp

from .. import envvars
from ..devmem.device import CHUNK_BYTES, ChunkDevice, ChunkDeviceError, ChunkSource
from ..devmem.mapped import HandedMemory
from ..devmem.memfd import MemfdDevice
from ..devmem.vmm import CudaVmmDevice
from ..devmem.vulkan import can_hand_over
from ..errors import ConfigError, OutOfDeviceMemoryError, ResidencyError
from ..state import WorkerReleaseLevel
from ..util.fileid import FileId
from . import _ggml, context, hostmem
from .context import ContextAside
from .gguf_check import check_gguf
from .inplace import InPlace
from .kv import state_sizes
from .kvlevel import KvLevel
from .kvmemory import KvHostMemory
from .measure import MemoryMeasure
from .options import Mode, ResidencyOptions
from .overlap import RestoreGate, overlap_note, overlap_probed, overlap_wanted
from .paths import HostFigures, InPlacePath, NoPath, PathName, ResidencyPath, WeightPart
from .probe import probe as probe_build
from .projector import ProjectorWatch
from .rebuild import RebuildPath
from .reports import ReleaseReport, RestoreReport
from .state import Kv, ResidencyState, Weights, check_transition
from .timeline import OverlapTimeline, ReleaseSteps, RestoreSteps, log_restore_steps
from .unsupported import InPlaceUnsupportedError, NothingToReleaseError
from .view import InPlaceView

log = logging.getLogger(__name__)


def mode_wanted(option: Mode = "auto") -> Mode:
    """The residency path as asked: ``TIMESHARE_RESIDENCY_PATH`` (auto, inplace or rebuild)
    overrides ``option`` (the worker's "auto"); any other value is a ConfigError that names it."""
    value = envvars.RESIDENCY_PATH.text().lower()
    if not value:
        return option
    modes: dict[str, Mode] = {"auto": "auto", "inplace": "inplace", "rebuild": "rebuild"}
    if value not in modes:
        raise ConfigError(
            [
                f"{envvars.RESIDENCY_PATH.name}={envvars.RESIDENCY_PATH.text()!r}: give auto, inplace "
                "or rebuild, or unset it"
            ]
        )
    return modes[value]


def _vulkan_note(gpu: _ggml.Device) -> str:
    """Why a model on a Vulkan device allocates and frees its weights (checked at attach: whether
    the device could hand memory over, devmem/vulkan.py)."""
    desc = _ggml.device_description(gpu.handle)
    same = [d for d in _ggml.devices() if d.is_gpu and _ggml.device_description(d.handle) == desc]
    ordinal = next((i for i, d in enumerate(same) if d.handle == gpu.handle), 0)
    ok, why = can_hand_over(desc, _ggml.device_id(gpu.handle) or None, ordinal)
    can = f"the device can hand memory over ({why})" if ok else f"the device cannot hand memory over: {why}"
    return (
        f"{gpu.name}: {can}; ggml-vulkan's weight buffers are not made of handed-over chunks yet "
        "(`timeshare bench vk-handover` checks the chunks alone): the alloc/free path is used"
    )


def handed_memory(gpu: _ggml.Device | None, source: ChunkSource | None) -> tuple[HandedMemory | None, str]:
    """The hand-over's memory for a model on ``gpu`` (None: a CPU build, where the memfd stand-in
    plays the device), or None and why it cannot be used."""
    device: ChunkDevice
    try:
        if gpu is None:
            device = MemfdDevice()
        elif gpu.name.startswith("CUDA"):
            index = gpu.name[4:]
            device = CudaVmmDevice(_ggml.device_id(gpu.handle), int(index) if index.isdigit() else 0)
        else:
            return None, _vulkan_note(gpu)
    except ChunkDeviceError as exc:
        return None, str(exc)
    chunk = source.chunk_bytes if source is not None else CHUNK_BYTES
    if chunk % device.granularity:
        return (
            None,
            f"the arena's chunk of {chunk} bytes is not a multiple of {device.name}'s {device.granularity}",
        )
    mem = HandedMemory(device, source, chunk)
    mem.keep_mappings = envvars.HANDOVER_KEEP.switch() is not False
    # auto (the default): on a full card a release gives its chunks back at once (H100, 20
    # switches of two 8B models with no room: first token 101.7 ms against 106.8 kept and asked
    # back, 2026-12-07); with room they stay kept and a switch back uploads nothing
    mem.keep_only_with_room = envvars.HANDOVER_KEEP.text() in ("", "auto")
    mem.lazy_unmap = envvars.HANDOVER_LAZY_UNMAP.switch() is True
    mem.reuse_contents = envvars.HANDOVER_INTACT.switch() is not False
    room = envvars.HANDOVER_ROOM.text()
    mem.room_bytes = int(room) if room.isdigit() else None
    if room and mem.room_bytes is None:
        log.warning("$%s=%r is not a number of bytes: ignored", envvars.HANDOVER_ROOM.name, room)
    return mem, ""


class Residency:
    """Release/restore of a loaded ``llama_cpp.Llama``. Create with :meth:`attach`."""

    def __init__(self) -> None:  # use attach()
        self._llm: Any = None
        self.model_path = ""
        #: how the weights leave and come back (residency/paths.py), chosen once at attach
        self._path: ResidencyPath = NoPath(0)
        #: the same, where it is the in-place path (what only it has: shadow, overlap, hand-over)
        self._inpath: InPlacePath | None = None
        self.reason = ""
        self.backend = "CPU"
        self._state = ResidencyState.RESIDENT
        self.weight_bytes = 0
        self.host_bytes = 0
        self.host_pinned = False
        self.host_note = ""
        self.host_parts = 0  # separate host allocations of the shadow (pinned ones are per-buffer)
        self.parts_note = ""  # why the in-place path has fewer layer parts than asked for
        self._n_layer = 0
        self._opts = ResidencyOptions()
        self._gpu: _ggml.Device | None = None
        self.projector_bytes = 0  # its device weight bytes (in weight_bytes too); 0: none attached
        self.projector_note = ""  # why a projector stays on the device ("": none, or it moves)
        self._file_id: FileId | None = None
        self._final = False  # release(final=True): never restored
        self._level: WorkerReleaseLevel = "weights"
        #: the Llama's context while set aside (weights released, the KV cache kept in it)
        self._aside = ContextAside(None)
        #: the KV level (residency/kvlevel.py): the snapshot, in place the KV and compute buffers
        self._kvl = KvLevel(None, "", None, False)
        #: the last release's save of the KV cells: (ms, bytes, way, its host memory's allocation ms)
        self._kv_save: tuple[float, int, str, float | None] | None = None
        self._closed = False
        self.overlap_note = ""  # why restores are synchronous ("" when they may overlap)
        self._gate = RestoreGate("")  # an overlapped restore's upload gate (residency/overlap.py)
        self._memory = MemoryMeasure(None)  # memory_measure (residency/measure.py)
        #: why restores do not map handed-over memory ("" when they do; issue 40)
        self.handover_note = "not asked for (ResidencyOptions.handover, arena.handover)"

    # -- construction -------------------------------------------------------------------------

    #: what this build allows, before any model is loaded (residency/probe.py)
    probe = staticmethod(probe_build)

    @classmethod
    def attach(
        cls,
        llm: Any,
        model_path: str | os.PathLike[str],
        options: ResidencyOptions | None = None,
        chunk_source: ChunkSource | None = None,
    ) -> Residency:
        """Take charge of ``llm``'s residency. Raises ModelFileError when ``model_path`` is not a
        sound GGUF or no longer holds the loaded weights; ResidencyError when ``mode="inplace"``
        was asked for and cannot be used (the reason says why). ``chunk_source``: with
        ``options.handover``, where handed-over memory comes from and goes back to (the arena's
        holder; None: the chunks are this process's own)."""
        self = cls()
        self._llm = llm
        self.model_path = os.fspath(model_path)
        self._opts = options or ResidencyOptions()
        if getattr(llm, "_lora_adapter", None) is not None:
            raise ResidencyError(
                "models with a LoRA adapter cannot be released yet: load it without the adapter"
            )
        check_gguf(self.model_path)
        self._n_layer = int(llama_cpp.llama_model_n_layer(llm._model.model))
        self._file_id = FileId.of(self.model_path)
        # the model's own GPU (``models[].device`` loads with split mode none and main_gpu):
        # freed bytes and the backend name are measured there, not on GPU 0
        self._gpu = _ggml.gpu_at(int(getattr(getattr(llm, "model_params", None), "main_gpu", 0) or 0))
        self._kvl = KvLevel(llm, self.model_path, self._gpu, self._want_pinned_kv())
        self._aside = ContextAside(llm)
        self._memory = MemoryMeasure(self._gpu)
        self._gate = RestoreGate(self.model_path)
        mode = self._opts.mode
        if mode not in ("auto", "inplace", "rebuild"):
            raise ValueError(f"mode must be auto, inplace or rebuild, not {mode!r}")
        if self._opts.parts < 1:
            raise ValueError(f"parts must be at least 1, not {self._opts.parts}")
        if mode == "rebuild":
            self._use_rebuild("rebuild path asked for (mode=rebuild)")
            return self
        probe = probe_build()
        if not probe.inplace_possible:
            self._fallback(mode, probe.reason)
            return self
        wanted = overlap_wanted(self._opts.overlap_restore)
        overlap_probe = overlap_probed(wanted, self._opts.parts, self._gpu)
        handed: HandedMemory | None = None
        if self._opts.handover:
            handed, self.handover_note = handed_memory(self._gpu, chunk_source)
        try:
            ip = InPlace(llm, self.model_path, self._gpu, self._opts, overlap=overlap_probe, handed=handed)
        except NothingToReleaseError as exc:
            if mode != "auto":
                self._fallback(mode, str(exc))
                return self
            self._path = NoPath(self._n_layer)
            self.reason = str(exc)
            self.backend = "CPU"
            log.info("residency of %s: nothing to release (%s)", self.model_path, self.reason)
            return self
        except InPlaceUnsupportedError as exc:
            self._fallback(mode, str(exc))
            return self
        self._path = self._inpath = InPlacePath(ip, llm, self._graphs_moved_at_close)
        if ip.split_pending and not ip.split_at_release:
            self._split(self._inpath)
        # the context may be set aside (a split that met out-of-memory left the model released)
        self._kvl.find(int(self._aside.current().ctx), ip.backend)
        self.backend = ip.backend
        self.weight_bytes = ip.weight_bytes
        if handed is not None:
            self.handover_note = ip.handover.note
        self._note_shadow()
        self.parts_note = ip.parts_note
        self.overlap_note = overlap_note(wanted, self._gpu, ip)
        self.reason = ""
        log.info(
            "residency of %s: in-place on %s, %d buffers in %d part(s), %.1f MB, %d weight tensors seen, "
            "shadow %s, overlapped restore %s",
            self.model_path,
            self.backend,
            len(ip.buffers),
            len(ip.parts),
            self.weight_bytes / 1e6,
            ip.n_weight_tensors_seen,
            "deferred" if ip.host_shadow.pending else f"pinned={self.host_pinned}",
            f"off ({self.overlap_note})" if self.overlap_note else "on",
        )
        return self

    @property
    def path(self) -> PathName:
        """How the weights leave and come back: ``inplace``, ``rebuild`` or ``none`` (nothing to
        free: memory-mapped weights of a CPU-only build)."""
        return self._path.name

    @property
    def _inplace(self) -> InPlace | None:
        """The in-place path's InPlace (None on other paths)."""
        return self._inpath.ip if self._inpath is not None else None

    def attach_projector(self, watch: ProjectorWatch, path: str | os.PathLike[str]) -> bool:
        """Release and restore a vision projector's weights with the model's (issue 41): the
        weights ``watch`` saw in the clip context's warm-up encode, their host shadow read from
        the projector's GGUF ``path``. Only beside the in-place path, with the weights resident
        (call it right after :meth:`attach`). Counted in :attr:`weight_bytes`,
        :attr:`resident_bytes` and :attr:`host_bytes`; False (``projector_note`` says why) when
        it stays on the device."""
        self._check_open()
        inpath = self._inpath
        if inpath is None or not self.weights_resident:
            self.projector_note = f"the model's residency is {self.path!r}: its projector stays where it is"
            return False
        self.projector_note = inpath.attach_projector(watch, os.fspath(path), self._gpu, self._opts)
        if inpath.projector is None:
            return False
        self.projector_bytes = inpath.projector.weight_bytes
        self.weight_bytes += self.projector_bytes
        self._note_shadow()
        return True

    def projector_ready(self) -> None:
        """Call before the projector's weights compute (an image encode): its restore runs off
        the caller's path after the model's (residency/projector.py); this waits for it. Raises
        its error (OutOfDeviceMemoryError: the projector stays released, the image fails; the
        next call, or the next restore, tries again). A no-op without a projector that moves."""
        self._check_open()
        if self._inpath is not None:
            self._inpath.projector_ready()

    def _split(self, inpath: InPlacePath) -> None:
        """Move the weights into their layer parts (InPlace.split); the part buffers are freed
        with the model (its ExitStack). The graphs are built anew (every weight moved), except on
        Vulkan, where that reset itself breaks the context (see context.forget_graphs) and is not needed:
        ggml-vulkan reads each weight's ``buffer`` and ``data`` (vk_ptr_base + its offset in the
        part) from the tensor at every dispatch and drops its cached descriptor bindings when the
        model's own VkBuffers are destroyed, and the weights' tensor structs are the ones the
        graphs name (none of them is a view). Out of memory there leaves the model released
        (restore() brings it back)."""
        llm, ip = self._llm, inpath.ip
        try:
            ip.split()
        except OutOfDeviceMemoryError as exc:
            log.warning("%s: the model stays released until a restore", exc)
            self._aside.set_aside()
            self._enter(weights=Weights.NONE)
        except ResidencyError:  # nothing moved (a placeholder could not be made): the shadow goes
            ip.close()
            self._path, self._inpath = NoPath(self._n_layer), None
            raise
        finally:
            if not ip.split_pending:
                inpath.own_parts()
        if self.weights_resident and not ip.backend.startswith("Vulkan"):
            context.forget_graphs(llm.ctx, llm)

    def _graphs_moved_at_close(self) -> None:
        """Closing moved resident weights (their handed-over memory given back): the graphs are
        built anew at the next decode."""
        if self.weights_resident:
            with contextlib.suppress(ResidencyError, AttributeError):
                context.forget_graphs(self._llm._ctx.ctx, self._llm)

    def _note_shadow(self, fig: HostFigures | None = None) -> None:
        fig = fig or (self._inpath.host_figures() if self._inpath is not None else None)
        if fig is not None:
            self.host_bytes, self.host_pinned, self.host_note, self.host_parts = astuple(fig)

    @property
    def shadow_pending(self) -> bool:
        """The in-place path's host shadow was deferred (``defer_shadow``) and is not filled yet."""
        return self._inplace is not None and self._inplace.host_shadow.pending

    @property
    def shadow_slices(self) -> tuple[int, int]:
        """(built, total) slices of the in-place path's host shadow ((0, 0) before its build
        started, and on other paths)."""
        return self._inplace.host_shadow.slices if self._inplace is not None else (0, 0)

    @property
    def shadow_fillable(self) -> bool:
        """A deferred host shadow is pending and :meth:`fill_shadow` can build it now: the weights
        are resident (each slice is checked against them), or a release checked the slices left
        against the file (they are read from it alone)."""
        ip = self._inplace
        return (
            ip is not None and ip.host_shadow.pending and (self.weights_resident or ip.host_shadow.from_file)
        )

    def fill_shadow(self, stop: Callable[[], bool] | None = None, pin: bool = True) -> bool:
        """Fill a deferred host shadow now, slice by slice (before the first release, or after it
        from the file: see :attr:`shadow_fillable`; the next restore fills what is left);
        ``stop``, asked after each slice, True: leave the rest for a
        later call (returns False: still pending). True when the shadow is complete (also on
        other paths: nothing to do). ``pin`` False: the slices left go to pageable memory (a
        restore cannot wait for seconds of pinning), pinned later by :meth:`pin_shadow`. Raises
        ModelFileError when the file no longer holds the loaded weights (before a release: no
        shadow then, the model stays loaded; after one, ModelFileChangedError: the model stays
        released, what was built is kept)."""
        self._check_open()
        ip = self._inplace
        if ip is None or not ip.host_shadow.pending:
            return True
        if not (self.weights_resident or ip.host_shadow.from_file):
            raise ResidencyError("the deferred host shadow cannot be built: the weights are released")
        assert self._inpath is not None
        fig = self._inpath.fill_shadow(stop, pin)
        self._note_shadow(fig)
        return fig is not None

    @property
    def shadow_to_pin(self) -> int:
        """Allocations of the host shadow a release made pageable (it could not wait for the
        pinning), still to be pinned by :meth:`pin_shadow`."""
        return self._inplace.host_shadow.to_pin if self._inplace is not None else 0

    def pin_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        """Pin what a release left pageable, one allocation at a time (``stop`` asked after
        each; the shadow is complete throughout). True when nothing is left to pin."""
        self._check_open()
        ip = self._inplace
        if ip is None or not ip.host_shadow.to_pin:
            return True
        self.settle()
        assert self._inpath is not None
        done = self._inpath.pin_shadow(stop)
        self._note_shadow()
        return done

    @property
    def inplace_view(self) -> InPlaceView | None:
        """A read-only view of the in-place path for diagnostics (None on other paths)."""
        return InPlaceView(self._inplace) if self._inplace is not None else None

    @property
    def attach_steps(self) -> dict[str, float]:
        """Milliseconds of the in-place attach's steps (discover, plan; shadow alloc, read and
        verify once filled); empty on other paths."""
        return self._path.attach_steps

    def _fallback(self, mode: Mode, reason: str) -> None:
        if mode == "inplace":
            raise ResidencyError(f"the in-place path cannot be used for {self.model_path}: {reason}")
        self._use_rebuild(reason)

    def _use_rebuild(self, reason: str) -> None:
        assert self._file_id is not None
        self.reason = reason
        self.backend = self._gpu.name if self._gpu and self._llm.model_params.n_gpu_layers != 0 else "CPU"
        self.weight_bytes = int(llama_cpp.llama_model_size(self._llm._model.model))
        self._path = RebuildPath(
            self._llm,
            self.model_path,
            self._file_id,
            self._want_pinned_kv(),
            self._n_layer,
            self.weight_bytes,
        )
        log.info("residency of %s: rebuild path (%s)", self.model_path, reason)

    @property
    def context_kept(self) -> bool:
        """The KV cache is released in place: the context stays (its compute buffers too where
        :attr:`buffers_kept`)."""
        return self._kvl.context_kept

    @property
    def buffers_kept(self) -> bool:
        """The KV cache is released in place and the context's compute buffers stay on the device
        (they could not be released in place: :attr:`buffers_note` says why)."""
        return self._kvl.buffers_kept

    @property
    def buffers_releasable(self) -> bool:
        """A deep release frees the compute buffers: in place, or with the context."""
        return self._path.frees_memory and self._kvl.compute_releasable

    @property
    def kv_hint_bytes(self) -> int:
        """The KV cache's bytes on the device as the owner measured them (worker/footprint.py,
        from the GGUF's shape; 0: not known): what a context made again allocates for its KV
        cache where the KV level cannot find its buffers (:attr:`kv_note`). A restore after a
        release that freed the context keeps that context's bytes out of the hand-over's room
        (``restore_steps.later_bytes``)."""
        return self._kvl.kv_hint_bytes

    @kv_hint_bytes.setter
    def kv_hint_bytes(self, nbytes: int) -> None:
        self._kvl.kv_hint_bytes = max(0, int(nbytes))

    @property
    def later_bytes(self) -> int:
        """The device bytes the next restore allocates after the weights (a context freed at the
        release, made again: its KV cache and compute buffers; 0 while the KV cache is resident
        or its context was kept)."""
        return 0 if self.kv_resident else self._kvl.later_bytes

    @property
    def compute_released_bytes(self) -> int:
        """Bytes of compute buffers released in place now (0 otherwise)."""
        return self._kvl.compute_released_bytes

    @property
    def kv_host_bytes(self) -> int:
        """Bytes of the KV snapshot held in host memory while the context is freed (0 otherwise)."""
        if self._path.releases_context:
            return self._path.kv_bytes
        return self._kvl.snapshot_bytes

    @property
    def deep_note(self) -> str:
        """How the KV level goes for this model, in words: "" where it is wholly in place (the
        context kept; its KV cells and compute buffers released and back with the weights'
        parts), else what differs and why (a sliding-window, recurrent or hybrid cache, a build
        whose scheduler or state format is not the one checked)."""
        if self._path.releases_context:
            return "the rebuild path frees the context (its KV cache and compute buffers) at every release"
        if self._inpath is None:
            return ""
        return "; ".join(self._kvl.notes())

    @property
    def kv_note(self) -> str:
        """Why the KV level frees the context and makes it again ("": in place, or not the in-place
        path): a sliding-window, recurrent or hybrid cache, a build whose KV buffers are not found."""
        return self._kvl.kv_note

    @property
    def buffers_note(self) -> str:
        """Why the compute buffers stay on the device at the KV level in place ("": they go too):
        they cannot be found for sure, or a Vulkan build until TIMESHARE_DEEP_INPLACE=1."""
        return self._kvl.buffers_note

    @property
    def kv_upload_note(self) -> str:
        """Why the KV cells come back after the weights, the portable way ("": layer by layer
        with the weights' parts), e.g. a Vulkan build until TIMESHARE_DEEP_INPLACE=1, a state format
        not the one checked."""
        return self._kvl.kv_upload_note

    @property
    def kv_save_note(self) -> str:
        """Why the last deep release in place saved the KV cells through llama_state_seq_get_data
        ("": straight from the KV tensors, residency/kvsave.py), e.g. one KV stream for several
        sequences (kv_unified), an M-RoPE model, TIMESHARE_KV_SAVE_RAW=0."""
        return self._kvl.kv_save_note

    @property
    def kv_in_place(self) -> bool:
        """The KV level keeps the context: its cells' metadata stays and the cells in use come
        back where they were (the caller need not move its sequences to host memory first)."""
        return self._inpath is not None and self._kvl.in_place

    def parked_states(self) -> dict[int, tuple[bytes, int]]:
        """While the KV cache is released (its snapshot held): each saved sequence's state, as
        ``llama_state_seq_get_data`` wrote it, and its lowest position (from the kept context's
        metadata; 0 where the context was freed). Empty otherwise."""
        return {} if self.kv_resident else self._kvl.parked_states()

    @property
    def kv_context(self) -> Any | None:
        """The llama_context handle that holds the KV cache, also while the weights are released
        and the context is kept aside (KV snapshots read only the cache, never the weights);
        None while the context itself is freed (``release(kv=True)``, the rebuild path)."""
        if not self.kv_resident:
            return None
        return self._aside.current().ctx if self._aside.held or self._llm is not None else None

    # -- layer parts --------------------------------------------------------------------------

    def parts(self) -> list[WeightPart]:
        """The weights' layer parts in layer order (one part on the rebuild path, or with
        ``parts=1``)."""
        return self._path.parts(self.weights_resident)

    @property
    def resident_bytes(self) -> int:
        """Exact bytes of the resident parts (what a lease must cover); ``weight_bytes`` when all
        are resident, 0 when released."""
        return self._path.resident_bytes(self.weights_resident)

    @property
    def resident_lease_bytes(self) -> int:
        """The device memory the resident weights hold (what a lease of them must cover):
        :attr:`resident_bytes`, plus, with handed-over memory, the unused part of each resident
        buffer's last chunk (``handover["lease_padding_bytes"]`` when all are resident)."""
        ip = self._inplace
        padding = ip.resident_padding_bytes if ip is not None else 0
        if self._inpath is not None:
            padding += self._inpath.projector_padding
        return self.resident_bytes + padding

    @property
    def state(self) -> ResidencyState:
        """Where the weights and the KV cache are (the table: residency/state.py)."""
        return self._state

    @property
    def weights_resident(self) -> bool:
        """Every weight part is on the device (nothing may decode otherwise: restore first)."""
        return self._state.weights is Weights.ALL

    @property
    def kv_resident(self) -> bool:
        """The KV cache is in its context on the device (set aside while the weights are released)."""
        return self._state.kv is Kv.DEVICE

    @property
    def partly_resident(self) -> bool:
        """Some but not all of the layer parts are resident (restore before computing)."""
        return self._state.weights is Weights.SOME

    def _enter(self, weights: Weights | None = None, kv: Kv | None = None) -> None:
        """Change one or both facts of the state, through the transition table."""
        new = ResidencyState.of(
            self._state.weights if weights is None else weights, self._state.kv if kv is None else kv
        )
        self._state = check_transition(self._state, new)

    # -- measurements -------------------------------------------------------------------------

    @property
    def device(self) -> _ggml.Device | None:
        """The ggml device the model's weights live on (None on a CPU-only build)."""
        return self._gpu

    @property
    def handover(self) -> dict[str, object]:
        """What the hand-over of device memory did (issue 40): ``on``, ``note``, and while on the
        device, chunk size, chunks handed / created / put back, cuMemCreate calls, mapped bytes."""
        if self._inplace is not None:
            # a projector mapped from the same memory: its buffers' last chunks are leased too
            extra = self._inpath.handed_projector_buffers if self._inpath is not None else []
            return self._inplace.handover.stats(self._inplace.buffers + extra)
        return {"on": False, "note": self.handover_note}

    @property
    def release_steps(self) -> ReleaseSteps:
        """The last in-place release: milliseconds, buffers and parts (all None on other paths,
        and before the first release); where it went to the deep level in place, the KV cells'
        save too (``kv_save_ms``, ``kv_save_bytes``, ``kv_save_path``) and whether it allocated
        their host memory (``kv_host_grown`` 1 or 0, ``kv_host_alloc_ms``: 0.0 when not)."""
        steps = self._path.release_steps
        kv = self._kv_save
        if kv is None:
            return steps
        return dataclasses.replace(
            steps,
            kv_save_ms=kv[0],
            kv_save_bytes=kv[1],
            kv_save_path=kv[2],
            kv_host_grown=0 if kv[3] is None else 1,
            kv_host_alloc_ms=0.0 if kv[3] is None else kv[3],
        )

    @property
    def host_held_bytes(self) -> int:
        """Host memory this model holds for its residency: the host shadow of the weights and the
        KV snapshots' memory, kept from its first deep release on (at the high-water mark of the
        cells in use; the rebuild path's snapshot lies in it too)."""
        if isinstance(self._path, RebuildPath):
            return self._path.kv_memory.nbytes
        return self.host_bytes + self._kvl.memory.nbytes

    @property
    def kv_memory(self) -> KvHostMemory:
        """The host memory KV snapshots are taken into, kept from one deep release to the next
        (its ``nbytes``: the high-water mark so far; freed at close)."""
        if isinstance(self._path, RebuildPath):
            return self._path.kv_memory
        return self._kvl.memory

    def grow_kv_memory(self) -> int:
        """Off the switch's path (the worker idle after an answer): grow :attr:`kv_memory` to what
        a release that saves the KV cells would take now (a deep release; every release of the
        rebuild path), by the rule of a release's own growth, so that release allocates nothing.
        Returns the bytes allocated (0: it holds enough, or the KV cache is not on the device, or
        a snapshot holds the memory). The loop thread calls it between releases and restores,
        never during one (one owner: never concurrently)."""
        self._check_open()
        if self._final or not self.kv_resident:
            return 0
        ctx = self.kv_context
        if ctx is None:
            return 0
        if isinstance(self._path, RebuildPath):
            return self._path.kv_memory.grow_ahead(sum(n for _s, n in state_sizes(int(ctx))))
        return self._kvl.grow_ahead(int(ctx))

    @property
    def restore_steps(self) -> RestoreSteps:
        """Per-step milliseconds of the last in-place restore: allocation, copy (all None on other
        paths, and before the first restore)."""
        return self._path.restore_steps

    @property
    def memory_measure(self) -> str:
        """What release reports measure as freed memory: ``"device"`` (the device's free memory,
        ``ggml_backend_dev_memory``) or ``"rss"`` (the process's resident memory: a CPU build, or
        a device that does not report its usage -- see :attr:`memory_note`)."""
        return self._memory.measure(self.backend, self.weights_resident, self.weight_bytes)

    @property
    def memory_note(self) -> str:
        """Why :attr:`memory_measure` is not the device's own report, when it is not."""
        return self._memory.note

    def device_memory(self) -> tuple[str, int, int] | None:
        """(device name, free bytes, total bytes) of the model's GPU as ``ggml_backend_dev_memory``
        reports them; None on a CPU-only build."""
        return self._memory.device_memory()

    # -- release / restore --------------------------------------------------------------------

    def release(
        self, kv: bool = False, keep_bytes: int | None = None, final: bool = False, free_context: bool = False
    ) -> ReleaseReport:
        """Free the weights (and with ``kv=True`` the KV cache, its cells in use saved to host
        memory first: in place, the context kept, where :attr:`kv_note` is empty; else the
        context freed with it; ``free_context``: freed in any case, its compute buffers with it,
        also after an earlier release in place). Idempotent; a deeper release of a released
        model frees the KV cache too. The rebuild path always frees both.

        ``keep_bytes``: release layer parts from the last layer down only until at most that many
        bytes of weights stay resident (:attr:`resident_bytes`); None releases all. With any part
        released the context is set aside like a whole release: restore() before computing. The
        rebuild path (one part) releases everything unless ``keep_bytes`` covers the model; the
        ``none`` path (mmapped CPU weights, nothing to free) ignores it.

        ``final``: the weights will never be restored (the process is ending and frees its device
        memory first): a deferred host shadow is neither checked nor built, and a later
        restore() raises ResidencyError."""
        self._check_open()
        self.settle()  # an overlapped restore's uploads are over before anything is freed
        if keep_bytes is not None and keep_bytes < 0:
            raise ValueError(f"keep_bytes must be at least 0 (or None: release all), not {keep_bytes}")
        path = self._path
        weights_todo = path.weights_todo(self.weights_resident, kv, keep_bytes)
        kv_todo = kv and self.kv_resident
        if free_context:  # deeper still: a kept context goes too
            self._kvl.free_kept()
        if not weights_todo and not kv_todo:
            return ReleaseReport(0.0, 0, self._level, 0, self.resident_bytes)
        if final:
            self._final = True
        elif self._inpath is not None and self.weights_resident and self.shadow_pending:
            self._inpath.check_shadow()  # the slices left checked against the file, read later
        if self.memory_measure == "rss":
            # host memory freed into a hole of glibc's heap goes back to the system only when the
            # heap is trimmed (a CPU release is for that memory): trimmed before and after, so the
            # report counts only what this release freed
            hostmem.trim_heap()
        before = self._memory.free(self.memory_measure)
        resident_before = self.resident_bytes
        self._kv_save = None
        t0 = time.perf_counter()
        if path.releases_context:  # the model and its context go together, the KV cache saved first
            weights = path.release(keep_bytes, final)
            self.host_bytes, self.host_pinned = path.kv_bytes, path.kv_pinned
            self._enter(kv=Kv.HOST)
            self._level = "weights+kv"
            self._enter(weights=weights)
        else:
            if kv_todo:
                self._kvl.release(self._aside.current(), free_context)
                self._kv_save = self._kvl.last_save()
                self._aside.handed_on()
                self._enter(kv=Kv.HOST)
            if weights_todo:
                weights = path.release(keep_bytes, final)  # undoes its own releases on a ResidencyError
                if self.kv_resident and not self._aside.held:
                    self._aside.set_aside()
                self._enter(weights=weights)
            self._level = "weights" if self.kv_resident else "weights+kv"
        if self.memory_measure == "rss":
            hostmem.trim_heap()
        ms = (time.perf_counter() - t0) * 1000.0
        freed = self._memory.free(self.memory_measure) - before
        resident = self.resident_bytes
        return ReleaseReport.logged(
            self.model_path, ms, freed, self._level, resident_before - resident, resident
        )

    @property
    def overlap_available(self) -> bool:
        """Restores may overlap their uploads with the next decode (:attr:`overlap_note` says
        why not)."""
        return self._inpath is not None and not self.overlap_note

    def restore(self, overlap: bool | None = None) -> RestoreReport:
        """Bring the weights (every released part) and the KV cache back; the same ``llm`` works
        as before. ``bytes``: what this call uploaded. Raises OutOfDeviceMemoryError (the model
        stays as released as it was) or ModelFileChangedError.

        ``overlap`` (None: as the options say, when :attr:`overlap_available`): with two or more
        parts to bring back, return once they are allocated and the tensors point into them; the
        parts then upload in layer order on another thread while the next decode runs, waiting
        (the upload gate, installed in the context for it) before the first node that reads a
        part still on its way. :meth:`settle` after that decode waits for the rest and takes the
        gate out again; every other call of this object that touches the weights settles first.
        The report says ``overlapped`` and how many bytes were still to upload."""
        self._check_open()
        self.settle()
        if self.weights_resident and self.kv_resident:
            return RestoreReport(0.0, 0, 0.0, self._level)
        if self._final:
            raise ResidencyError("the model was released for good (release(final=True)): it is not restored")
        if overlap is None:
            overlap = self.overlap_available
        overlap = overlap and self.overlap_available
        level = self._level
        t0 = time.perf_counter()
        moved: bool | None = None
        reset = False
        path, ip = self._path, self._inplace
        if path.releases_context:
            nbytes, moved = path.restore(overlap, None)
            self.host_bytes = 0
        else:
            nbytes = 0
            # the deep level in place: the KV cache's and compute buffers' memory first, so the
            # KV cells can go up with the weights' parts (OutOfDeviceMemoryError: nothing changed)
            kv_up = self._kvl.begin_restore(t0)
            kv_alloc_ms = (time.perf_counter() - t0) * 1000
            if not self.weights_resident:
                if self.shadow_pending:  # a release came before its deferred shadow was built
                    self.fill_shadow(pin=False)  # the rest from the file, pinned later (pin_shadow)
                # a context freed at the release comes back after the weights (its KV cache and
                # compute buffers): handed-over memory does not count those bytes as its room
                later = self.later_bytes
                try:
                    nbytes, moved = path.restore(overlap, kv_up, later)
                except BaseException:
                    self._kvl.buffers_out()  # back to the deep level as a whole
                    raise
            elif path.tracks_addresses:  # the KV cache alone was released: the weights never moved
                moved = False
            if ip is not None and kv_up is not None:
                ip.restore_steps["kv_alloc_ms"] = kv_alloc_ms
            self._enter(weights=Weights.ALL)
            try:
                if not self.kv_resident:
                    self._llm._ctx, reset = self._kvl.context_back(moved, ip)
                    self._enter(kv=Kv.DEVICE)
                elif self._aside.held:
                    # Graphs (and captured CUDA graphs) hold the weights' addresses: they must be
                    # built anew only when a buffer moved. Every buffer back at its old address (the
                    # allocator often hands the same block back) skips the scheduler's reserve.
                    # Vulkan buffers never move (see context.forget_graphs), so a Vulkan restore never resets.
                    reset = moved is not False
                    self._aside.put_back(forget=reset)
            except BaseException:
                if ip is not None:
                    ip.finish_uploads()
                raise
        gated = self._gate.install(ip, self._aside.live(), reset) if ip is not None else None
        pending, overlapped = gated or 0, gated is not None
        if ip is not None and moved is not None:
            # from the restore's start until the caller may decode (the uploads may still run)
            ip.restore_steps["returned_ms"] = (time.perf_counter() - t0) * 1000
        dt = time.perf_counter() - t0
        if ip is not None and not overlapped:  # an overlapped restore logs them once settled
            log_restore_steps(self.model_path, ip.restore_steps)
        self._enter(weights=Weights.ALL)
        self._enter(kv=Kv.DEVICE)
        return RestoreReport.logged(self.model_path, dt, nbytes, level, moved, reset, overlapped, pending)

    @property
    def uploads_pending(self) -> bool:
        """An overlapped restore's uploads or its gate are still to be settled."""
        return self._gate.installed or (self._inplace is not None and self._inplace.uploads.pending)

    def settle(self, decoded: bool = False) -> None:
        """After the first decode that followed an overlapped restore (or before anything else
        touches the weights): wait for the uploads still going and take the upload gate out of
        the context, so no later decode pays for a callback. ``decoded``: a decode (or an encode)
        just ended, so a projector's restore that is due starts now (InPlacePath.settled). A
        no-op otherwise (cheap: call it after every decode). :attr:`last_overlap` then holds what
        the gate saw."""
        ip = self._inplace
        if decoded and self._inpath is not None:
            self._inpath.settled()  # a projector's restore starts (after the uploads, if any)
        if ip is None or (not self._gate.installed and not ip.uploads.pending):
            return
        gate = ip.uploads.gate
        try:
            ip.finish_uploads()
        finally:
            self._kvl.settled(ip)
            self._gate.take_out(ip, self._aside.live())
        if gate is not None:
            self._gate.settled(ip.restore_steps, gate)

    @property
    def last_overlap(self) -> OverlapTimeline | None:
        """What the last overlapped restore's gate saw, once settled (see :meth:`settle`)."""
        return self._gate.last

    def _want_pinned_kv(self) -> bool:
        return self._opts.host_shadow == "pinned"

    # -- lifetime -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ResidencyError("this Residency is closed")

    def close(self) -> None:
        """Free the host shadow and snapshots. ``llm`` is left as it is: restore() first to keep
        using it (a model closed while released can only be freed)."""
        if self._closed:
            return
        try:
            self.settle()
        except ResidencyError:
            log.exception("the last overlapped restore of %s failed", self.model_path)
        self._closed = True
        if self._aside.held and self.weights_resident:
            self._aside.put_back()
        self._aside.close()
        self._kvl.close()
        self._path.close()  # (in place: the graphs reset where handed-over memory was given back)
        self._inpath = None
        self._llm = None
