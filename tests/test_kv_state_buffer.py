"""The buffers KV states are read and snapshotted into (kv_files.state_buffer): zero bytes the
kernel provides as they are first written, so making one costs nothing while the GIL is held.
``bytearray(n)`` zero-fills its memory itself with the GIL held -- 1 GB for a 7,500-token chat on
an 8B model, during which every other thread of the worker (the arena's request for the GPU among
them) stood still. The oracle is the kernel's resident-set count: making the buffer touches none
of its pages; writing them does."""

from __future__ import annotations

import ctypes
import zlib
from pathlib import Path

from _proc_util import rss_of
from timeshare.core.worker import kv_files
from timeshare.core.worker.kv_files import KVSnapshot, state_buffer, truncated

N = 256 << 20


def test_a_state_buffer_touches_no_page_until_written() -> None:
    before = rss_of()
    buf = state_buffer(N)
    made = rss_of()
    assert len(buf) == N
    assert made - before < N // 16, f"making the buffer touched {made - before} of its {N} bytes"
    view = (ctypes.c_uint8 * N).from_buffer(buf)  # llama.cpp's way in: no copy
    ctypes.memset(view, 1, N)
    del view
    assert rss_of() - made > N // 2  # the oracle sees pages once they are written
    assert zlib.crc32(buf) == zlib.crc32(b"\x01" * N)


def test_a_fresh_state_buffer_reads_as_zeros_and_truncates_in_place() -> None:
    buf = state_buffer(10_000)
    assert bytes(buf[:10_000]) == bytes(10_000)
    buf[0:3] = b"abc"
    cut = truncated(buf, 3)
    assert cut is buf and len(cut) == 3 and bytes(cut[:3]) == b"abc"
    assert truncated(bytearray(b"xyz"), 2) == bytearray(b"xy")
    assert len(state_buffer(0)) == 0 and len(truncated(buf, 0)) == 0


def test_a_snapshot_file_round_trips_through_a_state_buffer(tmp_path: Path) -> None:
    state = state_buffer(9000)
    state[:] = bytes(range(256)) * 35 + bytes(range(40))
    ident = {"model": "m", "n_ctx": 64}
    snap = KVSnapshot(3, (5, 6, 7), state, pos_min=0, prompt_len=2)
    path = tmp_path / "m.kv"
    kv_files.write(path, "m", {"conversation": "c"}, snap, ident)
    got = kv_files.read(path, {"conversation": "c"}, ident)
    assert got is not None and got.input_ids == (5, 6, 7) and got.prompt_len == 2
    assert bytes(got.state[: len(got.state)]) == bytes(state[: len(state)])
