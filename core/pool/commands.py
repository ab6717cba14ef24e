"""The pool thread's halves of :class:`~.supervisor.Pool`'s public methods: what ``start``,
``generate`` (and a generation's cancel), ``pin``, ``sleep``, ``wake``, ``stop_model``,
``start_model``, ``apply_config`` and ``stop`` post to the pool thread, which runs them here.

What happens on the pool thread by itself (worker messages and exits, restarts, idle release, the
watchdog) is :class:`~.handlers.PoolHandlers`, which this builds on.
"""

from __future__ import annotations

import signal
import subprocess

from ..config.schema import Config
from ..errors import ModelUnavailableError, QueueFullError, UnknownModelError
from ..state import EventKind, ReleaseLevel
from ..worker import protocol
from .configure import restart_fields
from .generation import Generation
from .handlers import SHUTTING_DOWN, PoolHandlers, unavailable
from .lifecycle import Phase
from .process import signal_group
from .record import WorkerRecord
from .watchdog import tick_period


class PoolCommands(PoolHandlers):
    """The calls that Pool's public methods make on the pool thread (pool thread only)."""

    # ---- starting (pool thread) ----------------------------------------------------------

    def _start_all(self) -> None:
        for cfg in self._config.models:
            self._workers[cfg.id] = self._new_worker(cfg)
        self._publish()
        for w in list(self._workers.values()):
            self._spawn(w)
        self._timers.add(tick_period(self._config.arena.hung_holder_s), self._watchdog_tick)

    # ---- requests (pool thread) ----------------------------------------------------------

    def _worker(self, model_id: str) -> WorkerRecord:
        w = self._workers.get(model_id)
        if w is None or w.removed:
            known = ", ".join(sorted(k for k, v in self._workers.items() if not v.removed)) or "none"
            raise UnknownModelError(f"unknown model {model_id!r}; configured models: {known}")
        return w

    def _submit(self, gen: Generation) -> None:
        w = self._worker(gen.model)
        if w.phase is Phase.FAILED:
            raise ModelUnavailableError(unavailable(w))
        limit = self._config.api.queue_limit
        if len(w.queue) >= limit:
            raise QueueFullError(
                f"{w.id} already has {len(w.queue)} requests waiting (api.queue_limit = {limit}); "
                "retry later or raise the limit"
            )
        w.queue.append(gen)
        self._wanted(w)
        self._dispatch(w)

    def _wanted(self, w: WorkerRecord) -> None:
        """A request or a wake wants the model: start a STOPPED one on demand; one being stopped
        starts again once it has exited."""
        if w.phase is Phase.STOPPED:
            self._spawn(w)
        elif w.phase is Phase.STOPPING:
            w.lifecycle.transition(Phase.RESTARTING)

    def _cancel(self, gen: Generation) -> None:
        w = self._workers.get(gen.model)
        if w is None or gen.done:
            return
        if gen in w.queue:
            w.queue.remove(gen)
            gen._finish_cancelled()
            self._publish(model=w.id)
        elif w.inflight is gen:
            w.send(protocol.Cancel(gen.req))

    # ---- commands (pool thread) ----------------------------------------------------------

    def _command(self, w: WorkerRecord, msg: object) -> None:
        """Send now when the worker is ready (a wake may go in during the load), else once it is."""
        if w.ready or (w.accepting and isinstance(msg, protocol.Wake)):
            w.send(msg)
        else:
            w.pending.append(msg)

    def _pin(self, model_id: str, pinned: bool) -> bool:
        """True when a Pin went to a running worker (whose confirmation pin() then awaits)."""
        w = self._worker(model_id)
        w.pinned = pinned
        sent = w.ready and w.send(protocol.Pin(pinned))
        self._publish(EventKind.MESSAGE, w.id, f"{w.id} {'pinned' if pinned else 'unpinned'}")
        if not pinned:
            self._arm_idle(w)
        return sent

    def _sleep(self, model_id: str, level: ReleaseLevel) -> None:
        w = self._worker(model_id)
        if level == "stop":
            self._stop(w)
            return
        if w.phase in (Phase.STOPPED, Phase.FAILED):
            return  # holds nothing
        self._command(w, protocol.Sleep(level=level))
        self._publish(EventKind.MESSAGE, w.id, f"{w.id}: sleep ({level})", extra={"level": level})

    def _wake(self, model_id: str) -> None:
        w = self._worker(model_id)
        if w.phase is Phase.FAILED:
            raise ModelUnavailableError(unavailable(w))
        self._command(w, protocol.Wake())
        self._wanted(w)  # a stopped one starts, then wakes
        self._publish(EventKind.MESSAGE, w.id, f"{w.id}: wake")

    def _stop_model(self, model_id: str) -> None:
        self._stop(self._worker(model_id))

    def _start_model(self, model_id: str) -> None:
        """Start a STOPPED, FAILED (or restarting) model now, with a fresh restart budget.
        Raises ModelUnavailableError when it fails at once (its file is still missing ...)."""
        w = self._worker(model_id)
        if w.alive:
            if w.phase is Phase.STOPPING:
                w.lifecycle.transition(Phase.RESTARTING)
            return
        w.crash_times.clear()  # a fresh restart budget
        w.spawn_failures = 0
        if w.phase is Phase.BACKOFF:
            w.lifecycle.transition(Phase.STOPPED)  # a start, not a restart after the crash
        self._spawn(w)
        if w.phase is Phase.FAILED:
            raise ModelUnavailableError(unavailable(w))

    def _apply_config(self, config: Config) -> None:
        old = self._config
        self._config = config
        wanted = {m.id for m in config.models}
        arena_changed = old.arena != config.arena
        for model_id, gone in list(self._workers.items()):
            if model_id in wanted or gone.removed:
                continue
            if gone.alive:
                self._stop(gone, Phase.REMOVING)  # forgotten once it has exited
            else:
                self._forget(gone)
        for cfg in config.models:
            w = self._workers.get(cfg.id)
            if w is None:
                w = self._new_worker(cfg)
                self._workers[cfg.id] = w
                self._spawn(w)
                continue
            changed = restart_fields(w.config, cfg)
            pinned_changed = cfg.pinned != w.config.pinned
            w.config = cfg
            w.log_path = self._log_dir / f"worker-{cfg.id}.log"
            if w.phase is Phase.REMOVING:  # added back before its worker exited: start it again
                w.lifecycle.transition(Phase.RESTARTING)
            if pinned_changed:
                self._pin(cfg.id, cfg.pinned)
            if changed or arena_changed:
                if w.phase is Phase.FAILED:
                    w.crash_times.clear()
                    self._spawn(w)
                elif w.alive:
                    self._stop(w, Phase.RESTARTING)
            self._arm_idle(w)
        self._publish(EventKind.MESSAGE, None, "configuration applied")

    # ---- shutdown (pool thread) ----------------------------------------------------------

    def _begin_shutdown(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        self._timers.clear()
        procs = []
        for w in self._workers.values():
            w.fail_all(ModelUnavailableError(SHUTTING_DOWN))
            w.pending.clear()
            if w.proc is not None:
                if w.phase not in (Phase.STOPPING, Phase.REMOVING):
                    w.lifecycle.transition(Phase.STOPPING)
                if not w.send(protocol.Shutdown(save_kv=True)):
                    signal_group(w.proc, signal.SIGTERM)
                procs.append((w.id, w.proc))
        self._publish(EventKind.MESSAGE, None, "stopping all models")
        return procs
