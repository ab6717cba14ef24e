"""The pool thread and its state: :class:`Pool`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import itertools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from .. import errors, paths
from ..arena.dirs import resolve_arena_dir
from ..arena.tickets import check_arena_dir
from ..config.schema import Config, ModelConfig
from ..errors import ConfigError, ModelUnavailableError, QueueFullError, TimeshareError, UnknownModelError
from ..modelfile import gguf_problem
from ..state import EventKind, ModelState, ModelStatus, PoolEvent, PoolSnapshot, SwitchStats
from ..worker import protocol
from .generation import Generation
from .process import _exited, _rotate_log, _signal_group, _wait, clean_env, read_log_tail

log = logging.getLogger(__name__)


T = TypeVar("T")
SleepLevel = Literal["weights", "weights+kv", "stop"]
#: ModelConfig fields whose change does not need a worker restart
_LIVE_FIELDS = frozenset({"name", "pinned", "idle_sleep_s", "idle_release", "licence"})
_SERVING = (ModelState.RESIDENT, ModelState.RELEASED, ModelState.SLEEPING)


def _error_for(code: str, message: str) -> TimeshareError:
    """The typed error (core/errors.py) for a worker's ``Error`` code; unknown codes: the base class."""
    if code == ConfigError.code:
        return ConfigError([message])
    for value in vars(errors).values():
        if (
            isinstance(value, type)
            and issubclass(value, TimeshareError)
            and value.__module__ == errors.__name__
            and value.code == code
            and value is not ConfigError
        ):
            return value(message)
    err = TimeshareError(message)
    err.code = code
    return err


# ---- per-worker state (pool thread only) ---------------------------------------------------


@dataclass
class _Worker:
    config: ModelConfig
    log_path: Path
    pinned: bool
    state: ModelState = ModelState.STARTING
    reason: str = ""
    epoch: int = 0  # incremented per spawn; messages of an older process are ignored
    proc: subprocess.Popen[bytes] | None = None
    conn: protocol.Connection | None = None
    pid: int | None = None
    ready: bool = False
    accepting: bool = False  # said Hello: requests may be sent (the worker queues them while loading)
    info: protocol.ModelInfo | None = None
    status: protocol.WorkerStatus | None = None
    queue: deque[Generation] = field(default_factory=deque)
    inflight: Generation | None = None
    restarts: int = 0
    crash_times: deque[float] = field(default_factory=deque)
    stopping: bool = False  # a Shutdown was sent on purpose: the exit is not a crash
    respawn_after_stop: bool = False
    fatal: protocol.Error | None = None
    crashed_before: bool = False  # the current spawn follows a crash (RESTARTED when it is ready)
    pending: list[object] = field(default_factory=list)  # commands to send once ready
    last_switch: SwitchStats | None = None
    log_tail: tuple[str, ...] = ()
    idle_token: int = 0
    removed: bool = False

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def alive(self) -> bool:
        return self.proc is not None


class _Timers:
    """A heap of (due, seq, callback) run by the pool thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def add(self, delay: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay), next(self._seq), callback))

    def next_delay(self) -> float | None:
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - time.monotonic())

    def pop_due(self) -> list[Callable[[], None]]:
        now = time.monotonic()
        due = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def clear(self) -> None:
        self._heap.clear()


_Item = tuple[Callable[..., object], tuple[object, ...]]


class Pool:
    """Supervisor of one worker process per configured model. See the module docstring."""

    def __init__(
        self,
        config: Config,
        arena_dir: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        restart_backoff_s: float = 0.5,
        max_restarts: int = 3,
        restart_window_s: float = 60.0,
        stop_grace_s: float = 5.0,
        kv_dir: str | os.PathLike[str] | None = None,
        event_log: str | None = None,
        worker_argv: Sequence[str] | None = None,
    ) -> None:
        _validate(config)
        self._config = config
        self._arena_dir_arg = arena_dir
        self._log_dir_arg = log_dir
        self._kv_dir_arg = kv_dir
        self.restart_backoff_s = restart_backoff_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.stop_grace_s = stop_grace_s
        self.event_log = event_log
        # the command that starts a worker, before "--spec JSON --ipc-fd N" (a frozen build or a
        # test's fault injection may give its own)
        self.worker_argv: tuple[str, ...] = tuple(
            worker_argv or (sys.executable, "-m", "timeshare.core.worker")
        )
        self.arena_dir: Path | None = None

        self._inbox: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # None: quit
        self._timers = _Timers()
        self._workers: dict[str, _Worker] = {}
        self._holder: str | None = None
        self._last_release: tuple[str, float, float] | None = None  # (model, release_ms, monotonic)
        self._req_ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._event_thread: threading.Thread | None = None
        self._events: queue.SimpleQueue[PoolEvent | None] = queue.SimpleQueue()
        self._readers: list[threading.Thread] = []
        self._subscribers: list[Callable[[PoolEvent], None]] = []
        self._sub_lock = threading.Lock()
        self._state_cond = threading.Condition()
        self._snapshot = PoolSnapshot()
        self._worker_pinned: dict[str, bool] = {}
        self._running = False
        self._closing = False
        self._run_lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Validate the arena, then spawn a worker per model and return at once.

        Raises ArenaError when the arena directory is unsafe (nothing is spawned then)."""
        with self._run_lock:
            if self._running:
                return
            if self._closing:
                raise ModelUnavailableError("this pool was stopped; create a new Pool to start again")
            # validates (creating it if missing) owner, mode and symlinks; raises ArenaError
            self.arena_dir = check_arena_dir(self._resolve_arena_dir())
            self._log_dir = Path(self._log_dir_arg) if self._log_dir_arg else paths.log_dir()
            self._log_dir.mkdir(parents=True, exist_ok=True)
            self._kv_root = Path(self._kv_dir_arg) if self._kv_dir_arg else paths.kv_dir()
            self._running = True
            self._event_thread = threading.Thread(target=self._event_loop, name="pool-events", daemon=True)
            self._event_thread.start()
            self._thread = threading.Thread(target=self._loop, name="pool", daemon=True)
            self._thread.start()
        self._post(self._start_all)

    def stop(self, timeout: float = 10.0) -> None:
        """Shut every worker down: Shutdown (workers save their KV), a grace period, SIGTERM, then
        SIGKILL to each worker's process group. Returns when no worker process is left."""
        with self._run_lock:
            if not self._running:
                return
            already = self._closing  # another thread is stopping it: wait for that one
            self._closing = True
        if already:
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=timeout + 10.0)
            return
        procs = self._call(self._begin_shutdown, closing_ok=True)
        deadline = time.monotonic() + timeout * 0.6
        for _, proc in procs:
            _wait(proc, deadline - time.monotonic())
        for model_id, proc in procs:
            if not _exited(proc):
                log.warning("%s did not exit after Shutdown: SIGTERM to its process group", model_id)
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout * 0.3
        for _, proc in procs:
            _wait(proc, deadline - time.monotonic())
        for model_id, proc in procs:
            if not _exited(proc):
                log.warning("%s ignored SIGTERM: SIGKILL to its process group", model_id)
            _signal_group(proc, signal.SIGKILL)  # also takes any child the worker left behind
            proc.wait()
        for reader in list(self._readers):
            reader.join(timeout=5.0)
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        with self._run_lock:
            self._running = False
        self._events.put(None)
        if self._event_thread is not None and self._event_thread is not threading.current_thread():
            self._event_thread.join(timeout=10.0)

    def __enter__(self) -> Pool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- reading state -------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        return self._snapshot

    @property
    def config(self) -> Config:
        return self._config

    def subscribe(self, callback: Callable[[PoolEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` from the pool's event thread for every event; returns the
        function that unsubscribes. Keep callbacks short (post to your own thread/queue)."""
        with self._sub_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._sub_lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def wait_ready(self, model_ids: Iterable[str] | None = None, timeout: float = 120.0) -> None:
        """Wait until each model has left STARTING/LOADING (it serves, or it is STOPPED/FAILED:
        look at ``snapshot()``). Raises TimeoutError naming the models still starting."""
        if not self._running:
            raise ModelUnavailableError("the pool is not running; call start() first")
        wanted = None if model_ids is None else set(model_ids)
        deadline = time.monotonic() + timeout
        with self._state_cond:
            while True:
                snap = self._snapshot
                pending = [
                    m.id
                    for m in snap.models
                    if (wanted is None or m.id in wanted)
                    and m.state in (ModelState.STARTING, ModelState.LOADING)
                ]
                missing = [] if wanted is None else sorted(wanted - {m.id for m in snap.models})
                if not pending and not missing and (snap.models or not self._config.models):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"models still starting after {timeout} s: {', '.join(pending + missing)}"
                    )
                self._state_cond.wait(min(left, 0.5))

    # ---- commands ------------------------------------------------------------------------

    def generate(
        self,
        model_id: str,
        *,
        prompt: str | None = None,
        messages: Sequence[protocol.ChatMessage | Mapping[str, str]] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 40,
        seed: int | None = None,
        stop: Sequence[str] = (),
        conversation: str | None = None,
    ) -> Generation:
        """Queue a request for ``model_id`` (FIFO, one at a time per worker) and return its handle.

        Give ``prompt`` (completion) or ``messages`` (chat: ChatMessage or {"role", "content"}).
        Raises UnknownModelError, ModelUnavailableError (failed model), QueueFullError, and
        ValueError for malformed arguments. A STOPPED model is started on demand."""
        chat: tuple[protocol.ChatMessage, ...] | None = None
        if messages is not None:
            chat = tuple(_chat_message(m) for m in messages)
        request = protocol.Generate(
            req=f"r{next(self._req_ids)}",
            prompt=prompt,
            messages=chat,
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=seed,
            stop=tuple(stop),
            conversation=conversation,
        )
        try:
            protocol.check_generate(request)
        except ValueError as exc:
            raise ValueError(f"invalid request for {model_id}: {exc}") from None
        gen = Generation(self, model_id, request)
        self._call(self._submit, gen)
        return gen

    def pin(self, model_id: str, pinned: bool = True, timeout: float = 10.0) -> None:
        """Pin (or unpin) a model. Returns once its worker has confirmed it (or is not running:
        then it applies when the worker is ready), so a request sent afterwards to another model
        cannot take the GPU from a freshly pinned holder."""
        if not self._call(self._pin, model_id, pinned):
            return
        deadline = time.monotonic() + timeout
        with self._state_cond:
            while self._worker_pinned.get(model_id, pinned) != pinned:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "%s did not confirm %s within %g s", model_id, "pin" if pinned else "unpin", timeout
                    )
                    return
                self._state_cond.wait(left)

    def sleep(self, model_id: str, level: SleepLevel = "weights") -> None:
        if level not in ("weights", "weights+kv", "stop"):
            raise ValueError(f"unknown sleep level {level!r}: use 'weights', 'weights+kv' or 'stop'")
        self._call(self._sleep, model_id, level)

    def wake(self, model_id: str) -> None:
        self._call(self._wake, model_id)

    def stop_model(self, model_id: str) -> None:
        self._call(self._stop_model, model_id, False)

    def start_model(self, model_id: str) -> None:
        self._call(self._start_model, model_id)

    def apply_config(self, config: Config) -> None:
        """Adopt a new configuration: start added models, stop removed ones, restart models whose
        load-time settings changed; pin and idle settings apply without a restart."""
        _validate(config)
        self._call(self._apply_config, config)

    # ---- the pool thread -----------------------------------------------------------------

    def _post(self, fn: Callable[..., object], *args: object) -> None:
        self._inbox.put((fn, args))

    def _call(self, fn: Callable[..., T], *args: object, closing_ok: bool = False) -> T:
        """Run ``fn(*args)`` on the pool thread and return its result (or raise its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        with self._run_lock:
            if not self._running or (self._closing and not closing_ok):
                raise ModelUnavailableError("the pool is not running; start Timeshare first")
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()

            def run() -> None:
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)

            self._inbox.put((run, ()))
        return fut.result()

    def _loop(self) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=self._timers.next_delay())
            except queue.Empty:
                for callback in self._timers.pop_due():
                    self._guard(callback)
                continue
            for callback in self._timers.pop_due():
                self._guard(callback)
            if item is None:
                break
            fn, args = item
            self._guard(fn, *args)
        # fail whatever is still waiting (nothing should be)
        for w in self._workers.values():
            self._fail_all(
                w, ModelUnavailableError("Timeshare is shutting down; send again after it restarts")
            )

    def _guard(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("pool: %s failed", getattr(fn, "__name__", fn))

    def _event_loop(self) -> None:
        while True:
            event = self._events.get()
            if event is None:
                return
            with self._sub_lock:
                subscribers = list(self._subscribers)
            for cb in subscribers:
                try:
                    cb(event)
                except Exception:
                    log.exception("pool event subscriber %r failed", cb)

    # ---- publishing (pool thread) --------------------------------------------------------

    def _build_snapshot(self) -> PoolSnapshot:
        models = []
        switching = False
        for w in self._workers.values():
            st = w.status
            info = w.info
            alive_status = st if (st is not None and w.ready and w.alive) else None
            busy = w.inflight is not None  # the pool's own knowledge: it sent a request, no Done yet
            if alive_status is not None and busy and not alive_status.holds_token:
                switching = True
            reason = w.reason
            waits = st is not None and w.alive and st.waiting_reason and (busy or not w.ready)
            if not reason and st is not None and waits:  # waiting to load, or to answer
                reason = st.waiting_reason
                if not reason.startswith("waiting"):
                    reason = f"waiting for the GPU: {reason}"
            models.append(
                ModelStatus(
                    id=w.id,
                    name=w.config.display_name,
                    path=w.config.path,
                    state=w.state,
                    busy=busy,
                    pinned=w.pinned,
                    queued=len(w.queue),
                    reason=reason,
                    residency_path=info.residency_path if info else "",
                    residency_reason=info.residency_reason if info else "",
                    backend=info.backend if info else "",
                    chat_format=info.chat_format if info else "",
                    licence=w.config.licence,
                    weight_bytes=info.weight_bytes if info else 0,
                    host_pinned_bytes=_host_bytes(w, alive_status),
                    device_bytes=alive_status.device_bytes if alive_status else 0,
                    n_ctx=info.n_ctx if info else w.config.n_ctx,
                    pid=w.pid if w.alive else None,
                    restarts=w.restarts,
                    last_switch=w.last_switch,
                    log_tail=w.log_tail,
                )
            )
        return PoolSnapshot(models=tuple(models), holder=self._holder, switching=switching)

    def _publish(
        self,
        kind: EventKind = EventKind.STATE,
        model: str | None = None,
        message: str = "",
        switch: SwitchStats | None = None,
        extra: dict[str, object] | None = None,
    ) -> None:
        snap = self._build_snapshot()
        worker_pinned = {w.id: w.status.pinned for w in self._workers.values() if w.status is not None}
        with self._state_cond:
            self._worker_pinned = worker_pinned  # what the workers say (pin() waits for it)
            self._state_cond.notify_all()
            if kind is EventKind.STATE and snap == self._snapshot:
                return
            self._snapshot = snap
        self._events.put(PoolEvent(kind, snap, model, message, switch, dict(extra or {})))

    # ---- spawning (pool thread) ----------------------------------------------------------

    def _resolve_arena_dir(self) -> Path:
        if self._arena_dir_arg is not None:
            return Path(self._arena_dir_arg).expanduser()
        return resolve_arena_dir(self._config.arena.dir)  # $TIMESHARE_VRAM_ARENA, config, default

    def _new_worker(self, cfg: ModelConfig) -> _Worker:
        return _Worker(config=cfg, log_path=self._log_dir / f"worker-{cfg.id}.log", pinned=cfg.pinned)

    def _start_all(self) -> None:
        for cfg in self._config.models:
            self._workers[cfg.id] = self._new_worker(cfg)
        self._publish()
        for w in list(self._workers.values()):
            self._spawn(w)

    def _spawn(self, w: _Worker) -> None:
        if self._closing or w.removed or w.alive:
            return
        problem = gguf_problem(w.config.path)
        if problem:
            self._set_failed(w, problem)
            return
        w.epoch += 1
        w.ready = w.accepting = False
        w.info = None
        w.status = None
        w.fatal = None
        w.stopping = False
        w.respawn_after_stop = False
        w.state = ModelState.STARTING
        if not w.crashed_before:
            w.reason = ""
        spec = {
            "model": asdict(w.config),
            "arena": asdict(self._config.arena),
            "arena_dir": str(self.arena_dir),
            "kv_dir": str(self._kv_root / w.id),
            "event_log": self.event_log,
        }
        _rotate_log(w.log_path)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with w.log_path.open("ab") as logf:
                logf.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting worker for {w.id}\n".encode())
                logf.flush()
                proc = subprocess.Popen(
                    [
                        *self.worker_argv,
                        "--spec",
                        _json(spec),
                        "--ipc-fd",
                        str(child.fileno()),
                    ],
                    pass_fds=(child.fileno(),),
                    start_new_session=True,
                    env=clean_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=logf,
                    close_fds=True,
                )
        except OSError as exc:
            parent.close()
            self._set_failed(w, f"could not start the worker process for {w.id}: {exc}")
            return
        finally:
            child.close()
        w.proc = proc
        w.pid = proc.pid
        w.conn = protocol.Connection(parent)
        log.info("started worker for %s (pid %d)", w.id, proc.pid)
        reader = threading.Thread(
            target=self._reader, args=(w.id, w.epoch, w.conn, proc), name=f"pool-read-{w.id}", daemon=True
        )
        self._readers = [t for t in self._readers if t.is_alive()]
        self._readers.append(reader)
        reader.start()
        self._publish(model=w.id)

    def _reader(
        self, model_id: str, epoch: int, conn: protocol.Connection, proc: subprocess.Popen[bytes]
    ) -> None:
        """One per worker process: post every message to the pool thread, then the exit."""
        while True:
            try:
                msg = conn.recv()
            except protocol.FrameError as exc:
                log.warning("%s: %s", model_id, exc)
                if exc.recoverable:
                    continue
                break
            except OSError as exc:
                log.warning("%s: connection lost: %s", model_id, exc)
                break
            if msg is None:
                break
            self._post(self._on_message, model_id, epoch, msg)
        if not _wait(proc, max(self.stop_grace_s, 1.0)):
            # it closed (or broke) the connection but keeps running: it cannot be talked to any more
            log.warning("%s: worker closed its connection but did not exit: killing it", model_id)
        # the exited leader is not reaped yet, so its process group id is still ours: take any
        # process the worker left behind, then reap
        _signal_group(proc, signal.SIGKILL)
        code = proc.wait()
        self._post(self._on_exit, model_id, epoch, code)

    def _send(self, w: _Worker, msg: object) -> bool:
        if w.conn is None:
            return False
        try:
            w.conn.send(msg)
            return True
        except (OSError, TimeshareError) as exc:
            log.warning("%s: could not send %s: %s", w.id, type(msg).__name__, exc)
            return False

    # ---- worker messages (pool thread) ---------------------------------------------------

    def _on_message(self, model_id: str, epoch: int, msg: object) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch:
            return
        if isinstance(msg, protocol.Token):
            if w.inflight is not None and w.inflight.req == msg.req:
                w.inflight._feed(msg.text)
        elif isinstance(msg, protocol.WorkerStatus):
            self._on_status(w, msg)
        elif isinstance(msg, protocol.StatusReply):
            self._on_status(w, msg.status)
        elif isinstance(msg, protocol.Done):
            self._on_done(w, msg)
        elif isinstance(msg, protocol.Released):
            self._last_release = (w.id, msg.release_ms, time.monotonic())
            self._publish(
                EventKind.MESSAGE,
                w.id,
                f"{w.id} released its {msg.level} in {msg.release_ms:.1f} ms",
                extra={"level": msg.level, "release_ms": msg.release_ms, "freed_bytes": msg.freed_bytes},
            )
        elif isinstance(msg, protocol.Error):
            self._on_error(w, msg)
        elif isinstance(msg, protocol.Hello):
            if msg.model_id != w.id:
                log.warning("%s: the worker says it serves %r", w.id, msg.model_id)
            w.state = ModelState.LOADING
            w.accepting = True
            # send queued work now: a worker that finds a request waiting when its load is done
            # keeps the GPU token instead of releasing and restoring at once
            for cmd in w.pending:
                if isinstance(cmd, protocol.Wake):
                    w.pending.remove(cmd)
                    self._send(w, cmd)
                    break
            self._dispatch(w)
        elif isinstance(msg, protocol.Loading):
            w.state = ModelState.LOADING
            self._publish(
                EventKind.MESSAGE,
                w.id,
                f"{w.id}: loading ({msg.stage})",
                extra={"stage": msg.stage, "fraction": msg.fraction},
            )
        elif isinstance(msg, protocol.Ready):
            self._on_ready(w, msg)
        else:
            log.warning("%s: unexpected %s from the worker", w.id, type(msg).__name__)

    def _on_ready(self, w: _Worker, msg: protocol.Ready) -> None:
        w.ready = True
        w.info = msg.info
        w.reason = ""
        if w.state in (ModelState.STARTING, ModelState.LOADING):
            w.state = ModelState.RELEASED
        if w.pinned != w.config.pinned:  # changed at run time; the spec carried the configured value
            self._send(w, protocol.Pin(w.pinned))
        pending, w.pending = w.pending, []
        for cmd in pending:
            self._send(w, cmd)
        if w.crashed_before:
            w.crashed_before = False
            self._publish(EventKind.RESTARTED, w.id, f"{w.id} restarted after a crash (restart {w.restarts})")
        self._dispatch(w)  # publishes
        self._arm_idle(w)

    def _on_status(self, w: _Worker, st: protocol.WorkerStatus) -> None:
        w.status = st
        if w.ready and not w.stopping:
            w.state = {
                "resident": ModelState.RESIDENT,
                "released": ModelState.RELEASED,
                "sleeping": ModelState.SLEEPING,
                "loading": ModelState.LOADING,
            }[st.state]
        if st.holds_token:
            self._holder = w.id
        elif self._holder == w.id:
            self._holder = None
        self._publish(model=w.id)

    def _on_done(self, w: _Worker, msg: protocol.Done) -> None:
        gen = w.inflight
        if gen is None or gen.req != msg.req:
            log.warning("%s: Done for unknown request %s", w.id, msg.req)
            return
        w.inflight = None
        release_ms = 0.0
        if msg.switch.switched and self._last_release is not None:
            holder, ms, at = self._last_release
            if holder != w.id and at >= gen._sent_at:
                release_ms = ms
        switch = SwitchStats(
            switched=msg.switch.switched,
            wait_ms=msg.switch.wait_ms,
            restore_ms=msg.switch.restore_ms,
            release_ms=release_ms,
            first_token_ms=msg.switch.first_token_ms,
            prompt_tokens_evaluated=msg.usage.prompt_tokens_evaluated,
        )
        w.last_switch = switch
        gen._finish(msg.finish_reason, msg.usage, switch)
        self._publish(
            EventKind.REQUEST_DONE,
            w.id,
            f"{w.id}: {msg.finish_reason}, {msg.usage.completion_tokens} tokens",
            switch=switch,
            extra={
                "req": gen.req,
                "finish_reason": msg.finish_reason,
                "prompt_tokens": msg.usage.prompt_tokens,
                "completion_tokens": msg.usage.completion_tokens,
                "prompt_tokens_evaluated": msg.usage.prompt_tokens_evaluated,
                "conversation": gen.request.conversation,
            },
        )
        self._dispatch(w)
        self._arm_idle(w)

    def _on_error(self, w: _Worker, msg: protocol.Error) -> None:
        if msg.fatal:
            w.fatal = msg
            log.error("%s: fatal worker error (%s): %s", w.id, msg.code, msg.message)
        gen = w.inflight
        if gen is not None and (msg.req == gen.req or (msg.fatal and msg.req is None)):
            w.inflight = None
            gen._fail(_error_for(msg.code, msg.message))
            self._publish(EventKind.MESSAGE, w.id, f"{w.id}: {msg.message}", extra={"code": msg.code})
            if not msg.fatal:
                self._dispatch(w)
                self._arm_idle(w)
            return
        if not msg.fatal:
            log.warning("%s: worker error (%s): %s", w.id, msg.code, msg.message)
            self._publish(EventKind.MESSAGE, w.id, f"{w.id}: {msg.message}", extra={"code": msg.code})

    def _on_exit(self, model_id: str, epoch: int, code: int) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch:
            return
        if w.conn is not None:
            w.conn.close()
        w.conn = None
        w.proc = None
        if self._holder == w.id:
            self._holder = None
        was_ready, w.ready = w.ready, False
        w.accepting = False
        w.status = None
        w.log_tail = read_log_tail(w.log_path)
        log.info("worker for %s exited with status %s", w.id, code)

        if w.removed:
            self._fail_all(w, UnknownModelError(f"{w.id} was removed from the configuration"))
            del self._workers[w.id]
            self._publish(model=w.id)
            return
        if w.stopping:
            self._fail_inflight(w, ModelUnavailableError(f"{w.id} was stopped while answering; send again"))
            w.state = ModelState.STOPPED
            w.reason = ""
            if self._closing:
                self._fail_all(
                    w, ModelUnavailableError("Timeshare is shutting down; send again after it restarts")
                )
                self._publish(model=w.id)
                return
            self._publish(model=w.id, message=f"{w.id} stopped")
            if w.respawn_after_stop or w.queue:
                self._spawn(w)
            return
        fatal = w.fatal
        if fatal is not None and (not was_ready or fatal.code == errors.ModelFileError.code):
            # a load failure: restarting would fail the same way
            self._set_failed(w, fatal.message)
            return
        # a crash
        if not was_ready and w.inflight is not None:
            w.queue.appendleft(w.inflight)  # it was waiting for the load, not being answered
            w.inflight = None
        self._publish(
            EventKind.CRASHED,
            w.id,
            f"{w.id} crashed (exit status {code})",
            extra={"exit_code": code, "log_tail": list(w.log_tail)},
        )
        self._fail_inflight(
            w, ModelUnavailableError(f"{w.id} crashed while answering; it is being restarted — send again")
        )
        now = time.monotonic()
        while w.crash_times and now - w.crash_times[0] > self.restart_window_s:
            w.crash_times.popleft()
        if len(w.crash_times) >= self.max_restarts:
            self._set_failed(
                w,
                f"{w.id} crashed {_times(len(w.crash_times) + 1)} within {self.restart_window_s:g} s "
                f"(last exit status {code}); see its log {w.log_path}, then start it again",
            )
            return
        w.crash_times.append(now)
        w.restarts += 1
        w.crashed_before = True
        delay = self.restart_backoff_s * (2 ** (len(w.crash_times) - 1))
        w.state = ModelState.STARTING
        w.reason = f"restarting in {delay:g} s after a crash (exit status {code})"
        self._publish(model=w.id)
        epoch_now = w.epoch
        self._timers.add(delay, lambda: self._restart_due(w.id, epoch_now))

    def _restart_due(self, model_id: str, epoch: int) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch or w.alive or w.state is not ModelState.STARTING:
            return
        self._spawn(w)

    def _set_failed(self, w: _Worker, reason: str) -> None:
        w.state = ModelState.FAILED
        w.reason = reason
        w.ready = False
        w.crashed_before = False
        if not w.log_tail:
            w.log_tail = read_log_tail(w.log_path)
        self._fail_all(w, ModelUnavailableError(f"{w.config.display_name} is not available: {reason}"))
        log.error("%s failed: %s", w.id, reason)
        self._publish(EventKind.FAILED, w.id, reason)

    def _fail_inflight(self, w: _Worker, error: TimeshareError) -> None:
        if w.inflight is not None:
            w.inflight._fail(error)
            w.inflight = None

    def _fail_all(self, w: _Worker, error: TimeshareError) -> None:
        self._fail_inflight(w, error)
        while w.queue:
            w.queue.popleft()._fail(error)

    # ---- requests (pool thread) ----------------------------------------------------------

    def _worker(self, model_id: str) -> _Worker:
        w = self._workers.get(model_id)
        if w is None or w.removed:
            known = ", ".join(sorted(k for k, v in self._workers.items() if not v.removed)) or "none"
            raise UnknownModelError(f"unknown model {model_id!r}; configured models: {known}")
        return w

    def _submit(self, gen: Generation) -> None:
        w = self._worker(gen.model)
        if w.state is ModelState.FAILED:
            raise ModelUnavailableError(
                f"{w.config.display_name} is not available: {w.reason} (fix it, then start the model again)"
            )
        limit = self._config.api.queue_limit
        if len(w.queue) >= limit:
            raise QueueFullError(
                f"{w.id} already has {len(w.queue)} requests waiting (api.queue_limit = {limit}); "
                "retry later or raise the limit"
            )
        w.queue.append(gen)
        if w.state is ModelState.STOPPED and not w.alive:
            self._spawn(w)  # on demand
        elif w.stopping:
            w.respawn_after_stop = True
        self._dispatch(w)

    def _dispatch(self, w: _Worker) -> None:
        """Send the next queued request when the worker can take it; publishes the state in every
        case (callers rely on that and do not publish again)."""
        if w.accepting and not w.stopping and w.conn is not None:
            while w.inflight is None and w.queue:
                gen = w.queue.popleft()
                if gen.cancelled:
                    gen._finish_cancelled()
                    continue
                gen._sent_at = time.monotonic()
                if not self._send(w, gen.request):
                    w.queue.appendleft(gen)  # the exit handler deals with it
                    break
                w.inflight = gen
                w.idle_token += 1  # busy: disarm the idle timer
        self._publish(model=w.id)

    def _cancel(self, gen: Generation) -> None:
        w = self._workers.get(gen.model)
        if w is None or gen.done:
            return
        if gen in w.queue:
            w.queue.remove(gen)
            gen._finish_cancelled()
            self._publish(model=w.id)
        elif w.inflight is gen:
            self._send(w, protocol.Cancel(gen.req))

    # ---- commands (pool thread) ----------------------------------------------------------

    def _command(self, w: _Worker, msg: object) -> None:
        early = w.accepting and isinstance(msg, protocol.Wake)  # a wake may go in during the load
        if (w.ready or early) and w.conn is not None and not w.stopping:
            self._send(w, msg)
        else:
            w.pending.append(msg)

    def _pin(self, model_id: str, pinned: bool) -> bool:
        """True when a Pin went to a running worker (whose confirmation pin() then awaits)."""
        w = self._worker(model_id)
        w.pinned = pinned
        sent = w.ready and not w.stopping and self._send(w, protocol.Pin(pinned))
        self._publish(EventKind.MESSAGE, w.id, f"{w.id} {'pinned' if pinned else 'unpinned'}")
        if not pinned:
            self._arm_idle(w)
        return sent

    def _sleep(self, model_id: str, level: SleepLevel) -> None:
        w = self._worker(model_id)
        if level == "stop":
            self._stop_model(model_id, False)
            return
        if w.state in (ModelState.STOPPED, ModelState.FAILED):
            return  # holds nothing
        self._command(w, protocol.Sleep(level=level))
        self._publish(EventKind.MESSAGE, w.id, f"{w.id}: sleep ({level})", extra={"level": level})

    def _wake(self, model_id: str) -> None:
        w = self._worker(model_id)
        if w.state is ModelState.FAILED:
            raise ModelUnavailableError(f"{w.config.display_name} is not available: {w.reason}")
        self._command(w, protocol.Wake())
        if w.state is ModelState.STOPPED and not w.alive:
            self._spawn(w)
        elif w.stopping:
            w.respawn_after_stop = True  # woken while stopping: start again, then wake
        self._publish(EventKind.MESSAGE, w.id, f"{w.id}: wake")

    def _stop_model(self, model_id: str, respawn: bool) -> None:
        w = self._worker(model_id)
        w.pending.clear()
        w.idle_token += 1
        if not w.alive:
            self._timers_cancel_restart(w)
            if w.state is not ModelState.FAILED:
                w.state = ModelState.STOPPED
                w.reason = ""
            self._fail_all(w, ModelUnavailableError(f"{w.id} was stopped; send again to start it"))
            self._publish(EventKind.MESSAGE, w.id, f"{w.id} stopped")
            if respawn:
                self._spawn(w)
            return
        w.respawn_after_stop = w.respawn_after_stop or respawn
        if w.stopping:
            return
        w.stopping = True
        while w.queue:
            w.queue.popleft()._fail(ModelUnavailableError(f"{w.id} was stopped; send again to start it"))
        if not self._send(w, protocol.Shutdown(save_kv=True)) and w.proc is not None:
            _signal_group(w.proc, signal.SIGTERM)
        self._publish(EventKind.MESSAGE, w.id, f"{w.id} stopping")
        epoch = w.epoch
        self._timers.add(self.stop_grace_s, lambda: self._escalate(w.id, epoch, signal.SIGTERM))
        self._timers.add(self.stop_grace_s * 2, lambda: self._escalate(w.id, epoch, signal.SIGKILL))

    def _timers_cancel_restart(self, w: _Worker) -> None:
        w.epoch += 1  # a pending restart timer checks the epoch and does nothing
        w.crashed_before = False

    def _escalate(self, model_id: str, epoch: int, sig: signal.Signals) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch or w.proc is None:
            return
        log.warning("%s did not stop in time: %s to its process group", model_id, sig.name)
        _signal_group(w.proc, sig)

    def _start_model(self, model_id: str) -> None:
        w = self._worker(model_id)
        if w.alive:
            if w.stopping:
                w.respawn_after_stop = True
            return
        w.crash_times.clear()
        w.crashed_before = False
        w.state = ModelState.STOPPED
        self._spawn(w)

    def _apply_config(self, config: Config) -> None:
        old = self._config
        self._config = config
        wanted = {m.id: m for m in config.models}
        arena_changed = old.arena != config.arena
        for model_id, old_w in list(self._workers.items()):
            if model_id not in wanted:
                if old_w.alive:
                    self._stop_model(model_id, False)
                    old_w.removed = True  # the exit handler forgets it
                else:
                    old_w.removed = True
                    self._fail_all(old_w, UnknownModelError(f"{model_id} was removed from the configuration"))
                    del self._workers[model_id]
        for cfg in config.models:
            w = self._workers.get(cfg.id)
            if w is None:
                w = self._new_worker(cfg)
                self._workers[cfg.id] = w
                self._spawn(w)
                continue
            changed = {
                k for k, v in asdict(cfg).items() if asdict(w.config)[k] != v and k not in _LIVE_FIELDS
            }
            pinned_changed = cfg.pinned != w.config.pinned
            w.config = cfg
            w.log_path = self._log_dir / f"worker-{cfg.id}.log"
            if pinned_changed:
                self._pin(cfg.id, cfg.pinned)
            if changed or arena_changed:
                if w.state is ModelState.FAILED:
                    w.crash_times.clear()
                    self._spawn(w)
                elif w.alive:
                    self._stop_model(cfg.id, True)
            self._arm_idle(w)
        self._publish(EventKind.MESSAGE, None, "configuration applied")

    # ---- idle release (pool thread) ------------------------------------------------------

    def _arm_idle(self, w: _Worker) -> None:
        w.idle_token += 1
        delay = w.config.idle_sleep_s
        if delay is None or not w.ready or w.inflight is not None or w.queue:
            return
        token, epoch = w.idle_token, w.epoch
        self._timers.add(delay, lambda: self._idle_due(w.id, epoch, token))

    def _idle_due(self, model_id: str, epoch: int, token: int) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch or w.idle_token != token or not w.ready or w.stopping:
            return
        if w.pinned or w.inflight is not None or w.queue:
            return
        level = w.config.idle_release
        idle = w.config.idle_sleep_s
        if level == "stop":
            self._publish(
                EventKind.MESSAGE, w.id, f"{w.id} idle for {idle:g} s: stopping", extra={"level": level}
            )
            self._stop_model(w.id, False)
        elif level == "weights+kv" and w.state in (ModelState.RESIDENT, ModelState.RELEASED):
            self._send(w, protocol.Sleep(level="weights+kv"))
            self._publish(
                EventKind.MESSAGE, w.id, f"{w.id} idle for {idle:g} s: sleeping", extra={"level": level}
            )
        elif level == "weights" and w.state is ModelState.RESIDENT:
            self._send(w, protocol.Sleep(level="weights"))
            self._publish(
                EventKind.MESSAGE,
                w.id,
                f"{w.id} idle for {idle:g} s: releasing its weights",
                extra={"level": level},
            )

    # ---- shutdown (pool thread) ----------------------------------------------------------

    def _begin_shutdown(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        self._timers.clear()
        procs = []
        for w in self._workers.values():
            self._fail_all(
                w, ModelUnavailableError("Timeshare is shutting down; send again after it restarts")
            )
            w.pending.clear()
            if w.proc is not None:
                w.stopping = True
                if not self._send(w, protocol.Shutdown(save_kv=True)):
                    _signal_group(w.proc, signal.SIGTERM)
                procs.append((w.id, w.proc))
        self._publish(EventKind.MESSAGE, None, "stopping all models")
        return procs


# ---- helpers -------------------------------------------------------------------------------


def _validate(config: Config) -> None:
    problems = []
    seen: set[str] = set()
    for i, m in enumerate(config.models):
        if not m.id:
            problems.append(f"models[{i}].id: empty; give every model an id")
        elif m.id in seen:
            problems.append(f"models[{i}].id: {m.id!r} is used twice; model ids must be unique")
        seen.add(m.id)
        if not m.path:
            problems.append(f"models[{i}].path: empty; give the path of a .gguf file")
        if m.idle_release not in ("weights", "weights+kv", "stop"):
            problems.append(f"models[{i}].idle_release: {m.idle_release!r}; use weights, weights+kv or stop")
    if config.api.queue_limit < 1:
        problems.append(f"api.queue_limit: {config.api.queue_limit}; it must be at least 1")
    if problems:
        raise ConfigError(problems)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _host_bytes(w: _Worker, status: protocol.WorkerStatus | None) -> int:
    if not w.alive:
        return 0
    if status is not None:
        return status.host_pinned_bytes
    return w.info.host_pinned_bytes if w.info else 0


def _chat_message(m: protocol.ChatMessage | Mapping[str, str]) -> protocol.ChatMessage:
    if isinstance(m, protocol.ChatMessage):
        return m
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "user", "assistant") or not isinstance(content, str):
        raise ValueError(
            f"a chat message needs role system/user/assistant and a text content, got {dict(m)!r}"
        )
    return protocol.ChatMessage(cast(Literal["system", "user", "assistant"], role), content)


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
