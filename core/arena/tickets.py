"""The ticket queue of one arena: :class:`TicketQueue` (``seq`` and ``waiters/``).

Why tickets, and how the queue works: the package docstring (:mod:`timeshare.core.arena`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import time

from ..errors import ArenaError
from .dirs import ArenaDir
from .records import MAX_SEQ, O_FILE, SEQ_FILE, Ticket

log = logging.getLogger(__name__)

_SEQ_RE = re.compile(rb"^\s*(\d{0,12})\s*$")


class TicketQueue:
    """The queue for leases in one :class:`~.dirs.ArenaDir`: the ticket counter ``seq`` and one
    locked ticket file per waiting process in ``waiters/``. Taking a ticket bumps the counter and
    creates the file under the counter's lock, so ticket order is creation order."""

    def __init__(self, directory: ArenaDir) -> None:
        self.dir = directory

    def waiting(self, *, sweep: bool = True) -> list[Ticket]:
        """Live tickets in queue order; when ``sweep``, what is not a live ticket is removed where
        that is safe (see :meth:`.arena.Arena.sweep`). Without ``sweep`` the locks are not looked
        at (every regular file with a ticket's name counts)."""
        d = self.dir
        live = []
        for name in d.listdir(d.waiters_fd):
            ticket = Ticket.parse(name)
            if d.probe(d.waiters_fd, name, remove=sweep) == "live" and ticket is not None:
                live.append(ticket)
        return sorted(live)

    def _next_seq(self, seq_fd: int) -> int:
        """The last ticket number handed out (under the counter's lock), and never less than the
        highest live ticket. A counter that is not a number of at most 12 digits (garbage,
        negative, too large) starts again after the highest ticket in the queue."""
        raw = os.pread(seq_fd, 64, 0)
        match = _SEQ_RE.match(raw)
        queue_last = max((t.seq for t in self.waiting()), default=0)
        if match is not None and int(match.group(1) or b"0") < MAX_SEQ:
            # never behind the queue (a counter removed by hand would let newcomers jump it)
            return max(int(match.group(1) or b"0"), queue_last)
        log.warning(
            "the arena's ticket counter %s held %r, not a ticket number: counting on after the queue (%d)",
            self.dir.path / SEQ_FILE,
            raw[:40],
            queue_last,
        )
        return queue_last

    def take(self, model: str, need: int | None = None) -> tuple[Ticket, int]:
        """Create this process's ticket; return it and the fd that keeps it locked (alive: give
        it back with :meth:`drop`).
        ``need``: the weight bytes it asks for (None: the device to itself)."""
        seq_fd = self.dir.open_record(SEQ_FILE, "ticket counter", replace=True)
        try:
            fcntl.flock(seq_fd, fcntl.LOCK_EX)
            last = self._next_seq(seq_fd)
            for _ in range(100):
                if last >= MAX_SEQ:
                    break
                ticket = Ticket(last + 1, os.getpid(), model)
                made = self._make(ticket, need)
                last = ticket.seq
                if made is not None:
                    text = f"{ticket.seq}\n".encode()
                    os.pwrite(seq_fd, text, 0)
                    os.ftruncate(seq_fd, len(text))
                    return ticket, made
            raise ArenaError(
                f"no ticket number is free in {self.dir.waiters_path} (the last tried was {last}); stop "
                f"every Timeshare that uses {self.dir.path}, empty {self.dir.waiters_path} and start again"
            )
        finally:
            os.close(seq_fd)  # drops the counter lock

    def _make(self, ticket: Ticket, need: int | None = None) -> int | None:
        """Create ``ticket`` locked; its fd, or None when its name is taken (a leftover: the
        caller takes the next number)."""
        tmp = f".{ticket.name}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_FILE, 0o600, dir_fd=self.dir.fd)
        except FileExistsError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            body = {
                "model": ticket.model,
                "pid": ticket.pid,
                "at": time.time(),
                "at_monotonic": time.monotonic(),
                "bytes": need,
            }
            os.write(fd, json.dumps(body).encode())
            try:
                os.lstat(ticket.name, dir_fd=self.dir.waiters_fd)
            except FileNotFoundError:
                pass
            else:  # a leftover has this name (a rename would replace a file, fail on a folder)
                os.unlink(tmp, dir_fd=self.dir.fd)
                os.close(fd)
                return None
            # Renamed in: watchers get IN_MOVED_TO and never see a half-made, unlocked ticket.
            os.rename(tmp, ticket.name, src_dir_fd=self.dir.fd, dst_dir_fd=self.dir.waiters_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir.fd)
            os.close(fd)
            raise
        return fd

    def need(self, ticket: Ticket) -> int | None:
        """The weight bytes a ticket asks for; None when it wants the device to itself (or its
        body cannot be read: the safe reading)."""
        try:
            fd = os.open(ticket.name, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=self.dir.waiters_fd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            body = json.loads(os.read(fd, 4096))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        need = body.get("bytes") if isinstance(body, dict) else None
        return need if type(need) is int and need >= 0 else None

    def drop(self, ticket: Ticket, fd: int) -> None:
        """Leave the queue: the file goes, then its lock (the next waiter moves up)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ticket.name, dir_fd=self.dir.waiters_fd)
        os.close(fd)
