"""One worker's lifecycle as the pool sees it: its states, the transitions allowed between them, and
what a snapshot shows for each (:class:`~timeshare.core.state.ModelState`).

The states follow what the pool does with a worker process (llama-swap's process states were the
model)::

    NEW ─spawn─► STARTING ─Hello─► LOADING ─Ready─► READY
    STARTING, LOADING, READY ─exit, a crash─► BACKOFF ─delay─► STARTING
                             ─exit, a load failure or the restart budget spent─► FAILED
                             ─Shutdown on purpose─► STOPPING ─exit─► STOPPED
                                                    RESTARTING ─exit─► STOPPED ─spawn─► STARTING
                                                    REMOVING ─exit─► REMOVED (forgotten)
    STOPPED, FAILED, BACKOFF ─spawn─► STARTING (a request, a wake, start_model, a new configuration)
    NEW, STOPPED, FAILED, BACKOFF ─spawn fails for a passing shortage (EMFILE, ENOMEM)─► RETRYING
                             ─delay─► STARTING (or RETRYING again; FAILED once the retries are spent)
    FAILED ─stop─► STOPPED (the user stopped it: no reason shown; a request or start spawns it)

Whether the worker's weights are resident, released or asleep is not a lifecycle state: it is the
worker's own report (its ``WorkerStatus``), shown as the :class:`ModelState` of a READY worker.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from ..state import ModelState


class Phase(str, enum.Enum):
    NEW = "new"  # configured, no process yet
    STARTING = "starting"  # process spawned, no Hello yet
    LOADING = "loading"  # said Hello: requests may be sent (the worker queues them), not Ready yet
    READY = "ready"  # serving; resident/released/sleeping is the worker's own report
    STOPPING = "stopping"  # Shutdown sent on purpose: the exit is not a crash; STOPPED after it
    RESTARTING = "restarting"  # as STOPPING, then spawned again (load-time settings changed, or wanted)
    REMOVING = "removing"  # as STOPPING, then forgotten (removed from the configuration)
    BACKOFF = "backoff"  # crashed; spawned again when the restart delay is over
    # could not be spawned for a passing shortage (too many open files, out of memory): spawned
    # again after a delay, FAILED when the shortage lasts
    RETRYING = "retrying"
    STOPPED = "stopped"  # no process, on purpose (stopped, or idle release "stop")
    FAILED = "failed"  # could not load, or crashed past its restart budget; see the reason
    REMOVED = "removed"  # forgotten; the pool holds no record of it any more


class TransitionError(RuntimeError):
    """A transition the table does not allow: a bug in the pool, not a user's mistake."""


_STOPS = (Phase.STOPPING, Phase.RESTARTING, Phase.REMOVING)

#: every allowed transition; anything else raises TransitionError
TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.STARTING, Phase.RETRYING, Phase.FAILED, Phase.STOPPED, Phase.REMOVED}),
    Phase.STARTING: frozenset({Phase.LOADING, Phase.READY, *_STOPS, Phase.BACKOFF, Phase.FAILED}),
    Phase.LOADING: frozenset({Phase.READY, *_STOPS, Phase.BACKOFF, Phase.FAILED}),
    Phase.READY: frozenset({*_STOPS, Phase.BACKOFF, Phase.FAILED}),
    Phase.STOPPING: frozenset({Phase.STOPPED, Phase.RESTARTING, Phase.REMOVING}),
    # STOPPING: the pool shuts down, so nothing is spawned again
    Phase.RESTARTING: frozenset({Phase.STOPPED, Phase.STOPPING, Phase.REMOVING}),
    # RESTARTING: added back to the configuration before its worker exited
    Phase.REMOVING: frozenset({Phase.REMOVED, Phase.RESTARTING}),
    Phase.BACKOFF: frozenset({Phase.STARTING, Phase.RETRYING, Phase.STOPPED, Phase.FAILED, Phase.REMOVED}),
    Phase.RETRYING: frozenset({Phase.STARTING, Phase.RETRYING, Phase.STOPPED, Phase.FAILED, Phase.REMOVED}),
    Phase.STOPPED: frozenset({Phase.STARTING, Phase.RETRYING, Phase.FAILED, Phase.REMOVED}),
    Phase.FAILED: frozenset({Phase.STARTING, Phase.RETRYING, Phase.FAILED, Phase.STOPPED, Phase.REMOVED}),
    Phase.REMOVED: frozenset(),
}

#: what a snapshot shows on entering each phase; None: what it showed before (a worker being
#: stopped keeps its last state until it has exited). READY starts RELEASED, then follows the
#: worker's reports (:meth:`Lifecycle.report`).
MODEL_STATE: Mapping[Phase, ModelState | None] = {
    Phase.NEW: ModelState.STARTING,
    Phase.STARTING: ModelState.STARTING,
    Phase.LOADING: ModelState.LOADING,
    Phase.READY: ModelState.RELEASED,
    Phase.STOPPING: None,
    Phase.RESTARTING: None,
    Phase.REMOVING: None,
    Phase.BACKOFF: ModelState.STARTING,  # with the reason "restarting in N s after a crash"
    Phase.RETRYING: ModelState.STARTING,  # with the reason "could not start: too many open files ..."
    Phase.STOPPED: ModelState.STOPPED,
    Phase.FAILED: ModelState.FAILED,
    Phase.REMOVED: ModelState.STOPPED,  # never published: the model is gone from snapshots
}

#: a READY worker's own report (``WorkerStatus.state``) as a ModelState
REPORTED: Mapping[str, ModelState] = {
    "resident": ModelState.RESIDENT,
    "released": ModelState.RELEASED,
    "sleeping": ModelState.SLEEPING,
    "loading": ModelState.LOADING,
}


class Lifecycle:
    """The phase of one worker, changed only through :meth:`transition`.

    ``after_crash``: the current spawn follows a crash (set on entering BACKOFF, kept through
    STARTING and LOADING, cleared on READY, STOPPED, FAILED and REMOVED); the pool announces
    RESTARTED when such a spawn becomes READY."""

    __slots__ = ("_after_crash", "_phase", "_shown")

    def __init__(self, phase: Phase = Phase.NEW) -> None:
        self._phase = phase
        self._shown = MODEL_STATE[phase] or ModelState.STARTING
        self._after_crash = phase is Phase.BACKOFF

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def after_crash(self) -> bool:
        return self._after_crash

    @property
    def model_state(self) -> ModelState:
        """What a snapshot shows for this worker."""
        return self._shown

    @property
    def stopping(self) -> bool:
        """A Shutdown was sent on purpose: the exit that follows is not a crash."""
        return self._phase in _STOPS

    def transition(self, new: Phase) -> Phase:
        """Enter ``new``; returns the phase left. Raises TransitionError when the table forbids it."""
        old = self._phase
        if new not in TRANSITIONS[old]:
            raise TransitionError(f"a worker cannot go from {old.value} to {new.value}")
        self._phase = new
        shown = MODEL_STATE[new]
        if shown is not None:
            self._shown = shown
        if new is Phase.BACKOFF:
            self._after_crash = True
        elif new in (Phase.READY, Phase.STOPPED, Phase.FAILED, Phase.REMOVED):
            self._after_crash = False
        return old

    def report(self, worker_state: str) -> None:
        """The worker's own state (``WorkerStatus.state``); shown while READY, ignored otherwise."""
        if self._phase is Phase.READY:
            self._shown = REPORTED[worker_state]

    def __repr__(self) -> str:
        return f"Lifecycle({self._phase.value}, shows {self._shown.value})"
