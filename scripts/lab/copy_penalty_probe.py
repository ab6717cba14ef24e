"""Why a host->device copy into just-allocated memory is slower (issue 28, item 3): a CUDA-only probe.

Usage (on a machine with an NVIDIA GPU and the CUDA runtime; no model needed):

    python3 scripts/lab/copy_penalty_probe.py [--gb 4.22] [--reps 4] [--json]

`bench residency`'s copy_probe measured, on the H200, a 4.22 GB pinned copy through ggml at
76.3 ms into a buffer allocated once and 85.5 ms into a buffer allocated right after the previous
one was freed; a 0.5 s pause after the free or after the allocation removed the difference. A
switch always copies into memory the other model has just freed, so this is on every switched
turn. This script talks to libcudart directly (ctypes, no ggml) so that each condition is one
change from the last, and it can ask what ggml cannot: whether another process's free slows a
copy into memory allocated long before (the driver scrubbing freed memory on a copy engine the
copy shares), or whether only memory allocated after the free is slow (its pages being mapped).

Each case prints the median copy milliseconds of ``--reps`` copies of ``--gb`` GB from one pinned
host buffer (``cudaHostAlloc``) with ``cudaMemcpy`` (synchronous), and GB/s:

- ``reused``: into one buffer allocated once (the limit);
- ``fresh_after_free``: free the previous buffer, allocate, copy (a restore after a release, in-process);
- ``fresh_never_freed``: allocate more memory without freeing any first (new pages, no free before);
- ``reused_after_other_free``: allocate and free another buffer of the same size, then copy into
  the old reused one at once (a free's aftermath slowing a copy elsewhere);
- ``fresh_after_free_memset``: as fresh_after_free, with a ``cudaMemset`` of the new buffer before
  the copy (its time in ``memset_ms``);
- ``fresh_after_free_sleep_N``: N ms between the free and the allocation (how long the work lasts);
- ``fresh_after_free_chunks_2streams``: the copy in 64 MiB chunks alternating over two streams;
- ``cross_process_fresh``: another process frees the same size, then this one allocates and copies
  (what a switch does);
- ``cross_process_reused``: another process frees, this one copies into its old buffer;
- ``cross_process_fresh_memset``: the switch with a memset of the new buffer first;
- ``reused_after_other_free_{0.25,1}x``: the freed buffer a quarter of the size, or the same;
- ``sm_*``: the copy done by the copy kernel (``smcopy.py`` beside this script) instead of a
  copy engine, reused / after another free / into fresh memory after a free (``sm_copy_exact``:
  the last 4 KiB read back);
- ``hybrid_{share}_*``: the kernel taking ``share`` of each of 32 parts beside the copy engine, as
  the restore lane did (``TIMESHARE_UPLOAD_SM_SHARE``, removed from the product in issue 37).

Prints JSON with ``--json``. A probe: it asserts nothing; the figures are in docs/lab/HISTORY.md."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

H2D = 1
CHUNK = 64 << 20


def _cudart() -> ctypes.CDLL:
    names = [ctypes.util.find_library("cudart")]
    for pattern in (
        "/usr/local/cuda/lib64/libcudart.so*",
        "/usr/local/cuda*/targets/x86_64-linux/lib/libcudart.so*",
        "/usr/lib/x86_64-linux-gnu/libcudart.so*",
    ):
        names.extend(sorted(glob.glob(pattern)))
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("libcudart not found: this probe needs the CUDA runtime (an NVIDIA GPU machine)")


RT = _cudart()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        RT.cudaGetErrorString.restype = ctypes.c_char_p
        raise SystemExit(f"{what} failed: {RT.cudaGetErrorString(rc).decode()} ({rc})")


def malloc(n: int) -> int:
    p = ctypes.c_void_p()
    _check(RT.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)), f"cudaMalloc({n})")
    return int(p.value or 0)


def free(p: int) -> None:
    _check(RT.cudaFree(ctypes.c_void_p(p)), "cudaFree")


def memset(p: int, n: int) -> float:
    t0 = time.perf_counter()
    _check(RT.cudaMemset(ctypes.c_void_p(p), 0, ctypes.c_size_t(n)), "cudaMemset")
    _check(RT.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    return time.perf_counter() - t0


def host_alloc(n: int) -> int:
    p = ctypes.c_void_p()
    _check(RT.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(n), 0), f"cudaHostAlloc({n})")
    return int(p.value or 0)


def copy(dst: int, src: int, n: int) -> float:
    t0 = time.perf_counter()
    _check(RT.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n), H2D), "cudaMemcpy")
    return time.perf_counter() - t0


def copy_2streams(dst: int, src: int, n: int, streams: list[int]) -> float:
    t0 = time.perf_counter()
    off = 0
    i = 0
    while off < n:
        k = min(CHUNK, n - off)
        _check(
            RT.cudaMemcpyAsync(
                ctypes.c_void_p(dst + off),
                ctypes.c_void_p(src + off),
                ctypes.c_size_t(k),
                H2D,
                ctypes.c_void_p(streams[i % len(streams)]),
            ),
            "cudaMemcpyAsync",
        )
        off += k
        i += 1
    _check(RT.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    return time.perf_counter() - t0


def _lab_smcopy() -> Any:
    """smcopy.py beside this script, loaded on its own (scripts/lab is no package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smcopy.py")
    spec = importlib.util.spec_from_file_location("timeshare_smcopy", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def holder(n: int) -> None:
    """The other process: allocate and touch n bytes, say so, free them when asked, say so."""
    _check(RT.cudaSetDevice(0), "cudaSetDevice")
    p = malloc(n)
    memset(p, n)
    print("ready", flush=True)
    sys.stdin.readline()
    free(p)
    _check(RT.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    print("freed", flush=True)
    sys.stdin.readline()


class Other:
    """A holder process with n bytes on the device until free() is called."""

    def __init__(self, n: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--holder", str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the holder process did not start")

    def free(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("free\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "freed":
            raise SystemExit("the holder process did not free")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def med_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.22)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--holder", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.holder:
        holder(args.holder)
        return
    n = int(args.gb * 1e9) & ~4095
    _check(RT.cudaSetDevice(0), "cudaSetDevice")
    src = host_alloc(n)
    ctypes.memset(src, 0x5A, n)
    out: dict[str, Any] = {"bytes": n, "reps": args.reps}
    cases: dict[str, list[float]] = {}

    def note(name: str, xs: list[float]) -> None:
        cases[name] = xs
        print(
            f"{name}: {med_ms(xs)} ms ({n / statistics.median(xs) / 1e9:.1f} GB/s)",
            file=sys.stderr,
            flush=True,
        )

    reused = malloc(n)
    copy(reused, src, n)
    note("reused", [copy(reused, src, n) for _ in range(args.reps)])

    xs = []
    cur = malloc(n)
    for _ in range(args.reps):
        free(cur)
        cur = malloc(n)
        xs.append(copy(cur, src, n))
    note("fresh_after_free", xs)

    xs = []
    extra: list[int] = []
    for _ in range(args.reps):
        p = malloc(n)
        extra.append(p)
        xs.append(copy(p, src, n))
    note("fresh_never_freed", xs)
    for p in extra:
        free(p)

    xs = []
    for _ in range(args.reps):
        p = malloc(n)
        memset(p, n)
        free(p)
        xs.append(copy(reused, src, n))
    note("reused_after_other_free", xs)

    xs, ms = [], []
    for _ in range(args.reps):
        free(cur)
        cur = malloc(n)
        ms.append(memset(cur, n))
        xs.append(copy(cur, src, n))
    note("fresh_after_free_memset", xs)
    out["memset_ms"] = med_ms(ms)

    for pause in (0.005, 0.02, 0.05, 0.2):
        xs = []
        for _ in range(args.reps):
            free(cur)
            time.sleep(pause)
            cur = malloc(n)
            xs.append(copy(cur, src, n))
        note(f"fresh_after_free_sleep_{int(pause * 1000)}", xs)

    streams = []
    for _ in range(2):
        s = ctypes.c_void_p()
        _check(RT.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreate")
        streams.append(int(s.value or 0))
    xs = []
    for _ in range(args.reps):
        free(cur)
        cur = malloc(n)
        xs.append(copy_2streams(cur, src, n, streams))
    note("fresh_after_free_chunks_2streams", xs)
    xs = [copy_2streams(reused, src, n, streams) for _ in range(args.reps)]
    note("reused_chunks_2streams", xs)
    free(cur)

    for frac in (0.25, 1.0):
        xs = []
        m = int(n * frac) & ~4095
        for _ in range(args.reps):
            p = malloc(m)
            memset(p, m)
            free(p)
            xs.append(copy(reused, src, n))
        note(f"reused_after_other_free_{frac:g}x", xs)

    try:
        # the copy kernel (smcopy.py beside this script, its PTX JIT-compiled by the driver)
        lane = _lab_smcopy().KernelCopier(0)
        src_dev = lane.device_pointer(src)

        def sm_copy(dst: int) -> float:
            t0 = time.perf_counter()
            lane.copy(dst, src_dev, n)
            lane.wait()
            return time.perf_counter() - t0

        sm_copy(reused)
        note("sm_reused", [sm_copy(reused) for _ in range(args.reps)])
        xs = []
        for _ in range(args.reps):
            p = malloc(n)
            memset(p, n)
            free(p)
            xs.append(sm_copy(reused))
        note("sm_reused_after_other_free", xs)
        xs = []
        cur = malloc(n)
        for _ in range(args.reps):
            free(cur)
            cur = malloc(n)
            xs.append(sm_copy(cur))
        note("sm_fresh_after_free", xs)
        free(cur)
        # the same kernel beside the copy engine, part by part as a restore uploads (32 parts),
        # the kernel taking `share` of each part
        ce_stream = streams[0]

        def hybrid(dst: int, share: float, parts: int = 32) -> float:
            t0 = time.perf_counter()
            step = (n // parts) & ~4095
            off = 0
            while off < n:
                m = min(step, n - off)
                k = int(m * share) // 4096 * 4096
                if k:
                    lane.copy(dst + off, src_dev + off, k)
                _check(
                    RT.cudaMemcpyAsync(
                        ctypes.c_void_p(dst + off + k),
                        ctypes.c_void_p(src + off + k),
                        ctypes.c_size_t(m - k),
                        H2D,
                        ctypes.c_void_p(ce_stream),
                    ),
                    "cudaMemcpyAsync",
                )
                _check(RT.cudaStreamSynchronize(ctypes.c_void_p(ce_stream)), "cudaStreamSynchronize")
                lane.wait()
                off += m
            return time.perf_counter() - t0

        for share in (0.0, 0.25, 0.4, 0.5):
            note(f"hybrid_{share:g}_reused", [hybrid(reused, share) for _ in range(args.reps)])
            xs = []
            for _ in range(args.reps):
                p = malloc(n)
                memset(p, n)
                free(p)
                xs.append(hybrid(reused, share))
            note(f"hybrid_{share:g}_after_other_free", xs)
        # the bytes arrived: the kernel copy is a copy
        chk = (ctypes.c_uint8 * 4096)()
        _check(
            RT.cudaMemcpy(chk, ctypes.c_void_p(reused + n - 4096), ctypes.c_size_t(4096), 2), "cudaMemcpy D2H"
        )
        out["sm_copy_exact"] = all(b == 0x5A for b in chk)
    except (RuntimeError, OSError, ValueError) as exc:
        out["sm_error"] = str(exc)
        print(f"sm copy: {exc}", file=sys.stderr, flush=True)

    for name in ("cross_process_fresh", "cross_process_reused", "cross_process_fresh_memset"):
        xs, ms = [], []
        for _ in range(args.reps):
            other = Other(n)
            try:
                other.free()
                if name == "cross_process_reused":
                    xs.append(copy(reused, src, n))
                else:
                    p = malloc(n)
                    if name.endswith("memset"):
                        ms.append(memset(p, n))
                    xs.append(copy(p, src, n))
                    free(p)
            finally:
                other.close()
        note(name, xs)
        if ms:
            out["cross_process_memset_ms"] = med_ms(ms)
    free(reused)

    out["median_ms"] = {k: med_ms(v) for k, v in cases.items()}
    out["ms"] = {k: [round(x * 1000, 2) for x in v] for k, v in cases.items()}
    base = out["median_ms"]["reused"]
    out["vs_reused"] = {k: round(base / v, 3) for k, v in out["median_ms"].items()}
    if args.json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    main()
