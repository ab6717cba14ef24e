"""Tenancy: the GPU token and the weights; the policy that decides when they are on the device."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import envvars
from ..arena.arena import Arena
from ..arena.budget import GPU_CONTEXT_ALLOWANCE, BudgetRecord, LeaseRecord, compute_budget, time_share_room
from ..arena.client import TokenClient
from ..arena.dirs import device_arena_dir
from ..arena.handclient import HandoverClient, holder_env_ok
from ..arena.handover import RECLAIM_WAIT_S, HandoverError, read_state
from ..arena.records import DoorbellRing
from ..arena.request import TokenRequest
from ..errors import ArenaError, OutOfDeviceMemoryError, VramBudgetError
from ..observe import NULL_OBSERVER, EventLog, Observer
from ..residency import Residency, ResidencyOptions
from ..residency.measure import rss_bytes
from ..residency.overlap import overlap_expected
from ..residency.probe import probe
from ..residency.reports import ReleaseReport, RestoreReport
from ..residency.residency import mode_wanted
from ..residency.state import Weights
from ..state import WorkerReleaseLevel
from ..util.units import decimal_bytes
from ..wire import protocol as p
from ..wire.spec import WorkerSpec
from .device import DeviceMemory, budget_setting, device_memory
from .engine import Engine

log = logging.getLogger(__name__)


# ---- tenancy: the GPU token and the weights ------------------------------------------------


#: the environment variable that sets a deferred host shadow's slice size, in MiB (tests use
#: small slices so a small model's shadow is several)
SHADOW_SLICE_ENV = envvars.SHADOW_SLICE_MIB.name


def shadow_slice_bytes() -> int:
    """A deferred host shadow's slice size: ``TIMESHARE_SHADOW_SLICE_MIB`` (MiB; fractions
    allowed), else the residency's default (256 MiB)."""
    raw = envvars.SHADOW_SLICE_MIB.text()
    if raw:
        try:
            mib = float(raw)
        except ValueError:
            mib = 0.0
        if mib > 0:
            return max(1, int(mib * (1 << 20)))
        log.warning("%s=%r is not a positive number of MiB: using the default", SHADOW_SLICE_ENV, raw)
    return ResidencyOptions.shadow_slice_bytes


def shadow_slice_pause_s() -> float:
    """For tests: the pause between two slices of a deferred host shadow's idle build
    (``TIMESHARE_SHADOW_SLICE_PAUSE_MS``; 0, the default: none), so that a test can stop the worker
    inside the build on a loaded machine, where the build may otherwise end first."""
    ms = envvars.SHADOW_SLICE_PAUSE_MS.number()
    if ms is not None and 0.0 <= ms <= 60_000.0:
        return ms / 1000.0
    log.warning(
        "%s=%r is not a number of milliseconds (0 to 60000): no pause",
        envvars.SHADOW_SLICE_PAUSE_MS.name,
        envvars.SHADOW_SLICE_PAUSE_MS.text(),
    )
    return 0.0


def handover_wanted(setting: bool, backend: str) -> bool:
    """Whether a worker on ``backend`` (the build's first GPU, "CPU" without one) uses the
    hand-over: ``$TIMESHARE_HANDOVER`` (0/1) decides when set, on any build (1 on a CPU build: the
    memfd stand-in plays the device, as the tests use it); else ``arena.handover`` (default on)
    where the device can hand memory over: CUDA (VMM). Not on Vulkan (the probe exists, ggml-vulkan's
    buffers are not made of handed chunks yet) nor on the CPU build (host memory: nothing to gain)."""
    override = envvars.HANDOVER.switch()
    if override is not None:
        return override
    return setting and backend.startswith("CUDA")


@dataclass(frozen=True)
class Acquired:
    switched: bool
    wait_ms: float = 0.0
    restore_ms: float = 0.0
    restored_bytes: int = 0  # weight bytes the restore moved (only what a partial release lost)
    # how long the previous holder's release took, as its worker measured it: carried by the
    # arena with the token (TokenGrant.previous_release_ms); 0.0 when none
    release_ms: float = 0.0


class Tenancy:
    """The token and the weights, driven by the loop thread only.

    This base class is the arena-less tenancy: one worker alone, weights always on the device.
    ``ArenaTenancy`` (when an arena directory is given) adds the flock token and the
    release/restore of the weights.
    """

    #: what the Ready message reports (ArenaTenancy takes them from the attached residency)
    path = "none"
    reason = "no arena: the weights stay loaded"
    backend = "CPU"
    weight_bytes = 0
    host_bytes = 0

    @property
    def device_bytes(self) -> int:
        """Bytes of weights on the device now (0 without an arena: nothing to report)."""
        return 0

    @property
    def resident_fraction(self) -> float:
        """The share of the weights on the device now (1.0 without an arena: always loaded)."""
        return 1.0

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

    def start(self, enqueue_yield: Callable[[DoorbellRing], None]) -> None:
        """Begin watching the doorbell (warden thread): each ring goes to ``enqueue_yield``."""

    def attach(self, engine: Engine, *, defer_shadow: bool = False) -> None:
        """Attach the release/restore mechanism to a freshly loaded model; ``defer_shadow``: the
        host copy the weights come back from is made later (:meth:`fill_shadow`)."""

    @property
    def shadow_pending(self) -> bool:
        """A deferred host shadow is still to be made, and can be now (:meth:`fill_shadow`): the
        weights are resident, or were released after the slices left were checked against the
        file."""
        return False

    def fill_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        """Make a deferred host shadow now, slice by slice: ``stop``,
        asked after each slice, True leaves the rest for later (returns False). True when no
        shadow is pending. Raises ModelFileError when the file no longer holds the loaded
        weights."""
        return True

    @property
    def shadow_to_pin(self) -> int:
        """Allocations of the host shadow a release left pageable, to pin when idle."""
        return 0

    def pin_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        """Pin them, one at a time (``stop`` asked after each); True when none is left."""
        return True

    def grow_kv_ahead(self) -> int:
        """Idle after an answer: grow the host memory a release saves the KV cells into to what
        they take now, where a release of this worker may save them, so that it allocates nothing
        on the switch's path; returns the bytes allocated (0: nothing to do, or not worth it)."""
        return 0

    @property
    def attach_steps(self) -> dict[str, float]:
        """Milliseconds of the attach's steps (the worker logs them)."""
        return {}

    def set_pinned(self, pinned: bool) -> None:
        """A pinned holder keeps the token; waiters are told so."""

    def note_use(self, busy: bool) -> None:
        """The worker starts (``busy``) or ends using its weights (recorded for the budget's
        least-recently-used choice, with the quantum it keeps them for)."""

    #: the device and its budget, for the Ready and status messages
    device_index = 0
    device_name = ""
    budget: BudgetRecord | None = None
    budget_note = ""

    @property
    def lease_bytes(self) -> int:
        """Weight bytes leased on the device's budget now."""
        return 0

    @property
    def budget_bytes(self) -> int:
        """The device's weights budget now (0: one model at a time, or no arena)."""
        return 0

    def handover_figures(self) -> dict[str, int]:
        """The hand-over's figures for the worker's status (none without an arena)."""
        return {}

    def acquire(self, poll: Callable[[], None], timeout_s: float | None) -> float:
        """Take the token only (no restore); returns the wait in ms."""
        return 0.0

    def shared_room(self) -> int | None:
        """The budget this model time-shares, for its fit (core/config/fit.py, rule 1): an auto
        budget less what the other models keep at their deepest level; None: no such budget
        (the model is fitted to the free memory at its load)."""
        return None

    def make_room(self, need: int, poll: Callable[[], None], timeout_s: float | None) -> None:
        """Before a load: have the parked models go as deep as ``need`` bytes of the budget ask
        (the fitted model's weights, compute allowance and KV cache). Nothing without an arena."""

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

    def release(self, kv: bool, final: bool = False, free_context: bool = False) -> p.Released | None:
        """Release the weights (and the KV cache when ``kv``; ``free_context``: the context and
        its compute buffers too, a sleep) and give the token back. ``final``: the worker is ending
        and will not restore them (a deferred host shadow is not checked against the file first)."""
        return None

    @property
    def context_kept(self) -> bool:
        """The KV cache is released in place: the context stays."""
        return False

    @property
    def sleeps_in_place(self) -> bool:
        """A sleep (``weights+kv``) can keep the context: the deep level is wholly in place here
        (the KV buffer and the compute buffers are released in place: the rule of a deep release
        on contention, with the compute buffers' too, so that a sleep frees as much as freeing
        the context did)."""
        return False

    def parked_states(self) -> dict[int, tuple[bytes, int]]:
        """While the KV cache is released: each of its sequences' saved state and lowest position
        (Residency.parked_states), for a worker that ends before it comes back."""
        return {}

    @property
    def deep_note(self) -> str:
        """How a deep release goes for this model ("": in place; Residency.deep_note)."""
        return ""

    @property
    def buffers_kept(self) -> bool:
        """The KV cache is released in place and the compute buffers stay on the device (they
        could not be released in place)."""
        return False

    def settle(self) -> None:
        """After a decode: the uploads of an overlapped restore are complete and its gate is out
        of the context, and a projector's restore that waited for the decode has started (a
        no-op, and cheap, otherwise: called after every decode step)."""

    def asked(self, ring: DoorbellRing | None = None) -> DoorbellRing | None:
        """What the head of the queue asks of this worker now: the doorbell's ``ring`` while it is
        fresh (no scan of the arena), else one scan. None when nothing is asked of it: pinned, or
        its weights not asked for while it holds a lease, or its KV cache not asked for while it
        holds none."""
        return None

    def give_way(self, ring: DoorbellRing | None = None) -> p.Released | None:
        """Make the room the head of the queue asks this worker for (``ring``: what
        :meth:`asked` said; None: ask now): the whole lease, or (a partial lease) only the layer
        parts it needs; and, asked to go deep, the KV cache and compute buffers too. None when
        nobody asks any more."""
        return None

    @property
    def over_budget(self) -> bool:
        """The device's weights leases exceed its budget now: after a load under an auto budget,
        whose reserve is measured only once the weights are in (the load leased the device to
        itself). The holder gives its lease back and asks through the queue, whose plan then asks
        the parked workers to go deep first."""
        return False

    #: the KV cache and the compute buffers the context holds on the device (from the GGUF's
    #: shape and ggml's scheduler, worker/footprint.py; 0: not known): what a deep release frees
    #: (both, in place or with the context; the KV cache alone where the compute buffers cannot be
    #: released in place: Residency.buffers_note)
    kv_footprint: tuple[int, int] = (0, 0)

    #: called before the KV cache leaves the device with its context (the loop moves its idle
    #: conversations to host snapshots, as before a sleep; not where the KV level keeps the
    #: context: Residency.kv_in_place); returns the bytes of KV it moved
    on_deep: Callable[[], int] | None = None

    def waiting_reason(self) -> str:
        return ""

    def close(self) -> None:
        pass


class ArenaTenancy(Tenancy):
    """The GPU token (core/arena.py) plus the release/restore of the weights (core/residency).

    Invariant: the weights are on the device iff this worker holds a lease on the device's VRAM
    budget (the "token"; under a one-model budget exactly the old single token), and the leased
    bytes of a device never exceed its budget. Restore happens only after the lease is granted;
    the lease is given back only after the release has freed the memory. The observer
    (core/observe.py) gets a "resident" interval for each stretch of resident weights; the
    TokenClient writes the "token" intervals (with the leased bytes and the budget).

    The budget: the worker measures its device (``models[].device``), computes the budget its
    setting asks for (its spec's ``arena.vram_budget``, which the pool resolved: core/config/
    vram_budget.py puts ``$TIMESHARE_VRAM_BUDGET`` in place of "auto") and joins the device's
    arena, whose first member's budget is the one in force. The load runs
    under a lease of the whole budget (one-model, auto: the device to itself, which lets an auto
    budget measure what the worker keeps on the device while released) or of the file's size
    (capped by the budget); once the weights are known the lease shrinks to their bytes, and a
    model whose weights exceed the whole budget fails (VramBudgetError)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device: DeviceMemory = device_memory(spec.model.device)
        self.device_index = self.device.index
        self.device_name = self.device.name
        setting = budget_setting(spec.arena.vram_budget)
        base = Path(spec.arena_dir) if spec.arena_dir is not None else None
        self.arena = Arena(device_arena_dir(base, self.device.index) if base is not None else None)
        # device memory the arena's hand-over holder keeps for the next restore is Timeshare's:
        # free for an auto budget measured now (else it would count as another program's)
        holder = read_state(self.arena.dir.fd)
        kept = holder.on_hand_bytes if holder is not None else 0
        wanted = compute_budget(
            setting,
            total=self.device.total,
            free=min(self.device.total, self.device.free + kept),
            device=self.device.index,
            device_name=self.device.name,
            pid=os.getpid(),
            at=time.time(),
        )
        self.observer: Observer = EventLog(spec.event_log, spec.model.id) if spec.event_log else NULL_OBSERVER
        try:
            self.client = TokenClient(
                self.arena, spec.model.id, observer=self.observer, pinned=spec.model.pinned, budget=wanted
            )
        except BaseException:
            self.arena.close()
            raise
        self.budget = self.client.budget
        self.budget_note = self.client.budget_note
        self.residency: Residency | None = None
        self._request: TokenRequest | None = None
        self._resident_since: float | None = None
        self._restore_wait = ""  # set while a restore waits for device memory
        # what the grants of the last acquire() said the previous holders' releases took
        self._previous_release_ms = 0.0
        self._free_before_load: int | None = None  # auto budgets: the device's free bytes before the load
        self._budget_bytes = 0
        self._budget_read_at = 0.0
        self._closed = False
        self._pinned = spec.model.pinned
        # set by the doorbell (warden thread), with its last ring (one reference, replaced whole):
        # a partly released holder waiting to grow back looks at them while it waits, so that it
        # makes room for the head of the queue meanwhile
        self._rung = threading.Event()
        self._last_ring: DoorbellRing | None = None
        # the deep level (issue 39; auto budgets): the reserve measured at the load (KV cache,
        # compute buffers, context), the bytes of it the KV level frees, and what the worker keeps
        # once it went deep (measured at its first deep release; the driver context's allowance
        # on a GPU, nothing on the CPU build, until then)
        self._reserve_full = 0
        self._deepens = 0
        self._deep_keeps = 0
        #: the arena's hand-over holder (issue 40): where handed-over device memory comes from
        self.handover: HandoverClient | None = None

    def _weights_budget(self) -> int:
        if self._closed:  # the worker is ending: a last status reports what was read before
            return self._budget_bytes
        try:
            limit = self.client.weights_budget()
        except OSError as exc:
            log.warning("reading the arena's leases failed: %s", exc)
            return self._budget_bytes
        return 0 if limit is None else limit

    @property
    def lease_bytes(self) -> int:
        return self.client.lease_bytes

    @property
    def budget_bytes(self) -> int:
        """The weights budget, read again at most once a second (reserves come and go)."""
        now = time.monotonic()
        if now - self._budget_read_at >= 1.0:
            self._budget_read_at = now
            self._budget_bytes = self._weights_budget()
        return self._budget_bytes

    def _load_need(self) -> int | None:
        """What the load leases: the device to itself (one-model; auto, to measure the reserve),
        or the file's bytes capped by the budget (the weights are known only once loaded)."""
        budget = self.budget
        if budget is None or budget.one_model or budget.kind == "auto":
            return None
        try:
            size = os.path.getsize(self.spec.model.path)
        except OSError:
            return None
        limit = self._weights_budget()
        # the file holds the weights and more (metadata, vocabulary); a little more still, for
        # the devices' alignment padding: the lease then only ever shrinks once they are known
        return min(size + size // 100 + 2**20, limit)

    def note_use(self, busy: bool) -> None:
        quantum = max(0.0, float(self.spec.arena.min_quantum_ms)) / 1000.0
        self.client.note_use(busy, time.monotonic() + quantum if busy else 0.0)

    @property
    def use_mmap(self) -> bool:
        return Residency.probe().use_mmap_for_inplace

    @property
    def frees_context(self) -> bool:
        return self.residency is not None and self.residency.path == "rebuild"

    def _weight_parts(self) -> int:
        """The parts the released weights are held in: ``models[].weight_parts`` under a byte
        budget, 1 (whole buffers, as before parts existed) under a one-model budget, where a
        switch always moves the whole model."""
        budget = self.budget
        if budget is None or budget.one_model:
            return 1
        return max(1, int(self.spec.model.weight_parts))

    @property
    def partial(self) -> bool:
        """This worker can free part of its weights (layer parts on the in-place path, under a
        byte budget)."""
        res = self.residency
        return res is not None and res.path == "inplace" and self._weight_parts() > 1 and len(res.parts()) > 1

    def _overlap_parts(self) -> int:
        """Layer parts under a one-model budget: ``models[].weight_parts`` where restores overlap
        the first decode (a CUDA build, or ``TIMESHARE_OVERLAP_RESTORE=1``), split at the first
        release (every release stays whole); 1 elsewhere."""
        return max(1, int(self.spec.model.weight_parts)) if overlap_expected() else 1

    def _handover_client(self) -> HandoverClient | None:
        """The arena's hand-over holder, when it is wanted (:func:`handover_wanted`): connected
        now (starting it when none lives); a holder that cannot be reached is tried again at each
        restore, and meanwhile the worker's chunks are its own."""
        if not handover_wanted(self.spec.arena.handover, probe().backend) or not holder_env_ok():
            return None
        client = HandoverClient(self.arena.path, self.spec.model.id, idle_s=self.spec.arena.handover_idle_s)
        try:
            client.connect()
        except HandoverError as exc:
            log.warning("the arena's hand-over holder cannot be reached now: %s", exc)
        return client

    def attach(self, engine: Engine, *, defer_shadow: bool = False) -> None:
        """Attach the residency mechanism to the loaded model (under the token)."""
        one_model = self.budget is None or self.budget.one_model
        parts = self._overlap_parts() if one_model else self._weight_parts()
        options = ResidencyOptions(
            mode=mode_wanted("auto"),  # TIMESHARE_RESIDENCY_PATH may ask for a path
            host_shadow=engine.model.host_shadow,
            defer_shadow=defer_shadow,
            shadow_slice_bytes=shadow_slice_bytes(),
            parts=parts,
            split_at_release=one_model and parts > 1,
        )
        if self.handover is None:  # (made before the load when there was a holder to ask)
            self.handover = self._handover_client()
        if self.handover is not None:
            options = replace(options, handover=True)
        res = Residency.attach(engine.llm, engine.model.path, options, chunk_source=self.handover)
        # a context the KV level frees (its KV buffers not found) is made again after the weights:
        # its KV cache's bytes stay out of the hand-over's room then
        res.kv_hint_bytes = self.kv_footprint[0]
        if engine.vision is not None and res.attach_projector(engine.vision.watch, engine.vision.path):
            # its projector's weights go and come back with the model's (restored after them, off
            # the first token's path): an encode waits for them
            engine.vision.ready = res.projector_ready
        self.residency = res
        self.path = res.path
        self.reason = res.reason
        self.backend = res.backend
        # handed-over memory is mapped in whole chunks: the last chunk of each buffer's padding
        # is device memory too, so its lease counts it (a small card's budget holds)
        self.weight_bytes = res.weight_bytes + int(res.handover.get("lease_padding_bytes", 0) or 0)  # type: ignore[call-overload]
        self.host_bytes = res.host_held_bytes
        self._fit_budget(self.weight_bytes)
        self.client.set_partial(self.partial)

    @property
    def shadow_pending(self) -> bool:
        return self.residency is not None and self.residency.shadow_fillable

    def settle(self) -> None:
        res = self.residency
        if res is not None:
            res.settle(decoded=True)

    def fill_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        res = self.residency
        if res is None or not res.shadow_fillable:
            return True
        pause_s = shadow_slice_pause_s()
        if stop is not None and pause_s > 0.0:  # the idle build, under a test's pause
            stop = _paused(stop, pause_s)
        # released (the slices left come from the file): pageable first, so the shadow is whole
        # soon (a restore then waits for none of it), pinned afterwards while idle (pin_shadow)
        done = res.fill_shadow(stop, pin=res.weights_resident)
        self.host_bytes = res.host_held_bytes
        return done

    @property
    def shadow_to_pin(self) -> int:
        return self.residency.shadow_to_pin if self.residency is not None else 0

    def pin_shadow(self, stop: Callable[[], bool] | None = None) -> bool:
        return self.residency is None or self.residency.pin_shadow(stop)

    def grow_kv_ahead(self) -> int:
        """Idle after an answer (the loop thread: never during a release or a restore): grow the
        KV snapshots' host memory (Residency.grow_kv_memory) where :meth:`kv_ahead` says it is
        worth its RAM, so that the next deep release takes none of the switch's time allocating
        it (a pinned allocation of a gigabyte: 300 ms on an H100)."""
        res = self.residency
        if res is None or not self.kv_ahead():
            return 0
        grown = res.grow_kv_memory()
        if grown:
            self.host_bytes = res.host_held_bytes
        return grown

    def kv_ahead(self) -> bool:
        """Whether a release of this worker may save its KV cells, so that growing their host
        memory ahead is worth the RAM (pinned: the cells in use x1.25, held while the model
        lives): ``TIMESHARE_KV_AHEAD`` 1 or 0 says so; else where contention may send it deep (an
        auto budget, a deep release that frees something, unpinned, and another model's reserve
        on the device's arena: they time-share it), and on the rebuild path (its every release
        saves them). Not under a one-model budget (its switches move the weights only) nor for a
        model alone on its device: there only a sleep goes deep, off any switch's path."""
        override = envvars.KV_AHEAD.switch()
        if override is not None:
            return override
        res, budget = self.residency, self.budget
        if res is None:
            return False
        if res.path == "rebuild":
            return True
        if self._pinned or budget is None or budget.kind != "auto" or self._deepens <= 0:
            return False
        leases = self._leases()
        if leases is None:
            return False
        me = (os.getpid(), self.spec.model.id)
        return any(x.kind == "reserve" and (x.pid, x.model) != me for x in leases)

    @property
    def attach_steps(self) -> dict[str, float]:
        return self.residency.attach_steps if self.residency is not None else {}

    def _hand_back_for_load(self) -> None:
        """Before a load (holding the token): the hand-over's memory that no model uses goes back
        to the driver -- the chunks on hand at the holder, and those the parked workers keep mapped
        (asked back, then closed) -- since ggml allocates the new model's weights, KV cache and
        compute buffers itself, outside the hand-over. Without this a load on a card that holds a
        parked model's kept chunks finds them in its way (H100, ``bench api --deep``'s card: "1.7
        GB of GPU memory is free now" for 4.5 GB of weights, 2026-12-07). A holder that does not
        answer only costs the wait (at most the reclaim's); the load then tries as before."""
        if self.handover is None:
            self.handover = self._handover_client()
        client = self.handover
        if client is None:
            return
        try:
            status = client.status()
            if not (int(status.get("on_hand_bytes", 0)) or int(status.get("kept_bytes", 0))):
                return
            client.trim(0)  # on hand: closed; kept: asked back
            deadline = time.monotonic() + RECLAIM_WAIT_S
            while int(client.status().get("kept_bytes", 0)) and time.monotonic() < deadline:
                time.sleep(0.01)
            client.trim(0)  # what came back
            log.info(
                "before loading %s: the hand-over's memory no model uses went back "
                "(%s kept, %s on hand before)",
                self.spec.model.id,
                decimal_bytes(int(status.get("kept_bytes", 0))),
                decimal_bytes(int(status.get("on_hand_bytes", 0))),
            )
        except HandoverError as exc:
            log.warning("before the load, the hand-over's memory could not be given back: %s", exc)

    def _measure_free(self) -> int:
        """The device's free bytes, for the auto budget's reserve (free before the load minus free
        after it, less the weights). On a GPU the driver's count; on host memory the total less
        this process's own resident memory, since MemAvailable moves with every other process on
        the machine (a busy machine measured a negative footprint, so no reserve at all)."""
        if self.device.gpu:
            return device_memory(self.device.index).free
        return self.device.total - rss_bytes()

    def _fit_budget(self, weight_bytes: int) -> None:
        """After the load (holding the load's lease): measure the reserve (auto), refuse weights
        larger than the whole budget, and shrink the lease to the weights' bytes."""
        budget = self.budget
        assert budget is not None
        reserve = 0
        if budget.kind == "auto" and self._free_before_load is not None:
            try:
                free_now = self._measure_free()
            except Exception as exc:  # a measurement only: the margin covers it
                log.warning("measuring the device after the load failed: %s", exc)
                free_now = self._free_before_load - weight_bytes
            footprint = max(0, self._free_before_load - free_now - weight_bytes)
            reserve = footprint + (GPU_CONTEXT_ALLOWANCE if self.device.gpu else 0)
            log.info(
                "auto VRAM budget: %s keeps %s on %s while released (measured %s%s)",
                self.spec.model.id,
                decimal_bytes(reserve),
                self.device.name,
                decimal_bytes(footprint),
                " + the driver context allowance" if self.device.gpu else ", this process's own memory",
            )
        limit = self._weights_budget()
        if budget.kind == "auto":  # the parked workers' KV caches can make room (deep release)
            limit += self.client.deepable_bytes()
        if not budget.one_model and weight_bytes > limit - reserve:
            others = f", after the {decimal_bytes(reserve)} it keeps there while released" if reserve else ""
            raise VramBudgetError(
                f"{self.spec.model.id}'s weights take {decimal_bytes(weight_bytes)} on {self.device.name}, "
                f"more than the whole VRAM budget of {decimal_bytes(max(0, limit - reserve))}{others} "
                f"(arena.vram_budget = {budget.setting!r}): raise the budget, or use a smaller "
                "quantisation or fewer GPU layers"
            )
        self.client.shrink(weight_bytes)
        if reserve:
            self._reserve_full = reserve
            self._deepens = reserve - (GPU_CONTEXT_ALLOWANCE if self.device.gpu else 0)
            kv, buffers = self.kv_footprint
            # the compute buffers go too: in place, or with the context. Not counted on the CPU
            # build: their pages are in the RSS (the measure there) only once a decode touched
            # them, so the reserve measured at the load does not hold them and a deep release of
            # a worker that has not computed yet frees the KV cache alone
            res = self.residency
            counted = self.device.gpu and (res is None or res.buffers_releasable)
            estimate = kv + (buffers if counted else 0)
            if estimate > 0:  # the measured reserve holds more on the CPU build (the host shadow)
                self._deepens = min(self._deepens, estimate)
            self._deep_keeps = reserve - self._deepens
            self.client.reserve(reserve, deepens=self._deepens)
        self._budget_bytes = self._weights_budget()

    def start(self, enqueue_yield: Callable[[DoorbellRing], None]) -> None:
        """Start the doorbell: each ring (with what the head of the queue asks) goes to
        ``enqueue_yield``, on the warden thread."""

        def ring(heard: DoorbellRing) -> None:
            self._last_ring = heard
            self._rung.set()
            enqueue_yield(heard)

        self.client.start_doorbell(ring)

    def set_pinned(self, pinned: bool) -> None:
        self._pinned = pinned
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

    def handover_figures(self) -> dict[str, int]:
        """The hand-over's figures for the worker's status (all 0 while it is off)."""
        res = self.residency
        h = res.handover if res is not None else {}
        if not h.get("on"):
            return {}
        return {
            "handover_creates": int(h.get("creates", 0) or 0),  # type: ignore[call-overload]
            "handover_mapped_chunks": int(h.get("last_mapped_chunks", 0) or 0),  # type: ignore[call-overload]
            "handover_kept_bytes": int(h.get("kept_bytes", 0) or 0),  # type: ignore[call-overload]
            "handover_skipped_bytes": int(h.get("skipped_upload_bytes", 0) or 0),  # type: ignore[call-overload]
        }

    @property
    def device_bytes(self) -> int:
        res = self.residency
        if res is None:
            return self.weight_bytes if self.client.holds_token else 0
        return res.resident_bytes

    @property
    def resident_fraction(self) -> float:
        res = self.residency
        if res is None or res.weight_bytes <= 0:
            return 1.0 if self.weights_resident else 0.0
        return min(1.0, res.resident_bytes / res.weight_bytes)

    def _covered(self) -> bool:
        """Holds a lease of all its weights (a partly released holder holds less)."""
        if not self.client.holds_token:
            return False
        return self.residency is None or self.client.lease_bytes >= self.residency.weight_bytes

    def _own_allowance(self) -> int:
        """The driver context this worker holds on a GPU that no budget counts yet: the first
        member's is in the auto budget's "others" (measured after its context existed)."""
        budget = self.budget
        if not self.device.gpu or budget is None or budget.pid == os.getpid():
            return 0
        return GPU_CONTEXT_ALLOWANCE

    def shared_room(self) -> int | None:
        budget = self.budget
        if budget is None or budget.kind != "auto":
            return None
        leases = self._leases()
        if leases is None:
            return None
        return time_share_room(budget, leases, (os.getpid(), self.spec.model.id), self._own_allowance())

    def _leases(self) -> list[LeaseRecord] | None:
        """The arena's live leases, None (said in the log) when they cannot be read."""
        try:
            return self.arena.leases()
        except OSError as exc:
            log.warning("reading the arena's leases failed: %s", exc)
            return None

    def make_room(self, need: int, poll: Callable[[], None], timeout_s: float | None) -> None:
        """Under an auto budget, when ``need`` (plus this worker's driver context) exceeds what the
        budget has left beside the others' reserves, a request for that many bytes goes through
        the queue first: its plan sends holders away and parked models deep (least recently used
        first), as for a restore; the lease is given back at once, and the load then asks for the
        device to itself (the reserve it measures must not move with another's restore). A need
        the budget cannot make room for even so is left to the load (its failure has the words)."""
        budget = self.budget
        if budget is None or budget.kind != "auto" or self.residency is not None:
            return
        need += self._own_allowance()
        try:
            limit = self.client.weights_budget()
            deepable = self.client.deepable_bytes()
        except OSError as exc:
            log.warning("reading the arena's leases failed: %s", exc)
            return
        if limit is None or need <= limit or need > limit + deepable:
            return
        log.info(
            "%s needs %s of the budget to load, %s is left beside the parked models: they go deep first",
            self.spec.model.id,
            decimal_bytes(need),
            decimal_bytes(limit),
        )
        request = self.client.request(timeout_s, need)
        try:
            while not request.wait(0.05):
                poll()
            request.result()
        except VramBudgetError as exc:  # the others changed meanwhile: the load goes on as it can
            log.warning("making room for the load: %s", exc)
            return
        except BaseException:
            if not request.cancel():  # granted meanwhile: given back below
                request.wait()
                self.client.release()
            raise
        self.client.release()

    def acquire(self, poll: Callable[[], None], timeout_s: float | None) -> float:
        """Wait for a lease (on the arena's helper thread), polling; returns the wait in ms. The
        weight bytes once loaded; before that, the load's lease (:meth:`_load_need`). A partly
        released holder asks for its whole weights: the bytes it holds count as its own, so it
        waits for room for the rest only; while it waits it still makes room for the head of the
        queue when asked (two partly released holders must never wait for each other), and asks
        again after it has."""
        self._previous_release_ms = 0.0
        if self._covered():
            return 0.0
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        rounds = 0
        while True:
            rounds += 1
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            need = self.weight_bytes + self._regrow() if self.residency is not None else self._load_need()
            request = self.client.request(left, need)
            self._request = request
            gave_way = False
            ring: DoorbellRing | None = None
            try:
                while not request.wait(0.05):
                    poll()
                    if self._rung.is_set() and not self._pinned:
                        self._rung.clear()
                        # asked for its weights (a partly released holder), or for its KV cache
                        # (a parked worker behind the head): give way, then ask again
                        ring = self.asked(self._last_ring)
                        if ring is not None and request.cancel():
                            request.wait()  # its thread has given back what it took meanwhile
                            gave_way = True
                            break
            except BaseException:
                # Give the place in the queue up; if it was granted just now, cancel() is False and
                # the token is kept with the exception: the caller releases or uses it.
                request.cancel()
                raise
            finally:
                self._request = None
            if gave_way:
                self.give_way(ring)
                continue
            grant = request.result()
            if grant.acquired_at >= started:  # granted now (not the lease held already)
                self._previous_release_ms += grant.previous_release_ms
            if self._covered() or self.residency is None:
                break
            if rounds >= 1000:  # never expected: a granted request always covers the weights
                raise ArenaError(
                    f"{self.spec.model.id} holds {self.client.lease_bytes} bytes of its "
                    f"{self.weight_bytes} after its request was granted"
                )
        wait_ms = grant.wait_ms if rounds == 1 else (time.monotonic() - started) * 1000.0
        # From here the weights may land on the device (load or restore): the resident interval
        # of the arena-test harness starts now (a partly released holder's goes on) and ends when
        # a release has freed them all.
        if self._resident_since is None:
            self._resident_since = time.monotonic()
        if self.residency is None:
            self._hand_back_for_load()
        if self.residency is None and self.budget is not None and self.budget.kind == "auto":
            try:
                self._free_before_load = self._measure_free()
            except Exception as exc:
                log.warning("measuring the device before the load failed: %s", exc)
        self._budget_bytes = self._weights_budget() if grant.budget is None else grant.budget
        return wait_ms

    def ensure(self, poll: Callable[[], None], timeout_s: float) -> Acquired:
        held = self._covered() and self.weights_resident
        wait_ms = self.acquire(poll, timeout_s)
        restore_ms = 0.0
        restored = 0
        res = self.residency
        if res is not None and not res.kv_resident and self._regrow() > 0:
            # back from the deep level: the request covered the KV cache and compute buffers too;
            # they move from the weights lease into the reserve before the context is made again
            self.client.reserve(self._reserve_full, deepens=self._deepens, from_lease=True)
        if res is not None and not res.weights_resident:
            try:
                report = self._restore(res, poll)
            except BaseException:
                self.release(kv=False)  # what is left goes too: the model stays released, the invariant holds
                raise
            restore_ms, restored = report.ms, report.bytes
        if res is not None:
            # the weights are on the device only under a lease that covers them (the arena's invariant)
            assert res.state.weights is Weights.ALL and self._covered(), (res.state, self.client.lease_bytes)
        return Acquired(
            switched=not held,
            wait_ms=wait_ms,
            restore_ms=restore_ms,
            restored_bytes=restored,
            release_ms=self._previous_release_ms,
        )

    def _restore(self, res: Residency, poll: Callable[[], None]) -> RestoreReport:
        """Restore the weights (holding the token); returns the successful attempt's report.

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
                    return res.restore()
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

    @property
    def context_kept(self) -> bool:
        return self.residency is not None and self.residency.context_kept

    @property
    def sleeps_in_place(self) -> bool:
        res = self.residency
        return res is not None and res.kv_in_place and res.buffers_releasable

    @property
    def buffers_kept(self) -> bool:
        return self.residency is not None and self.residency.buffers_kept

    def parked_states(self) -> dict[int, tuple[bytes, int]]:
        return self.residency.parked_states() if self.residency is not None else {}

    @property
    def deep_note(self) -> str:
        return self.residency.deep_note if self.residency is not None else ""

    def release(self, kv: bool, final: bool = False, free_context: bool = False) -> p.Released | None:
        res = self.residency
        report = None
        if res is not None and free_context and res.context_kept:
            res.release(kv=True, free_context=True)  # a sleep after a deep release: the context goes too
        if res is not None and (res.resident_bytes > 0 or (kv and res.kv_resident)):
            moved = -1
            if kv and res.kv_resident and not final:
                # the conversations stay in their sequences where the KV level keeps the context
                # (their cells come back where they were, with the weights' parts); else they are
                # moved to host snapshots first, as before a sleep
                parks = self.on_deep is not None and not res.kv_in_place
                moved = self.on_deep() if parks and self.on_deep is not None else 0
            report = res.release(kv=kv, final=final, free_context=free_context)
            self.host_bytes = res.host_held_bytes  # a deferred shadow's slices left come later (fill_shadow)
            if moved >= 0:
                # handed-over weights stay allocated (the arena's holder keeps them): not in freed_bytes
                weights_freed = 0 if res.handover.get("on") else report.released_bytes
                self._went_deep(report.freed_bytes - weights_freed, moved + res.kv_host_bytes)
        if res is not None:  # the lease goes only once the weights left the device (the arena's invariant)
            assert res.resident_bytes == 0 and (res.state.weights is Weights.NONE or res.weight_bytes == 0), (
                res.state,
                res.resident_bytes,
            )
        return self._end_lease(report, kv)

    def _end_lease(self, report: ReleaseReport | None, kv: bool) -> p.Released | None:
        """The weights are off the device (``report``: their release; None when none was
        resident): the lease goes, and how long the release took goes with it, in the arena,
        for the next holder's grant to say (the Released message says the same, for the log)."""
        self._end_resident()
        release_ms = report.ms if report is not None else None  # None: nothing released, no record
        if self.client.release(release_ms=release_ms) is None and report is None:
            return None
        level: WorkerReleaseLevel = "weights+kv" if kv else "weights"
        if report is None:
            return p.Released(level=level, release_ms=0.0, freed_bytes=0)
        return p.Released(level=level, release_ms=report.ms, freed_bytes=report.freed_bytes)

    def asked(self, ring: DoorbellRing | None = None) -> DoorbellRing | None:
        """What the head of the queue asks of this worker now (see :meth:`Tenancy.asked`): the
        ring while it is fresh (younger than RING_REPEAT_S: the doorbell scanned for it), else
        one scan of the arena (``TokenClient.ring_now``)."""
        if self._pinned:
            return None
        if ring is None or not ring.fresh(time.monotonic()):
            try:
                ring = self.client.ring_now()
            except OSError as exc:
                log.warning("scanning the arena's waiters failed: %s", exc)
                # err on the side of yielding: the whole lease
                lease = self.client.lease_bytes if self.client.holds_token else None
                ring = DoorbellRing(waiters=(), at=time.monotonic(), ask=lease)
        return self._for_me(ring)

    def _for_me(self, ring: DoorbellRing) -> DoorbellRing | None:
        """``ring`` as it concerns this worker now: its weights while it holds a lease, its KV
        cache while it holds none (and only where it has one to free); None when neither."""
        if self._pinned:
            return None
        deepen = ring.deepen and self._deepable()
        if self.client.holds_token:
            return replace(ring, deepen=deepen) if ring.ask is not None else None
        return replace(ring, ask=None, deepen=True) if deepen else None

    def give_way(self, ring: DoorbellRing | None = None) -> p.Released | None:
        """Free what the head of the queue asks for (see :meth:`Tenancy.give_way`): a partial
        lease asked for less than it holds releases parts from its last layer down until its
        resident bytes are at most its lease less the ask, then leases exactly those (the
        resident interval goes on: it still has weights on the device); anything else, or a
        release that left nothing resident, gives the whole lease back."""
        asked = self.asked() if ring is None else self._for_me(ring)
        if asked is None:
            return None
        if not self.client.holds_token:  # parked: the head needs its KV cache
            return self.release(kv=True)
        ask = asked.ask
        assert ask is not None
        res = self.residency
        lease = self.client.lease_bytes
        if res is None or not self.partial or ask >= lease:
            return self.release(kv=asked.deepen)
        report = res.release(keep_bytes=lease - ask)
        self.host_bytes = res.host_held_bytes
        if res.resident_bytes <= 0:  # every part went: the whole lease goes, with this release's time
            assert res.state.weights is Weights.NONE or res.weight_bytes == 0, res.state
            return self._end_lease(report, kv=False)
        # the device memory the resident parts hold: with handed-over memory, whole chunks; the
        # release's time goes to the grant that the room lets through
        self.client.shrink(res.resident_lease_bytes, release_ms=report.ms)
        assert res.state.weights is not Weights.NONE and res.resident_lease_bytes <= self.client.lease_bytes
        log.info(
            "made room for the head of the queue: released %s of %s, %s stays on %s",
            decimal_bytes(report.released_bytes),
            self.spec.model.id,
            decimal_bytes(res.resident_bytes),
            self.device_name or "the device",
        )
        return p.Released(
            level="weights",
            release_ms=report.ms,
            freed_bytes=report.freed_bytes,
            resident_bytes=res.resident_bytes,
        )

    def _deepable(self) -> bool:
        """It has a KV cache on the device that a deep release would free."""
        res = self.residency
        return res is not None and res.kv_resident and self._deepens > 0

    @property
    def over_budget(self) -> bool:
        budget = self.budget
        if budget is None or budget.kind != "auto" or not self.client.holds_token:
            return False
        try:
            limit = self.client.weights_budget()
            leased = sum(x.bytes for x in self.client.holders())
        except OSError as exc:
            log.warning("reading the arena's leases failed: %s", exc)
            return False
        return limit is not None and leased > limit

    def _regrow(self) -> int:
        """What its reserve must grow by before the context is made again (back from the deep
        level: the KV cache and compute buffers); 0 otherwise."""
        res = self.residency
        if res is None or res.kv_resident or not self._reserve_full:
            return 0
        return max(0, self._reserve_full - self.client.reserve_bytes)

    def _went_deep(self, freed: int, moved: int) -> None:
        """The KV cache and compute buffers left the device (``freed``: what the memory measure
        saw go, the weights' bytes taken off; ``moved``: the KV bytes copied to host memory, the
        cells in use only): the reserve shrinks to what the worker keeps there now, measured, and
        asks nothing more of it."""
        log.info(
            "%s: KV cache released, %d bytes of it (the cells in use) moved to host memory",
            self.spec.model.id,
            moved,
        )
        if not self._reserve_full:
            return
        floor = GPU_CONTEXT_ALLOWANCE if self.device.gpu else 0
        keeps = max(floor, self._reserve_full - freed) if freed > 0 else self._deep_keeps
        res = self.residency
        # what the next plans count on: measured by a deep release of the kind contention asks
        # for (the context kept where the KV cache is released in place; a sleep frees the
        # context and its compute buffers too, and measures more)
        if res is None or res.context_kept or not (res.path == "inplace" and res.kv_note == ""):
            self._deep_keeps = keeps
            self._deepens = self._reserve_full - keeps
        log.info(
            "%s went deep (its KV cache released, %s): it keeps %s on %s (measured %s "
            "freed; %s kept while released at the weights level)",
            self.spec.model.id,
            "its compute buffers kept" if self.buffers_kept else "its compute buffers too",
            decimal_bytes(keeps),
            self.device_name or "the device",
            decimal_bytes(max(0, freed)),
            decimal_bytes(self._reserve_full),
        )
        self.client.reserve(keeps, deepens=0)

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
        self._closed = True
        try:
            self.client.close()
        finally:
            res = self.residency
            try:
                if res is not None:
                    res.close()  # its handed-over chunks go back to the holder, which closes them
            finally:
                if self.handover is not None:
                    self.handover.close()
                self.arena.close()


def _paused(stop: Callable[[], bool], pause_s: float) -> Callable[[], bool]:
    """``stop``, asked after a pause (it is asked between two slices: the pause comes before the
    question, so a request that came meanwhile still stops the build at once)."""

    def paused() -> bool:
        time.sleep(pause_s)
        return stop()

    return paused


def make_tenancy(spec: WorkerSpec) -> Tenancy:
    """The arena tenancy when an arena directory is given, else the arena-less one."""
    if spec.arena_dir is None:
        return Tenancy()
    return ArenaTenancy(spec)
