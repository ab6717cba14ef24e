"""Kept mappings (issue 40, the mapping cost): a released worker keeps its chunks mapped until
another worker needs the memory, so its next restore maps nothing; the holder asks the owner to
unmap them (its reclaim channel) only when a restoring worker has no room to allocate, under a
byte budget, when idle. On the CPU with real processes, real fds over the real socket and the
memfd stand-in (``MemfdDevice``, named as such: no GPU), whose map and unmap calls are counted;
"no chunk mapped by two live workers" is read from ``/proc`` (tests/_handover_util.py).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path

import pytest
from _handover_util import (
    CHUNK,
    Worker,
    alive,
    arena_dir,
    clients_closed,
    memfd_fds,
    memfd_maps,
    new_tag,
    observer,
    shared_between,
    wait_for,
    worker_list,
)
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.budget import compute_budget, parse_budget
from timeshare.core.arena.handover import RECLAIM_WAIT_S, REQUEST_TIMEOUT_S
from timeshare.core.arena.ledger import Ledger, LedgerError, on_hand_limit
from timeshare.core.devmem.mapped import HandedMemory
from timeshare.core.devmem.memfd import MemfdDevice

FULL = "0"  # the stand-in's free bytes: a card with no room left (kept chunks are asked back)


tag = pytest.fixture(name="tag")(new_tag)
arena = pytest.fixture(name="arena")(arena_dir)
workers = pytest.fixture(name="workers")(worker_list)
_close_clients = pytest.fixture(name="_close_clients", autouse=True)(clients_closed)


def report(w: Worker) -> dict[str, int]:
    out: dict[str, int] = json.loads(w("report"))
    return out


# ---- the ledger (pure) ----------------------------------------------------------------------


def test_ledger_kept_chunks_go_to_another_pid_only_after_their_owner_released_them() -> None:
    led = Ledger(CHUNK)
    ids = led.adopt([10, 11, 12], pid=100)
    led.keep(100, ids, now=1.0)
    assert led.kept_bytes == 3 * CHUNK and led.lent_bytes == 0 and led.kept_by(100) == ids
    assert led.give(200, 3) == []  # kept is not on hand: never given while mapped by its owner
    with pytest.raises(LedgerError):
        led.keep(100, ids, now=2.0)  # kept already: only a lent chunk can be kept
    with pytest.raises(LedgerError):
        led.released(200, ids, ids, now=2.0)  # not 200's
    led.use(100, ids[:1])  # a restore of 100 maps nothing: in use again
    assert led.lent_to(100) == ids[:1] and led.stats.reused == 1
    asked = led.ask_back(5, but=200)
    assert asked == {100: ids[1:]}  # only kept ones, never the one in use
    assert led.ask_back(5, but=200) == {}  # asked already
    assert led.still_asked(ids) and led.give(200, 2) == []
    assert led.released(100, ids[1:], ids[1:], now=3.0) == 2
    assert not led.still_asked(ids)
    assert sorted(c.id for c in led.give(200, 2)) == ids[1:]
    assert led.ask_back(5, but=0) == {}  # nothing kept any more
    assert led.held_bytes == 3 * CHUNK  # no byte lost, none counted twice


def test_ledger_a_kept_chunk_comes_back_at_its_owners_exit_or_put() -> None:
    led = Ledger(CHUNK)
    a = led.adopt([1, 2], pid=7)
    b = led.adopt([3], pid=8)
    led.keep(7, a, now=1.0)
    led.keep(8, b, now=1.0)
    assert led.pid_gone(7, now=2.0) == 2 and led.on_hand_bytes == 2 * CHUNK
    assert led.put(8, b, now=3.0, keep=False) == [3]  # its last release: closed
    assert led.kept_bytes == 0 and led.held_bytes == 2 * CHUNK


def test_on_hand_limit_counts_kept_chunks_as_memory_outside_the_leases() -> None:
    led = Ledger(CHUNK)
    ids = led.adopt([1, 2, 3, 4], pid=7)
    led.keep(7, ids[:3], now=1.0)
    # a byte budget of 10 chunks, 6 leased: 4 may be outside the leases, 3 are kept
    assert on_hand_limit(10 * CHUNK, 6 * CHUNK, led) == CHUNK
    # one model at a time: the largest set (4) less what is lent or kept (4)
    assert on_hand_limit(None, 0, led) == 0


# ---- the same worker: a restore after its own release maps nothing --------------------------


def test_a_restore_after_a_release_by_the_same_worker_maps_nothing(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    workers.append(a)
    assert a(f"map 1 {4 * CHUNK}").startswith("ok handed=0 created=4 adopted=4 kept=0 mapped=4")
    assert a("fill 1 61") == "ok"
    maps = report(a)["maps"]
    for _ in range(3):
        assert a("release 1") == "ok 4 kept=True"
        st = obs.status()
        assert st["kept_bytes"] == 4 * CHUNK and st["lent_bytes"] == 0 and st["on_hand_bytes"] == 0
        assert a(f"map 1 {4 * CHUNK}").startswith("ok handed=0 created=0 adopted=0 kept=4 mapped=0")
        assert a("check 1 61") == "ok"
        assert obs.status()["lent_bytes"] == 4 * CHUNK  # in use again
    r = report(a)
    assert (r["maps"], r["unmaps"], r["creates"]) == (maps, 0, 4)  # 0 map calls after the first
    st = obs.status()
    assert (st["kept"], st["reused"], st["asked_back"]) == (12, 12, 0)
    a("release 1")
    a.end()  # exits with its chunks kept: they come back on hand
    wait_for("A's kept chunks on hand", lambda: obs.status()["on_hand_bytes"] == 4 * CHUNK)
    assert obs.status()["kept_bytes"] == 0 and memfd_maps(tag) == {}
    obs.close()


# ---- another worker needs the memory: the owner unmaps first, then it maps -------------------


def test_when_another_worker_needs_the_memory_the_owner_unmaps_first(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    b = Worker(arena, tag, "", FULL)  # no room on its card: it must get A's memory
    workers += [a, b]
    a(f"map 1 {3 * CHUNK}")
    a("fill 1 72")
    assert a("release 1") == "ok 3 kept=True"
    assert set(memfd_maps(tag)) == {a.pid}  # still mapped by A
    assert b(f"map 5 {3 * CHUNK}").startswith("ok handed=3 created=0 adopted=0 kept=0 mapped=3")
    assert b("check 5 72") == "ok"  # A's bytes: the same memory, nothing copied, nothing allocated
    ra, rb = report(a), report(b)
    assert ra["unmaps"] == 3 and ra["reclaimed"] == 3  # A unmapped them at the holder's request
    assert rb["creates"] == 0 and rb["maps"] == 3
    assert set(memfd_maps(tag)) == {b.pid} and shared_between(memfd_maps(tag)) == set()
    st = obs.status()
    assert (st["asked_back"], st["released"], st["given"]) == (3, 3, 3)
    assert st["by_pid"] == {str(b.pid): 3} and st["kept_bytes"] == 0
    # A's next restore: nothing kept any more, B's in use: A allocates its own
    assert a(f"map 1 {3 * CHUNK}").startswith("ok handed=0 created=3")
    assert shared_between(memfd_maps(tag)) == set()
    a.end()
    b.end()
    obs.close()
    wait_for("no chunk left anywhere", lambda: memfd_fds(tag) == {} and memfd_maps(tag) == {})


def test_two_workers_with_room_each_keep_their_own_and_switch_mapping_nothing(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    obs = observer(arena)
    a, b = Worker(arena, tag), Worker(arena, tag)
    workers += [a, b]
    a(f"map 1 {2 * CHUNK}")
    a("fill 1 3")
    a("release 1")
    b(f"map 1 {3 * CHUNK}")  # room on the card: allocates its own, A's stay kept
    b("fill 1 4")
    b("release 1")
    maps = report(a)["maps"] + report(b)["maps"]
    creates = report(a)["creates"] + report(b)["creates"]
    for _ in range(5):  # the alternating switch: A, B, A, B...
        assert a(f"map 1 {2 * CHUNK}").startswith("ok handed=0 created=0 adopted=0 kept=2 mapped=0")
        assert a("check 1 3") == "ok"
        a("release 1")
        assert b(f"map 1 {3 * CHUNK}").startswith("ok handed=0 created=0 adopted=0 kept=3 mapped=0")
        assert b("check 1 4") == "ok"
        b("release 1")
    assert report(a)["maps"] + report(b)["maps"] == maps  # 0 map calls in 10 switches
    assert report(a)["creates"] + report(b)["creates"] == creates  # 0 allocations
    assert shared_between(memfd_maps(tag)) == set()
    st = obs.status()
    assert st["asked_back"] == 0 and st["kept_bytes"] == 5 * CHUNK
    a.end()
    b.end()
    obs.close()


# ---- crashes and an owner that does not answer -----------------------------------------------


def test_owner_killed_while_keeping(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    workers.append(a)
    a(f"map 1 {2 * CHUNK}")
    a("fill 1 9")
    a("release 1")
    a.kill()
    wait_for("A's kept chunks on hand", lambda: obs.status()["on_hand_bytes"] == 2 * CHUNK)
    st = obs.status()
    assert st["kept_bytes"] == 0 and st["returned_by_exit"] == 2 and memfd_maps(tag) == {}
    b = Worker(arena, tag, "", FULL)
    workers.append(b)
    assert b(f"map 1 {2 * CHUNK}").startswith("ok handed=2 created=0")
    assert b("check 1 9") == "ok"
    b.end()
    obs.close()


def test_an_owner_that_does_not_answer_keeps_its_chunks_and_the_taker_allocates(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    b = Worker(arena, tag, "", FULL)
    workers += [a, b]
    a(f"map 1 {2 * CHUNK}")
    a("fill 1 21")
    a("release 1")
    os.kill(a.pid, signal.SIGSTOP)  # hung: its reclaim thread cannot answer
    try:
        # B waits (at most RECLAIM_WAIT_S) for A, then allocates: never A's memory while A maps it
        assert RECLAIM_WAIT_S + 10 <= REQUEST_TIMEOUT_S  # well below the client's socket timeout
        assert b(f"map 1 {2 * CHUNK}").startswith("ok handed=0 created=2")
        assert shared_between(memfd_maps(tag)) == set()
        st = obs.status()
        assert st["kept_bytes"] == 2 * CHUNK and st["by_pid"] == {str(a.pid): 2, str(b.pid): 2}
    finally:
        os.kill(a.pid, signal.SIGCONT)
    # A answers late: its chunks come on hand then (unmapped first), and its next restore gets
    # them back, its bytes untouched
    wait_for("A's late answer", lambda: obs.status()["on_hand_bytes"] == 2 * CHUNK)
    assert obs.status()["kept_bytes"] == 0 and set(memfd_maps(tag)) == {b.pid}
    assert a(f"map 1 {2 * CHUNK}").startswith("ok handed=2 created=0")
    assert a("check 1 21") == "ok"
    assert shared_between(memfd_maps(tag)) == set()
    a.kill()
    b.end()
    obs.close()
    wait_for("no chunk left anywhere", lambda: memfd_fds(tag) == {} and memfd_maps(tag) == {})


def test_holder_killed_while_a_worker_keeps(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    workers.append(a)
    a(f"map 1 {2 * CHUNK}")
    a("fill 1 5")
    a("release 1")
    holder_pid = obs.status()["pid"]
    os.kill(holder_pid, signal.SIGKILL)
    wait_for("the holder gone", lambda: not alive(holder_pid))
    assert set(memfd_maps(tag)) == {a.pid} and memfd_fds(tag) == {}  # A's mapping keeps it alone
    # the next restore uses the kept range (the holder is gone: nobody else can have it)
    assert "kept=2 mapped=0" in a(f"map 1 {2 * CHUNK}")
    assert a("check 1 5") == "ok"
    # a release no holder can ask back: unmapped (the memory goes back), never kept
    assert a("release 1") == "ok 2 kept=False"
    assert memfd_maps(tag) == {}
    # the next mapping meets a new holder: ids of the old session mean nothing to it
    assert a(f"map 1 {2 * CHUNK}").startswith("ok handed=0 created=2")
    assert a("release 1") == "ok 2 kept=True"
    st = json.loads(a("status"))
    assert st["pid"] != holder_pid and st["kept_bytes"] == 2 * CHUNK
    a.end()
    wait_for("no chunk left anywhere", lambda: memfd_fds(tag) == {} and memfd_maps(tag) == {})


# ---- kept memory goes back: the budget, idle ------------------------------------------------


def test_kept_chunks_above_a_byte_budget_are_asked_back_and_closed(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    member = Arena(arena)
    _record, budget_fd, _note = member.lease_files.join_budget(
        compute_budget(parse_budget(2 * CHUNK), total=1 << 30, free=1 << 30)
    )
    try:
        obs = observer(arena)
        a = Worker(arena, tag)
        workers.append(a)
        a(f"map 1 {4 * CHUNK}")
        a("release 1")  # 4 kept outside any lease, the budget leaves room for 2
        wait_for("the budget's limit", lambda: obs.status()["on_hand_bytes"] == 2 * CHUNK)
        st = obs.status()
        assert st["kept_bytes"] == 0 and st["closed"] == {"budget": 2} and st["released"] == 4
        assert memfd_maps(tag) == {}
        a.end()
        obs.close()
    finally:
        os.close(budget_fd)
        member.close()


def test_kept_chunks_go_back_when_idle(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena, idle_s=1.0)
    a = Worker(arena, tag)
    workers.append(a)
    a(f"map 1 {3 * CHUNK}")
    a("release 1")
    wait_for("idle: nothing kept or on hand", lambda: obs.status()["chunks"] == 0)
    assert obs.status()["closed"] == {"idle": 3}
    assert memfd_fds(tag) == {} and memfd_maps(tag) == {}
    a.end()
    obs.close()


def test_keep_mappings_off_unmaps_at_each_release(tmp_path: Path) -> None:
    """``keep_mappings`` False ($TIMESHARE_HANDOVER_KEEP=0): the release unmaps, as before."""
    client = observer(tmp_path / "arena")
    device = MemfdDevice(secrets.token_hex(4))
    mem = HandedMemory(device, client, client.chunk_bytes)
    mem.keep_mappings = False
    mem.map_all([(1, 2 * CHUNK)])
    assert mem.unmap([1]) == 2 and not mem.kept(1) and device.unmaps == 2
    assert mem.map_all([(1, 2 * CHUNK)]).handed == 2 and device.maps == 4
    mem.close()
    assert client.status()["chunks"] == 0


def test_keep_only_with_room_gives_back_at_the_release_on_a_full_card(tmp_path: Path) -> None:
    """``keep_only_with_room`` ($TIMESHARE_HANDOVER_KEEP=auto): a release keeps its mappings while
    the device has room for as many bytes again, and gives the chunks back at once on a full card
    (the holder has them on hand: the next restore takes them with no reclaim). The kernel's view:
    this process's mappings of the stand-in's memfds."""
    client = observer(tmp_path / "arena")
    tag = secrets.token_hex(4)
    device = MemfdDevice(tag)
    mem = HandedMemory(device, client, client.chunk_bytes)
    mem.keep_only_with_room = True
    mem.room_bytes = 2 * CHUNK  # room for the 2 chunks released: kept
    mem.map_all([(1, 2 * CHUNK)])
    assert mem.unmap([1]) == 2 and mem.kept(1) and mem.unkept_chunks == 0
    assert len(memfd_maps(tag).get(os.getpid(), set())) == 2  # still mapped here
    mem.map_all([(1, 2 * CHUNK)])  # claimed back: no map call
    assert device.maps == 2
    mem.room_bytes = 2 * CHUNK - 1  # a full card: given back at the release
    assert mem.unmap([1]) == 2 and not mem.kept(1) and mem.unkept_chunks == 2
    assert os.getpid() not in memfd_maps(tag) and device.unmaps == 2
    assert client.status()["chunks"] == 2  # on hand at the holder, for whoever restores next
    mem.close()


def test_lazy_unmap_puts_first_and_unmaps_after_the_release(tmp_path: Path) -> None:
    """``lazy_unmap`` ($TIMESHARE_HANDOVER_LAZY_UNMAP=1): a release that gives its chunks back
    returns with them on hand at the holder while its own mapping is still there (its unmaps wait
    on their thread, held here by a gate); another mapping takes them meanwhile and reads the
    releaser's bytes (the same memory, mapped by both); then the releaser's unmaps run and its
    next mapping waits for them. The kernel's view: this process's maps of the memfds."""
    import ctypes
    import threading

    client = observer(tmp_path / "arena")
    tag = secrets.token_hex(4)
    gate = threading.Event()
    device = MemfdDevice(tag)
    real_unmap = device.unmap

    def held_unmap(address: int, nbytes: int) -> None:
        assert gate.wait(30), "the gate never opened"
        real_unmap(address, nbytes)

    device.unmap = held_unmap  # type: ignore[method-assign]
    mem = HandedMemory(device, client, client.chunk_bytes)
    mem.keep_mappings, mem.lazy_unmap = False, True
    mem.map_all([(1, 2 * CHUNK)])
    first = mem.address(1)
    for k in range(2):
        ctypes.memmove(first + k * CHUNK, b"released chunk %d" % k, 16)
    inodes_before = len(memfd_maps(tag).get(os.getpid(), set()))
    assert mem.unmap([1]) == 2 and not mem.mapped(1)  # returned: the unmaps wait at the gate
    assert client.status()["on_hand_bytes"] == 2 * CHUNK
    assert len(memfd_maps(tag).get(os.getpid(), set())) == inodes_before == 2  # still mapped here
    taker = HandedMemory(MemfdDevice(tag), client, client.chunk_bytes)
    assert taker.map_all([(7, 2 * CHUNK)]).handed == 2  # taken while the releaser still maps them
    got = {ctypes.string_at(taker.address(7) + k * CHUNK, 16) for k in range(2)}
    assert got == {b"released chunk 0", b"released chunk 1"}  # the releaser's memory
    gate.set()
    mem.settle_unmaps()
    assert mem.lazy_unmapped_chunks == 2 and device.unmaps == 2
    with open("/proc/self/maps") as f:
        here = [line for line in f if f"timeshare-chunk-{tag}" in line]
    starts = {int(line.split("-", 1)[0], 16) for line in here}
    assert first not in starts and taker.address(7) in starts  # only the taker's mapping is left
    assert mem.map_all([(1, 2 * CHUNK)]).created == 2  # again (the holder had none on hand)
    taker.close()
    mem.close()


# ---- bad requests are refused, and lose nothing ------------------------------------------------


def test_bad_keep_take_and_released_requests_are_refused(arena: Path, tag: str) -> None:
    from timeshare.core.arena.handover import RequestRefusedError, connect, receive, send

    client = observer(arena)  # no reclaim channel on this connection
    device = MemfdDevice(tag)
    handle = device.create(CHUNK)
    fd = device.export(handle)
    ids = client.adopt([fd])
    os.close(fd)
    device.release(handle)
    with pytest.raises(RequestRefusedError, match="no reclaim channel"):
        client.keep(ids)  # nobody could ask it back: refused, the chunk stays lent
    with pytest.raises(RequestRefusedError, match="not kept by pid"):
        client.take(0, use=ids)  # lent, not kept
    dir_fd = os.open(arena, os.O_RDONLY)
    raw = connect(dir_fd, str(arena), 5.0)  # a raw connection of this process: its bad requests
    try:
        send(raw, {"op": "hello", "v": 1, "pid": os.getpid(), "model": "raw", "role": "boss"})
        refused = receive(raw)[0]
        assert refused is not None and refused["op"] == "error"
        assert "unknown role 'boss'" in refused["message"]
        send(raw, {"op": "hello", "v": 1, "pid": os.getpid(), "model": "raw"})
        assert receive(raw)[0]["op"] == "welcome"  # type: ignore[index]
        for bad, why in (
            ({"op": "take", "n": 1, "room": -1}, "'room' must be a count"),
            ({"op": "take", "n": 0, "use": "all"}, "'use' must be a list"),
            ({"op": "keep", "ids": [True]}, "'ids' must be a list"),
            ({"op": "released", "ids": ids, "asked": []}, "'released' on a request connection"),
        ):
            send(raw, bad)
            answer, fds = receive(raw)
            assert answer is not None and fds == [] and answer["op"] == "error", answer
            assert why in answer["message"], answer
    finally:
        raw.close()
        os.close(dir_fd)
    st = client.status()
    assert st["lent_bytes"] == CHUNK and st["kept_bytes"] == 0  # nothing changed, nothing lost
    client.put(ids, keep=False)
    assert client.status()["chunks"] == 0


@pytest.mark.parametrize(
    ("text", "want"),
    [("", 64 << 20), ("256MiB", 256 << 20), ("3MB", 4 << 20), ("100GiB", 4 << 30), ("lots", 64 << 20)],
)
def test_the_chunk_size_is_a_choice(
    text: str, want: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from timeshare.core.arena.handclient import HandoverClient, chunk_choice

    monkeypatch.setenv("TIMESHARE_HANDOVER_CHUNK", text)
    assert chunk_choice() == want
    client = HandoverClient(tmp_path / "arena", "m", start=False)
    assert client.chunk_bytes == want  # what a holder it starts is started with
    client.close()


def test_a_last_release_gives_kept_ranges_back_too(tmp_path: Path) -> None:
    """``unmap(keep=False)`` (a worker's last release): the buffers released now and the ranges
    kept since an earlier release are unmapped, and the holder closes their chunks."""
    client = observer(tmp_path / "arena")
    device = MemfdDevice(secrets.token_hex(4))
    mem = HandedMemory(device, client, client.chunk_bytes)
    mem.map_all([(1, 2 * CHUNK), (2, CHUNK)])
    assert mem.unmap([1]) == 2 and mem.kept(1)  # a part released earlier: kept
    assert client.status()["kept_bytes"] == 2 * CHUNK
    assert mem.unmap([2], keep=False) == 1
    assert not mem.kept(1) and mem.kept_bytes == 0 and device.unmaps == 3
    st = client.status()
    assert st["chunks"] == 0 and st["closed"] == {"drop": 3}
    mem.close()
