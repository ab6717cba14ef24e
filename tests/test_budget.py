"""The VRAM budget of the arena without llama: the setting and its sizes, the fit rule, leases held
by clients in this process and by real processes (real flock, real kill -9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from _proc_util import blocked_flocks, wait_until
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.budget import (
    BudgetRecord,
    LeaseRecord,
    compute_budget,
    decode_record,
    encode_record,
    parse_budget,
    parse_lease_record,
    plan_fit,
)
from timeshare.core.arena.client import TokenClient
from timeshare.core.arena.records import DoorbellRing
from timeshare.core.errors import VramBudgetError
from timeshare.core.util.units import parse_size

ROOT = Path(__file__).resolve().parent.parent
DRIVER = str(Path(__file__).resolve().parent / "_arena_util.py")
TIMEOUT = 60.0  # generous: the machine may be loaded; nothing here is timed


@pytest.fixture
def arena_dir(tmp_path: Path) -> Path:
    return tmp_path / "arena"


@pytest.fixture
def clients() -> Iterator[list[TokenClient]]:
    made: list[TokenClient] = []
    yield made
    for c in reversed(made):
        c.close()


def make(
    clients: list[TokenClient], arena_dir: Path, model: str, budget: str = "1000B", **kw: object
) -> TokenClient:
    wanted = compute_budget(parse_budget(budget), total=10_000, free=10_000, pid=os.getpid())
    c = TokenClient(Arena(arena_dir), model, budget=wanted, **kw)  # type: ignore[arg-type]
    clients.append(c)
    return c


# ---- settings and sizes ------------------------------------------------------------------------


def test_sizes_are_decimal_or_binary_as_written() -> None:
    assert parse_size("20GiB") == 20 * 2**30
    assert parse_size("12000MB") == 12_000_000_000
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("512") == 512
    assert parse_size("64kib") == 65536
    for bad in ("", "GB", "20 potatoes", "-5GB", "1e9"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)


def test_budget_settings() -> None:
    assert parse_budget("auto").kind == "auto"
    assert parse_budget("one-model").kind == "one-model"
    assert parse_budget("80%").kind == "fraction" and parse_budget("80%").value == pytest.approx(0.8)
    assert parse_budget("20GiB").value == 20 * 2**30
    assert parse_budget(4096).value == 4096
    for bad in ("0%", "101%", "x%", 0, True, "0GB", 1.5):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_auto_takes_off_what_others_use_and_a_margin() -> None:
    total = 100 * 10**9
    record = compute_budget(parse_budget("auto"), total=total, free=90 * 10**9)
    assert record.others_bytes == 10 * 10**9
    assert record.margin_bytes == 45 * 10**8  # 5 % of what was free (at least 256 MiB)
    assert record.bytes == 855 * 10**8
    assert record.weights_budget(reserved=3 * 10**9) == 825 * 10**8  # the workers' reserves too
    explicit = compute_budget(parse_budget("20GB"), total=total, free=1)
    assert explicit.weights_budget(reserved=10**9) == 20 * 10**9  # an explicit size: no margin, no reserves
    assert compute_budget(parse_budget("50%"), total=total, free=1).bytes == total // 2
    assert compute_budget(parse_budget("one-model"), total=total, free=1).weights_budget(0) is None


def test_auto_margin_is_a_share_of_the_free_memory_with_a_floor() -> None:
    """Issue 39: a 141 GB card held down to 8 GiB free by another process. A margin of 5 % of the
    card (7 GB) left a budget of 0; 5 % of the 8 GiB Timeshare may use leaves the rest."""
    total, free = 141 * 10**9, 8 * 2**30
    record = compute_budget(parse_budget("auto"), total=total, free=free)
    assert record.margin_bytes == int(0.05 * free)
    assert record.bytes == free - int(0.05 * free) > 7 * 2**30
    small = compute_budget(parse_budget("auto"), total=total, free=2 * 2**30)
    assert small.margin_bytes == 256 * 2**20  # the floor
    assert compute_budget(parse_budget("auto"), total=total, free=0).bytes == 0


# ---- the rule (pure) ---------------------------------------------------------------------------


def lease(name: str, nbytes: int, used_at: float, **kw: object) -> LeaseRecord:
    return LeaseRecord(model=name, pid=1, bytes=nbytes, used_at=used_at, name=name, **kw)  # type: ignore[arg-type]


def test_plan_evicts_least_recently_used_idle_holders_first() -> None:
    budget = BudgetRecord(setting="100B", kind="bytes", bytes=100)
    a, b = lease("a", 40, used_at=1.0), lease("b", 40, used_at=2.0)
    c = lease("c", 20, used_at=0.5, busy=True, quantum_until=50.0)  # used longest ago, but in its quantum
    assert plan_fit(20, [a, b], budget, now=10.0).fits
    plan = plan_fit(30, [a, b, c], budget, now=10.0)
    assert not plan.fits and [v.name for v in plan.victims] == ["a"]
    assert [v.name for v in plan_fit(50, [a, b, c], budget, now=10.0).victims] == ["a", "b"]
    # past its quantum a busy holder comes after the idle ones, before those still inside it
    assert [v.name for v in plan_fit(90, [a, b, c], budget, now=60.0).victims] == ["a", "b", "c"]


def test_plan_with_pinned_holders_in_the_way() -> None:
    budget = BudgetRecord(setting="100B", kind="bytes", bytes=100)
    a = lease("a", 60, used_at=1.0, pinned=True)
    b = lease("b", 30, used_at=2.0)
    assert [v.name for v in plan_fit(40, [a, b], budget, now=0.0).victims] == ["b"]
    never = plan_fit(50, [a, b], budget, now=0.0)
    assert not never.possible and not never.too_large and [p.name for p in never.pinned] == ["a"]
    assert plan_fit(101, [], budget, now=0.0).too_large
    one = BudgetRecord(setting="one-model", kind="one-model", bytes=0)
    waits = plan_fit(10, [a], one, now=0.0)
    assert not waits.possible and not waits.too_large  # one model at a time: waits for an unpin


def test_a_partial_victim_is_asked_to_free_only_what_the_request_lacks() -> None:
    budget = BudgetRecord(setting="100B", kind="bytes", bytes=100)
    a = lease("a", 50, used_at=1.0, partial=True)
    b = lease("b", 40, used_at=2.0, partial=True)
    plan = plan_fit(30, [a, b], budget, now=10.0)  # 10 free: 20 lacking, all from the LRU holder
    assert not plan.fits and plan.possible and [v.name for v in plan.victims] == ["a"]
    assert plan.frees == (20,) and plan.asked("a") == 20 and plan.asked("b") is None and plan.partial
    plan = plan_fit(70, [a, b], budget, now=10.0)  # 60 lacking: a goes whole, b frees the rest
    assert [v.name for v in plan.victims] == ["a", "b"] and plan.frees == (50, 10)
    whole = replace(a, partial=False)  # a holder without parts frees its whole lease
    assert plan_fit(30, [whole, b], budget, now=10.0).frees == (50,)
    assert not plan_fit(30, [whole, b], budget, now=10.0).partial


def test_a_request_for_the_device_or_a_one_model_budget_never_asks_for_part() -> None:
    bytes_budget = BudgetRecord(setting="100B", kind="bytes", bytes=100)
    one = BudgetRecord(setting="one-model", kind="one-model", bytes=0)
    a = lease("a", 50, used_at=1.0, partial=True)
    assert plan_fit(None, [a], bytes_budget, now=0.0).frees == (50,)
    assert plan_fit(10, [a], one, now=0.0).frees == (50,)
    assert not plan_fit(10, [a], one, now=0.0).partial


def test_a_partly_released_holder_needs_room_only_for_what_it_lost() -> None:
    budget = BudgetRecord(setting="100B", kind="bytes", bytes=100)
    mine = LeaseRecord(model="m", pid=7, bytes=30, used_at=0.0, name="mine", partial=True)
    other = lease("o", 60, used_at=5.0, partial=True)
    # m holds 30 of its 50: it needs 20 more and 10 are free, so o frees 10 (never m itself)
    plan = plan_fit(50, [mine, other], budget, now=10.0, requester=(7, "m"))
    assert not plan.fits and [v.name for v in plan.victims] == ["o"] and plan.frees == (10,)
    assert plan.own == 30 and plan.leased == 60
    assert plan_fit(40, [mine, other], budget, now=10.0, requester=(7, "m")).fits
    # judged for someone else, m's lease is a victim like any other (least recently used first)
    assert plan_fit(50, [mine, other], budget, now=10.0).victims[0].name == "mine"
    # a pinned other leaves no room: impossible, and m is never its own victim
    pinned = replace(other, pinned=True, bytes=70)
    never = plan_fit(50, [mine, pinned], budget, now=10.0, requester=(7, "m"))
    assert not never.possible and never.victims == () and [p.name for p in never.pinned] == ["o"]


def test_the_partial_flag_travels_in_the_lease_record() -> None:
    record = LeaseRecord(model="m", pid=3, bytes=10, partial=True)
    assert parse_lease_record(decode_record(encode_record(record.to_json()))) == record
    assert parse_lease_record({"model": "m", "pid": 3, "bytes": 10}) == replace(record, partial=False)
    assert parse_lease_record({"model": "m", "pid": 3, "bytes": 10, "partial": "yes"}) is None


# ---- clients of one arena ----------------------------------------------------------------------


def test_two_fit_at_once_and_a_third_evicts_the_least_recently_used(
    arena_dir: Path, clients: list[TokenClient]
) -> None:
    a, b, c = (make(clients, arena_dir, m) for m in "abc")
    a.acquire(timeout=TIMEOUT, need=400)
    b.acquire(timeout=TIMEOUT, need=400)  # fits beside a: no waiting, no ring
    assert a.holds_token and b.holds_token
    assert [x.model for x in a.holders()] == ["b", "a"] and a.weights_budget() == 1000
    b.note_use(busy=False)  # b used after a: a is the least recently used
    rings: dict[str, list[DoorbellRing]] = {"a": [], "b": []}
    a.start_doorbell(rings["a"].append)
    b.start_doorbell(rings["b"].append)
    req = c.request(timeout=TIMEOUT, need=400)
    wait_until(lambda: rings["a"], TIMEOUT, "a asked to yield")
    # the ring comes with c's ticket; the reason with c's first fit plan, a moment later
    wait_until(lambda: req.waiting_reason().startswith("held by a (needs 400 B"), TIMEOUT, "c's reason")
    assert not req.done()
    assert not rings["b"] and not b.asked_to_yield()
    a.release()
    grant = req.result(timeout=TIMEOUT)
    assert grant.bytes == 400 and grant.budget == 1000 and grant.handoff
    assert sorted(x.model for x in c.holders()) == ["b", "c"]


def test_the_head_of_the_queue_is_not_starved_by_smaller_requests(
    arena_dir: Path, clients: list[TokenClient]
) -> None:
    small, big, late = (make(clients, arena_dir, m) for m in ("small", "big", "late"))
    small.acquire(timeout=TIMEOUT, need=400)
    big_req = big.request(timeout=TIMEOUT, need=900)
    wait_until(lambda: big_req.ticket is not None, TIMEOUT, "the big request's ticket")
    late_req = late.request(timeout=TIMEOUT, need=100)  # would fit now, but waits its turn
    wait_until(lambda: late_req.ticket is not None, TIMEOUT, "the late request's ticket")
    assert small.asked_to_yield()
    # (the reason is set by the request's thread after its ticket: a moment later under load)
    wait_until(lambda: "1 ahead in the queue" in late_req.waiting_reason(), TIMEOUT, "the late one's reason")
    assert not late_req.done()
    small.release()
    assert big_req.result(timeout=TIMEOUT).bytes == 900
    assert not late_req.done() or late_req.result().acquired_at > big_req.result().acquired_at
    assert late_req.result(timeout=TIMEOUT).bytes == 100  # 900 + 100 fit the budget of 1000


def test_pinned_holders_leaving_no_room_fail_the_request_at_once(
    arena_dir: Path, clients: list[TokenClient]
) -> None:
    pinned = make(clients, arena_dir, "gemma", pinned=True)
    other = make(clients, arena_dir, "smol")
    pinned.acquire(timeout=TIMEOUT, need=600)
    with pytest.raises(VramBudgetError) as info:
        other.acquire(timeout=TIMEOUT, need=500)  # not after the timeout: at once
    message = str(info.value)
    assert "smol needs 500 B" in message and "budget of 1 kB" in message
    assert "pinned gemma (600 B) holds the rest" in message and "unpin it" in message
    assert info.value.code == "vram_budget"
    with pytest.raises(VramBudgetError, match="more than the whole budget of 1 kB"):
        other.acquire(timeout=TIMEOUT, need=1001)
    assert Arena(arena_dir).waiters() == []  # the failed requests left the queue
    other.acquire(timeout=TIMEOUT, need=400)  # what fits beside the pinned one is granted
    assert other.holds_token and pinned.holds_token


def test_a_shrunk_lease_makes_room(arena_dir: Path, clients: list[TokenClient]) -> None:
    loader, other = make(clients, arena_dir, "loader"), make(clients, arena_dir, "other")
    grant = loader.acquire(timeout=TIMEOUT)  # the device to itself (a load: its bytes unknown)
    assert grant.bytes == 1000
    loader.shrink(300)
    assert loader.lease_bytes == 300
    assert [x.bytes for x in other.holders()] == [300]
    other.acquire(timeout=TIMEOUT, need=700)
    assert loader.holds_token and other.holds_token


def test_the_first_budget_wins_and_a_different_one_is_reported(
    arena_dir: Path, clients: list[TokenClient]
) -> None:
    first = make(clients, arena_dir, "a", "1000B")
    second = make(clients, arena_dir, "b", "2GB")
    assert first.budget.setting == second.budget.setting == "1000B"
    assert first.budget_note == ""
    assert "'1000B'" in second.budget_note and "'2GB'" in second.budget_note
    same = make(clients, arena_dir, "c", "1000 B")
    assert same.budget_note == ""  # the same bytes, written differently
    assert Arena(arena_dir).budget_in_force() == first.budget
    for c in clients:
        c.close()
    clients.clear()
    assert Arena(arena_dir).budget_in_force() is None  # nobody uses the arena any more
    later = make(clients, arena_dir, "d", "2GB")
    assert later.budget.setting == "2GB" and later.budget_note == ""


def test_a_garbage_budget_record_is_replaced(arena_dir: Path, clients: list[TokenClient]) -> None:
    Arena(arena_dir).close()
    (arena_dir / "budget").write_text("{garbage")
    c = make(clients, arena_dir, "a", "3kB")
    assert c.budget.bytes == 3000 and c.budget_note == ""


def test_leases_of_dead_processes_are_swept(arena_dir: Path, clients: list[TokenClient]) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    dead = child.pid
    arena = Arena(arena_dir)
    (arena_dir / "leases" / f"{dead}-1-ghost").write_text("x")  # nobody holds its lock
    (arena_dir / f".lease.{dead}-2-ghost.tmp").write_text("x")
    (arena_dir / f".lease.{os.getpid()}-3-mine.tmp").write_text("x")  # a live writer's: kept
    assert sorted(arena.sweep()) == sorted([f".lease.{dead}-2-ghost.tmp", f"leases/{dead}-1-ghost"])
    assert (arena_dir / f".lease.{os.getpid()}-3-mine.tmp").exists()
    c = make(clients, arena_dir, "a")
    c.acquire(timeout=TIMEOUT, need=1000)  # the ghost's bytes were never counted
    arena.close()


# ---- real processes ------------------------------------------------------------------------------


def test_kill9_of_a_lease_holder_frees_its_bytes(arena_dir: Path, clients: list[TokenClient]) -> None:
    holder = subprocess.Popen(
        [sys.executable, DRIVER, "hold", str(arena_dir), "auto", "victim", "bytes=700", "budget=1000B"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "HELD"
        other = make(clients, arena_dir, "survivor")
        assert other.budget.setting == "1000B"
        other.acquire(timeout=TIMEOUT, need=300)  # fits beside it
        other.release()
        req = other.request(timeout=TIMEOUT, need=500)
        files = [p for p in (arena_dir / "leases").iterdir() if not p.name.startswith(".")]
        assert len(files) == 1
        # blocked in flock(2) on the victim's lease: the kernel wakes it when the lease ends
        wait_until(lambda: blocked_flocks(files[0]) == 1, TIMEOUT, "the waiter blocked on the lease")
        assert req.waiting_reason().startswith("held by victim")
        holder.send_signal(signal.SIGKILL)
        holder.wait(TIMEOUT)
        grant = req.result(timeout=TIMEOUT)
        assert grant.bytes == 500 and [x.model for x in other.holders()] == ["survivor"]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(TIMEOUT)
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()


def test_many_clients_never_exceed_the_budget(arena_dir: Path, clients: list[TokenClient]) -> None:
    """Random contention in one process: the leased bytes, summed under the arena lock by an
    observer, never exceed the budget, and everyone gets through."""
    sizes = {"a": 300, "b": 500, "c": 400, "d": 200}
    cs = {m: make(clients, arena_dir, m) for m in sizes}
    for c in cs.values():
        c.start_doorbell(lambda _ring, c=c: c.release())  # an idle holder yields at once
    arena = Arena(arena_dir)
    stop = threading.Event()
    worst = [0]

    def observe() -> None:
        while not stop.is_set():
            lock = arena.dir.lock()
            assert lock is not None
            try:
                worst[0] = max(worst[0], sum(x.bytes for x in arena.leases() if x.kind == "weights"))
            finally:
                arena.dir.unlock(lock)

    def run(m: str) -> None:
        for _ in range(15):
            cs[m].acquire(timeout=TIMEOUT, need=sizes[m])
            cs[m].release()

    watcher = threading.Thread(target=observe)
    watcher.start()
    threads = [threading.Thread(target=run, args=(m,)) for m in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 4)
    stop.set()
    watcher.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    assert 0 < worst[0] <= 1000
    arena.close()


def test_the_budget_variable_replaces_auto_in_the_spec_and_the_worker_never_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from timeshare.core.config.schema import ArenaConfig
    from timeshare.core.config.vram_budget import resolve_arena
    from timeshare.core.errors import ConfigError
    from timeshare.core.worker.device import budget_setting

    monkeypatch.setenv("TIMESHARE_VRAM_BUDGET", "one-model")
    assert resolve_arena(ArenaConfig()).vram_budget == "one-model"
    assert resolve_arena(ArenaConfig(vram_budget="2GiB")).vram_budget == "2GiB"  # only "auto" yields
    assert budget_setting("auto").kind == "auto"  # the worker takes its spec's value as it is
    monkeypatch.setenv("TIMESHARE_VRAM_BUDGET", "20 potatoes")
    with pytest.raises(ConfigError, match=r"^\$TIMESHARE_VRAM_BUDGET: "):
        resolve_arena(ArenaConfig())
    monkeypatch.delenv("TIMESHARE_VRAM_BUDGET")
    assert resolve_arena(ArenaConfig()).vram_budget == "auto"
