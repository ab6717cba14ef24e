"""The `timeshare` command. A bare `timeshare` starts the tray app; subcommands do the rest.

Each subcommand's handler lives with the code it drives and is imported only when used, so
`timeshare status` never loads Qt or llama.cpp. Handlers take the parsed namespace and return an
exit status.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__
from .core.sampling import DEFAULTS
from .core.state import RELEASE_LEVELS, USER_SLEEP_LEVEL

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
    "start": "timeshare.client:main",
    "chat": "timeshare.client:main",
    "run": "timeshare.client:main",
    "models": "timeshare.client:main",
    "unload": "timeshare.client:main",
    "stop": "timeshare.client:main",
    "load": "timeshare.client:main",
    "show": "timeshare.client:main",
    "reload": "timeshare.client:main",
    "rm": "timeshare.manage:rm_main",
    "pull": "timeshare.pull:main",
    "desktop": "timeshare.app.desktop_install:main",
}
#: commands that start servers or workers of their own, each in its own session (so that a Ctrl-C
#: in the terminal reaches only this process, which stops them in order): SIGTERM and SIGHUP end
#: these as Ctrl-C does, so their finally blocks stop what they started. Before, `timeout 300
#: timeshare bench api ...` ending the run left its `timeshare serve` and workers holding the GPU.
_CLEAN_UP_ON_TERMINATE = {"bench", "arena-test", "doctor"}
# alias -> the subcommand it stands for
_ALIASES = {"ps": "status", "ls": "models"}

_CONFIG_HELP = "configuration file (default: platformdirs config dir)"
_VERBOSE_HELP = "log debug messages (chat: also the token counts and the switch cost)"
_JSON_HELP = "print the result as JSON on stdout"
_MODEL_HELP = "the model: its id, display name or a unique prefix (see `timeshare ls`)"


class _VerbParser(argparse.ArgumentParser):
    """A subcommand's parser: it also takes the global options, so `timeshare serve --config F`
    works like `timeshare --config F serve`. Their default is SUPPRESS, so a value given before
    the subcommand is not overwritten by the subcommand's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=_CONFIG_HELP)
        self.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP
        )


_CARD_HELP = (
    "measure as on a card of SIZE (8GiB, 12GiB, 16GiB, 24GiB): on a GPU a ballast process holds all "
    "but SIZE of its free memory before anything starts (a SIZE larger than the GPU, or than its free "
    "memory, is refused); on a CPU build SIZE caps the host memory the workers see instead"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timeshare",
        description="Keep several local LLMs loaded and time-share one GPU between them.",
    )
    parser.add_argument("--version", action="version", version=f"timeshare {__version__}")
    parser.add_argument("--config", metavar="PATH", help=_CONFIG_HELP)
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_VerbParser)

    tray = sub.add_parser("tray", help="start the tray app (the default)")
    tray.add_argument("--background", action="store_true", help="start without opening a window (autostart)")

    def client(name: str, help_text: str, aliases: Sequence[str] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, aliases=list(aliases))
        p.add_argument("--url", help="API of the running instance (default: the one it recorded)")
        return p

    chat = client("chat", "send one prompt to a model and stream the answer")
    chat.add_argument("model", help=_MODEL_HELP)
    chat.add_argument("prompt", nargs="?", default="-", help="the prompt; '-' or none: read it from stdin")
    _generation_options(chat, "cli_chat")
    repl = client(
        "run",
        "chat with a model interactively (one conversation; /? lists the commands); with a prompt "
        "or piped input: one answer, then exit",
    )
    repl.add_argument("model", help=_MODEL_HELP)
    repl.add_argument("prompt", nargs="?", default=None, help="answer this once and exit (else: the REPL)")
    _generation_options(repl, "cli_run")

    client(
        "status", "show which model holds the GPU and every model's state (alias: ps)", ["ps"]
    ).add_argument("--json", action="store_true", help=_JSON_HELP)
    client("models", "list the configured models (alias: ls)", ["ls"]).add_argument(
        "--json", action="store_true", help=_JSON_HELP
    )
    for verb, text in (
        ("pin", "keep a model on the GPU once it has it"),
        ("unpin", "let a pinned model yield the GPU again"),
        ("sleep", "release a model's weights (and KV cache) from the GPU"),
        ("wake", "restore a model's weights to the GPU ahead of a request"),
    ):
        verb_parser = client(verb, text)
        verb_parser.add_argument("model", help=_MODEL_HELP)
        if verb in ("sleep", "wake"):
            verb_parser.add_argument(
                "--wait",
                type=float,
                default=5.0,
                metavar="SECONDS",
                help="wait this long for the model to get there, then report its state (default: 5)",
            )
        if verb == "sleep":
            verb_parser.add_argument(
                "--level",
                choices=RELEASE_LEVELS,
                default=USER_SLEEP_LEVEL,
                help="weights: free the weights, keep the KV cache on the GPU; weights+kv: move the "
                "KV cache to host memory too (the default); stop: end the worker (its KV saved to disk)",
            )
    for verb, text in (
        ("unload", "take a model off the GPU, keeping its KV cache (= sleep --level weights)"),
        ("stop", "end a model's worker, its KV saved to disk (= sleep --level stop; load starts it)"),
        ("load", "start a model if it is stopped or failed, then put it on the GPU (start + wake)"),
    ):
        lifecycle = client(verb, text)
        lifecycle.add_argument("model", help=_MODEL_HELP)
        lifecycle.add_argument(
            "--wait",
            type=float,
            default=60.0 if verb == "load" else 5.0,
            metavar="SECONDS",
            help="wait this long for the model to get there, then report its state",
        )
    show = client("show", "a model's file, quantisation, context, template, licence and capabilities")
    show.add_argument("model", help=_MODEL_HELP)
    show.add_argument("--json", action="store_true", help=_JSON_HELP)
    client("reload", "make the running Timeshare re-read its configuration file")
    rm = client("rm", "remove a model from the configuration (the running Timeshare drops it)")
    rm.add_argument("model", help=_MODEL_HELP)
    rm.add_argument("--delete-file", action="store_true", help="also delete its GGUF file (asks first)")
    rm.add_argument("--yes", action="store_true", help="with --delete-file: do not ask")
    start = client("start", "start a failed or stopped model again (with a fresh restart budget)")
    start.add_argument("model", help=_MODEL_HELP)
    start.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="wait this long for the model to load, then report its state (default: 60)",
    )
    pull = sub.add_parser(
        "pull", help="get a model from Hugging Face or a URL (resumable, checked) and add it"
    )
    pull.add_argument(
        "source",
        help="user/repo, user/repo:QUANT, user/repo/file.gguf (hf.co/ in front is fine), "
        "or the http(s):// URL of a .gguf file",
    )
    pull.add_argument(
        "--id", help="model id to use (default: from the repo and quantisation, or the file name)"
    )
    pull.add_argument(
        "--name", help="display name to use (default: from the repo and quantisation, or the file name)"
    )
    pull.add_argument(
        "--dir",
        metavar="DIR",
        help="save the file(s) here (default: the Hugging Face cache for a repo, "
        "Timeshare's data dir models/ for a URL)",
    )
    pull.add_argument("--quant", metavar="Q", help="the quantisation to get from a repo (e.g. Q4_K_M)")
    pull.add_argument(
        "--max-size",
        metavar="SIZE",
        help="the most a file whose size the server does not say may have before the download "
        "stops (default: 64GiB; e.g. 100GiB, 500MB)",
    )
    serve = sub.add_parser("serve", help="run the pool and the OpenAI-compatible API without a GUI")
    serve.add_argument("--host", default=None, help="bind address (default from config: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default from config)")

    desktop = sub.add_parser(
        "desktop", help="add Timeshare to the desktop's application menu (this installation)"
    )
    desktop.add_argument(
        "action",
        choices=("install", "uninstall"),
        help="install: the .desktop entry and the icons into $XDG_DATA_HOME (~/.local/share); "
        "uninstall: remove them",
    )
    _add_diagnostics(sub)  # last in --help: the everyday verbs come first
    return parser


def _add_diagnostics(sub: Any) -> None:
    """doctor, bench and arena-test: the tools that measure and check the product."""
    doctor = sub.add_parser("doctor", help="check the residency mechanism on this machine's backend")
    doctor.add_argument("--model", metavar="PATH", help="GGUF file (default: the smallest demo model)")
    doctor.add_argument("--cycles", type=int, default=3, help="release/restore cycles (default: 3)")
    doctor.add_argument(
        "--mmproj",
        metavar="PATH",
        help='a vision projector checked with the model ("generated": one made for it, random weights)',
    )
    doctor.add_argument(
        "--budget",
        default="one-model",
        metavar="SIZE",
        help="also report what this VRAM budget setting gives on device 0 (auto, 20GiB, 80%%; "
        "default one-model) and whether the model fits it",
    )
    doctor.add_argument(
        "--partial",
        action="store_true",
        help="check the layer parts instead: partial releases and restores compared bitwise, and "
        "release/restore times of whole buffers against --parts parts at 50 %% kept",
    )
    doctor.add_argument(
        "--parts", type=int, default=8, metavar="N", help="layer parts for --partial (default: 8)"
    )
    doctor.add_argument(
        "--deep-floor",
        action="store_true",
        help="what a parked worker keeps on the device, part by part (CUDA context, what the first decode "
        "grew, the weights and the deep level's floor, what the kept llama context still holds), measured "
        "by nvidia-smi in a child process per variant (TIMESHARE_DEEP_INPLACE, CUDA_MODULE_LOADING)",
    )
    doctor.add_argument(
        "--context",
        type=int,
        default=0,
        metavar="N",
        help="--deep-floor: n_ctx (default 0: fitted, as a worker)",
    )
    doctor.add_argument(
        "--prompt-tokens", type=int, default=1500, metavar="N", help="--deep-floor: the first prompt's length"
    )
    doctor.add_argument("--flash-attn", action="store_true", help="--deep-floor: flash attention on")
    doctor.add_argument("--card", metavar="SIZE", help=_CARD_HELP)
    doctor.add_argument(
        "--handover",
        action="store_true",
        help="restores map device memory handed over through a holder of this run's own (issue 40), "
        "as with arena.handover: the path, the chunks handed over and allocated",
    )
    doctor.add_argument(
        "--json", action="store_true", help="print only a JSON report on stdout (progress goes to stderr)"
    )
    doctor.add_argument(
        "--env",
        action="store_true",
        help="list the environment variables Timeshare reads (class, type, default, value now) and exit",
    )

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    bres = bench_sub.add_parser("residency", help="release/restore against the raw copy limit and reloads")
    bres.add_argument("--model", metavar="PATH", required=True, help="GGUF file to measure")
    bres.add_argument("--cycles", type=int, default=5, help="release/restore cycles (default: 5)")
    bres.add_argument("--n-ctx", type=int, default=8192, help="context size (default: 8192)")
    bres.add_argument(
        "--parts",
        type=int,
        default=1,
        metavar="N",
        help="hold the weights in N layer parts (default 1: the model's own buffers)",
    )
    bres.add_argument(
        "--no-copy-probe",
        action="store_true",
        help="skip the copies under a restore's conditions (fresh buffers, pauses, another thread)",
    )
    bres.add_argument(
        "--handover",
        action="store_true",
        help="restores map device memory handed over (issue 40): bytes handed over vs allocated",
    )
    bres.add_argument("--json", action="store_true", help=_JSON_HELP)
    bswitch = bench_sub.add_parser("switch", help="two workers alternating: switch time vs process restart")
    bswitch.add_argument(
        "--model", metavar="PATH", action="append", help="give it twice (default: the two demo models)"
    )
    bswitch.add_argument("--rounds", type=int, default=10, help="switches to measure (default: 10)")
    bswitch.add_argument(
        "--budget",
        default="one-model",
        metavar="SIZE",
        help="the VRAM budget of the two workers (default one-model: they switch; a size that fits "
        "both measures turns without a switch)",
    )
    bswitch.add_argument(
        "--handover",
        action="store_true",
        help="the workers hand device memory over (arena.handover); the report counts the chunks "
        "allocated (cuMemCreate) during the switched turns",
    )
    bswitch.add_argument("--json", action="store_true", help=_JSON_HELP)
    bapi = bench_sub.add_parser(
        "api", help="first token through the real API: switch vs restart, fresh process, llama-server"
    )
    bapi.add_argument(
        "--model", metavar="PATH", action="append", help="GGUF file; give it twice (default: the demo models)"
    )
    bapi.add_argument(
        "--context", type=int, default=1024, metavar="N", help="tokens per conversation (default: 1024)"
    )
    bapi.add_argument("--rounds", type=int, default=5, help="turns per model and system (default: 5)")
    bapi.add_argument(
        "--llama-server",
        metavar="PATH",
        help="also measure llama-swap's way (stop, start, prefill) and both models in two llama-servers",
    )
    bapi.add_argument(
        "--flash-attn", action="store_true", help="flash attention for every system (default: off)"
    )
    bapi.add_argument(
        "--budget",
        default="one-model",
        metavar="SIZE",
        help="the VRAM budget of timeshare's systems (default one-model: a switch moves the whole "
        "model; a size below both models' weights: a switch moves only the layer parts that lack "
        "room, and the rows report restored_bytes)",
    )
    bapi.add_argument(
        "--switch-only", action="store_true", help="measure the switched turns only (timeshare_switch)"
    )
    bapi.add_argument(
        "--deep",
        action="store_true",
        help="also the deep switch: the first model twice under an auto budget on a card that sends "
        "every parked worker to the deep level, against the weights-only switch and the issue's target",
    )
    bapi.add_argument(
        "--responses",
        action="store_true",
        help="instead: a /v1/responses turn continuing a stored response (previous_response_id) "
        "after a switch vs the same turn through chat completions with a conversation",
    )
    bapi.add_argument(
        "--keep-logs", action="store_true", help="keep the work folder with serve's and the workers' logs"
    )
    bapi.add_argument("--card", metavar="SIZE", help=_CARD_HELP)
    bapi.add_argument("--plot", metavar="FILE.png", help="draw the turns and the medians (needs matplotlib)")
    bapi.add_argument("--json", action="store_true", help=_JSON_HELP)

    bvk = bench_sub.add_parser(
        "vk-handover",
        help="Vulkan device memory handed from one process to another as opaque fds (issue 40): "
        "works here or why not, and the timings",
    )
    bvk.add_argument("--chunks", type=int, default=8, help="chunks handed over (default: 8)")
    bvk.add_argument("--chunk-mib", type=int, default=64, help="MiB per chunk (default: 64)")
    bvk.add_argument("--device", metavar="NAME", help="the Vulkan device's name (default: the first)")
    bvk.add_argument("--json", action="store_true", help=_JSON_HELP)

    bpar = bench_sub.add_parser(
        "parallel", help="concurrent streams on one model: aggregate tok/s and first token (batching)"
    )
    bpar.add_argument("--model", metavar="PATH", help="GGUF file (default: the SmolLM2 demo model)")
    bpar.add_argument(
        "--concurrency", default="1,2,4,8", metavar="N,N,...", help="streams at once (default: 1,2,4,8)"
    )
    bpar.add_argument("--tokens", type=int, default=128, help="completion tokens per request (default: 128)")
    bpar.add_argument("--prompt-words", type=int, default=32, help="words per prompt (default: 32)")
    bpar.add_argument("--n-ctx", type=int, default=2048, help="context per request (default: 2048)")
    bpar.add_argument("--baseline", action="store_true", help="also run each N with parallel = 1")
    bpar.add_argument("--llama-server", metavar="PATH", help="also llama-server -np N on the same model")
    bpar.add_argument("--flash-attn", action="store_true", help="flash attention (default: off)")
    bpar.add_argument("--json", action="store_true", help=_JSON_HELP)

    bemb = bench_sub.add_parser(
        "embed", help="/v1/embeddings throughput: inputs/s for 1, 64 and 2,048 short inputs (batching)"
    )
    bemb.add_argument("--model", metavar="PATH", help="GGUF file (default: the SmolLM2 demo model)")
    bemb.add_argument(
        "--counts", default="1,64,2048", metavar="N,N,...", help="inputs per request (default: 1,64,2048)"
    )
    bemb.add_argument("--words", type=int, default=8, help="words per input (default: 8)")
    bemb.add_argument("--rounds", type=int, default=3, help="requests per count; the median (default: 3)")
    bemb.add_argument("--n-ctx", type=int, default=2048, help="context per sequence (default: 2048)")
    bemb.add_argument(
        "--parallel", type=int, default=0, help="the model's sequences (default 0: the build's default)"
    )
    bemb.add_argument(
        "--llama-server",
        metavar="PATH",
        help="also llama-server --embeddings --pooling mean on the same model",
    )
    bemb.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="a request that takes longer ends the run, naming it (default: 300)",
    )
    bemb.add_argument(
        "--interleave",
        action="store_true",
        help="both servers up at once, their requests in turns (a busy CPU slows both alike; "
        "needs --llama-server and room for the model twice)",
    )
    bemb.add_argument("--flash-attn", action="store_true", help="flash attention (default: off)")
    bemb.add_argument("--json", action="store_true", help=_JSON_HELP)

    brr = bench_sub.add_parser(
        "rerank", help="/v1/rerank throughput: 32 documents of ~200 tokens (issue 42), vs llama-server"
    )
    brr.add_argument(
        "--model",
        metavar="PATH",
        help="a reranker GGUF (rank pooling; default: a synthetic BERT-base-shaped one, random weights)",
    )
    brr.add_argument(
        "--vocab",
        metavar="PATH",
        help="any GGUF with a tokenizer: the synthetic reranker's vocabulary (default: the SmolLM2 "
        "demo model's; not used with --model)",
    )
    brr.add_argument("--documents", type=int, default=32, help="documents per request (default: 32)")
    brr.add_argument("--words", type=int, default=150, help="words per document, ~200 tokens (default: 150)")
    brr.add_argument("--rounds", type=int, default=5, help="requests; the median (default: 5)")
    brr.add_argument("--n-ctx", type=int, default=512, help="context per sequence (default: 512)")
    brr.add_argument("--parallel", type=int, default=8, help="sequences / llama-server slots (default: 8)")
    brr.add_argument("--llama-server", metavar="PATH", help="also llama-server --reranking on the same model")
    brr.add_argument("--flash-attn", action="store_true", help="flash attention (default: off)")
    brr.add_argument("--json", action="store_true", help=_JSON_HELP)

    arena = sub.add_parser(
        "arena-test", help="stress the VRAM arena with real workers and check the invariant"
    )
    arena.add_argument("--workers", type=int, default=3, help="worker processes (default: 3)")
    arena.add_argument("--seconds", type=float, default=20.0, help="how long to run (default: 20)")
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
    arena.add_argument(
        "--chaos",
        action="store_true",
        help="while they contend, kill -9 a random worker every --kill-every s and SIGSTOP one (the "
        "GPU holder if any) every --stop-every s for --stop-for s; the pool restarts them. Reports "
        "kills, stops, restarts, watchdog kills and lost requests (memory is not sampled)",
    )
    arena.add_argument("--kill-every", type=float, default=20.0, metavar="S", help="(--chaos; 0: no kills)")
    arena.add_argument("--stop-every", type=float, default=30.0, metavar="S", help="(--chaos; 0: no stops)")
    arena.add_argument(
        "--stop-for",
        type=float,
        default=None,
        metavar="S",
        help="(--chaos) how long a stop lasts; default 1.5 x hung-holder-s, so a stopped holder is "
        "killed by the pool's watchdog; less than hung-holder-s: a plain stall",
    )
    arena.add_argument(
        "--hung-holder-s",
        type=float,
        default=None,
        metavar="S",
        help="the pool's arena.hung_holder_s (default 30; 0: no watchdog)",
    )
    arena.add_argument(
        "--deadlock-s",
        type=float,
        default=None,
        metavar="S",
        help="a request not answered within S seconds counts as a deadlock (default 120)",
    )
    arena.add_argument(
        "--budget",
        default="one-model",
        metavar="SIZE",
        help="the VRAM budget the workers share: one-model (the default: one at a time, overlaps must "
        "be 0), a size such as 2GB or 20GiB, a share such as 80%%, or auto; several workers stay on "
        "the GPU together when they fit, and budget_violations must be 0",
    )
    arena.add_argument(
        "--parallel",
        type=int,
        default=0,
        metavar="N",
        help="each worker's models[].parallel: requests it answers at once, decoded together (0: auto, "
        "the default); the clients outnumber the workers, so N > 1 batches",
    )
    arena.add_argument("--card", metavar="SIZE", help=_CARD_HELP)
    arena.add_argument("--json", action="store_true", help=_JSON_HELP)


def _generation_options(p: argparse.ArgumentParser, front_end: str) -> None:
    """--max-tokens and --temperature; their defaults are ``front_end``'s row of sampling.DEFAULTS
    (applied when the body is built)."""
    defaults = DEFAULTS[front_end]
    p.set_defaults(front_end=front_end)
    p.add_argument(
        "--max-tokens",
        type=int,
        help="stop the answer after this many tokens (default: "
        + (f"{defaults['max_tokens']})" if defaults["max_tokens"] else "no limit: until the model ends it)"),
    )
    p.add_argument("--temperature", type=float, help=f"0 for greedy (default: {defaults['temperature']})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = _ALIASES.get(args.command, args.command) or "tray"
    args.command = command
    if command == "tray" and not hasattr(args, "background"):
        args.background = False
    module_name, func_name = _HANDLERS[command].split(":")
    clean_up = command in _CLEAN_UP_ON_TERMINATE
    if clean_up:
        _terminate_as_interrupt()
    try:
        handler = getattr(importlib.import_module(module_name), func_name)
        result = handler(args)
        sys.stdout.flush()  # a broken pipe shows here, not at exit
    except BrokenPipeError:
        return _broken_pipe()
    except KeyboardInterrupt as exc:
        if not clean_up:
            raise
        why = f" ({exc})" if str(exc) else ""
        print(f"timeshare {command}: interrupted{why}; what it started has been stopped", file=sys.stderr)
        return 130
    return int(result or 0)


def _terminate_as_interrupt() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does; a second
    one of the same signal ends the process at once (the default action)."""

    def interrupt(signum: int, _frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def _broken_pipe() -> int:
    """The reader of stdout went away (`timeshare status | head -1`): exit quietly, as a shell
    tool does (141 = 128 + SIGPIPE). stdout goes to /dev/null so the interpreter's final flush
    does not complain either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
