"""The processes ``timeshare bench api`` drives and its HTTP client: ``timeshare serve`` in its own
home, llama-server, and the fresh process (core/diagnostics/fresh_process.py) with this bench's fields."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .. import envvars
from ..errors import TimeshareError
from . import fresh_process as fresh_process_

MAX_TOKENS = 8  # per turn: the benchmark is about the first token
_STARTUP_RE = re.compile(r"startup phases \(ms\)[^{]*(\{.*\})\s*$")
_FILLED_RE = re.compile(r"filled \(deferred\) in (\d+) ms")
_OVERLAP_RE = re.compile(r"overlapped restore settled \(.*?\): (\{.*\})\s*$")
_KV_READ_RE = re.compile(r"KV loaded from disk \((\d+) tokens, ([\d.]+) MB in (\d+) ms")
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
#: a wait (a server's start, a long request) says how it stands this often (``watched``)
PROGRESS_EVERY_S = 10.0

T = TypeVar("T")


def _quiet(_msg: str) -> None:
    pass


def watched(
    call: Callable[[], T],
    what: str,
    timeout_s: float,
    progress: Callable[[str], None] = _quiet,
    state: Callable[[], str] = lambda: "",
    every_s: float | None = None,
) -> T:
    """``call()`` on a thread of its own, saying every ``every_s`` (PROGRESS_EVERY_S) how long it
    has taken (and ``state()``: what the server says meanwhile); a TimeshareError naming ``what``
    when it has not returned in ``timeout_s`` (the thread is left to the socket's own timeout and
    the server's end). What ``call`` raises is raised here. The benches' requests (``stream``,
    ``bench embed``'s) and waits go through it."""
    every = PROGRESS_EVERY_S if every_s is None else every_s
    result: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="bench-request", daemon=True)
    started = time.monotonic()
    thread.start()
    while True:
        elapsed = time.monotonic() - started
        thread.join(max(0.0, min(every, timeout_s - elapsed)))
        if not thread.is_alive():
            break
        elapsed = time.monotonic() - started
        now = state()
        if elapsed >= timeout_s:
            raise TimeshareError(f"{what}: no answer in {timeout_s:g} s{f' ({now})' if now else ''}")
        progress(f"{what}: {elapsed:.0f} s so far{f' ({now})' if now else ''}")
    if failed:
        raise failed[0]
    return result[0]


# ---- HTTP -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(port: int, method: str, path: str, body: object = None, timeout: float = 10.0) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        c.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        r = c.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw or b"null")
        except ValueError:
            return r.status, None
    finally:
        c.close()


def _piece(event: dict[str, Any]) -> str | None:
    """The text an event of a stream carries: a completion chunk's, a chat chunk's delta, a
    Responses ``response.output_text.delta``, llama-server's ``content``."""
    if event.get("type") == "response.output_text.delta":
        return str(event.get("delta") or "")
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        return choice.get("text") or (choice.get("delta") or {}).get("content")
    content = event.get("content")
    return content if isinstance(content, str) else None


def stream(
    port: int,
    path: str,
    body: dict[str, Any],
    *,
    what: str = "",
    progress: Callable[[str], None] = _quiet,
    state: Callable[[], str] = lambda: "",
    every_s: float | None = None,
) -> dict[str, Any]:
    """POST a streaming request; the client's view: time to the first piece of text, total time,
    the text, and what the last events said (usage, Timeshare's ``timeshare``, llama-server's
    timings; a Responses stream's final response: its ``id`` too). With ``progress``, a request
    that takes long is said every ``every_s`` (``watched``: ``what``, the seconds so far and
    ``state()``); the times are the request's own either way."""
    if progress is _quiet:
        return _stream(port, path, body)
    return watched(
        lambda: _stream(port, path, body), what or path, REQUEST_TIMEOUT_S, progress, state, every_s
    )


def _stream(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    t0 = time.perf_counter()
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise TimeshareError(f"{path} answered {r.status}: {r.read()[:300]!r}")
        first: float | None = None
        out: dict[str, Any] = {}
        text: list[str] = []
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event or event.get("type") in ("error", "response.failed"):
                raise TimeshareError(f"{path}: error event {event.get('error') or event.get('message')}")
            piece = _piece(event)
            if first is None and piece:
                first = time.perf_counter() - t0
            if piece:
                text.append(piece)
            final = (
                event.get("response")
                if event.get("type") in ("response.completed", "response.incomplete")
                else None
            )
            for key in ("usage", "timeshare", "timings", "id"):
                value = final.get(key) if isinstance(final, dict) else event.get(key) if key != "id" else None
                if value:
                    out[key] = value
            if event.get("stop") is True:
                break
        total = time.perf_counter() - t0
    finally:
        c.close()
    out["ttft_ms"] = (first if first is not None else total) * 1000.0
    out["total_ms"] = total * 1000.0
    out["text"] = "".join(text)
    return out


def _kill_group(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM the process group (the process was started in its own session), then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):  # what its workers left in the group
        os.killpg(proc.pid, signal.SIGKILL)


def _log_tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def worker_log_phases(text: str) -> dict[str, Any]:
    """What a worker log says of the worker's last start: its "startup phases" line
    (core/worker/loop.py: ``startup``), its last KV file read (the engine's "KV loaded from disk":
    ``kv_tokens``, ``kv_mb``, ``kv_read_ms``: what the request waited for it, and ``kv_read_ahead``:
    it was read while the model loaded) and a deferred host shadow made since (the
    residency's "filled (deferred)": ``deferred_shadow_ms``)."""
    out: dict[str, Any] = {}
    for line in reversed(text.splitlines()):
        if "startup" not in out and (m := _STARTUP_RE.search(line)):
            with contextlib.suppress(ValueError):
                out["startup"] = json.loads(m.group(1))
        if "kv_read_ms" not in out and (m := _KV_READ_RE.search(line)):
            out["kv_tokens"], out["kv_mb"], out["kv_read_ms"] = int(m[1]), float(m[2]), float(m[3])
            out["kv_read_ahead"] = "read while the model loaded" in line
        if "deferred_shadow_ms" not in out and (m := _FILLED_RE.search(line)):
            out["deferred_shadow_ms"] = float(m[1])
        if "starting worker" in line:
            break  # the last start only
    return out


def worker_log_overlaps(text: str) -> list[dict[str, float]]:
    """Every "overlapped restore settled" line of a worker log, in order: the residency's
    ``last_overlap`` (the upload gate's counts and the restore's timeline, ms from its start)."""
    out: list[dict[str, float]] = []
    for line in text.splitlines():
        if m := _OVERLAP_RE.search(line):
            with contextlib.suppress(ValueError):
                out.append(json.loads(m.group(1)))
    return out


# ---- Timeshare ------------------------------------------------------------------------------


def _row(model: str, got: dict[str, Any]) -> dict[str, Any]:
    """A measured turn: the client's times, what the answer's ``timeshare`` and usage said."""
    ts = got.get("timeshare") or {}
    usage = got.get("usage") or {}
    return {
        "model": model,
        "ttft_ms": got["ttft_ms"],
        "total_ms": got["total_ms"],
        "switched": bool(ts.get("switched")),
        "restore_ms": ts.get("restore_ms"),
        "restored_bytes": ts.get("restored_bytes"),
        "wait_ms": ts.get("wait_ms"),
        "worker_first_token_ms": ts.get("first_token_ms"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "prompt_tokens_evaluated": ts.get("prompt_tokens_evaluated"),
        "completion_tokens": usage.get("completion_tokens"),
    }


class Serve:
    """``timeshare serve`` in its own TIMESHARE_HOME, session and port. ``progress``: where a
    turn that takes long is said, every ``progress_every_s`` (``stream``)."""

    def __init__(
        self,
        work: Path,
        ids: list[str],
        paths: list[str],
        n_ctx: int,
        flash_attn: bool,
        parallel: int = 0,
        budget: str = "one-model",
        env: dict[str, str] | None = None,
        progress: Callable[[str], None] = _quiet,
        progress_every_s: float | None = None,
    ) -> None:
        self.progress = progress
        self.progress_every_s = progress_every_s
        home = work / "home"
        home.mkdir(parents=True)
        self.log = work / "serve.log"
        config = work / "config.toml"
        lines = [
            "[api]",
            "queue_limit = 64",
            "",
            "[arena]",
            # one-model: every turn of the other model switches, moving all of its weights; a byte
            # budget below both models' weights: each switch moves only the layer parts that lack room
            f"vram_budget = {json.dumps(budget)}",
            f"wait_timeout_s = {REQUEST_TIMEOUT_S}",
        ]
        for mid, path in zip(ids, paths, strict=True):
            lines += [
                "",
                "[[models]]",
                f"id = {json.dumps(mid)}",
                f"path = {json.dumps(str(Path(path).resolve()))}",
                f"n_ctx = {n_ctx}",
                "n_seq = 4",
                "idle_sleep_s = false",
                f"flash_attn = {'true' if flash_attn else 'false'}",
                f"parallel = {parallel}",  # 0: the build's default
            ]
        config.write_text("\n".join(lines) + "\n")
        env = envvars.environment(**{envvars.HOME.name: str(home)}, **(env or {}))
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "timeshare", "--config", str(config), "serve", "--port", "0"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=work,  # not a source checkout's root: `python -m` puts the cwd first on sys.path
            )
        self.port = 0
        self.ids = ids
        self._address = home / "run" / "api.json"
        self._logs = home / "log"

    def wait_ready(
        self, progress: Callable[[str], None] = _quiet, timeout_s: float = START_TIMEOUT_S
    ) -> float:
        """Until every model has loaded (resident, released or sleeping); seconds it took. Says
        every PROGRESS_EVERY_S how each model stands; TimeshareError when serve exits, a model
        fails, or ``timeout_s`` passes (with the models' states and the log's tail)."""
        t0 = time.monotonic()
        said = t0
        while True:
            if self.proc.poll() is not None:
                raise TimeshareError(
                    f"timeshare serve exited ({self.proc.returncode}): {_log_tail(self.log)}"
                )
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise TimeshareError(
                    f"timeshare serve was not ready in {timeout_s:.0f} s ({self.states() or 'no answer'}); "
                    f"its log ends: {_log_tail(self.log, 600)}"
                )
            if now - said >= PROGRESS_EVERY_S:
                said = now
                progress(f"timeshare serve: {now - t0:.0f} s, {self.states() or 'starting'}")
            if not self.port:
                try:
                    record = json.loads(self._address.read_text())
                    if record.get("pid") == self.proc.pid:
                        self.port = int(record["url"].rsplit(":", 1)[1])
                except (OSError, ValueError, KeyError):
                    pass
            if self.port:
                states = {m["id"]: m for m in self.status().get("models", [])}
                failed = [f"{i}: {m.get('reason')}" for i, m in states.items() if m.get("state") == "failed"]
                if failed:
                    raise TimeshareError("a model could not be loaded: " + "; ".join(failed))
                if all(
                    states.get(i, {}).get("state") in ("resident", "released", "sleeping") for i in self.ids
                ):
                    return time.monotonic() - t0
            time.sleep(0.1)

    def status(self) -> dict[str, Any]:
        try:
            code, body = _http(self.port, "GET", "/timeshare/v1/status")
        except OSError:
            return {}
        return body if code == 200 and isinstance(body, dict) else {}

    def states(self) -> str:
        """Each model's state as the status says it (busy, waiting reason), for progress lines."""
        parts = []
        for m in self.status().get("models", []):
            words = [str(m.get("state", "?"))]
            if m.get("busy"):
                words.append("busy")
            if m.get("waiting_reason"):
                words.append(str(m["waiting_reason"]))
            if m.get("state") == "failed" and m.get("reason"):
                words.append(str(m["reason"]))
            parts.append(f"{m.get('id')}: {', '.join(words)}")
        return "; ".join(parts)

    def state(self, model: str) -> str:
        return str(next((m["state"] for m in self.status().get("models", []) if m["id"] == model), ""))

    def stream(self, model: str, path: str, body: dict[str, Any], what: str = "") -> dict[str, Any]:
        """``stream`` to this serve, a long wait said with the models' states."""
        return stream(
            self.port,
            path,
            body,
            what=what or f"timeshare {model}",
            progress=self.progress,
            state=self.states,
            every_s=self.progress_every_s,
        )

    def turn(
        self,
        model: str,
        prompt: str,
        conversation: str | None,
        max_tokens: int = MAX_TOKENS,
        what: str = "",
    ) -> dict[str, Any]:
        """A streamed /v1/completions turn (``what``: which system, row and round, for the
        progress lines of a long wait)."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if conversation is not None:
            body["conversation"] = conversation
        return _row(model, self.stream(model, "/v1/completions", body, what))

    def chat_turn(
        self,
        model: str,
        messages: list[dict[str, str]],
        conversation: str,
        max_tokens: int = MAX_TOKENS,
        what: str = "",
    ) -> dict[str, Any]:
        """A streamed /v1/chat/completions turn with the ``conversation`` extension (its ``text``
        too: the next turn's history)."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "conversation": conversation,
        }
        got = self.stream(model, "/v1/chat/completions", body, what)
        return {**_row(model, got), "text": got["text"]}

    def response_turn(
        self, model: str, text: str, previous: str | None, max_tokens: int = MAX_TOKENS, what: str = ""
    ) -> dict[str, Any]:
        """A streamed /v1/responses turn continuing ``previous`` (its ``response_id`` too)."""
        body: dict[str, Any] = {
            "model": model,
            "input": text,
            "max_output_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        if previous is not None:
            body["previous_response_id"] = previous
        got = self.stream(model, "/v1/responses", body, what)
        usage = got.get("usage") or {}
        got["usage"] = {
            "prompt_tokens": usage.get("input_tokens"),
            "completion_tokens": usage.get("output_tokens"),
        }
        return {**_row(model, got), "response_id": got.get("id"), "text": got["text"]}

    def worker_phases(self, model: str) -> dict[str, Any]:
        """:func:`worker_log_phases` of ``model``'s worker log ({} when there is none)."""
        try:
            text = (self._logs / f"worker-{model}.log").read_text(errors="replace")
        except OSError:
            return {}
        return worker_log_phases(text)

    def worker_overlaps(self, model: str) -> list[dict[str, float]]:
        """:func:`worker_log_overlaps` of ``model``'s worker log ([] when there is none)."""
        try:
            text = (self._logs / f"worker-{model}.log").read_text(errors="replace")
        except OSError:
            return []
        return worker_log_overlaps(text)

    def stop_worker(self, model: str) -> None:
        code, body = _http(self.port, "POST", f"/timeshare/v1/models/{model}/sleep", {"level": "stop"}, 120)
        if code != 200:
            raise TimeshareError(f"sleep level stop of {model} answered {code}: {body}")
        deadline = time.monotonic() + 120
        while self.state(model) != "stopped":
            if time.monotonic() > deadline:
                raise TimeshareError(f"{model} did not stop within 120 s")
            time.sleep(0.05)

    def close(self) -> None:
        _kill_group(self.proc)


def fresh_process(path: str, n_ctx: int, prompt: str, flash_attn: bool, work: Path) -> dict[str, Any]:
    """A new Python process: fit the model to the card alone, load the GGUF, prefill ``prompt``,
    sample one token. ``{"unfit": sentence}`` when the model does not fit the card even alone."""
    r = fresh_process_.run(
        path, n_ctx, prompt=prompt, flash_attn=flash_attn, timeout=START_TIMEOUT_S, cwd=work
    )
    if "unfit" in r:
        return {"unfit": r["unfit"]}
    keys = ("load_ms", "prompt_tokens", "prompt_tokens_evaluated", "fit")
    return {**{k: r[k] for k in keys}, "ttft_ms": r["process_ttft_ms"]}


def card_fit(path: str, n_ctx: int, flash_attn: bool, work: Path) -> dict[str, Any]:
    """The model alone on the card now, fitted by the workers' rule with ``n_ctx`` (a fresh process
    measures the device, so this one holds no GPU context): ``{"fit": {...}}`` or ``{"unfit": ...}``."""
    return fresh_process_.fit(path, n_ctx, flash_attn=flash_attn, timeout=START_TIMEOUT_S, cwd=work)


# ---- llama-server ---------------------------------------------------------------------------


class LlamaServer:
    """One llama-server process (e2e_switch.py's flags: all layers on the GPU, or ``gpu_layers``;
    one slot, or ``parallel`` slots sharing ``n_ctx``; ``threads``: ``-t``/``-tb``, its CPU threads
    for one token and for a batch (None: llama-server's default); ``extra`` flags after them).
    ``command``: the command line it was started with."""

    def __init__(
        self,
        binary: str,
        model: str,
        n_ctx: int,
        flash_attn: bool,
        log_path: Path,
        parallel: int = 1,
        extra: Sequence[str] = (),
        gpu_layers: int = -1,
        progress: Callable[[str], None] = _quiet,
        progress_every_s: float | None = None,
        threads: tuple[int, int] | None = None,
    ) -> None:
        self.progress = progress  # where a turn that takes long is said (``stream``)
        self.progress_every_s = progress_every_s
        self.port = _free_port()
        self.log = log_path
        ngl = "999" if gpu_layers < 0 else str(gpu_layers)  # -1: all
        cmd = [binary, "-m", model, "-ngl", ngl, "-c", str(n_ctx), "--port", str(self.port)]
        cmd += ["--host", "127.0.0.1", "-np", str(parallel), "-b", "2048", "-ub", "512"]
        cmd += ["--flash-attn", "on" if flash_attn else "off"]
        if threads is not None:
            cmd += ["-t", str(threads[0]), "-tb", str(threads[1])]
        cmd += extra
        self.command = cmd
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def wait_healthy(
        self, progress: Callable[[str], None] = _quiet, timeout_s: float = START_TIMEOUT_S
    ) -> float:
        """Until ``/health`` answers 200; seconds it took. Says every PROGRESS_EVERY_S what
        ``/health`` answers; TimeshareError when llama-server exits or ``timeout_s`` passes (with
        its log's tail: a model it cannot load, an unknown flag)."""
        t0 = time.monotonic()
        said = t0
        while True:
            if self.proc.poll() is not None:
                raise TimeshareError(
                    f"llama-server exited ({self.proc.returncode}): {_log_tail(self.log, 600)}"
                )
            answer = "no answer"
            try:
                code, body = _http(self.port, "GET", "/health", timeout=2)
                if code == 200:
                    return time.monotonic() - t0
                answer = f"/health {code} {body}"
            except OSError as exc:
                answer = str(exc) or type(exc).__name__
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise TimeshareError(
                    f"llama-server was not healthy within {timeout_s:.0f} s ({answer}); its log ends: "
                    f"{_log_tail(self.log, 600)}"
                )
            if now - said >= PROGRESS_EVERY_S:
                said = now
                progress(f"llama-server: {now - t0:.0f} s, {answer}")
            time.sleep(0.05)

    def state(self) -> str:
        """What ``/health`` answers now, for progress lines."""
        try:
            code, body = _http(self.port, "GET", "/health", timeout=2)
        except OSError as exc:
            return f"/health: {exc}"
        return f"/health {code} {body}"

    def turn(
        self, prompt: str, n_predict: int = MAX_TOKENS, cache_prompt: bool = True, what: str = "llama-server"
    ) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": 0,
            "stream": True,
            "cache_prompt": cache_prompt,
        }
        got = stream(
            self.port,
            "/completion",
            body,
            what=what,
            progress=self.progress,
            state=self.state,
            every_s=self.progress_every_s,
        )
        timings = got.get("timings") or {}
        return {
            "ttft_ms": got["ttft_ms"],
            "total_ms": got["total_ms"],
            "prompt_tokens_evaluated": timings.get("prompt_n"),
            "completion_tokens": timings.get("predicted_n"),
            "server_tok_s": timings.get("predicted_per_second"),
        }

    def stop(self) -> None:
        _kill_group(self.proc)


def decode_rate(row: dict[str, Any]) -> float | None:
    n = row.get("completion_tokens") or 0
    span = (row["total_ms"] - row["ttft_ms"]) / 1000.0
    return (n - 1) / span if n > 1 and span > 0 else None
