"""The worker's loop thread and its entry point (``python -m timeshare.core.worker``)."""

from __future__ import annotations

# isort: off
# llama_cpp first: importing numpy before it made model loading segfault on the GPU image.
import llama_cpp  # noqa: F401  (import order, not use)
# isort: on

import argparse
import collections
import contextlib
import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import CancelledError, FrameError, TimeshareError
from ..residency import fix_malloc_mmap_threshold, prefer_device_local_memory
from ..util.logsetup import setup_logging
from . import protocol as p
from .engine import Engine, GenerationOutcome
from .spec import WorkerSpec
from .tenancy import Acquired, Tenancy, make_tenancy

#: numbers per Embeddings frame (a frame holds at most MAX_FRAME bytes; a float takes ~20)
EMBED_FRAME_VALUES = 256 * 1024

log = logging.getLogger(__name__)

# ---- internal tasks ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Yield:
    """The warden heard the doorbell: another worker wants the token."""


@dataclass(frozen=True)
class _Disconnected:
    reason: str


_Task = p.Request | _Yield | _Disconnected  # what the loop thread takes from its queue


class Worker:
    def __init__(self, spec: WorkerSpec, conn: p.Connection, tenancy: Tenancy | None = None) -> None:
        self.spec = spec
        self.conn = conn
        self.tenancy = tenancy or Tenancy()
        self.tasks: queue.Queue[_Task] = queue.Queue()
        self.engine: Engine | None = None
        self.pinned = spec.model.pinned
        self._pending: collections.deque[_Task] = collections.deque()
        self._cancelled: set[str] = set()
        # when each request that came while another task ran arrived, and the last wake that took
        # the GPU (its start, its end, what it cost): a request that came meanwhile waited for it
        self._arrived: dict[str, float] = {}
        self._last_wake: tuple[float, float, Acquired] | None = None
        self._state: Literal["loading", "ready", "sleeping"] = "loading"
        self._busy = False
        self._status = p.WorkerStatus("loading", False, self.pinned, False)
        self._status_lock = threading.Lock()
        self._sent_status: p.WorkerStatus | None = None
        self._yield_wanted = False
        self._quantum_start = 0.0
        self._exit_code = 0
        self._stopping = False
        self._connected = True

    # ---- sending ----------------------------------------------------------------------------

    def send(self, msg: p.Event) -> None:
        if not self._connected:
            return
        try:
            self.conn.send(msg)
        except OSError as exc:
            self._connected = False
            log.warning("pool connection lost while sending %s: %s", type(msg).__name__, exc)
            self.tasks.put(_Disconnected(f"send failed: {exc}"))

    def status(self) -> p.WorkerStatus:
        with self._status_lock:
            return self._status

    def publish(self) -> None:
        """Build the status snapshot (loop thread) and push it if it changed."""
        engine = self.engine
        res = self.tenancy
        state: p.WorkerState
        if self._state == "ready":
            state = "resident" if res.weights_resident else "released"
        else:
            state = self._state
        status = p.WorkerStatus(
            state=state,
            busy=self._busy,
            pinned=self.pinned,
            holds_token=res.holds_token,
            waiting_reason=res.waiting_reason(),
            device_bytes=res.device_bytes,
            host_pinned_bytes=res.host_bytes,
            prompt_tokens_evaluated=engine.prompt_tokens_evaluated if engine else 0,
            live_conversations=engine.conversations if engine else (),
            lease_bytes=res.lease_bytes,
            budget_bytes=res.budget_bytes,
        )
        with self._status_lock:
            self._status = status
        if status != self._sent_status:
            self._sent_status = status
            self.send(status)

    # ---- reader thread ----------------------------------------------------------------------

    def read_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except FrameError as exc:
                log.warning("bad frame from the pool: %s", exc)
                self.send(p.Error(req=exc.req, code="protocol", message=str(exc)))
                if exc.recoverable:
                    continue
                self.tasks.put(_Disconnected(str(exc)))
                return
            except OSError as exc:
                self.tasks.put(_Disconnected(f"read failed: {exc}"))
                return
            if msg is None:
                self.tasks.put(_Disconnected("the pool closed the connection"))
                return
            # a StatusRequest (the watchdog's ping) goes to the loop thread like every request:
            # its answer proves the loop thread makes progress, not only that this thread runs
            if isinstance(msg, p.REQUEST_TYPES):
                self.tasks.put(msg)
            else:
                self.send(
                    p.Error(
                        req=None, code="protocol", message=f"protocol: {type(msg).__name__} is not a request"
                    )
                )

    # ---- loop thread ------------------------------------------------------------------------

    def run(self) -> int:
        """The loop thread's body. Returns the process exit status."""
        model = self.spec.model
        self.send(p.Hello(pid=os.getpid(), model_id=model.id))
        try:
            self._load()
        except CancelledError:
            log.info("shutdown while loading")
            self._shutdown(save_kv=False)
            return 0
        except TimeshareError as exc:
            log.error("cannot load %s: %s", model.id, exc)
            self.send(p.Error(req=None, code=exc.code, message=str(exc), fatal=True))
            return 2
        except Exception as exc:
            log.exception("unexpected failure loading %s", model.id)
            self.send(
                p.Error(req=None, code="internal", message=f"loading {model.id} failed: {exc}", fatal=True)
            )
            return 2
        while not self._stopping:
            task = self._pending.popleft() if self._pending else self.tasks.get()
            try:
                self._dispatch(task)
            except Exception as exc:  # keep serving; the request (if any) gets the error
                log.exception("task %s failed", type(task).__name__)
                req = getattr(task, "req", None)
                code = exc.code if isinstance(exc, TimeshareError) else "internal"
                self.send(p.Error(req=req, code=code, message=str(exc) or type(exc).__name__))
            self.publish()
        return self._exit_code

    def _answer_ping(self, task: p.StatusRequest) -> None:
        """The watchdog's ping, answered on the loop thread (see core/pool/watchdog.py)."""
        self.send(p.StatusReply(req=task.req, status=self.status()))

    def _load_poll(self) -> None:
        self._poll(None)
        self.publish()
        if any(isinstance(t, (p.Shutdown, _Disconnected)) for t in self._pending):
            raise CancelledError("shutdown requested while loading")

    def _load(self) -> None:
        """Load under the token (the weights land on the device), attach the residency, then
        release the weights and the token unless a request is already waiting."""
        model = self.spec.model
        res = self.tenancy
        self.publish()
        res.acquire(self._load_poll, None)
        try:
            self.send(p.Loading("model", 0.0))
            # On a CPU build the host weight buffers play the device; they can only be released
            # when they are not an mmap of the file (core/residency says which).
            self.engine = Engine.load(model, use_mmap=res.use_mmap)
            self.engine.kv_dir = Path(self.spec.kv_dir)
            engine_ref = self.engine
            self.engine.state_ctx = lambda: res.state_ctx(engine_ref)
            self.send(p.Loading("residency", 0.5))
            res.attach(self.engine)
        except BaseException:
            res.release(kv=False)
            raise
        engine = self.engine
        self._state = "ready"
        res.set_pinned(self.pinned)
        res.start(lambda: self.tasks.put(_Yield()))
        self.send(
            p.Ready(
                p.ModelInfo(
                    n_ctx=engine.info.n_ctx,
                    n_vocab=engine.info.n_vocab,
                    chat_format=engine.info.chat_format,
                    residency_path=self.tenancy.path,
                    residency_reason=self.tenancy.reason,
                    backend=self.tenancy.backend,
                    weight_bytes=self.tenancy.weight_bytes,
                    host_pinned_bytes=self.tenancy.host_bytes,
                    device=self.tenancy.device_index,
                    device_name=self.tenancy.device_name,
                    budget_setting=self.tenancy.budget.setting if self.tenancy.budget else "",
                    budget_note=self.tenancy.budget_note,
                )
            )
        )
        self._poll(None)
        work_waiting = any(isinstance(t, (p.Generate, p.Embed, p.Wake)) for t in self._pending)
        if not self.pinned and (not work_waiting or self._yield_wanted):
            self._release(kv=False)  # a pinned model keeps the GPU once it has it
        else:
            self._quantum_start = time.monotonic()
        self.publish()

    def _set_pinned(self, pinned: bool) -> None:
        self.pinned = pinned
        self.tenancy.set_pinned(pinned)

    def _dispatch(self, task: _Task) -> None:
        if isinstance(task, p.StatusRequest):
            self._answer_ping(task)
        elif isinstance(task, (p.Generate, p.Embed)):
            self._generate(task)
        elif isinstance(task, p.Cancel):
            self._cancel_queued(task.req)
        elif isinstance(task, p.Pin):
            self._set_pinned(task.pinned)
        elif isinstance(task, p.Wake):
            started = time.monotonic()
            got = self._ensure_resident(lambda: self._wait_poll(None))
            self._last_wake = (started, time.monotonic(), got) if got.switched else None
        elif isinstance(task, p.Sleep):
            self._release(kv=task.level == "weights+kv")
        elif isinstance(task, _Yield):
            if self._should_yield():
                self._release(kv=False)
        elif isinstance(task, p.Shutdown):
            self._shutdown(task.save_kv)
        elif isinstance(task, _Disconnected):
            log.info("%s: shutting down", task.reason)
            self._connected = False
            self._shutdown(save_kv=True)

    def _cancel_queued(self, req: str) -> None:
        for task in list(self._pending):
            if isinstance(task, (p.Generate, p.Embed)) and task.req == req:
                self._pending.remove(task)
                self._arrived.pop(req, None)
                self._send_done(task, "cancelled", p.Usage(0, 0, 0), p.SwitchMeasured(False))
                return
        self._cancelled.add(req)

    def _send_done(
        self, req: p.Generate | p.Embed, finish: p.FinishReason, usage: p.Usage, switch: p.SwitchMeasured
    ) -> None:
        self.send(p.Done(req=req.req, finish_reason=finish, usage=usage, switch=switch))

    def _poll(self, current: str | None) -> None:
        """Drain the queue between decode steps (and while waiting for the token)."""
        while True:
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                return
            if isinstance(task, p.StatusRequest):
                self._answer_ping(task)  # between decode steps, while loading or waiting
            elif isinstance(task, p.Cancel):
                if task.req == current:
                    raise CancelledError(f"request {current} cancelled")
                self._cancel_queued(task.req)
            elif isinstance(task, p.Pin):
                self._set_pinned(task.pinned)
                self.publish()
            elif isinstance(task, _Yield):
                self._yield_wanted = True
            elif isinstance(task, (p.Shutdown, _Disconnected)):
                self._pending.appendleft(task)
                if current is not None:
                    raise CancelledError("the worker is shutting down")
            else:
                if isinstance(task, (p.Generate, p.Embed)):
                    self._arrived[task.req] = time.monotonic()
                self._pending.append(task)

    def _wait_poll(self, current: str | None) -> None:
        self._poll(current)
        self.publish()  # waiting_reason becomes visible

    def _should_yield(self) -> bool:
        """Give the token up now? Not when pinned, not holding, or when the ring was stale."""
        if self.pinned or not self.tenancy.holds_token:
            return False
        if not self.tenancy.others_waiting():
            self._yield_wanted = False
            return False
        return True

    def _ensure_resident(self, poll: Callable[[], None]) -> Acquired:
        res = self.tenancy
        if res.holds_token and res.weights_resident:
            return Acquired(switched=False)
        self._state = "ready"
        self._yield_wanted = False  # a ring only comes while holding: anything older is stale
        self.publish()
        acquired = res.ensure(poll, self.spec.arena.wait_timeout_s)
        # A ring that arrives while restoring stays in the queue and is seen at the next step.
        self._quantum_start = time.monotonic()
        res.note_use(self._busy)
        self.publish()
        return acquired

    def _release(self, kv: bool) -> None:
        if self.engine is not None and (kv or self.tenancy.frees_context) and self.tenancy.kv_resident:
            self.engine.park()  # the context goes away: every conversation becomes a host snapshot
        released = self.tenancy.release(kv)
        self._yield_wanted = False
        if kv:
            self._state = "sleeping"
        if released is not None:
            self.send(released)
        self.publish()

    def _generate(self, req: p.Generate | p.Embed) -> None:
        engine = self.engine
        assert engine is not None
        if req.req in self._cancelled:
            self._cancelled.discard(req.req)
            self._send_done(req, "cancelled", p.Usage(0, 0, 0), p.SwitchMeasured(False))
            return
        t0 = time.monotonic()
        first: list[float] = []
        switch = Acquired(switched=False)
        arrived = self._arrived.pop(req.req, None)
        wake = self._last_wake
        if arrived is not None and wake is not None and wake[0] <= arrived < wake[1]:
            # it came while a wake (a pre-wake while the user typed) waited for the GPU and
            # restored: it waited for that switch too, from when it came
            waited_ms = (wake[1] - arrived) * 1000.0
            restore_ms = min(wake[2].restore_ms, waited_ms)
            switch = Acquired(switched=True, wait_ms=waited_ms - restore_ms, restore_ms=restore_ms)
            t0 = arrived

        def step() -> None:
            nonlocal switch
            self._poll(req.req)
            held_ms = (time.monotonic() - self._quantum_start) * 1000.0
            quantum_over = held_ms >= self.spec.arena.min_quantum_ms
            if self._yield_wanted and quantum_over and self._should_yield():
                self._release(kv=False)
            if not (self.tenancy.holds_token and self.tenancy.weights_resident):
                got = self._ensure_resident(lambda: self._wait_poll(req.req))
                if not first:
                    switch = got

        logprobs: list[p.TokenLogprobs] = []  # those of the text emitted next

        def emit(text: str) -> None:
            if not first:
                first.append(time.monotonic())
            self.send(p.Token(req=req.req, text=text, logprobs=tuple(logprobs)))
            logprobs.clear()

        self._busy = True
        if self.tenancy.holds_token:
            self._quantum_start = time.monotonic()  # the quantum counts generation, not idle holding
            self.tenancy.note_use(True)
        self.publish()
        reply: p.Done | p.Error
        try:
            if isinstance(req, p.Embed):
                outcome = self._embed(req, step)
            else:
                outcome = engine.generate(
                    req, emit, step, poll=lambda: self._poll(req.req), logprobs=logprobs.extend
                )
        except CancelledError:
            reply = p.Done(req.req, "cancelled", p.Usage(0, 0, 0), p.SwitchMeasured(False))
        except TimeshareError as exc:
            reply = p.Error(req=req.req, code=exc.code, message=str(exc))
        else:
            first_ms = (first[0] - t0) * 1000.0 if first else 0.0
            reply = p.Done(
                req.req,
                outcome.finish_reason,
                p.Usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.prompt_tokens_evaluated),
                p.SwitchMeasured(
                    switch.switched,
                    wait_ms=switch.wait_ms,
                    restore_ms=switch.restore_ms,
                    first_token_ms=first_ms,
                ),
                stop=outcome.stop,
            )
        finally:
            self._busy = False
            self.tenancy.note_use(False)
            self.publish()  # the snapshot is current before the reply arrives
        self.send(reply)
        if self._yield_wanted and self._should_yield():
            self._release(kv=False)  # between requests the quantum does not apply

    def _embed(self, req: p.Embed, step: Callable[[], None]) -> GenerationOutcome:
        """Embed, sending the vectors in ``Embeddings`` frames of at most EMBED_FRAME_VALUES
        numbers; the outcome makes the ``Done`` (usage.prompt_tokens: the tokens embedded)."""
        engine = self.engine
        assert engine is not None
        vectors, n_tokens = engine.embed(req.inputs, step)
        per_frame = max(1, EMBED_FRAME_VALUES // max(1, len(vectors[0]) if vectors else 1))
        for i in range(0, len(vectors), per_frame):
            self.send(p.Embeddings(req=req.req, data=tuple(tuple(v) for v in vectors[i : i + per_frame])))
        return GenerationOutcome("stop", n_tokens, 0, n_tokens, "")

    def _shutdown(self, save_kv: bool) -> None:
        self._stopping = True
        self._poll(None)  # requests still in the queue get their error below
        engine = self.engine
        if save_kv and engine is not None:
            try:
                engine.save_kv(Path(self.spec.kv_dir))
            except Exception:
                log.exception("saving the KV snapshots failed")
        for task in list(self._pending):
            if isinstance(task, (p.Generate, p.Embed)):
                self.send(
                    p.Error(req=task.req, code="model_unavailable", message="the worker is shutting down")
                )
        self._pending.clear()
        try:
            self.tenancy.release(kv=False)
        finally:
            self.tenancy.close()


def _setup_logging(model_id: str) -> None:
    setup_logging(bool(os.environ.get("TIMESHARE_DEBUG")), tag=model_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m timeshare.core.worker")
    parser.add_argument("--spec", required=True, help="JSON: model, arena, arena_dir, kv_dir, event_log")
    parser.add_argument("--ipc-fd", type=int, required=True, help="socket to the pool")
    args = parser.parse_args(argv)
    # Nothing may reach stdout: C libraries' prints go to stderr (the pool's log file) instead.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        conn = p.Connection.from_fd(args.ipc_fd)
    except OSError as exc:
        print(f"--ipc-fd {args.ipc_fd} is not a socket: {exc}", file=sys.stderr)
        return 2
    try:
        spec = WorkerSpec.from_json(args.spec)
    except ValueError as exc:
        _setup_logging("?")
        log.error("%s", exc)
        with contextlib.suppress(OSError):
            conn.send(p.Error(req=None, code="invalid_config", message=str(exc), fatal=True))
        return 2
    _setup_logging(spec.model.id)
    fix_malloc_mmap_threshold()  # freed weight buffers go back to the system at once (RSS drops)
    prefer_device_local_memory()  # Vulkan: DMA uploads, not memcpy through the BAR (residency/vkenv.py)
    try:
        tenancy = make_tenancy(spec)
    except TimeshareError as exc:
        log.error("%s", exc)
        with contextlib.suppress(OSError):
            conn.send(p.Error(req=None, code=exc.code, message=str(exc), fatal=True))
        return 2
    worker = Worker(spec, conn, tenancy)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        worker.tasks.put(p.Shutdown(save_kv=True))

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: stacks to the log
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    result: list[int] = []
    loop = threading.Thread(target=lambda: result.append(worker.run()), name="loop")
    reader = threading.Thread(target=worker.read_loop, name="reader", daemon=True)
    loop.start()
    reader.start()
    while loop.is_alive():
        loop.join(0.2)  # short joins keep the main thread free to run signal handlers
    code = result[0] if result else 1
    conn.close()
    log.info("exit %d", code)
    logging.shutdown()
    return code
