"""The arena directory's file names and the records kept in it (tickets, the holder record, the
release record, grants)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

TOKEN_FILE = "token"
HOLDER_FILE = "holder"
RELEASE_FILE = "released"
SEQ_FILE = "seq"
WAITERS_DIR = "waiters"
LEASES_DIR = "leases"
BUDGET_FILE = "budget"

#: how often waiters and the doorbell rescan ``waiters/`` even without an event (a ticket created
#: before the watch existed, a waiter killed with -9: its file does not go away by itself)
RESCAN_INTERVAL_S = 0.5
#: while this client holds the token and someone waits, the doorbell rings again this often
RING_REPEAT_S = 0.2
#: directory polling period of the polling backend
POLL_INTERVAL_S = 0.02
#: a waiting request sweeps the whole arena (leftovers of dead processes) this often
SWEEP_INTERVAL_S = 5.0

#: the largest ticket number: tickets are named with 12 digits, so that name order is queue order
MAX_SEQ = 10**12 - 1
#: pids above this are not pids (Linux's pid_max is at most 2**22)
MAX_PID = 2**31 - 1

Backend = Literal["auto", "inotify", "poll"]

#: the model name a ticket or lease file may carry. Deliberately looser than the config's model-id
#: rule (``config.validate.MODEL_ID_RE``, the one rule for ids people give): the arena directory is
#: shared by every pool and worker on the machine (other configs, other Timeshare versions, the
#: arena harness's ``model#2`` ids), and the name is only ever a part of a file name there
#: (``<seq>-<pid>-<model>``), so this is a file-name safety check (no ``/``, no NUL, no spaces,
#: bounded length), never the id rule itself: a record that another version wrote with a wider
#: name is still read and honoured, not ignored.
RECORD_MODEL_RE = re.compile(r"^[A-Za-z0-9._#+@=-]{1,120}$")
_TICKET_RE = re.compile(r"^(\d{12})-([1-9]\d{0,9})-(.+)$")
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_FILE = os.O_NOFOLLOW | os.O_CLOEXEC


# ---- records ---------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Ticket:
    """A place in the queue for the token. Order is the order of ``seq``."""

    seq: int
    pid: int
    model: str

    @property
    def name(self) -> str:
        return f"{self.seq:012d}-{self.pid}-{self.model}"

    @classmethod
    def parse(cls, name: str) -> Ticket | None:
        """The ticket a file name stands for, or None when the name is not one a
        :class:`~.client.TokenClient` makes (12-digit seq, a pid, a valid model id)."""
        match = _TICKET_RE.match(name)
        if not match:
            return None
        pid = int(match.group(2))
        if pid > MAX_PID or not RECORD_MODEL_RE.match(match.group(3)):
            return None
        return cls(int(match.group(1)), pid, match.group(3))


@dataclass(frozen=True)
class HolderRecord:
    """Who holds the GPU token. ``since`` is wall-clock (for people), ``since_monotonic`` is
    ``time.monotonic()`` of the holder (CLOCK_MONOTONIC: comparable across processes on Linux)."""

    model: str
    pid: int
    since: float
    since_monotonic: float
    pinned: bool = False

    def describe(self) -> str:
        return f"pinned by {self.model}" if self.pinned else f"held by {self.model}"


@dataclass(frozen=True)
class ReleaseRecord:
    """The last release of a lease, carried to the holder that comes next: the releasing holder
    writes it (``released``, atomically) just before its lease goes, with how long its release of
    the weights took as it measured it; the next grant takes it (reads and removes it, under the
    arena lock) into :attr:`TokenGrant.previous_release_ms`. So the release time travels with the
    token, in the arena, instead of racing the two workers' reports to the pool. ``at`` is
    ``time.monotonic()`` of the releaser when it wrote the record (CLOCK_MONOTONIC: comparable
    across processes on Linux): a grant credits only a release that came after its request."""

    model: str
    pid: int
    release_ms: float
    at: float


@dataclass(frozen=True)
class TokenGrant:
    """The token was acquired. ``handoff`` is True when another process held it or was ahead in the
    queue when it was requested (``wait_ms`` then measures doorbell rung → token acquired)."""

    model: str
    requested_at: float
    acquired_at: float
    handoff: bool
    previous: str | None  # model that held the token when it was requested
    bytes: int = 0  # the weight bytes leased
    budget: int | None = None  # the device's weights budget it was granted under (None: one model)
    # how long the release took that this grant followed (a ReleaseRecord made after the request,
    # by another holder; under a byte budget, the last of the holders that made room): 0.0 when
    # none (no previous holder, a share beside a pinned holder, a holder that crashed)
    previous_release_ms: float = 0.0

    @property
    def wait_ms(self) -> float:
        return (self.acquired_at - self.requested_at) * 1000.0


@dataclass(frozen=True)
class DoorbellRing:
    """Other processes wait for the token this client holds (or is about to hold), and what the
    head of their queue asks of this client, as the one scan of the arena that rang saw it: so
    that a worker decides a yield from the ring while it is fresh, without scanning again."""

    waiters: tuple[Ticket, ...]  # the others' live tickets, in queue order (the head first)
    at: float  # time.monotonic() when the scan that saw them began
    # the weight bytes the head asks this client to free: its whole lease, or (a partial lease
    # under a byte budget) what the head lacks; None: not asked (judged as if unpinned)
    ask: int | None = None
    deepen: bool = False  # the head asks this client to go deep too (its KV cache: auto budgets)
    need: int | None = None  # the weight bytes the head asks for (None: the device to itself)

    @property
    def head(self) -> Ticket | None:
        """Who asks: the first of the others in the queue."""
        return self.waiters[0] if self.waiters else None

    def fresh(self, now: float) -> bool:
        """Younger than RING_REPEAT_S: the doorbell has not rung again since, so what it saw still
        stands (the scan a yield decision would make is not needed)."""
        return now - self.at < RING_REPEAT_S
