"""Residence: the GPU token and the weights; the policy that decides when they are on the device."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..arena.client import TokenClient, TokenRequest
from ..arena.tickets import Arena
from ..errors import OutOfDeviceMemoryError
from ..observe import NULL_OBSERVER, EventLog, Observer
from ..residency import Residency, ResidencyOptions
from ..state import WorkerReleaseLevel
from . import protocol as p
from .engine import Engine
from .spec import WorkerSpec

log = logging.getLogger(__name__)


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
    memory. The observer (core/observe.py) gets a "resident" interval for each stretch of
    resident weights; the TokenClient writes the "token" intervals."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.arena = Arena(spec.arena_dir)
        self.observer: Observer = EventLog(spec.event_log, spec.model.id) if spec.event_log else NULL_OBSERVER
        self.client = TokenClient(self.arena, spec.model.id, observer=self.observer, pinned=spec.model.pinned)
        self.residency: Residency | None = None
        self._request: TokenRequest | None = None
        self._resident_since: float | None = None
        self._restore_wait = ""  # set while a restore waits for device memory

    @property
    def use_mmap(self) -> bool:
        return Residency.probe().use_mmap_for_inplace

    @property
    def frees_context(self) -> bool:
        return self.residency is not None and self.residency.path == "rebuild"

    def attach(self, engine: Engine) -> None:
        """Attach the residency mechanism to the loaded model (under the token)."""
        res = Residency.attach(
            engine.llm, engine.model.path, ResidencyOptions(mode="auto", host_shadow=engine.model.host_shadow)
        )
        self.residency = res
        self.path = res.path
        self.reason = res.reason
        self.backend = res.backend
        self.weight_bytes = res.weight_bytes
        self.host_bytes = res.host_bytes

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
        return self.residency.weights_resident

    @property
    def kv_resident(self) -> bool:
        return self.residency is None or self.residency.kv_resident

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

    def _restore(self, res: Residency, poll: Callable[[], None]) -> float:
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
                    return res.restore().ms
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
        level: WorkerReleaseLevel = "weights+kv" if kv else "weights"
        if report is None:
            return p.Released(level=level, release_ms=0.0, freed_bytes=0)
        return p.Released(level=level, release_ms=report.ms, freed_bytes=report.freed_bytes)

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
        try:
            self.observer.record("resident", self._resident_since, end)
        except OSError as exc:
            log.warning("could not record the resident interval: %s", exc)
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


def make_residence(spec: WorkerSpec) -> Residence:
    """The arena residence when an arena directory is given, else the arena-less one."""
    if spec.arena_dir is None:
        return Residence()
    return ArenaResidence(spec)
