"""``timeshare bench parallel``: concurrent streams on one model through the real API (issue 24).

For each concurrency N (``--concurrency 1,2,4,8``) it starts its own ``timeshare serve`` with one
model and ``parallel = N`` (each request has the model's whole ``--n-ctx``), sends N streamed greedy
``/v1/completions`` at once (distinct prompts of about ``--prompt-words`` words, ``--tokens`` tokens
each, no prompt cache), and reports per N: the aggregate decode rate (all completion tokens over the
time from the first request sent to the last one done), each request's first-token latency at the
client and when it finished, and the largest ``batch_size`` the answers report; for Timeshare also
each answer's ``timeshare.timings`` (where its first token went in the worker: queue_ms,
steps_before, prefill_steps, prefill_ms, first_token_ms, step_sequences, step_prompts; see
docs/API.md) and their medians (``timings_median``). ``--baseline``
also runs each N with ``parallel = 1`` (one request at a time: the queue before batching);
``--llama-server PATH`` the same N streams against ``llama-server -np N -c n_ctx×N`` on the same
model (llama-server's slots are its continuous batching). Prints a table, or ``--json`` one object.
A server's start or a request that takes long is said on stderr every 10 s (which system,
concurrency and stream, the seconds so far, what the server says).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TimeshareError
from ..worker.threads import cpu_threads
from .bench_api import word_salad
from .bench_api_procs import LlamaServer, Serve
from .bench_main import bench_main, given_or_demo_model

SYSTEMS = ("timeshare", "timeshare_parallel_1", "llama_server")


def _prompts(n: int, words: int) -> list[str]:
    return [f"Story {i}: {word_salad(1000 + i, words)}. Continue the story:" for i in range(n)]


def _at_once(n: int, one: Callable[[int], dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    """Run ``one(i)`` for i < n on n threads released together; the rows (with their start and end
    relative to the release) and the wall time from the release to the last end."""
    barrier = threading.Barrier(n + 1)
    rows: list[dict[str, Any] | BaseException] = [RuntimeError("not run")] * n
    t0 = 0.0

    def run(i: int) -> None:
        barrier.wait()
        try:
            start = time.perf_counter()
            row = one(i)
            row["start_ms"] = (start - t0) * 1000.0
            row["end_ms"] = (time.perf_counter() - t0) * 1000.0
            rows[i] = row
        except BaseException as exc:
            rows[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for r in rows:
        if isinstance(r, BaseException):
            raise TimeshareError(f"a concurrent request failed: {r}") from r
    return [r for r in rows if isinstance(r, dict)], wall


def _summary(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    tokens = sum(int(r.get("completion_tokens") or 0) for r in rows)
    ttft = [float(r["ttft_ms"]) for r in rows]
    return {
        "requests": len(rows),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "aggregate_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_median": statistics.median(ttft),
        "ttft_ms_max": max(ttft),
        "done_at_ms": sorted(float(r["end_ms"]) for r in rows),
        "batch_size_max": max(int(r.get("batch_size") or 1) for r in rows),
        "rows": rows,
    } | _timings_median(rows)


def _timings_median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each worker timing over the rows that report them ({} when none does)."""
    timed = [r["timings"] for r in rows if isinstance(r.get("timings"), dict)]
    if not timed:
        return {}
    keys = [k for k in timed[0] if all(isinstance(t.get(k), int | float) for t in timed)]
    medians = {k: statistics.median(float(t[k]) for t in timed) for k in keys}
    # what the first token took outside the worker (HTTP, the API, the pool, the pipes)
    outside = [
        float(r["ttft_ms"]) - float(r["timings"]["first_token_ms"])
        for r in rows
        if isinstance(r.get("timings"), dict) and "first_token_ms" in r["timings"]
    ]
    if outside:
        medians["outside_worker_ms"] = statistics.median(outside)
    return {"timings_median": medians}


def _timeshare(
    model: str,
    n: int,
    parallel: int,
    args: argparse.Namespace,
    work: Path,
    prompts: list[str],
    progress: Callable[[str], None],
    every_s: float | None,
) -> dict[str, Any]:
    serve = Serve(
        work,
        ["m"],
        [model],
        int(args.n_ctx),
        bool(args.flash_attn),
        parallel=parallel,
        progress=progress,
        progress_every_s=every_s,
    )
    try:
        serve.wait_ready(progress)

        def one(i: int) -> dict[str, Any]:
            body = {
                "model": "m",
                "prompt": prompts[i],
                "max_tokens": int(args.tokens),
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "cache_prompt": False,
            }
            what = f"timeshare, parallel {parallel}: {n} stream(s), stream {i + 1}"
            got = serve.stream("m", "/v1/completions", body, what)
            usage = got.get("usage") or {}
            ts = got.get("timeshare") or {}
            return {
                "ttft_ms": got["ttft_ms"],
                "total_ms": got["total_ms"],
                "completion_tokens": usage.get("completion_tokens"),
                "batch_size": ts.get("batch_size"),
                "timings": ts.get("timings"),
            }

        one(0)  # warm: the first request after the load restores the weights
        rows, wall = _at_once(n, one)
        return _summary(rows, wall)
    finally:
        serve.close()


def _llama_server(
    model: str,
    n: int,
    args: argparse.Namespace,
    work: Path,
    prompts: list[str],
    progress: Callable[[str], None],
    every_s: float | None,
) -> dict[str, Any]:
    server = LlamaServer(
        args.llama_server,
        model,
        int(args.n_ctx) * n,
        bool(args.flash_attn),
        work / f"llama-server-{n}.log",
        parallel=n,
        progress=progress,
        progress_every_s=every_s,
        threads=cpu_threads(),  # the worker's (core/worker/threads.py)
    )
    try:
        server.wait_healthy(progress)

        def one(i: int) -> dict[str, Any]:
            what = f"llama-server -np {n}: {n} stream(s), stream {i + 1}"
            return server.turn(prompts[i], n_predict=int(args.tokens), cache_prompt=False, what=what)

        one(0)
        rows, wall = _at_once(n, one)
        return _summary(rows, wall)
    finally:
        server.stop()


def run_parallel_bench(
    model: str,
    args: argparse.Namespace,
    progress: Callable[[str], None] = lambda _m: None,
    progress_every_s: float | None = None,
) -> dict[str, Any]:
    """Run the bench; returns the JSON report. ``progress``: each phase, and every
    ``progress_every_s`` (10 s) how a long wait stands."""
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise TimeshareError("--concurrency takes counts of at least 1, e.g. 1,2,4,8")
    report: dict[str, Any] = {
        "model": model,
        "n_ctx": int(args.n_ctx),
        "tokens": int(args.tokens),
        "prompt_words": int(args.prompt_words),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "levels": {},
    }
    with tempfile.TemporaryDirectory(prefix="timeshare-bench-parallel-") as tmp:
        for n in levels:
            prompts = _prompts(n, int(args.prompt_words))
            level: dict[str, Any] = {}
            progress(f"{n} stream(s): timeshare, parallel {n}")
            level["timeshare"] = _timeshare(
                model, n, n, args, Path(tmp) / f"ts-{n}", prompts, progress, progress_every_s
            )
            if args.baseline and n > 1:
                progress(f"{n} stream(s): timeshare, parallel 1 (one at a time)")
                level["timeshare_parallel_1"] = _timeshare(
                    model, n, 1, args, Path(tmp) / f"ts1-{n}", prompts, progress, progress_every_s
                )
            if args.llama_server:
                progress(f"{n} stream(s): llama-server -np {n}")
                level["llama_server"] = _llama_server(
                    model, n, args, Path(tmp), prompts, progress, progress_every_s
                )
            report["levels"][str(n)] = level
    report["load_after"] = os.getloadavg()
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"model {report['model']}, {report['tokens']} tokens per request, n_ctx {report['n_ctx']}, "
        f"{report['cpus']} CPUs, load {report['load_before'][0]:.1f} before, "
        f"{report['load_after'][0]:.1f} after"
    )
    head = f"{'N':>3}  {'system':<22} {'tok/s':>8} {'ratio':>6} {'TTFT med':>9} {'TTFT max':>9} {'batch':>5}"
    print(head + "  done at (s)")
    for n, level in report["levels"].items():
        base = level.get("llama_server")
        for system in SYSTEMS:
            s = level.get(system)
            if s is None:
                continue
            ratio = (
                f"{s['aggregate_tok_s'] / base['aggregate_tok_s']:.2f}"
                if base and system != "llama_server"
                else ""
            )
            done = ", ".join(f"{t / 1000.0:.2f}" for t in s["done_at_ms"])
            print(
                f"{n:>3}  {system:<22} {s['aggregate_tok_s']:>8.1f} {ratio:>6} {s['ttft_ms_median']:>7.0f}ms "
                f"{s['ttft_ms_max']:>7.0f}ms {s['batch_size_max']:>5}  {done}"
            )
            tm = s.get("timings_median")
            if tm:
                print(
                    f"{'':>5}worker medians: queue {tm['queue_ms']:.1f} ms, {tm['steps_before']:.0f} steps "
                    f"before, prefill {tm['prefill_steps']:.0f} step(s) {tm['prefill_ms']:.1f} ms with "
                    f"{tm['step_prompts']:.0f} prompt(s), first token {tm['first_token_ms']:.1f} ms "
                    f"(+{tm.get('outside_worker_ms', 0.0):.1f} ms outside the worker)"
                )


def main(args: argparse.Namespace) -> int:
    """The ``timeshare bench parallel`` handler. Exit 0: it ran; 2: it could not run."""
    return bench_main("bench parallel", args, given_or_demo_model, run_parallel_bench, print_table)
