"""Hostile or broken arena entries: what a crash, a bug or a person can leave in an arena directory.

Each case either keeps switching working (the entry is validated and removed when nothing can own
it, or ignored) or fails with an ArenaError that names the path and says what to do. Real flock,
real processes; no llama here."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
from _proc_util import wait_until
from timeshare.core.arena.arena import Arena, check_arena_dir
from timeshare.core.arena.client import TokenClient
from timeshare.core.arena.dirs import read_holder
from timeshare.core.arena.records import SWEEP_INTERVAL_S, Ticket
from timeshare.core.errors import ArenaError

TIMEOUT = 60.0  # generous: the machine may be loaded; nothing here is timed


@pytest.fixture
def arena_dir(tmp_path: Path) -> Path:
    path = tmp_path / "arena"
    check_arena_dir(path)
    return path


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid belongs to nobody now
    return child.pid


def handoff_works(arena_dir: Path) -> None:
    """A holder and a waiter in this process: the waiter is seen by the holder's doorbell scan,
    gets the token once the holder lets go, and the holder record names it."""
    arena = Arena(arena_dir)
    first = TokenClient(arena, "first")
    second = TokenClient(Arena(arena_dir), "second")
    try:
        first.acquire(timeout=TIMEOUT)
        req = second.request(timeout=TIMEOUT)
        wait_until(
            lambda: [t.model for t in first.others_waiting()] == ["second"], TIMEOUT, "the waiter's ticket"
        )
        first.release()
        grant = req.result(timeout=TIMEOUT)
        assert grant.model == "second"
        record = read_holder(arena_dir)
        assert record is not None and record.model == "second" and record.pid == os.getpid()
    finally:
        second.close()
        first.close()
        arena.close()


# ---- waiters/ ---------------------------------------------------------------------------------


def test_symlink_with_a_ticket_name_is_removed_and_its_target_kept(arena_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    link = arena_dir / "waiters" / Ticket(1, os.getpid(), "ghost").name
    link.symlink_to(target)  # ahead of everyone in the queue, and never lockable through the arena
    client = TokenClient(Arena(arena_dir), "a")
    client.acquire(timeout=TIMEOUT)  # not stuck behind the link
    assert not os.path.lexists(link)
    assert target.read_text() == "precious"
    client.close()
    handoff_works(arena_dir)


def test_dangling_symlink_in_waiters_is_removed(arena_dir: Path) -> None:
    link = arena_dir / "waiters" / Ticket(1, 1, "ghost").name
    link.symlink_to("/nonexistent/nowhere")
    assert Arena(arena_dir).waiters() == []
    assert not os.path.lexists(link)


def test_empty_directory_with_a_ticket_name_is_removed(arena_dir: Path) -> None:
    folder = arena_dir / "waiters" / Ticket(1, os.getpid(), "ghost").name
    folder.mkdir()
    handoff_works(arena_dir)
    assert not folder.exists()


def test_directory_with_files_in_waiters_is_ignored_and_reported(
    arena_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = arena_dir / "waiters" / Ticket(1, os.getpid(), "ghost").name
    folder.mkdir()
    (folder / "something").write_text("x")
    with caplog.at_level(logging.WARNING, logger="timeshare.core.arena"):
        handoff_works(arena_dir)
    assert folder.is_dir()  # not ours to delete recursively...
    assert any(
        str(folder) in r.getMessage() and "remove it by hand" in r.getMessage() for r in caplog.records
    )


def test_fifo_in_waiters_is_removed_without_blocking(arena_dir: Path) -> None:
    fifo = arena_dir / "waiters" / Ticket(1, os.getpid(), "ghost").name
    os.mkfifo(fifo)
    handoff_works(arena_dir)
    assert not os.path.lexists(fifo)


def test_unlocked_files_that_are_not_tickets_are_swept(arena_dir: Path) -> None:
    waiters = arena_dir / "waiters"
    for name in ("notes.txt", "99999999999999999999-1-m", "000000000001-0-m", "000000000001-7-bad name"):
        (waiters / name).write_text("")
    arena = Arena(arena_dir)
    assert arena.waiters() == []
    assert os.listdir(waiters) == []
    arena.close()


# ---- the ticket counter -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    ["-5", "99999999999999999999", "garbage", "1e9", "", "999999999999", "12 34", "\x00\xff"],
    ids=["negative", "20-digit", "garbage", "float", "empty", "at-max", "two-numbers", "binary"],
)
def test_bad_counter_keeps_tickets_visible_and_in_order(arena_dir: Path, content: str) -> None:
    (arena_dir / "seq").write_bytes(content.encode("latin-1"))
    handoff_works(arena_dir)
    value = (arena_dir / "seq").read_text().strip()
    assert value.isdigit() and 0 < int(value) < 10**12 - 1


def test_counter_never_falls_behind_the_queue(arena_dir: Path) -> None:
    arena = Arena(arena_dir)
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=TIMEOUT)
    early = TokenClient(Arena(arena_dir), "early")
    early_req = early.request(timeout=TIMEOUT)
    wait_until(lambda: early_req.ticket is not None, TIMEOUT, "the first waiter's ticket")
    (arena_dir / "seq").write_text("-5")  # reset behind the queue
    late = TokenClient(Arena(arena_dir), "late")
    late_req = late.request(timeout=TIMEOUT)
    wait_until(lambda: late_req.ticket is not None, TIMEOUT, "the second waiter's ticket")
    assert early_req.ticket is not None and late_req.ticket is not None
    assert late_req.ticket.seq > early_req.ticket.seq  # no jumping the queue
    holder.release()
    assert early_req.result(timeout=TIMEOUT).model == "early"
    early.release()
    assert late_req.result(timeout=TIMEOUT).model == "late"
    for c in (late, early, holder):
        c.close()


def test_symlinked_counter_is_replaced(arena_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "counter-elsewhere"
    target.write_text("41")
    (arena_dir / "seq").symlink_to(target)
    handoff_works(arena_dir)
    assert not (arena_dir / "seq").is_symlink()
    assert target.read_text() == "41"


def test_counter_that_is_a_full_directory_is_an_error_naming_it(arena_dir: Path) -> None:
    (arena_dir / "seq").mkdir()
    (arena_dir / "seq" / "x").write_text("")
    client = TokenClient(Arena(arena_dir), "a")
    with pytest.raises(ArenaError) as info:
        client.acquire(timeout=TIMEOUT)
    assert str(arena_dir / "seq") in str(info.value) and "remove it" in str(info.value)
    client.close()


def test_leftover_with_the_next_ticket_name_is_skipped(arena_dir: Path) -> None:
    (arena_dir / "seq").write_text("5")
    mine = Ticket(6, os.getpid(), "a")
    (arena_dir / f".{mine.name}.tmp").write_text("")  # a live pid's (ours): not swept
    (arena_dir / "waiters" / Ticket(7, os.getpid(), "a").name).mkdir()  # and a folder on the next
    (arena_dir / "waiters" / Ticket(7, os.getpid(), "a").name / "x").write_text("")
    client = TokenClient(Arena(arena_dir), "a")
    req = client.request(timeout=TIMEOUT)
    req.result(timeout=TIMEOUT)
    assert req.ticket is not None and req.ticket.seq == 8
    client.close()


# ---- leftovers of dead processes ----------------------------------------------------------------


def test_tmp_leftovers_of_dead_processes_are_swept_when_an_arena_opens(arena_dir: Path) -> None:
    pid = dead_pid()
    leftovers = [f".{Ticket(3, pid, 'dead').name}.tmp", f".holder.{pid}.1.tmp", f".released.{pid}.1.tmp"]
    for name in leftovers:
        (arena_dir / name).write_text("{}")
    (arena_dir / f".holder.{pid}.2.tmp").mkdir()  # even as an (empty) folder
    (arena_dir / f".holder.{os.getpid()}.1.tmp").write_text("{}")  # a live writer's: kept
    (arena_dir / f".released.{os.getpid()}.1.tmp").write_text("{}")
    (arena_dir / ".unknown.tmp").write_text("")  # not ours to judge: kept
    Arena(arena_dir).close()
    left = sorted(n for n in os.listdir(arena_dir) if n.endswith(".tmp"))
    assert left == sorted([f".holder.{os.getpid()}.1.tmp", f".released.{os.getpid()}.1.tmp", ".unknown.tmp"])


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir"])
def test_a_release_record_that_is_not_a_file_reads_as_none_and_goes(arena_dir: Path, kind: str) -> None:
    arena = Arena(arena_dir)
    target = arena_dir.parent / "elsewhere"
    target.write_text('{"model": "x", "pid": 1, "release_ms": 5.0, "at": 1e12}')
    released = arena_dir / "released"
    if kind == "symlink":
        released.symlink_to(target)  # never followed
    elif kind == "fifo":
        os.mkfifo(released)  # never opened for a writer (no block)
    else:
        released.mkdir()
    holder = TokenClient(arena, "holder")
    holder.acquire(timeout=TIMEOUT)
    waiter = TokenClient(Arena(arena_dir), "waiter")
    req = waiter.request(timeout=TIMEOUT)
    wait_until(lambda: req.ticket is not None, TIMEOUT, "the waiter's ticket")
    holder.release()  # says nothing: what the odd entry claims is not believed either
    assert req.result(timeout=TIMEOUT).previous_release_ms == 0.0
    assert not os.path.lexists(released) and target.exists()  # the entry went, not what it named
    waiter.close()
    holder.close()


def test_a_waiter_sweeps_leftovers_while_it_waits(arena_dir: Path) -> None:
    holder = TokenClient(Arena(arena_dir), "holder")
    holder.acquire(timeout=TIMEOUT)
    waiter = TokenClient(Arena(arena_dir), "waiter")
    req = waiter.request(timeout=TIMEOUT + 10 * SWEEP_INTERVAL_S)
    wait_until(lambda: req.ticket is not None, TIMEOUT, "the waiter's ticket")
    leftover = arena_dir / f".holder.{dead_pid()}.1.tmp"
    leftover.write_text("{}")  # appears while the waiter waits
    wait_until(lambda: not leftover.exists(), TIMEOUT + 10 * SWEEP_INTERVAL_S, "the waiter's periodic sweep")
    assert not req.done()
    holder.release()
    assert req.result(timeout=TIMEOUT).model == "waiter"
    waiter.close()
    holder.close()


# ---- the holder record --------------------------------------------------------------------------


def _record(pid: int, model: str = "ghost") -> str:
    return json.dumps({"model": model, "pid": pid, "since": time.time(), "since_monotonic": time.monotonic()})


def test_symlinked_holder_record_is_not_believed_and_is_replaced(arena_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "record-elsewhere"
    original = _record(os.getpid())  # a live pid: it would be believed if followed
    target.write_text(original)
    (arena_dir / "holder").symlink_to(target)
    assert read_holder(arena_dir) is None
    handoff_works(arena_dir)
    assert target.read_text() == original
    assert not (arena_dir / "holder").is_symlink()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"model": "a", "pid": 99999999999, "since": 0, "since_monotonic": 0}',
        '{"model": "a", "pid": -1, "since": 0, "since_monotonic": 0}',
        '{"model": "a", "pid": true, "since": 0, "since_monotonic": 0}',
        '{"model": "a/b", "pid": 1, "since": 0, "since_monotonic": 0}',
        '{"model": "a", "pid": 1, "since": NaN, "since_monotonic": 0}',
    ],
    ids=["not-json", "not-object", "huge-pid", "negative-pid", "bool-pid", "bad-model", "nan"],
)
def test_garbage_holder_record_is_ignored_and_swept(arena_dir: Path, content: str) -> None:
    (arena_dir / "holder").write_text(content)
    assert read_holder(arena_dir) is None
    Arena(arena_dir).close()  # opening sweeps it (the token is free)
    assert not (arena_dir / "holder").exists()
    handoff_works(arena_dir)


def test_holder_record_of_a_dead_pid_is_swept_only_while_the_token_is_free(arena_dir: Path) -> None:
    arena = Arena(arena_dir)
    holder = TokenClient(Arena(arena_dir), "holder")
    holder.acquire(timeout=TIMEOUT)
    (arena_dir / "holder").write_text(_record(dead_pid()))  # clobbered while someone holds
    assert arena.sweep() == []  # the token is held: the record is left to its holder
    holder.release()
    (arena_dir / "holder").write_text(_record(dead_pid()))
    assert arena.sweep() == ["holder"]
    holder.close()
    arena.close()


def test_holder_record_that_is_a_fifo_does_not_block_readers(arena_dir: Path) -> None:
    os.mkfifo(arena_dir / "holder")
    assert read_holder(arena_dir) is None  # returns at once: a FIFO is never opened for a writer
    handoff_works(arena_dir)


def test_holder_record_that_is_a_full_directory_never_blocks_the_token(
    arena_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (arena_dir / "holder").mkdir()
    (arena_dir / "holder" / "x").write_text("")
    with caplog.at_level(logging.WARNING, logger="timeshare.core.arena"):
        a = TokenClient(Arena(arena_dir), "a")
        a.acquire(timeout=TIMEOUT)
        assert read_holder(arena_dir) is None
        a.release()  # does not raise, and the token is really given back
        b = TokenClient(Arena(arena_dir), "b")
        b.acquire(timeout=TIMEOUT)
        b.close()
        a.close()
    assert any(str(arena_dir / "holder") in r.getMessage() for r in caplog.records)


# ---- the token ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_token_that_is_not_a_file_is_an_error_naming_it(arena_dir: Path, tmp_path: Path, kind: str) -> None:
    token = arena_dir / "token"
    token.unlink()  # made by the fixture's check
    if kind == "symlink":
        (tmp_path / "t").write_text("")
        token.symlink_to(tmp_path / "t")
    elif kind == "directory":
        token.mkdir()
    else:
        os.mkfifo(token)
    with pytest.raises(ArenaError) as info:
        Arena(arena_dir)
    message = str(info.value)
    assert str(token) in message and "remove it" in message
    assert os.path.lexists(token)  # never removed: a process could hold the GPU through the old one
