"""A restore into kept memory that still holds the weights uploads nothing (issue 40): a released
worker keeps its chunks mapped; when nobody else mapped them since (the holder vouches for each
chunk by its generation) and the worker filled them before its release, its next restore skips
their upload. Anything else -- a chunk lent to another worker in between, asked back, scribbled
on, a holder gone, a fill never completed -- is uploaded again.

On the CPU with the real holder, real fds over the real socket and the memfd stand-in
(``MemfdDevice``, named as such: no GPU; tests/_handover_util.py). The residency tests use real
llama-cpp-python models and compare with an oracle of their own: a fresh ``llama_cpp.Llama`` of
the same file, never released.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
from pathlib import Path
from typing import Any

import llama_cpp  # before numpy
import numpy as np
import pytest
from _handover_util import (
    CHUNK,
    Worker,
    alive,
    arena_dir,
    clients_closed,
    new_tag,
    observer,
    wait_for,
    worker_list,
)
from _residency_util import Greedy, load, same
from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.arena.ledger import Ledger, LedgerError
from timeshare.core.devmem.device import Given
from timeshare.core.devmem.mapped import HandedMemory
from timeshare.core.devmem.memfd import MemfdDevice
from timeshare.core.residency import Residency, ResidencyOptions
from timeshare.core.residency import uploads as uploads_mod

MODEL = str(Path(__file__).with_name("_handover_model.py"))
MODEL_CHUNK = 8 << 20

tag = pytest.fixture(name="tag")(new_tag)
arena = pytest.fixture(name="arena")(arena_dir)
workers = pytest.fixture(name="workers")(worker_list)
_close_clients = pytest.fixture(name="_close_clients", autouse=True)(clients_closed)


def oracle_logits(path: Path) -> list[np.ndarray[Any, Any]]:
    """8 greedy steps of a fresh llama-cpp-python model of ``path`` (never released)."""
    llm = load(path)
    try:
        return Greedy(llm).run()
    finally:
        llm.close()


# ---- the ledger (pure): generations ---------------------------------------------------------


def test_a_kept_chunk_is_vouched_for_only_at_the_generation_its_keep_gave() -> None:
    led = Ledger(CHUNK)
    ids = led.adopt([10, 11], pid=100)
    gens = led.keep(100, ids, now=1.0)
    assert led.use(100, ids, gens) == ids  # untouched: both vouched for
    assert led.stats.intact == 2
    led.keep(100, ids, now=2.0)
    assert led.use(100, ids) == []  # no generations named: nothing vouched for
    gens = led.keep(100, ids, now=3.0)
    # the first chunk goes round: asked back, released, lent to pid 200 and put back by it, lent
    # to 100 again (the same id) and kept by it: its generation moved on at each step
    assert led.ask_back(1, but=200) == {100: ids[:1]}
    assert led.released(100, ids[:1], ids[:1], now=4.0) == 1
    assert [c.id for c in led.give(200, 1)] == ids[:1]
    led.put(200, ids[:1], now=5.0)
    assert [c.id for c in led.give(100, 1)] == ids[:1]
    assert led.keep(100, ids[:1], now=6.0)[0] > gens[0]
    with pytest.raises(LedgerError, match="1 generation"):
        led.use(100, ids, gens[:1])  # one generation for two chunks: refused, nothing changed
    assert led.kept_by(100) == ids
    assert led.use(100, ids, gens) == ids[1:]  # the old generation no longer vouches for it


@pytest.mark.parametrize("way", ["exit", "put"])
def test_an_exit_or_a_put_moves_the_generation_on(way: str) -> None:
    led = Ledger(CHUNK)
    ids = led.adopt([1], pid=7)
    gens = led.keep(7, ids, now=1.0)
    if way == "exit":
        assert led.pid_gone(7, now=2.0) == 1
    else:
        led.use(7, ids, gens)
        led.put(7, ids, now=2.0)
    assert [c.id for c in led.give(7, 1)] == ids  # (a new process of the same pid, or the same)
    led.keep(7, ids, now=3.0)
    assert led.use(7, ids, gens) == []


# ---- the mapped memory with the real holder (the memfd stand-in) ----------------------------


class Recorded:
    """The real hand-over client, recording the chunk ids its adopts, takes and keeps named (the
    test's view of a mapping's chunks). Everything else is the client's."""

    def __init__(self, client: HandoverClient) -> None:
        self.client = client
        self.adopted: list[int] = []
        self.taken: list[int] = []
        self.kept: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def adopt(self, fds: list[int]) -> list[int]:
        self.adopted = self.client.adopt(fds)
        return self.adopted

    def take(
        self, n: int, room: int | None = None, use: list[int] | None = None, gens: list[int] | None = None
    ) -> Given:
        got = self.client.take(n, room, use, gens)
        self.taken = [i for i, _fd in got.chunks]
        return got

    def keep(self, ids: list[int]) -> list[int]:
        self.kept = list(ids)
        return self.client.keep(ids)


def memory(arena: Path, tag: str, free: int | None = None) -> tuple[HandedMemory, Recorded]:
    source = Recorded(observer(arena))
    mem = HandedMemory(MemfdDevice(tag, free_bytes=free), source, CHUNK)  # type: ignore[arg-type]
    return mem, source


def fill(mem: HandedMemory, key: int, byte: int, nbytes: int) -> None:
    ctypes.memset(mem.address(key), byte, nbytes)


def every_byte(mem: HandedMemory, key: int, nbytes: int) -> int | None:
    """The byte every byte of the range is, or None when they differ."""
    data = ctypes.string_at(mem.address(key), nbytes)
    return data[0] if data.count(data[:1]) == len(data) else None


def test_untouched_kept_chunks_are_vouched_for_and_keep_their_bytes(arena: Path, tag: str) -> None:
    mem, _src = memory(arena, tag)
    size = 3 * CHUNK
    rep = mem.map_all([(1, size)])
    assert (rep.created, rep.intact) == (3, 0) and not mem.filled(1)  # fresh: to be uploaded
    fill(mem, 1, 0x5A, size)
    mem.mark_filled([1])
    for _ in range(3):
        assert mem.unmap([1]) == 3 and mem.kept(1)
        rep = mem.map_all([(1, size)])
        assert (rep.kept, rep.mapped, rep.intact) == (3, 0, 3)
        assert mem.filled(1)  # nothing to upload
        assert every_byte(mem, 1, size) == 0x5A
    st = observer(arena).status()
    assert (st["reused"], st["intact"]) == (9, 9)
    mem.close()


def test_a_range_never_filled_is_not_vouched_for(arena: Path, tag: str) -> None:
    """A release after an upload that did not end (or failed): the range is kept, its bytes are
    not the buffer's -- the next mapping uploads it though the holder vouches for the chunks."""
    mem, _src = memory(arena, tag)
    mem.map_all([(1, 2 * CHUNK)])
    assert mem.unmap([1]) == 2 and mem.kept(1)
    rep = mem.map_all([(1, 2 * CHUNK)])
    assert (rep.kept, rep.intact) == (2, 0) and not mem.filled(1)
    st = observer(arena).status()
    assert (st["reused"], st["intact"]) == (2, 0)  # no generation named for a range never filled
    mem.close()


def test_chunks_scribbled_on_by_another_holder_of_them_are_caught_by_their_generation(
    arena: Path, tag: str
) -> None:
    """The case only the generations catch: the range stayed mapped and kept, its chunks are kept
    by this pid again under the same ids -- but they went round in between and another mapping of
    them wrote over the bytes. The test's own second connection plays that other holder of them
    (the same pid: the holder lets it use, put, take and keep the chunks as their owner could)."""
    mem, src = memory(arena, tag)
    size = 3 * CHUNK
    mem.map_all([(1, size)])
    fill(mem, 1, 0x5A, size)
    mem.mark_filled([1])
    assert mem.unmap([1]) == 3 and mem.kept(1)
    ids = sorted(src.kept)
    assert ids == sorted(src.adopted) and len(ids) == 3
    other = observer(arena)
    other.take(0, use=ids)  # in use again (no generations named: nothing vouched for)
    other.put(ids)  # on hand
    got = other.take(3)
    assert sorted(i for i, _fd in got.chunks) == ids  # the same chunks, the same ids
    for _i, fd in got.chunks:  # another mapping of them writes over the bytes
        with mmap.mmap(fd, CHUNK) as m:
            m[:] = b"\xee" * CHUNK
        os.close(fd)
    other.keep(ids)  # kept by this pid again: only the generations differ
    rep = mem.map_all([(1, size)])
    assert (rep.kept, rep.mapped, rep.intact) == (3, 0, 0)
    assert not mem.filled(1)  # uploaded again
    assert every_byte(mem, 1, size) == 0xEE  # what a skipped upload would have left
    mem.close()


def test_chunks_lent_to_another_worker_in_between_are_uploaded_again(
    arena: Path, tag: str, workers: list[Worker]
) -> None:
    """A keeps; B (a full card) has A's chunks asked back, writes over them and keeps them; A
    (a full card too) has them back -- the same ids -- and uploads: its range was unmapped when
    asked back, and the chunks' generations moved on."""
    mem, src = memory(arena, tag, free=0)
    size = 2 * CHUNK
    mem.map_all([(1, size)])
    fill(mem, 1, 0x21, size)
    mem.mark_filled([1])
    mem.unmap([1])
    first = sorted(src.kept)
    b = Worker(arena, tag, "", "0")
    workers.append(b)
    assert b(f"map 5 {size}").startswith("ok handed=2 created=0")
    assert mem.reclaimed_chunks == 2 and not mem.kept(1)
    assert b("fill 5 238") == "ok"
    assert b("release 5") == "ok 2 kept=True"
    rep = mem.map_all([(1, size)])
    assert (rep.handed, rep.kept, rep.intact) == (2, 0, 0)
    assert sorted(src.taken) == first  # the same chunks came back
    assert not mem.filled(1)
    assert every_byte(mem, 1, size) == 238  # B's bytes: an upload is needed
    b.end()
    mem.close()


def test_a_holder_gone_vouches_for_nothing(arena: Path, tag: str) -> None:
    mem, _src = memory(arena, tag)
    mem.map_all([(1, CHUNK)])
    fill(mem, 1, 7, CHUNK)
    mem.mark_filled([1])
    mem.unmap([1])
    pid = observer(arena).status()["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for("the holder gone", lambda: not alive(pid))
    rep = mem.map_all([(1, CHUNK)])
    assert rep.kept == 1 and rep.intact == 0 and not mem.filled(1)
    mem.close()


# ---- the residency: real models, an oracle of the test's own --------------------------------


@pytest.fixture
def counted_uploads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The buffers the upload thread copied from the host shadow (the real upload, counted)."""
    seen: list[int] = []
    real = uploads_mod.upload

    def counting(b: Any, shadow: Any) -> None:
        seen.append(id(b))
        real(b, shadow)

    monkeypatch.setattr(uploads_mod, "upload", counting)
    return seen


@pytest.mark.parametrize("parts", [1, 3])
def test_a_restore_into_untouched_kept_memory_uploads_nothing_and_stays_bitwise(
    smol: llama_cpp.Llama, smollm2_path: Path, tmp_path: Path, counted_uploads: list[int], parts: int
) -> None:
    oracle = oracle_logits(smollm2_path)
    greedy = Greedy(smol)
    assert same(oracle, greedy.run())
    holder = observer(tmp_path / "arena", chunk=MODEL_CHUNK)
    client = observer(tmp_path / "arena")
    opts = ResidencyOptions(handover=True, parts=parts, overlap_restore=True)
    res = Residency.attach(smol, smollm2_path, opts, chunk_source=client)
    try:
        restore_without_uploads(res, greedy, oracle, counted_uploads)
        assert holder.status()["intact"] > 0
    finally:
        res.close()
    assert same(oracle, greedy.run())


def restore_without_uploads(
    res: Residency, greedy: Greedy, oracle: list[np.ndarray[Any, Any]], counted_uploads: list[int]
) -> None:
    assert res.handover_note == "" and res.handover["reuse_contents"] is True
    if not res.restore_steps.uploaded_bytes:  # (layer parts: attach put them in handed memory)
        res.release()
        first = res.restore()  # allocated: every byte uploaded
        assert first.bytes == res.restore_steps.uploaded_bytes
    steps = res.restore_steps
    total = int(steps.uploaded_bytes or 0)
    assert total > 0 and steps.skipped_upload_bytes == 0 and steps.created_chunks
    assert same(oracle, greedy.run())
    for kv in (False, True, False):
        counted_uploads.clear()
        res.release(kv=kv)  # kv: the deep level (the KV cache is ggml's memory: written back)
        report = res.restore()
        res.settle()
        steps = res.restore_steps
        assert (steps.uploaded_bytes, steps.skipped_upload_bytes) == (0, total)
        assert report.bytes == 0 and counted_uploads == []  # nothing copied from the shadow
        assert steps.intact_chunks == steps.kept_chunks and steps.mapped_chunks == 0
        assert not report.overlapped or kv  # nothing to wait for: no gate (KV cells aside)
        assert same(oracle, greedy.run())


@pytest.mark.parametrize("parts", [1, 3])
def test_a_deferred_shadow_is_read_once_and_never_for_a_restore_that_skips_every_byte(
    smol: llama_cpp.Llama,
    smollm2_path: Path,
    tmp_path: Path,
    counted_uploads: list[int],
    monkeypatch: pytest.MonkeyPatch,
    parts: int,
) -> None:
    """A deferred host shadow (a worker started for a waiting request) is pending at the first
    release, which checks its slices against the file. The first restore must upload every
    byte (the weights were in memory ggml allocated, freed by that release: the hand-over's
    memory is new), so it reads the file then, once. Every later restore into kept memory the
    holder vouches for skips every byte and reads nothing from the file (the file reads counted
    at the real reader, and the shadow's slices as the residency reports them)."""
    from timeshare.core.residency import shadow as shadow_mod

    reads: list[int] = []
    real_read = shadow_mod.parallel_read

    def counting_read(path: str, mem: Any, ranges: Any) -> None:
        reads.append(len(ranges))
        real_read(path, mem, ranges)

    monkeypatch.setattr(shadow_mod, "parallel_read", counting_read)
    greedy = Greedy(smol)
    reference = greedy.run()
    observer(tmp_path / "arena", chunk=MODEL_CHUNK)
    opts = ResidencyOptions(handover=True, defer_shadow=True, parts=parts, split_at_release=parts > 1)
    res = Residency.attach(smol, smollm2_path, opts, chunk_source=observer(tmp_path / "arena"))
    try:
        assert res.shadow_pending and reads == []
        res.release()
        assert res.shadow_pending and res.shadow_slices[0] == 0 and reads == []  # checked, not read
        res.restore()
        res.settle()
        steps = res.restore_steps
        assert steps.uploaded_bytes and not steps.skipped_upload_bytes  # new memory: every byte
        assert not res.shadow_pending
        slices, read = res.shadow_slices, len(reads)
        assert read > 0 and slices[0] == slices[1] > 0
        for kv in (False, True, False):
            counted_uploads.clear()
            res.release(kv=kv)
            res.restore()
            res.settle()
            steps = res.restore_steps
            assert steps.uploaded_bytes == 0 and steps.skipped_upload_bytes and counted_uploads == []
            assert len(reads) == read and res.shadow_slices == slices  # not one more read
            assert same(reference, greedy.run())
    finally:
        res.close()


def test_with_the_skip_off_every_restore_uploads(
    smol: llama_cpp.Llama, smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESHARE_HANDOVER_INTACT", "0")
    observer(tmp_path / "arena", chunk=MODEL_CHUNK)
    res = Residency.attach(
        smol, smollm2_path, ResidencyOptions(handover=True), chunk_source=observer(tmp_path / "arena")
    )
    try:
        assert res.handover["reuse_contents"] is False
        res.release()
        res.restore()
        total = res.restore_steps.uploaded_bytes
        res.release()
        res.restore()
        steps = res.restore_steps
        assert steps.kept_chunks and (steps.uploaded_bytes, steps.skipped_upload_bytes) == (total, 0)
    finally:
        res.close()


# ---- two model processes: a switch back ----------------------------------------------------


def restore_steps(w: Worker) -> dict[str, float]:
    assert w("restore").startswith("ok")
    out: dict[str, float] = json.loads(w("steps"))
    return out


def bitwise_with_oracle(w: Worker, oracle: list[np.ndarray[Any, Any]], tmp_path: Path) -> bool:
    """The worker's 8 greedy steps equal, bit for bit, the oracle's."""
    path = tmp_path / f"logits-{w.pid}.npy"
    assert w(f"logits {path}") == "ok"
    return same(oracle, list(np.load(path)))


@pytest.fixture(scope="module")
def variant_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A generated variant of SmolLM2 (named as such): the same file with every F32 tensor (the
    norms) scaled by 1.25 -- the same layout, other weights (a plain-memory model for the CPU
    stand-in; Gemma 3's Q4_K weights are repacked on the CPU and take no hand-over)."""
    from gguf import GGUFReader

    out = tmp_path_factory.mktemp("variant") / "smollm2-variant-norms-x1.25.gguf"
    out.write_bytes(smollm2_path.read_bytes())
    norms = [t for t in GGUFReader(smollm2_path).tensors if t.tensor_type.name == "F32"]
    assert norms
    with open(out, "r+b") as f:
        for t in norms:
            f.seek(int(t.data_offset))
            values = np.frombuffer(f.read(int(t.n_bytes)), dtype=np.float32) * np.float32(1.25)
            f.seek(int(t.data_offset))
            f.write(values.astype(np.float32).tobytes())
    return out


def two_models(
    smollm2_path: Path, variant_path: Path, arena: Path, workers: list[Worker]
) -> tuple[Worker, Worker, HandoverClient]:
    """A (SmolLM2) and B (its variant): other weights, so bytes one leaves are wrong for the
    other. Each released once (its own ggml memory): the next restores map handed memory."""
    holder = observer(arena, chunk=MODEL_CHUNK)
    a = Worker(arena, new_tag(), MODEL, str(smollm2_path))
    b = Worker(arena, new_tag(), MODEL, str(variant_path))
    workers += [a, b]
    a("release")
    b("release")
    return a, b, holder


def test_a_switch_back_where_the_other_fitted_beside_uploads_nothing(
    smollm2_path: Path, variant_path: Path, arena: Path, tmp_path: Path, workers: list[Worker]
) -> None:
    a, b, holder = two_models(smollm2_path, variant_path, arena, workers)
    oracles = {a.pid: oracle_logits(smollm2_path), b.pid: oracle_logits(variant_path)}
    assert not same(oracles[a.pid], oracles[b.pid])  # bytes left by the other would show
    totals = {}
    for w in (a, b):  # each allocates its own (room on the card); the other's stay kept
        steps = restore_steps(w)
        totals[w.pid] = steps["uploaded_bytes"]
        assert totals[w.pid] > 0 and steps["skipped_upload_bytes"] == 0
        assert bitwise_with_oracle(w, oracles[w.pid], tmp_path)
        w("release")
    for _ in range(2):  # A -> B -> A -> B: each restore finds its own memory untouched
        for w in (a, b):
            steps = restore_steps(w)
            assert (steps["uploaded_bytes"], steps["skipped_upload_bytes"]) == (0, totals[w.pid])
            assert steps["intact_chunks"] == steps["kept_chunks"] > 0
            assert bitwise_with_oracle(w, oracles[w.pid], tmp_path)
            w("release")
    st = holder.status()
    assert st["asked_back"] == 0 and st["intact"] == st["reused"] > 0


def test_a_switch_back_after_the_other_took_the_memory_uploads_everything(
    smollm2_path: Path,
    variant_path: Path,
    arena: Path,
    tmp_path: Path,
    workers: list[Worker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full card (no room: each restore has the other's kept chunks asked back): B's restore
    takes A's memory and writes its own weights there; A's takes it back (B's asked back in
    turn) and uploads every byte."""
    monkeypatch.setenv("TIMESHARE_HANDOVER_ROOM", "0")  # the workers read it at attach
    monkeypatch.setenv("TIMESHARE_HANDOVER_KEEP", "1")  # kept even so: asked back at each switch
    a, b, holder = two_models(smollm2_path, variant_path, arena, workers)
    oracle = oracle_logits(smollm2_path)
    total = restore_steps(a)["uploaded_bytes"]
    a("release")
    steps = restore_steps(b)
    assert steps["handed_chunks"] > 0 and steps["skipped_upload_bytes"] == 0  # A's memory
    b("release")
    for _ in range(2):
        steps = restore_steps(a)
        assert steps["handed_chunks"] > 0 and steps["kept_chunks"] == 0
        assert (steps["uploaded_bytes"], steps["skipped_upload_bytes"], steps["intact_chunks"]) == (
            total,
            0,
            0,
        )
        assert bitwise_with_oracle(a, oracle, tmp_path)
        a("release")
        assert restore_steps(b)["skipped_upload_bytes"] == 0
        b("release")
    assert holder.status()["asked_back"] > 0


def test_a_restore_after_its_kept_memory_was_asked_back_uploads_everything(
    smollm2_path: Path, arena: Path, tmp_path: Path, workers: list[Worker]
) -> None:
    """Asked back with no other worker (a trim; the same as a budget shrink or idle): the chunks
    come on hand, the restore gets them back -- and uploads."""
    holder = observer(arena, chunk=MODEL_CHUNK)
    a = Worker(arena, new_tag(), MODEL, str(smollm2_path))
    workers.append(a)
    oracle = oracle_logits(smollm2_path)
    a("release")
    total = restore_steps(a)["uploaded_bytes"]
    a("release")
    holder.trim(1 << 40)  # nothing closed; ...
    assert holder.status()["kept_bytes"] > 0
    holder.trim(0)  # ... the kept ones asked back (closed at the next trim: not yet)
    wait_for("A's kept chunks unmapped", lambda: holder.status()["kept_bytes"] == 0)
    steps = restore_steps(a)
    assert steps["kept_chunks"] == 0 and steps["handed_chunks"] > 0
    assert (steps["uploaded_bytes"], steps["skipped_upload_bytes"]) == (total, 0)
    assert bitwise_with_oracle(a, oracle, tmp_path)


# ---- a partial lease counts the padding of handed chunks ----------------------------------------


def test_a_partial_release_keeps_what_the_lease_covers_padding_included(
    smol: llama_cpp.Llama, smollm2_path: Path, tmp_path: Path
) -> None:
    """Handed memory is mapped in whole chunks: a partial release down to ``keep_bytes`` counts
    each resident part's last-chunk padding (the device memory really held), and
    ``resident_lease_bytes`` says what the lease must cover."""
    observer(tmp_path / "arena", chunk=MODEL_CHUNK)
    opts = ResidencyOptions(handover=True, parts=3)
    res = Residency.attach(smol, smollm2_path, opts, chunk_source=observer(tmp_path / "arena"))
    try:
        padding = int(res.handover["lease_padding_bytes"])  # type: ignore[call-overload]
        assert padding > 0 and res.resident_lease_bytes == res.weight_bytes + padding
        parts = res.parts()
        keep = parts[0].bytes + parts[1].bytes  # the first two parts' bytes, without padding
        res.release(keep_bytes=keep)
        assert res.resident_lease_bytes <= keep  # padding counted: the second part went too
        assert [p.resident for p in res.parts()] == [True, False, False]
        assert res.resident_lease_bytes > res.resident_bytes == parts[0].bytes
        res.restore()
        assert res.resident_lease_bytes == res.weight_bytes + padding
    finally:
        res.close()
