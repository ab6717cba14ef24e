"""The hand-over wire carries messages longer than one packet (issue 40): a model of thousands of
chunks (a 70 GB model in 2 MiB chunks is 35,000; each id has up to 13 digits, so ~4,700 ids fill
the 64 KiB packet) names them all in one ``keep``, ``take {use, gens}``, ``given {intact}`` or
``put``. Such a message goes as a header packet and parts; garbage in that shape is refused.

On the CPU: the real holder, real fds over the real Unix socket (SCM_RIGHTS) and the memfd
stand-in (``MemfdDevice``, named as such: no GPU), in chunks of one page so that thousands of
chunks are a few MiB.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from _handover_util import arena_dir, clients_closed, new_tag, observer
from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.arena.handover import (
    MAX_LONG_MESSAGE,
    MAX_MESSAGE,
    HandoverError,
    RequestRefusedError,
    connect,
    receive,
    send,
)
from timeshare.core.devmem.mapped import HandedMemory
from timeshare.core.devmem.memfd import MemfdDevice

tag = pytest.fixture(name="tag")(new_tag)
arena = pytest.fixture(name="arena")(arena_dir)
_close_clients = pytest.fixture(name="_close_clients", autouse=True)(clients_closed)

PAGE = mmap.PAGESIZE
#: chunks of one buffer: its ids alone are well over one packet (the keep, the put: ~140 KB of
#: 13-digit ids), the take's ids and generations about twice it
MANY = 10000


class Recorded:
    """The real hand-over client, recording the ids its last keep named."""

    def __init__(self, client: HandoverClient) -> None:
        self.client = client
        self.kept: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def keep(self, ids: list[int]) -> list[int]:
        self.kept = list(ids)
        return self.client.keep(ids)


def every_byte(mem: HandedMemory, key: int, nbytes: int) -> int | None:
    data = ctypes.string_at(mem.address(key), nbytes)
    return data[0] if data.count(data[:1]) == len(data) else None


def test_thousands_of_chunks_are_kept_vouched_for_and_handed_over(arena: Path, tag: str) -> None:
    client = observer(arena, chunk=PAGE)
    source = Recorded(client)
    mem = HandedMemory(MemfdDevice(tag), source, PAGE)  # type: ignore[arg-type]
    size = MANY * PAGE
    rep = mem.map_all([(1, size)])
    assert (rep.created, rep.adopted, rep.note) == (MANY, MANY, "")
    ctypes.memset(mem.address(1), 0x5A, size)
    mem.mark_filled([1])
    # the release keeps every chunk mapped: one keep naming MANY ids
    assert mem.unmap([1]) == MANY and mem.kept(1), mem.source_note
    assert mem.source_note == ""
    st = client.status()
    assert st["kept_bytes"] == size and st["lent_bytes"] == 0
    # the restore names them all with their generations (take {use, gens}) and the holder
    # vouches for them all (given {intact}): nothing mapped, nothing to upload
    rep = mem.map_all([(1, size)])
    assert (rep.kept, rep.intact, rep.mapped, rep.handed, rep.created, rep.note) == (MANY, MANY, 0, 0, 0, "")
    assert mem.filled(1) and every_byte(mem, 1, size) == 0x5A
    st = client.status()
    assert (st["reused"], st["intact"], st["lent_bytes"]) == (MANY, MANY, size)
    # how long those messages were: well over one packet
    assert len(source.kept) == MANY
    assert len(json.dumps({"op": "keep", "ids": source.kept}, separators=(",", ":"))) > MAX_MESSAGE
    # unmapped and put back (one put naming MANY ids): on hand, and another worker's mapping
    # takes them all (given in batches of fds, nothing created)
    assert mem.unmap([1], keep_mapped=False) == MANY
    assert mem.source_note == ""
    st = client.status()
    assert (st["on_hand_bytes"], st["lent_bytes"], st["kept_bytes"]) == (size, 0, 0)
    other = HandedMemory(MemfdDevice(tag), observer(arena, chunk=PAGE), PAGE)
    rep = other.map_all([(7, size)])
    assert (rep.handed, rep.created, rep.note) == (MANY, 0, "")
    assert every_byte(other, 7, size) == 0x5A  # the same memory (nothing cleared, nothing copied)
    other.close()
    mem.close()
    assert client.status()["chunks"] == 0  # the closes put every chunk back, closed


def test_a_long_request_with_a_bad_id_is_refused_and_the_connection_stays(arena: Path) -> None:
    client = observer(arena, chunk=PAGE)
    bogus = [(1 << 40) + i for i in range(MANY)]
    with pytest.raises(RequestRefusedError, match="is not lent or kept by pid"):
        client.put(bogus)  # the holder read the whole list (a long message) and refused it
    assert client.status()["chunks"] == 0  # the same connection answers


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.settimeout(5.0)
    b.settimeout(5.0)
    return a, b


def test_a_long_message_round_trips_with_its_fds() -> None:
    a, b = _pair()
    r, w = os.pipe()
    try:
        message = {"op": "given", "ids": list(range(1 << 40, (1 << 40) + 3 * MANY)), "more": False}
        # more than the socket buffers: the sender blocks until the receiver reads (a thread)
        sender = threading.Thread(target=send, args=(a, message, [r, w]))
        sender.start()
        got, fds = receive(b)
        sender.join()
        assert got == message and len(fds) == 2
        os.write(fds[1], b"x")  # the pipe's ends came across
        assert os.read(r, 1) == b"x"
        for fd in fds:
            os.close(fd)
        send(a, {"op": "done"})  # the stream is in step after it
        assert receive(b) == ({"op": "done"}, [])
    finally:
        a.close()
        b.close()
        os.close(r)
        os.close(w)


def _head(nbytes: int, parts: int) -> bytes:
    return json.dumps({"op": "long", "bytes": nbytes, "parts": parts}).encode()


@pytest.mark.parametrize(
    ("packets", "why"),
    [
        ([_head(10, 1), b"{}"], "more than 65536"),  # a short message never goes in parts
        ([_head(MAX_LONG_MESSAGE + 1, 513), b"x"], "in 513 parts"),
        ([_head(MAX_MESSAGE + 5, 3), b"x"], "in 3 parts"),  # the counts do not add up
        ([_head(MAX_MESSAGE + 5, True), b"x"], "in True parts"),
        ([_head(MAX_MESSAGE + 5, 2), b"x" * MAX_MESSAGE, b"x" * 9], "longer than it said"),
        ([_head(MAX_MESSAGE + 5, 2), b"x" * MAX_MESSAGE, b"x" * 3], "not the 65541 it said"),
        ([_head(MAX_MESSAGE + 5, 2), b"x" * MAX_MESSAGE, b"x" * 5], "not JSON"),
        (
            [_head(MAX_MESSAGE + 5, 2), b'{"op":"long","x":"' + b"x" * (MAX_MESSAGE - 18), b'"}' + b" " * 3],
            "inside another",
        ),
        ([_head(MAX_MESSAGE + 5, 2), b"x" * MAX_MESSAGE], "ended inside"),
    ],
    ids=["short", "too-long", "miscounted", "bool", "overlong", "short-parts", "not-json", "nested", "cut"],
)
def test_a_long_message_that_does_not_add_up_is_refused(packets: list[bytes], why: str) -> None:
    a, b = _pair()

    def write() -> None:
        try:
            for p in packets:
                a.send(p)
            a.shutdown(socket.SHUT_WR)  # the end of the connection comes after the packets
        except (BrokenPipeError, ConnectionResetError):
            pass  # the receiver refused before the rest was sent and closed its end: expected

    sender = threading.Thread(target=write)  # more than the socket buffers: a thread sends
    sender.start()
    try:
        with pytest.raises(HandoverError, match=why):
            receive(b)
    finally:
        b.close()  # a sender still writing gets an error (EPIPE), and ends
        sender.join()
        a.close()


def test_fds_with_a_part_are_closed_and_refused() -> None:
    a, b = _pair()
    r, w = os.pipe()
    try:
        a.send(_head(MAX_MESSAGE + 5, 2))
        socket.send_fds(a, [b"x" * MAX_MESSAGE], [r])
        os.close(r)
        with pytest.raises(HandoverError, match="file descriptors with a part"):
            receive(b)
        with pytest.raises(BrokenPipeError):  # the received read end was closed: nobody reads
            os.write(w, b"x")
    finally:
        a.close()
        b.close()
        os.close(w)


def test_the_holder_drops_a_connection_that_sends_a_bad_long_message(arena: Path) -> None:
    client = observer(arena, chunk=PAGE)
    dir_fd = os.open(arena, os.O_RDONLY)
    raw = connect(dir_fd, str(arena), 5.0)
    try:
        send(raw, {"op": "hello", "v": 1, "pid": os.getpid(), "model": "raw"})
        assert receive(raw)[0]["op"] == "welcome"  # type: ignore[index]
        raw.send(_head(MAX_MESSAGE + 5, 2))
        raw.send(b"not json at all" * 10)
        raw.send(b"x" * (MAX_MESSAGE + 5 - 150))
        assert receive(raw) == (None, [])  # the holder closed it
    finally:
        raw.close()
        os.close(dir_fd)
    assert client.status()["connections"] == 1  # the holder lives on: only the observer
