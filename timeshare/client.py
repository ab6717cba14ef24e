"""The CLI commands that talk to a running Timeshare through its local API.

`timeshare status|models|pin|unpin|sleep|wake|start|chat|run|unload|stop|load|show|reload` find the
API in the address file the running instance wrote (core/api/address.py); ``--url`` overrides it.
When the API needs a key, the key comes from ``$TIMESHARE_API_KEY`` or from api.key in the config
(``--config``).

Nothing here imports Qt or llama.cpp: these commands start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from . import repl_commands
from .connection import EXIT_OK, EXIT_USAGE, Api, ClientError, Endpoint, find_endpoint
from .core import words
from .core.sampling import for_front_end
from .core.state import STOP_LEVEL, UNLOAD_LEVEL, USER_SLEEP_LEVEL
from .core.util.units import human_bytes
from .image_paths import content_with_images, split_images

# ---- commands ----------------------------------------------------------------------------------


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _device_line(d: dict[str, Any]) -> str:
    """ "GPU 0 (CUDA0): budget 20GiB = 21.5 GB, 8.4 GB leased by a, b" (one line per device)."""
    name = f" ({d['name']})" if d.get("name") else ""
    held = ", ".join(d.get("holders") or []) or "nobody"
    if d.get("budget_bytes") is None:
        budget = d.get("budget") or "?"
        text = f"GPU {d.get('index', 0)}{name}: budget {budget} (one model at a time), held by {held}"
    else:
        text = (
            f"GPU {d.get('index', 0)}{name}: budget {d.get('budget')} = {d['budget_bytes'] / 1e9:.1f} GB, "
            f"{int(d.get('leased_bytes') or 0) / 1e9:.1f} GB leased by {held}"
        )
    note = f" ({d['note']})" if d.get("note") else ""
    return text + note + "\n"


def _state_text(m: dict[str, Any], gpu: bool, *, ready: bool = True) -> str:
    """A model's STATE cell in the one vocabulary (core/words.py): "on the GPU", "set aside — ready
    in 0.1 s", "partly on the GPU (62 %)", "asleep" ("in memory" where the models run on the CPU)."""
    fraction = m.get("resident_fraction")
    last = m.get("last_switch") or {}
    return words.state_words(
        str(m.get("state", "?")),
        gpu=gpu,
        resident_fraction=float(fraction) if isinstance(fraction, (int, float)) else 0.0,
        restore_ms=float(last["restore_ms"])
        if ready and last.get("switched") and last.get("restore_ms")
        else None,
    )


def held_text(m: dict[str, Any]) -> str:
    """A model's HOLDS cell: what its worker holds on the GPU now (host memory on a CPU build),
    with the parts besides the weights: "4.9 GiB: KV 4.0 GiB, buffers 0.4 GiB, context 0.5 GiB"."""
    total = int(m.get("device_bytes") or 0)
    if total <= 0:
        return "-"
    parts = [
        ("KV", m.get("kv_bytes")),
        ("buffers", m.get("buffer_bytes")),
        ("context", m.get("context_bytes")),
    ]
    weights = total - sum(int(v or 0) for _, v in parts)
    shown = [("weights", weights), *parts]
    where = " of RAM" if str(m.get("backend") or "").upper().startswith("CPU") else ""
    detail = ", ".join(f"{k} {human_bytes(int(v or 0), largest='GiB')}" for k, v in shown if int(v or 0) > 0)
    return f"{human_bytes(total, largest='GiB')}{where}: {detail}"


def print_status(status: dict[str, Any], out: TextIO) -> None:
    holder = status.get("holder")
    out.write(f"GPU holder: {holder or 'none'}{'  (switching)' if status.get('switching') else ''}\n")
    holders = {holder} if holder else set()
    devices = status.get("devices") or []
    # a line per GPU where it says more than the holder: a byte budget, several GPUs, a note
    shown = len(devices) > 1 or any(d.get("budget_bytes") is not None or d.get("note") for d in devices)
    for d in devices:
        holders.update(d.get("holders") or [])
        if shown:
            out.write(_device_line(d))
    for name, where in (status.get("served") or {}).items():
        urls = ", ".join(where.get("urls") or [])
        out.write(f"Serving {name} ({where.get('paths', '')}) at {urls}\n")
        if where.get("refused"):
            out.write(f"  {where['refused']}\n")
    models = status.get("models") or []
    if not models:
        out.write("No models are configured.\n")
        return
    stats = (status.get("switch_stats") or {}).get("per_model", {})
    gpu = words.has_gpu([str(m.get("backend") or "") for m in models])
    rows = [
        [
            "MODEL",
            "STATE",
            "BUSY",
            "ACTIVE",
            "PINNED",
            "QUEUED",
            "WEIGHTS",
            "HOLDS NOW",
            "SWITCHES",
            "LAST RESTORE",
            "NOTE",
        ]
    ]
    for m in models:
        tally = stats.get(m["id"], {})
        last = m.get("last_switch") or {}
        restore = f"{last['restore_ms']:.0f} ms" if last.get("switched") else "-"
        note = m.get("reason") or ""
        if m.get("vision"):
            note = words.READS_IMAGES + ("; " + note if note else "")
        if m.get("residency_path") == "rebuild" and m.get("residency_reason"):
            note = (note + "; " if note else "") + f"rebuild path: {m['residency_reason']}"
        rows.append(
            [
                m["id"] + (" *" if m["id"] in holders else ""),
                _state_text(m, gpu),
                "yes" if m.get("busy") else "no",
                f"{m.get('active', 0)}/{m['parallel']}" if m.get("parallel") else "-",  # answered together
                "yes" if m.get("pinned") else "no",
                str(m.get("queued", 0)),
                human_bytes(int(m.get("weight_bytes") or 0), empty="-", largest="GiB"),
                held_text(m),
                str(tally.get("switches", 0)),
                restore,
                note,
            ]
        )
    _table(rows, out)


def print_models(models: dict[str, Any], out: TextIO) -> None:
    data = models.get("data") or []
    if not data:
        out.write("No models are configured.\n")
        return
    rows = [["ID", "NAME", "STATE", "CHAT FORMAT", "LICENCE", "CAPABILITIES"]]
    for m in data:
        extra = m.get("timeshare") or {}
        rows.append(
            [
                m["id"],
                extra.get("name", ""),
                extra.get("state", ""),
                extra.get("chat_format") or "-",
                extra.get("licence", ""),
                ",".join(m.get("capabilities") or []) or "-",
            ]
        )
    _table(rows, out)


_GET_COMMANDS: dict[str, tuple[str, Callable[[dict[str, Any], TextIO], None]]] = {
    "status": ("/timeshare/v1/status", print_status),
    "models": ("/v1/models", print_models),
}
_VERB_DONE = {"pin": "pinned", "unpin": "unpinned", "sleep": "put to sleep", "wake": "woken"}
#: what a verb says when the model has not reached its target state within --wait
_VERB_PENDING = {"sleep": "going to sleep", "wake": "waking"}
#: the state each sleep level leads to
SLEEP_STATES = {"weights": "released", "weights+kv": "sleeping", "stop": "stopped"}


def _target_state(command: str, args: argparse.Namespace) -> str | None:
    if command == "wake":
        return "resident"
    if command == "sleep":
        return SLEEP_STATES[getattr(args, "level", None) or USER_SLEEP_LEVEL]
    return None  # pin, unpin: the state does not change


def _now(model: dict[str, Any]) -> str:
    """ "now on the GPU", "now set aside": a model's state after a verb, in the one vocabulary."""
    gpu = words.has_gpu([str(model.get("backend") or "")])
    return f"now {_state_text(model, gpu, ready=False)}"


def _model_of(status: dict[str, Any], model_id: str) -> dict[str, Any]:
    return next((m for m in status.get("models") or [] if m.get("id") == model_id), {})


def _verb(api: Api, args: argparse.Namespace, out: TextIO, command: str) -> int:
    """pin, unpin, sleep, wake (``command``: the endpoint's last path segment; unload and stop are
    sleeps, load a wake); reports the model's state after the command (wake and sleep wait up to
    ``--wait`` seconds for the model to get there)."""
    body = {"level": args.level} if command == "sleep" and getattr(args, "level", None) else None
    reply = api.request("POST", f"/timeshare/v1/models/{args.model}/{command}", body)
    model: dict[str, Any] = reply.get("model") or {}
    target = _target_state(command, args)
    deadline = time.monotonic() + float(getattr(args, "wait", 5.0))
    while target is not None and model.get("state") != target and model.get("state") != "failed":
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
        model = _model_of(api.request("GET", "/timeshare/v1/status"), args.model) or model
    state = model.get("state", "?")
    if target is None or state == target:
        done = _LIFECYCLE_DONE.get(args.command) or _VERB_DONE[command]
        out.write(f"{args.model}: {done} ({_now(model)})\n")
        return EXIT_OK
    reason = model.get("reason") or ""
    if state == "failed":
        raise ClientError(f"{args.model} failed: {reason or 'see `timeshare status`'}")
    detail = f"; {reason}" if reason else ""
    out.write(f"{args.model}: {_VERB_PENDING[command]} ({_now(model)}{detail})\n")
    return EXIT_OK


def _start(api: Api, args: argparse.Namespace, out: TextIO) -> int:
    """start: a FAILED or STOPPED model is spawned again; waits up to ``--wait`` seconds for its load."""
    reply = api.request("POST", f"/timeshare/v1/models/{args.model}/start")
    model: dict[str, Any] = reply.get("model") or {}
    deadline = time.monotonic() + float(getattr(args, "wait", 60.0))
    while model.get("state") in ("starting", "loading") and time.monotonic() < deadline:
        time.sleep(0.2)
        model = _model_of(api.request("GET", "/timeshare/v1/status"), args.model) or model
    state = model.get("state", "?")
    reason = model.get("reason") or ""
    if state == "failed":
        raise ClientError(f"{args.model} did not start: {reason or 'see `timeshare status`'}")
    if state in ("starting", "loading"):
        detail = f"; {reason}" if reason else ""
        out.write(f"{args.model}: starting ({_now(model)}{detail})\n")
        return EXIT_OK
    out.write(f"{args.model}: started ({_now(model)})\n")
    return EXIT_OK


_LIFECYCLE_DONE = {"unload": "unloaded (off the GPU, KV cache kept)", "stop": "stopped (KV saved)"}


def _resolve(api: Api, args: argparse.Namespace) -> None:
    """``args.model`` as the id of the model it names (an id, a display name or a unique prefix:
    modelnames' CLI rule), from the running instance's model list."""
    from .core.modelnames import resolve_cli_model

    listed = api.request("GET", "/v1/models").get("data") or []
    models = [_Listed(m["id"], (m.get("timeshare") or {}).get("name") or m["id"]) for m in listed]
    try:
        args.model = resolve_cli_model(models, args.model)
    except ValueError as exc:
        raise ClientError(str(exc)) from exc


@dataclass(frozen=True)
class _Listed:
    id: str
    display_name: str


def _load(api: Api, args: argparse.Namespace, out: TextIO) -> int:
    """load: start the model if it is stopped or failed, then wake it (Ollama's and lms' load)."""
    model = _model_of(api.request("GET", "/timeshare/v1/status"), args.model)
    if model.get("state") in ("stopped", "failed"):
        _start(api, args, io.StringIO())
    return _verb(api, args, out, "wake")


def run_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from . import manage
    from .core.errors import ConfigError

    try:
        return _run_online(args, out, err)
    except ClientError as exc:
        if not exc.not_running or args.command not in ("models", "show"):
            raise
        # nothing runs: the configured models, each "not running"
        err.write(f"({exc})\n")
        try:
            if args.command == "show":
                return _show_offline(args, out)
            data = manage.models_json(manage.configured(args))
        except ConfigError as config_exc:
            raise ClientError(str(config_exc)) from config_exc
        if args.json:
            out.write(json.dumps(data, indent=2) + "\n")
        else:
            print_models(data, out)
        return EXIT_OK


def _run_online(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from . import manage

    command = args.command
    with Api(find_endpoint(args)) as api:
        if getattr(args, "model", None) is not None:
            _resolve(api, args)
        if command in _GET_COMMANDS:
            path, show = _GET_COMMANDS[command]
            data = api.request("GET", path)
            if args.json:
                out.write(json.dumps(data, indent=2) + "\n")
            else:
                show(data, out)
            return EXIT_OK
        if command == "show":
            return manage.show(args, api.request("GET", "/timeshare/v1/status"), out)
        if command == "reload":
            answer = api.request("POST", "/timeshare/v1/reload")
            out.write(
                f"Reloaded {answer.get('config')}: models {', '.join(answer.get('models') or []) or 'none'}\n"
            )
            return EXIT_OK
        if command == "start":
            return _start(api, args, out)
        if command == "load":
            return _load(api, args, out)
        if command in _LIFECYCLE_DONE:
            args.level = UNLOAD_LEVEL if command == "unload" else STOP_LEVEL
            return _verb(api, args, out, "sleep")
        if command in _VERB_DONE:  # the command is the endpoint's last path segment
            return _verb(api, args, out, command)
        if command == "chat":
            return _chat(api, args, out, err)
        if command == "run":
            return _repl(api, args, out, err)
    raise ClientError(f"unknown command {command!r}", EXIT_USAGE)


def _show_offline(args: argparse.Namespace, out: TextIO) -> int:
    from . import manage
    from .core.errors import ConfigError
    from .core.modelnames import resolve_cli_model

    try:
        args.model = resolve_cli_model(manage.configured(args).models, args.model)
    except (ConfigError, ValueError) as exc:
        raise ClientError(str(exc)) from exc
    return manage.show(args, None, out)


# ---- generation: chat and run --------------------------------------------------------------------


def _check_generation_args(args: argparse.Namespace) -> None:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ClientError("--max-tokens must be at least 1.", EXIT_USAGE)
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        raise ClientError("--temperature must be from 0 to 2.", EXIT_USAGE)


def _read_prompt(args: argparse.Namespace, err: TextIO, stdin: TextIO) -> str:
    prompt: str | None = getattr(args, "prompt", None)
    if prompt is not None and prompt != "-":
        return prompt
    if stdin.isatty():
        err.write("(reading the prompt from stdin: end it with Ctrl-D)\n")
        err.flush()
    text = stdin.read()
    if not text.strip():
        raise ClientError("the prompt is empty: give it as an argument or on stdin.", EXIT_USAGE)
    return text.rstrip("\n")


def _waiting_text(model: dict[str, Any]) -> str:
    """Why a request to this model has no first token yet, from its ModelStatus."""
    state = model.get("state") or "?"
    reason = model.get("reason") or ""
    if state == "failed":
        return f"the model failed: {reason}" if reason else "the model failed"
    if reason:
        return reason  # "waiting for the GPU: pinned by gemma3-270m", "waiting to load: ..."
    if state in ("starting", "loading"):
        return "loading the model"
    if state == "stopped":
        return "starting the model"
    queued = int(model.get("queued") or 0)
    if queued:
        return f"queued behind {queued} request{'' if queued == 1 else 's'}"
    if state in ("released", "sleeping"):
        return f"restoring the model to the GPU (it was {_state_text(model, True)})"
    return "evaluating the prompt"


class WaitReporter:
    """Says on stderr why the answer has not started, while waiting for the first token.

    On a terminal (``live``) one line is rewritten in place every second and erased when the
    answer starts; otherwise (``-v`` with stderr not a terminal) a line is written whenever the
    reason changes, and every ``REPEAT_S``. The reason comes from ``GET /timeshare/v1/status``
    (the model's state and waiting reason), polled on a thread with its own connection.
    """

    DELAY_S = 1.0  # nothing is shown for answers that start sooner
    POLL_S = 1.0
    REPEAT_S = 15.0

    def __init__(self, endpoint: Endpoint, model: str, err: TextIO, *, live: bool) -> None:
        self.endpoint = endpoint
        self.model = model
        self.err = err
        self.live = live
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._shown = False
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="timeshare-wait", daemon=True)

    def __enter__(self) -> WaitReporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """The answer started (or ended): stop, and erase the live line. Idempotent."""
        if self._done.is_set():
            return
        with self._lock:
            self._done.set()
            if self.live and self._shown:
                self.err.write("\r\x1b[K")
                self.err.flush()

    def _run(self) -> None:
        if self._done.wait(self.DELAY_S):
            return
        last_text = ""
        last_written = 0.0
        headers = {"Authorization": f"Bearer {self.endpoint.key}"} if self.endpoint.key else {}
        with httpx.Client(base_url=self.endpoint.url, headers=headers, timeout=10.0) as http:
            while not self._done.is_set():
                try:
                    status = http.get("/timeshare/v1/status").json()
                    text = _waiting_text(_model_of(status, self.model))
                except (httpx.HTTPError, ValueError, AttributeError):
                    text = "waiting for the server"
                elapsed = time.monotonic() - self._started
                now = time.monotonic()
                with self._lock:
                    if self._done.is_set():
                        return
                    line = f"{self.model}: {text}, {elapsed:.0f} s"
                    if self.live:
                        self.err.write(f"\r\x1b[K{line}")
                        self._shown = True
                    elif text != last_text or now - last_written >= self.REPEAT_S:
                        self.err.write(f"[{line}]\n")
                        last_text, last_written = text, now
                    self.err.flush()
                self._done.wait(self.POLL_S)


def _reporter(api: Api, args: argparse.Namespace, err: TextIO) -> WaitReporter | contextlib.nullcontext[None]:
    live = _isatty(err)
    if live or getattr(args, "verbose", False):
        return WaitReporter(api.endpoint, args.model, err, live=live)
    return contextlib.nullcontext()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _generation_body(args: argparse.Namespace, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request: the options given, the rest from the command's row of sampling.DEFAULTS."""
    sampling = for_front_end(args.front_end, max_tokens=args.max_tokens, temperature=args.temperature)
    return {
        "model": args.model,
        "messages": messages,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class _Answer:
    text: str = ""
    extras: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    sent: str | list[dict[str, Any]] | None = None  # the user message's content as sent


def _user_content(text: str, err: TextIO) -> str | list[dict[str, Any]]:
    """The prompt's content: the image files it names (``./cat.png``) sent as images, as ``ollama
    run`` does (timeshare/image_paths.py)."""
    cleaned, images = split_images(text)
    for path in images:
        err.write(f"Added image '{path}'\n")
    try:
        return content_with_images(cleaned, images)
    except OSError as exc:
        raise ClientError(f"cannot read the image {exc.filename}: {exc.strerror}", EXIT_USAGE) from None


def _stream_answer(
    api: Api, args: argparse.Namespace, body: dict[str, Any], out: TextIO, err: TextIO, answer: _Answer
) -> None:
    """Stream one answer to ``out`` (progress on ``err`` until it starts), filling ``answer``."""
    with _reporter(api, args, err) as reporter:
        for event in api.stream_events("/v1/chat/completions", body):
            if reporter is not None:
                reporter.stop()
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    answer.text += text
                    out.write(text)
                    out.flush()
            answer.extras = event.get("timeshare") or answer.extras
            answer.usage = event.get("usage") or answer.usage


def _print_cost(args: argparse.Namespace, answer: _Answer, err: TextIO) -> None:
    extras = answer.extras or {}
    usage = answer.usage or {}
    switched = "switched GPU" if extras.get("switched") else "no GPU switch"
    evaluated = extras.get("prompt_tokens_evaluated")
    prompt = f"{usage.get('prompt_tokens', '?')} prompt"
    if evaluated is not None:
        prompt += f" ({evaluated} evaluated)"
    err.write(
        f"[{args.model}: {prompt} + {usage.get('completion_tokens', '?')} completion tokens; {switched}, "
        f"restore {extras.get('restore_ms', 0):.0f} ms, "
        f"first token {extras.get('first_token_ms', 0):.0f} ms]\n"
    )


def _chat(api: Api, args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO | None = None) -> int:
    _check_generation_args(args)
    prompt = _read_prompt(args, err, stdin or sys.stdin)
    answer = _Answer()
    content = _user_content(prompt, err)
    _stream_answer(
        api, args, _generation_body(args, [{"role": "user", "content": content}]), out, err, answer
    )
    out.write("\n")
    out.flush()
    if getattr(args, "verbose", False):
        _print_cost(args, answer, err)
    return EXIT_OK


REPL_PROMPT = ">>> "


def _describe_model(api: Api, model_id: str) -> str:
    try:
        info = api.request("GET", f"/v1/models/{model_id}")
    except ClientError as exc:
        return f"Model {model_id}: {exc}\n"
    extra = info.get("timeshare") or {}
    return (
        f"Model {model_id} ({extra.get('name') or model_id}): {extra.get('state', '?')}, "
        f"context {extra.get('n_ctx') or '?'} tokens, chat format {extra.get('chat_format') or '?'}"
        f"{', licence ' + extra['licence'] if extra.get('licence') else ''} "
        f"(more: `timeshare show {model_id}`)\n"
    )


def _repl(api: Api, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``timeshare run MODEL [PROMPT]``: with a prompt, or with stdin not a terminal, one answer
    (to the prompt, else to all of stdin) and exit, as ``ollama run`` does. Else one conversation
    (Timeshare's ``conversation`` extension, so each turn evaluates only its new tokens) with the
    slash commands of repl_commands (``/?`` lists them). Ctrl-C stops the answer in progress (or
    clears the line being typed); Ctrl-D or /bye exits."""
    _check_generation_args(args)
    api.request("GET", f"/v1/models/{args.model}")  # an unknown model fails now, not at the first turn
    if getattr(args, "prompt", None) is not None or not _isatty(sys.stdin):
        return _chat(api, args, out, err)
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    err.write(f"Chatting with {args.model}. Ctrl-C stops an answer; Ctrl-D or /bye exits; /? for help.\n")
    err.flush()
    conversation = f"cli-run-{uuid.uuid4().hex}"
    session = repl_commands.Session()
    while True:
        try:
            line = input(REPL_PROMPT)
        except EOFError:
            out.write("\n")
            return EXIT_OK
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, like a shell
            out.write("\n")
            continue
        line = line.strip()
        if not line:
            continue
        outcome = repl_commands.handle(line, session, lambda: _describe_model(api, args.model))
        if outcome.exit:
            return EXIT_OK
        if outcome.cleared:
            conversation = f"cli-run-{uuid.uuid4().hex}"
        if outcome.send is None:
            out.write(outcome.output)
            out.flush()
            continue
        text = outcome.send
        answer = _Answer()
        try:
            _turn(api, args, session, text, conversation, answer, out, err)
        except KeyboardInterrupt:  # the stream is closed: the server cancels the generation
            out.write("\n")
            err.write("[stopped]\n")
            err.flush()
        except ClientError as exc:
            out.write("\n")
            err.write(f"timeshare run: {exc}\n")
            err.flush()
            continue  # the turn did not happen
        if answer.text:  # what the model said, all or up to Ctrl-C, stays in the conversation
            session.messages += [
                {"role": "user", "content": answer.sent if answer.sent is not None else text},
                {"role": "assistant", "content": answer.text},
            ]


def _turn(
    api: Api,
    args: argparse.Namespace,
    session: repl_commands.Session,
    text: str,
    conversation: str,
    answer: _Answer,
    out: TextIO,
    err: TextIO,
) -> None:
    answer.sent = _user_content(text, err)  # its images stay in the conversation with it
    body = _generation_body(args, session.request_messages(answer.sent))
    body.update(session.parameters)  # /set parameter wins over the options and defaults
    body["conversation"] = conversation
    _stream_answer(api, args, body, out, err, answer)
    out.write("\n")
    out.flush()
    if getattr(args, "verbose", False):
        _print_cost(args, answer, err)


def main(args: argparse.Namespace) -> int:
    try:
        return run_command(args, sys.stdout, sys.stderr)
    except ClientError as exc:
        sys.stdout.flush()
        print(f"timeshare {args.command}: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        # closing the stream makes the server cancel the generation
        print("", file=sys.stderr)
        return 130
