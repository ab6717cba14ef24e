"""The frame every ``timeshare bench`` handler of the HTTP benches shares (embed, rerank, parallel):
progress lines on stderr, ``--llama-server`` checked before anything starts, the model chosen
and checked, the report printed as JSON or as the bench's table, and a failure reported the way
``doctor`` reports one (exit 2)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ..errors import TimeshareError
from ..gguf.modelfile import gguf_problem

Progress = Callable[[str], None]


def given_or_demo_model(args: argparse.Namespace) -> str:
    """``--model``, else the SmolLM2 demo model; a file that is no GGUF is a TimeshareError."""
    from ..config import demo

    try:
        model: str = args.model or str(demo.smollm2_path())
    except demo.DemoUnavailableError as exc:
        raise TimeshareError(f"{exc}; give a model with --model PATH") from None
    problem = gguf_problem(model)
    if problem:
        raise TimeshareError(problem)
    return model


def bench_main(
    name: str,
    args: argparse.Namespace,
    model_of: Callable[[argparse.Namespace], str],
    run: Callable[[str, argparse.Namespace, Progress], dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
) -> int:
    """Run the bench ``name`` ("bench embed"): ``model_of(args)`` chooses and checks the model
    (TimeshareError: it cannot run), ``run(model, args, progress)`` makes the report. Exit 0: it
    ran; 2: it could not run (a TimeshareError, a timeout or an OSError, reported)."""
    from .bench_api import check_llama_server
    from .doctor import report_failure

    def progress(msg: str) -> None:
        print(f"{name}: {msg}", file=sys.stderr, flush=True)

    try:
        if args.llama_server:
            check_llama_server(args.llama_server)
        report = run(model_of(args), args, progress)
    except (TimeshareError, subprocess.TimeoutExpired, OSError) as exc:
        err = exc if isinstance(exc, TimeshareError) else TimeshareError(str(exc))
        return report_failure(name, err, bool(args.json))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0
