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
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .. import envvars
from ..arena.records import DoorbellRing
from ..chatformat.format import of_template
from ..errors import CancelledError, FrameError, ModelFileError, ModelUnavailableError, TimeshareError
from ..residency import fix_malloc_mmap_threshold, prefer_device_local_memory
from ..util.logsetup import setup_logging
from ..wire import protocol as p
from ..wire.spec import WorkerSpec
from . import kv_files
from .decode import Live
from .device import device_memory
from .engine import Engine
from .fitting import Fitted, fit_to_device
from .footprint import Footprint
from .tenancy import Acquired, Tenancy, make_tenancy

#: numbers per Embeddings frame (a frame holds at most MAX_FRAME bytes; a float takes ~20)
EMBED_FRAME_VALUES = 256 * 1024
#: prompt tokens' logprob entries per PromptLogprobs frame (20 alternatives each stay far below MAX_FRAME)
PROMPT_LOGPROBS_PER_FRAME = 1024


def _env_ms(var: envvars.EnvVar) -> float:
    """Seconds from an environment variable in milliseconds (a benchmark's knob), else its default."""
    ms = var.number()
    return max(0.0, ms if ms is not None else float(var.default)) / 1000.0


#: A burst of requests joins one prefill step (llama-server prefills all of a step's new prompts
#: in one batch): before a step that admits requests the loop takes what is still on its way, for
#: at most GATHER_S in all, while bytes of another message are unread on the pipe (or being
#: decoded by the reader thread) or the latest request arrived less than GATHER_QUIET_S ago.
#: TIMESHARE_BATCH_GATHER_MS and TIMESHARE_BATCH_QUIET_MS (milliseconds) override them, for
#: benchmarks and tests.
GATHER_S = _env_ms(envvars.BATCH_GATHER_MS)
GATHER_QUIET_S = _env_ms(envvars.BATCH_QUIET_MS)

log = logging.getLogger(__name__)

# ---- internal tasks ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Yield:
    """The warden heard the doorbell: another worker wants the token (``ring``: who, and what it
    asks of this worker, as the doorbell's one scan saw it)."""

    ring: DoorbellRing


@dataclass(frozen=True)
class _Disconnected:
    reason: str


_Task = p.Request | _Yield | _Disconnected  # what the loop thread takes from its queue


@dataclass
class _Running:
    """A request in the batch: when it started, its first token, the GPU switch it waited for."""

    req: p.Generate
    t0: float
    first: float | None = None
    switch: Acquired = field(default_factory=lambda: Acquired(switched=False))
    live: Live | None = None
    arrived: float = 0.0  # the reader thread took it off the pipe
    arrival_step: int = 0  # the Decoder's ``decodes`` then (steps begun before it came)
    joined: float = 0.0  # it joined the batch (tokenized, its sequence chosen)


class Worker:
    def __init__(self, spec: WorkerSpec, conn: p.Connection, tenancy: Tenancy | None = None) -> None:
        self.spec = spec
        self.conn = conn
        self.tenancy = tenancy or Tenancy()
        self.tasks: queue.Queue[_Task] = queue.Queue()
        self.engine: Engine | None = None
        self._fitted: Fitted | None = None  # the model as fitted to its device (set at load)
        self._footprint = Footprint()  # what its context holds besides the weights
        self.pinned = spec.model.pinned
        self._pending: collections.deque[_Task] = collections.deque()
        self._cancelled: set[str] = set()  # cancelled before they joined the batch
        self._running: dict[str, _Running] = {}  # the requests in the batch, by req
        self._to_cancel: set[str] = set()  # requests in the batch cancelled since the last step
        self._stop_batch = False  # a shutdown came while the batch ran: every request ends
        # when each request that came while another task ran arrived, and the last wake that took
        # the GPU (its start, its end, what it cost): a request that came meanwhile waited for it
        self._arrived: dict[str, float] = {}
        self._last_wake: tuple[float, float, Acquired] | None = None
        # each Generate's arrival as the reader thread saw it (monotonic, the decode steps begun
        # by then): written by the reader thread, taken by the loop thread when it joins
        self._received: dict[str, tuple[float, int]] = {}
        self._last_received = 0.0
        self._state: Literal["loading", "ready", "sleeping"] = "loading"
        self._busy = False
        self._status = p.WorkerStatus("loading", False, self.pinned, False)
        self._status_lock = threading.Lock()
        self._sent_status: p.WorkerStatus | None = None
        self._yield_wanted = False
        self._ring: DoorbellRing | None = None  # the doorbell's last ring (with _yield_wanted)
        # an answer ended since the KV snapshots' host memory was last grown ahead (when idle)
        self._kv_ahead_due = False
        self._quantum_start = 0.0
        self._exit_code = 0
        self._stopping = False
        self._connected = True
        # KV files read ahead while the model loads, by conversation (reader thread; see read_loop)
        self._ahead: dict[str, kv_files.ReadAhead] = {}
        self._ahead_lock = threading.Lock()

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
        held = self._footprint.now(
            kv_resident=state in ("resident", "released") and res.kv_resident,
            context_kept=res.context_kept,
            buffers_kept=res.buffers_kept,
        )
        status = p.WorkerStatus(
            state=state,
            busy=self._busy,
            pinned=self.pinned,
            holds_token=res.holds_token,
            waiting_reason=res.waiting_reason(),
            device_bytes=res.device_bytes + held.total,
            kv_bytes=held.kv,
            buffer_bytes=held.buffers,
            context_bytes=held.context,
            resident_fraction=res.resident_fraction if state != "loading" else 0.0,
            host_pinned_bytes=res.host_bytes,
            prompt_tokens_evaluated=engine.prompt_tokens_evaluated if engine else 0,
            live_conversations=engine.conversations if engine else (),
            active=len(self._running),
            lease_bytes=res.lease_bytes,
            budget_bytes=res.budget_bytes,
            **res.handover_figures(),
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
                if isinstance(msg, p.Generate):
                    now = time.monotonic()
                    engine = self.engine
                    self._received[msg.req] = (now, engine.decodes if engine is not None else 0)
                    self._last_received = now
                    if msg.conversation is not None:
                        self._read_ahead(msg.conversation)
                self.tasks.put(msg)
            else:
                self.send(
                    p.Error(
                        req=None, code="protocol", message=f"protocol: {type(msg).__name__} is not a request"
                    )
                )

    def _read_ahead(self, conversation: str) -> None:
        """A request for ``conversation`` came while the model loads (a stopped model's next turn):
        its KV file, if there is one, is read now on a thread of its own, not after the load."""
        with self._ahead_lock:
            if self.engine is not None or conversation in self._ahead or len(self._ahead) >= 2:
                return
            path = kv_files.kv_file(Path(self.spec.kv_dir), self.spec.model.id, conversation)
            if path.is_file():
                self._ahead[conversation] = kv_files.ReadAhead(path, {"conversation": conversation})

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
            idle = not self._pending and self.tasks.empty()
            if idle and self.tenancy.shadow_pending:
                # idle: the deferred host shadow (a restart answered first), slice by slice; a
                # request or a ring that arrives stops it between two (a release checks the rest
                # against the file, and they are read from it here afterwards, or by the restore)
                self._fill_shadow(stop=lambda: not self.tasks.empty() or self._yield_wanted)
                self.publish()
                continue
            if idle and self._kv_ahead_due and not self._yield_wanted:
                # idle after an answer: the host memory a deep release saves the KV cells into,
                # grown now to what they take (a pinned allocation: hundreds of ms for a
                # gigabyte), so that the release, on the switch's path, allocates nothing
                self._kv_ahead_due = False
                self._grow_kv_ahead()
                self.publish()
                continue
            if idle and self.tenancy.shadow_to_pin:
                # idle: pin what was made pageable (a restore or a released build could not wait)
                self.tenancy.pin_shadow(stop=lambda: not self.tasks.empty())
                self.publish()
                continue
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
        self._poll()
        self.publish()
        if any(isinstance(t, (p.Shutdown, _Disconnected)) for t in self._pending):
            raise CancelledError("shutdown requested while loading")

    def _load(self) -> None:
        """Load under the token (the weights land on the device), attach the residency, then
        release the weights and the token unless a request is already waiting. A request that
        is already waiting (a stopped model's next turn) is answered before the host shadow is
        made: the loop makes it when it is next idle (after a release too: from the file), or
        the next restore does."""
        model = self.spec.model
        res = self.tenancy
        phases: dict[str, float] = {}
        if (age := process_age_s()) is not None:
            phases["process_start_to_loop_ms"] = age * 1000.0  # interpreter, imports, arena
        self.publish()
        t0 = time.monotonic()
        # an auto budget: the model is fitted to the budget it time-shares (not to what a model
        # parked at the weights level leaves free now), and the parked models go as deep as its
        # load needs first (core/config/fit.py, rule 1)
        shared = res.shared_room()
        fitted: Fitted | None = None
        if shared is not None:
            fitted = fit_to_device(model, self.spec.arena.kv_cache_type, device_memory(model.device), shared)
            res.make_room(fitted.fit.need, self._load_poll, None)
        res.acquire(self._load_poll, None)
        t1 = time.monotonic()
        try:
            self.send(p.Loading("model", 0.0))
            # On a CPU build the host weight buffers play the device; they can only be released
            # when they are not an mmap of the file (core/residency says which).
            if fitted is None:
                fitted = fit_to_device(model, self.spec.arena.kv_cache_type, device_memory(model.device))
            self._fitted = fitted
            engine = Engine.load(fitted.model, use_mmap=res.use_mmap, plan=fitted.plan)
            self._footprint = Footprint.measure(engine, fitted)
            # what a deep release would free: the KV cache and compute buffers on the device
            res.kv_footprint = (self._footprint.kv, self._footprint.buffers)
            with self._ahead_lock:  # the reads started while it loaded go to the engine
                engine.read_ahead.update(self._ahead)
                self._ahead.clear()
                self.engine = engine
            self.engine.kv_dir = Path(self.spec.kv_dir)
            engine_ref = self.engine
            self.engine.state_ctx = lambda: res.state_ctx(engine_ref)
            # before its KV cache leaves the device (deep release on contention, issue 39): the idle
            # conversations become host snapshots, as before a sleep
            res.on_deep = self._park_for_deep
            t2 = time.monotonic()
            self.send(p.Loading("residency", 0.5))
            self._poll()
            waiting = any(isinstance(t, (p.Generate, p.Embed)) for t in self._pending)
            res.attach(self.engine, defer_shadow=waiting)
        except BaseException:
            res.release(kv=False)
            raise
        t3 = time.monotonic()
        phases |= {"gpu_wait_ms": (t1 - t0) * 1000.0, "load_ms": (t2 - t1) * 1000.0}
        phases["attach_ms"] = (t3 - t2) * 1000.0
        phases |= {f"attach_{k}": round(v, 1) for k, v in res.attach_steps.items()}
        log.info(
            "startup phases (ms)%s: %s",
            " (host shadow deferred for the waiting request)" if res.shadow_pending else "",
            json.dumps({k: round(v, 1) for k, v in phases.items()}),
        )
        engine = self.engine
        self._state = "ready"
        res.set_pinned(self.pinned)
        res.start(lambda ring: self.tasks.put(_Yield(ring)))
        chat = of_template(engine.template)  # what the API plans tool calls with
        self.send(
            p.Ready(
                p.ModelInfo(
                    n_ctx=engine.info.n_ctx,
                    n_vocab=engine.info.n_vocab,
                    chat_format=engine.info.chat_format,
                    residency_path=self.tenancy.path,
                    residency_reason=self.tenancy.reason,
                    deep_note=self.tenancy.deep_note,
                    backend=self.tenancy.backend,
                    weight_bytes=self.tenancy.weight_bytes,
                    host_pinned_bytes=self.tenancy.host_bytes,
                    device=self.tenancy.device_index,
                    device_name=self.tenancy.device_name,
                    budget_setting=self.tenancy.budget.setting if self.tenancy.budget else "",
                    budget_note=self.tenancy.budget_note,
                    parallel=engine.parallel,
                    kv_cache_type=self._fitted.model.kv_type() if self._fitted else "f16",
                    kv_bytes=self._footprint.kv_total,
                    n_gpu_layers=self._fitted.model.n_gpu_layers if self._fitted else -1,
                    fit=self._fitted.fit.note if self._fitted else "",
                    chat_family=chat.family.name,
                    thinks=chat.thinks,
                    starts_thinking=chat.starts_thinking,
                    projector_bytes=engine.vision.weight_bytes if engine.vision is not None else 0,
                    pooling=engine.pooling,
                )
            )
        )
        self._poll()
        work_waiting = any(isinstance(t, (p.Generate, p.Embed, p.Wake)) for t in self._pending)
        # over the budget once its reserve is known (auto): the waiting work asks again through the
        # queue, whose plan makes the room (parked workers go deep) before it computes
        if not self.pinned and (not work_waiting or self._yield_wanted or res.over_budget):
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
        elif isinstance(task, p.Generate):
            self._generate(task)
        elif isinstance(task, p.Embed):
            self._embed(task)
        elif isinstance(task, p.Cancel):
            self._cancel_queued(task.req)
        elif isinstance(task, p.Pin):
            self._set_pinned(task.pinned)
        elif isinstance(task, p.Wake):
            self._wake()
        elif isinstance(task, p.Sleep):
            self._release(kv=task.level == "weights+kv")
        elif isinstance(task, _Yield):
            self._ring = task.ring
            asked = self._asked(idle=True)  # between batches: its weights, or its KV cache
            if asked is not None:
                self._give_way(asked)
        elif isinstance(task, p.Shutdown):
            self._shutdown(task.save_kv)
        elif isinstance(task, _Disconnected):
            log.info("%s: shutting down", task.reason)
            self._connected = False
            self._shutdown(save_kv=True)

    def _wake(self) -> None:
        """A Wake (a pre-warm): take the token and restore now. A shutdown while it waits for the
        GPU ends the wait at once, as it ends an Embed's or a batch's: the pool hears that the
        worker is shutting down, and the Shutdown, next in the queue, ends the worker. A Sleep
        that came after it ends the wait too (the user changed their mind: the pre-warm is
        dropped, quietly, and the Sleep, next in the queue, finds nothing to release)."""
        started = time.monotonic()
        superseded = "a sleep came after it"

        def poll() -> None:
            self._wait_poll()
            if any(isinstance(t, (p.Shutdown, _Disconnected)) for t in self._pending):
                raise CancelledError("the worker is shutting down")
            if any(isinstance(t, p.Sleep) for t in self._pending):
                raise CancelledError(superseded)

        try:
            got = self._ensure_resident(poll)
        except CancelledError as exc:
            log.info("wake ended: %s", exc)
            if str(exc) != superseded:
                self.send(p.Error(req=None, code=ModelUnavailableError.code, message=str(exc)))
            return
        self._last_wake = (started, time.monotonic(), got) if got.switched else None

    def _cancel_queued(self, req: str) -> None:
        self._received.pop(req, None)
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

    def _poll(self) -> None:
        """Drain the queue between decode steps (and while waiting for the token). A cancel of a
        request in the batch, or a shutdown while one runs, takes effect at the next step."""
        while True:
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                return
            self._take(task)

    def _take(self, task: _Task) -> None:
        """One task off the queue, between decode steps (see ``_poll``)."""
        if isinstance(task, p.StatusRequest):
            self._answer_ping(task)  # between decode steps, while loading or waiting
        elif isinstance(task, p.Cancel):
            if task.req in self._running:
                self._to_cancel.add(task.req)
            else:
                self._cancel_queued(task.req)
        elif isinstance(task, p.Pin):
            self._set_pinned(task.pinned)
            self.publish()
        elif isinstance(task, _Yield):
            self._yield_wanted = True
            self._ring = task.ring
        elif isinstance(task, (p.Shutdown, _Disconnected)):
            self._pending.appendleft(task)
            if self._running:
                self._stop_batch = True
        else:
            if isinstance(task, (p.Generate, p.Embed)):
                self._arrived[task.req] = time.monotonic()
            self._pending.append(task)

    def _gather(self) -> None:
        """Requests of a burst still on their way join this step (see GATHER_S)."""
        start = time.monotonic()
        while True:
            now = time.monotonic()
            left = start + GATHER_S - now
            quiet = self._last_received + GATHER_QUIET_S - now
            if self._stop_batch or any(isinstance(t, (p.Shutdown, _Disconnected)) for t in self._pending):
                return
            unread = self.conn.unread()
            if left <= 0 or (not unread and quiet <= 0):
                return
            try:
                task = self.tasks.get(timeout=min(left, quiet if not unread else 0.0002))
            except queue.Empty:
                continue
            self._take(task)
            self._poll()

    def _wait_poll(self) -> None:
        self._poll()
        self.publish()  # waiting_reason becomes visible

    def _asked(self, idle: bool = False) -> DoorbellRing | None:
        """Give way now, and with what? What the head of the queue asks of this worker, from the
        doorbell's last ring while it is fresh, else from one scan of the arena (tenancy.asked);
        None when pinned, when nothing is asked any more (the ring was stale), or, during a batch
        (not ``idle``), when it holds no lease (only its weights may go while sequences run)."""
        if self.pinned or not (idle or self.tenancy.holds_token):
            return None
        asked = self.tenancy.asked(self._ring)
        if asked is None:
            self._yield_wanted = False
            self._ring = None
        return asked

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

    def _fill_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        """Make a deferred host shadow, all of it or, with ``stop``, until it says so between two
        slices. False when the model file no longer holds the loaded weights (see
        :meth:`_file_lost`)."""
        if not self.tenancy.shadow_pending:
            return True
        try:
            self.tenancy.fill_shadow(stop)
            return True
        except TimeshareError as exc:
            self._file_lost(exc)
            return False

    def _file_lost(self, exc: TimeshareError) -> None:
        """The model file no longer holds the loaded weights, so released weights could not come
        back: the worker ends as a failed load does (every request with it; its exit frees the
        GPU for the others)."""
        log.error("cannot keep %s: %s", self.spec.model.id, exc)
        self.send(p.Error(req=None, code=exc.code, message=str(exc), fatal=True))
        self._exit_code = 2
        self._stopping = True
        self._stop_batch = True

    def _release(self, kv: bool) -> None:
        # a sleep (kv) takes the deep level in place where it is wholly in place (the KV cache and
        # compute buffers released, the context and its conversations kept: they come back
        # bitwise, as after a deep release on contention); elsewhere it frees the context
        in_place = kv and self.tenancy.sleeps_in_place
        if (
            self.engine is not None
            and ((kv and not in_place) or self.tenancy.frees_context)
            and self.tenancy.kv_resident
        ):
            self.engine.park()  # the context goes away: every conversation becomes a host snapshot
        try:
            released = self.tenancy.release(kv, free_context=kv and not in_place)
        except ModelFileError as exc:  # a deferred shadow's check at the release
            self._file_lost(exc)
            return
        self._yield_wanted = False
        if kv:
            self._state = "sleeping"
        if released is not None:
            self.send(released)
        self.publish()

    def _grow_kv_ahead(self) -> None:
        """Grow the KV snapshots' host memory ahead of a deep release (tenancy.grow_kv_ahead); a
        failure only leaves the allocation to that release."""
        try:
            self.tenancy.grow_kv_ahead()
        except Exception:
            log.exception("growing the KV snapshots' host memory ahead failed: a deep release allocates it")

    def _park_for_deep(self) -> int:
        """Before the KV cache leaves the device: the idle conversations become host snapshots
        (``llama_state_seq_get_data``: the cells in use only); returns the bytes they took."""
        engine = self.engine
        if engine is None:
            return 0
        before = engine.snapshot_bytes
        engine.park()
        return max(0, engine.snapshot_bytes - before)

    def _give_way(self, asked: DoorbellRing) -> None:
        """The head of the queue needs room: free what it asks for (``asked``, from
        :meth:`_asked`: all of the weights, or only some layer parts; the KV cache and compute
        buffers too when it asks this worker to go deep: ``tenancy.on_deep`` parks the
        conversations first)."""
        if self.engine is not None and self.tenancy.frees_context and self.tenancy.kv_resident:
            self.engine.park()  # the rebuild path frees the context: every conversation to the host
        try:
            released = self.tenancy.give_way(asked)
        except ModelFileError as exc:  # a deferred shadow's check at the release
            self._file_lost(exc)
            return
        self._yield_wanted = False
        self._ring = None
        if released is not None:
            self.send(released)
        self.publish()

    def _generate(self, req: p.Generate) -> None:
        """Answer ``req`` and every request that joins while it runs (continuous batching): the
        batch steps until no sequence is left in it."""
        self._pending.appendleft(req)
        engine = self.engine
        assert engine is not None
        try:
            while True:
                try:
                    self._before_step()
                except CancelledError:  # shutting down, or nothing left to wait for the GPU for
                    self._end_all_cancelled()
                    break
                except TimeshareError as exc:  # the GPU could not be had (gpu_busy, out of memory)
                    for req in self._admissible():  # those waiting to join fail with the batch
                        self._pending.remove(req)
                        self._arrived.pop(req.req, None)
                        self._received.pop(req.req, None)
                        self.send(p.Error(req=req.req, code=exc.code, message=str(exc)))
                    self._fail_all(exc.code, str(exc))
                    continue  # requests that came meanwhile try again
                if not self._running:
                    break
                try:
                    done = engine.step()
                    self.tenancy.settle()  # after a restore's first decode: uploads done, gate out
                except Exception as exc:  # llama_decode failed: every sequence of the batch ended
                    log.exception("a decode step failed")
                    self._fail_all("internal", str(exc) or type(exc).__name__)
                    continue
                for live in done:
                    self._finish(live)
        finally:
            if self._busy:
                self._busy = False
                self.tenancy.note_use(False)
            self.publish()
        if self._yield_wanted and (asked := self._asked()) is not None:
            self._give_way(asked)  # between requests the quantum does not apply
        self._kv_ahead_due = True  # the conversations' cells may have grown: looked at when idle

    def _admissible(self) -> list[p.Generate]:
        """The requests that may join the batch now, in arrival order: the Generates at the head of
        the queue (up to the first other task, which waits for the batch to end; an Embed runs
        between two steps where a sequence is idle: ``_embed_beside``), as many as the
        context has free sequences, skipping one whose conversation is being answered (a
        conversation is never decoded twice at once)."""
        engine = self.engine
        assert engine is not None
        room = engine.free_slots
        out: list[p.Generate] = []
        for task in self._pending:
            if len(out) >= room or not isinstance(task, p.Generate):
                break
            conv = task.conversation
            if conv is not None and (engine.busy_with(conv) or any(g.conversation == conv for g in out)):
                continue
            out.append(task)
        return out

    def _before_step(self) -> None:
        """Between two decode steps: drain the queue (cancels, pins, new requests), yield the GPU
        when asked and the quantum is over, make the weights resident again, admit new requests.
        Raises CancelledError when the batch must end (shutdown; every request left while waiting
        for the GPU), a TimeshareError when the GPU cannot be had."""
        started = time.monotonic()  # a request admitted now waited for this step's switch too
        self._poll()
        self._apply_cancels()
        if self._stop_batch:
            raise CancelledError("the worker is shutting down")
        joining = bool(self._admissible())
        if not self._running and not joining:
            return
        if joining:
            self._gather()  # the rest of a burst joins the same prefill step
        held_ms = (time.monotonic() - self._quantum_start) * 1000.0
        quantum_over = held_ms >= self.spec.arena.min_quantum_ms
        if self._yield_wanted and quantum_over and (asked := self._asked()) is not None:
            self._give_way(asked)  # every sequence pauses; the restore resumes them all
            if self._stop_batch:
                raise CancelledError("the worker is ending: its model file changed")
        got: Acquired | None = None
        if not (self.tenancy.holds_token and self.tenancy.weights_resident):
            got = self._ensure_resident(self._batch_wait_poll)
            for run in self._running.values():
                if run.first is None:
                    run.switch = got
        admitted = self._admissible()
        for req in admitted:
            self._admit(req, got, started)
        if admitted:
            self.publish()  # once for all who joined (the pool hears of the batch once per step)
        self._embed_beside()

    def _embed_beside(self) -> None:
        """An Embed at the head of the queue runs now, between two steps of the batch, in the
        sequences the batch leaves idle (issue 45: it no longer waits for every answer to end).
        A chat model's only: its context switches to embeddings for the Embed's decodes and back,
        and the sequences of the batch are not touched (each decodes in its own KV stream; their
        next step evaluates their last token as before). With no idle sequence it waits."""
        engine = self.engine
        if engine is None or engine.model.embedding or not self._running or not self._pending:
            return
        task = self._pending[0]
        if not isinstance(task, p.Embed) or task.query is not None or engine.free_slots < 1:
            return
        self._pending.popleft()
        self._embed(task, beside_batch=True)

    def _batch_wait_poll(self) -> None:
        """``poll`` while waiting for the GPU with a batch: cancels take effect at once; the wait
        ends (CancelledError) when nothing is left to wait for."""
        self._poll()
        self._apply_cancels()
        self.publish()  # waiting_reason becomes visible
        if self._stop_batch or (not self._running and not self._admissible()):
            raise CancelledError("nothing is waiting for the GPU any more")

    def _admit(self, req: p.Generate, got: Acquired | None, started: float) -> None:
        """``req`` joins the batch (tokenized now; its prefill runs in the next steps). ``got``:
        the GPU switch this step waited for, if any (the request waited for it too)."""
        engine = self.engine
        assert engine is not None
        self._pending.remove(req)
        arrived, arrival_step = self._received.pop(req.req, (started, engine.decodes))
        if req.req in self._cancelled:
            self._cancelled.discard(req.req)
            self._send_done(req, "cancelled", p.Usage(0, 0, 0), p.SwitchMeasured(False))
            return
        run = _Running(req, started, arrived=arrived, arrival_step=arrival_step)
        arrived_loop = self._arrived.pop(req.req, None)
        wake = self._last_wake
        if arrived_loop is not None and wake is not None and wake[0] <= arrived_loop < wake[1]:
            # it came while a wake (a pre-wake while the user typed) waited for the GPU and
            # restored: it waited for that switch too, from when it came
            waited_ms = (wake[1] - arrived_loop) * 1000.0
            restore_ms = min(wake[2].restore_ms, waited_ms)
            run.switch = Acquired(
                switched=True,
                wait_ms=waited_ms - restore_ms,
                restore_ms=restore_ms,
                restored_bytes=wake[2].restored_bytes,
                release_ms=wake[2].release_ms,  # the previous holder's release that switch followed
            )
            run.t0 = arrived_loop
        if got is not None:
            run.switch = got

        def poll() -> None:
            self._poll()
            if req.req in self._cancelled or self._stop_batch:
                raise CancelledError(f"request {req.req} cancelled")

        logprobs: list[p.TokenLogprobs] = []  # those of the text emitted next

        def emit(text: str) -> None:
            if run.first is None:
                run.first = time.monotonic()
            self.send(p.Token(req=req.req, text=text, logprobs=tuple(logprobs)))
            logprobs.clear()

        def prompt_emit(entries: list[p.TokenLogprobs]) -> None:
            for i in range(0, len(entries), PROMPT_LOGPROBS_PER_FRAME):
                self.send(
                    p.PromptLogprobs(req=req.req, logprobs=tuple(entries[i : i + PROMPT_LOGPROBS_PER_FRAME]))
                )

        try:
            prepared = engine.prepare(req, poll)
            run.live = engine.start(prepared, emit, logprobs.extend, prompt_emit)
        except CancelledError:
            self._cancelled.discard(req.req)
            self._send_done(req, "cancelled", p.Usage(0, 0, 0), p.SwitchMeasured(False))
            return
        except TimeshareError as exc:
            self.send(p.Error(req=req.req, code=exc.code, message=str(exc)))
            return
        except Exception as exc:
            log.exception("request %s could not start", req.req)
            self.send(p.Error(req=req.req, code="internal", message=str(exc) or type(exc).__name__))
            return
        run.joined = time.monotonic()
        self._running[req.req] = run
        if not self._busy:
            self._busy = True
            if self.tenancy.holds_token:
                self._quantum_start = time.monotonic()  # the quantum counts generation, not idle holding
            self.tenancy.note_use(True)

    def _finish(self, live: Live) -> None:
        engine = self.engine
        assert engine is not None
        req_id = next(r for r, run in self._running.items() if run.live is live)
        run = self._running.pop(req_id)
        outcome = engine.outcome(live)
        first_ms = (run.first - run.t0) * 1000.0 if run.first is not None else 0.0
        if not self._running:
            self._busy = False
            self.tenancy.note_use(False)
        self.publish()  # the snapshot is current before the reply arrives
        if live.error is not None:  # no token for its grammar, no projector for its image: it alone fails
            self.send(p.Error(req=req_id, code=live.error.code, message=str(live.error)))
            return
        self.send(
            p.Done(
                req_id,
                outcome.finish_reason,
                p.Usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.prompt_tokens_evaluated),
                p.SwitchMeasured(
                    run.switch.switched,
                    wait_ms=run.switch.wait_ms,
                    restore_ms=run.switch.restore_ms,
                    restored_bytes=run.switch.restored_bytes,
                    first_token_ms=first_ms,
                    release_ms=run.switch.release_ms,
                ),
                stop=outcome.stop,
                batch_size=outcome.batch_size,
                timings=timings_of(run, live),
            )
        )

    def _apply_cancels(self) -> None:
        """Cancelled requests leave the batch now (no context needed: their KV stays as it is).
        Each one's Done carries its real usage: the tokens it generated before the Stop (what the
        chat window counts), its prompt and what of it was evaluated."""
        engine = self.engine
        while self._to_cancel:
            req_id = self._to_cancel.pop()
            run = self._running.pop(req_id, None)
            if run is None:
                continue
            usage = p.Usage(0, 0, 0)
            if run.live is not None and engine is not None:
                engine.cancel(run.live)
                out = engine.outcome(run.live)
                usage = p.Usage(out.prompt_tokens, out.completion_tokens, out.prompt_tokens_evaluated)
            self._send_done(run.req, "cancelled", usage, p.SwitchMeasured(False))
        if not self._running and self._busy:
            self._busy = False
            self.tenancy.note_use(False)
            self.publish()

    def _end_all_cancelled(self) -> None:
        self._to_cancel.update(self._running)
        self._apply_cancels()
        self._stop_batch = False

    def _fail_all(self, code: str, message: str) -> None:
        """Every request of the batch fails with the same error (their sequences leave it)."""
        engine = self.engine
        for req_id, run in list(self._running.items()):
            if run.live is not None and engine is not None and not run.live.done:
                engine.cancel(run.live)
            self.send(p.Error(req=req_id, code=code, message=message))
        self._running.clear()
        if self._busy:
            self._busy = False
            self.tenancy.note_use(False)
        self.publish()

    def _embed(self, req: p.Embed, beside_batch: bool = False) -> None:
        """An Embed request, between batches or (``beside_batch``) between two steps of one (a
        chat model's context switches to embeddings): the vectors go in ``Embeddings`` frames of
        at most EMBED_FRAME_VALUES numbers, then a ``Done`` (usage.prompt_tokens: the tokens
        embedded)."""
        engine = self.engine
        assert engine is not None
        if req.req in self._cancelled:
            self._cancelled.discard(req.req)
            self._send_done(req, "cancelled", p.Usage(0, 0, 0), p.SwitchMeasured(False))
            return
        self._arrived.pop(req.req, None)
        switch = Acquired(switched=False)

        def check() -> None:
            """Cancelled, or the worker is ending (a shutdown: beside a batch, the batch ends on
            it at its next step): CancelledError."""
            ending = any(isinstance(t, (p.Shutdown, _Disconnected)) for t in self._pending)
            if req.req in self._cancelled or self._stop_batch or ending:
                self._cancelled.discard(req.req)
                if not beside_batch:
                    self._stop_batch = False
                raise CancelledError(f"request {req.req} cancelled")

        def wait_poll() -> None:  # while it waits for the GPU: a cancel or a shutdown ends the wait
            self._wait_poll()
            check()

        def step() -> None:
            """Before the tokenizing and before each decode, as ``_before_step`` before a
            generation step: give the GPU way when asked once the quantum is over (between
            batches; beside one, the batch's own step does), then make the weights resident."""
            nonlocal switch
            self._poll()
            check()
            held_ms = (time.monotonic() - self._quantum_start) * 1000.0
            if (
                not beside_batch
                and self._yield_wanted
                and held_ms >= self.spec.arena.min_quantum_ms
                and (asked := self._asked()) is not None
            ):
                self._give_way(asked)
                check()  # a model file that changed ends the worker (_file_lost)
            if not (self.tenancy.holds_token and self.tenancy.weights_resident):
                got = self._ensure_resident(wait_poll)
                if not switch.switched:  # the switch it waited for first
                    switch = got

        reply: p.Done | p.Error
        if not beside_batch:
            self._busy = True
            if self.tenancy.holds_token:
                self._quantum_start = time.monotonic()  # the quantum counts work, not idle holding
            self.tenancy.note_use(True)
            self.publish()
        try:
            if req.query is not None:  # a rerank: one row of scores per document
                vectors, n_tokens = engine.rerank(req.query, req.inputs, step)
            else:
                vectors, n_tokens = engine.embed(req.inputs, step)
            self.tenancy.settle()
            per_frame = max(1, EMBED_FRAME_VALUES // max(1, len(vectors[0]) if vectors else 1))
            for i in range(0, len(vectors), per_frame):
                self.send(p.Embeddings(req=req.req, data=tuple(tuple(v) for v in vectors[i : i + per_frame])))
            reply = p.Done(
                req.req,
                "stop",
                p.Usage(n_tokens, 0, n_tokens),
                p.SwitchMeasured(
                    switch.switched,
                    wait_ms=switch.wait_ms,
                    restore_ms=switch.restore_ms,
                    restored_bytes=switch.restored_bytes,
                    release_ms=switch.release_ms,
                ),
            )
        except CancelledError:
            reply = p.Done(req.req, "cancelled", p.Usage(0, 0, 0), p.SwitchMeasured(False))
        except TimeshareError as exc:
            reply = p.Error(req=req.req, code=exc.code, message=str(exc))
        except Exception as exc:  # llama_decode failed: this request fails, the worker goes on
            log.exception("embedding request %s failed", req.req)
            reply = p.Error(req=req.req, code="internal", message=str(exc) or type(exc).__name__)
        finally:
            if not beside_batch:  # the batch keeps the worker busy
                self._busy = False
                self.tenancy.note_use(False)
                self.publish()
        self.send(reply)
        if not beside_batch and self._yield_wanted and (asked := self._asked()) is not None:
            # between requests the quantum does not apply, as after a batch: each Embed starts a
            # quantum of its own, so a stream of short ones would otherwise keep the GPU from the
            # head of the queue for as long as the stream lasts (its rings taken between decodes)
            self._give_way(asked)

    def _shutdown(self, save_kv: bool) -> None:
        self._stopping = True
        self._poll()  # requests still in the queue get their error below
        for task in list(self._pending):
            if isinstance(task, (p.Generate, p.Embed)):
                self.send(
                    p.Error(req=task.req, code="model_unavailable", message="the worker is shutting down")
                )
        self._pending.clear()
        self._received.clear()
        engine = self.engine
        try:
            # the GPU first: the weights are freed and the token given back before the KV is
            # saved (a second for a long chat), so another model need not wait for that; final:
            # no check of a deferred shadow, nothing is restored any more. The KV cache stays
            # until the process ends, as a released model's does, and the snapshots read only it.
            try:
                self.tenancy.release(kv=False, final=True)
            except Exception:  # the KV is still worth saving; the exit frees the rest
                log.exception("releasing the GPU before the exit failed")
            if save_kv and engine is not None:
                try:
                    # released deep, the context kept: the sequences' KV is the residency's
                    # snapshot (the context's own cells have no memory under them)
                    states = self.tenancy.parked_states()
                    if states:
                        engine.park_states(states)
                    engine.save_kv(Path(self.spec.kv_dir))
                except Exception:
                    log.exception("saving the KV snapshots failed")
        finally:
            self.tenancy.close()


def timings_of(run: _Running, live: Live) -> p.Timings:
    """Where a finished request's first token went (``protocol.Timings``)."""
    ms = 1000.0
    first = run.first if run.first is not None else run.arrived
    return p.Timings(
        queue_ms=max(0.0, run.joined - run.arrived) * ms,
        steps_before=max(0, live.first_step - run.arrival_step) if live.first_step >= 0 else 0,
        prefill_steps=live.prefill_steps,
        prefill_ms=max(0.0, live.prefill_end - live.prefill_start) * ms if live.prefill_end else 0.0,
        first_token_ms=max(0.0, first - run.arrived) * ms,
        step_sequences=live.step_sequences,
        step_prompts=live.step_prompts,
    )


def process_age_s() -> float | None:
    """Seconds since this process started (``/proc/self/stat``'s start time against the boot
    clock, 10 ms steps); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _setup_logging(model_id: str) -> None:
    setup_logging(bool(envvars.DEBUG.raw()), tag=model_id)


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
