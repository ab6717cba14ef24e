"""core/util/crc.py: the parallel CRC-32 equals zlib.crc32 (the oracle) for every split of a buffer
into chunks, and a KV snapshot file written and read in chunks keeps the format its readers know
(one CRC-32 of the token ids then the state, in the header)."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest
from timeshare.core.util import crc
from timeshare.core.worker import kv_files
from timeshare.core.worker.kv_files import KVSnapshot


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 64, 1000, 4097])
@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 64, 4096])
def test_chunked_crc_equals_zlib(size: int, chunk: int) -> None:
    data = os.urandom(size)
    for start in (0, 1, 0xDEADBEEF):
        got = crc.crc32_chunks(size, lambda a, b: zlib.crc32(data[a:b]), start, chunk=chunk)
        assert got == zlib.crc32(data, start), (size, chunk, start)


def test_combine_is_crc_of_the_concatenation() -> None:
    a, b = os.urandom(1234), os.urandom(98765)
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc.combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)


def test_large_buffer_on_threads() -> None:
    data = bytearray(os.urandom(1 << 16)) * 1100  # about 72 MB: three chunks
    assert len(crc.chunks(len(data))) == 3
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(memoryview(data)[5:], 7) == zlib.crc32(memoryview(data)[5:], 7)


def test_kv_file_round_trip_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crc, "CHUNK_BYTES", 4096)  # many chunks from a small state
    calls: list[int] = []
    real = crc.combine
    monkeypatch.setattr(crc, "combine", lambda a, b, n: calls.append(n) or real(a, b, n))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ident = kv_files.identity(str(model), 512)
    state = bytearray(os.urandom(50_001))
    snap = KVSnapshot(3, (1, 2, 3), state, pos_min=0, prompt_len=2)
    target = tmp_path / "kv" / "m-x.kv"
    kv_files.write(target, "m", {"conversation": "x"}, snap, ident)
    data = target.read_bytes()
    # the format as its docstring says: magic, u32 header length, JSON header, ids, state
    magic_end = data.index(b"\n") + 1
    (hlen,) = struct.unpack_from(">I", data, magic_end)
    header = json.loads(data[magic_end + 4 : magic_end + 4 + hlen])
    ids = data[magic_end + 4 + hlen : magic_end + 4 + hlen + 12]
    assert header["crc32"] == zlib.crc32(bytes(state), zlib.crc32(ids))
    got = kv_files.read(target, {"conversation": "x"}, ident)
    assert got is not None and got.state == state and got.input_ids == (1, 2, 3) and got.prompt_len == 2
    assert not target.exists()
    assert len(calls) >= 2 * 13  # written and read in 13 chunks of 4 KiB
    # one flipped bit in the last chunk is caught
    kv_files.write(target, "m", {"conversation": "x"}, snap, ident)
    raw = bytearray(target.read_bytes())
    raw[-3] ^= 0x10
    target.write_bytes(raw)
    assert kv_files.read(target, {"conversation": "x"}, ident) is None
    assert not target.exists()


def test_kv_file_read_ahead_checks_the_identity_when_it_is_known(tmp_path: Path) -> None:
    """A restarted worker reads a conversation's file while its model loads, before the identity
    (the context size llama.cpp settles on) is known: the result is read()'s, checked then."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ident = kv_files.identity(str(model), 512)
    snap = KVSnapshot(2, (7, 8), bytearray(os.urandom(9000)), prompt_len=1)
    target = tmp_path / "kv" / "m-x.kv"
    kv_files.write(target, "m", {"conversation": "x"}, snap, ident)
    ahead = kv_files.ReadAhead(target, {"conversation": "x"})
    got = ahead.result(ident)
    assert got is not None and got.state == snap.state and got.input_ids == (7, 8)
    assert not target.exists()
    kv_files.write(target, "m", {"conversation": "x"}, snap, ident)
    other = kv_files.identity(str(model), 1024)  # another context size: refused once known
    assert kv_files.ReadAhead(target, {"conversation": "x"}).result(other) is None
    assert not target.exists()
    kv_files.write(target, "m", {"conversation": "x"}, snap, ident)
    assert kv_files.ReadAhead(target, {"conversation": "y"}).result(ident) is None  # another key
