"""The residency paths: how one model's weights leave the device and come back, behind one
interface (:class:`ResidencyPath`) that :class:`~.residency.Residency` chooses once, at attach,
and then only delegates to.

- ``inplace`` (:class:`InPlacePath`): the weight buffers are freed and put back in place from a
  host shadow (residency/inplace.py), layer part by layer part; a vision projector's with them
  (restored after them, off the caller's path: residency/projector.py);
- ``rebuild`` (residency/rebuild.py's ``RebuildPath``): the model and its context are freed and
  loaded again from the file;
- ``none`` (:class:`NoPath`): nothing to free (memory-mapped weights of a CPU-only build).

What only the in-place path has (the deferred host shadow, overlapped restores, the hand-over of
device memory, the KV level in place) stays on :class:`InPlacePath` and its
:class:`~.inplace.InPlace`; the Residency reaches it there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from . import _ggml
from .inplace import InPlace
from .kvupload import KvUpload
from .options import ResidencyOptions
from .plan import WeightBuffer
from .projector import ProjectorResidency, ProjectorWatch
from .state import Weights
from .timeline import ReleaseSteps, RestoreSteps
from .unsupported import InPlaceUnsupportedError, NothingToReleaseError

log = logging.getLogger(__name__)

PathName = Literal["inplace", "rebuild", "none"]


@dataclass(frozen=True)
class WeightPart:
    """One run of consecutive layers of the weights (the tensors outside the layers belong to
    the first layer's part); ``bytes``: its buffers' exact sizes (alignment padding in)."""

    index: int
    first_layer: int
    last_layer: int
    bytes: int
    resident: bool


@dataclass(frozen=True)
class HostFigures:
    """The in-place path's host shadow, the projector's in: bytes, whether every allocation is
    pinned, why not, and its separate host allocations (pinned ones are per-buffer)."""

    bytes: int
    pinned: bool
    note: str
    parts: int


class ResidencyPath(Protocol):
    """One way of releasing and restoring a model's weights. ``resident`` arguments: whether the
    Residency holds every weight part on the device now (its state)."""

    @property
    def name(self) -> PathName:
        """``inplace``, ``rebuild`` or ``none`` (Residency.path, the status and doctor show it)."""
        ...

    @property
    def frees_memory(self) -> bool:
        """A release frees memory (False: nothing to free, the release only sets the model aside)."""
        ...

    @property
    def releases_context(self) -> bool:
        """A release frees the context with the weights and holds its KV cache itself
        (:attr:`kv_bytes`): every release is the deep one."""
        ...

    @property
    def tracks_addresses(self) -> bool:
        """A restore knows whether the weights came back at their addresses."""
        ...

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV snapshot this path holds while released (0: none, or not its own)."""
        ...

    @property
    def kv_pinned(self) -> bool: ...

    def weights_todo(self, resident: bool, kv: bool, keep_bytes: int | None) -> bool:
        """Whether a release (``kv``: the deep one) down to ``keep_bytes`` frees any weights."""
        ...

    def release(self, keep_bytes: int | None, final: bool) -> Weights:
        """Free the weights down to ``keep_bytes`` (None: all); ``final``: never restored.
        Returns how much of the weights stays on the device."""
        ...

    def restore(self, overlap: bool, kv: KvUpload | None, later: int = 0) -> tuple[int, bool | None]:
        """Bring every released part back (``overlap``, ``kv``, ``later``: see InPlace.restore);
        returns the bytes uploaded and whether a weight came back at another address (None: not
        known). Raises OutOfDeviceMemoryError with the weights as released as they were."""
        ...

    def resident_bytes(self, resident: bool) -> int:
        """Exact bytes of the weights on the device now (what a lease must cover)."""
        ...

    def parts(self, resident: bool) -> list[WeightPart]:
        """The weights' layer parts, in layer order."""
        ...

    @property
    def release_steps(self) -> ReleaseSteps: ...

    @property
    def restore_steps(self) -> RestoreSteps: ...

    @property
    def attach_steps(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class NoPath:
    """Nothing to release: the weights are memory-mapped on a CPU-only build. A release only sets
    the model aside (restore() before computing again)."""

    name: PathName = "none"
    frees_memory = False
    releases_context = False
    tracks_addresses = False
    kv_bytes = 0
    kv_pinned = False

    def __init__(self, n_layer: int) -> None:
        self._n_layer = n_layer

    def weights_todo(self, resident: bool, kv: bool, keep_bytes: int | None) -> bool:
        return resident

    def release(self, keep_bytes: int | None, final: bool) -> Weights:
        return Weights.NONE

    def restore(self, overlap: bool, kv: KvUpload | None, later: int = 0) -> tuple[int, bool | None]:
        return 0, None

    def resident_bytes(self, resident: bool) -> int:
        return 0

    def parts(self, resident: bool) -> list[WeightPart]:
        return [WeightPart(0, 0, max(self._n_layer - 1, 0), 0, resident)]

    release_steps = ReleaseSteps()  # (frozen: none to record)
    restore_steps = RestoreSteps()

    @property
    def attach_steps(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def _free_buffers(ptrs: list[int]) -> None:
    for ptr in ptrs:
        _ggml.buffer_free(ptr)


class InPlacePath:
    """The in-place path: the model's :class:`InPlace` and, once attached, a vision projector's
    (:class:`ProjectorResidency`), released with it and restored after it: its restore starts
    once the model's has returned, on its own thread, its copies after the model's (a text turn
    never waits for it; :meth:`projector_ready` does). The layer parts' buffers, once made
    (:meth:`own_parts`), are freed with the Llama ``llm`` (its ExitStack); ``moved_at_close`` is
    called once close() moved resident weights (their hand-over memory given back): the graphs
    hold their old addresses."""

    name: PathName = "inplace"
    frees_memory = True
    releases_context = False
    tracks_addresses = True
    kv_bytes = 0
    kv_pinned = False

    def __init__(self, ip: InPlace, llm: Any, moved_at_close: Callable[[], None]) -> None:
        self.ip = ip
        self.projector: ProjectorResidency | None = None
        self._llm = llm
        self._moved_at_close = moved_at_close
        self._shadow_build_s = 0.0  # the deferred shadow's slices so far, seconds

    @property
    def weight_bytes(self) -> int:
        proj = self.projector
        return self.ip.weight_bytes + (proj.weight_bytes if proj is not None else 0)

    def weights_todo(self, resident: bool, kv: bool, keep_bytes: int | None) -> bool:
        return bool(self.ip.parts_to_release(keep_bytes))

    def own_parts(self) -> None:
        """The parts' structs exist (the split happened, at attach or at a release): the model's
        close frees them."""
        self._llm._stack.callback(_free_buffers, self.ip.part_buffers())

    def attach_projector(
        self, watch: ProjectorWatch, path: str, gpu: _ggml.Device | None, model_opts: ResidencyOptions
    ) -> str:
        """Take a vision projector's weights in charge (Residency.attach_projector): those
        ``watch`` saw, their host shadow read from the GGUF ``path``, on ``gpu`` as the model's
        options say. Returns why it stays on the device ("": :attr:`projector` is set)."""
        opts = ResidencyOptions(
            mode="inplace",
            host_shadow=model_opts.host_shadow,
            verify_shadow=model_opts.verify_shadow,
            coalesce_upload=model_opts.coalesce_upload,
            parallel_buffers=model_opts.parallel_buffers,
        )
        try:
            # mapped from the model's handed-over memory where the model's are (kept with room:
            # a switch back uploads none of it either; its own buffers given back at close)
            handed = self.ip.handover.handed
            proj = InPlace(None, path, gpu, opts, handed=handed, discovery=watch.stop(), owns_handed=False)
        except (InPlaceUnsupportedError, NothingToReleaseError) as exc:
            log.info("the projector %s stays on the device: %s", path, exc)
            return str(exc)
        self.projector = ProjectorResidency(proj)
        log.info(
            "residency of the projector %s: in place, %d buffer(s), %.1f MB, %d weight tensors seen",
            path,
            len(proj.buffers),
            proj.weight_bytes / 1e6,
            proj.n_weight_tensors_seen,
        )
        return ""

    # -- the host shadow and its deferral (the Residency checks the state first) ----------------

    def host_figures(self) -> HostFigures | None:
        """The host shadow's figures (None while it is deferred)."""
        ip, proj = self.ip, self.projector
        if ip.host_shadow.pending:
            return None
        return HostFigures(
            ip.shadow.size + (proj.shadow.size if proj is not None else 0),
            ip.shadow.pinned and (proj is None or proj.shadow.pinned),
            ip.host_shadow.note,
            len(ip.shadow.segments) + (len(proj.shadow.segments) if proj is not None else 0),
        )

    def check_shadow(self) -> None:
        """Before a release of resident weights whose deferred shadow's slices are not all built:
        those left are checked against the file now (nothing is released that could not come
        back) and read from it later -- idle, or by the next restore -- not before this release,
        which another model may be waiting for."""
        t1 = time.perf_counter()
        checked = self.ip.host_shadow.check_pending()
        built, total = self.ip.host_shadow.slices
        log.info(
            "release of %s: %d of %d host shadow slices built; the rest will be read from the "
            "file (%d tensors checked against it in %.1f ms)",
            self.ip.path,
            built,
            total,
            checked,
            (time.perf_counter() - t1) * 1000.0,
        )

    def fill_shadow(self, stop: Callable[[], bool] | None, pin: bool) -> HostFigures | None:
        """Fill the deferred host shadow (Residency.fill_shadow); its figures once complete (None:
        ``stop`` paused it)."""
        shadow = self.ip.host_shadow
        before, total = shadow.slices

        def stop_after_slice() -> bool:
            built, total = shadow.slices
            if built == 1:
                log.info("host shadow of %s: building %d slices", self.ip.path, total)
            return stop is not None and stop()

        t0 = time.perf_counter()
        done = shadow.fill(stop_after_slice if stop is not None else None, pin) is not None
        built, total = shadow.slices
        self._shadow_build_s += time.perf_counter() - t0
        if not done:
            log.info(
                "host shadow of %s: %d of %d slices built, paused (a request is waiting)",
                self.ip.path,
                built,
                total,
            )
            return None
        fig = self.host_figures()
        assert fig is not None
        log.info(
            "host shadow of %s filled (deferred) in %.0f ms: %.1f MB, pinned=%s, %d slices, "
            "%d of them in this call%s",
            self.ip.path,
            self._shadow_build_s * 1000.0,
            fig.bytes / 1e6,
            fig.pinned,
            built,
            built - before,
            f", {shadow.to_pin} pageable until pinned" if shadow.to_pin else "",
        )
        return fig

    def pin_shadow(self, stop: Callable[[], bool] | None) -> bool:
        """Pin what a release left pageable (Residency.pin_shadow)."""
        done = self.ip.pin_shadow(stop)
        if done:
            fig = self.host_figures()
            log.info(
                "host shadow of %s pinned (the part a release made pageable) in %.0f ms, pinned=%s",
                self.ip.path,
                self.ip.attach_steps.get("shadow_pin_ms", 0.0),
                fig is not None and fig.pinned,
            )
        return done

    def release(self, keep_bytes: int | None, final: bool) -> Weights:
        ip = self.ip
        proj = self.projector
        if proj is not None:  # its restore is over (or dropped) before the model's memory moves:
            proj.join()  # both may map the same handed-over memory
        splitting = ip.split_pending  # split_at_release: this release splits
        ip.release(keep_bytes, final)  # undoes its own releases on a ResidencyError
        if proj is not None:  # any release takes it along
            proj.release(final)
        if splitting and not ip.split_pending:
            self.own_parts()
        if ip.resident_bytes <= 0:
            return Weights.NONE
        return Weights.ALL if self.resident_bytes(True) == self.weight_bytes else Weights.SOME

    def restore(self, overlap: bool, kv: KvUpload | None, later: int = 0) -> tuple[int, bool | None]:
        """The model's weights (InPlace.restore), then the projector's restore made due, started on
        its thread once the first decode is over (:meth:`settled`) and queued after the uploads the
        model's restore left running: the bytes returned count it (it moves with every switch),
        the caller does not wait for it. ``later``: what the caller allocates after this (a new
        context); the projector's released bytes are added to it where ggml allocates them (not
        mapped from handed-over memory, whose own take counts them)."""
        proj = self.projector
        if proj is not None:
            proj.join()  # (a restore of the last switch: over long ago)
            if proj.ip.handover.handed is None:  # allocated by ggml (mapped: its own take counts it)
                later += max(0, proj.ip.weight_bytes - proj.ip.resident_bytes)
        nbytes = self.ip.restore(overlap=overlap, kv=kv, later=later)
        if proj is not None:
            if self.ip.backend.startswith("Vulkan"):  # over before the caller decodes (overlap_note)
                nbytes += proj.start_restore(after=self.ip.uploads.queued, background=False)
            else:  # started once the first decode is over (settle)
                nbytes += proj.defer_restore(after=self.ip.uploads.queued)
        return nbytes, self.ip.swaps.moved

    def settled(self) -> None:
        """The first decode after a restore is over: the projector's restore, due, starts."""
        if self.projector is not None:
            self.projector.kick()

    def projector_ready(self) -> None:
        """The projector's weights are on the device (ProjectorResidency.ready); a no-op without
        one that moves."""
        if self.projector is not None:
            self.projector.ready(model_resident=self.ip.resident_bytes >= self.ip.weight_bytes)

    def resident_bytes(self, resident: bool) -> int:
        proj = self.projector
        return self.ip.resident_bytes + (proj.resident_bytes if proj is not None else 0)

    def parts(self, resident: bool) -> list[WeightPart]:
        ip = self.ip
        return [
            WeightPart(p.index, p.first_layer, p.last_layer, p.bytes, p.resident or ip.split_pending)
            for p in ip.parts
        ]

    @property
    def release_steps(self) -> ReleaseSteps:
        return self.ip.release_steps

    @property
    def restore_steps(self) -> RestoreSteps:
        """The model's restore's steps, with the projector's (``projector_ms``,
        ``projector_after_ms``) once its restore is over."""
        extra = self.projector.last_steps if self.projector is not None else {}
        return RestoreSteps.of({**self.ip.restore_steps, **extra})

    @property
    def attach_steps(self) -> dict[str, float]:
        return dict(self.ip.attach_steps)

    @property
    def handed_projector_buffers(self) -> list[WeightBuffer]:
        """The projector's buffers where they are mapped from the model's handed-over memory (their
        last chunks' padding is device memory the lease counts with the model's); [] otherwise."""
        proj = self.projector
        return list(proj.ip.buffers) if proj is not None and proj.ip.handover.handed is not None else []

    @property
    def projector_padding(self) -> int:
        """That padding while the projector is resident (0 when released)."""
        proj = self.projector
        if proj is None or not proj.resident_bytes:
            return 0
        return proj.ip.handover.padding(self.handed_projector_buffers)

    def close(self) -> None:
        if self.projector is not None:
            # first: its buffers leave the model's handed-over memory before the model closes it
            self.projector.close()
            self.projector = None
        self.ip.close()
        if self.ip.handover.moved_at_close:
            self._moved_at_close()
