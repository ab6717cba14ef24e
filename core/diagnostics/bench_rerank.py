"""``timeshare bench rerank``: reranking throughput through the real API (issue 42's target: 32
documents of about 200 tokens, at least 0.9 x llama-server's ``/v1/rerank`` on the same model).

It starts its own ``timeshare serve`` with one reranker (``--parallel`` sequences), sends one
``POST /v1/rerank`` of ``--documents`` distinct documents (``--words`` words each: a fixed word
salad, about 200 tokens with a BPE vocabulary) against a short query ``--rounds`` times after one
warm-up request, and reports documents/s (documents over the request's time at the client, the
median round). With ``--llama-server PATH`` the same requests go to ``llama-server --reranking
-np N`` on the same model; the ratio is printed and the two servers' orders and scores compared
(the largest score difference, and whether the orders agree).

The model: ``--model PATH`` (a reranker GGUF: rank pooling), or by default a synthetic one
written first (``write_synthetic_reranker``): BERT-base-shaped (12 layers, 768 wide: the shape
of bge-reranker-base and ms-marco cross-encoders), random F16 weights, the vocabulary of
``--vocab PATH`` (any GGUF with a tokenizer; default: the SmolLM2 demo model's BPE vocabulary),
rank pooling with a classifier head: its scores mean nothing, its cost is a real BERT-base
reranker's. Prints a table, or ``--json`` one object.
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
from ..gguf.modelfile import gguf_problem
from ..worker.threads import cpu_threads
from .bench_api import word_salad
from .bench_api_procs import REQUEST_TIMEOUT_S, LlamaServer, Serve
from .bench_main import bench_main

SYSTEMS = ("timeshare", "llama_server")
QUERY = "which of these passages says how the weights come back to the device after a switch?"


def documents(count: int, words: int) -> list[str]:
    """``count`` distinct documents of ``words`` words."""
    return [f"{i}: {word_salad(9100 + i, words)}" for i in range(count)]


def post_rerank(port: int, docs: list[str]) -> tuple[float, list[tuple[int, float]], int]:
    """One ``/v1/rerank`` request: its time at the client (s), (index, score) in the answer's
    order, prompt tokens (0 where the server does not say)."""
    body = json.dumps({"model": "m", "query": QUERY, "documents": docs})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        t0 = time.perf_counter()
        c.request("POST", "/v1/rerank", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        elapsed = time.perf_counter() - t0
    finally:
        c.close()
    if r.status != 200:
        raise TimeshareError(f"/v1/rerank answered {r.status}: {raw[:300]!r}")
    answer = json.loads(raw)
    results = [(int(x["index"]), float(x["relevance_score"])) for x in answer["results"]]
    usage = answer.get("usage") or {}
    return elapsed, results, int(usage.get("prompt_tokens") or 0)


def _measure(port: int, count: int, words: int, rounds: int) -> dict[str, Any]:
    docs = documents(count, words)
    post_rerank(port, docs[:2])  # warm: the first request after the load restores
    times: list[float] = []
    results: list[tuple[int, float]] = []
    tokens = 0
    for _ in range(rounds):
        elapsed, results, tokens = post_rerank(port, docs)
        times.append(elapsed)
    median = statistics.median(times)
    return {
        "documents": count,
        "prompt_tokens": tokens,
        "seconds": times,
        "seconds_median": median,
        "documents_per_s": count / median if median > 0 else 0.0,
        "results": results,
    }


#: tokenizer keys a synthetic reranker sets itself (its pair format: BOS, EOS and SEP added)
_OWN_KEYS = frozenset(
    (
        "tokenizer.ggml.sep_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_sep_token",
    )
)


def vocab_problem(path: str) -> str:
    """Why the GGUF at ``path`` cannot lend a synthetic reranker its vocabulary ("" when it can):
    not a GGUF, or no tokenizer in it (``tokenizer.ggml.model`` and ``tokenizer.ggml.tokens``)."""
    problem = gguf_problem(path)
    if problem:
        return problem
    import gguf

    try:
        fields = gguf.GGUFReader(path).fields
    except (OSError, ValueError) as exc:
        return f"{path} could not be read as a GGUF: {exc}"
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in fields]
    if missing:
        return f"{path} has no tokenizer (no {', '.join(missing)}): give a GGUF model that has one"
    return ""


def write_synthetic_reranker(
    out: Path, vocab_gguf: Path, *, layers: int = 12, width: int = 768, context: int = 512
) -> Path:
    """A BERT-shaped reranker GGUF with random F16 weights (see the module docstring): the
    tensors llama.cpp's bert loader asks for, rank pooling, a one-output classifier head, and
    ``vocab_gguf``'s vocabulary (its tokenizer model, tokens, types, merges or scores, BOS and
    EOS; adding BOS, EOS and SEP = EOS: ``[BOS] q [EOS] [SEP] d [EOS]``)."""
    import gguf
    import numpy as np

    fields = gguf.GGUFReader(str(vocab_gguf)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_bool("bert.attention.causal", False)
    w.add_uint32("bert.attention.head_count", width // 64)
    w.add_float32("bert.attention.layer_norm_epsilon", 1e-12)
    w.add_uint32("bert.block_count", layers)
    w.add_uint32("bert.context_length", context)
    w.add_uint32("bert.embedding_length", width)
    w.add_uint32("bert.feed_forward_length", 4 * width)
    w.add_uint32("bert.pooling_type", 4)  # LLAMA_POOLING_TYPE_RANK
    w.add_file_type(1)  # F16
    # the vocabulary's whole tokenizer (model, pre-tokenizer, tokens, types, merges or scores,
    # special ids, SentencePiece's space prefix...), each key with its own type
    for key, field in fields.items():
        if key.startswith("tokenizer.ggml.") and key not in _OWN_KEYS:
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), vtype, sub)
    if "tokenizer.ggml.token_type_count" not in fields:
        w.add_uint32("tokenizer.ggml.token_type_count", 2)
    if "tokenizer.ggml.bos_token_id" not in fields:
        w.add_bos_token_id(1)
    if "tokenizer.ggml.eos_token_id" not in fields:
        w.add_eos_token_id(2)
    eos = fields.get("tokenizer.ggml.eos_token_id")
    w.add_sep_token_id(int(eos.contents()) if eos is not None else 2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_bool("tokenizer.ggml.add_sep_token", True)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int, scale: float = 0.02, f16: bool = True) -> None:
        # numpy's shape is ggml's ne reversed
        a = rng.standard_normal(tuple(reversed(shape)), dtype=np.float32) * scale
        w.add_tensor(name, a.astype(np.float16) if f16 else a)

    def norm(name: str) -> None:
        w.add_tensor(f"{name}.weight", np.ones(width, dtype=np.float32))
        w.add_tensor(f"{name}.bias", np.zeros(width, dtype=np.float32))

    tensor("token_embd.weight", width, len(tokens))
    tensor("position_embd.weight", width, context)
    norm("token_embd_norm")
    for i in range(layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{part}.weight", width, width)
        norm(f"blk.{i}.attn_output_norm")
        tensor(f"blk.{i}.ffn_up.weight", width, 4 * width)
        tensor(f"blk.{i}.ffn_down.weight", 4 * width, width)
        norm(f"blk.{i}.layer_output_norm")
    tensor("cls.weight", width, width)
    tensor("cls.bias", width, f16=False)
    tensor("cls.output.weight", width, 1, scale=0.5)
    tensor("cls.output.bias", 1, f16=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def demo_vocab() -> Path:
    """The SmolLM2 demo model, whose vocabulary the synthetic reranker takes when ``--vocab`` is
    not given; TimeshareError saying what to pass where the demo packages are not installed."""
    from ..config import demo

    try:
        return demo.smollm2_path()
    except demo.DemoUnavailableError as exc:
        raise TimeshareError(
            f"{exc}: the synthetic reranker takes the SmolLM2 demo model's vocabulary by default; "
            "pass --model PATH (a reranker GGUF) or --vocab PATH (any GGUF with a tokenizer)"
        ) from None


def _compare(ours: list[tuple[int, float]], theirs: list[tuple[int, float]]) -> dict[str, Any]:
    a, b = dict(ours), dict(theirs)
    return {
        "same_order": [i for i, _ in ours] == [i for i, _ in theirs],
        "max_score_difference": max(abs(a[i] - b[i]) for i in a) if a.keys() == b.keys() else None,
    }


def run_rerank_bench(
    model: str, args: argparse.Namespace, progress: Callable[[str], None] = lambda _m: None
) -> dict[str, Any]:
    count, words, rounds = int(args.documents), int(args.words), int(args.rounds)
    if not 1 <= count <= 2048:
        raise TimeshareError("--documents takes a count from 1 to 2048")
    parallel = int(args.parallel)
    report: dict[str, Any] = {
        "model": model,
        "n_ctx": int(args.n_ctx),
        "parallel": parallel,
        "documents": count,
        "words": words,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "systems": {},
    }
    with tempfile.TemporaryDirectory(prefix="timeshare-bench-rerank-") as tmp:
        if not model:
            vocab = Path(args.vocab) if args.vocab else demo_vocab()
            progress(
                f"writing a synthetic BERT-base-shaped reranker (random F16 weights, "
                f"{vocab.name}'s vocabulary)"
            )
            model = str(write_synthetic_reranker(Path(tmp) / "synthetic-reranker.gguf", vocab))
            report["model"] = f"synthetic BERT-base reranker (12 x 768, F16, {vocab.name}'s vocabulary)"
        progress(f"timeshare serve, parallel {parallel}")
        serve = Serve(
            Path(tmp) / "ts", ["m"], [model], int(args.n_ctx), bool(args.flash_attn), parallel=parallel
        )
        try:
            progress(f"timeshare serve: ready in {serve.wait_ready(progress):.1f} s ({serve.states()})")
            report["systems"]["timeshare"] = _measure(serve.port, count, words, rounds)
        finally:
            serve.close()
        if args.llama_server:
            progress(f"llama-server --reranking -np {parallel}")
            server = LlamaServer(
                args.llama_server,
                model,
                int(args.n_ctx) * parallel,
                bool(args.flash_attn),
                Path(tmp) / "llama-server.log",
                parallel=parallel,
                extra=("--reranking",),
                threads=cpu_threads(),  # the worker's (core/worker/threads.py)
            )
            try:
                progress(f"llama-server: healthy in {server.wait_healthy(progress):.1f} s")
                report["systems"]["llama_server"] = _measure(server.port, count, words, rounds)
            finally:
                server.stop()
    ours = report["systems"]["timeshare"]
    theirs = report["systems"].get("llama_server")
    if theirs is not None:
        ours["ratio"] = (
            ours["documents_per_s"] / theirs["documents_per_s"] if theirs["documents_per_s"] else None
        )
        ours |= _compare(ours["results"], theirs["results"])
    for system in report["systems"].values():
        system.pop("results", None)
    report["load_after"] = os.getloadavg()
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"model {report['model']}, parallel {report['parallel']}, {report['documents']} documents of "
        f"{report['words']} words, {report['rounds']} round(s), {report['cpus']} CPUs, load "
        f"{report['load_before'][0]:.1f} before, {report['load_after'][0]:.1f} after"
    )
    print(
        f"{'system':<13} {'tokens':>7} {'s (median)':>11} {'docs/s':>9} {'ratio':>6} {'order':>6} "
        f"{'max diff':>9}"
    )
    for system in SYSTEMS:
        row = report["systems"].get(system)
        if row is None:
            continue
        ratio = f"{row['ratio']:.2f}" if row.get("ratio") is not None else ""
        order = ("same" if row["same_order"] else "differs") if "same_order" in row else ""
        diff = row.get("max_score_difference")
        print(
            f"{system:<13} {row['prompt_tokens']:>7} {row['seconds_median']:>11.3f} "
            f"{row['documents_per_s']:>9.1f} {ratio:>6} {order:>6} {'' if diff is None else f'{diff:.2e}':>9}"
        )


def _model_of(args: argparse.Namespace) -> str:
    """``--model`` (a reranker GGUF, checked), else "" (the synthetic one, with ``--vocab``'s
    vocabulary or the demo model's: checked before anything starts, so a machine without the demo
    packages is told what to pass)."""
    model: str = args.model or ""
    if model:
        problem = gguf_problem(model)
        if problem:
            raise TimeshareError(problem)
    elif args.vocab:
        problem = vocab_problem(args.vocab)
        if problem:
            raise TimeshareError(f"--vocab: {problem}")
    else:
        demo_vocab()
    return model


def main(args: argparse.Namespace) -> int:
    """The ``timeshare bench rerank`` handler. Exit 0: it ran; 2: it could not run."""
    return bench_main("bench rerank", args, _model_of, run_rerank_bench, print_table)
