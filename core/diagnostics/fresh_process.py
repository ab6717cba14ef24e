"""The "fresh process" alternative that `bench switch` and `bench api` both measure: a new Python
process loads a GGUF with the worker's own Engine, prefills a prompt (or chat messages) and
samples one greedy token, as a tool without Timeshare would after a model change.

``run`` starts ``python -m timeshare.core.diagnostics.fresh_process`` with the job as JSON on
stdin and returns the child's figures plus ``process_ttft_ms`` (process start to the first token,
the Python start counted).

The child fits the model to its device before it loads, by the workers' rule (core/config/fit.py,
core/worker/fitting.py: the device's free memory less the margin, the model alone): ``n_ctx`` as
given, ``parallel`` and the GPU layers chosen, so that it never asks more than the card
(``--card``). Its figures carry the ``fit``; a model that cannot fit even alone answers
``{"unfit": sentence}`` instead of failing. :func:`fit` asks for the fit only (llama-server's
flags are sized by it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import TimeshareError
from ..sampling import Sampling

#: the one greedy token a fresh process samples
_ONE_TOKEN = Sampling(max_tokens=1)


def run(
    path: str,
    n_ctx: int,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    flash_attn: bool = False,
    timeout: float,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """Load ``path``, prefill ``prompt`` (a completion) or ``messages`` (a chat), one token.
    Returns load_ms, in_process_ttft_ms (load + prefill + token), prefill_first_token_ms,
    prompt_tokens, prompt_tokens_evaluated and process_ttft_ms. Raises TimeshareError when the
    child fails (its last stderr lines), subprocess.TimeoutExpired after ``timeout``."""
    job = {"path": path, "n_ctx": n_ctx, "prompt": prompt, "messages": messages, "flash_attn": flash_attn}
    started = time.time()
    child = _call(job, timeout, cwd)
    if "unfit" not in child:
        child["process_ttft_ms"] = (child.pop("first_token_at") - started) * 1000.0
    return child


def fit(
    path: str, n_ctx: int, *, flash_attn: bool = False, timeout: float, cwd: Path | None = None
) -> dict[str, Any]:
    """The fit of ``path`` alone on its device now, with ``n_ctx`` (a fresh process measures the
    device): ``{"fit": {"n_ctx", "parallel", "n_gpu_layers", "kv_bytes", "room", "note"}}``, or
    ``{"unfit": sentence}`` when it cannot fit even alone. Raises as :func:`run`."""
    job = {"path": path, "n_ctx": n_ctx, "flash_attn": flash_attn, "fit_only": True}
    return _call(job, timeout, cwd)


def _call(job: dict[str, Any], timeout: float, cwd: Path | None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "timeshare.core.diagnostics.fresh_process"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,  # not a source checkout's root: `python -m` puts the cwd first on sys.path
    )
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise TimeshareError(f"the fresh process failed (exit {proc.returncode}): {tail}")
    child: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return child


def _child() -> int:
    """In the fresh process: the job from stdin, one JSON line of figures on stdout."""
    import llama_cpp  # noqa: F401  (before anything that imports numpy)

    from ..config.schema import ModelConfig
    from ..errors import OutOfDeviceMemoryError
    from ..wire.protocol import ChatMessage, Generate
    from ..worker.device import device_memory
    from ..worker.engine import Engine
    from ..worker.fitting import fit_to_device

    job = json.loads(sys.stdin.read())
    t0 = time.perf_counter()
    model = ModelConfig(
        id="fresh", path=job["path"], n_ctx=int(job["n_ctx"]), flash_attn=bool(job["flash_attn"])
    )
    try:
        fitted = fit_to_device(model, "f16", device_memory(0))
    except OutOfDeviceMemoryError as exc:
        print(json.dumps({"unfit": str(exc)}))
        return 0
    chosen = fitted.model
    fit = {
        "n_ctx": chosen.n_ctx,
        "parallel": chosen.parallel,
        "n_gpu_layers": chosen.n_gpu_layers,
        "kv_bytes": fitted.fit.kv_bytes,
        "room": fitted.fit.room,
        "note": fitted.fit.note,
    }
    if job.get("fit_only"):
        print(json.dumps({"fit": fit}))
        return 0
    engine = Engine.load(chosen, plan=fitted.plan)
    t1 = time.perf_counter()
    first: list[float] = []

    def emit(_text: str) -> None:
        if not first:
            first.extend((time.perf_counter(), time.time()))

    if job["messages"] is not None:
        messages = tuple(ChatMessage(role=m["role"], content=m["content"]) for m in job["messages"])
        req = Generate(req="fresh", messages=messages, sampling=_ONE_TOKEN, cache_prompt=False)
    else:
        req = Generate(req="fresh", prompt=job["prompt"], sampling=_ONE_TOKEN, cache_prompt=False)
    outcome = engine.generate(req, emit)
    if not first:  # the token had no text of its own
        first.extend((time.perf_counter(), time.time()))
    engine.close()
    print(
        json.dumps(
            {
                "load_ms": (t1 - t0) * 1000.0,
                "in_process_ttft_ms": (first[0] - t0) * 1000.0,
                "prefill_first_token_ms": (first[0] - t1) * 1000.0,
                "prompt_tokens": outcome.prompt_tokens,
                "prompt_tokens_evaluated": outcome.prompt_tokens_evaluated,
                "first_token_at": first[1],
                "fit": fit,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(_child())
