"""The pool: :class:`Pool`, the supervisor of one worker process per model; its public methods.

The pool thread's side is ``handlers.py`` (worker records, messages, exits, timers) and
``commands.py`` (what these public methods run there); a worker's lifecycle, its states and allowed
transitions, ``lifecycle.py``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .. import paths
from ..arena.dirs import resolve_arena_dir
from ..arena.tickets import check_arena_dir
from ..config.schema import Config
from ..errors import ModelUnavailableError
from ..sampling import Sampling
from ..state import ModelState, PoolSnapshot, ReleaseLevel, parse_release_level
from ..worker import protocol
from ..worker.protocol import INTERNAL_SAMPLING
from .commands import PoolCommands
from .configure import check_config
from .generation import Generation, make_request
from .process import end_processes

log = logging.getLogger(__name__)


class Pool(PoolCommands):
    """Supervisor of one worker process per configured model.

    One worker process per configured model (``python -m timeshare.core.worker``), spawned with a
    clean environment, talking ``core/worker/protocol.py`` over a socketpair. The pool thread owns
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
        super().__init__(
            config,
            restart_backoff_s=restart_backoff_s,
            max_restarts=max_restarts,
            restart_window_s=restart_window_s,
            stop_grace_s=stop_grace_s,
            event_log=event_log,
            # the command that starts a worker, before "--spec JSON --ipc-fd N" (a frozen build or
            # a test's fault injection may give its own)
            worker_argv=worker_argv or (sys.executable, "-m", "timeshare.core.worker"),
        )
        self._arena_dir_arg = arena_dir
        self._log_dir_arg = log_dir
        self._kv_dir_arg = kv_dir
        self._req_ids = itertools.count(1)

    # ---- starting and stopping -----------------------------------------------------------

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
            self._start_threads()
        self._post(self._start_all)

    def _resolve_arena_dir(self) -> Path:
        if self._arena_dir_arg is not None:
            return Path(self._arena_dir_arg).expanduser()
        return resolve_arena_dir(self._config.arena.dir)  # $TIMESHARE_VRAM_ARENA, config, default

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
        end_processes(self._call(self._begin_shutdown, closing_ok=True), timeout)
        for reader in list(self._readers):
            reader.join(timeout=5.0)
        self._join_threads()

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
        sampling: Sampling = INTERNAL_SAMPLING,
        conversation: str | None = None,
        cache_prompt: bool | None = None,
        tools: Sequence[protocol.ToolSpec] = (),
    ) -> Generation:
        """Queue a request for ``model_id`` (FIFO, one at a time per worker) and return its handle.

        Give ``prompt`` (completion) or ``messages`` (chat: ChatMessage or {"role", "content"});
        ``sampling`` is carried to the worker unchanged (default: greedy, 256 tokens at most).
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
        )
        gen = Generation(model_id, request, functools.partial(self._post, self._cancel))
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

    def sleep(self, model_id: str, level: ReleaseLevel = "weights") -> None:
        self._call(self._sleep, model_id, parse_release_level(level))

    def wake(self, model_id: str) -> None:
        self._call(self._wake, model_id)

    def stop_model(self, model_id: str) -> None:
        self._call(self._stop_model, model_id)

    def start_model(self, model_id: str) -> None:
        self._call(self._start_model, model_id)

    def apply_config(self, config: Config) -> None:
        """Adopt a new configuration: start added models, stop removed ones, restart models whose
        load-time settings changed; pin and idle settings apply without a restart."""
        check_config(config)
        self._call(self._apply_config, config)
