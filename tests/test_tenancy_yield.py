"""A yield is decided by one scan of the arena (issue 37): the doorbell's ring carries what the head
of the queue asks (who, how many bytes), the worker's tenancy uses a ring younger than
RING_REPEAT_S as it is and scans once only for an older one, and give_way scans no more.

A worker's ``ArenaTenancy`` in this process (no model loaded: its lease is the load's, its file's
bytes under a byte budget) on a real arena directory, with its real doorbell thread; the other
side is a real ``TokenClient`` whose request, too large to fit beside it, waits in the queue. The
scans are counted by the client itself (``ring_scans``: the warden's, ``yield_scans``: any other
thread's).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.client import TokenClient
from timeshare.core.arena.records import RING_REPEAT_S, DoorbellRing
from timeshare.core.config.schema import ArenaConfig, ModelConfig
from timeshare.core.wire.spec import WorkerSpec
from timeshare.core.worker.tenancy import ArenaTenancy

TIMEOUT = 30.0
BUDGET = 1 << 30
#: what the other worker asks for: more than fits beside the tenancy's lease
NEED = BUDGET - (1 << 20)


@pytest.fixture
def tenancy(tmp_path: Path, smollm2_path: Path) -> Iterator[ArenaTenancy]:
    spec = WorkerSpec(
        model=ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, idle_sleep_s=None),
        arena=ArenaConfig(vram_budget=str(BUDGET)),
        arena_dir=str(tmp_path / "arena"),
        kv_dir=str(tmp_path / "kv"),
    )
    t = ArenaTenancy(spec)
    yield t
    t.close()


@pytest.fixture
def other(tenancy: ArenaTenancy) -> Iterator[TokenClient]:
    """Another worker of the same device's arena (its own Arena object, as another process has)."""
    arena = Arena(tenancy.arena.path)
    client = TokenClient(arena, "other")
    yield client
    client.close()
    arena.close()


def _rung_for(rings: queue.Queue[DoorbellRing], model: str) -> DoorbellRing:
    while True:
        ring = rings.get(timeout=TIMEOUT)
        if ring.head is not None and ring.head.model == model:
            return ring


def test_the_ring_carries_the_ask_and_a_fresh_ring_decides_the_yield_without_a_scan(
    tenancy: ArenaTenancy, other: TokenClient
) -> None:
    rings: queue.Queue[DoorbellRing] = queue.Queue()
    tenancy.start(rings.put)
    tenancy.acquire(lambda: None, TIMEOUT)
    assert tenancy.holds_token
    client = tenancy.client
    request = other.request(timeout=TIMEOUT, need=NEED)

    # the ring says who asks, for how much, and what of this worker: its whole lease
    ring = _rung_for(rings, "other")
    assert ring.need == NEED and ring.ask == client.lease_bytes > 0 and not ring.deepen
    assert client.ring_scans >= 1  # the warden's scan that rang

    # what the loop did before: its check (others_waiting → asked_to_yield) and give_way's own
    # asked_to_free scanned the arena twice more on the worker's side, three scans a yield
    before = client.yield_scans
    assert client.asked_to_yield() and client.asked_to_free() == ring.ask
    assert client.yield_scans - before == 2

    # now: a ring heard less than RING_REPEAT_S ago decides it as it is (no scan); one older is
    # judged again by one scan. A ring whose age straddled the limit during the call tells
    # nothing: the next ring (the bell rings again every RING_REPEAT_S) is taken instead
    fresh_seen = False
    for _ in range(100):
        if fresh_seen:
            break
        ring = _rung_for(rings, "other")
        before = client.yield_scans
        started = time.monotonic()
        asked = tenancy.asked(ring)
        ended = time.monotonic()
        scans = client.yield_scans - before
        assert asked is not None and asked.ask == client.lease_bytes
        if ended - ring.at < RING_REPEAT_S:  # fresh for the whole call
            assert scans == 0 and asked.at == ring.at
            fresh_seen = True
        elif started - ring.at >= RING_REPEAT_S:  # stale for the whole call
            assert scans == 1 and asked.at >= started
    assert fresh_seen, "no ring was decided while fresh in 100 rings"

    # giving way with what was asked scans no more: the lease goes to the head of the queue
    before = client.yield_scans
    released = tenancy.give_way(asked)
    assert client.yield_scans == before
    assert released is not None and not tenancy.holds_token
    assert request.result(timeout=TIMEOUT).model == "other"


def test_a_stale_ring_costs_one_scan_and_a_ring_nobody_stands_behind_none_after(
    tenancy: ArenaTenancy, other: TokenClient
) -> None:
    rings: queue.Queue[DoorbellRing] = queue.Queue()
    tenancy.start(rings.put)
    tenancy.acquire(lambda: None, TIMEOUT)
    client = tenancy.client
    request = other.request(timeout=TIMEOUT, need=NEED)
    ring = _rung_for(rings, "other")
    time.sleep(RING_REPEAT_S)  # older than RING_REPEAT_S: the bell may have rung again since
    assert not ring.fresh(time.monotonic())
    before = client.yield_scans
    asked = tenancy.asked(ring)
    assert client.yield_scans - before == 1  # one scan, whose ring give_way uses as it is
    assert asked is not None and asked.ask == client.lease_bytes and asked.at > ring.at
    assert tenancy.give_way(asked) is not None and client.yield_scans - before == 1
    request.result(timeout=TIMEOUT)

    # the head took the GPU: an old ring of it asks nothing any more (one scan says so), and a
    # worker holding no lease and no KV cache to free gives nothing
    other.release()
    tenancy.acquire(lambda: None, TIMEOUT)
    before = client.yield_scans
    assert tenancy.asked(ring) is None and client.yield_scans - before == 1
    assert tenancy.give_way() is None  # with nothing heard, give_way asks itself: one scan
    assert client.yield_scans - before == 2 and tenancy.holds_token


def test_a_pinned_worker_is_asked_nothing_and_scans_nothing(
    tenancy: ArenaTenancy, other: TokenClient
) -> None:
    rings: queue.Queue[DoorbellRing] = queue.Queue()
    tenancy.start(rings.put)
    tenancy.acquire(lambda: None, TIMEOUT)
    request = other.request(timeout=TIMEOUT, need=NEED)
    ring = _rung_for(rings, "other")
    assert ring.ask is not None
    # pinned now (a request that a pinned holder leaves no room for then fails at once: no matter)
    tenancy.set_pinned(True)
    before = tenancy.client.yield_scans
    assert tenancy.asked(ring) is None and tenancy.give_way(ring) is None
    assert tenancy.client.yield_scans == before and tenancy.holds_token
    request.cancel()
