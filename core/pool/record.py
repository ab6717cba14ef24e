"""One worker as the pool thread sees it: its lifecycle, its process, its request queue, and the
:class:`~timeshare.core.state.ModelStatus` it shows. Pool thread only."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..config.schema import ModelConfig
from ..errors import ProtocolError, TimeshareError
from ..state import ModelStatus, SwitchStats
from ..wire import protocol
from .generation import Generation
from .lifecycle import Lifecycle, Phase

log = logging.getLogger(__name__)

#: spawns that meet a passing shortage (too many open files, no memory) before the model FAILS
SPAWN_RETRIES = 5
SPAWN_RETRY_MAX_S = 8.0


@dataclass(frozen=True)
class WorkerPolicy:
    """How the pool treats every worker's crashes, failed spawns and stops (``Pool``'s arguments)."""

    restart_backoff_s: float = 0.5  # the first restart's delay; it doubles per crash in the window
    max_restarts: int = 3  # crashes within restart_window_s before the model FAILS
    restart_window_s: float = 60.0
    stop_grace_s: float = 5.0  # Shutdown, then SIGTERM after this, SIGKILL after twice this

    def escalation(self) -> tuple[tuple[float, signal.Signals], ...]:
        """When a stop that is not done yet escalates, and to what."""
        return ((self.stop_grace_s, signal.SIGTERM), (self.stop_grace_s * 2, signal.SIGKILL))


@dataclass
class WorkerRecord:
    config: ModelConfig
    log_path: Path
    pinned: bool
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    reason: str = ""
    failure_code: str = ""  # the error code of the failure while FAILED ("model_file", ...)
    spawn_failures: int = 0  # spawns in a row that met a passing shortage (EMFILE, ENOMEM)
    disk_retries: int = 0  # starts tried on its own since it failed for a full disk
    epoch: int = 0  # incremented per spawn; messages and timers of an older process are ignored
    proc: subprocess.Popen[bytes] | None = None
    conn: protocol.Connection | None = None
    pid: int | None = None
    info: protocol.ModelInfo | None = None  # from Ready (None until this spawn is ready)
    status: protocol.WorkerStatus | None = None
    queue: deque[Generation] = field(default_factory=deque)
    # sent, no Done yet, by req: up to ``capacity`` at once (the worker decodes them together)
    inflight: dict[str, Generation] = field(default_factory=dict)
    restarts: int = 0
    crash_times: deque[float] = field(default_factory=deque)  # the crashes the restart budget counts
    answered: int = 0  # requests its workers answered (stop or length): the model itself works
    fatal: protocol.Error | None = None
    pending: list[object] = field(default_factory=list)  # commands to send once ready
    last_switch: SwitchStats | None = None
    log_tail: tuple[str, ...] = ()
    idle_token: int = 0
    killed_why: str = ""  # set when the hung-holder watchdog killed it; the exit handler says it
    gpu_since: float = 0.0  # monotonic: when its status first said it holds the GPU (a lease)
    file_check: object | None = None  # the token of the model-file check under way (pool/filecheck.py)

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def alive(self) -> bool:
        """It has a process (spawned, its exit not handled yet)."""
        return self.proc is not None

    @property
    def removed(self) -> bool:
        return self.phase in (Phase.REMOVING, Phase.REMOVED)

    @property
    def accepting(self) -> bool:
        """Requests may be sent (after Hello; the worker queues them while loading)."""
        return self.phase in (Phase.LOADING, Phase.READY)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def send(self, msg: object) -> bool:
        if self.conn is None:
            return False
        try:
            self.conn.send(msg)
            return True
        except (OSError, TimeshareError) as exc:
            log.warning("%s: could not send %s: %s", self.id, type(msg).__name__, exc)
            return False

    # ---- policy: crashes, spawn retries, idle release ------------------------------------

    def crash_backoff(self, policy: WorkerPolicy, now: float) -> float | None:
        """A crash at ``now``: the delay before the restart, or None when the restart budget is
        spent (``max_restarts`` crashes within ``restart_window_s``: the model FAILS)."""
        while self.crash_times and now - self.crash_times[0] > policy.restart_window_s:
            self.crash_times.popleft()
        if len(self.crash_times) >= policy.max_restarts:
            return None
        self.crash_times.append(now)
        self.restarts += 1
        return float(policy.restart_backoff_s * (2 ** (len(self.crash_times) - 1)))

    def charge_crash(self, now: float) -> tuple[list[Generation], bool]:
        """A crash at ``now`` of a ready worker, attributed (issue 38). Every request in flight
        records it. A request in flight at its second crash (sent again after the first, nothing
        streamed either time) is *charged* with its crashes: two fresh workers died while it
        alone was the common factor. When the model has answered some request since it was
        started (the model itself works), a charged request's crashes leave the restart budget:
        the earlier ones are taken out of ``crash_times`` and the caller does not count this one.
        A model that never answered keeps counting them (a model that crashes on everything
        still FAILS). Returns (the charged requests, still in flight; whether they are forgiven)."""
        charged = [g for g in self.inflight.values() if g.dispatch.resent and not g.text]
        for gen in self.inflight.values():
            gen.dispatch.crashes.append(now)
        forgiven = bool(charged) and self.answered > 0
        if forgiven:
            for gen in charged:
                for at in gen.dispatch.crashes:
                    if at in self.crash_times:
                        self.crash_times.remove(at)
        return charged, forgiven

    def spawn_retry_delay(self, policy: WorkerPolicy) -> float | None:
        """A spawn met a passing shortage: the delay before the next attempt, or None once it has
        lasted SPAWN_RETRIES attempts (the model FAILS; the count starts again)."""
        self.spawn_failures += 1
        if self.spawn_failures > SPAWN_RETRIES:
            self.spawn_failures = 0
            return None
        return float(min(SPAWN_RETRY_MAX_S, policy.restart_backoff_s * (2 ** (self.spawn_failures - 1))))

    def arm_idle(self) -> float | None:
        """Disarm the idle timer; the delay of a new one when it applies now (ready, idle, a
        configured ``idle_sleep_s``)."""
        self.idle_token += 1
        delay = self.config.idle_sleep_s
        if delay is None or not self.ready or not self.idle:
            return None
        return delay

    def idle_due(self, token: int) -> bool:
        """Whether the idle timer armed with ``token`` still applies (not re-armed since, still
        ready, idle and not pinned)."""
        return self.idle_token == token and self.ready and self.idle and not self.pinned

    # ---- the request queue ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """How many requests may be in flight: the worker's ``parallel`` once it is ready (one
        before: a crash during the load sends them again)."""
        return max(1, self.info.parallel) if self.info is not None else 1

    def send_queued(self) -> None:
        """Send queued requests while fewer than ``capacity`` are in flight (cancelled ones are
        finished on the way)."""
        while len(self.inflight) < self.capacity and self.queue:
            gen = self.queue.popleft()
            if gen.cancelled:
                gen.finish_cancelled()
                continue
            gen.dispatch.sent_at = time.monotonic()
            if self.conn is None:
                self.queue.appendleft(gen)
                return
            try:
                self.conn.send(gen.request)
            except ProtocolError as exc:
                # this request cannot be framed (a string that is not Unicode, a frame too big):
                # it alone fails, the next one goes
                log.warning("%s: request %s cannot be sent: %s", self.id, gen.req, exc)
                gen.fail(ProtocolError(f"the request cannot be sent to {self.id}: {exc}"))
                continue
            except (OSError, TimeshareError) as exc:
                log.warning("%s: could not send request %s: %s", self.id, gen.req, exc)
                self.queue.appendleft(gen)  # the worker is gone: the exit handler deals with it
                return
            self.inflight[gen.req] = gen
            self.idle_token += 1  # busy: disarm the idle timer

    def requeue_inflight(self, only_unanswered: bool = False) -> list[Generation]:
        """Requests in flight go back to the head of the queue, in the order they were sent:
        all of them (they waited for the load, nothing was answered), or ``only_unanswered``:
        those that have streamed nothing yet and were not sent again once already. Returns them."""
        back = [
            g for g in self.inflight.values() if not only_unanswered or (not g.text and not g.dispatch.resent)
        ]
        for gen in reversed(back):
            del self.inflight[gen.req]
            if only_unanswered:
                gen.dispatch.resent = True
                gen.drop_partial()  # an echo's prompt entries, an Embed's vectors: they come again
            self.queue.appendleft(gen)
        return back

    def fail_inflight(self, error: TimeshareError) -> None:
        inflight, self.inflight = self.inflight, {}
        for gen in inflight.values():
            gen.fail(error)

    def fail_queued(self, error: TimeshareError) -> None:
        while self.queue:
            self.queue.popleft().fail(error)

    def fail_all(self, error: TimeshareError) -> None:
        self.fail_inflight(error)
        self.fail_queued(error)

    @property
    def idle(self) -> bool:
        return not self.inflight and not self.queue

    # ---- what a snapshot shows -----------------------------------------------------------

    def model_status(self) -> tuple[ModelStatus, bool]:
        """This worker's ModelStatus, and whether it is switching (sent a request, no token yet)."""
        st = self.status
        info = self.info
        # the worker's reports count once it is ready, until it exits
        alive_status = st if (st is not None and info is not None and self.alive) else None
        busy = bool(self.inflight)  # the pool's own knowledge: it sent a request, no Done yet
        switching = alive_status is not None and busy and not alive_status.holds_token
        reason = self.reason
        waits = st is not None and self.alive and st.waiting_reason and (busy or info is None)
        if not reason and st is not None and waits:  # waiting to load, or to answer
            reason = st.waiting_reason
            if not reason.startswith("waiting"):
                reason = f"waiting for the GPU: {reason}"
        status = ModelStatus(
            id=self.id,
            name=self.config.display_name,
            path=self.config.path,
            state=self.lifecycle.model_state,
            busy=busy,
            pinned=self.pinned,
            queued=len(self.queue),
            active=alive_status.active if alive_status else 0,
            parallel=info.parallel if info else 0,
            reason=reason,
            failure_code=self.failure_code if self.phase is Phase.FAILED else "",
            residency_path=info.residency_path if info else "",
            residency_reason=info.residency_reason if info else "",
            deep_note=info.deep_note if info else "",
            backend=info.backend if info else "",
            chat_format=info.chat_format if info else "",
            chat_family=info.chat_family if info else "",
            thinks=info.thinks if info else False,
            starts_thinking=info.starts_thinking if info else False,
            pooling=info.pooling if info else "",
            licence=self.config.licence,
            vision=bool(self.config.mmproj),
            projector_bytes=info.projector_bytes if info else 0,
            weight_bytes=info.weight_bytes if info else 0,
            host_pinned_bytes=self._host_bytes(alive_status),
            device_bytes=alive_status.device_bytes if alive_status else 0,
            kv_bytes=alive_status.kv_bytes if alive_status else 0,
            buffer_bytes=alive_status.buffer_bytes if alive_status else 0,
            context_bytes=alive_status.context_bytes if alive_status else 0,
            kv_cache_type=info.kv_cache_type if info else "",
            fit=info.fit if info else "",
            n_ctx=info.n_ctx if info else self.config.n_ctx,
            pid=self.pid if self.alive else None,
            restarts=self.restarts,
            last_switch=self.last_switch,
            log_tail=self.log_tail,
            device=info.device if info else self.config.device,
            holds_gpu=alive_status is not None and alive_status.holds_token,
            lease_bytes=alive_status.lease_bytes if alive_status and alive_status.holds_token else 0,
            resident_fraction=alive_status.resident_fraction if alive_status and self.alive else 0.0,
            handover_creates=alive_status.handover_creates if alive_status else 0,
            handover_mapped_chunks=alive_status.handover_mapped_chunks if alive_status else 0,
            handover_kept_bytes=alive_status.handover_kept_bytes if alive_status else 0,
            handover_skipped_bytes=alive_status.handover_skipped_bytes if alive_status else 0,
        )
        return status, switching

    def _host_bytes(self, status: protocol.WorkerStatus | None) -> int:
        if not self.alive:
            return 0
        if status is not None:
            return status.host_pinned_bytes
        return self.info.host_pinned_bytes if self.info else 0
