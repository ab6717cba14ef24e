"""``timeshare bench api --responses``: a Responses API turn that continues a stored response
(``previous_response_id``) after a GPU switch, against the same turn through chat completions
with the ``conversation`` extension (issue 42's target: at most 1.05 x).

One ``timeshare serve`` (a one-model VRAM budget by default, so that every turn of the other model
switches) with two models A and B. Model A holds two copies of one conversation that starts with
a text of about ``--context`` tokens (with A's tokenizer): one chained through /v1/responses by
``previous_response_id`` (the server keeps the history), one through /v1/chat/completions with a
``conversation`` id (the client sends the history). Each round, for each of the two (in turn
first), B answers a short turn (the GPU leaves A), then A takes the round's new user message; the
first streamed token at the client is timed. Both copies get the same new messages and greedy
answers of ``MAX_TOKENS`` tokens, so both evaluate the same few new tokens: what differs is the
path (the store's chain, the conversation's KV, the two dialects).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TimeshareError
from .bench_api import Conversations, check_arguments, given_or_demo_models, word_salad
from .bench_api_procs import MAX_TOKENS, Serve
from .bench_api_report import median

#: the issue's target for the ratio (Responses' median first token / chat completions')
TARGET = 1.05
RESPONSES = "responses_previous_response_id"
CHAT = "chat_conversation"
LABELS = {
    RESPONSES: "/v1/responses, previous_response_id, after a switch",
    CHAT: "/v1/chat/completions, conversation, after a switch",
}


def run_responses_bench(
    models: list[str],
    *,
    context: int,
    rounds: int,
    budget: str = "one-model",
    flash_attn: bool = False,
    progress: Callable[[str], None] | None = None,
    keep_logs: bool = False,
) -> dict[str, Any]:
    """Run the comparison; returns the JSON report. Raises TimeshareError when it cannot run."""
    from .arena_test import model_ids_for_paths

    check_arguments(models, rounds, context, budget)
    say = progress or (lambda _msg: None)
    ids = model_ids_for_paths(models)
    say(f"building a conversation of about {context} tokens")
    conv = Conversations(models, context)
    n_ctx = conv.n_ctx(2 * rounds + 2)  # the chat template's markers and both answers: room to spare
    rows: dict[str, list[dict[str, Any]]] = {RESPONSES: [], CHAT: []}
    report: dict[str, Any] = {
        "context": context,
        "n_ctx": n_ctx,
        "rounds": rounds,
        "max_tokens": MAX_TOKENS,
        "budget": budget,
        "flash_attn": flash_attn,
        "target": TARGET,
    }
    work = Path(tempfile.mkdtemp(prefix="timeshare-bench-responses-"))
    if keep_logs:
        report["work"] = str(work)
    ok = False
    try:
        say(f"starting timeshare serve (n_ctx {n_ctx}, VRAM budget {budget})")
        serve = Serve(work, ids, models, n_ctx, flash_attn, budget=budget, progress=say)
        try:
            report["serve_ready_s"] = serve.wait_ready(say)
            _phases(serve, ids, conv, rounds, rows, say)
        finally:
            serve.close()
        ok = True
    finally:
        if ok and not keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"the logs are kept in {work}")
    systems: dict[str, dict[str, Any]] = {}
    medians: dict[str, float | None] = {}
    for key, found in rows.items():
        samples = [float(r["ttft_ms"]) for r in found]
        medians[key] = median(samples)
        systems[key] = {
            "label": LABELS[key],
            "ttft_ms_median": medians[key],
            "samples": samples,
            "rows": found,
        }
    report["systems"] = systems
    a, b = medians[RESPONSES], medians[CHAT]
    report["ratio"] = a / b if a is not None and b else None
    report["switched"] = all(r["switched"] for found in rows.values() for r in found)
    return report


def _phases(
    serve: Serve,
    ids: list[str],
    conv: Conversations,
    rounds: int,
    rows: dict[str, list[dict[str, Any]]],
    say: Callable[[str], None],
) -> None:
    a, b = ids
    opening = conv.base[0] + "\n\nWhat do you make of this?"
    say("the first turns of both copies and of the other model (full prefill, not counted)")
    first = serve.response_turn(a, opening, None, what=f"{RESPONSES} {a} first turn")
    previous = first["response_id"]
    if not previous:
        raise TimeshareError("/v1/responses answered without a response id (is the response stored?)")
    history = [{"role": "user", "content": opening}]
    got = serve.chat_turn(a, history, "bench-chat", what=f"{CHAT} {a} first turn")
    history.append({"role": "assistant", "content": got["text"]})
    serve.turn(b, conv.prompt(1, 0), "bench-other", what=f"the other model {b}, first turn")
    for r in range(1, rounds + 1):
        question = word_salad(100 * r + 7, 25)
        for key in (RESPONSES, CHAT) if r % 2 else (CHAT, RESPONSES):
            # the GPU leaves A
            serve.turn(b, conv.prompt(1, r), "bench-other", what=f"the other model {b}, round {r}/{rounds}")
            if key == RESPONSES:
                row = serve.response_turn(a, question, previous, what=f"{key} {a} round {r}/{rounds}")
                previous = row["response_id"]
            else:
                row = serve.chat_turn(
                    a,
                    [*history, {"role": "user", "content": question}],
                    "bench-chat",
                    what=f"{key} {a} round {r}/{rounds}",
                )
                history += [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": row["text"]},
                ]
            rows[key].append(dict(row, round=r))
            say(
                f"{key} turn {r}: {row['ttft_ms']:.1f} ms, switched {row['switched']}, "
                f"{row['prompt_tokens_evaluated']} of {row['prompt_tokens']} prompt tokens evaluated"
            )


def print_report(r: dict[str, Any]) -> None:
    print(
        f"a conversation of about {r['context']} tokens on the first model, n_ctx {r['n_ctx']}, "
        f"{r['rounds']} rounds, {r['max_tokens']} tokens per turn, VRAM budget {r['budget']}"
        + ("" if r["switched"] else "; NOT every measured turn switched")
    )
    print(f"{'first streamed token at the client':55} {'n':>3} {'median ms':>10} {'evaluated':>10}")
    for e in r["systems"].values():
        evaluated = median([float(x["prompt_tokens_evaluated"] or 0) for x in e["rows"]])
        med = "-" if e["ttft_ms_median"] is None else f"{e['ttft_ms_median']:.1f}"
        ev = "-" if evaluated is None else f"{evaluated:.0f}"
        print(f"{e['label']:55} {len(e['samples']):>3} {med:>10} {ev:>10}")
    ratio = r["ratio"]
    verdict = (
        "" if ratio is None else (" (within the target)" if ratio <= r["target"] else " (over the target)")
    )
    shown = "-" if ratio is None else f"{ratio:.3f}"
    print(f"responses / chat completions: {shown} x; target <= {r['target']}{verdict}")


def main(args: argparse.Namespace) -> int:
    """``timeshare bench api --responses``. Exit 0: it ran; 2: it could not run."""
    from .card import hold_card
    from .doctor import report_failure

    def progress(msg: str) -> None:
        print(f"bench api: {msg}", file=sys.stderr, flush=True)

    try:
        if args.llama_server or args.plot or getattr(args, "switch_only", False):
            raise TimeshareError(
                "--responses compares two APIs of timeshare: leave out --llama-server, --plot and "
                "--switch-only"
            )
        models = given_or_demo_models(args)
        with hold_card(getattr(args, "card", None)) as card:
            if card is not None:
                progress(card.describe())
            report = run_responses_bench(
                models,
                context=int(args.context),
                rounds=int(args.rounds),
                budget=str(getattr(args, "budget", None) or "one-model"),
                flash_attn=bool(args.flash_attn),
                progress=progress,
                keep_logs=bool(getattr(args, "keep_logs", False)),
            )
        if card is not None:
            report["card"] = card.to_json()
    except (TimeshareError, subprocess.TimeoutExpired, OSError) as exc:
        err = exc if isinstance(exc, TimeshareError) else TimeshareError(str(exc))
        return report_failure("bench api", err, bool(args.json))
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0
