"""GPU check of the worker's restore retry on out-of-device-memory, with real CUDA allocations.

Usage (a CUDA build of llama-cpp-python, timeshare importable, libcudart on the loader path):

    python scripts/gpu_restore_oom_check.py MODEL.gguf

The worker's ``ArenaTenancy`` runs in this process on MODEL (loaded, greedy reference, released);
a "hog" child process (this file again) takes all but 2 GiB of the free device memory:

A. the hog also holds the arena token and is killed with SIGKILL while our worker waits: the
   kernel drops its flock at once, the driver gives its memory back a little later; how long, and
   whether our restore had to retry;
B. a hog without the token frees its memory after 2 s: the restore retries, then succeeds;
C. the memory never comes back and ``restore_oom_retry_s`` is 1: the error the user sees.

Each scenario checks that the greedy output after the restore equals the reference. Prints one
JSON line per scenario and a JSON report at the end. Not part of ``make test`` (needs a GPU)."""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

KEEP_FREE = 2 << 30  # what the hog leaves free: less than the test model's weights


def cudart() -> Any:
    names = ["libcudart.so", "libcudart.so.12", *sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("libcudart not found: this check needs a CUDA machine")


def free_bytes(cud: Any) -> int:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cud.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    return int(free.value)


def hog_main(arena_dir: str, hold_token: bool, free_after_s: float) -> None:
    cud = cudart()
    if hold_token:
        from timeshare.core.arena.arena import Arena
        from timeshare.core.arena.client import TokenClient

        TokenClient(Arena(arena_dir), "hog").acquire(timeout=30)
    size = free_bytes(cud) - KEEP_FREE
    ptr = ctypes.c_void_p()
    rc = cud.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size))
    cud.cudaMemset(ptr, 1, ctypes.c_size_t(size))
    cud.cudaDeviceSynchronize()
    print(f"HOG rc={rc} bytes={size} free_now={free_bytes(cud)}", flush=True)
    if free_after_s > 0:
        time.sleep(free_after_s)
        cud.cudaFree(ptr)
        cud.cudaDeviceSynchronize()
        print("FREED", flush=True)
    time.sleep(3600)


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def main(model_path: str) -> None:
    import llama_cpp  # noqa: F401  (first, as the worker does)
    from timeshare.core.config.schema import ArenaConfig, ModelConfig
    from timeshare.core.errors import OutOfDeviceMemoryError
    from timeshare.core.wire.spec import WorkerSpec
    from timeshare.core.worker.engine import Engine
    from timeshare.core.worker.tenancy import ArenaTenancy

    messages = Messages()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger().addHandler(messages)

    arena_dir = tempfile.mkdtemp(prefix="oom-arena-")
    spec = WorkerSpec(
        model=ModelConfig(id="m", path=model_path, n_ctx=512, idle_sleep_s=None),
        arena=ArenaConfig(restore_oom_retry_s=10.0),
        arena_dir=arena_dir,
        kv_dir=tempfile.mkdtemp(prefix="oom-kv-"),
    )
    res = ArenaTenancy(spec)
    res.acquire(lambda: None, None)
    engine = Engine.load(spec.model, use_mmap=res.use_mmap)
    res.attach(engine)
    print("residency", res.path, res.backend, res.weight_bytes, flush=True)

    def greedy() -> list[int]:
        llm = engine.llm
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(llm.tokenize(b"The three primary colours are"), temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) == 12:
                break
        return out

    reference = greedy()
    res.release(kv=False)
    cud = cudart()
    report: dict[str, Any] = {"weight_bytes": res.weight_bytes, "free_after_release": free_bytes(cud)}

    def scenario(
        name: str, hold: bool, free_after_s: float, kill_after_s: float | None, retry_s: float
    ) -> None:
        res.spec = dataclasses.replace(spec, arena=ArenaConfig(restore_oom_retry_s=retry_s))
        messages.seen.clear()
        hog = subprocess.Popen(
            [sys.executable, __file__, "hog", arena_dir, "1" if hold else "0", str(free_after_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert hog.stdout is not None
        out: dict[str, Any] = {"hog": hog.stdout.readline().strip(), "free_with_hog": free_bytes(cud)}
        samples: list[tuple[float, int]] = []
        killed_at: list[float] = []

        def killer() -> None:
            assert kill_after_s is not None
            time.sleep(kill_after_s)
            killed_at.append(time.monotonic())
            hog.kill()
            while time.monotonic() < killed_at[0] + 5.0:
                samples.append((time.monotonic() - killed_at[0], free_bytes(cud)))
                time.sleep(0.002)

        thread = threading.Thread(target=killer) if kill_after_s is not None else None
        if thread is not None:
            thread.start()
        t0 = time.monotonic()
        try:
            acquired = res.ensure(lambda: None, 60.0)
            t1 = time.monotonic()
            out.update(
                ok=True,
                ensure_s=t1 - t0,
                wait_ms=acquired.wait_ms,
                restore_ms=acquired.restore_ms,
                equal=greedy() == reference,
            )
            if killed_at:
                out["restored_after_kill_ms"] = (t1 - killed_at[0]) * 1000.0
        except OutOfDeviceMemoryError as exc:
            out.update(ok=False, ensure_s=time.monotonic() - t0, error=str(exc))
        out["log"] = [m for m in messages.seen if "trying again" in m or "attempts" in m]
        if thread is not None:
            thread.join()
        if samples:
            back = next((t for t, f in samples if f > out["free_with_hog"] + KEEP_FREE), None)
            out["memory_back_after_kill_ms"] = None if back is None else back * 1000.0
        if hog.poll() is None:
            hog.kill()
        hog.wait()
        res.release(kv=False)
        print(name, json.dumps(out), flush=True)
        report[name] = out

    scenario("A_kill9_holder", hold=True, free_after_s=0.0, kill_after_s=1.0, retry_s=10.0)
    time.sleep(1.0)
    scenario("B_memory_back_after_2s", hold=False, free_after_s=2.0, kill_after_s=None, retry_s=10.0)
    time.sleep(1.0)
    scenario("C_never_back_retry_1s", hold=False, free_after_s=0.0, kill_after_s=None, retry_s=1.0)
    res.spec = spec
    res.ensure(lambda: None, 60.0)
    report["equal_after_all"] = greedy() == reference
    res.release(kv=False)
    res.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "hog":
        hog_main(sys.argv[2], sys.argv[3] == "1", float(sys.argv[4]))
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        raise SystemExit(__doc__)
