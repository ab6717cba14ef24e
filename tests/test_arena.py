"""The VRAM arena with real processes: real flock, real inotify (and the polling backend), real
kill -9. No llama here: the clients are tests/_arena_util.py processes and this test process."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _proc_util import blocked_flocks, wait_until
from timeshare.core.arena.arena import Arena, check_arena_dir
from timeshare.core.arena.client import TokenClient
from timeshare.core.arena.dirs import read_holder, resolve_arena_dir
from timeshare.core.arena.records import DoorbellRing, Ticket, TokenGrant
from timeshare.core.arena.watch import inotify_available
from timeshare.core.errors import ArenaError, CancelledError, TokenTimeoutError, UnsafeArenaError
from timeshare.core.observe import EventLog, read_events

BACKENDS = ["inotify", "poll"] if inotify_available() else ["poll"]
ROOT = Path(__file__).resolve().parent.parent
DRIVER = str(Path(__file__).resolve().parent / "_arena_util.py")


class Proc:
    """A driver process with a line reader."""

    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, DRIVER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.strip())

    def wait_line(self, prefix: str, timeout: float = 30.0) -> str:
        def seen() -> bool:
            return any(line.startswith(prefix) for line in self.lines) or self.popen.poll() is not None

        wait_until(seen, timeout, f"{prefix!r} from {self.popen.args}")
        if self.popen.poll() is not None:
            # it exited: its last lines may still be on their way to the reader thread (until EOF)
            self._reader.join(timeout)
        for line in self.lines:
            if line.startswith(prefix):
                return line
        err = self.popen.stderr.read() if self.popen.stderr else ""
        raise AssertionError(f"process exited ({self.popen.returncode}) before {prefix!r}: {err}")

    def finish(self, timeout: float = 60.0) -> int:
        if self.popen.stdin and not self.popen.stdin.closed:
            self.popen.stdin.close()
        rc = self.popen.wait(timeout)
        self._reader.join(5)
        if rc != 0:
            err = self.popen.stderr.read() if self.popen.stderr else ""
            raise AssertionError(f"{self.popen.args} exited {rc}: {err}")
        return rc

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def cleanup(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None and not stream.closed:
                stream.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.cleanup()


@pytest.fixture
def arena_dir(tmp_path: Path) -> Path:
    return tmp_path / "arena"


def spawn(procs: list[Proc], *args: str) -> Proc:
    p = Proc(*args)
    procs.append(p)
    return p


def lease_file(arena_dir: Path) -> Path:
    """The one lease in the arena (its holder keeps it flock-ed: a waiter blocks on it)."""
    files = [p for p in (arena_dir / "leases").iterdir() if not p.name.startswith(".")]
    assert len(files) == 1, files
    return files[0]


def overlaps(intervals: list[tuple[float, float, int]]) -> list[tuple[tuple[float, float, int], ...]]:
    ordered = sorted(intervals)
    return [(a, b) for a, b in itertools.pairwise(ordered) if b[0] < a[1] and a[2] != b[2]]


# ---- mutual exclusion, FIFO -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_mutual_exclusion_under_contention(
    procs: list[Proc], arena_dir: Path, tmp_path: Path, backend: str
) -> None:
    log = tmp_path / "intervals.jsonl"
    n_procs, rounds = 4, 12
    for i in range(n_procs):
        spawn(procs, "contend", str(arena_dir), backend, f"m{i}", str(log), str(rounds))
    for p in procs:
        p.finish()
    records = [r for r in read_events(log) if r["kind"] == "token"]
    assert len(records) == n_procs * rounds
    assert {r["model"] for r in records} == {f"m{i}" for i in range(n_procs)}
    assert overlaps([(r["start"], r["end"], r["pid"]) for r in records]) == []
    assert any(r["handoff"] for r in records)  # they really contended
    # every ticket went away once served
    assert os.listdir(arena_dir / "waiters") == []
    assert read_holder(arena_dir) is None


def test_overlap_detector_can_fail() -> None:
    assert overlaps([(0.0, 1.0, 1), (0.5, 2.0, 2)]) != []
    assert overlaps([(0.0, 1.0, 1), (1.0, 2.0, 2)]) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_waiters_are_served_in_ticket_order(
    procs: list[Proc], arena_dir: Path, tmp_path: Path, backend: str
) -> None:
    log = tmp_path / "order.jsonl"
    arena = Arena(arena_dir, backend=backend)  # type: ignore[arg-type]
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=10)
    names = ["first", "second", "third", "fourth"]
    for i, name in enumerate(names):
        spawn(procs, "once", str(arena_dir), backend, name, str(log))
        wait_until(lambda i=i: len(arena.waiters()) == i + 1, what=f"ticket of {name}")  # type: ignore[misc]
    assert [t.model for t in arena.waiters()] == names
    holder.release()
    for p in procs:
        p.finish()
    served = sorted(read_events(log), key=lambda r: r["start"])
    assert [r["model"] for r in served] == names
    arena.close()


# ---- holder record, waiting reason, pinned timeout ---------------------------------------------


def test_holder_record_is_visible_and_pinned_holder_times_out_with_a_clear_error(
    procs: list[Proc], arena_dir: Path
) -> None:
    holder = spawn(procs, "hold", str(arena_dir), "auto", "gemma3-270m", "pinned")
    holder.wait_line("HELD")
    record = read_holder(arena_dir)
    assert record is not None
    assert (record.model, record.pid, record.pinned) == ("gemma3-270m", holder.popen.pid, True)
    client = TokenClient(Arena(arena_dir), "smollm2-135m-instruct")
    # the waiting reason, on a request that cannot time out while it is read
    patient = client.request(timeout=None)
    wait_until(lambda: blocked_flocks(lease_file(arena_dir)) == 1, what="our request blocked in flock")
    assert patient.waiting_reason() == "pinned by gemma3-270m"
    assert patient.cancel() is True
    with pytest.raises(CancelledError):
        patient.result(timeout=10)
    # the timeout, on a request that can
    req = client.request(timeout=1.0)
    with pytest.raises(TokenTimeoutError) as info:
        req.result(timeout=30)
    message = str(info.value)
    assert "gemma3-270m holds the GPU and is pinned" in message
    assert "unpin it or raise arena.wait_timeout_s" in message
    assert info.value.code == "gpu_busy"
    # the timed-out request left the queue, and the holder is untouched
    assert Arena(arena_dir).waiters() == []
    assert not client.holds_token
    holder.finish()
    assert "RELEASED" in holder.lines
    assert read_holder(arena_dir) is None
    client.close()


def test_set_pinned_updates_the_record(arena_dir: Path) -> None:
    client = TokenClient(Arena(arena_dir), "a")
    grant = client.acquire(timeout=5)
    assert grant.handoff is False and grant.previous is None
    record = read_holder(arena_dir)
    assert record is not None and not record.pinned and record.pid == os.getpid()
    client.set_pinned(True)
    record = read_holder(arena_dir)
    assert record is not None and record.pinned and record.describe() == "pinned by a"
    client.close()
    assert read_holder(arena_dir) is None


def test_request_while_holding_is_granted_at_once(arena_dir: Path) -> None:
    client = TokenClient(Arena(arena_dir), "a")
    first = client.acquire(timeout=5)
    again = client.request()
    assert again.done() and again.result() == first
    client.close()


def test_garbage_holder_record_and_counter_are_survived(arena_dir: Path) -> None:
    arena = Arena(arena_dir)
    (arena_dir / "holder").write_text("{not json")
    (arena_dir / "seq").write_text("garbage")
    assert read_holder(arena_dir) is None
    client = TokenClient(arena, "a")
    client.acquire(timeout=5)
    assert read_holder(arena_dir) is not None
    client.close()
    assert (arena_dir / "seq").read_text().strip() == "1"


def test_holder_record_of_a_dead_process_is_ignored(procs: list[Proc], arena_dir: Path) -> None:
    holder = spawn(procs, "hold", str(arena_dir), "auto", "ghost")
    holder.wait_line("HELD")
    assert read_holder(arena_dir) is not None
    holder.kill9()
    assert (arena_dir / "holder").exists()  # left behind by the dead process...
    assert read_holder(arena_dir) is None  # ...and not believed


# ---- crashes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill9_of_the_holder_lets_the_waiter_take_the_token(
    procs: list[Proc], arena_dir: Path, backend: str
) -> None:
    holder = spawn(procs, "hold", str(arena_dir), backend, "victim")
    holder.wait_line("HELD")
    client = TokenClient(Arena(arena_dir, backend=backend), "survivor")  # type: ignore[arg-type]
    req = client.request(timeout=60)
    # really blocked behind the holder: inside flock(2), queued by the kernel
    wait_until(lambda: blocked_flocks(lease_file(arena_dir)) == 1, what="our request blocked in flock")
    assert not req.done()
    assert req.waiting_reason().startswith("held by victim")
    holder.kill9()
    grant = req.result(timeout=30)
    assert grant.handoff and grant.previous == "victim"
    assert client.holds_token
    record = read_holder(arena_dir)
    assert record is not None and record.model == "survivor"
    client.close()


# ---- the release time, carried with the token ---------------------------------------------------


def _handed_over(
    procs: list[Proc], arena_dir: Path, backend: str, first: str, second: str, *holder_args: str
) -> tuple[TokenClient, TokenGrant]:
    """``first`` (another process, ``holder_args`` for its release) holds the token; ``second``
    (a client here) asks for it and waits inside flock(2); the holder releases: the client and
    its grant."""
    holder = spawn(procs, "hold", str(arena_dir), backend, first, *holder_args)
    holder.wait_line("HELD")
    client = TokenClient(Arena(arena_dir, backend=backend), second)  # type: ignore[arg-type]
    req = client.request(timeout=60)
    wait_until(lambda: blocked_flocks(lease_file(arena_dir)) == 1, what="our request blocked in flock")
    holder.finish()  # it releases (saying how long its release took, if told to) and lets go
    return client, req.result(timeout=30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grant_carries_the_release_time_of_the_holder_it_followed(
    procs: list[Proc], arena_dir: Path, backend: str
) -> None:
    client, grant = _handed_over(procs, arena_dir, backend, "first", "second", "release_ms=12.25")
    assert grant.handoff and grant.previous == "first"
    assert grant.previous_release_ms == 12.25  # the other process's own figure, through the arena
    assert not (arena_dir / "released").exists()  # taken by this grant: one release is credited once
    client.release(release_ms=3.5)
    assert (arena_dir / "released").exists()
    # a release that came before the request was no part of its wait
    later = TokenClient(Arena(arena_dir, backend=backend), "third")  # type: ignore[arg-type]
    assert later.acquire(timeout=5).previous_release_ms == 0.0
    later.close()
    client.close()


def test_a_grant_with_no_previous_holder_says_no_release(procs: list[Proc], arena_dir: Path) -> None:
    client = TokenClient(Arena(arena_dir), "alone")
    grant = client.acquire(timeout=5)
    assert grant.previous is None and grant.previous_release_ms == 0.0
    client.close()  # a close says no release time: nothing for the next grant
    assert not (arena_dir / "released").exists()
    # a holder that says nothing (an older version): 0, never an error
    waiter, grant = _handed_over(procs, arena_dir, "auto", "older", "newer")
    assert grant.previous == "older" and grant.previous_release_ms == 0.0
    waiter.close()
    # a record that is not one, found by a grant: 0 and taken away. Each is dated after any
    # request and names another pid, so only its own flaw keeps it from being credited: the same
    # record made sane (last) is
    future = time.monotonic() + 3600
    sane = {"model": "x", "pid": 1, "release_ms": 4.0, "at": future}
    for bad in (
        "{not json",
        "[1, 2]",
        json.dumps({**sane, "release_ms": -4}),
        json.dumps({**sane, "release_ms": float("nan")}),
        json.dumps({**sane, "pid": True}),
        json.dumps({**sane, "model": "a b"}),
        json.dumps({k: v for k, v in sane.items() if k != "at"}),
    ):
        (arena_dir / "released").write_text(bad)
        reader = TokenClient(Arena(arena_dir), "reader")
        assert reader.acquire(timeout=5).previous_release_ms == 0.0, bad
        assert not (arena_dir / "released").exists(), bad
        reader.close()
    (arena_dir / "released").write_text(json.dumps(sane))
    reader = TokenClient(Arena(arena_dir), "reader")
    assert reader.acquire(timeout=5).previous_release_ms == 4.0
    reader.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grant_after_a_crashed_holder_says_no_release(
    procs: list[Proc], arena_dir: Path, backend: str
) -> None:
    first = spawn(procs, "hold", str(arena_dir), backend, "first", "release_ms=7")
    first.wait_line("HELD")
    victim = spawn(procs, "hold", str(arena_dir), backend, "victim", "release_ms=9")
    arena = Arena(arena_dir, backend=backend)  # type: ignore[arg-type]
    wait_until(lambda: [t.model for t in arena.waiters()] == ["victim"], what="the victim queued")
    client = TokenClient(arena, "survivor")
    req = client.request(timeout=60)  # behind the victim, before first's release
    wait_until(lambda: len(arena.waiters()) == 2, what="our request queued")
    first.finish()  # releases (7 ms): the victim's grant takes that
    victim.wait_line("HELD")
    victim.kill9()  # it wrote no release: the survivor's grant says none, not first's 7 ms
    grant = req.result(timeout=30)
    assert grant.handoff and grant.previous_release_ms == 0.0
    client.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_waiter_file_is_swept_and_the_queue_moves_on(
    procs: list[Proc], arena_dir: Path, tmp_path: Path, backend: str
) -> None:
    arena = Arena(arena_dir, backend=backend)  # type: ignore[arg-type]
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=10)
    log = tmp_path / "order.jsonl"
    doomed = spawn(procs, "once", str(arena_dir), backend, "doomed", str(log))
    line = doomed.wait_line("TICKET")
    ticket_name = line.split()[1]
    after = spawn(procs, "once", str(arena_dir), backend, "after", str(log))
    wait_until(lambda: len(arena.waiters()) == 2, what="two tickets")
    doomed.kill9()
    # its file stays (a dead process removes nothing); anyone scanning sweeps it: here the
    # waiter behind it does, within its rescan interval
    wait_until(lambda: not (arena_dir / "waiters" / ticket_name).exists(), what="stale ticket swept")
    assert [t.model for t in arena.waiters()] == ["after"]
    holder.release()
    after.finish()
    assert [r["model"] for r in read_events(log)] == ["after"]
    arena.close()


def test_sweep_removes_dead_tickets_and_keeps_live_ones(procs: list[Proc], arena_dir: Path) -> None:
    arena = Arena(arena_dir)
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=10)
    waiter = spawn(procs, "hold", str(arena_dir), "auto", "live")
    wait_until(lambda: len(os.listdir(arena_dir / "waiters")) == 1, what="live ticket")
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid belongs to nobody now
    dead_pid = child.pid
    dead = Ticket(999999, dead_pid, "dead")  # a file nobody holds a lock on
    (arena_dir / "waiters" / dead.name).write_text("{}")
    leftovers = [f".{Ticket(1000000, dead_pid, 'dead').name}.tmp", f".holder.{dead_pid}.1.tmp"]
    for name in leftovers:  # what a process killed while writing leaves behind
        (arena_dir / name).write_text("{}")
    (arena_dir / f".holder.{os.getpid()}.1.tmp").write_text("{}")  # a live writer's: kept
    assert sorted(arena.sweep()) == sorted([dead.name, *leftovers])
    assert (arena_dir / f".holder.{os.getpid()}.1.tmp").exists()
    assert [t.model for t in arena.waiters()] == ["live"]
    holder.release()
    waiter.wait_line("HELD")
    waiter.finish()
    arena.close()


# ---- doorbell ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_doorbell_rings_for_a_waiter_that_came_before_the_watch(
    procs: list[Proc], arena_dir: Path, tmp_path: Path, backend: str
) -> None:
    arena = Arena(arena_dir, backend=backend)  # type: ignore[arg-type]
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=10)
    waiter = spawn(procs, "once", str(arena_dir), backend, "early", str(tmp_path / "log.jsonl"))
    waiter.wait_line("TICKET")
    rings: list[DoorbellRing] = []
    holder.start_doorbell(rings.append)  # the waiter's file is older than the watch
    wait_until(lambda: len(rings) >= 1, what="doorbell for an earlier waiter")
    assert [t.model for t in rings[0].waiters] == ["early"]
    # a later waiter rings again (inotify IN_MOVED_TO, or the poll)
    second = spawn(procs, "once", str(arena_dir), backend, "late", str(tmp_path / "log.jsonl"))
    wait_until(
        lambda: any(t.model == "late" for r in rings for t in r.waiters), what="doorbell for a new waiter"
    )
    n_rings = len(rings)
    holder.release()
    waiter.finish()
    second.finish()
    holder.close()
    assert len(rings) == n_rings  # no ring while not holding
    arena.close()


def test_doorbell_keeps_ringing_while_someone_waits(
    procs: list[Proc], arena_dir: Path, tmp_path: Path
) -> None:
    """Level-triggered: a holder that dropped a ring (pinned, or busy restoring) hears it again."""
    arena = Arena(arena_dir)
    holder = TokenClient(arena, "holder", pinned=True)
    holder.acquire(timeout=10)
    rings: list[DoorbellRing] = []
    holder.start_doorbell(rings.append)
    waiter = spawn(procs, "once", str(arena_dir), "auto", "w", str(tmp_path / "log.jsonl"))
    wait_until(lambda: len(rings) >= 3, what="repeated rings")
    assert all([t.model for t in r.waiters] == ["w"] for r in rings)
    holder.set_pinned(False)
    n = len(rings)
    wait_until(lambda: len(rings) > n, what="ring after unpinning")
    holder.release()
    waiter.finish()
    holder.close()
    arena.close()


def test_own_ticket_does_not_ring_own_doorbell(arena_dir: Path) -> None:
    arena = Arena(arena_dir)
    a = TokenClient(arena, "a")
    rings: list[DoorbellRing] = []
    a.start_doorbell(rings.append)
    a.acquire(timeout=5)
    b = TokenClient(arena, "b")  # another client in this process is another waiter
    req = b.request(timeout=30)
    wait_until(lambda: len(rings) >= 1, what="ring for b")
    assert [t.model for t in rings[0].waiters] == ["b"]
    assert a.others_waiting() == rings[0].waiters
    a.release()
    req.result(timeout=10)
    b.close()
    a.close()


# ---- fairness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_busy_clients_both_make_progress(
    procs: list[Proc], arena_dir: Path, tmp_path: Path, backend: str
) -> None:
    log = tmp_path / "busy.jsonl"
    n = 6
    a = spawn(procs, "busy", str(arena_dir), backend, "a", str(log), str(n), "50")
    b = spawn(procs, "busy", str(arena_dir), backend, "b", str(log), str(n), "50")
    a.finish()
    b.finish()
    # both got every turn they asked for (each acquire has a 60 s timeout: starving fails it)
    assert {int(p.wait_line("TURNS").split()[1]) for p in (a, b)} == {n}
    records = sorted((r for r in read_events(log) if r["kind"] == "token"), key=lambda r: r["start"])
    assert len(records) == 2 * n
    assert overlaps([(r["start"], r["end"], r["pid"]) for r in records]) == []
    # while both wanted the GPU (from the later one's first turn to the earlier one's last), a
    # holder kept it only until the other asked: the turns strictly alternate (no clock involved)
    models = [r["model"] for r in records]
    first = max(models.index("a"), models.index("b"))
    last = min(len(models) - 1 - models[::-1].index(m) for m in ("a", "b"))
    both = models[first : last + 1]
    assert len(both) >= n, models
    assert all(x != y for x, y in itertools.pairwise(both)), models


# ---- cancel -------------------------------------------------------------------------------------


def test_cancel_leaves_the_queue_and_the_next_waiter_proceeds(arena_dir: Path) -> None:
    arena = Arena(arena_dir)
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=5)
    first, second = TokenClient(arena, "first"), TokenClient(arena, "second")
    r1 = first.request(timeout=30)
    wait_until(lambda: r1.ticket is not None, what="first ticket")
    r2 = second.request(timeout=30)
    wait_until(lambda: len(arena.waiters()) == 2, what="two tickets")
    assert r1.cancel() is True
    with pytest.raises(CancelledError):
        r1.result(timeout=10)
    assert [t.model for t in arena.waiters()] == ["second"]
    holder.release()
    assert r2.result(timeout=10).previous == "holder"
    assert not first.holds_token and second.holds_token
    assert r2.cancel() is False  # already granted: stays granted
    second.close()
    first.close()
    holder.close()


class GatedClient(TokenClient):
    """A client whose requests' threads stop, as they end, at ``gate`` (``ticket_gone`` is called
    on the request's thread): a cancelled request stays pending until the gate opens."""

    def __init__(self, arena: Arena, model: str) -> None:
        super().__init__(arena, model)
        self.gate = threading.Event()

    def ticket_gone(self, ticket: Ticket) -> None:
        self.gate.wait(30)
        super().ticket_gone(ticket)


def test_a_request_after_a_cancel_is_a_new_one(arena_dir: Path) -> None:
    """A request made while the client's cancelled request is still pending (its thread has not
    ended yet) is a new request that waits and is granted: not the cancelled one, whose result is
    a CancelledError (a worker's Embed sent after a cancelled waiting Embed was answered
    "cancelled", though nobody had cancelled it)."""
    arena = Arena(arena_dir)
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=5)
    client = GatedClient(arena, "client")
    r1 = client.request(timeout=30)
    wait_until(lambda: r1.ticket is not None, what="its ticket")
    assert r1.cancel() is True and r1.cancelled
    opener = threading.Timer(0.3, client.gate.set)  # the new request waits for the old one to end
    opener.start()
    r2 = client.request(timeout=30)
    assert r2 is not r1 and not r2.cancelled
    with pytest.raises(CancelledError):
        r1.result(timeout=10)
    wait_until(lambda: [t.model for t in arena.waiters()] == ["client"], what="the new request's ticket")
    holder.release()
    assert r2.result(timeout=10).previous == "holder"
    assert client.holds_token
    opener.join()
    client.close()
    holder.close()


def test_cancel_of_the_head_waiter_blocked_in_flock(arena_dir: Path) -> None:
    arena = Arena(arena_dir)
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=5)
    head = TokenClient(arena, "head")
    req = head.request(timeout=30)
    token = arena_dir.parent / "lease-link"
    os.link(lease_file(arena_dir), token)  # the lease file goes at release: its inode stays seen here
    # the kernel queued its flock behind the holder's: it is inside the blocking flock(2), the path
    # where cancel cannot interrupt the call and has to abandon the locker thread
    wait_until(lambda: blocked_flocks(token) == 1, what="the head waiter blocked in flock")
    assert not req.done()
    assert req.cancel() is True
    with pytest.raises(CancelledError):
        req.result(timeout=10)
    assert arena.waiters() == []  # its ticket left the queue
    assert blocked_flocks(token) == 1  # the abandoned locker still waits in the kernel...
    holder.release()
    # ...gets the lock once the holder lets go, and gives it back at once: nobody holds it
    wait_until(lambda: blocked_flocks(token) == 0, what="the abandoned flock to be granted")
    other = TokenClient(arena, "other")
    grant = other.acquire(timeout=10)
    assert grant.previous is None  # no holder record was left behind by the abandoned request
    assert not head.holds_token
    other.close()
    head.close()
    holder.close()


# ---- interval log --------------------------------------------------------------------------------


def test_event_log_records_token_intervals(arena_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "i.jsonl"
    client = TokenClient(Arena(arena_dir), "a", observer=EventLog(log, "a"))
    grant = client.acquire(timeout=5)
    end = client.release()
    EventLog(log, "a").record("resident", grant.acquired_at + 0.001, grant.acquired_at + 0.002)
    (log.open("a")).close()
    with log.open("a") as f:
        f.write('{"torn": ')  # a killed writer's last line
    records = read_events(log)
    assert [r["kind"] for r in records] == ["acquired", "token", "resident"]
    # the start is written as the token is taken (a holder killed later leaves it behind)
    assert records[0]["start"] == records[0]["end"] == grant.acquired_at
    assert records[1]["start"] == grant.acquired_at and records[1]["end"] == end
    assert records[1]["pid"] == os.getpid() and records[1]["model"] == "a"


# ---- unsafe arena directories --------------------------------------------------------------------


def test_new_arena_is_private(arena_dir: Path) -> None:
    Arena(arena_dir).close()
    assert (arena_dir.stat().st_mode & 0o777) == 0o700
    assert ((arena_dir / "waiters").stat().st_mode & 0o777) == 0o700


def test_symlinked_arena_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeArenaError) as info:
        Arena(link)
    assert str(link) in str(info.value) and "symbolic link" in str(info.value)


def test_arena_reached_through_a_symlinked_parent_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    if os.geteuid() == 0:  # root's own links are trusted as system links; make it someone else's
        os.lchown(link, 12345, 12345)
    else:
        pytest.skip("needs root to give the link another owner")  # pragma: no cover
    with pytest.raises(UnsafeArenaError) as info:
        Arena(link / "arena")
    assert f"reached through the symbolic link {link}" in str(info.value)


def test_world_writable_arena_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(UnsafeArenaError) as info:
        Arena(d)
    assert str(d) in str(info.value) and "group- or world-writable (mode 0777)" in str(info.value)
    assert d.stat().st_mode & 0o777 == 0o777  # nothing was changed


def test_group_writable_waiters_dir_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "arena"
    Arena(d).close()
    (d / "waiters").chmod(0o770)
    with pytest.raises(UnsafeArenaError) as info:
        Arena(d)
    assert str(d / "waiters") in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_arena_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(UnsafeArenaError) as info:
        Arena(d)
    assert "owned by uid 12345, not by you" in str(info.value) and str(d) in str(info.value)


def test_a_file_is_not_an_arena(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ArenaError) as info:
        check_arena_dir(f)
    assert "not a directory" in str(info.value)
    assert f.read_text() == "x"


def test_arena_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = Path(os.environ["TIMESHARE_HOME"])
    assert resolve_arena_dir() == home / "run" / "arena"
    assert resolve_arena_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"
    monkeypatch.setenv("TIMESHARE_VRAM_ARENA", str(tmp_path / "env"))
    assert resolve_arena_dir(str(tmp_path / "cfg")) == tmp_path / "env"


def test_bad_model_id_is_refused(arena_dir: Path) -> None:
    with pytest.raises(ArenaError, match="cannot name an arena ticket"):
        TokenClient(Arena(arena_dir), "a/b")
    assert Ticket.parse("000000000012-345-smollm2-135m-instruct#2") == Ticket(
        12, 345, "smollm2-135m-instruct#2"
    )
    assert Ticket.parse("junk") is None


def test_arena_inside_a_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename our arena away and put theirs in its place
    with pytest.raises(UnsafeArenaError) as info:
        Arena(shared / "arena")
    assert f"it is inside {shared}, which others may write (mode 0777" in str(info.value)
    assert not (shared / "arena").exists()
    shared.chmod(0o1777)  # sticky, like /tmp: others cannot rename what is ours
    Arena(shared / "arena").close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_arena_inside_someone_elses_folder_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UnsafeArenaError) as info:
        Arena(theirs / "arena")
    assert f"it is inside {theirs}, which belongs to uid 12345" in str(info.value)
