"""The room a restoring worker says it may allocate chunks in (issue 40) leaves out what the
restore allocates after the weights: a deep restore whose context was freed makes it again after
mapping the weights (its KV cache and compute buffers), so a take that counted those bytes as
room would create chunks in memory the context then lacks, while kept chunks of another worker
(that the holder could have asked back) stay idle.

On the CPU: the real holder, real fds over the real socket, real worker processes and real
llama-cpp-python models; the memfd stand-in (``MemfdDevice``, named as such: no GPU) plays the
device and says the free memory a test gives it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import llama_cpp  # before numpy
import pytest
from _handover_util import CHUNK, Worker, arena_dir, clients_closed, new_tag, observer, worker_list
from _residency_util import Greedy, load, same
from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.devmem.device import Given
from timeshare.core.devmem.mapped import ROOM_MARGIN_FRACTION, ROOM_MARGIN_MIN, HandedMemory
from timeshare.core.devmem.memfd import MemfdDevice
from timeshare.core.gguf.header import parse_metadata
from timeshare.core.gguf.kvcache import KvShape, kv_shape
from timeshare.core.residency import Residency, ResidencyOptions
from timeshare.core.worker.footprint import compute_bytes

tag = pytest.fixture(name="tag")(new_tag)
arena = pytest.fixture(name="arena")(arena_dir)
workers = pytest.fixture(name="workers")(worker_list)
_close_clients = pytest.fixture(name="_close_clients", autouse=True)(clients_closed)

MODEL_CHUNK = 8 << 20


def margin() -> int:
    """The room margin the stand-in's figures give (its total is the host's memory)."""
    total = os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE
    return max(ROOM_MARGIN_MIN, int(ROOM_MARGIN_FRACTION * total))


class Rooms:
    """The real hand-over client, recording the room each take said."""

    def __init__(self, client: HandoverClient) -> None:
        self.client = client
        self.rooms: list[int | None] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def take(
        self, n: int, room: int | None = None, use: list[int] | None = None, gens: list[int] | None = None
    ) -> Given:
        self.rooms.append(room)
        return self.client.take(n, room, use, gens)


# ---- the mapped memory: what comes later is not room ----------------------------------------


def test_the_room_a_take_says_leaves_out_what_comes_later(arena: Path, tag: str) -> None:
    free = margin() + 10 * CHUNK
    source = Rooms(observer(arena))
    mem = HandedMemory(MemfdDevice(tag, free_bytes=free), source, CHUNK)  # type: ignore[arg-type]
    rep = mem.map_all([(1, 2 * CHUNK)])
    assert source.rooms == [10 * CHUNK] and (rep.room, rep.later) == (10 * CHUNK, 0)
    rep = mem.map_all([(2, 2 * CHUNK)], later=3 * CHUNK)
    assert source.rooms[-1] == 7 * CHUNK and (rep.room, rep.later) == (7 * CHUNK, 3 * CHUNK)
    mem.map_all([(3, 2 * CHUNK)], later=50 * CHUNK)
    assert source.rooms[-1] == 0  # never below nothing
    mem.room_bytes = 4 * CHUNK  # $TIMESHARE_HANDOVER_ROOM: the room, of which later takes its share
    mem.map_all([(4, CHUNK)], later=CHUNK)
    assert source.rooms[-1] == 3 * CHUNK
    mem.close()


def test_a_restore_that_allocates_later_has_kept_chunks_asked_back_for_it(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    """B has room for 4 chunks: with nothing to allocate after them it creates its own and A's
    kept chunks stay; with 3 chunks' worth of context to allocate afterwards it may create one,
    and the holder asks A's kept chunks back for the other 3 (A unmaps its whole range: all 4
    come on hand, and B creates nothing)."""
    obs = observer(arena)
    a = Worker(arena, tag)
    b = Worker(arena, tag, "", str(margin() + 4 * CHUNK))
    workers += [a, b]
    a(f"map 1 {4 * CHUNK}")
    a("fill 1 9")
    assert a("release 1") == "ok 4 kept=True"
    out = b(f"map 1 {4 * CHUNK}")
    assert out.startswith("ok handed=0 created=4") and out.endswith(f"room={4 * CHUNK}"), out
    assert obs.status()["asked_back"] == 0
    assert b("release 1") == "ok 4 kept=True"  # B's own stay kept too (never asked for B's take)
    out = b(f"map 2 {4 * CHUNK} {3 * CHUNK}")
    assert out.startswith("ok handed=4 created=0") and out.endswith(f"room={CHUNK}"), out
    assert b("check 2 9") == "ok"  # A's memory, nothing allocated
    st = obs.status()
    assert (st["asked_back"], st["released"]) == (3, 4)  # A unmapped its range at the request
    assert st["kept_bytes"] == 4 * CHUNK  # B's first four
    a.end()
    b.end()


# ---- the residency: a deep restore's new context --------------------------------------------


def _kv_oracle(path: Path, n_ctx: int) -> int:
    """The KV cache of one sequence of ``n_ctx`` cells from the GGUF's shape (core/gguf, checked
    against llama.cpp's buffers in tests/test_kvcache.py), f16."""
    data = path.read_bytes()
    shape = kv_shape(parse_metadata(data, len(data))[4])
    assert isinstance(shape, KvShape)
    return shape.bytes(n_ctx, 1)


def test_a_deep_restore_keeps_its_new_context_out_of_the_room(
    smol: llama_cpp.Llama, smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = 1 << 30
    monkeypatch.setenv("TIMESHARE_HANDOVER_ROOM", str(room))  # read at attach
    monkeypatch.setenv("TIMESHARE_HANDOVER_KEEP", "0")  # each restore takes its chunks again
    greedy = Greedy(smol)
    reference = greedy.run()
    observer(tmp_path / "arena", chunk=MODEL_CHUNK)
    source = Rooms(observer(tmp_path / "arena"))
    res = Residency.attach(smol, smollm2_path, ResidencyOptions(handover=True), chunk_source=source)  # type: ignore[arg-type]
    try:
        assert res.kv_in_place and res.handover_note == ""
        compute = compute_bytes(smol.ctx)
        context = _kv_oracle(smollm2_path, smol.n_ctx()) + compute.device + compute.host
        assert compute.device + compute.host > 0
        for kv, free_context, later in (
            (False, False, 0),  # the weights alone: nothing after them
            (True, False, 0),  # deep, in place: the KV and compute buffers come back before them
            (True, True, context),  # deep, the context freed: made again after the weights
            (True, False, 0),
        ):
            res.release(kv=kv, free_context=free_context)
            assert res.later_bytes == later
            source.rooms.clear()
            res.restore()
            res.settle()
            steps = res.restore_steps
            assert source.rooms == [room - later]  # one take, for every chunk
            assert (steps.room_bytes, steps.later_bytes) == (room - later, later)
            assert same(reference, greedy.run())
            assert res.later_bytes == 0
    finally:
        res.close()


def test_a_context_whose_kv_buffers_are_not_found_counts_the_owners_kv_figure(gemma3_path: Path) -> None:
    """Gemma-3's sliding-window cache is not handled in place (``kv_note``): every deep release
    frees the context, and the restore makes it again after the weights. The KV level cannot
    size that cache from its buffers; the owner's figure (the worker's, from the GGUF's shape)
    stands for it, beside the compute buffers the scheduler reports."""
    llm = load(gemma3_path)
    try:
        greedy = Greedy(llm)
        reference = greedy.run()
        res = Residency.attach(llm, gemma3_path, ResidencyOptions())
        try:
            assert not res.kv_in_place and "sliding-window" in res.kv_note
            kv = _kv_oracle(gemma3_path, llm.n_ctx())
            res.kv_hint_bytes = kv
            compute = compute_bytes(llm.ctx)
            assert res.later_bytes == 0  # nothing released
            res.release(kv=True)
            assert res.later_bytes == kv + compute.device + compute.host
            res.restore()
            assert res.later_bytes == 0
            assert same(reference, greedy.run())
        finally:
            res.close()
    finally:
        llm.close()
