"""The copy a restore is measured against (issue 28, item 3): the model's host shadow copied
into a plain device buffer of the same type through the same ggml call
(``ggml_backend_tensor_set``), one copy per shadow allocation as a restore makes them.

:func:`raw_copy_seconds` is the limit (the copy into one buffer, allocated once); :func:`copy_probe`
tells a GPU run where a restore's copy loses against it, by copying the same bytes under the
conditions a restore has and the limit has not: into a buffer allocated just before (right
after another was freed, as a restore follows a release), with a pause after the free or after
the allocation, and from another thread than the one that allocated (the restore's upload
thread). Run both while the model is released (they need its memory).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

from ..residency.scratch import ScratchTensor, device_buffer_type
from ..residency.view import InPlaceView


def _device_buft(inplace: InPlaceView) -> int:
    """The device's own buffer type (an "extra" type like CPU_REPACK would repack the bytes)."""
    return device_buffer_type(max(inplace.buffers, key=lambda b: b.size).buft)


def _pieces(inplace: InPlaceView) -> list[tuple[int, int, int]]:
    """(host address, offset, bytes) of each shadow allocation in order, as restore reads them."""
    nbytes = inplace.tensor_bytes
    out: list[tuple[int, int, int]] = []
    for off, size, addr in inplace.shadow_segments:
        n = min(size, nbytes - off)
        if n > 0:
            out.append((addr, off, n))
    return out


def _copy(target: ScratchTensor, pieces: list[tuple[int, int, int]]) -> float:
    t0 = time.perf_counter()
    for addr, off, n in pieces:
        target.set(addr, off, n)
    return time.perf_counter() - t0


def raw_copy_seconds(inplace: InPlaceView, reps: int = 3) -> list[float]:
    """The limit restore is measured against: one copy of the same byte count from the same host
    shadow into one fresh buffer of the same device buffer type, through the same ggml call, once
    per rep into the same buffer (the first rep writes into fresh memory: see copy_probe)."""
    pieces = _pieces(inplace)
    target = ScratchTensor(_device_buft(inplace), inplace.tensor_bytes)
    try:
        return [_copy(target, pieces) for _ in range(reps)]
    finally:
        target.free()


def _ms(xs: list[float]) -> list[float]:
    return [x * 1000 for x in xs]


def copy_probe(inplace: InPlaceView, reps: int = 3, pause_s: float = 0.5) -> dict[str, object]:
    """Milliseconds of the same copy as :func:`raw_copy_seconds` under a restore's conditions,
    ``reps`` each (lists, in order; ``*_median`` beside them):

    - ``reused_ms``: into one buffer allocated once (what the limit takes the minimum of);
    - ``fresh_copy_ms`` / ``fresh_alloc_ms``: the previous buffer freed and a new one allocated
      right before each copy (a restore after a release);
    - ``pause_after_free_copy_ms``: the same with ``pause_s`` between the free and the allocation
      (slow fresh copies that are fast here: the driver still works on the freed memory, e.g.
      scrubbing it, while the copy runs);
    - ``pause_after_alloc_copy_ms``: a pause between the allocation and the copy instead (fast
      here only: the allocation leaves work behind it);
    - ``short_pause_after_free_copy_ms``: a 50 ms pause after the free (how long that work takes);
    - ``cleared_copy_ms`` (and ``cleared_clear_ms``): the fresh buffer cleared on the device
      (``ggml_backend_buffer_clear``: every page touched from the GPU side) before the copy;
    - ``thread_copy_ms``: into the reused buffer from another thread (the restore's uploads run
      on the upload thread), after one warm-up copy there."""
    pieces = _pieces(inplace)
    buft = _device_buft(inplace)
    nbytes = inplace.tensor_bytes
    out: dict[str, object] = {"reps": reps, "pause_s": pause_s, "copies": len(pieces), "bytes": nbytes}
    target = ScratchTensor(buft, nbytes)
    try:
        out["reused_ms"] = _ms([_copy(target, pieces) for _ in range(reps)])
        got: list[float] = []
        errors: list[BaseException] = []

        def on_thread() -> None:
            try:
                _copy(target, pieces)  # warm-up: the thread's first device call
                got.extend(_copy(target, pieces) for _ in range(reps))
            except BaseException as exc:  # re-raised on the calling thread
                errors.append(exc)

        th = threading.Thread(target=on_thread, name="residency-copy-probe")
        th.start()
        th.join()
        if errors:
            raise errors[0]
        out["thread_copy_ms"] = _ms(got)

        clears: list[float] = []

        def fresh(
            before_alloc: float, after_alloc: float, clear: bool = False
        ) -> tuple[list[float], list[float]]:
            nonlocal target
            allocs: list[float] = []
            copies: list[float] = []
            for _ in range(reps):
                target.free()
                time.sleep(before_alloc)
                t0 = time.perf_counter()
                target = ScratchTensor(buft, nbytes)
                allocs.append(time.perf_counter() - t0)
                time.sleep(after_alloc)
                if clear:
                    t1 = time.perf_counter()
                    target.clear()
                    clears.append(time.perf_counter() - t1)
                copies.append(_copy(target, pieces))
            return _ms(allocs), _ms(copies)

        cases: list[tuple[str, Callable[[], tuple[list[float], list[float]]]]] = [
            ("fresh", lambda: fresh(0.0, 0.0)),
            ("pause_after_free", lambda: fresh(pause_s, 0.0)),
            ("pause_after_alloc", lambda: fresh(0.0, pause_s)),
            ("short_pause_after_free", lambda: fresh(0.05, 0.0)),
            ("cleared", lambda: fresh(0.0, 0.0, clear=True)),
        ]
        for name, run in cases:
            allocs, copies = run()
            out[f"{name}_alloc_ms"] = allocs
            out[f"{name}_copy_ms"] = copies
        out["cleared_clear_ms"] = _ms(clears)
    finally:
        target.free()
    for key in [k for k in out if k.endswith("_ms")]:
        xs = out[key]
        assert isinstance(xs, list)
        out[key.removesuffix("_ms") + "_median_ms"] = float(statistics.median(xs)) if xs else 0.0
    return out
