"""A vision projector's weights, released and restored with the model's (issue 41, item 5).

libmtmd's clip context has its own ggml context and weight buffer, which llama.cpp's model knows
nothing of: the model's warm-up graph never shows them. They are found the way the model's are
(residency/discovery.py), in the clip context's own graph: ``mtmd_context_params`` takes an eval
callback for the clip scheduler, and libmtmd's warm-up encode at init (a blank image of the
projector's size) runs the whole vision tower through it. :class:`ProjectorWatch` is that
callback; once the warm-up is over it only answers "no" (an encode then costs one Python call per
graph node: about 1 ms for a 27-layer tower; a context's callback cannot be taken out).

The weights found make a second in-place plan (``InPlace`` with this discovery: one part, the host
shadow read from the projector's GGUF, the same buffer swap; mapped from the model's handed-over
memory where the model's weights are, so that with room a switch back uploads neither), which
``Residency`` releases with the model's weights and restores after them
(:meth:`.residency.Residency.attach_projector`). Where the plan cannot be made (a weight the
graph did not show, a buffer type not checked) the projector stays on the device and
``Residency.projector_note`` says why.

:class:`ProjectorResidency` keeps the projector's restore off the first token's path: a text turn
never needs the clip context, so the projector comes back on a thread of its own once the first
decode after the model's restore is over (``Residency.settle``), its copies after the model's
weights' (it waits for the uploads the model's restore queued). Started at the restore itself, its
upload ran beside that first decode and slowed it: H100, a 1.3 GB projector beside a synthetic 8B
whose kept hand-over memory needed no upload, first token 51.5 against 38.1 ms without a projector
(2026-12-07). Whatever uses the clip context (an image encode) first calls
:meth:`ProjectorResidency.ready` (through ``Residency.projector_ready``), which starts a restore
still due; a release and a close first join a pending restore (one still due is dropped).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

import llama_cpp

from ..errors import ResidencyError
from . import _ggml
from .discovery import Discovery, complete_from_tensor_lists
from .hostmem import HostMemory
from .inplace import InPlace
from .unsupported import InPlaceUnsupportedError

log = logging.getLogger(__name__)


class ProjectorWatch:
    """The eval callback to give a clip context (``mtmd_context_params.cb_eval``) so that its
    warm-up encode shows its weight tensors. Keep it referenced as long as the context lives."""

    def __init__(self) -> None:
        self.note = ""  # why the weights could not be watched ("": they could)
        layout = _ggml.TensorLayout()
        try:
            _ggml.probe_tensor_layout(layout)
        except _ggml.LayoutMismatchError as exc:
            self.note = str(exc)
        self.discovery = Discovery(layout)
        self._watching = not self.note
        self.callback: Any = llama_cpp.ggml_backend_sched_eval_callback(self._eval)

    def _eval(self, tensor: int | None, ask: bool, user: int | None) -> bool:
        if self._watching:
            return self.discovery.observe(tensor, ask, user)
        return False

    def stop(self) -> Discovery:
        """The warm-up is over: stop watching, and return the weights it showed with the ones the
        clip context's tensor list holds beside them. Raises InPlaceUnsupportedError when none
        were seen (a projector without warm-up?)."""
        self._watching = False
        if self.note:
            raise InPlaceUnsupportedError(self.note)
        if not self.discovery.weights:
            raise InPlaceUnsupportedError("the projector's warm-up encode showed no weight tensors")
        complete_from_tensor_lists(self.discovery)
        return self.discovery


class ProjectorResidency:
    """A vision projector's weights (``ip``: its :class:`InPlace`, one part), released with the
    model's and restored after them, off the caller's path: :meth:`start_restore` hands the
    restore (allocation and upload) to a thread of its own and returns; :meth:`ready` waits for
    it. Its bytes count as resident from the moment the restore is started (the model's lease
    covers them: the restore allocates them now or fails), until a failed restore is known.
    Driven by one thread (the worker's loop); the restore thread touches ``ip`` only while a
    restore is pending, and every other call joins it first."""

    def __init__(self, ip: InPlace) -> None:
        self.ip = ip
        #: a restore due once the first decode is over (:meth:`defer_restore`): the model's uploads
        #: it waits for
        self._due: tuple[Future[Any], ...] | None = None
        self._job: Future[dict[str, float]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        #: the last restore's steps once joined: ``projector_ms`` (its allocation and upload, on
        #: its thread), ``projector_after_ms`` (from the start until the model's uploads were over)
        self.steps: dict[str, float] = {}

    @property
    def weight_bytes(self) -> int:
        return self.ip.weight_bytes

    @property
    def shadow(self) -> HostMemory:
        """The projector's host shadow (InPlace.shadow; filled at attach)."""
        return self.ip.shadow

    @property
    def last_steps(self) -> dict[str, float]:
        """The steps of the last restore that is over ({} while one is pending, or failed)."""
        job = self._job
        if job is None:
            return self.steps
        if job.done() and job.exception() is None:
            return job.result()
        return {}

    @property
    def pending(self) -> bool:
        """A restore is due, or was started and has not ended yet."""
        return self._due is not None or (self._job is not None and not self._job.done())

    @property
    def resident_bytes(self) -> int:
        """Its device bytes: all of them while a restore is pending or done well, none once a
        failed one has ended (it stays released)."""
        job = self._job
        if self._due is not None:
            return self.ip.weight_bytes
        if job is None:
            return self.ip.resident_bytes
        if job.done() and job.exception() is not None:
            return 0
        return self.ip.weight_bytes

    def start_restore(self, after: Sequence[Future[Any]] = (), background: bool = True) -> int:
        """Start bringing the weights back on the projector's thread, once the futures ``after``
        (the uploads the model's restore queued) are over; returns the bytes it uploads (0:
        resident already). ``background`` False: return once it is over (Vulkan, whose uploads
        beside a decode on another thread are not checked to be safe); its error, as a
        background one's, is raised by :meth:`ready`."""
        self.join()
        if self.ip.resident_bytes >= self.ip.weight_bytes:
            return 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="residency-projector")
        self._job = self._pool.submit(self._restore, tuple(after), time.perf_counter())
        if not background:
            wait_for([self._job])
        return self.ip.tensor_bytes

    def defer_restore(self, after: Sequence[Future[Any]] = ()) -> int:
        """Make a restore due, started by :meth:`kick` (after the first decode) or :meth:`ready`
        (an image first), once the futures ``after`` are over; returns the bytes it will upload
        (0: resident already). Its bytes count as resident from now: the model's lease covers
        them."""
        self.join()
        if self.ip.resident_bytes >= self.ip.weight_bytes:
            return 0
        self._due = tuple(after)
        return self.ip.tensor_bytes

    def kick(self) -> None:
        """Start a restore that is due, on the projector's thread (a no-op otherwise)."""
        due, self._due = self._due, None
        if due is not None:
            self.start_restore(after=due)

    def _restore(self, after: tuple[Future[Any], ...], started: float) -> dict[str, float]:
        """(the projector's thread) InPlace.restore: what it restored it releases again on an
        error, which the caller's ready() raises."""
        wait_for(after)
        t0 = time.perf_counter()
        nbytes = self.ip.restore()
        steps = {
            "projector_ms": (time.perf_counter() - t0) * 1000,
            "projector_after_ms": (t0 - started) * 1000,
        }
        # one line per restore (scripts/bench_vision_switch.py collects them from the worker log)
        log.info(
            "projector %s restored off the first token's path: %s",
            self.ip.path,
            json.dumps({**{k: round(v, 3) for k, v in steps.items()}, "projector_bytes": nbytes}),
        )
        return steps

    def ready(self, model_resident: bool) -> None:
        """Before the clip context computes: wait for a pending restore and raise its error
        (OutOfDeviceMemoryError: the projector stays released); with none pending and the weights
        released (the last restore failed), restore them now, on this thread, where the model is
        resident (``model_resident``; else ResidencyError: restore the model first). A restore
        still due starts now."""
        self.kick()
        job, self._job = self._job, None
        if job is not None:
            if not job.done():
                log.debug("waiting for the projector's restore (%s)", self.ip.path)
            try:
                self.steps = job.result()
            except BaseException as exc:
                self.steps = {}
                log.warning("the projector %s did not come back: %s", self.ip.path, exc)
                raise
            return
        if self.ip.resident_bytes >= self.ip.weight_bytes:
            return
        if not model_resident:
            raise ResidencyError("the model is released: its projector comes back with it (restore first)")
        t0 = time.perf_counter()
        self.ip.restore()
        self.steps = {"projector_ms": (time.perf_counter() - t0) * 1000, "projector_after_ms": 0.0}
        ms = self.steps["projector_ms"]
        log.info("projector %s restored (again: for an image) in %.1f ms", self.ip.path, ms)

    def join(self) -> None:
        """Wait for a pending restore; a failed one is logged (the projector stays released). A
        restore still due is dropped (the projector stays released: the caller releases or
        restores it again)."""
        self._due = None
        if self._job is None:
            return
        with contextlib.suppress(Exception):  # (logged by ready)
            self.ready(model_resident=False)

    def release(self, final: bool = False) -> None:
        """Free its device buffers (any release of the model takes it along), after a pending
        restore."""
        self.join()
        if self.ip.resident_bytes:
            self.ip.release(None, final)

    def close(self) -> None:
        try:
            self.join()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self.ip.close()
