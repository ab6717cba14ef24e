"""``timeshare bench embed``: embedding throughput through the real API (issue 45).

It starts its own ``timeshare serve`` with one model (``--parallel`` sequences; 0: the build's
default), and for each count of ``--counts`` (default 1, 64, 2048: one input, a request of a RAG
ingestion, OpenAI's maximum) sends one ``POST /v1/embeddings`` of that many short distinct inputs
(``--words`` words each, a fixed word salad) ``--rounds`` times, after one warm-up request, and
reports inputs/s (inputs over the request's time at the client, the median round). With
``--llama-server PATH`` the same requests go to ``llama-server --embeddings --pooling mean -np N``
on the same model (mean pooling is what Timeshare does on a chat model; llama-server refuses
``/v1/embeddings`` with pooling ``none``) and the CPU threads Timeshare's worker computes with
(``-t``/``-tb``: core/worker/threads.py; on a GPU they matter little, on a CPU they are the
comparison), the ratio is printed, and the two servers' vectors for
the same inputs are compared (the least cosine similarity over the inputs: they differ in the
last bits, llama-server's KV cache being unified). Prints a table, or ``--json`` one object.

It says on stderr what it is doing, phase by phase (a server starting, each request and its
time), and every 10 s how a long wait stands (the model's state, llama-server's ``/health``);
a request that takes longer than ``--timeout`` seconds ends the run with the phase named. The
servers it started are stopped on every way out (a SIGTERM too: timeshare/cli.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TimeshareError
from ..worker.threads import cpu_threads
from .bench_api import word_salad
from .bench_api_procs import LlamaServer, Serve, watched
from .bench_main import bench_main, given_or_demo_model

#: a request of the bench that takes longer fails the run (``--timeout``)
DEFAULT_TIMEOUT_S = 300.0

SYSTEMS = ("timeshare", "llama_server")


def inputs(count: int, words: int) -> list[str]:
    """``count`` distinct short texts of ``words`` words."""
    return [f"{i}: {word_salad(7000 + i, words)}" for i in range(count)]


def post_embeddings(
    port: int, texts: list[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[float, list[list[float]], int]:
    """One ``/v1/embeddings`` request: its time at the client (s), the vectors, prompt tokens."""
    body = json.dumps({"model": "m", "input": texts, "encoding_format": "float"})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        t0 = time.perf_counter()
        c.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        elapsed = time.perf_counter() - t0
    finally:
        c.close()
    if r.status != 200:
        raise TimeshareError(f"/v1/embeddings answered {r.status}: {raw[:300]!r}")
    answer = json.loads(raw)
    data = sorted(answer["data"], key=lambda d: int(d["index"]))
    usage = answer.get("usage") or {}
    return elapsed, [list(d["embedding"]) for d in data], int(usage.get("prompt_tokens") or 0)


def _measure(
    port: int,
    counts: list[int],
    words: int,
    rounds: int,
    *,
    system: str,
    timeout_s: float,
    progress: Callable[[str], None],
    state: Callable[[], str],
) -> dict[str, Any]:
    def post(texts: list[str], what: str) -> tuple[float, list[list[float]], int]:
        progress(f"{what} ...")
        got = watched(lambda: post_embeddings(port, texts, timeout_s), what, timeout_s, progress, state)
        progress(f"{what}: {got[0]:.3f} s, {got[2]} tokens")
        return got

    # warm: the first request after the load restores
    post(inputs(1, words), f"{system}: warm-up, 1 input")
    out: dict[str, Any] = {}
    for count in counts:
        texts = inputs(count, words)
        times: list[float] = []
        vectors: list[list[float]] = []
        tokens = 0
        for r in range(rounds):
            elapsed, vectors, tokens = post(texts, f"{system}: {count} input(s), round {r + 1}/{rounds}")
            times.append(elapsed)
        median = statistics.median(times)
        out[str(count)] = {
            "inputs": count,
            "prompt_tokens": tokens,
            "seconds": times,
            "seconds_median": median,
            "inputs_per_s": count / median if median > 0 else 0.0,
            "vectors": vectors,
        }
    return out


def _least_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    import numpy as np  # only to compare; imported where used, as bench_rerank's writer does

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise TimeshareError(f"the two servers gave vectors of shapes {x.shape} and {y.shape}")
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    dots = np.einsum("ij,ij->i", x, y)
    cos = np.where((nx > 0) & (ny > 0), dots / np.maximum(nx * ny, 1e-300), 0.0)
    return float(min(1.0, cos.min())) if len(cos) else 1.0


def sequences(args: argparse.Namespace) -> int:
    """The sequences Timeshare's worker embeds with: ``--parallel``, or (0) the build's default as
    the worker resolves it; llama-server gets as many slots."""
    from ..worker.device import default_parallel  # asks llama.cpp whether the build has a GPU

    return int(args.parallel) if int(args.parallel) > 0 else default_parallel()


def start_llama_server(binary: str, model: str, args: argparse.Namespace, log: Path) -> LlamaServer:
    """llama-server on ``model`` as the bench compares it: embeddings, mean pooling, a slot of
    ``--n-ctx`` per sequence of Timeshare's worker (``sequences``) and its threads (``cpu_threads``)."""
    n = sequences(args)
    return LlamaServer(
        binary,
        model,
        int(args.n_ctx) * n,
        bool(args.flash_attn),
        log,
        parallel=n,
        extra=("--embeddings", "--pooling", "mean"),
        threads=cpu_threads(),
    )


def run_embed_bench(
    model: str, args: argparse.Namespace, progress: Callable[[str], None] = lambda _m: None
) -> dict[str, Any]:
    counts = [int(x) for x in str(args.counts).split(",") if x.strip()]
    if not counts or min(counts) < 1 or max(counts) > 2048:
        raise TimeshareError("--counts takes counts from 1 to 2048, e.g. 1,64,2048")
    parallel = int(args.parallel)
    report: dict[str, Any] = {
        "model": model,
        "n_ctx": int(args.n_ctx),
        "parallel": parallel,
        "words": int(args.words),
        "rounds": int(args.rounds),
        "cpus": os.cpu_count(),
        "threads": list(cpu_threads()),  # both servers': one token, a batch
        "load_before": os.getloadavg(),
        "systems": {},
    }
    timeout_s = float(args.timeout)
    if timeout_s <= 0:
        raise TimeshareError("--timeout takes seconds above 0, e.g. 300")
    words, rounds = int(args.words), int(args.rounds)
    with tempfile.TemporaryDirectory(prefix="timeshare-bench-embed-") as tmp:
        progress(f"timeshare serve, parallel {parallel or 'default'}: starting, loading {Path(model).name}")
        serve = Serve(
            Path(tmp) / "ts", ["m"], [model], int(args.n_ctx), bool(args.flash_attn), parallel=parallel
        )
        try:
            ready_s = serve.wait_ready(progress)
            progress(f"timeshare serve: ready in {ready_s:.1f} s ({serve.states()})")
            report["systems"]["timeshare"] = _measure(
                serve.port,
                counts,
                words,
                rounds,
                system="timeshare",
                timeout_s=timeout_s,
                progress=progress,
                state=serve.states,
            )
        finally:
            progress("timeshare serve: stopping")
            serve.close()
        if args.llama_server:
            server = start_llama_server(args.llama_server, model, args, Path(tmp) / "llama-server.log")
            t, tb = cpu_threads()
            flags = f"--embeddings --pooling mean -np {sequences(args)} -t {t} -tb {tb}"
            progress(f"llama-server {flags}: starting")
            try:
                healthy_s = server.wait_healthy(progress)
                progress(f"llama-server: healthy in {healthy_s:.1f} s")
                report["systems"]["llama_server"] = _measure(
                    server.port,
                    counts,
                    words,
                    rounds,
                    system="llama-server",
                    timeout_s=timeout_s,
                    progress=progress,
                    state=server.state,
                )
            finally:
                progress("llama-server: stopping")
                server.stop()
    progress("comparing the vectors")
    ours = report["systems"]["timeshare"]
    theirs = report["systems"].get("llama_server")
    for key, row in ours.items():
        if theirs is not None:
            other = theirs[key]
            row["ratio"] = row["inputs_per_s"] / other["inputs_per_s"] if other["inputs_per_s"] else None
            row["least_cosine_vs_llama_server"] = _least_cosine(row["vectors"], other["vectors"])
    for system in report["systems"].values():
        for row in system.values():
            row.pop("vectors", None)
    report["load_after"] = os.getloadavg()
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"model {report['model']}, parallel {report['parallel'] or 'default'}, {report['words']} words "
        f"per input, {report['rounds']} round(s), {report['cpus']} CPUs, threads "
        f"{report['threads'][0]}/{report['threads'][1]} (one token/batch), load "
        f"{report['load_before'][0]:.1f} before, {report['load_after'][0]:.1f} after"
    )
    print(
        f"{'inputs':>6}  {'system':<13} {'tokens':>7} {'s (median)':>11} {'inputs/s':>9} "
        f"{'ratio':>6} {'cos':>9}"
    )
    counts = list(report["systems"]["timeshare"])
    for key in counts:
        for system in SYSTEMS:
            row = report["systems"].get(system, {}).get(key)
            if row is None:
                continue
            ratio = f"{row['ratio']:.2f}" if row.get("ratio") is not None else ""
            cos = (
                f"{row['least_cosine_vs_llama_server']:.6f}" if "least_cosine_vs_llama_server" in row else ""
            )
            print(
                f"{row['inputs']:>6}  {system:<13} {row['prompt_tokens']:>7} {row['seconds_median']:>11.3f} "
                f"{row['inputs_per_s']:>9.1f} {ratio:>6} {cos:>9}"
            )


def main(args: argparse.Namespace) -> int:
    """The ``timeshare bench embed`` handler. Exit 0: it ran; 2: it could not run."""
    return bench_main("bench embed", args, given_or_demo_model, run_embed_bench, print_table)
