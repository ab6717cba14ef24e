"""``timeshare doctor --deep-floor``: what a parked worker keeps on the device, part by part (issue
39: a parked worker's floor was 848 MiB by nvidia-smi on the H100, the target is 600 MiB).

One child process per variant (each its own CUDA context, as a worker): the model is fitted and
loaded as a worker loads it (core/worker/fitting.py, Engine.load), answers one prompt of about
``--prompt-tokens`` tokens, gets the residency, and is released step by step; after each step the
process's device memory is measured:

- ``cuda_context``: the driver context and the runtime, before anything is loaded;
- ``loaded``: + weights, KV cache, compute buffers (and the output buffer where it is on the device);
- ``decoded``: + what the first prompt made: ggml-cuda's memory pool (grown to the largest
  temporary a graph needed, never shrunk while the llama context lives), the cuBLAS handle and
  its workspace, captured CUDA graphs, kernels loaded on first use;
- ``released_weights``: a switch's floor (weights released, the KV cache and buffers kept);
- ``released_deep``: the deep level, in place where it is supported (the KV buffer, and the compute
  buffers where ``TIMESHARE_DEEP_INPLACE`` allows it): the parked floor of the issue's target;
- ``context_freed``: the llama context freed too (what ``sleep`` did before): the difference is
  what the kept context still holds (the pool, cuBLAS, graphs, streams; the compute buffers when
  not released in place).

Variants: as the workers run now; with ``TIMESHARE_DEEP_INPLACE=1`` (the compute buffers released
in place); on a GPU, with it and ``CUDA_MODULE_LOADING=LAZY`` and ``EAGER`` (kernels loaded on
first use or all at the context's creation: how much of the "context" is code),
``GGML_CUDA_DISABLE_GRAPHS=1`` (no captured CUDA graphs) and ``CUBLAS_WORKSPACE_CONFIG=:4096:1``
(a 4 MiB cuBLAS workspace). The process's memory is nvidia-smi's figure for its
pid where nvidia-smi sees it, else the GPU's used memory less what was used before it started; on
a CPU build, its resident memory (RSS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from .. import envvars
from ..errors import TimeshareError

STAGES = ("cuda_context", "loaded", "decoded", "released_weights", "released_deep", "context_freed")
#: the issue's target for a parked worker's floor
TARGET_MIB = 600
MIB = 2**20
CHILD_TIMEOUT_S = 600.0


def _nvidia_smi(*query: str) -> list[list[str]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def gpu_used_bytes(device: int = 0) -> int | None:
    """The GPU's used memory now (nvidia-smi), None without one."""
    rows = _nvidia_smi("--query-gpu=index,memory.used")
    for row in rows or []:
        if len(row) == 2 and row[0] == str(device) and row[1].isdigit():
            return int(row[1]) * MIB
    return None


def process_used_bytes(pid: int) -> int | None:
    """``pid``'s device memory by nvidia-smi (None: not listed, e.g. another PID namespace)."""
    rows = _nvidia_smi("--query-compute-apps=pid,used_memory")
    total = None
    for row in rows or []:
        if len(row) == 2 and row[0] == str(pid) and row[1].isdigit():
            total = (total or 0) + int(row[1]) * MIB
    return total


def variants(gpu: bool) -> list[tuple[str, dict[str, str]]]:
    out = [("as the workers run", {}), ("TIMESHARE_DEEP_INPLACE=1", {envvars.DEEP_INPLACE.name: "1"})]
    if gpu:
        deep = {envvars.DEEP_INPLACE.name: "1"}
        for loading in ("LAZY", "EAGER"):  # how much of the "context" is kernels' code
            out.append((f"+ CUDA_MODULE_LOADING={loading}", {**deep, "CUDA_MODULE_LOADING": loading}))
        # what the captured CUDA graphs and cuBLAS's workspace keep (ggml-cuda and cuBLAS read these)
        out.append(("+ GGML_CUDA_DISABLE_GRAPHS=1", {**deep, "GGML_CUDA_DISABLE_GRAPHS": "1"}))
        out.append(("+ CUBLAS_WORKSPACE_CONFIG=:4096:1", {**deep, "CUBLAS_WORKSPACE_CONFIG": ":4096:1"}))
    return out


def run_deep_floor(
    model: str, n_ctx: int = 0, prompt_tokens: int = 1500, flash_attn: bool = False, progress: Any = None
) -> dict[str, Any]:
    """Every variant in its own child process; returns the report. Raises TimeshareError when a
    child fails."""
    say = progress or (lambda _msg: None)
    gpu = gpu_used_bytes() is not None
    report: dict[str, Any] = {"model": model, "n_ctx": n_ctx, "prompt_tokens": prompt_tokens, "gpu": gpu}
    report["target_mib"] = TARGET_MIB
    runs = []
    for name, env in variants(gpu):
        say(f"deep floor: {name}")
        job = {"path": model, "n_ctx": n_ctx, "prompt_tokens": prompt_tokens, "flash_attn": flash_attn}
        job["gpu_used_before"] = gpu_used_bytes()
        proc = subprocess.run(
            [sys.executable, "-m", "timeshare.core.diagnostics.deep_floor"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
            env=envvars.environment(**env),
        )
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
            raise TimeshareError(f"deep floor ({name}): the child failed (exit {proc.returncode}): {tail}")
        got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append({"variant": name, "env": env, **got})
    report["runs"] = runs
    return report


def parts(stages: dict[str, int], kv: int, compute: int) -> dict[str, int]:
    """The parts of the floor from the stages' figures (bytes; negative where noise wins)."""
    return {
        "cuda_context": stages["cuda_context"],
        "decode_growth": stages["decoded"] - stages["loaded"],
        "weights_level_floor": stages["released_weights"],
        "deep_floor": stages["released_deep"],
        "kept_by_the_llama_context": stages["released_deep"] - stages["context_freed"],
        "left_after_context_freed": stages["context_freed"] - stages["cuda_context"],
        "kv_bytes": kv,
        "compute_device_bytes": compute,
    }


def print_report(r: dict[str, Any]) -> None:
    measure = "nvidia-smi (MiB)" if r["gpu"] else "RSS (MiB)"
    print(
        f"deep floor of {r['model']}: process memory by {measure} after each step; target ≤ {TARGET_MIB} MiB"
    )
    print(f"{'variant':58} " + " ".join(f"{s[:14]:>14}" for s in STAGES))
    for run in r["runs"]:
        cells = " ".join(f"{run['stages'][s] / MIB:>14.0f}" for s in STAGES)
        print(f"{run['variant']:58} {cells}")
    for run in r["runs"]:
        p = {k: v / MIB for k, v in run["parts"].items()}
        kept = "pool, cuBLAS, graphs" + ("" if run["compute_released_bytes"] else ", compute buffers")
        words = [
            f"deep floor {p['deep_floor']:.0f} MiB = CUDA context {p['cuda_context']:.0f}",
            f"+ kept by the llama context {p['kept_by_the_llama_context']:.0f} ({kept})",
            f"+ left after it was freed {p['left_after_context_freed']:.0f};",
            f"the first decode grew it by {p['decode_growth']:.0f}; KV {p['kv_bytes']:.0f},",
            f"compute buffers {p['compute_device_bytes']:.0f}",
            f"(released in place: {run['compute_released_bytes'] / MIB:.0f})",
        ]
        note = f"; {run['deep_note']}" if run.get("deep_note") else ""
        print(f"  {run['variant']}: " + " ".join(words) + note)


# ---- the child -------------------------------------------------------------------------------

_WORDS = ("river", "stone", "light", "garden", "window", "market", "winter", "paper", "silver", "forest")


def _words(n: int) -> str:
    """About ``n`` tokens of plain words (a fixed sequence: every variant prefills the same)."""
    return " ".join(_WORDS[(i * 7 + i // 10) % len(_WORDS)] for i in range(n))


def _child() -> int:
    import llama_cpp  # noqa: F401  (before anything that imports numpy)

    from ..config.schema import ModelConfig
    from ..residency import Residency, ResidencyOptions
    from ..residency.measure import rss_bytes
    from ..sampling import Sampling
    from ..wire.protocol import Generate
    from ..worker.device import device_memory
    from ..worker.engine import Engine
    from ..worker.fitting import fit_to_device
    from ..worker.footprint import compute_bytes

    job = json.loads(sys.stdin.read())
    before = job.get("gpu_used_before")
    pid = os.getpid()

    def used() -> int:
        if before is None:  # a CPU build: this process's resident memory
            return rss_bytes()
        mine = process_used_bytes(pid)
        if mine is not None:
            return mine
        now = gpu_used_bytes()
        return 0 if now is None else now - int(before)

    stages: dict[str, int] = {}
    dev = device_memory(0)  # the CUDA context exists from here
    time.sleep(0.2)
    stages["cuda_context"] = used()
    model = ModelConfig(
        id="deep-floor", path=job["path"], n_ctx=int(job["n_ctx"]), flash_attn=bool(job["flash_attn"])
    )
    fitted = fit_to_device(model, "f16", dev)
    engine = Engine.load(fitted.model, use_mmap=Residency.probe().use_mmap_for_inplace, plan=fitted.plan)
    try:
        stages["loaded"] = used()
        compute = compute_bytes(engine.llm.ctx).device if dev.gpu else 0
        prompt = _words(int(job["prompt_tokens"]))
        engine.generate(
            Generate(req="floor", prompt=prompt, sampling=Sampling(max_tokens=8), cache_prompt=False),
            lambda _t: None,
        )
        stages["decoded"] = used()
        res = Residency.attach(engine.llm, job["path"], ResidencyOptions(mode="auto"))
        try:
            res.release(kv=False)
            stages["released_weights"] = used()
            res.release(kv=True)
            stages["released_deep"] = used()
            deep = {
                "in_place": res.kv_in_place,
                "compute_released_bytes": res.compute_released_bytes,
                "deep_note": res.deep_note,
            }
            res.release(kv=True, free_context=True)
            stages["context_freed"] = used()
        finally:
            res.close()
    finally:
        engine.close()
    out = {
        "fit": {"n_ctx": fitted.model.n_ctx, "parallel": fitted.model.parallel, "note": fitted.fit.note},
        "stages": stages,
        **deep,
        "parts": parts(stages, fitted.fit.kv_bytes, compute),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
