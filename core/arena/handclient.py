"""A worker's side of the hand-over holder (issue 40): connect (starting the holder when none
lives), take chunks, hand over the ones it created, put them back.

It is the ``ChunkSource`` the worker's mapped memory (:mod:`core.devmem.mapped`) takes its chunks
from; it knows nothing of devices: it passes fds and ids. Any failure of the holder (none answers,
a refused socket, its end) raises :class:`~.handover.HandoverError`; the caller then allocates and
frees its own memory, and :meth:`HandoverClient.take` later tries a new holder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import envvars
from ..devmem.device import CHUNK_BYTES, Given
from ..util.units import parse_size
from .dirs import ArenaDir
from .handover import (
    IDLE_S,
    MAX_FDS,
    REQUEST_TIMEOUT_S,
    VERSION,
    HandoverError,
    PeerRefusedError,
    RequestRefusedError,
    close_all,
    connect,
    fd_room,
    not_there,
    receive,
    send,
)

log = logging.getLogger(__name__)

#: how long a worker waits for a holder it started to listen
START_TIMEOUT_S = 10.0

#: what unmaps kept chunks when the holder asks them back: (ids asked, the holder's session) ->
#: the ids unmapped (the mapped memory's :meth:`~core.devmem.mapped.HandedMemory.reclaim`)
Reclaimer = Callable[[list[int], str], list[int]]


class HandoverClient:
    """One worker's connection to its arena's holder. Thread-safe (one request at a time).

    ``chunk_bytes`` and ``idle_s`` are what a holder this client starts is started with (None:
    :func:`chunk_choice`); a holder that lives already says its own chunk size
    (:attr:`chunk_bytes` after :meth:`connect`).
    ``start``: start a holder when none lives (False: only use a live one)."""

    def __init__(
        self,
        arena_dir: str | os.PathLike[str],
        model: str,
        *,
        chunk_bytes: int | None = None,
        idle_s: float = IDLE_S,
        start: bool = True,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.dir = ArenaDir(Path(os.path.abspath(arena_dir)))
        self.model = model
        self.chunk_bytes = chunk_choice() if chunk_bytes is None else chunk_bytes
        self.idle_s = idle_s
        self.start = start
        self.timeout = timeout
        self.session = ""
        self.holder_pid = 0
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._reclaimer: Reclaimer | None = None
        self._channel: socket.socket | None = None  # the reclaim channel (its own thread reads it)
        #: kept chunks unmapped at the holder's request (by the reclaim thread)
        self.reclaimed = 0
        #: holders this client started (for doctor and the tests)
        self.started = 0

    # -- connection ----------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> None:
        """Connect (starting a holder when none lives and ``start``); a no-op when connected.
        Raises HandoverError (PeerRefusedError: a stranger's or stale socket that is not a live
        holder's)."""
        with self._lock:
            self._connect()

    def _connect(self) -> None:
        if self._sock is not None:
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        spawned = False
        while True:
            try:
                sock = connect(self.dir.fd, str(self.dir.path), self.timeout)
                break
            except PeerRefusedError:
                if not spawned:
                    raise
                # a holder we started has bound the socket but not rewritten its record yet
            except OSError as exc:
                if not not_there(exc):
                    raise HandoverError(f"cannot reach the hand-over holder: {exc}") from exc
                if not self.start:
                    raise HandoverError("no hand-over holder lives") from exc
            if not spawned:
                self._spawn()
                spawned = True
            if time.monotonic() > deadline:
                raise HandoverError(f"the hand-over holder did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        try:
            send(sock, {"op": "hello", "v": VERSION, "pid": os.getpid(), "model": self.model})
            reply = self._answer(sock, "welcome")
        except BaseException:
            sock.close()
            raise
        chunk = reply.get("chunk")
        if not isinstance(chunk, int) or chunk <= 0:
            sock.close()
            raise HandoverError(f"the hand-over holder named a chunk size of {chunk!r}")
        self.chunk_bytes = chunk
        self.session = str(reply.get("session", ""))
        self.holder_pid = int(reply.get("pid", 0))
        self._sock = sock
        if self._reclaimer is not None:
            self._open_channel()

    # -- the reclaim channel -------------------------------------------------------------------

    @property
    def keeps(self) -> bool:
        """Released chunks may stay mapped here: the holder can ask them back (the reclaim
        channel is open)."""
        return self._channel is not None

    def serve_reclaims(self, reclaimer: Reclaimer) -> None:
        """Open the reclaim channel (now when connected, else at the next connection): a second
        connection on which the holder asks kept chunks back; a thread of its own answers,
        calling ``reclaimer``."""
        with self._lock:
            self._reclaimer = reclaimer
            if self._sock is not None and self._channel is None:
                self._open_channel()

    def _open_channel(self) -> None:
        try:
            sock = connect(self.dir.fd, str(self.dir.path), self.timeout)
        except (OSError, HandoverError) as exc:
            log.warning("no reclaim channel to the hand-over holder: %s", exc)
            return
        try:
            hello = {"op": "hello", "v": VERSION, "pid": os.getpid(), "model": self.model, "role": "reclaim"}
            send(sock, hello)
            reply = self._answer(sock, "welcome")
            if str(reply.get("session", "")) != self.session:
                raise HandoverError("another holder answered the reclaim channel")
        except (OSError, HandoverError) as exc:
            sock.close()
            log.warning("no reclaim channel to the hand-over holder: %s", exc)
            return
        self._close_channel()
        self._channel = sock
        thread = threading.Thread(
            target=self._serve_channel, args=(sock, self.session), name="handover-reclaim", daemon=True
        )
        thread.start()

    def _close_channel(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(OSError):
                self._channel.shutdown(socket.SHUT_RDWR)
            self._channel = None

    def _serve_channel(self, sock: socket.socket, session: str) -> None:
        """The reclaim thread: unmap what the holder asks back, answer ``released``."""
        sock.settimeout(None)
        try:
            while True:
                message, fds = receive(sock)
                close_all(fds)
                if message is None:
                    return
                if message.get("op") != "reclaim":
                    log.warning("the hand-over holder sent %r on the reclaim channel", message)
                    continue
                asked = [int(i) for i in message.get("ids", []) if isinstance(i, int)]
                reclaimer = self._reclaimer
                done = reclaimer(asked, session) if reclaimer is not None else []
                self.reclaimed += len(done)
                send(sock, {"op": "released", "ids": done, "asked": asked})
        except (OSError, HandoverError, ValueError) as exc:
            log.info("the reclaim channel ended: %s", exc)
        finally:
            if self._channel is sock:  # kept chunks cannot be asked back any more: keep none
                self._channel = None
            sock.close()

    def _spawn(self) -> None:
        """Start a holder (it forks and goes on in its own session; the first process exits at
        once and is waited for here, so no zombie is left)."""
        module = f"{__package__}.holder"
        cmd = [
            sys.executable,
            "-m",
            module,
            str(self.dir.path),
            "--chunk",
            str(self.chunk_bytes),
            "--idle",
            str(self.idle_s),
            "--detach",
        ]
        log_path = self.dir.path / "handover.log"
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env=envvars.environment(),
                close_fds=True,
                cwd="/",
            )
        proc.wait()
        self.started += 1

    def close(self) -> None:
        with self._lock:
            self._lost()
        self.dir.close()

    def _lost(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._close_channel()

    # -- requests ------------------------------------------------------------------------------

    def _answer(self, sock: socket.socket, op: str) -> dict[str, Any]:
        message, fds = receive(sock)
        if message is None:
            raise HandoverError("the hand-over holder closed the connection")
        if fds and op != "given":
            close_all(fds)
            raise HandoverError(f"the hand-over holder sent fds with {message.get('op')!r}")
        if message.get("op") == "error":
            close_all(fds)
            raise RequestRefusedError(f"the hand-over holder refused: {message.get('message', '?')}")
        if message.get("op") != op:
            close_all(fds)
            raise HandoverError(f"the hand-over holder answered {message.get('op')!r}, not {op!r}")
        if fds:
            message["_fds"] = fds
        return message

    def _request(self, message: dict[str, Any], op: str, fds: list[int] | None = None) -> dict[str, Any]:
        self._connect()
        sock = self._sock
        assert sock is not None
        try:
            send(sock, message, fds or [])
            return self._answer(sock, op)
        except RequestRefusedError:
            raise
        except (OSError, HandoverError) as exc:
            self._lost()
            raise HandoverError(f"the hand-over holder is gone: {exc}") from exc

    def take(
        self, n: int, room: int | None = None, use: list[int] | None = None, gens: list[int] | None = None
    ) -> Given:
        """Up to ``n`` chunks on hand, lent to this process (``Given.chunks``: (id, fd) pairs,
        the fds this process's to close after importing them). ``room``: the bytes this process
        may allocate on its device (the holder asks kept chunks of others back for the rest);
        ``use``: chunks this process kept mapped and restores into now (in use again); ``gens``:
        their generations as :meth:`keep` gave them -- ``Given.intact`` then names those the
        holder vouches nobody else mapped since (none without ``gens``)."""
        if n <= 0 and not use:
            return Given([], set())
        if n > 0:
            fd_room(n)  # every chunk's fd arrives before the caller imports any
        with self._lock:
            out: list[tuple[int, int]] = []
            request: dict[str, Any] = {"op": "take", "n": max(0, n)}
            if room is not None:
                request["room"] = max(0, room)
            if use:
                request["use"] = use
                if gens is not None:
                    request["gens"] = gens
            reply = self._request(request, "given")
            named = reply.get("intact", [])
            intact = {i for i in named if isinstance(i, int)} if isinstance(named, list) and use else set()
            intact &= set(use or [])  # the holder vouches for nothing it was not asked about
            while True:
                fds: list[int] = reply.pop("_fds", [])
                ids = reply.get("ids")
                if not isinstance(ids, list) or len(ids) != len(fds):
                    close_all(fds)
                    close_all([fd for _i, fd in out])
                    self._lost()
                    raise HandoverError("the hand-over holder sent a 'given' whose ids and fds differ")
                out.extend(zip((int(i) for i in ids), fds, strict=True))
                if not reply.get("more"):
                    return Given(out, intact)
                assert self._sock is not None
                try:
                    reply = self._answer(self._sock, "given")
                except (OSError, HandoverError) as exc:
                    close_all([fd for _i, fd in out])
                    self._lost()
                    raise HandoverError(f"the hand-over holder is gone: {exc}") from exc

    def adopt(self, fds: list[int]) -> list[int]:
        """Hand the holder chunks this process created (their exported fds; they stay this
        process's to close): lent to it from now on. Their ids, in order."""
        with self._lock:
            ids: list[int] = []
            for i in range(0, len(fds), MAX_FDS):
                batch = fds[i : i + MAX_FDS]
                reply = self._request({"op": "adopt", "n": len(batch)}, "adopted", batch)
                got = reply.get("ids")
                if not isinstance(got, list) or len(got) != len(batch):
                    raise HandoverError("the hand-over holder adopted another number of chunks")
                ids.extend(int(x) for x in got)
            return ids

    def put(self, ids: list[int], keep: bool = True) -> None:
        """The chunks ``ids`` (lent to this process) are unmapped: on hand again, or closed
        (``keep`` False: this process's last release)."""
        if not ids:
            return
        with self._lock:
            self._request({"op": "put", "ids": ids, "keep": keep}, "done")

    def keep(self, ids: list[int]) -> list[int]:
        """The chunks ``ids`` (lent to this process) stay mapped here while its model is
        released: the holder may ask them back (the reclaim channel). Returns their generations
        (for :meth:`take`'s ``gens``; [] from a holder that says none). Raises HandoverError
        (RequestRefusedError: no reclaim channel, an id not lent here): unmap and put them."""
        if not ids:
            return []
        with self._lock:
            gens = self._request({"op": "keep", "ids": ids}, "done").get("gens")
        if not isinstance(gens, list) or len(gens) != len(ids) or not all(type(g) is int for g in gens):
            return []
        return gens

    def trim(self, keep_bytes: int = 0) -> int:
        """Close on-hand chunks down to ``keep_bytes``; the bytes on hand after."""
        with self._lock:
            return int(self._request({"op": "trim", "keep_bytes": keep_bytes}, "done").get("on_hand", 0))

    def status(self) -> dict[str, Any]:
        with self._lock:
            reply = self._request({"op": "status"}, "status")
            reply.pop("op", None)
            return reply


#: the largest chunk a holder may be started with (one chunk per buffer is the most that helps)
MAX_CHUNK_BYTES = 4 << 30
#: chunk sizes are multiples of this (every CUDA allocation granularity seen divides it)
CHUNK_STEP = 2 << 20


def chunk_choice() -> int:
    """The chunk size a new holder starts with: ``$TIMESHARE_HANDOVER_CHUNK`` (a size, rounded
    up to a multiple of 2 MiB, at most 4 GiB) or :data:`CHUNK_BYTES`. Larger chunks mean fewer
    map calls per restore and more padding per buffer (the last chunk's unused part)."""
    text = envvars.HANDOVER_CHUNK.text()
    if not text:
        return CHUNK_BYTES
    try:
        size = parse_size(text)
    except ValueError as exc:
        log.warning("$%s: %s; chunks of %d bytes", envvars.HANDOVER_CHUNK.name, exc, CHUNK_BYTES)
        return CHUNK_BYTES
    return min(MAX_CHUNK_BYTES, max(CHUNK_STEP, -(-size // CHUNK_STEP) * CHUNK_STEP))


def holder_env_ok() -> bool:
    """The hand-over may be used at all here: Linux (memfd, pidfds, SCM_RIGHTS)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")
