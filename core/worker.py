"""The worker process: one per model, started by the pool.

    python -m timeshare.core.worker --spec JSON --ipc-fd N

JSON = {"model": {ModelConfig fields}, "arena": {ArenaConfig fields}, "arena_dir": str | null,
"kv_dir": str, "interval_log": str | null}. The worker speaks core/protocol.py over the socket
``N``; it logs to stderr and never writes to stdout.

Threads:
- the **loop thread** owns the Engine (the llama objects), the residency and the conversations;
  every request, release and restore runs there;
- the **reader thread** decodes frames from the pool and enqueues them; it answers StatusRequest
  itself from the immutable status snapshot the loop thread publishes, and answers undecodable
  frames with ``Error(code="protocol")`` (or ends the session when the stream cannot be resynced);
- the **warden thread** (arena) only enqueues a "yield" task when another worker rings;
- the main thread waits, and turns SIGTERM/SIGINT into a Shutdown task.
"""

from __future__ import annotations

# isort: off
# llama_cpp first: importing numpy before it made model loading segfault on the GPU image.
import llama_cpp  # noqa: F401  (import order, not use)
# isort: on

import argparse
import collections
import contextlib
import faulthandler
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from . import protocol as p
from .arena import Arena, IntervalLog, TokenClient, TokenRequest
from .config import ArenaConfig, ModelConfig
from .engine import Engine
from .errors import CancelledError, OutOfDeviceMemoryError, TimeshareError
from .residency import Residency, ResidencyOptions, fix_malloc_mmap_threshold

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    model: ModelConfig
    arena: ArenaConfig
    arena_dir: str | None
    kv_dir: str
    interval_log: str | None = None

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        """Parse the --spec argument. Raises ValueError with a sentence naming the bad field."""
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--spec is not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError("--spec must be a JSON object")
        for key in ("model", "kv_dir"):
            if key not in obj:
                raise ValueError(f"--spec lacks {key!r}")
        model = _dataclass_from(ModelConfig, obj["model"], "model")
        arena = _dataclass_from(ArenaConfig, obj.get("arena") or {}, "arena")
        return cls(
            model=model,
            arena=arena,
            arena_dir=obj.get("arena_dir"),
            kv_dir=str(obj["kv_dir"]),
            interval_log=obj.get("interval_log"),
        )

    def to_json(self) -> str:
        from dataclasses import asdict

        return json.dumps(
            {
                "model": asdict(self.model),
                "arena": asdict(self.arena),
                "arena_dir": self.arena_dir,
                "kv_dir": self.kv_dir,
                "interval_log": self.interval_log,
            }
        )


def _dataclass_from(cls: Any, obj: object, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ValueError(f"--spec {where} must be an object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"--spec {where} has unknown field(s): {', '.join(unknown)}")
    try:
        return cls(**obj)
    except TypeError as exc:
        raise ValueError(f"--spec {where}: {exc}") from None


# ---- residence: the GPU token and the weights ------------------------------------------------


@dataclass(frozen=True)
class Acquired:
    switched: bool
    wait_ms: float = 0.0
    restore_ms: float = 0.0


class Residence:
    """The token and the weights, driven by the loop thread only.

    This base class is the arena-less residence: one worker alone, weights always on the device.
    ``ArenaResidence`` (when an arena directory is given) adds the flock token and the
    release/restore of the weights.
    """

    #: what the Ready message reports (ArenaResidence takes them from the attached residency)
    path = "none"
    reason = "no arena: the weights stay loaded"
    backend = "CPU"
    weight_bytes = 0
    host_bytes = 0

    @property
    def device_bytes(self) -> int:
        """Bytes of weights on the device now (0 without an arena: nothing to report)."""
        return 0

    def state_ctx(self, engine: Engine) -> Any:
        """The llama_context for KV snapshots: the engine's own."""
        return engine.llm.ctx

    @property
    def use_mmap(self) -> bool:
        """What the engine passes as ``Llama(use_mmap=...)``."""
        return True

    @property
    def frees_context(self) -> bool:
        """True when a plain yield also frees the context (rebuild path): park the KV first."""
        return False

    def start(self, enqueue_yield: Callable[[], None]) -> None:
        """Begin watching the doorbell (warden thread)."""

    def attach(self, engine: Engine) -> None:
        """Attach the release/restore mechanism to a freshly loaded model."""

    def set_pinned(self, pinned: bool) -> None:
        """A pinned holder keeps the token; waiters are told so."""

    def acquire(self, poll: Callable[[], None], timeout_s: float | None) -> float:
        """Take the token only (no restore); returns the wait in ms."""
        return 0.0

    @property
    def holds_token(self) -> bool:
        return True

    @property
    def weights_resident(self) -> bool:
        return True

    @property
    def kv_resident(self) -> bool:
        """The llama context (and its KV cache) exists: conversations can be snapshotted."""
        return True

    def ensure(self, poll: Callable[[], None], timeout_s: float) -> Acquired:
        """Take the token and restore the weights. ``poll`` runs now and then while waiting (it may
        raise CancelledError). Raises TokenTimeoutError after ``timeout_s``."""
        return Acquired(switched=False)

    def release(self, kv: bool) -> p.Released | None:
        """Release the weights (and the KV cache when ``kv``) and give the token back."""
        return None

    def waiting_reason(self) -> str:
        return ""

    def others_waiting(self) -> bool:
        """Another worker waits for the token now."""
        return False

    def close(self) -> None:
        pass


class ArenaResidence(Residence):
    """The GPU token (core/arena.py) plus the release/restore of the weights (core/residency).

    Invariant: the weights are on the device iff this worker holds the token. Restore happens only
    after the token is granted; the token is given back only after the release has freed the
    memory. The interval log (arena-test harness) gets a "resident" interval for each stretch of
    resident weights; the TokenClient writes the "token" intervals."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.arena = Arena(spec.arena_dir)
        self.interval_log = IntervalLog(spec.interval_log, spec.model.id) if spec.interval_log else None
        self.client = TokenClient(
            self.arena, spec.model.id, interval_log=self.interval_log, pinned=spec.model.pinned
        )
        self.residency: Any | None = None
        self._request: TokenRequest | None = None
        self._resident_since: float | None = None
        self._restore_wait = ""  # set while a restore waits for device memory

    @property
    def use_mmap(self) -> bool:
        return bool(Residency.probe().use_mmap_for_inplace)

    @property
    def frees_context(self) -> bool:
        return self.residency is not None and self.residency.path == "rebuild"

    def attach(self, engine: Engine) -> None:
        """Attach the residency mechanism to the loaded model (under the token)."""
        res = Residency.attach(
            engine.llm, engine.model.path, ResidencyOptions(mode="auto", host_shadow=engine.model.host_shadow)
        )
        self.residency = res
        self.path = str(res.path)
        self.reason = str(res.reason)
        self.backend = str(res.backend)
        self.weight_bytes = int(res.weight_bytes)
        self.host_bytes = int(res.host_bytes)

    def start(self, enqueue_yield: Callable[[], None]) -> None:
        self.client.start_doorbell(lambda _ring: enqueue_yield())

    def set_pinned(self, pinned: bool) -> None:
        self.client.set_pinned(pinned)

    @property
    def holds_token(self) -> bool:
        return self.client.holds_token

    @property
    def weights_resident(self) -> bool:
        if self.residency is None:
            return self.client.holds_token
        return bool(self.residency.weights_resident)

    @property
    def kv_resident(self) -> bool:
        return self.residency is None or bool(self.residency.kv_resident)

    def state_ctx(self, engine: Engine) -> Any:
        """The live llama_context for KV snapshots, also while the weights are released (the
        residency keeps the context aside then and puts a guard in its place). Snapshots read
        only the KV cache, never the weights."""
        if self.residency is not None and not self.weights_resident:
            ctx = self.residency.kv_context
            if ctx is not None:
                return ctx
        return engine.llm.ctx

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes if self.weights_resident else 0

    def acquire(self, poll: Callable[[], None], timeout_s: float | None) -> float:
        """Wait for the token (on the arena's helper thread), polling; returns the wait in ms."""
        if self.client.holds_token:
            return 0.0
        request = self.client.request(timeout_s)
        self._request = request
        try:
            while not request.wait(0.05):
                poll()
        except BaseException:
            # Give the place in the queue up; if it was granted just now, cancel() is False and
            # the token is kept with the exception: the caller releases or uses it.
            request.cancel()
            raise
        finally:
            self._request = None
        grant = request.result()
        # From here the weights may land on the device (load or restore): the resident interval
        # of the arena-test harness starts now and ends when a release has freed them.
        self._resident_since = time.monotonic()
        return grant.wait_ms

    def ensure(self, poll: Callable[[], None], timeout_s: float) -> Acquired:
        held = self.client.holds_token
        wait_ms = self.acquire(poll, timeout_s)
        restore_ms = 0.0
        res = self.residency
        if res is not None and not res.weights_resident:
            try:
                restore_ms = self._restore(res, poll)
            except BaseException:
                self._end_resident()
                self.client.release()  # the model stays released: the invariant holds
                raise
        return Acquired(switched=not held, wait_ms=wait_ms, restore_ms=restore_ms)

    def _restore(self, res: Any, poll: Callable[[], None]) -> float:
        """Restore the weights (holding the token); returns the successful attempt's ms.

        Out of device memory is retried, keeping the token, for ``arena.restore_oom_retry_s``: after
        a ``kill -9`` of the holder the kernel drops its flock at once but the driver frees its
        memory a little later, and another program may hold memory for a moment. A failed restore
        leaves the model released and intact, so trying again is safe. ``poll`` keeps the worker
        answering (status, cancel) between attempts; the last error is raised when time is up."""
        retry_s = max(0.0, float(self.spec.arena.restore_oom_retry_s))
        deadline = time.monotonic() + retry_s
        delay = 0.05
        attempts = 0
        try:
            while True:
                attempts += 1
                try:
                    return float(res.restore().ms)
                except OutOfDeviceMemoryError as exc:
                    left = deadline - time.monotonic()
                    if left <= 0.0:
                        if attempts == 1:
                            raise
                        raise OutOfDeviceMemoryError(
                            f"{exc} (tried {attempts} times over {retry_s:g} s, arena.restore_oom_retry_s)"
                        ) from exc
                    if attempts == 1:
                        log.warning("%s; trying again for up to %.1f s", exc, left)
                        self._restore_wait = "waiting for device memory to restore the weights"
                    pause_until = time.monotonic() + min(delay, left)
                    while time.monotonic() < pause_until:
                        poll()
                        time.sleep(min(0.02, max(0.0, pause_until - time.monotonic())))
                    delay = min(delay * 2.0, 1.0)
        finally:
            self._restore_wait = ""
            if attempts > 1:
                log.info("restore: %d attempts", attempts)

    def release(self, kv: bool) -> p.Released | None:
        res = self.residency
        report = None
        if res is not None and (res.weights_resident or (kv and res.kv_resident)):
            report = res.release(kv=kv)
        self._end_resident()
        if self.client.release() is None and report is None:
            return None
        level = "weights+kv" if kv else "weights"
        if report is None:
            return p.Released(level=level, release_ms=0.0, freed_bytes=0)
        return p.Released(level=level, release_ms=float(report.ms), freed_bytes=int(report.freed_bytes))

    def others_waiting(self) -> bool:
        try:
            return bool(self.client.others_waiting())
        except OSError as exc:
            log.warning("scanning the arena's waiters failed: %s", exc)
            return True  # err on the side of yielding

    def _end_resident(self) -> None:
        if self._resident_since is None:
            return
        end = time.monotonic()
        if self.interval_log is not None:
            try:
                self.interval_log.record("resident", self._resident_since, end)
            except OSError as exc:
                log.warning("could not write the interval log: %s", exc)
        self._resident_since = None

    def waiting_reason(self) -> str:
        if self._restore_wait:
            return self._restore_wait
        request = self._request
        return request.waiting_reason() if request is not None else ""

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            res = self.residency
            if res is not None:
                res.close()
            self.arena.close()


# ---- internal tasks ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Yield:
    """The warden heard the doorbell: another worker wants the token."""


@dataclass(frozen=True)
class _Disconnected:
    reason: str


_Task = Any  # protocol requests, _Yield, _Disconnected


class Worker:
    def __init__(self, spec: WorkerSpec, conn: p.Connection, residence: Residence | None = None) -> None:
        self.spec = spec
        self.conn = conn
        self.residence = residence or Residence()
        self.tasks: queue.Queue[_Task] = queue.Queue()
        self.engine: Engine | None = None
        self.pinned = spec.model.pinned
        self._pending: collections.deque[_Task] = collections.deque()
        self._cancelled: set[str] = set()
        self._state = "loading"
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

    def send(self, msg: object) -> None:
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
        res = self.residence
        state = self._state
        if state not in ("loading", "sleeping"):
            state = "resident" if res.weights_resident else "released"
        status = p.WorkerStatus(
            state=state,  # type: ignore[arg-type]
            busy=self._busy,
            pinned=self.pinned,
            holds_token=res.holds_token,
            waiting_reason=res.waiting_reason(),
            device_bytes=res.device_bytes,
            host_pinned_bytes=res.host_bytes,
            prompt_tokens_evaluated=engine.prompt_tokens_evaluated if engine else 0,
            live_conversations=engine.conversations if engine else (),
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
            except p.FrameError as exc:
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
            if isinstance(msg, p.StatusRequest):
                self.send(p.StatusReply(req=msg.req, status=self.status()))
            elif isinstance(msg, p.REQUEST_TYPES):
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

    def _load_poll(self) -> None:
        self._poll(None)
        self.publish()
        if any(isinstance(t, (p.Shutdown, _Disconnected)) for t in self._pending):
            raise CancelledError("shutdown requested while loading")

    def _load(self) -> None:
        """Load under the token (the weights land on the device), attach the residency, then
        release the weights and the token unless a request is already waiting."""
        model = self.spec.model
        res = self.residence
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
                    residency_path=self.residence.path,
                    residency_reason=self.residence.reason,
                    backend=self.residence.backend,
                    weight_bytes=self.residence.weight_bytes,
                    host_pinned_bytes=self.residence.host_bytes,
                )
            )
        )
        self._poll(None)
        work_waiting = any(isinstance(t, (p.Generate, p.Wake)) for t in self._pending)
        if not self.pinned and (not work_waiting or self._yield_wanted):
            self._release(kv=False)  # a pinned model keeps the GPU once it has it
        else:
            self._quantum_start = time.monotonic()
        self.publish()

    def _set_pinned(self, pinned: bool) -> None:
        self.pinned = pinned
        self.residence.set_pinned(pinned)

    def _dispatch(self, task: _Task) -> None:
        if isinstance(task, p.Generate):
            self._generate(task)
        elif isinstance(task, p.Cancel):
            self._cancel_queued(task.req)
        elif isinstance(task, p.Pin):
            self._set_pinned(task.pinned)
        elif isinstance(task, p.Wake):
            self._ensure_resident(lambda: self._wait_poll(None))
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
            if isinstance(task, p.Generate) and task.req == req:
                self._pending.remove(task)
                self._send_done(task, "cancelled", p.Usage(0, 0, 0), p.Switch(False))
                return
        self._cancelled.add(req)

    def _send_done(self, req: p.Generate, finish: str, usage: p.Usage, switch: p.Switch) -> None:
        self.send(p.Done(req=req.req, finish_reason=finish, usage=usage, switch=switch))  # type: ignore[arg-type]

    def _poll(self, current: str | None) -> None:
        """Drain the queue between decode steps (and while waiting for the token)."""
        while True:
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                return
            if isinstance(task, p.Cancel):
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
                self._pending.append(task)

    def _wait_poll(self, current: str | None) -> None:
        self._poll(current)
        self.publish()  # waiting_reason becomes visible

    def _should_yield(self) -> bool:
        """Give the token up now? Not when pinned, not holding, or when the ring was stale."""
        if self.pinned or not self.residence.holds_token:
            return False
        if not self.residence.others_waiting():
            self._yield_wanted = False
            return False
        return True

    def _ensure_resident(self, poll: Callable[[], None]) -> Acquired:
        res = self.residence
        if res.holds_token and res.weights_resident:
            return Acquired(switched=False)
        self._state = "ready"
        self._yield_wanted = False  # a ring only comes while holding: anything older is stale
        self.publish()
        acquired = res.ensure(poll, self.spec.arena.wait_timeout_s)
        # A ring that arrives while restoring stays in the queue and is seen at the next step.
        self._quantum_start = time.monotonic()
        self.publish()
        return acquired

    def _release(self, kv: bool) -> None:
        if self.engine is not None and (kv or self.residence.frees_context) and self.residence.kv_resident:
            self.engine.park()  # the context goes away: every conversation becomes a host snapshot
        released = self.residence.release(kv)
        self._yield_wanted = False
        if kv:
            self._state = "sleeping"
        if released is not None:
            self.send(released)
        self.publish()

    def _generate(self, req: p.Generate) -> None:
        engine = self.engine
        assert engine is not None
        if req.req in self._cancelled:
            self._cancelled.discard(req.req)
            self._send_done(req, "cancelled", p.Usage(0, 0, 0), p.Switch(False))
            return
        t0 = time.monotonic()
        first: list[float] = []
        switch = Acquired(switched=False)

        def step() -> None:
            nonlocal switch
            self._poll(req.req)
            held_ms = (time.monotonic() - self._quantum_start) * 1000.0
            quantum_over = held_ms >= self.spec.arena.min_quantum_ms
            if self._yield_wanted and quantum_over and self._should_yield():
                self._release(kv=False)
            if not (self.residence.holds_token and self.residence.weights_resident):
                got = self._ensure_resident(lambda: self._wait_poll(req.req))
                if not first:
                    switch = got

        def emit(text: str) -> None:
            if not first:
                first.append(time.monotonic())
            self.send(p.Token(req=req.req, text=text))

        self._busy = True
        if self.residence.holds_token:
            self._quantum_start = time.monotonic()  # the quantum counts generation, not idle holding
        self.publish()
        reply: object
        try:
            outcome = engine.generate(req, emit, step)
        except CancelledError:
            reply = p.Done(req.req, "cancelled", p.Usage(0, 0, 0), p.Switch(False))
        except TimeshareError as exc:
            reply = p.Error(req=req.req, code=exc.code, message=str(exc))
        else:
            first_ms = (first[0] - t0) * 1000.0 if first else 0.0
            reply = p.Done(
                req.req,
                outcome.finish_reason,  # type: ignore[arg-type]
                p.Usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.prompt_tokens_evaluated),
                p.Switch(switch.switched, switch.wait_ms, switch.restore_ms, first_ms),
            )
        finally:
            self._busy = False
            self.publish()  # the snapshot is current before the reply arrives
        self.send(reply)
        if self._yield_wanted and self._should_yield():
            self._release(kv=False)  # between requests the quantum does not apply

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
            if isinstance(task, p.Generate):
                self.send(
                    p.Error(req=task.req, code="model_unavailable", message="the worker is shutting down")
                )
        self._pending.clear()
        try:
            self.residence.release(kv=False)
        finally:
            self.residence.close()


def _setup_logging(model_id: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{model_id}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if os.environ.get("TIMESHARE_DEBUG") else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m timeshare.core.worker")
    parser.add_argument("--spec", required=True, help="JSON: model, arena, arena_dir, kv_dir, interval_log")
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
    try:
        residence = make_residence(spec)
    except TimeshareError as exc:
        log.error("%s", exc)
        with contextlib.suppress(OSError):
            conn.send(p.Error(req=None, code=exc.code, message=str(exc), fatal=True))
        return 2
    worker = Worker(spec, conn, residence)

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


def make_residence(spec: WorkerSpec) -> Residence:
    """The arena residence when an arena directory is given, else the arena-less one."""
    if spec.arena_dir is None:
        return Residence()
    return ArenaResidence(spec)


if __name__ == "__main__":
    sys.exit(main())
