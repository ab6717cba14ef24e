"""The hand-over wire: the holder's socket and record, its messages, fds over SCM_RIGHTS and the
peer checks both ends make (issue 40; docs/INTERFACES.md, "Device memory handed over between
workers"). The holder is :mod:`.holder`, a worker's side :mod:`.handclient`.

Files in the arena directory (mode 0700, owned by the user: :mod:`.dirs` checks it):

    handover.sock   AF_UNIX SOCK_SEQPACKET socket the live holder listens on
    handover        the holder's record (pid, session, chunk size, bytes on hand and lent), a
                    checksummed fixed-size frame rewritten in place; the live holder keeps an
                    exclusive ``flock`` on it for its whole life, so a record nobody locks is
                    stale, and a peer whose pid is not the record's is not the holder

A message is a JSON object with an ``op`` and up to ``MAX_FDS`` file descriptors as SCM_RIGHTS
(the kernel takes at most 253 per packet). One of at most ``MAX_MESSAGE`` bytes is one packet. A
longer one (the ids of thousands of chunks: ids have up to 13 digits, so ~4,700 of them fill a
packet) is sent as a *long* message: a header packet ``{"op": "long", "bytes": N, "parts": K}``
(the fds ride on it) and then K packets of the JSON text, each at most ``MAX_MESSAGE`` bytes, N
bytes in all (at most ``MAX_LONG_MESSAGE``), read back to back (the socket's timeout bounds the
wait for each). Anything else -- a packet that is not JSON, a header whose counts do not add up,
a part with fds, a connection that ends inside a long message, a long message inside another --
is refused (HandoverError; every fd that came is closed). Fds that arrive with a message that
names none are closed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import resource
import socket
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ArenaError
from .budget import RECORD_SIZE, decode_record, encode_record
from .records import O_FILE

SOCKET_FILE = "handover.sock"
RECORD_FILE = "handover"
VERSION = 1
#: the most fds one packet carries (the kernel's SCM_MAX_FD is 253)
MAX_FDS = 250
#: the most bytes of JSON one packet carries (a longer message goes in parts)
MAX_MESSAGE = 64 << 10
#: the most bytes of JSON a message carries in all (a long message: header and parts)
MAX_LONG_MESSAGE = 32 << 20
#: the op of a long message's header packet (never a request or an answer of its own)
LONG_OP = "long"
#: on-hand chunks go back to the driver after this long without a take or a put (arena.handover_idle_s)
IDLE_S = 300.0
#: a take that asked kept chunks back waits this long for their owners' answers (then it gets
#: what is on hand)
RECLAIM_WAIT_S = 3.0
#: a worker's socket timeout for one answer of the holder: a take may wait RECLAIM_WAIT_S for
#: other owners, and a loaded machine schedules the holder late (5 s left too little margin: a
#: take timed out and the worker used its own memory); only a hung holder costs this wait
REQUEST_TIMEOUT_S = RECLAIM_WAIT_S + 12.0


class HandoverError(ArenaError):
    """The hand-over holder cannot be used: none answers, it was refused (a stranger's or stale
    socket), it ended, or it refused a request. The worker falls back to allocating and freeing
    its own device memory."""

    code = "handover"


class RequestRefusedError(HandoverError):
    """The holder refused one request (a chunk not lent to the asker, a bad count): the
    connection stays usable."""


class PeerRefusedError(HandoverError):
    """The other end of the socket is not who it must be (another uid, not the recorded holder)."""


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    """The credentials of the process at the other end (``SO_PEERCRED``: taken at connect)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one message and ``fds`` (at most MAX_FDS): one packet, or a long message's header
    (with the fds) and its parts when the JSON is longer than MAX_MESSAGE."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} fds in one message (at most {MAX_FDS})")
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_LONG_MESSAGE:
        raise ValueError(f"a hand-over message of {len(data)} bytes (at most {MAX_LONG_MESSAGE})")
    parts: list[bytes] = []
    if len(data) > MAX_MESSAGE:
        parts = [data[i : i + MAX_MESSAGE] for i in range(0, len(data), MAX_MESSAGE)]
        head = {"op": LONG_OP, "bytes": len(data), "parts": len(parts)}
        data = json.dumps(head, separators=(",", ":")).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)
    for part in parts:
        sock.sendall(part)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it (the caller owns them); (None, []) at the end
    of the connection. A packet that is not a JSON object with an ``op``, fds cut short
    (MSG_CTRUNC) or a long message that does not add up raises HandoverError (its fds are
    closed)."""
    data, fds, flags, _addr = socket.recv_fds(sock, MAX_MESSAGE + 1, MAX_FDS + 3)
    if not data and not fds:
        return None, []
    try:
        if flags & socket.MSG_CTRUNC:
            raise HandoverError("a hand-over message lost some of its file descriptors (MSG_CTRUNC)")
        if len(data) > MAX_MESSAGE:
            raise HandoverError(f"a hand-over packet longer than {MAX_MESSAGE} bytes")
        message = _parse(data)
        if message["op"] == LONG_OP:
            message = _parse(_read_parts(sock, message))
            if message["op"] == LONG_OP:
                raise HandoverError("a long hand-over message inside another")
    except BaseException:
        close_all(fds)
        raise
    return message, fds


def _parse(data: bytes | bytearray) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except ValueError:
        raise HandoverError("a hand-over message that is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise HandoverError("a hand-over message that is not an object with an 'op'")
    return message


def _read_parts(sock: socket.socket, head: dict[str, Any]) -> bytearray:
    """The JSON text of a long message whose header is ``head``: its parts, read now."""
    total, count = head.get("bytes"), head.get("parts")
    if (
        not isinstance(total, int)
        or not isinstance(count, int)
        or isinstance(total, bool)
        or isinstance(count, bool)
        or not MAX_MESSAGE < total <= MAX_LONG_MESSAGE
        or count != -(-total // MAX_MESSAGE)
    ):
        raise HandoverError(
            f"a long hand-over message of {total!r} bytes in {count!r} parts (more than {MAX_MESSAGE} "
            f"and at most {MAX_LONG_MESSAGE} bytes, in packets of {MAX_MESSAGE})"
        )
    text = bytearray()
    for _ in range(count):
        part, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE + 1, MAX_FDS + 3)
        if fds:
            close_all(fds)
            raise HandoverError("file descriptors with a part of a long hand-over message")
        if not part:
            raise HandoverError("the connection ended inside a long hand-over message")
        if len(part) > MAX_MESSAGE or len(text) + len(part) > total:
            raise HandoverError(f"a long hand-over message longer than it said ({total} bytes)")
        text += part
    if len(text) != total:
        raise HandoverError(f"a long hand-over message of {len(text)} bytes, not the {total} it said")
    return text


def fd_room(need: int | None = None) -> int:
    """Raise this process's soft open-files limit (``RLIMIT_NOFILE``, never above the hard one)
    so that ``need`` more fds fit beside those open now (None: as high as the hard limit lets):
    the holder holds one fd per chunk, a worker receives one per chunk it takes before importing
    them (a desktop's soft limit is often 1024: 2 GiB of 2 MiB chunks). Returns the soft limit
    in force (-1: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return -1
    if need is None:
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    else:
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = soft
        want = open_now + max(0, need) + 64
    if hard != resource.RLIM_INFINITY:
        want = min(hard, want)
    if want > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# ---- the holder's record ----------------------------------------------------------------------


@dataclass(frozen=True)
class HolderState:
    """The live holder's record (``arena/handover``)."""

    pid: int
    session: str
    chunk: int
    on_hand_bytes: int = 0
    lent_bytes: int = 0
    at: float = 0.0  # wall clock of the last rewrite

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "session": self.session,
            "chunk": self.chunk,
            "on_hand_bytes": self.on_hand_bytes,
            "lent_bytes": self.lent_bytes,
            "at": self.at,
        }


def parse_state(data: dict[str, Any] | None) -> HolderState | None:
    if data is None:
        return None
    ints = [data.get(k) for k in ("pid", "chunk", "on_hand_bytes", "lent_bytes")]
    session, at = data.get("session"), data.get("at", 0.0)
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in ints):
        return None
    if not isinstance(session, str) or not isinstance(at, (int, float)) or isinstance(at, bool):
        return None
    pid, chunk, on_hand, lent = (int(x) for x in ints)  # type: ignore[arg-type]
    return HolderState(pid, session[:64], chunk, on_hand, lent, float(at))


def open_record(dir_fd: int) -> int:
    """Open (create) the holder's record file in the arena: a regular file, never through a link."""
    fd = os.open(RECORD_FILE, os.O_RDWR | os.O_CREAT | O_FILE, 0o600, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HandoverError(f"the arena's {RECORD_FILE} is not a regular file: remove it")
    return fd


def write_state(fd: int, state: HolderState) -> None:
    os.pwrite(fd, encode_record(state.to_json()), 0)


def read_state(dir_fd: int) -> HolderState | None:
    """The live holder's record; None when there is no holder (nobody locks the record)."""
    try:
        fd = os.open(RECORD_FILE, os.O_RDONLY | os.O_NONBLOCK | O_FILE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # the holder's exclusive lock: it lives
        else:
            return None  # nobody holds it (our shared lock goes with the close)
        for _ in range(20):  # a frame being rewritten: read again
            state = parse_state(decode_record(os.pread(fd, RECORD_SIZE + 1, 0)))
            if state is not None:
                return state
            time.sleep(0.0005)
        return None
    finally:
        os.close(fd)


def check_socket_path(dir_fd: int) -> None:
    """The socket's name is a socket owned by this uid (not a link, not another user's): raises
    PeerRefusedError naming what it is. FileNotFoundError when there is none."""
    st = os.lstat(SOCKET_FILE, dir_fd=dir_fd)
    if not stat.S_ISSOCK(st.st_mode):
        raise PeerRefusedError(
            f"the arena's {SOCKET_FILE} is not a socket (mode {stat.filemode(st.st_mode)})"
        )
    if st.st_uid != os.geteuid():
        raise PeerRefusedError(
            f"the arena's {SOCKET_FILE} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
        )


def connect(dir_fd: int, dir_path: str, timeout: float) -> socket.socket:
    """Connect to the arena's socket and check who answers: the same uid, and the pid of the
    holder's live record. Raises FileNotFoundError / ConnectionRefusedError (no holder: a stale
    or missing socket) or PeerRefusedError (a stranger)."""
    check_socket_path(dir_fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        # connect by /proc/self/fd/N/name: the checked directory, not whatever its path names now
        path = f"/proc/self/fd/{dir_fd}/{SOCKET_FILE}"
        if len(path) >= 100 or not os.path.isdir(f"/proc/self/fd/{dir_fd}"):
            path = os.path.join(dir_path, SOCKET_FILE)
        sock.connect(path)
        peer = peer_of(sock)
        if peer.uid != os.geteuid():
            raise PeerRefusedError(
                f"the process behind the arena's {SOCKET_FILE} runs as uid {peer.uid}, not as you"
            )
        state = read_state(dir_fd)
        if state is None or state.pid != peer.pid:
            raise PeerRefusedError(
                f"the process behind the arena's {SOCKET_FILE} (pid {peer.pid}) is not the live "
                "hand-over holder"
            )
        return sock
    except BaseException:
        sock.close()
        raise


def not_there(exc: OSError) -> bool:
    """A connect error that means no holder listens (missing or stale socket)."""
    return isinstance(exc, (FileNotFoundError, ConnectionRefusedError)) or exc.errno in (
        errno.ENOENT,
        errno.ECONNREFUSED,
    )
