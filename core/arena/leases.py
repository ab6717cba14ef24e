"""The lease files and the budget record of one arena: :class:`LeaseFiles`.

Files (beside the ticket queue of :mod:`.tickets`; the arena lock is :meth:`.dirs.ArenaDir.lock`):

    token        the arena lock: held (``flock``) only for the short critical sections that read
                 the live leases and create one, record the budget or rewrite the holder record
    budget       the budget in force (:class:`~.budget.BudgetRecord`); every member (a
                 TokenClient, i.e. a worker) holds a shared ``flock`` on it for its lifetime, so
                 the record is rewritten only by a member that finds no other one alive
    leases/      one file per lease, ``<pid>-<serial>-<model>``, ``flock``-ed by its holder for as
                 long as it holds it (the lock is taken on a temporary name, ``.lease.<name>.tmp``
                 in the arena, before the file is renamed in, so it is never seen unlocked); the
                 kernel drops the lock of a killed holder and the next scan removes the file

Lease and budget records are :func:`~.budget.encode_record` frames (checksummed, fixed size,
rewritten in place with one ``pwrite``): a holder updates its lease's pinned/busy/last-use fields
without the arena lock, and a reader that meets a half-written frame reads again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import asdict

from ..errors import ArenaError
from .budget import (
    ONE_MODEL,
    RECORD_SIZE,
    BudgetRecord,
    LeaseRecord,
    compute_budget,
    decode_record,
    encode_record,
    parse_budget_record,
    parse_lease_record,
)
from .dirs import ArenaDir
from .records import BUDGET_FILE, MAX_PID, O_FILE, RECORD_MODEL_RE

log = logging.getLogger(__name__)

#: a lease file's name: ``<pid>-<serial>-<model>``
_LEASE_RE = re.compile(r"^([1-9]\d{0,9})-(\d{1,9})-(.+)$")
_serial = itertools.count(1)


def parse_lease_name(name: str) -> tuple[int, str] | None:
    """(pid, model) of a lease file's name, or None when it is not one."""
    match = _LEASE_RE.match(name)
    if match is None or int(match.group(1)) > MAX_PID or not RECORD_MODEL_RE.match(match.group(3)):
        return None
    return int(match.group(1)), match.group(3)


class LeaseFiles:
    """The lease files (``leases/``) and the budget record of one :class:`~.dirs.ArenaDir`:
    listing the live leases, creating, rewriting and ending one, and joining the budget in force.
    Creating a lease, joining and reading whether a budget is in force happen under the arena
    lock (:meth:`~.dirs.ArenaDir.lock`); the callers of :meth:`create` and :meth:`drop` take it."""

    def __init__(self, directory: ArenaDir) -> None:
        self.dir = directory
        #: the last good record of each live lease (a frame being rewritten reads as garbage)
        self._cache: dict[str, LeaseRecord] = {}

    # -- leases --

    def live(self, *, sweep: bool = True) -> list[LeaseRecord]:
        """The live leases (a lease whose lock anyone can take belongs to a dead process and is
        removed when ``sweep``). A live lease whose record cannot be read is reported and left out."""
        out = []
        d = self.dir
        for name in d.listdir(d.leases_fd):
            parsed = parse_lease_name(name)
            state = d.probe(d.leases_fd, name, remove=sweep)
            if state != "live" or parsed is None:
                if state == "live" and parsed is None:
                    d.report(d.leases_path / name, "is not a lease")
                continue
            record = self._read_lease(name, parsed)
            if record is not None:
                out.append(record)
        live = {r.name for r in out}
        for gone in [n for n in self._cache if n not in live]:
            del self._cache[gone]
        return out

    def _read_lease(self, name: str, parsed: tuple[int, str]) -> LeaseRecord | None:
        for _ in range(20):  # a frame being rewritten: read again
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=self.dir.leases_fd)
            except FileNotFoundError:
                return None
            except OSError:
                break
            try:
                raw = os.pread(fd, RECORD_SIZE + 1, 0)
            finally:
                os.close(fd)
            record = parse_lease_record(decode_record(raw), name)
            if record is not None and (record.pid, record.model) == parsed:
                self._cache[name] = record
                return record
            time.sleep(0.0005)
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        self.dir.report(self.dir.leases_path / name, "is a live lease whose record cannot be read")
        return None

    def create(self, record: LeaseRecord) -> tuple[str, int]:
        """Create a lease file for ``record`` (under the arena lock), locked; its name and the fd
        that holds it (the lease lasts until :meth:`drop`, or this process's death)."""
        dir_fd, leases_fd = self.dir.fd, self.dir.leases_fd
        for _ in range(1000):
            name = f"{record.pid}-{next(_serial)}-{record.model}"
            tmp = f".lease.{name}.tmp"
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_FILE, 0o600, dir_fd=dir_fd)
            except FileExistsError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.pwrite(fd, encode_record(record.to_json()), 0)
                try:
                    os.lstat(name, dir_fd=leases_fd)
                except FileNotFoundError:
                    pass
                else:  # a leftover with this name: take the next serial
                    os.unlink(tmp, dir_fd=dir_fd)
                    os.close(fd)
                    continue
                os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=leases_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                os.close(fd)
                raise
            return name, fd
        raise ArenaError(f"no lease name is free in {self.dir.leases_path}: empty it and start again")

    @staticmethod
    def update(fd: int, record: LeaseRecord) -> None:
        """Rewrite a held lease's record in place (one pwrite of a fixed-size frame)."""
        os.pwrite(fd, encode_record(record.to_json()), 0)

    def drop(self, name: str, fd: int) -> None:
        """End a lease: the file goes first, then the lock (a waiter blocked on it wakes)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.dir.leases_fd)
        os.close(fd)
        self._cache.pop(name, None)

    def open_for_wait(self, name: str) -> int | None:
        """An fd on another holder's lease file, to block in ``flock`` until it lets go; None
        when it is gone already."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=self.dir.leases_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    # -- the budget record --

    def budget_record(self) -> BudgetRecord | None:
        """The budget recorded in this arena (None: none yet, or garbage). Whether it is in force
        (any member alive) is :meth:`budget_in_force`."""
        try:
            fd = os.open(BUDGET_FILE, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=self.dir.fd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            for _ in range(20):
                record = parse_budget_record(decode_record(os.pread(fd, RECORD_SIZE + 1, 0)))
                if record is not None:
                    return record
                time.sleep(0.0005)
            return None
        finally:
            os.close(fd)

    def budget_in_force(self) -> BudgetRecord | None:
        """The recorded budget while some member lives (a member holds the record's shared lock);
        None when nobody uses the arena (or its lock stayed busy for a second)."""
        try:
            fd = os.open(BUDGET_FILE, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=self.dir.fd)
        except OSError:
            return None
        try:
            lock = self.dir.lock(timeout=1.0)  # members join under it: no join sees our probe's lock
            if lock is None:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return self.budget_record()
            finally:
                self.dir.unlock(lock)
            return None  # nobody holds it: no member
        finally:
            os.close(fd)

    def join_budget(
        self, wanted: BudgetRecord | None, check: Callable[[], None] | None = None
    ) -> tuple[BudgetRecord, int, str]:
        """Become a member: the budget in force, the fd holding the record's shared lock (keep it
        open for as long as this member lives, then close it) and a note when ``wanted`` was not
        used."""
        fd = self.dir.open_record(BUDGET_FILE, "budget record", replace=True)
        try:
            lock = self.dir.lock(check)
            assert lock is not None
            try:
                return self._join_locked(fd, wanted)
            finally:
                self.dir.unlock(lock)
        except BaseException:
            os.close(fd)
            raise

    def _join_locked(self, fd: int, wanted: BudgetRecord | None) -> tuple[BudgetRecord, int, str]:
        mine = wanted or compute_budget(ONE_MODEL, total=0, free=0, pid=os.getpid(), at=time.time())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            first = True
        except BlockingIOError:
            first = False
        record = None if first else parse_budget_record(decode_record(os.pread(fd, RECORD_SIZE + 1, 0)))
        if record is None:
            if not first:
                log.warning(
                    "the arena's budget record %s is not one while Timeshare uses it; recording %s",
                    self.dir.path / BUDGET_FILE,
                    mine.setting,
                )
            os.pwrite(fd, encode_record(_record_json(mine)), 0)
            os.ftruncate(fd, RECORD_SIZE)
            record = mine
        fcntl.flock(fd, fcntl.LOCK_SH)  # a conversion: nobody can take it meanwhile (arena lock)
        note = ""
        if wanted is not None and not same_setting(record, wanted):
            note = (
                f"the VRAM budget in force on this device is {record.setting!r} (set by pid "
                f"{record.pid}, the first Timeshare process of the arena {self.dir.path}), not this "
                f"model's {wanted.setting!r}: "
                "stop every Timeshare that uses the arena to change it"
            )
            log.warning("%s", note)
        return record, fd, note


def _record_json(record: BudgetRecord) -> dict[str, object]:
    return asdict(record)


def same_setting(a: BudgetRecord, b: BudgetRecord) -> bool:
    """Whether two records come from the same setting ("20GiB" and "21474836480" do; two auto
    budgets do, whatever each measured)."""
    if a.kind != b.kind:
        return False
    if a.kind == "bytes":
        return a.bytes == b.bytes
    if a.kind == "fraction":
        return a.setting.replace(" ", "") == b.setting.replace(" ", "")
    return True
