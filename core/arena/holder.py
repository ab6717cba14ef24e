"""The hand-over holder: the small arena process that holds the device memory workers hand over
(issue 40; docs/INTERFACES.md, "Device memory handed over between workers").

``python -m timeshare.core.arena.holder ARENA_DIR [--chunk BYTES] [--idle S] [--detach]``, started
on demand by the first worker that hands memory over (:mod:`.handclient`). It never initialises a
GPU API: it holds file descriptors (CUDA VMM POSIX-fd handles, or memfds on the CPU stand-in) and
the :class:`~.ledger.Ledger` that says who may have each chunk mapped. One thread, one
``selectors`` loop: the listening socket, the connections, one pidfd per borrower.

It lives while a worker is connected or a chunk is lent; then it closes what it holds (the
memory goes back to the driver) and exits. On-hand chunks are closed sooner when the budget
shrinks, after ``--idle`` seconds without a take or a put, or when asked (``trim``).

Kept chunks (a released worker keeps its mapping: its next restore maps nothing) are asked back
through the worker's second connection, its *reclaim channel* (``hello`` with ``role``
"reclaim"): when a restoring worker needs more than is on hand and may not allocate the rest
(the room it reports on its device, the byte budget), when the budget shrinks, when idle. The
take waits (at most ``RECLAIM_WAIT_S``) for the owners' ``released``; an owner that does not
answer keeps its chunks and the taker allocates what it still lacks.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import secrets
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..devmem.device import CHUNK_BYTES
from .arena import Arena
from .handover import (
    IDLE_S,
    MAX_FDS,
    RECLAIM_WAIT_S,
    RECORD_FILE,
    SOCKET_FILE,
    VERSION,
    HandoverError,
    HolderState,
    close_all,
    fd_room,
    open_record,
    peer_of,
    receive,
    send,
    write_state,
)
from .ledger import Ledger, LedgerError, on_hand_limit, outside_limit

log = logging.getLogger(__name__)

#: the budget is compared with what is on hand this often
CHECK_S = 1.0
#: a starting holder tries this long for the record's lock (a reader probes it for microseconds)
LOCK_TRY_S = 0.5


@dataclass
class _Waiting:
    """A take that waits for kept chunks to be unmapped by their owners."""

    conn: _Conn
    n: int
    asked: list[int]
    deadline: float
    intact: list[int] = field(default_factory=list)  # of the take's ``use``: vouched for


@dataclass
class _Conn:
    sock: socket.socket
    pid: int
    model: str = ""
    hello: bool = False
    #: "request" (the worker's requests) or "reclaim" (the holder asks kept chunks back on it)
    role: str = "request"
    #: adopt messages still expected (a worker sends more than MAX_FDS fds in several packets)
    pending: list[int] = field(default_factory=list)


class Holder:
    """One arena's holder. :meth:`serve` runs until nothing is left to hold."""

    def __init__(self, arena_dir: Path, chunk: int = CHUNK_BYTES, idle_s: float = IDLE_S) -> None:
        self.arena = Arena(arena_dir, backend="poll")
        self.ledger = Ledger(chunk)
        self.idle_s = idle_s
        self.session = secrets.token_hex(8)
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}  # socket fd -> connection
        self._reclaimers: dict[int, _Conn] = {}  # pid -> its reclaim channel
        self._waiting: list[_Waiting] = []  # takes waiting for kept chunks to come back
        self._pidfds: dict[int, int] = {}  # pid -> pidfd
        self._last_use = time.monotonic()
        self._over_since: float | None = None  # on hand above the budget's limit since (monotonic)
        self._members_checked = 0.0
        self._record_fd = -1
        self._listener: socket.socket | None = None
        self._stop = False

    # -- start ---------------------------------------------------------------------------------

    def claim(self) -> bool:
        """Take the record's lock (False: another holder lives) and bind the socket."""
        fd = open_record(self.arena.dir.fd)
        deadline = time.monotonic() + LOCK_TRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    return False
                time.sleep(0.01)
        self._record_fd = fd
        self._write_record()
        with contextlib.suppress(FileNotFoundError):  # a stale socket of a dead holder
            os.unlink(SOCKET_FILE, dir_fd=self.arena.dir.fd)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.arena.path / SOCKET_FILE))
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._sel.register(listener, selectors.EVENT_READ, ("listen", 0))
        log.info(
            "hand-over holder %d on %s (chunk %d bytes)",
            os.getpid(),
            self.arena.path,
            self.ledger.chunk_bytes,
        )
        return True

    # -- the loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        next_check = time.monotonic() + CHECK_S
        try:
            while not self._stop:
                now = time.monotonic()
                timeout = max(0.0, next_check - now)
                if self._waiting:
                    timeout = min(timeout, max(0.0, min(w.deadline for w in self._waiting) - now))
                if self.idle_s > 0 and self.ledger.on_hand_bytes:
                    timeout = min(timeout, max(0.0, self._last_use + self.idle_s - now))
                for key, _mask in self._sel.select(timeout):
                    kind, ident = key.data
                    if kind == "listen":
                        self._accept()
                    elif kind == "conn":
                        self._readable(ident)
                    else:
                        self._pid_exited(ident)
                now = time.monotonic()
                self._serve_waiting(now)
                if self.idle_s > 0 and now >= self._last_use + self.idle_s:
                    if self.ledger.on_hand_bytes:
                        self._close_fds(self.ledger.trim(0, "idle"))
                    if self.ledger.kept_bytes:  # asked back; closed as they come on hand
                        self._ask_back(len(self.ledger.chunks), but=0)
                if now >= next_check:
                    next_check = now + CHECK_S
                    self._check_budget(now)
                mapped = self.ledger.lent_bytes + self.ledger.kept_bytes
                if not self._conns and not mapped and not self._members_live(now):
                    break  # nobody to hold memory for
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Close everything held (the memory goes back to the driver), the socket, the record."""
        self._close_fds(self.ledger.trim(0, "exit"))
        for c in self.ledger.chunks:  # lent ones: their borrowers keep their own references
            with contextlib.suppress(OSError):
                os.close(c.fd)
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        for pidfd in self._pidfds.values():
            with contextlib.suppress(OSError):
                os.close(pidfd)
        self._pidfds.clear()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                os.unlink(SOCKET_FILE, dir_fd=self.arena.dir.fd)
            self._listener.close()
            self._listener = None
        if self._record_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(RECORD_FILE, dir_fd=self.arena.dir.fd)
            os.close(self._record_fd)  # drops the lock
            self._record_fd = -1
        self._sel.close()
        self.arena.close()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.admit(sock)

    def admit(self, sock: socket.socket) -> bool:
        """Serve a connected socket, or close it at once (False) when its peer runs as another
        uid: refused before a byte is read or sent."""
        peer = peer_of(sock)
        if peer.uid != os.geteuid():
            log.warning("refused a connection from uid %d (pid %d)", peer.uid, peer.pid)
            sock.close()
            return False
        sock.setblocking(True)
        sock.settimeout(5.0)  # a peer that stops reading mid-answer is dropped, not waited for
        self._conns[sock.fileno()] = _Conn(sock, peer.pid)
        self._sel.register(sock, selectors.EVENT_READ, ("conn", sock.fileno()))
        self._watch_pid(peer.pid)
        return True

    def _watch_pid(self, pid: int) -> None:
        if pid in self._pidfds:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.ledger.pid_gone(pid, time.monotonic())
            return
        self._pidfds[pid] = pidfd
        self._sel.register(pidfd, selectors.EVENT_READ, ("pid", pid))

    def _pid_exited(self, pid: int) -> None:
        """``pid`` has exited (its pidfd is readable: its fds and mappings are gone)."""
        back = self.ledger.pid_gone(pid, time.monotonic())
        if back:
            log.info("pid %d exited holding %d chunk(s): on hand again", pid, back)
        pidfd = self._pidfds.pop(pid)
        self._sel.unregister(pidfd)
        os.close(pidfd)
        self._waiting = [w for w in self._waiting if w.conn.pid != pid]
        self._serve_waiting(time.monotonic())
        self._write_record()

    def _drop_conn(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        del self._conns[conn.sock.fileno()]
        if self._reclaimers.get(conn.pid) is conn:
            del self._reclaimers[conn.pid]
        self._waiting = [w for w in self._waiting if w.conn is not conn]
        conn.sock.close()
        # what is lent to its pid stays lent until the pid exits (its pidfd says so)

    def _readable(self, ident: int) -> None:
        conn = self._conns[ident]
        try:
            message, fds = receive(conn.sock)
        except (HandoverError, OSError) as exc:
            log.warning("dropped pid %d: %s", conn.pid, exc)
            self._drop_conn(conn)
            return
        if message is None:
            self._drop_conn(conn)
            return
        try:
            self._handle(conn, message, fds)
        except (LedgerError, ValueError, TypeError, KeyError) as exc:
            close_all(fds)
            self._reply(conn, {"op": "error", "code": "refused", "message": str(exc)})
        except OSError as exc:
            close_all(fds)
            log.warning("dropped pid %d: %s", conn.pid, exc)
            self._drop_conn(conn)
        self._write_record()

    def _reply(self, conn: _Conn, message: dict[str, Any], fds: list[int] | None = None) -> None:
        try:
            send(conn.sock, message, fds or [])
        except OSError as exc:
            log.warning("dropped pid %d: %s", conn.pid, exc)
            self._drop_conn(conn)

    # -- requests ------------------------------------------------------------------------------

    def _handle(self, conn: _Conn, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg["op"]
        if not conn.hello and op != "hello":
            raise ValueError("say hello first")
        if op != "adopt" and fds:
            close_all(fds)  # fds only come with adopt
            fds = []
        now = time.monotonic()
        if (conn.role == "reclaim") != (op == "released") and op != "hello":
            raise ValueError(f"{op!r} on a {conn.role} connection")
        if op == "hello":
            if msg.get("v") != VERSION:
                raise ValueError(
                    f"hand-over protocol version {msg.get('v')!r} (this holder speaks {VERSION})"
                )
            role = msg.get("role", "request")
            if role not in ("request", "reclaim"):
                raise ValueError(f"unknown role {role!r}")
            conn.hello, conn.model, conn.role = True, str(msg.get("model", ""))[:120], str(role)
            if role == "reclaim":
                old = self._reclaimers.get(conn.pid)
                if old is not None and old is not conn:
                    self._drop_conn(old)
                self._reclaimers[conn.pid] = conn
            self._reply(
                conn,
                {
                    "op": "welcome",
                    "v": VERSION,
                    "session": self.session,
                    "chunk": self.ledger.chunk_bytes,
                    "pid": os.getpid(),
                },
            )
        elif op == "take":
            n = _count(msg, "n")
            room = msg.get("room")
            if room is not None:
                room = _count(msg, "room", 1 << 62)
            self._last_use = now
            gens = _ids(msg, "gens") if "gens" in msg else None
            intact = self.ledger.use(conn.pid, _ids(msg, "use"), gens)
            asked = self._ask_for(conn.pid, n, room)
            if asked:
                self._waiting.append(_Waiting(conn, n, asked, now + RECLAIM_WAIT_S, intact))
            else:
                self._give(conn, n, intact)
        elif op == "keep":
            ids = _ids(msg, "ids")
            if ids and conn.pid not in self._reclaimers:
                raise ValueError("no reclaim channel: kept chunks could not be asked back")
            self._last_use = now
            gens = self.ledger.keep(conn.pid, ids, now)
            self._reply(conn, {"op": "done", "on_hand": self.ledger.on_hand_bytes, "gens": gens})
        elif op == "released":
            back = self.ledger.released(conn.pid, _ids(msg, "ids"), _ids(msg, "asked"), now)
            if back:
                log.info("pid %d unmapped %d kept chunk(s): on hand", conn.pid, back)
            self._serve_waiting(now)
        elif op == "adopt":
            n = _count(msg, "n")
            if n != len(fds) or n == 0:
                raise ValueError(f"adopt names {n} chunk(s) but {len(fds)} fd(s) came with it")
            self._last_use = now
            self._reply(conn, {"op": "adopted", "ids": self.ledger.adopt(fds, conn.pid)})
        elif op == "put":
            put_ids = _ids(msg, "ids")
            self._last_use = now
            self._close_fds(self.ledger.put(conn.pid, put_ids, now, keep=bool(msg.get("keep", True))))
            if self.idle_s <= 0:
                self._close_fds(self.ledger.trim(0, "idle"))
            self._reply(conn, {"op": "done", "on_hand": self.ledger.on_hand_bytes})
        elif op == "trim":
            keep = _count(msg, "keep_bytes", 1 << 62)
            self._close_fds(self.ledger.trim(keep, "trim"))
            over = self.ledger.on_hand_bytes + self.ledger.kept_bytes - keep
            if over > 0:  # kept ones too: asked back, closed at the next trim
                self._ask_back(-(-over // self.ledger.chunk_bytes), but=0)
            self._reply(conn, {"op": "done", "on_hand": self.ledger.on_hand_bytes})
        elif op == "status":
            self._reply(conn, {"op": "status", **self.status()})
        else:
            raise ValueError(f"unknown op {op!r}")

    # -- kept chunks asked back --------------------------------------------------------------------

    def _give(self, conn: _Conn, n: int, intact: list[int]) -> None:
        """Lend up to ``n`` chunks on hand to ``conn``'s pid; the first packet says which kept
        chunks of the take's ``use`` are ``intact`` (:meth:`Ledger.use`)."""
        chunks = self.ledger.give(conn.pid, n)
        batches = [chunks[i : i + MAX_FDS] for i in range(0, len(chunks), MAX_FDS)] or [[]]
        for i, batch in enumerate(batches):
            message: dict[str, Any] = {
                "op": "given",
                "ids": [c.id for c in batch],
                "more": i + 1 < len(batches),
            }
            if i == 0:
                message["intact"] = intact
            self._reply(conn, message, [c.fd for c in batch])

    def _ask_for(self, pid: int, n: int, room: int | None) -> list[int]:
        """A take of ``n`` by ``pid``: the kept chunks of other workers asked back for it (their
        ids; none when what is on hand and what ``pid`` may allocate cover it). ``room``: the
        bytes ``pid`` may allocate on its device (None: no limit said). Under a byte budget the
        memory held outside the leases stays within what the leases leave."""
        led = self.ledger
        on_hand = len(led.on_hand)
        short = n - min(n, on_hand)
        if short <= 0 or not led.kept_bytes:
            return []
        chunk = led.chunk_bytes
        may_create = short if room is None else min(short, room // chunk)
        need = short - may_create
        record = self.arena.budget_in_force()
        if record is not None:
            leases = self.arena.leases(sweep=False)
            reserved = sum(x.bytes for x in leases if x.kind == "reserve")
            budget = record.weights_budget(reserved)
            if budget is not None:
                leased = sum(x.bytes for x in leases if x.kind == "weights")
                outside = (on_hand - min(n, on_hand)) * chunk + led.kept_bytes
                excess = outside - outside_limit(budget, leased)
                need = max(need, -(-excess // chunk))
        return self._ask_back(min(need, short), but=pid)

    def _ask_back(self, n: int, but: int) -> list[int]:
        """Ask owners of kept chunks (not ``but``) to unmap up to ``n`` of them; the ids asked."""
        asked: list[int] = []
        if n <= 0:
            return asked
        for pid, ids in self.ledger.ask_back(n, but).items():
            channel = self._reclaimers.get(pid)
            if channel is None:
                self.ledger.unask(ids)
                continue
            try:
                send(channel.sock, {"op": "reclaim", "ids": ids})
            except OSError as exc:
                log.warning("pid %d's reclaim channel: %s", pid, exc)
                self.ledger.unask(ids)
                self._drop_conn(channel)
                continue
            asked.extend(ids)
        return asked

    def _serve_waiting(self, now: float) -> None:
        """Answer the takes whose asked chunks came back (or whose owners took too long)."""
        still: list[_Waiting] = []
        for w in self._waiting:
            if self.ledger.still_asked(w.asked) and now < w.deadline:
                still.append(w)
                continue
            if self.ledger.still_asked(w.asked):
                log.warning("kept chunks not unmapped within %.1f s: the taker allocates", RECLAIM_WAIT_S)
                self.ledger.unask(w.asked)
            if w.conn.sock.fileno() in self._conns:
                self._give(w.conn, w.n, w.intact)
        self._waiting = still

    def status(self) -> dict[str, Any]:
        led = self.ledger
        return {
            "pid": os.getpid(),
            "session": self.session,
            "chunk": led.chunk_bytes,
            "chunks": len(led.chunks),
            "on_hand_bytes": led.on_hand_bytes,
            "lent_bytes": led.lent_bytes,
            "kept_bytes": led.kept_bytes,
            "waiting": len(self._waiting),
            "by_pid": {str(k): v for k, v in led.borrowers().items()},
            "connections": len(self._conns),
            **led.stats.as_dict(),
        }

    # -- giving memory back --------------------------------------------------------------------

    def _members_live(self, now: float) -> bool:
        """With no connection and nothing lent: keep what is on hand while the arena has members
        (a worker that hands over connects again), looked at once a second."""
        if not self.ledger.on_hand_bytes:
            return False
        if now < self._members_checked + CHECK_S:
            return True
        self._members_checked = now
        return self.arena.budget_in_force() is not None

    def _check_budget(self, now: float) -> None:
        """On hand above what the budget leaves (seen at two checks running): the oldest go."""
        if not self.ledger.on_hand_bytes and not self.ledger.kept_bytes:
            self._over_since = None
            return
        record = self.arena.budget_in_force()
        leases = self.arena.leases(sweep=False)
        if record is None:
            self._over_since = None
            return  # no budget recorded: nothing to hold it against
        reserved = sum(x.bytes for x in leases if x.kind == "reserve")
        leased = sum(x.bytes for x in leases if x.kind == "weights")
        budget = record.weights_budget(reserved)
        limit = on_hand_limit(budget, leased, self.ledger)
        # kept beyond what a byte budget leaves outside the leases: asked back (then closed)
        kept_over = 0 if budget is None else self.ledger.kept_bytes - outside_limit(budget, leased)
        if self.ledger.on_hand_bytes <= limit and kept_over <= 0:
            self._over_since = None
            return
        if self._over_since is None:
            self._over_since = now  # a releaser may not have dropped its lease yet: look again
            return
        closed = self.ledger.trim(limit, "budget")
        log.info("budget: %d chunk(s) on hand went back to the driver", len(closed))
        self._close_fds(closed)
        if kept_over > 0:
            self._ask_back(-(-kept_over // self.ledger.chunk_bytes), but=0)
        self._over_since = None
        self._write_record()

    def _close_fds(self, fds: list[int]) -> None:
        close_all(fds)
        if fds:
            self._write_record()

    def _write_record(self) -> None:
        if self._record_fd < 0:
            return
        with contextlib.suppress(OSError):
            write_state(
                self._record_fd,
                HolderState(
                    os.getpid(),
                    self.session,
                    self.ledger.chunk_bytes,
                    self.ledger.on_hand_bytes,
                    self.ledger.lent_bytes,
                    time.time(),
                ),
            )


def _count(msg: dict[str, Any], key: str, most: int = 1 << 20) -> int:
    value = msg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > most:
        raise ValueError(f"{key!r} must be a count, not {value!r}")
    return value


def _ids(msg: dict[str, Any], key: str) -> list[int]:
    value = msg.get(key, [])
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"{key!r} must be a list of chunk ids")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="timeshare-handover-holder", description=__doc__)
    parser.add_argument("arena", type=Path)
    parser.add_argument("--chunk", type=int, default=CHUNK_BYTES)
    parser.add_argument("--idle", type=float, default=IDLE_S)
    parser.add_argument("--detach", action="store_true", help="fork, and let the starter go on at once")
    args = parser.parse_args(argv)
    if args.chunk <= 0 or args.chunk % 4096:
        parser.error("--chunk must be a positive multiple of 4096")
    if args.detach:
        # the starter waits for this first process only; the holder goes on in a new session,
        # so the death of the worker that started it does not take it along
        if os.fork():
            os._exit(0)
        os.setsid()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s holder %(process)d: %(message)s")
    fd_room()  # one fd per chunk held: as many as the hard limit lets
    holder = Holder(args.arena, args.chunk, args.idle)
    if not holder.claim():
        holder.arena.close()
        return 0  # another holder lives
    signal.signal(signal.SIGTERM, lambda *_: setattr(holder, "_stop", True))
    signal.signal(signal.SIGINT, lambda *_: setattr(holder, "_stop", True))
    holder.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
