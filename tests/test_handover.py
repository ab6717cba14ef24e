"""Device memory handed over between workers (issue 40), on the CPU: the holder's bookkeeping,
real fds over a real Unix socket (SCM_RIGHTS), peer credentials, and a crash of each party
(kill -9 of real processes).

The device side is the memfd stand-in (``MemfdDevice``, core/devmem/memfd.py): named as such, it
proves the bookkeeping and the fd passing, not a GPU driver. Its memory is found in ``/proc``:
every chunk is a memfd named ``timeshare-chunk-<tag>``, so "no leak" is "no process holds an fd
or a mapping of one", and "no chunk shared by two live workers" is "no memfd inode mapped by two
live pids". The CUDA path is proven on the GPU (scripts/lab/handover_gpu.sh).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from _handover_util import (
    CHUNK,
    WAIT_S,
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
from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.arena.handover import (
    RECORD_FILE,
    SOCKET_FILE,
    HandoverError,
    PeerRefusedError,
)
from timeshare.core.arena.holder import Holder
from timeshare.core.arena.ledger import Ledger, LedgerError, on_hand_limit

tag = pytest.fixture(name="tag")(new_tag)
arena = pytest.fixture(name="arena")(arena_dir)
workers = pytest.fixture(name="workers")(worker_list)
_close_clients = pytest.fixture(name="_close_clients", autouse=True)(clients_closed)


# ---- the ledger (pure) ----------------------------------------------------------------------


def test_ledger_lends_a_chunk_to_one_pid_at_a_time() -> None:
    led = Ledger(CHUNK)
    ids = led.adopt([10, 11, 12], pid=100)
    assert led.lent_to(100) == ids and led.on_hand_bytes == 0 and led.lent_bytes == 3 * CHUNK
    assert led.give(200, 5) == []  # nothing on hand: lent chunks are never given
    assert led.put(100, ids[:2], now=1.0) == []
    given = led.give(200, 5)
    assert sorted(c.id for c in given) == ids[:2]  # only what was put back
    with pytest.raises(LedgerError):
        led.put(100, [ids[0]], now=2.0)  # lent to 200 now, not to 100
    with pytest.raises(LedgerError):
        led.put(200, [ids[0], 999], now=2.0)  # one bad id: nothing changes
    assert led.lent_to(200) == ids[:2]
    assert led.pid_gone(200, now=3.0) == 2
    assert led.on_hand_bytes == 2 * CHUNK and led.lent_to(100) == [ids[2]]
    assert led.held_bytes == 3 * CHUNK  # no byte lost, none counted twice


def test_ledger_trim_closes_the_oldest_on_hand_and_never_a_lent_one() -> None:
    led = Ledger(CHUNK)
    a, b, c = led.adopt([20, 21, 22], pid=1)
    led.put(1, [b], now=1.0)
    led.put(1, [a], now=2.0)
    assert led.trim(CHUNK, "budget") == [21]  # b came back first
    assert led.trim(0, "idle") == [20]
    assert led.trim(0, "idle") == []
    assert led.lent_to(1) == [c]
    assert led.put(1, [c], now=3.0, keep=False) == [22]
    assert led.held_bytes == 0
    assert led.stats.closed == {"budget": 1, "idle": 1, "drop": 1}
    with pytest.raises(LedgerError):
        led.give(1, -1)


def test_on_hand_limit_follows_the_budget() -> None:
    led = Ledger(CHUNK)
    ids = led.adopt([1, 2, 3, 4], pid=7)
    assert on_hand_limit(10 * CHUNK, 6 * CHUNK, led) == 4 * CHUNK
    assert on_hand_limit(10 * CHUNK, 12 * CHUNK, led) == 0
    # one model at a time: the largest set one pid has had, less what is lent now
    assert on_hand_limit(None, 0, led) == 0
    led.put(7, ids, now=1.0)
    assert on_hand_limit(None, 0, led) == 4 * CHUNK


# ---- memory passes, through real processes --------------------------------------------------


def test_memory_passes_from_a_worker_that_exited(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    workers.append(a)
    assert a(f"map 1 {3 * CHUNK + 100}").startswith("ok handed=0 created=4 adopted=4")
    assert a("fill 1 90") == "ok"
    assert a("unmap 1") == "ok 4"
    a.end()
    st = obs.status()
    assert st["on_hand_bytes"] == 4 * CHUNK and st["lent_bytes"] == 0
    holder_pid = st["pid"]
    # only the holder holds them now: fds, no mapping anywhere
    assert set(memfd_fds(tag)) == {holder_pid} and len(memfd_fds(tag)[holder_pid]) == 4
    assert memfd_maps(tag) == {}
    b = Worker(arena, tag)
    workers.append(b)
    assert b(f"map 7 {4 * CHUNK}").startswith("ok handed=4 created=0")
    assert json.loads(b("report"))["creates"] == 0  # nothing allocated: the same memory
    assert b("check 7 90") == "ok"  # A's bytes: the same physical memory, nothing copied
    assert obs.status()["lent_bytes"] == 4 * CHUNK
    b.end()  # exits without putting back: its chunks come back at its exit
    wait_for("B's chunks on hand", lambda: obs.status()["on_hand_bytes"] == 4 * CHUNK)
    obs.close()
    wait_for("the holder exits", lambda: holder_pid not in memfd_fds(tag) and not alive(holder_pid))
    assert memfd_fds(tag) == {} and memfd_maps(tag) == {}  # no leak
    assert not (arena / SOCKET_FILE).exists() and not (arena / RECORD_FILE).exists()


def test_chunks_lent_to_a_live_worker_are_never_given_to_another(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    obs = observer(arena)
    a, b = Worker(arena, tag), Worker(arena, tag)
    workers += [a, b]
    a(f"map 1 {2 * CHUNK}")
    a("fill 1 1")
    a("unmap_some 1 1")  # half released, nothing put back: both chunks still lent to A
    assert b(f"map 1 {2 * CHUNK}").startswith("ok handed=0 created=2")
    assert shared_between(memfd_maps(tag)) == set()
    assert obs.status()["by_pid"] == {str(a.pid): 2, str(b.pid): 2}
    obs.close()


# ---- crashes (kill -9) ----------------------------------------------------------------------


def test_releasing_worker_killed_mid_release(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    workers.append(a)
    a(f"map 1 {4 * CHUNK}")
    a("fill 1 33")
    a("unmap_some 1 2")  # mid-release: two chunks unmapped, none put back
    a.kill()
    wait_for("the dead releaser's chunks on hand", lambda: obs.status()["lent_bytes"] == 0)
    st = obs.status()
    assert st["on_hand_bytes"] == 4 * CHUNK and st["returned_by_exit"] == 4  # no byte lost
    assert memfd_maps(tag) == {}  # its mappings died with it
    b = Worker(arena, tag)
    workers.append(b)
    assert b(f"map 2 {4 * CHUNK}").startswith("ok handed=4 created=0")
    assert b("check 2 33") == "ok"
    assert set(memfd_maps(tag)) == {b.pid}
    b.end()
    obs.close()
    wait_for("no chunk left anywhere", lambda: memfd_fds(tag) == {} and memfd_maps(tag) == {})


def test_restoring_worker_killed_mid_restore(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena)
    a = Worker(arena, tag)
    workers.append(a)
    a(f"map 1 {3 * CHUNK}")
    a("fill 1 44")
    a("unmap 1")
    a.end()
    b = Worker(arena, tag)
    workers.append(b)
    assert b("take 3") == "ok 3"  # mid-restore: handles imported, nothing mapped yet
    assert obs.status()["by_pid"] == {str(b.pid): 3}
    b.kill()
    wait_for("the dead restorer's chunks on hand", lambda: obs.status()["lent_bytes"] == 0)
    assert obs.status()["on_hand_bytes"] == 3 * CHUNK
    c = Worker(arena, tag)
    workers.append(c)
    assert c(f"map 5 {3 * CHUNK}").startswith("ok handed=3 created=0")
    assert c("check 5 44") == "ok"
    c.end()
    obs.close()
    wait_for("no chunk left anywhere", lambda: memfd_fds(tag) == {} and memfd_maps(tag) == {})


def test_holder_killed(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena)
    a, b = Worker(arena, tag), Worker(arena, tag)
    workers += [a, b]
    a(f"map 1 {2 * CHUNK}")  # lent to A, mapped
    a("fill 1 55")
    b(f"map 1 {3 * CHUNK}")
    b("unmap 1")  # B's three chunks on hand
    holder_pid = obs.status()["pid"]
    b_chunks = memfd_fds(tag)[holder_pid]
    assert len(b_chunks) == 5
    os.kill(holder_pid, signal.SIGKILL)
    wait_for("the holder gone", lambda: not alive(holder_pid))
    # its on-hand chunks went back (no fd, no mapping anywhere); A's stay mapped by A alone
    assert memfd_fds(tag) == {}
    assert set(memfd_maps(tag)) == {a.pid} and len(memfd_maps(tag)[a.pid]) == 2
    assert a("check 1 55") == "ok"
    assert a("unmap 1") == "ok 2"  # the put fails quietly: the unmapping freed them
    assert memfd_maps(tag) == {}
    # the next mapping starts a new holder and allocates (nothing was kept)
    assert a(f"map 2 {CHUNK}").startswith("ok handed=0 created=1")
    st = json.loads(a("status"))
    assert st["pid"] != holder_pid and st["lent_bytes"] == CHUNK
    with pytest.raises(HandoverError):
        obs.status()  # the old connection is gone; nothing hangs
    a.end()
    b.end()
    obs.close()
    wait_for("no chunk left anywhere", lambda: memfd_fds(tag) == {} and memfd_maps(tag) == {})


# ---- memory goes back to the driver -----------------------------------------------------------


def test_idle_trim_and_a_last_release_give_memory_back(arena: Path, tag: str, workers: list[Worker]) -> None:
    obs = observer(arena, idle_s=1.0)
    a = Worker(arena, tag)
    workers.append(a)
    a(f"map 1 {3 * CHUNK}")
    a("unmap 1")
    assert obs.trim(CHUNK) == CHUNK  # asked: down to one chunk
    assert len(memfd_fds(tag)[obs.status()["pid"]]) == 1
    wait_for("idle: nothing on hand", lambda: obs.status()["on_hand_bytes"] == 0)
    assert obs.status()["closed"] == {"trim": 2, "idle": 1}
    assert memfd_fds(tag) == {}
    a.end()
    obs.close()


def test_budget_shrink_gives_memory_back(arena: Path, tag: str, workers: list[Worker]) -> None:
    member = Arena(arena)
    _record, budget_fd, _note = member.lease_files.join_budget(
        compute_budget(parse_budget(2 * CHUNK), total=1 << 30, free=1 << 30)
    )
    try:
        obs = observer(arena)
        a = Worker(arena, tag)
        workers.append(a)
        a(f"map 1 {4 * CHUNK}")
        a("unmap 1")  # 4 on hand, the budget leaves room for 2
        wait_for("the budget's limit", lambda: obs.status()["on_hand_bytes"] == 2 * CHUNK)
        assert obs.status()["closed"] == {"budget": 2}
        a.end()
        obs.close()
    finally:
        os.close(budget_fd)
        member.close()


# ---- peers: a stranger's or stale socket is refused -------------------------------------------


def test_a_stale_socket_is_replaced_by_a_new_holder(arena: Path) -> None:
    Arena(arena).close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(arena / SOCKET_FILE))
    stale.close()  # the file stays, nobody listens
    with pytest.raises(HandoverError, match="no hand-over holder lives"):
        HandoverClient(arena, "x", chunk_bytes=CHUNK, start=False).connect()
    client = HandoverClient(arena, "x", chunk_bytes=CHUNK)
    client.connect()
    assert client.started == 1 and client.status()["chunks"] == 0
    client.close()


def test_a_live_socket_that_is_not_the_holder_is_refused(arena: Path) -> None:
    Arena(arena).close()
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    impostor.bind(str(arena / SOCKET_FILE))
    impostor.listen(1)
    try:
        with pytest.raises(PeerRefusedError, match="not the live hand-over holder"):
            HandoverClient(arena, "x", chunk_bytes=CHUNK).connect()
    finally:
        impostor.close()


def test_a_link_or_another_users_socket_is_refused(arena: Path, tmp_path: Path) -> None:
    Arena(arena).close()
    elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    elsewhere.bind(str(tmp_path / "elsewhere.sock"))
    elsewhere.listen(1)
    try:
        os.symlink(tmp_path / "elsewhere.sock", arena / SOCKET_FILE)
        with pytest.raises(PeerRefusedError, match="is not a socket"):
            HandoverClient(arena, "x", chunk_bytes=CHUNK).connect()
        os.unlink(arena / SOCKET_FILE)
        if os.geteuid() != 0:
            return  # only root can make a socket file another user owns
        other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        other.bind(str(arena / SOCKET_FILE))
        os.chown(arena / SOCKET_FILE, 4242, 4242)
        with pytest.raises(PeerRefusedError, match="belongs to uid 4242"):
            HandoverClient(arena, "x", chunk_bytes=CHUNK).connect()
        other.close()
    finally:
        elsewhere.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="another uid's process needs root to make")
def test_a_peer_of_another_uid_is_refused_both_ways(arena: Path) -> None:
    # the worker's side: the process listening behind the socket runs as another uid
    Arena(arena).close()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # bind as root (the arena is root's), then listen as uid 4242
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(str(arena / SOCKET_FILE))
            os.setgid(4242)
            os.setuid(4242)
            s.listen(1)
            os.write(ready_w, b"x")
            time.sleep(WAIT_S)
        finally:
            os._exit(0)
    try:
        os.read(ready_r, 1)
        with pytest.raises(PeerRefusedError, match="runs as uid 4242"):
            HandoverClient(arena, "x", chunk_bytes=CHUNK).connect()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.unlink(arena / SOCKET_FILE)
        os.close(ready_r)
        os.close(ready_w)
    # the holder's side: a connection whose peer runs as another uid is closed unread
    carrier, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # a socket pair made by uid 4242: its credentials are 4242's
        try:
            os.setgid(4242)
            os.setuid(4242)
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            socket.send_fds(inside, [b"x"], [theirs.fileno()])
            mine.send(b'{"op":"hello","v":1}')
            time.sleep(WAIT_S)
        finally:
            os._exit(0)
    try:
        _msg, fds, _f, _a = socket.recv_fds(carrier, 16, 1)
        stranger = socket.socket(fileno=fds[0])
        holder = Holder(arena)
        try:
            assert holder.admit(stranger) is False
            assert stranger.fileno() == -1  # closed, nothing read or sent
        finally:
            holder.shutdown()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        holder = Holder(arena)
        try:
            assert holder.admit(theirs) is True  # the same uid is served
        finally:
            holder.shutdown()
            mine.close()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        carrier.close()
        inside.close()
