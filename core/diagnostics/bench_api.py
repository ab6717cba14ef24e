"""``timeshare bench api``: the end-to-end switch benchmark through the real API, as a client sees it.

It starts its own ``timeshare serve`` (its own ``TIMESHARE_HOME``, any free port, a one-model VRAM
budget so that every turn of the other model is a GPU switch) with two models, builds one growing
conversation per model of about ``--context`` tokens (counted with each model's own tokenizer),
and times the first streamed token at the client (request sent -> first piece of text), on the
same prompts, for:

- ``timeshare_switch``: turns alternate between the models, with the ``conversation`` extension;
- ``timeshare_same``: consecutive turns of one model (no switch);
- ``timeshare_plain_client``: alternating turns from a standard client (whole history, no
  extension: the prompt cache finds it);
- ``worker_restart``: the worker is stopped (the API's sleep with ``{"level": "stop"}``), then
  its next turn starts it again (its KV comes back from disk);
- ``fresh_process``: a new Python process loads the GGUF, prefills the conversation and samples
  one token (the process start counted: what a client waits for);

and with ``--llama-server PATH``, in the same run on the same prompts:

- ``llama_swap``: llama-swap's behaviour: stop the old model's llama-server, start one for the
  new model, wait for ``/health``, send the conversation (all of it counted);
- ``llama_server_coresident``: two llama-server processes with both models loaded at once (the
  ideal, which needs the VRAM of both; skipped, with the reason, when they do not fit).

Decode speed: a 256-token greedy answer through the API, against llama-server on the same model
and prompt (``--llama-server``), as a ratio. Prints a table (medians, ratios), ``--json`` one
object whose ``systems`` maps each system to ``{ttft_ms_median, samples, rows}``, ``--plot FILE``
draws the turns and the medians (matplotlib: ``pip install 'timeshare[bench]'``).

The tool is the product version of ``shared/tools/e2e_switch.py``: the same prompts' shape (word
salad from a fixed generator, ``User:``/``Assistant:`` turns, 8 tokens per turn, streamed
``/v1/completions``), the same llama-server flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..arena.budget import parse_budget
from ..errors import TimeshareError
from ..gguf.modelfile import gguf_problem
from ..worker.threads import cpu_threads
from .bench_api_deep import run_deep_phase, summarise_deep
from .bench_api_procs import MAX_TOKENS, LlamaServer, Serve, card_fit, decode_rate, fresh_process
from .bench_api_report import SYSTEMS, describe_fit, plot, print_table, summarise
from .card import hold_card

log = logging.getLogger(__name__)

DECODE_TOKENS = 256
#: the weights-only run's figures of the first model that the deep phase starts from
_DEEP_GUESS = ("weight_bytes", "kv_bytes", "buffer_bytes", "context_bytes")
MAX_ROUNDS = 100
RESTARTS = 3  # at most; fewer when --rounds is smaller
FRESH = 4  # fresh-process samples at most (alternating the models)
_WORDS = [
    *("river", "stone", "garden", "window", "paper", "engine", "silver", "morning", "quiet", "letter"),
    *("orange", "cable", "thunder", "market", "bottle", "candle", "forest", "planet", "doctor", "sugar"),
    *("pencil", "winter", "mirror", "jacket"),
]


def word_salad(seed: int, n: int) -> str:
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(_WORDS[x % len(_WORDS)])
    return " ".join(out)


class Conversations:
    """One growing conversation per model: a base text of about ``context`` tokens (with that
    model's tokenizer), then short turns; ``prompt(i, r)`` is model i's prompt at turn r."""

    def __init__(self, paths: list[str], context: int) -> None:
        self._models: list[Any] = []
        import llama_cpp  # before anything that imports numpy
        from llama_cpp import _internals

        self.base: list[str] = []
        self.tokens: list[Callable[[str], int]] = []
        for i, path in enumerate(paths):
            params = llama_cpp.llama_model_default_params()
            params.vocab_only = True  # the tokenizer only: no weights, no context
            vocab = _internals.LlamaModel(path_model=path, params=params, verbose=False)
            self._models.append(vocab)

            def count(text: str, v: Any = vocab) -> int:
                return len(v.tokenize(text.encode(), add_bos=True, special=False))

            n = context
            for _ in range(3):  # words per token differ by tokenizer: converge on the size
                n = max(1, round(n * context / max(1, count(word_salad(i + 1, n)))))
            self.base.append(word_salad(i + 1, n))
            self.tokens.append(count)

    def prompt(self, i: int, r: int) -> str:
        turns = "".join(
            f"\nUser: {word_salad(100 * r + k + 7 * i, 25)}\nAssistant: ok." for k in range(r + 1)
        )
        return self.base[i] + turns + "\nUser: go on\nAssistant:"

    def n_ctx(self, last_round: int) -> int:
        need = max(count(self.prompt(i, last_round)) for i, count in enumerate(self.tokens))
        need += DECODE_TOKENS + MAX_TOKENS + 64
        return 256 * -(-need // 256)


# ---- the run --------------------------------------------------------------------------------


def check_llama_server(path: str) -> str:
    """The llama-server binary to run (a path, or a name on PATH); TimeshareError when there is none."""
    found = shutil.which(path)
    if found is None:
        p = Path(path)
        if not p.exists():
            raise TimeshareError(
                f"--llama-server {path}: no such file (give the path of a llama-server binary)"
            )
        raise TimeshareError(f"--llama-server {path}: not an executable file")
    return found


def check_plot(path: str) -> None:
    """``--plot FILE`` needs matplotlib (an optional extra) and a folder to write to."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TimeshareError(
            "--plot needs matplotlib, an optional extra: pip install 'timeshare[bench]'"
        ) from None
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise TimeshareError(f"--plot {path}: the folder {parent} does not exist")


def given_or_demo_models(args: argparse.Namespace) -> list[str]:
    """The ``--model`` paths, else the two demo models (SmolLM2, Gemma 3); TimeshareError when
    the demo packages are missing."""
    from ..config import demo

    try:
        return list(args.model) if args.model else [str(demo.smollm2_path()), str(demo.gemma3_path())]
    except demo.DemoUnavailableError as exc:
        raise TimeshareError(f"{exc}; give two models with --model PATH --model PATH") from None


def check_arguments(models: Sequence[str], rounds: int, context: int, budget: str) -> None:
    """The two models, rounds, context and budget every ``bench api`` mode takes, checked:
    TimeshareError naming the option otherwise."""
    if len(models) != 2:
        raise TimeshareError(
            f"give --model exactly twice (got {len(models)}): the benchmark switches between two"
        )
    if not 1 <= rounds <= MAX_ROUNDS:
        raise TimeshareError(f"--rounds must be between 1 and {MAX_ROUNDS} (got {rounds})")
    if context < 32:
        raise TimeshareError(f"--context must be at least 32 tokens (got {context})")
    for path in models:
        if problem := gguf_problem(path):
            raise TimeshareError(problem)
    try:
        parse_budget(budget)
    except ValueError as exc:
        raise TimeshareError(f"--budget {budget!r}: {exc}") from None


def run_api_bench(
    models: list[str],
    *,
    context: int,
    rounds: int,
    llama_server: str | None = None,
    flash_attn: bool = False,
    progress: Callable[[str], None] | None = None,
    budget: str = "one-model",
    switch_only: bool = False,
    keep_logs: bool = False,
    deep: bool = False,
    progress_every_s: float | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON report. Raises TimeshareError when it cannot run.
    ``budget``: the VRAM budget of the timeshare systems (a byte budget below both models makes
    each switch a partial one); ``switch_only``: measure the switched turns only; ``keep_logs``:
    keep the work folder (serve's and the workers' logs) also when the run succeeds (the
    report's ``work`` says where); ``deep``: also the deep switch (bench_api_deep.py: the first
    model twice under an auto budget on a card that sends every parked worker to the deep level),
    compared with the weights-only switch of the same run. A request or a server's start that
    takes long is said through ``progress`` every ``progress_every_s`` (10 s): which system, row
    and round, the seconds so far and what the server says."""
    from .arena_test import model_ids_for_paths

    check_arguments(models, rounds, context, budget)
    if switch_only and llama_server:
        raise TimeshareError("--switch-only measures the switched turns only: leave out --llama-server")
    binary = check_llama_server(llama_server) if llama_server else None
    say = progress or (lambda _msg: None)
    ids = model_ids_for_paths(models)
    say(f"building two conversations of about {context} tokens")
    conv = Conversations(models, context)
    n_restarts = min(RESTARTS, rounds)
    n_ctx = conv.n_ctx(rounds + n_restarts + 1)
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in SYSTEMS}
    skipped: dict[str, str] = {}
    decode: dict[str, Any] = {"max_tokens": DECODE_TOKENS}
    report: dict[str, Any] = {
        "context": context,
        "n_ctx": n_ctx,
        "rounds": rounds,
        "max_tokens": MAX_TOKENS,
        "flash_attn": flash_attn,
        "budget": budget,
        "switch_only": switch_only,
        "llama_server": binary,
    }
    work = Path(tempfile.mkdtemp(prefix="timeshare-bench-api-"))
    if keep_logs:
        report["work"] = str(work)
    ok = False
    try:
        # every row sized to the card: each model alone, by the workers' fit rule (n_ctx as the
        # conversations need, parallel and GPU layers chosen); serve's workers fit themselves
        fits = _card_fits(models, ids, n_ctx, flash_attn, work, say)
        report["card_fit"] = fits
        unfit = {mid: f["unfit"] for mid, f in fits.items() if "unfit" in f}
        if unfit:
            why = "; ".join(f"{mid} does not fit the card even alone ({text})" for mid, text in unfit.items())
            for key in ("timeshare_switch", "timeshare_same", "timeshare_plain_client", "worker_restart"):
                skipped[key] = why
            say(f"the timeshare systems are skipped: {why}")
        else:
            first = _serve_phases(
                report,
                work,
                ids,
                models,
                conv,
                n_ctx,
                flash_attn,
                budget,
                (rounds, n_restarts),
                rows,
                decode,
                say,
                switch_only,
                progress_every_s,
            )
        if deep and not unfit:
            guess = {k: int(first.get(k) or 0) for k in _DEEP_GUESS}
            deep_rows, info = run_deep_phase(
                work, models[0], lambda _i, r: conv.prompt(0, r), n_ctx, flash_attn, rounds, guess, say
            )
            rows["timeshare_deep_switch"] = deep_rows
            weights_only = [r for r in rows["timeshare_switch"] if r["model"] == ids[0]]
            report["deep"] = {**info, **summarise_deep(deep_rows, weights_only, info)}
        if switch_only:
            ok = True
            return _summarised(report, rows, skipped, decode)
        say("fresh process: fit to the card, load the GGUF, prefill the conversation, sample a token")
        fitting = [i for i, mid in enumerate(ids) if mid not in unfit]
        if not fitting:
            skipped["fresh_process"] = "; ".join(f"{mid} does not fit the card even alone" for mid in unfit)
        for k in range(max(2, min(FRESH, rounds)) if fitting else 0):
            i = fitting[k % len(fitting)]
            row = fresh_process(models[i], n_ctx, conv.prompt(i, rounds + 1), flash_attn, work)
            if "unfit" in row:  # the card changed since the fit (another program): said, not fatal
                skipped["fresh_process"] = f"{ids[i]}: {row['unfit']}"
                say(skipped["fresh_process"])
                continue
            rows["fresh_process"].append(dict(row, model=ids[i]))
        if binary is not None and unfit:
            why = "; ".join(f"{mid} does not fit the card even alone" for mid in unfit)
            skipped["llama_swap"] = skipped["llama_server_coresident"] = why
        elif binary is not None:
            _llama_server_phases(
                binary,
                models,
                ids,
                conv,
                rounds,
                fits,
                flash_attn,
                work,
                rows,
                skipped,
                decode,
                say,
                progress_every_s,
            )
        ok = True
    finally:
        if ok and not keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"the logs are kept in {work}")
    return _summarised(report, rows, skipped, decode)


def _card_fits(
    models: list[str], ids: list[str], n_ctx: int, flash_attn: bool, work: Path, say: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """Each model alone on the card, fitted by the workers' rule (a fresh process measures it):
    ``{"n_ctx", "parallel", "n_gpu_layers", "kv_bytes", "room", "note"}`` or ``{"unfit": sentence}``."""
    fits: dict[str, dict[str, Any]] = {}
    for mid, path in zip(ids, models, strict=True):
        got = card_fit(path, n_ctx, flash_attn, work)
        fits[mid] = got.get("fit") or {"unfit": str(got.get("unfit") or "no fit reported")}
        say(f"{mid} on the card alone: {describe_fit(fits[mid])}")
    return fits


def _serve_phases(
    report: dict[str, Any],
    work: Path,
    ids: list[str],
    models: list[str],
    conv: Conversations,
    n_ctx: int,
    flash_attn: bool,
    budget: str,
    rounds: tuple[int, int],
    rows: dict[str, list[dict[str, Any]]],
    decode: dict[str, Any],
    say: Callable[[str], None],
    switch_only: bool,
    every_s: float | None = None,
) -> dict[str, Any]:
    """The timeshare systems: its own serve, whose workers fit themselves (parallel 0: auto).
    ``rounds``: the rounds and the worker restarts. Returns the first model's status at the start."""
    say(f"starting timeshare serve (n_ctx {n_ctx}, parallel auto, VRAM budget {budget})")
    serve = Serve(work, ids, models, n_ctx, flash_attn, budget=budget, progress=say, progress_every_s=every_s)
    try:
        report["serve_ready_s"] = serve.wait_ready(say)
        status = {m["id"]: m for m in serve.status().get("models", [])}
        report["models"] = [
            {
                "id": mid,
                "path": path,
                "file_bytes": os.path.getsize(path),
                "backend": status.get(mid, {}).get("backend"),
                "residency_path": status.get(mid, {}).get("residency_path"),
                "weight_bytes": status.get(mid, {}).get("weight_bytes"),
                # what its worker's fit chose (n_ctx and parallel; the note says GPU layers)
                "n_ctx": status.get(mid, {}).get("n_ctx"),
                "parallel": status.get(mid, {}).get("parallel"),
                "fit": status.get(mid, {}).get("fit"),
                "worker": serve.worker_phases(mid),  # its start's phases (attach steps)
            }
            for mid, path in zip(ids, models, strict=True)
        ]
        for m in report["models"]:
            fitted = m["fit"] or "as set"
            say(f"{m['id']} in timeshare serve: n_ctx {m['n_ctx']} x parallel {m['parallel']} ({fitted})")
        _timeshare_phases(serve, ids, conv, rounds[0], rounds[1], rows, decode, say, switch_only)
        # each overlapped restore's gate and timeline, as the workers logged them
        report["overlaps"] = {mid: serve.worker_overlaps(mid) for mid in ids}
    finally:
        serve.close()
    return dict(status.get(ids[0], {}))


def _summarised(
    report: dict[str, Any],
    rows: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    decode: dict[str, Any],
) -> dict[str, Any]:
    summarise(report, rows, skipped, decode)
    return report


def _timeshare_phases(
    serve: Serve,
    ids: list[str],
    conv: Conversations,
    rounds: int,
    n_restarts: int,
    rows: dict[str, list[dict[str, Any]]],
    decode: dict[str, Any],
    say: Callable[[str], None],
    switch_only: bool = False,
) -> None:
    systems = (("timeshare_switch", "bench-switch"), ("timeshare_plain_client", None))
    for key, conversation in systems[:1] if switch_only else systems:
        say(f"{key}: the first turn of each conversation (full prefill, not counted)")
        for i, mid in enumerate(ids):
            serve.turn(
                mid,
                conv.prompt(i, 0),
                conversation and f"{conversation}-{mid}",
                what=f"{key} {mid} first turn",
            )
        for r in range(1, rounds + 1):
            for i, mid in enumerate(ids):
                row = serve.turn(
                    mid,
                    conv.prompt(i, r),
                    conversation and f"{conversation}-{mid}",
                    what=f"{key} {mid} turn {r}/{rounds}",
                )
                rows[key].append(dict(row, round=r))
                moved = (
                    f", restored {row['restored_bytes'] / 1e9:.3f} GB" if row.get("restored_bytes") else ""
                )
                say(f"{key} {mid} turn {r}: {row['ttft_ms']:.1f} ms, switched {row['switched']}{moved}")
    if switch_only:
        return
    a = ids[0]
    say("timeshare_same: consecutive turns of one model")
    serve.turn(a, conv.prompt(0, 0), "bench-same", what=f"timeshare_same {a} first turn")
    for r in range(1, rounds + 1):
        row = serve.turn(a, conv.prompt(0, r), "bench-same", what=f"timeshare_same {a} turn {r}/{rounds}")
        rows["timeshare_same"].append(dict(row, round=r))
    say(f"decode: a {DECODE_TOKENS}-token greedy answer")
    row = serve.turn(
        a, conv.prompt(0, rounds + 1), "bench-same", max_tokens=DECODE_TOKENS, what=f"decode {a} (timeshare)"
    )
    decode["timeshare"] = dict(row, tok_s=decode_rate(row))
    for k in range(n_restarts):
        say(f"worker restart {k + 1}/{n_restarts}: sleep level stop, then the turn")
        serve.stop_worker(a)
        row = serve.turn(
            a,
            conv.prompt(0, rounds + 1 + k),
            f"bench-switch-{a}",
            what=f"worker_restart {a} {k + 1}/{n_restarts}",
        )
        # where the restart's time went, from the worker's own log (startup phases, KV read)
        rows["worker_restart"].append(dict(row, round=rounds + 1 + k, worker=serve.worker_phases(a)))


def _llama_server_phases(
    binary: str,
    models: list[str],
    ids: list[str],
    conv: Conversations,
    rounds: int,
    fits: dict[str, dict[str, Any]],
    flash_attn: bool,
    work: Path,
    rows: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    decode: dict[str, Any],
    say: Callable[[str], None],
    every_s: float | None = None,
) -> None:
    log_path = work / "llama-server.log"

    def server(i: int) -> LlamaServer:
        # sized to the card as the fit chose for the model alone: parallel slots of n_ctx each
        # (llama-server's -c is shared by its slots), the GPU layers that fit
        fit = fits[ids[i]]
        return LlamaServer(
            binary,
            models[i],
            fit["n_ctx"] * fit["parallel"],
            flash_attn,
            log_path,
            parallel=fit["parallel"],
            gpu_layers=fit["n_gpu_layers"],
            progress=say,
            progress_every_s=every_s,
            threads=cpu_threads(),  # the worker's (core/worker/threads.py)
        )

    say("llama_swap: stop the old llama-server, start the new one, wait for /health, send the turn")
    current: LlamaServer | None = None
    try:
        for r in range(1, rounds + 1):
            for i, mid in enumerate(ids):
                t0 = time.perf_counter()
                if current is not None:
                    current.stop()
                stopped = time.perf_counter()
                current = server(i)
                current.wait_healthy(say)
                ready = time.perf_counter()
                got = current.turn(conv.prompt(i, r), what=f"llama_swap {mid} turn {r}/{rounds}")
                row = dict(got, model=mid, round=r)
                row["stop_ms"] = (stopped - t0) * 1000.0
                row["ready_ms"] = (ready - t0) * 1000.0
                row["ttft_ms"] = row["ready_ms"] + got["ttft_ms"]  # from the client's request
                rows["llama_swap"].append(row)
                say(f"llama_swap {mid} turn {r}: {row['ttft_ms']:.1f} ms")
    finally:
        if current is not None:
            current.stop()
    say("llama_server_coresident: both models loaded in two llama-servers")
    servers: list[LlamaServer] = []
    try:
        for i in range(2):
            servers.append(server(i))
            try:
                servers[-1].wait_healthy(say)
            except TimeshareError as exc:
                if i == 0:
                    raise
                skipped["llama_server_coresident"] = (
                    f"the second llama-server did not start (no room?): {exc}"
                )
                say(skipped["llama_server_coresident"])
                servers.pop().stop()
        if len(servers) == 2:
            for i in range(2):
                servers[i].turn(conv.prompt(i, 0), what=f"llama_server_coresident {ids[i]} first turn")
            for r in range(1, rounds + 1):
                for i, mid in enumerate(ids):
                    got = servers[i].turn(
                        conv.prompt(i, r), what=f"llama_server_coresident {mid} turn {r}/{rounds}"
                    )
                    rows["llama_server_coresident"].append(dict(got, model=mid, round=r))
        else:
            servers[0].turn(conv.prompt(0, rounds), what=f"llama-server {ids[0]} warm-up")
        say(f"decode on llama-server: a {DECODE_TOKENS}-token greedy answer")
        row = servers[0].turn(
            conv.prompt(0, rounds + 1), n_predict=DECODE_TOKENS, what=f"decode {ids[0]} (llama-server)"
        )
        decode["llama_server"] = dict(row, tok_s=decode_rate(row))
    finally:
        for s in servers:
            s.stop()


def main(args: argparse.Namespace) -> int:
    """The ``timeshare bench api`` handler. Exit 0: it ran; 2: it could not run."""
    from .doctor import report_failure

    def progress(msg: str) -> None:
        print(f"bench api: {msg}", file=sys.stderr, flush=True)

    try:
        if args.plot:
            check_plot(args.plot)
        if args.llama_server:
            check_llama_server(args.llama_server)
        models = given_or_demo_models(args)
        # before anything starts: timeshare's systems and llama-swap's way run on the same card
        with hold_card(getattr(args, "card", None)) as card:
            if card is not None:
                progress(card.describe())
            report = run_api_bench(
                models,
                context=int(args.context),
                rounds=int(args.rounds),
                llama_server=args.llama_server,
                flash_attn=bool(args.flash_attn),
                progress=progress,
                budget=str(getattr(args, "budget", None) or "one-model"),
                switch_only=bool(getattr(args, "switch_only", False)),
                keep_logs=bool(getattr(args, "keep_logs", False)),
                deep=bool(getattr(args, "deep", False)),
            )
        if card is not None:
            report["card"] = card.to_json()
        if args.plot:
            plot(report, args.plot)
            report["plot"] = str(args.plot)
    except (TimeshareError, subprocess.TimeoutExpired, OSError) as exc:
        err = exc if isinstance(exc, TimeshareError) else TimeshareError(str(exc))
        return report_failure("bench api", err, bool(args.json))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0
