"""The in-place path's uploads: a restore's copies from the host shadow into the weight buffers put
back (step 5 of residency/inplace.py).

Each part's upload runs on one upload thread (in layer order; on CUDA from its own per-thread
stream, beside the compute streams of the decoding thread) as soon as its buffers are allocated,
so the copies overlap the allocations that follow; an overlapped restore returns with them
running and its :class:`~.gate.PartGate` tells the next decode which parts are in. On Vulkan
(:func:`restore_parallel`) every buffer is allocated at once on several threads and each is
uploaded as soon as its allocation is back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ResidencyError
from . import _ggml
from .gate import PartGate
from .hostmem import HostMemory
from .kvupload import KvUpload
from .plan import Part, WeightBuffer, out_of_memory
from .swaps import Swaps


def upload(b: WeightBuffer, shadow: HostMemory) -> None:
    """Copy ``b``'s bytes from the host shadow, through the buffer's own set_tensor: a mirrored
    buffer in one copy per host allocation it spans, others tensor by tensor."""
    if b.mirror:
        for off, size, _addr in shadow.segments:
            lo, hi = max(off, b.shadow_base), min(off + size, b.shadow_base + b.size)
            if lo < hi:
                _ggml.tensor_set(b.whole, shadow.address(lo, hi - lo), lo - b.shadow_base, hi - lo)
    else:
        for t in b.tensors:
            _ggml.tensor_set(t.ptr, shadow.address(t.shadow_offset, t.nbytes), 0, t.nbytes)


def restore_parallel(
    todo: list[WeightBuffer], swaps: Swaps, shadow: Callable[[], HostMemory], t_start: float
) -> tuple[int, dict[str, float]]:
    """Vulkan: every buffer of ``todo`` allocated at once on the swaps' threads, each relocated
    and uploaded (on this thread) as soon as its allocation is back; returns the bytes uploaded
    and the restore's steps. On an allocation failure what was restored is released again and
    OutOfDeviceMemoryError raised."""
    copy_s = 0.0
    futures: list[Future[int | None]] = [
        swaps.pool().submit(_ggml.buft_alloc_buffer, b.buft, b.size) for b in todo
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
                swaps.free(d)
            raise out_of_memory(b, todo)
        t1 = time.perf_counter()
        _ggml.buffer_free(swaps.relocate(b, new))  # the tiny placeholder memory
        upload(b, shadow())
        copy_s += time.perf_counter() - t1
        done.append(b)
    total_s = time.perf_counter() - t_start
    steps: dict[str, float] = {
        "alloc_ms": (total_s - copy_s) * 1000,  # allocation (not overlapped with copies) and relocation
        "copy_ms": copy_s * 1000,
        "buffers": len(done),
        "total_ms": total_s * 1000,
    }
    return sum(t.nbytes for b in done for t in b.tensors), steps


class Uploads:
    """Owns the uploads of the restore in progress: the upload thread, its jobs (futures), when
    each part's upload ran, the gate of an overlapped restore and the KV cells a deep restore
    uploads with the parts. Its caller is the in-place path's (one thread); the upload thread
    only runs :meth:`_upload_part`."""

    def __init__(self, layout: _ggml.TensorLayout) -> None:
        self._layout = layout
        #: the overlapped restore's gate (made before the first upload), until finish()
        self.gate: PartGate | None = None
        self._retired_gate: PartGate | None = None
        self._jobs: list[Future[float]] = []
        self.kv: KvUpload | None = None  # the KV cells a deep restore uploads with the parts
        #: (start, end) of each part's upload of the last restore, in order (the upload thread)
        self._spans: list[tuple[float, float]] = []
        self._pool: ThreadPoolExecutor | None = None
        #: ``perf_counter()`` at the start of the last restore: the origin of its timeline
        self.started = 0.0

    @property
    def pending(self) -> bool:
        """An overlapped restore's uploads are not all known to be complete (:meth:`finish`)."""
        return bool(self._jobs)

    @property
    def queued(self) -> tuple[Future[float], ...]:
        """The uploads submitted and not yet waited for by :meth:`finish` (another thread may
        wait for them to be over: the projector's restore, residency/projector.py)."""
        return tuple(self._jobs)

    def begin(self) -> None:
        """A restore's first upload is to come (its spans start anew)."""
        self._spans = []

    def make_gate(self, groups: list[tuple[Part, list[WeightBuffer]]]) -> PartGate:
        """The gate of an overlapped restore of ``groups``: made before any allocation (the
        tensors' struct pointers never change), it waits for each part's weights (and KV cells)."""
        self.gate = PartGate(
            self._layout,
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
        return self.gate

    def _uploader(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # one thread: the parts upload in layer order (on CUDA from its own per-thread stream,
            # beside the compute streams of the decoding thread)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="residency-upload")
        return self._pool

    def submit(
        self,
        held: list[tuple[Part, list[WeightBuffer]]],
        shadow: HostMemory,
        gate: PartGate | None,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        """Hand the parts in ``held`` to the upload thread, in order, and empty it (with the KV
        cache's layers of each part, when a deep restore gave them). ``skip``: ids of buffers
        whose memory holds their bytes already (kept handed memory): not copied, their part
        is ready as soon as the rest of it is."""
        for part, bufs in held:
            kv = None
            if self.kv is not None:
                self._kv_claim(part)
                kv = (self.kv, part.first_layer, part.last_layer)
            todo = [b for b in bufs if id(b) not in skip]
            job = self._uploader().submit(self._upload_part, todo, shadow, gate, part.index, kv)
            self._jobs.append(job)
        held.clear()

    def _kv_claim(self, part: Part) -> list[int]:
        return self.kv.claim(part.first_layer, part.last_layer) if self.kv is not None else []

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
        finish)."""
        t0 = time.perf_counter()
        try:
            for b in bufs:
                upload(b, shadow)
            if kv is not None:
                kv[0].upload(kv[1], kv[2])
        finally:
            t1 = time.perf_counter()
            self._spans.append((t0, t1))  # one writer: the upload thread
            if gate is not None:
                gate.set_ready(idx)
        return t1 - t0

    def wait(self) -> tuple[float, BaseException | None]:
        """Wait for every upload submitted: their seconds, and the first error one raised."""
        copy_s, error = 0.0, None
        for f in self._jobs:
            try:
                copy_s += f.result()
            except BaseException as exc:  # raised once every upload is over
                error = error or exc
        self._jobs = []
        return copy_s, error

    def finish(self, steps: dict[str, float]) -> None:
        """Wait for the uploads of the last restore; a no-op when none is pending. Then its
        ``steps`` have ``copy_ms`` (the upload thread's busy time), ``wait_ms`` (how long this
        call waited), ``first_upload_at_ms`` (from the restore's start to its first copy),
        ``upload_wall_ms`` (first copy's start to last copy's end) and ``upload_gaps_ms`` (the
        upload thread idle in between: waiting for allocations); ``total_ms`` of a synchronous
        restore is its whole time, ``uploads_ms`` of an overlapped one its upload wall time."""
        if not self._jobs:
            return
        t0 = time.perf_counter()
        copy_s, error = self.wait()
        t1 = time.perf_counter()
        steps["copy_ms"] = copy_s * 1000
        steps["wait_ms"] = (t1 - t0) * 1000
        spans = self._spans
        if spans:
            wall = max(e for _s, e in spans) - spans[0][0]
            steps["first_upload_at_ms"] = (spans[0][0] - self.started) * 1000
            steps["upload_wall_ms"] = wall * 1000
            steps["upload_gaps_ms"] = max(0.0, wall - copy_s) * 1000
        if steps.get("overlapped"):
            # from the start of the uploads to the end of the last one
            steps["uploads_ms"] = steps.get("upload_wall_ms", 0.0)
            if self.gate is not None and self.gate.stats.first_ask_t:
                st = self.gate.stats
                # when the decode's first node was asked about, and got past its last wait
                steps["first_node_at_ms"] = (st.first_ask_t - self.started) * 1000
                if st.last_wait_end_t:
                    steps["last_wait_end_at_ms"] = (st.last_wait_end_t - self.started) * 1000
            if spans:
                steps["last_upload_end_at_ms"] = (max(e for _s, e in spans) - self.started) * 1000
        else:
            steps["total_ms"] = (time.perf_counter() - self.started) * 1000
        # kept alive until the next restore: the context may still hold its callback pointer
        # until whoever installed it clears it (Residency.settle)
        self._retired_gate, self.gate = self.gate, None
        if error is not None:
            raise ResidencyError(f"uploading the restored weights failed: {error}") from error

    def close(self) -> None:
        """End the upload thread (after :meth:`finish`)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
