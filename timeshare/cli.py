"""The `timeshare` command. A bare `timeshare` starts the tray app; subcommands do the rest.

Each subcommand's handler lives with the code it drives and is imported only when used, so
`timeshare status` never loads Qt or llama.cpp. Handlers take the parsed namespace and return an
exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__

# subcommand -> "module:function"
_HANDLERS = {
    "tray": "timeshare.app.main:main",
    "doctor": "timeshare.core.diagnostics.doctor:main",
    "bench": "timeshare.core.diagnostics.bench_residency:main",
    "arena-test": "timeshare.core.diagnostics.arena_test:main",
    "serve": "timeshare.core.api.server:serve_main",
    "status": "timeshare.client:main",
    "pin": "timeshare.client:main",
    "unpin": "timeshare.client:main",
    "sleep": "timeshare.client:main",
    "wake": "timeshare.client:main",
    "chat": "timeshare.client:main",
    "models": "timeshare.client:main",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timeshare",
        description="Keep several local LLMs loaded and time-share one GPU between them.",
    )
    parser.add_argument("--version", action="version", version=f"timeshare {__version__}")
    parser.add_argument(
        "--config", metavar="PATH", help="configuration file (default: platformdirs config dir)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tray = sub.add_parser("tray", help="start the tray app (the default)")
    tray.add_argument("--background", action="store_true", help="start without opening a window (autostart)")

    doctor = sub.add_parser("doctor", help="check the residency mechanism on this machine's backend")
    doctor.add_argument("--model", metavar="PATH", help="GGUF file (default: the smallest demo model)")
    doctor.add_argument("--cycles", type=int, default=3, help="release/restore cycles (default: 3)")
    doctor.add_argument("--json", action="store_true", help="print only a JSON report on stdout")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    bres = bench_sub.add_parser("residency", help="release/restore against the raw copy limit and reloads")
    bres.add_argument("--model", metavar="PATH", required=True)
    bres.add_argument("--cycles", type=int, default=5)
    bres.add_argument("--n-ctx", type=int, default=8192)
    bres.add_argument("--json", action="store_true")
    bswitch = bench_sub.add_parser("switch", help="two workers alternating: switch time vs process restart")
    bswitch.add_argument(
        "--model", metavar="PATH", action="append", help="give it twice (default: the two demo models)"
    )
    bswitch.add_argument("--rounds", type=int, default=10)
    bswitch.add_argument("--json", action="store_true")

    arena = sub.add_parser(
        "arena-test", help="stress the VRAM arena with real workers and check the invariant"
    )
    arena.add_argument("--workers", type=int, default=3)
    arena.add_argument("--seconds", type=float, default=20.0)
    arena.add_argument(
        "--model", metavar="PATH", action="append", help="models to use (default: demo models)"
    )
    arena.add_argument(
        "--sample-memory-ms",
        type=int,
        default=50,
        metavar="N",
        help="sample each worker's memory every N ms (nvidia-smi on CUDA, else RSS) and check that "
        "no two held their weights at once (0: off; default 50)",
    )
    arena.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="run the pool and the OpenAI-compatible API without a GUI")
    serve.add_argument("--host", default=None, help="bind address (default from config: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default from config)")

    def client(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--url", help="API of the running instance (default: the one it recorded)")
        return p

    client("status", "show which model holds the GPU and every model's state").add_argument(
        "--json", action="store_true"
    )
    client("models", "list the configured models").add_argument("--json", action="store_true")
    for verb, text in (
        ("pin", "keep a model on the GPU once it has it"),
        ("unpin", "let a pinned model yield the GPU again"),
        ("sleep", "release a model's weights and KV cache to host memory"),
        ("wake", "restore a model's weights to the GPU ahead of a request"),
    ):
        client(verb, text).add_argument("model")
    chat = client("chat", "send one prompt to a model and stream the answer")
    chat.add_argument("model")
    chat.add_argument("prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.2, help="0 for greedy (default: 0.2)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command or "tray"
    if command == "tray" and not hasattr(args, "background"):
        args.background = False
    module_name, func_name = _HANDLERS[command].split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    result = handler(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
