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
the same inputs are compared (the least cosine similarity over the inputs: in the last bits, except
where llama-server pools an input batched with shorter ones apart, 0.884 on the CPU:
scripts/lab/embed_vectors_oracle.py says whose vector departs from llama-cpp-python's for the input
alone). Prints a table, or ``--json`` one object.

The servers run one after the other (a GPU holds one model's weights at a time), or with
``--interleave`` both at once, their requests in turns, the first of each round alternating: on a
CPU other processes share, a burst of load then falls on both alike (the 1-minute load average
after each request is in the report, ``load_1min``).

It says on stderr what it is doing, phase by phase (a server starting, each request and its
time), and every 10 s how a long wait stands (the model's state, llama-server's ``/health``);
a request that takes longer than ``--timeout`` seconds ends the run with the phase named. The
servers it started are stopped on every way out (a SIGTERM too: timeshare/cli.py).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Target:
    """A server the bench measures: its key in the report, port, what it says of itself, and its
    name in the progress lines."""

    system: str
    port: int
    state: Callable[[], str]
    label: str


def _measure(
    targets: Sequence[_Target],
    counts: list[int],
    words: int,
    rounds: int,
    *,
    timeout_s: float,
    progress: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Each target's rows (by system): a warm-up request each, then for each count ``rounds``
    requests each; with several targets, round by round in turns, the first of a round
    alternating (what the machine is doing meanwhile falls on both alike)."""

    def post(target: _Target, texts: list[str], what: str) -> tuple[float, list[list[float]], int]:
        what = f"{target.label}: {what}"
        progress(f"{what} ...")
        got = watched(
            lambda: post_embeddings(target.port, texts, timeout_s), what, timeout_s, progress, target.state
        )
        progress(f"{what}: {got[0]:.3f} s, {got[2]} tokens, load {os.getloadavg()[0]:.1f}")
        return got

    for target in targets:  # warm: the first request after the load restores
        post(target, inputs(1, words), "warm-up, 1 input")
    out: dict[str, dict[str, Any]] = {t.system: {} for t in targets}
    for count in counts:
        texts = inputs(count, words)
        times: dict[str, list[float]] = {t.system: [] for t in targets}
        loads: dict[str, list[float]] = {t.system: [] for t in targets}
        vectors: dict[str, list[list[float]]] = {}
        tokens: dict[str, int] = {}
        for r in range(rounds):
            for target in targets if r % 2 == 0 else list(reversed(targets)):
                elapsed, vectors[target.system], tokens[target.system] = post(
                    target, texts, f"{count} input(s), round {r + 1}/{rounds}"
                )
                times[target.system].append(elapsed)
                loads[target.system].append(os.getloadavg()[0])
        for target in targets:
            median = statistics.median(times[target.system])
            out[target.system][str(count)] = {
                "inputs": count,
                "prompt_tokens": tokens[target.system],
                "seconds": times[target.system],
                "seconds_median": median,
                "inputs_per_s": count / median if median > 0 else 0.0,
                "load_1min": loads[target.system],  # after each request
                "vectors": vectors[target.system],
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


def _checked(args: argparse.Namespace) -> list[int]:
    """The counts of ``--counts``; a TimeshareError naming the option for any value the bench
    cannot run with (before anything starts)."""
    try:
        counts = [int(x) for x in str(args.counts).split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or max(counts) > 2048:
        raise TimeshareError(f"--counts takes counts from 1 to 2048, e.g. 1,64,2048 (not {args.counts!r})")
    if int(args.rounds) < 1:
        raise TimeshareError("--rounds takes 1 or more (requests per count; the median is reported)")
    if int(args.words) < 1:
        raise TimeshareError("--words takes 1 or more (words per input)")
    if int(args.parallel) < 0:
        raise TimeshareError("--parallel takes 0 (the build's default) or more sequences")
    if float(args.timeout) <= 0:
        raise TimeshareError("--timeout takes seconds above 0, e.g. 300")
    if args.interleave and not args.llama_server:
        raise TimeshareError("--interleave takes turns with llama-server: give --llama-server PATH")
    return counts


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
    counts = _checked(args)
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
    words, rounds = int(args.words), int(args.rounds)
    interleave = bool(args.interleave)
    report["interleaved"] = interleave

    def measure(targets: Sequence[_Target]) -> None:
        report["systems"].update(
            _measure(targets, counts, words, rounds, timeout_s=timeout_s, progress=progress)
        )

    with tempfile.TemporaryDirectory(prefix="timeshare-bench-embed-") as tmp, contextlib.ExitStack() as up:
        progress(f"timeshare serve, parallel {parallel or 'default'}: starting, loading {Path(model).name}")
        serve = Serve(
            Path(tmp) / "ts", ["m"], [model], int(args.n_ctx), bool(args.flash_attn), parallel=parallel
        )
        up.callback(serve.close)
        up.callback(progress, "timeshare serve: stopping")
        ready_s = serve.wait_ready(progress)
        progress(f"timeshare serve: ready in {ready_s:.1f} s ({serve.states()})")
        targets = [_Target("timeshare", serve.port, serve.states, "timeshare")]
        if not interleave:  # one server at a time (a GPU holds one model's weights at a time)
            measure(targets)
            up.close()
            targets = []
        if args.llama_server:
            server = start_llama_server(args.llama_server, model, args, Path(tmp) / "llama-server.log")
            up.callback(server.stop)
            up.callback(progress, "llama-server: stopping")
            t, tb = cpu_threads()
            flags = f"--embeddings --pooling mean -np {sequences(args)} -t {t} -tb {tb}"
            progress(f"llama-server {flags}: starting")
            healthy_s = server.wait_healthy(progress)
            progress(f"llama-server: healthy in {healthy_s:.1f} s")
            targets.append(_Target("llama_server", server.port, server.state, "llama-server"))
            measure(targets)
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
