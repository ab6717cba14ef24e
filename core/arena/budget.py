"""The VRAM budget of one device: the setting, the record kept in its arena, leases and the rule
that decides who fits. Pure: no file is touched here (:mod:`.leases` does that).

Settings (``arena.vram_budget``, ``--budget``):

- ``"auto"`` (the default): the device's total memory, minus what other processes used when the
  first worker of the arena started (total − free, measured by that worker before it loaded
  anything; it includes that worker's own driver context), minus a safety margin
  (:func:`auto_margin`: 5 % of what was free then — the memory Timeshare may use, not the whole
  card — and at least 256 MiB), minus what every worker keeps on the
  device while released (its *reserve*: context, KV cache and compute buffers, measured around its
  load, plus a driver-context allowance on a GPU). Each worker's reserve is held as a lease of kind
  ``"reserve"`` for as long as the worker lives, so the weights' budget shrinks and grows with the
  workers.
- a size (``"20GiB"``, ``"12000MB"``: MB/GB decimal, MiB/GiB binary) or a fraction of the device
  (``"80%"``): the budget for weights as given; no margin, no reserves.
- ``"one-model"``: one model's weights at a time, whatever their size: the single GPU token of
  before budgets (the default of ``arena-test``, ``bench switch`` and ``doctor``).

The first worker that joins an arena with no live member records its setting and the bytes it
computed (:class:`BudgetRecord`); every later member uses that record (a different setting is
reported, never silently used) until the last member has gone.

Leases: a resident worker holds a lease of its weight bytes (:class:`LeaseRecord`). The invariant
is *a worker's weights on the device are covered by its lease, and the leased bytes of a device
never exceed its budget*. :func:`plan_fit` is the one rule, shared by the waiter (does it fit,
whom must it wait for) and the holders (am I asked to leave, and how much must I free).

Partial leases: a holder whose weights are held in layer parts (``models[].weight_parts``, the
in-place path) marks its lease ``partial``. Under a byte budget such a victim is asked to free
only the bytes the requester still lacks (:attr:`Plan.frees`); it releases parts from its last
layer down until its resident bytes are at most its lease less that, replaces its lease by one of
its resident bytes and stays a holder. Before it computes again it asks for its whole weights
through the same queue: the request counts the bytes it still holds as its own
(``plan_fit(requester=...)``), so it needs room only for what it lost. A one-model budget, and
any request for the device to itself, always asks whole leases to go.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..util.units import decimal_bytes, parse_size

BudgetKind = Literal["auto", "one-model", "bytes", "fraction"]
LeaseKind = Literal["weights", "reserve"]

#: the safety margin of an auto budget: this fraction of the memory Timeshare may use (the
#: device's free bytes when the arena's first worker started), and at least AUTO_MARGIN_MIN. A share
#: of the whole card was 7 GB on a 141 GB H200 held down to an "8 GB card" by another process: a
#: budget of 0 (issue 39)
AUTO_MARGIN_FRACTION = 0.05
AUTO_MARGIN_MIN = 256 * 2**20
#: added to a worker's measured reserve on a GPU: the driver context each worker process holds
#: (≈ 0.6 GB measured on the H200), which exists before the worker can measure anything
GPU_CONTEXT_ALLOWANCE = 512 * 2**20

#: lease, budget and ticket records are padded to this size and rewritten in place with one pwrite
RECORD_SIZE = 1024


@dataclass(frozen=True)
class BudgetSetting:
    """A parsed ``arena.vram_budget``: ``value`` is bytes (kind "bytes") or a fraction in (0, 1]."""

    kind: BudgetKind
    value: float = 0.0
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.kind


ONE_MODEL = BudgetSetting("one-model", text="one-model")
AUTO = BudgetSetting("auto", text="auto")


def parse_budget(raw: object) -> BudgetSetting:
    """``"auto"``, ``"one-model"``, a size (``"20GiB"``, ``"12000MB"``, an integer of bytes) or a
    fraction of the device (``"80%"``). Raises ValueError with a sentence."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise ValueError(
            f"must be 'auto', 'one-model', a size such as '20GiB' or a share such as '80%', not {raw!r}"
        )
    if isinstance(raw, int):
        if raw <= 0:
            raise ValueError(f"must be a positive size, not {raw}")
        return BudgetSetting("bytes", float(raw), str(raw))
    text = raw.strip()
    low = text.lower()
    if low in ("auto", "one-model"):
        return AUTO if low == "auto" else ONE_MODEL
    if low.endswith("%"):
        try:
            pct = float(low[:-1])
        except ValueError:
            raise ValueError(f"{raw!r} is not a share of the device: write e.g. '80%'") from None
        if not (0.0 < pct <= 100.0) or not math.isfinite(pct):
            raise ValueError(f"{raw!r}: a share of the device must be above 0% and at most 100%")
        return BudgetSetting("fraction", pct / 100.0, text)
    size = parse_size(text)
    if size <= 0:
        raise ValueError(f"{raw!r}: the budget must be more than 0 bytes")
    return BudgetSetting("bytes", float(size), text)


def auto_margin(available: int) -> int:
    """The safety margin of an auto budget over ``available`` bytes (free when it is computed)."""
    return max(AUTO_MARGIN_MIN, int(AUTO_MARGIN_FRACTION * max(0, available)))


@dataclass(frozen=True)
class BudgetRecord:
    """The budget in force in one arena (one device), recorded by its first member.

    ``bytes``: the weights' budget for "bytes" and "fraction"; for "auto" the budget before the
    workers' reserves are taken off (see :meth:`weights_budget`); 0 for "one-model"."""

    setting: str
    kind: BudgetKind
    bytes: int
    device: int = 0
    device_name: str = ""
    total_bytes: int = 0
    others_bytes: int = 0  # auto: what other processes used at start
    margin_bytes: int = 0  # auto: the safety margin
    pid: int = 0
    at: float = 0.0  # wall clock

    @property
    def one_model(self) -> bool:
        return self.kind == "one-model"

    def weights_budget(self, reserved: int) -> int | None:
        """Bytes of weights the device may hold; None for one-model (one at a time)."""
        if self.one_model:
            return None
        if self.kind == "auto":
            return max(0, self.bytes - reserved)
        return self.bytes

    def describe(self, reserved: int = 0) -> str:
        """ "20 GB (auto)", "one model at a time"..."""
        budget = self.weights_budget(reserved)
        if budget is None:
            return "one model at a time"
        return f"{decimal_bytes(budget)} ({self.setting})"


def compute_budget(
    setting: BudgetSetting,
    *,
    total: int,
    free: int,
    device: int = 0,
    device_name: str = "",
    pid: int = 0,
    at: float = 0.0,
) -> BudgetRecord:
    """The record a first member writes: ``total`` and ``free`` are the device's bytes now."""
    common: dict[str, Any] = {
        "setting": str(setting),
        "kind": setting.kind,
        "device": device,
        "device_name": device_name,
        "total_bytes": total,
        "pid": pid,
        "at": at,
    }
    if setting.kind == "one-model":
        return BudgetRecord(bytes=0, **common)
    if setting.kind == "bytes":
        return BudgetRecord(bytes=int(setting.value), **common)
    if setting.kind == "fraction":
        return BudgetRecord(bytes=int(setting.value * total), **common)
    others = max(0, total - free)
    margin = auto_margin(total - others)
    base = max(0, total - others - margin)
    return BudgetRecord(bytes=base, others_bytes=others, margin_bytes=margin, **common)


@dataclass(frozen=True)
class LeaseRecord:
    """One lease on a device's budget. ``kind`` "weights": a worker's weights are on the device;
    "reserve": what a worker keeps there while released (auto budgets only; never evicted).

    ``bytes`` never changes (a lease that shrinks or grows is replaced). The rest is rewritten in
    place by its holder: ``pinned``; ``busy`` and ``quantum_until`` (monotonic: the holder keeps
    the GPU at least until then while it generates); ``used_at`` (monotonic: its last use, for
    LRU); ``partial``: the holder can free part of it (layer parts, see the module docstring)."""

    model: str
    pid: int
    bytes: int
    kind: LeaseKind = "weights"
    since: float = 0.0  # wall clock
    since_monotonic: float = 0.0
    pinned: bool = False
    busy: bool = False
    quantum_until: float = 0.0
    used_at: float = 0.0
    partial: bool = False
    #: a "reserve" lease: the bytes its worker frees by releasing its KV cache and compute buffers
    #: too (the deep level, issue 39); 0: nothing more to free (already deep, or not measured)
    deepens: int = 0
    name: str = field(default="", compare=False)  # the lease file's name (not stored in it)

    def in_quantum(self, now: float) -> bool:
        return self.busy and now < self.quantum_until

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("name")
        return out


def encode_record(data: dict[str, Any]) -> bytes:
    """``<crc32 hex> <json>`` padded with spaces to RECORD_SIZE: rewritten in place with one
    pwrite, so a reader that meets a half-written record sees a bad checksum and reads again."""
    body = json.dumps(data, separators=(",", ":")).encode()
    raw = b"%08x " % zlib.crc32(body) + body
    if len(raw) > RECORD_SIZE:
        raise ValueError(f"arena record too large ({len(raw)} bytes)")
    return raw.ljust(RECORD_SIZE, b" ")


def decode_record(raw: bytes) -> dict[str, Any] | None:
    """The JSON object of :func:`encode_record`, or None (torn, garbage, not an object)."""
    raw = raw.strip()
    if len(raw) < 10 or raw[8:9] != b" ":
        return None
    body = raw[9:]
    try:
        if int(raw[:8], 16) != zlib.crc32(body):
            return None
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _num(data: dict[str, Any], key: str, default: float = 0.0) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(key)
    return float(value)


def _int(data: dict[str, Any], key: str, default: int = 0) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**63:
        raise ValueError(key)
    return value


def parse_budget_record(data: dict[str, Any] | None) -> BudgetRecord | None:
    if data is None:
        return None
    try:
        kind = data.get("kind")
        setting = data.get("setting")
        if kind not in ("auto", "one-model", "bytes", "fraction") or not isinstance(setting, str):
            return None
        name = data.get("device_name", "")
        return BudgetRecord(
            setting=setting[:64],
            kind=kind,
            bytes=_int(data, "bytes"),
            device=_int(data, "device"),
            device_name=name[:64] if isinstance(name, str) else "",
            total_bytes=_int(data, "total_bytes"),
            others_bytes=_int(data, "others_bytes"),
            margin_bytes=_int(data, "margin_bytes"),
            pid=_int(data, "pid"),
            at=_num(data, "at"),
        )
    except ValueError:
        return None


def parse_lease_record(data: dict[str, Any] | None, name: str = "") -> LeaseRecord | None:
    if data is None:
        return None
    try:
        model, kind = data.get("model"), data.get("kind", "weights")
        pinned, busy = data.get("pinned", False), data.get("busy", False)
        partial = data.get("partial", False)
        if not isinstance(model, str) or kind not in ("weights", "reserve"):
            return None
        if not isinstance(pinned, bool) or not isinstance(busy, bool) or not isinstance(partial, bool):
            return None
        return LeaseRecord(
            model=model,
            pid=_int(data, "pid"),
            bytes=_int(data, "bytes"),
            kind=kind,
            since=_num(data, "since"),
            since_monotonic=_num(data, "since_monotonic"),
            pinned=pinned,
            busy=busy,
            quantum_until=_num(data, "quantum_until"),
            used_at=_num(data, "used_at"),
            partial=partial,
            deepens=_int(data, "deepens"),
            name=name,
        )
    except ValueError:
        return None


# ---- the rule ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_fit` decided for one request.

    ``fits``: take the lease now. Otherwise ``victims`` are the holders asked to make room (least
    recently used first, unpinned only: idle ones, then busy ones past their quantum, then busy
    ones inside it, who leave when it ends) and ``frees`` the bytes each must free (its whole
    lease, or for a ``partial`` lease under a byte budget only what the request still lacks);
    ``pinned`` the pinned holders in the way; ``possible`` is False when the request cannot fit
    even after every unpinned holder left (``too_large``: not even on an empty device). ``own``:
    the weight bytes the requester already holds (a partly released holder asking for the rest)."""

    fits: bool
    victims: tuple[LeaseRecord, ...] = ()
    pinned: tuple[LeaseRecord, ...] = ()
    possible: bool = True
    too_large: bool = False
    budget: int | None = None  # the weights' budget it was judged against (None: one model)
    leased: int = 0  # weight bytes leased by others
    frees: tuple[int, ...] = ()  # per victim, in order: the bytes it is asked to free
    own: int = 0
    #: the parked workers asked to go deep (their "reserve" leases, least recently used first):
    #: each releases its KV cache and compute buffers, ``deepens`` bytes (issue 39)
    deepen: tuple[LeaseRecord, ...] = ()

    def asked_to_deepen(self, name: str) -> bool:
        """The reserve lease ``name`` is asked to go deep."""
        return any(x.name == name for x in self.deepen)

    def asked(self, name: str) -> int | None:
        """The bytes the lease ``name`` is asked to free (None: it is not a victim)."""
        for victim, nbytes in zip(self.victims, self.frees, strict=True):
            if victim.name == name:
                return nbytes
        return None

    @property
    def partial(self) -> bool:
        """Some victim is asked to free less than its whole lease."""
        return any(n < v.bytes for v, n in zip(self.victims, self.frees, strict=True))


def lru_order(leases: Sequence[LeaseRecord], now: float) -> list[LeaseRecord]:
    """Who leaves first: idle holders by last use, then busy ones past their quantum, then busy
    ones inside it."""
    return sorted(leases, key=lambda x: (x.in_quantum(now), x.busy, x.used_at, x.since_monotonic, x.name))


def plan_fit(
    need: int | None,
    leases: Sequence[LeaseRecord],
    budget: BudgetRecord,
    now: float,
    requester: tuple[int, str] | None = None,
) -> Plan:
    """Does a request for ``need`` weight bytes fit beside ``leases`` (the live leases), and if
    not, whom must it wait for and how much must each free? ``need`` None: the request wants the
    device to itself (every other weights lease gone), as does every request under a one-model
    budget. ``requester`` (pid, model): the weights leases it holds itself are its own (never
    victims; under a byte budget they count towards ``need``, so a partly released holder asking
    for its whole weights needs room for the rest only)."""
    weights, own = [], 0
    deepable: list[LeaseRecord] = []
    for x in leases:
        mine = requester is not None and (x.pid, x.model) == requester
        if x.kind != "weights":
            if not mine and x.deepens > 0 and not x.pinned:
                deepable.append(x)
            continue
        if mine:
            own += x.bytes
        else:
            weights.append(x)
    reserved = sum(x.bytes for x in leases if x.kind == "reserve")
    limit = budget.weights_budget(reserved)
    leased = sum(x.bytes for x in weights)
    pinned = tuple(x for x in weights if x.pinned)
    order = [x for x in lru_order(weights, now) if not x.pinned]
    common: dict[str, Any] = {"budget": limit, "leased": leased, "own": own}
    if limit is None or need is None:
        if not weights:
            return Plan(True, **common)
        return Plan(
            False, tuple(order), pinned, possible=not pinned, frees=tuple(x.bytes for x in order), **common
        )
    # an auto budget: the parked workers' KV caches can go too, after every unpinned holder's
    # weights (least recently used first), so a need above today's limit may still fit
    deeper = lru_order(deepable, now) if budget.kind == "auto" else []
    if need > limit + sum(x.deepens for x in deeper):
        return Plan(False, (), pinned, possible=False, too_large=True, **common)
    lacking = need + leased - limit  # its own bytes count towards need: the rest must fit beside the others
    if lacking <= 0:
        return Plan(True, **common)
    victims: list[LeaseRecord] = []
    frees: list[int] = []
    for lease in order:
        victims.append(lease)
        take = lacking if lease.partial and lacking < lease.bytes else lease.bytes
        frees.append(take)
        lacking -= take
        if lacking <= 0:
            return Plan(False, tuple(victims), pinned, frees=tuple(frees), **common)
    deepen: list[LeaseRecord] = []
    for lease in deeper:
        deepen.append(lease)
        lacking -= lease.deepens
        if lacking <= 0:
            return Plan(False, tuple(victims), pinned, frees=tuple(frees), deepen=tuple(deepen), **common)
    return Plan(
        False, tuple(victims), pinned, possible=False, frees=tuple(frees), deepen=tuple(deepen), **common
    )


def lease_bytes_for(need: int | None, budget: BudgetRecord, reserved: int) -> int:
    """The bytes a granted lease records: ``need``, or the whole weights' budget for a request
    that wants the device to itself (so nobody else fits beside it)."""
    if need is not None:
        return need
    limit = budget.weights_budget(reserved)
    return 0 if limit is None else limit


def time_share_room(
    budget: BudgetRecord, leases: Sequence[LeaseRecord], requester: tuple[int, str], allowance: int = 0
) -> int | None:
    """The bytes a model time-shares under an auto budget (core/config/fit.py's room, rule 1): the
    arena's budget less what every other model keeps on the device at the deepest level it can
    reach — a parked model's reserve less what its deep release frees (``deepens``), a pinned
    model's whole reserve and weights (they never go) — and ``allowance`` (the requester's own
    driver context on a GPU, not yet in any reserve). Unpinned holders' weights are not counted:
    they leave when the model needs the room. None: no auto budget (the room is the free memory)."""
    if budget.kind != "auto":
        return None
    kept = 0
    for x in leases:
        if (x.pid, x.model) == requester:
            continue
        if x.kind == "reserve":
            kept += x.bytes if x.pinned else x.bytes - min(x.bytes, x.deepens)
        elif x.pinned:
            kept += x.bytes
    return max(0, budget.bytes - kept - allowance)
