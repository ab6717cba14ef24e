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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from .inplace import InPlace
from .kvupload import KvUpload
from .projector import ProjectorResidency
from .state import Weights
from .timeline import ReleaseSteps, RestoreSteps

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

    def restore(self, overlap: bool, kv: KvUpload | None) -> tuple[int, bool | None]:
        """Bring every released part back (``overlap``, ``kv``: see InPlace.restore); returns the
        bytes uploaded and whether a weight came back at another address (None: not known).
        Raises OutOfDeviceMemoryError with the weights as released as they were."""
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

    def restore(self, overlap: bool, kv: KvUpload | None) -> tuple[int, bool | None]:
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


class InPlacePath:
    """The in-place path: the model's :class:`InPlace` and, once attached, a vision projector's
    (:class:`ProjectorResidency`), released with it and restored after it: its restore starts
    once the model's has returned, on its own thread, its copies after the model's (a text turn
    never waits for it; :meth:`projector_ready` does). ``own_parts`` is called
    with the InPlace once a release made its layer parts' buffers (split_at_release): whoever
    closes the model frees them; ``moved_at_close`` once close() moved resident weights (their
    hand-over memory given back): the graphs hold their old addresses."""

    name: PathName = "inplace"
    frees_memory = True
    releases_context = False
    tracks_addresses = True
    kv_bytes = 0
    kv_pinned = False

    def __init__(
        self, ip: InPlace, own_parts: Callable[[InPlace], None], moved_at_close: Callable[[], None]
    ) -> None:
        self.ip = ip
        self.projector: ProjectorResidency | None = None
        self._own_parts = own_parts
        self._moved_at_close = moved_at_close

    @property
    def weight_bytes(self) -> int:
        proj = self.projector
        return self.ip.weight_bytes + (proj.weight_bytes if proj is not None else 0)

    def weights_todo(self, resident: bool, kv: bool, keep_bytes: int | None) -> bool:
        return bool(self.ip.parts_to_release(keep_bytes))

    def release(self, keep_bytes: int | None, final: bool) -> Weights:
        ip = self.ip
        splitting = ip.split_pending  # split_at_release: this release splits
        ip.release(keep_bytes, final)  # undoes its own releases on a ResidencyError
        proj = self.projector
        if proj is not None:  # any release takes it along (a pending restore of it joined first)
            proj.release(final)
        if splitting and not ip.split_pending:
            self._own_parts(ip)
        if ip.resident_bytes <= 0:
            return Weights.NONE
        return Weights.ALL if self.resident_bytes(True) == self.weight_bytes else Weights.SOME

    def restore(self, overlap: bool, kv: KvUpload | None) -> tuple[int, bool | None]:
        """The model's weights (InPlace.restore), then the projector's restore started on its
        thread, queued after the uploads the model's restore left running: the bytes returned
        count it (it moves with every switch), the caller does not wait for it."""
        proj = self.projector
        if proj is not None:
            proj.join()  # (a restore of the last switch: over long ago)
        nbytes = self.ip.restore(overlap=overlap, kv=kv)
        if proj is not None:
            # (Vulkan: over before the caller decodes; see InPlace's overlap_note)
            background = not self.ip.backend.startswith("Vulkan")
            nbytes += proj.start_restore(after=self.ip.uploads.queued, background=background)
        return nbytes, self.ip.swaps.moved

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

    def close(self) -> None:
        if self.projector is not None:
            self.projector.join()  # its thread is over before anything is freed
        self.ip.close()
        if self.ip.handover.moved_at_close:
            self._moved_at_close()
        if self.projector is not None:
            self.projector.close()
            self.projector = None
