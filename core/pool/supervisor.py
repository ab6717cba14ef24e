"""The pool: :class:`Pool`, the supervisor of one worker process per model, in one class.

The Pool owns its actor (``actor.Actor``: the pool thread's inbox, its timers, the event thread)
and its worker records (``record.WorkerRecord``: one worker's process, queue, lifecycle and
policy). Public methods post to the pool thread and wait (``self._actor.call``); below them, the
pool thread's halves of those methods, then what the pool thread does by itself (spawning, worker
messages and exits, restarts, dispatching, stopping, idle release, the hung-holder watchdog,
publishing). A worker's states and allowed transitions are ``lifecycle.py``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from .. import errors, kv_folder, paths
from ..arena.arena import check_arena_dir
from ..arena.dirs import resolve_arena_dir
from ..config.schema import Config, ModelConfig
from ..config.vram_budget import resolve_arena
from ..diskspace import MIN_FREE_BYTES, free_bytes
from ..errors import ModelUnavailableError, QueueFullError, UnknownModelError
from ..gguf.modelfile import is_transient, transient_text
from ..observe import EventLog
from ..sampling import Sampling
from ..state import (
    EventKind,
    ModelState,
    PoolEvent,
    PoolSnapshot,
    ReleaseLevel,
    SwitchStats,
    parse_release_level,
)
from ..wire import protocol
from ..wire.protocol import INTERNAL_SAMPLING
from ..wire.spec import WorkerSpec
from .actor import Actor
from .codes import error_for
from .configure import check_config, restart_fields
from .devices import device_statuses
from .filecheck import FileCheck, find_model_file
from .generation import Generation, make_embed_request, make_request, make_rerank_request
from .lifecycle import Phase
from .process import end_processes, read_log_tail, read_worker, signal_group, spawn_worker
from .record import WorkerPolicy, WorkerRecord
from .watchdog import HolderWatchdog, tick_period

log = logging.getLogger(__name__)

SHUTTING_DOWN = "Timeshare is shutting down; send again after it restarts"
#: loads of its model a request waits through: the worker dying during the last fails it
LOAD_TRIES = 3
#: a model that failed for a full disk is started again on its own once the disk has room: it looks
#: after this long, doubling up to DISK_RETRY_MAX_S between looks
DISK_RETRY_FIRST_S = 1.0
DISK_RETRY_MAX_S = 60.0
#: the words of ENOSPC and EDQUOT (os.strerror) and of DiskFullError in a failure's reason
_DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "disk is full")


class Pool:
    """Supervisor of one worker process per configured model.

    One worker process per configured model (``python -m timeshare.core.worker``), spawned with a
    clean environment, talking ``core/wire/protocol.py`` over a socketpair. The pool thread owns
    every piece of pool state; public methods post a call to it and wait for its answer, one reader
    thread per worker posts each message and then the exit, timers (restart backoff, idle release,
    stop escalation) run on the pool thread. After every change it publishes a frozen
    :class:`PoolSnapshot` (``snapshot()``) and queues a :class:`PoolEvent` for the subscribers.
    """

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
        check_config(config)  # ConfigError for what the config layer refuses
        # the inbox, timers and event fan-out: the pool thread runs what is posted to it
        self._actor = Actor("pool", on_ended=self._loop_ended)
        self._config = config
        # what every worker record's crash backoff, spawn retries and stop escalation follow
        self._policy = WorkerPolicy(restart_backoff_s, max_restarts, restart_window_s, stop_grace_s)
        self.event_log = event_log
        # the command that starts a worker, before "--spec JSON --ipc-fd N" (a frozen build or
        # a test's fault injection may give its own)
        self.worker_argv = tuple(worker_argv or (sys.executable, "-m", "timeshare.core.worker"))
        self.arena_dir: Path | None = None  # these three are set by start()
        self._log_dir = Path()
        self._kv_root = Path()
        self._arena_dir_arg = arena_dir
        self._log_dir_arg = log_dir
        self._kv_dir_arg = kv_dir
        self._req_ids = itertools.count(1)

        self._workers: dict[str, WorkerRecord] = {}
        self._holder: str | None = None
        self._readers: list[threading.Thread] = []
        self._state_cond = threading.Condition()
        # the configured models from the first snapshot on (each "starting" until its record
        # exists), so an API that answers before the pool thread has run lists them all
        self._snapshot = PoolSnapshot(
            models=tuple(self._new_worker(cfg).model_status()[0] for cfg in config.models)
        )
        self._worker_pinned: dict[str, bool] = {}
        self._watchdog = HolderWatchdog()  # hung holders (arena.hung_holder_s)

    def subscribe(self, callback: Callable[[PoolEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` from the pool's event thread for every event; returns the
        function that unsubscribes. Keep callbacks short (post to your own thread/queue)."""
        return self._actor.subscribe(callback)

    # ---- starting and stopping -----------------------------------------------------------

    def start(self, conversation_gone: Callable[[str], bool] | None = None) -> None:
        """Validate the arena, then spawn a worker per model and return at once. Before the
        first spawn the KV folder is swept (``kv_folder.sweep``): the folders of models not
        configured go, and, with ``conversation_gone``, the files of the conversations it says
        are gone (the app: deleted from its conversations).

        Raises ArenaError when the arena directory is unsafe (nothing is spawned then)."""
        with self._actor.lock:
            if self._actor.running:
                return
            if self._actor.closing:
                raise ModelUnavailableError("this pool was stopped; create a new Pool to start again")
            # validates (creating it if missing) owner, mode and symlinks; raises ArenaError
            try:
                self.arena_dir = check_arena_dir(self._resolve_arena_dir())
            except errors.ArenaError:
                # nothing will start: the first snapshot's "starting" models are not listed
                with self._state_cond:
                    self._snapshot = PoolSnapshot()
                    self._state_cond.notify_all()
                raise
            self._log_dir = Path(self._log_dir_arg) if self._log_dir_arg else paths.log_dir()
            self._log_dir.mkdir(parents=True, exist_ok=True)
            self._kv_root = Path(self._kv_dir_arg) if self._kv_dir_arg else paths.kv_dir()
            self._actor.start()
        self._actor.post(self._start_all, conversation_gone)

    def _resolve_arena_dir(self) -> Path:
        if self._arena_dir_arg is not None:
            return Path(self._arena_dir_arg).expanduser()
        return resolve_arena_dir(self._config.arena.dir)  # $TIMESHARE_VRAM_ARENA, config, default

    def stop(self, timeout: float = 10.0) -> None:
        """Shut every worker down: Shutdown (workers save their KV), a grace period, SIGTERM, then
        SIGKILL to each worker's process group. Returns when no worker process is left."""
        with self._actor.lock:
            if not self._actor.running:
                return
            already = self._actor.closing  # another thread is stopping it: wait for that one
            self._actor.closing = True
        if already:
            if self._actor.thread is not None and self._actor.thread is not threading.current_thread():
                self._actor.thread.join(timeout=timeout + 10.0)
            return
        end_processes(self._actor.call(self._begin_shutdown, closing_ok=True), timeout)
        for reader in list(self._readers):
            reader.join(timeout=5.0)
        self._actor.join()

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

    def wait_ready(self, model_ids: Iterable[str] | None = None, timeout: float = 120.0) -> None:
        """Wait until each model has left STARTING/LOADING (it serves, or it is STOPPED/FAILED:
        look at ``snapshot()``). Raises TimeoutError naming the models still starting."""
        if not self._actor.running:
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

    def wait_state(self, model_id: str, states: Iterable[ModelState], timeout: float) -> bool:
        """Wait until ``model_id`` is in one of ``states``; False when ``timeout`` ran out first."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        with self._state_cond:
            while True:
                status = self._snapshot.model(model_id)
                if status is not None and status.state in wanted:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._state_cond.wait(min(left, 0.5))

    # ---- commands ------------------------------------------------------------------------

    def generate(
        self,
        model_id: str,
        *,
        prompt: str | None = None,
        messages: Sequence[protocol.ChatMessage | Mapping[str, str]] | None = None,
        sampling: Sampling = INTERNAL_SAMPLING,
        conversation: str | None = None,
        cache_prompt: bool | None = None,
        tools: Sequence[protocol.ToolSpec] = (),
        images: Sequence[protocol.ImagePart] = (),
        prompt_logprobs: bool = False,
        score_only: bool = False,
        prompt_tokens: Sequence[int] | None = None,
    ) -> Generation:
        """Queue a request for ``model_id`` (FIFO, one at a time per worker) and return its handle.

        Give ``prompt`` (completion; ``images``: the images among its text) or ``messages``
        (chat: ChatMessage, which carry their own images, or {"role", "content"});
        ``sampling`` is carried to the worker unchanged (default: greedy, 256 tokens at most).
        ``prompt_tokens``: a completion prompt given as token ids (instead of ``prompt``; no BOS
        added). ``prompt_logprobs``: the prompt tokens' logprobs too (``result().prompt_logprobs``, with
        ``sampling.top_logprobs`` alternatives); ``score_only``: generate nothing (max_tokens 0).
        Raises UnknownModelError, ModelUnavailableError (failed model), QueueFullError, and
        ValueError for malformed arguments. A STOPPED model is started on demand."""
        request = make_request(
            f"r{next(self._req_ids)}",
            model_id,
            prompt=prompt,
            messages=messages,
            sampling=sampling,
            conversation=conversation,
            cache_prompt=cache_prompt,
            tools=tools,
            images=images,
            prompt_logprobs=prompt_logprobs,
            score_only=score_only,
            prompt_tokens=prompt_tokens,
        )
        gen = Generation(model_id, request, functools.partial(self._actor.post, self._cancel))
        self._actor.call(self._submit, gen)
        return gen

    def embed(self, model_id: str, inputs: Sequence[str | Sequence[int]]) -> Generation:
        """Queue an embedding request (texts or token-id lists) for ``model_id``, in the same
        queue as its generations; ``result().embeddings`` holds the unit vectors in order and
        ``usage.prompt_tokens`` the tokens embedded. Raises as ``generate`` does."""
        request = make_embed_request(f"r{next(self._req_ids)}", model_id, inputs)
        gen = Generation(model_id, request, functools.partial(self._actor.post, self._cancel))
        self._actor.call(self._submit, gen)
        return gen

    def rerank(self, model_id: str, query: str, documents: Sequence[str]) -> Generation:
        """Queue a rerank (issue 42) for ``model_id``, a reranker, in the same queue as its
        generations: ``result().embeddings`` holds each document's scores (the model's classifier
        outputs; the first is the relevance score) in the documents' order, ``usage.prompt_tokens``
        the tokens of all the pairs. A model that is not a reranker fails with InvalidInputError.
        Raises as ``generate`` does."""
        request = make_rerank_request(f"r{next(self._req_ids)}", model_id, query, documents)
        gen = Generation(model_id, request, functools.partial(self._actor.post, self._cancel))
        self._actor.call(self._submit, gen)
        return gen

    def pin(self, model_id: str, pinned: bool = True, timeout: float = 10.0) -> None:
        """Pin (or unpin) a model. Returns once its worker has confirmed it (or is not running:
        then it applies when the worker is ready), so a request sent afterwards to another model
        cannot take the GPU from a freshly pinned holder."""
        if not self._actor.call(self._pin, model_id, pinned):
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

    def sleep(self, model_id: str, level: ReleaseLevel = "weights") -> None:
        self._actor.call(self._sleep, model_id, parse_release_level(level))

    def forget_conversation(self, conversation: str) -> int:
        """A conversation was deleted: its KV files go, every model's, now, on the caller's thread
        (a few unlinks: the pool thread is not waited for). A worker that holds its sequence and
        saves it when it stops leaves a file that the next start's sweep removes. Returns how
        many files went (0 before ``start``)."""
        if not self._actor.running:
            return 0
        return kv_folder.remove_conversation(self._kv_root, conversation)

    def wake(self, model_id: str) -> None:
        self._actor.call(self._wake, model_id)

    def stop_model(self, model_id: str) -> None:
        self._actor.call(self._stop_model, model_id)

    def start_model(self, model_id: str) -> None:
        """Start a stopped or failed model now; raises ModelUnavailableError when it fails at once
        (its file is still missing...). Its file is checked on the calling thread."""
        config = self._actor.call(self._config_of, model_id)
        self._actor.call(self._start_model, model_id, find_model_file(config))

    def apply_config(self, config: Config) -> None:
        """Adopt a new configuration: start added models, stop removed ones, restart models whose
        load-time settings changed; pin and idle settings apply without a restart. The files of
        added models and of those whose load-time settings changed are checked on the calling
        thread (a start that finds no check of its config makes its own, off the pool thread)."""
        check_config(config)
        old = self._config
        checks = {
            cfg.id: find_model_file(cfg)
            for cfg in config.models
            if (before := old.model(cfg.id)) is None or restart_fields(before, cfg)
        }
        self._actor.call(self._apply_config, config, checks)

    # ==== on the pool thread: the halves of the public methods ====

    # ---- starting (pool thread) ----------------------------------------------------------

    def _start_all(self, conversation_gone: Callable[[str], bool] | None) -> None:
        try:  # no worker runs yet: no KV file is in use
            kv_folder.sweep(self._kv_root, (cfg.id for cfg in self._config.models), conversation_gone)
        except Exception:  # a cache's upkeep: the models start all the same
            log.exception("sweeping the KV folder %s failed", self._kv_root)
        for cfg in self._config.models:
            self._workers[cfg.id] = self._new_worker(cfg)
        self._publish()
        for w in list(self._workers.values()):
            self._spawn(w)
        self._actor.later(tick_period(self._config.arena.hung_holder_s), self._watchdog_tick)

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
            gen.finish_cancelled()
            self._publish(model=w.id)
        elif w.inflight.get(gen.req) is gen:
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

    def _config_of(self, model_id: str) -> ModelConfig:
        return self._worker(model_id).config

    def _start_model(self, model_id: str, checked: FileCheck | None = None) -> None:
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
        self._spawn(w, checked)
        if w.phase is Phase.FAILED:  # (not "to start it: timeshare start": that was the start)
            raise ModelUnavailableError(unavailable(w, started=True))

    def _apply_config(self, config: Config, checks: Mapping[str, FileCheck] | None = None) -> None:
        checks = checks or {}
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
                self._spawn(w, checks.get(cfg.id))
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
                    self._spawn(w, checks.get(cfg.id))
                elif w.alive:
                    self._stop(w, Phase.RESTARTING)
            self._arm_idle(w)
        self._publish(EventKind.MESSAGE, None, "configuration applied")

    # ---- shutdown (pool thread) ----------------------------------------------------------

    def _begin_shutdown(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        self._actor.clear_timers()
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

    # ==== on the pool thread: by itself ====

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
        self._actor.emit(PoolEvent(kind, snap, model, message, switch, dict(extra or {})))

    # ---- spawning (pool thread) ----------------------------------------------------------

    def _new_worker(self, cfg: ModelConfig) -> WorkerRecord:
        return WorkerRecord(config=cfg, log_path=self._log_dir / f"worker-{cfg.id}.log", pinned=cfg.pinned)

    def _spawn(self, w: WorkerRecord, checked: FileCheck | None = None) -> None:
        """NEW, STOPPED, BACKOFF, RETRYING or FAILED → STARTING (FAILED when the model file is
        unusable or the process cannot be started; RETRYING on a passing shortage of open files or
        memory).

        The model file is checked first, never on this thread (it reads the disk and may assemble
        a demo model): ``checked`` is a check the caller made of the model's current config; without
        one (or for another config) a one-shot thread checks it and posts the result back to
        :meth:`_file_checked`, which spawns. One check per model at a time; stopping or removing the
        model forgets it."""
        if self._actor.closing or w.removed or w.alive:
            return
        if checked is None or checked.config != w.config:
            self._check_file(w)
            return
        w.file_check = None  # a check still running for it is answered by this one
        if checked.transient is not None:
            self._retry_spawn(w, checked.transient)
            return
        if not checked.usable:
            self._set_failed(w, checked.problem, checked.code)
            return
        path = checked.path
        try:  # $TIMESHARE_VRAM_BUDGET is read here, at each spawn, and the worker gets the result
            arena = resolve_arena(self._config.arena)
        except errors.ConfigError as exc:
            self._set_failed(w, f"{exc}: fix it and start {w.id} again", errors.ConfigError.code)
            return
        spec = WorkerSpec(
            model=replace(w.config, path=path),
            arena=arena,
            arena_dir=str(self.arena_dir),
            kv_dir=str(self._kv_root / w.id),
            event_log=self.event_log,
        )
        try:
            proc, conn = spawn_worker(self.worker_argv, spec.to_json(), w.log_path, w.id)
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
                max(self._policy.stop_grace_s, 1.0),
                functools.partial(self._actor.post, self._on_message, w.id, w.epoch),
                functools.partial(self._actor.post, self._on_exit, w.id, w.epoch),
            ),
            name=f"pool-read-{w.id}",
            daemon=True,
        )
        self._readers = [t for t in self._readers if t.is_alive()]
        self._readers.append(reader)
        reader.start()
        self._publish(model=w.id)

    def _check_file(self, w: WorkerRecord) -> None:
        """Check ``w``'s model file on a one-shot thread; the result comes back to the pool thread
        (:meth:`_file_checked`). Nothing starts while one is under way."""
        if w.file_check is not None:
            return  # its answer spawns
        token = object()
        w.file_check = token
        config = w.config

        def check() -> None:
            result = find_model_file(config)
            self._actor.post(self._file_checked, w.id, token, result)

        threading.Thread(target=check, name=f"pool-file-check-{w.id}", daemon=True).start()

    def _file_checked(self, model_id: str, token: object, result: FileCheck) -> None:
        w = self._workers.get(model_id)
        if w is None or w.file_check is not token:
            return  # stopped, removed, or answered by a newer check meanwhile
        w.file_check = None
        self._spawn(w, result)  # for a config changed meanwhile: checked again

    # ---- worker messages (pool thread) ---------------------------------------------------

    def _on_message(self, model_id: str, epoch: int, msg: object) -> None:
        w = self._workers.get(model_id)
        if w is None or w.epoch != epoch:
            return
        if isinstance(msg, protocol.Token):
            gen = w.inflight.get(msg.req)
            if gen is not None:
                gen.feed(msg.text, msg.logprobs)
        elif isinstance(msg, protocol.PromptLogprobs):
            gen = w.inflight.get(msg.req)
            if gen is not None:
                gen.add_prompt_logprobs(msg.logprobs)
        elif isinstance(msg, protocol.Embeddings):
            gen = w.inflight.get(msg.req)
            if gen is not None:
                gen.add_embeddings(msg.data)
        elif isinstance(msg, protocol.WorkerStatus):
            self._on_status(w, msg)
        elif isinstance(msg, protocol.StatusReply):
            self._watchdog.answered(w, msg.req)
            self._on_status(w, msg.status)
        elif isinstance(msg, protocol.Done):
            self._on_done(w, msg)
        elif isinstance(msg, protocol.Released):
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
        w.disk_retries = 0
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
        gen = w.inflight.pop(msg.req, None)
        if gen is None:
            log.warning("%s: Done for unknown request %s", w.id, msg.req)
            return
        switch = SwitchStats(
            switched=msg.switch.switched,
            wait_ms=msg.switch.wait_ms,
            restore_ms=msg.switch.restore_ms,
            # the previous holder's release as the arena handed it over with the token: never a
            # guess from the order in which two workers' messages reach this process
            release_ms=msg.switch.release_ms if msg.switch.switched else 0.0,
            first_token_ms=msg.switch.first_token_ms,
            prompt_tokens_evaluated=msg.usage.prompt_tokens_evaluated,
            restored_bytes=msg.switch.restored_bytes,
        )
        w.last_switch = switch
        if msg.finish_reason == "cancelled" and not gen.cancelled:
            # the worker cut the answer short on its own (stopped, removed, restarted, shut down):
            # an error with the reason, never a finished answer (its text so far stays in ``gen``)
            gen.fail(ModelUnavailableError(cut_short(w, self._actor.closing)))
        else:
            gen.finish(msg.finish_reason, msg.usage, switch, msg.stop, msg.batch_size, msg.timings)
            if msg.finish_reason != "cancelled":
                w.answered += 1  # the model works: a crash charged to a request is forgiven
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
                "conversation": getattr(gen.request, "conversation", None),
                "batch_size": msg.batch_size,
            },
        )
        self._dispatch(w)
        self._arm_idle(w)

    def _on_error(self, w: WorkerRecord, msg: protocol.Error) -> None:
        if msg.fatal:
            w.fatal = msg
            log.error("%s: fatal worker error (%s): %s", w.id, msg.code, msg.message)
        failed = [w.inflight.pop(msg.req)] if msg.req in w.inflight else []
        if msg.fatal and msg.req is None:
            failed, w.inflight = list(w.inflight.values()), {}
        if failed:
            for gen in failed:
                message = msg.message
                if msg.code == errors.ModelUnavailableError.code and (
                    w.lifecycle.stopping or self._actor.closing
                ):
                    # "the worker is shutting down": say why, as for an answer it cut short
                    message = cut_short(w, self._actor.closing, begun=bool(gen.text))
                gen.fail(error_for(msg.code, message))
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
            if self._actor.closing:
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
        now = time.monotonic()
        charged: list[Generation] = []
        forgiven = False
        if not was_ready:
            w.requeue_inflight()  # they were waiting for the load, not being answered
            self._count_load_crash(w, f"it {hung}" if hung else f"exit status {code}")
        else:
            # the requests in flight at their second crash are charged with it (record.py)
            charged, forgiven = w.charge_crash(now)
            # each request in flight on its own: one that had streamed nothing yet is sent again
            # after the restart (once: a second crash with it in flight fails it); one that had
            # streamed part of its answer fails, saying so
            again = w.requeue_inflight(only_unanswered=True)
            if again:
                log.info("%s: %d request(s) in flight had no answer yet: sent again", w.id, len(again))
        self._publish(
            EventKind.CRASHED,
            w.id,
            f"{w.id} was killed: it {hung}" if hung else f"{w.id} crashed (exit status {code})",
            extra={"exit_code": code, "log_tail": list(w.log_tail), **({"watchdog": hung} if hung else {})},
        )
        for gen in list(w.inflight.values()):
            del w.inflight[gen.req]
            if gen in charged:
                gen.fail(
                    ModelUnavailableError(
                        f"{w.id} crashed twice while answering this request (it was sent again after "
                        "the first crash): the request itself is the likely cause, so it is not sent "
                        f"again; the model is restarted for the others. See the worker log {w.log_path}"
                    )
                )
                continue
            said = (
                f"while answering ({len(gen.text)} characters streamed)"
                if gen.text
                else "again before answering (this request was in flight at both crashes)"
            )
            gen.fail(ModelUnavailableError(f"{w.id} crashed {said}; it is being restarted — send again"))
        if forgiven:
            # charged to a request: not counted toward taking the model offline (record.py)
            log.warning(
                "%s: crash charged to request(s) %s (in flight at two crashes in a row); not counted",
                w.id,
                ", ".join(g.req for g in charged),
            )
            w.restarts += 1
            delay: float | None = self._policy.restart_backoff_s
        else:
            delay = w.crash_backoff(self._policy, now)
        if delay is None:
            self._set_failed(
                w,
                f"{w.id} crashed {_times(len(w.crash_times) + 1)} within {self._policy.restart_window_s:g} s "
                f"(last exit status {code}); see its log {w.log_path}, then start it again",
            )
            return
        w.lifecycle.transition(Phase.BACKOFF)
        w.reason = f"restarting in {delay:g} s after a crash (exit status {code})"
        if hung:
            w.reason = f"restarting in {delay:g} s: killed because it {hung}"
        self._publish(model=w.id)
        self._after(delay, w, Phase.BACKOFF, self._spawn)

    def _count_load_crash(self, w: WorkerRecord, why: str) -> None:
        """The worker died while loading: each waiting request has tried once more; one that
        has waited through LOAD_TRIES loads fails with the reason (it was re-queued for ever when
        the crashes were spread wider than the restart window)."""
        waiting = list(w.queue)
        w.queue.clear()
        for gen in waiting:
            gen.dispatch.load_crashes += 1
            if gen.dispatch.load_crashes < LOAD_TRIES:
                w.queue.append(gen)
                continue
            gen.fail(
                ModelUnavailableError(
                    f"{w.id} died {_times(gen.dispatch.load_crashes)} while loading for this request (last: "
                    f"{why}); see its log {w.log_path}, then send again"
                )
            )
        if len(w.queue) != len(waiting):
            self._publish(model=w.id)

    def _retry_spawn(self, w: WorkerRecord, exc: OSError) -> None:
        """A spawn met a passing shortage (too many open files, no memory): try again after a
        delay; FAILED, saying what ran short, once it has lasted SPAWN_RETRIES attempts."""
        what = transient_text(exc)
        delay = w.spawn_retry_delay(self._policy)
        if delay is None:
            self._set_failed(
                w,
                f"could not start the worker for {w.id}: {what}. Close programs (or connections) that "
                "hold many files, or raise the open-files limit (ulimit -n) or free memory, then "
                "start the model again",
            )
            return
        w.epoch += 1  # timers of an earlier attempt do nothing
        w.lifecycle.transition(Phase.RETRYING)
        w.reason = f"could not start: {what}; trying again in {delay:g} s"
        log.warning("%s: %s", w.id, w.reason)
        self._publish(model=w.id)
        self._after(delay, w, Phase.RETRYING, self._spawn)

    def _set_failed(self, w: WorkerRecord, reason: str, code: str = "") -> None:
        w.lifecycle.transition(Phase.FAILED)
        w.reason = reason
        w.failure_code = code
        if not w.log_tail:
            w.log_tail = read_log_tail(w.log_path)
        disk_full = code == errors.DiskFullError.code or any(words in reason for words in _DISK_FULL_WORDS)
        if disk_full and not w.alive:  # (a live process's epoch must not change under it)
            delay = self._arm_disk_retry(w)
            w.reason = (
                f"{reason} (the disk is full: Timeshare starts it again on its own once there is room; "
                f"next look in {delay:g} s)"
            )
        w.fail_all(ModelUnavailableError(unavailable(w)))
        log.error("%s failed: %s", w.id, w.reason)
        self._publish(EventKind.FAILED, w.id, w.reason)

    def _arm_disk_retry(self, w: WorkerRecord) -> float:
        """Look again after a bounded backoff whether the disks the worker writes have room."""
        w.disk_retries += 1
        delay = min(DISK_RETRY_MAX_S, DISK_RETRY_FIRST_S * float(2 ** min(w.disk_retries - 1, 16)))
        w.epoch += 1  # timers of an earlier failure do nothing
        self._after(delay, w, Phase.FAILED, self._disk_retry_due)
        return delay

    def _disk_retry_due(self, w: WorkerRecord) -> None:
        if self._actor.closing:
            return
        try:
            room = all(free_bytes(folder) >= MIN_FREE_BYTES for folder in (self._log_dir, self._kv_root))
        except OSError:
            room = True  # cannot ask: let the start find out
        if not room:
            delay = self._arm_disk_retry(w)
            w.reason = w.reason.rsplit("; next look in", 1)[0] + f"; next look in {delay:g} s)"
            self._publish(model=w.id)
            return
        log.info("%s: the disk has room again: starting it", w.id)
        self._publish(EventKind.MESSAGE, w.id, f"{w.id}: the disk has room again, starting it")
        self._spawn(w)

    def _forget(self, w: WorkerRecord) -> None:
        """REMOVED: out of the configuration and, with no process left, out of the pool."""
        w.lifecycle.transition(Phase.REMOVED)
        w.file_check = None
        w.fail_all(UnknownModelError(f"{w.id} was removed from the configuration"))
        del self._workers[w.id]
        kv_folder.remove_model(self._kv_root, w.id)  # its process is gone: its files are not in use
        self._publish(model=w.id)

    # ---- timers (pool thread) -----------------------------------------------------------

    def _after(
        self, delay: float, w: WorkerRecord, phase: Phase | None, fn: Callable[[WorkerRecord], None]
    ) -> None:
        """Run ``fn(w)`` on the pool thread after ``delay`` s if ``w`` is still this pool's record of
        its model, in the same spawn (epoch) and, when ``phase`` is given, still in that phase: a
        timer of an earlier process, or of a state the worker has left, does nothing."""
        epoch = w.epoch

        def due() -> None:
            if self._workers.get(w.id) is w and w.epoch == epoch and (phase is None or w.phase is phase):
                fn(w)

        self._actor.later(delay, due)

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
        w.file_check = None  # a check under way starts nothing
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
        for delay, sig in self._policy.escalation():
            self._after(delay, w, None, functools.partial(self._escalate, sig))

    def _escalate(self, sig: signal.Signals, w: WorkerRecord) -> None:
        if w.proc is None:
            return
        log.warning("%s did not stop in time: %s to its process group", w.id, sig.name)
        signal_group(w.proc, sig)

    # ---- idle release (pool thread) ------------------------------------------------------

    def _arm_idle(self, w: WorkerRecord) -> None:
        delay = w.arm_idle()
        if delay is not None:
            self._after(delay, w, Phase.READY, functools.partial(self._idle_due, w.idle_token))

    def _idle_due(self, token: int, w: WorkerRecord) -> None:
        if not w.idle_due(token):
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
        if self._actor.closing:
            return
        limit = self._config.arena.hung_holder_s
        try:
            if limit > 0 and self.arena_dir is not None:
                for w, why in self._watchdog.check(list(self._workers.values()), self.arena_dir, limit):
                    self._kill_hung(w, why)
        finally:
            self._actor.later(tick_period(limit), self._watchdog_tick)

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


def unavailable(w: WorkerRecord, *, started: bool = False) -> str:
    """Why a FAILED model does not answer, naming it by id, and what to do (``started``: a
    start just failed, so only why)."""
    who = w.id if w.config.display_name == w.id else f"{w.config.display_name} ({w.id})"
    if started:
        return f"{who} did not start: {w.reason}"
    return (
        f"{who} is not available: {w.reason} (to start it: `timeshare start {w.id}`, "
        f"POST /timeshare/v1/models/{w.id}/start, or Restart in the tray)"
    )


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"
