"""The host shadow's memory: split over several host allocations where the device's host buffer
type hands out less than the whole shadow (ggml-vulkan: its max allocation), and ``host_pinned``
true only when every byte really is in the host buffer type's memory (ggml's host buffer types
fall back to a plain CPU buffer when the pinned allocation fails).

A CPU-only build has no pinned memory, so the host buffer type is stood in by the real CPU buffer
type of ggml (real buffers, real copies); the split is forced with a small allocation limit."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp  # before numpy
import pytest
from _residency_util import Greedy, same
from timeshare.core.errors import OutOfDeviceMemoryError
from timeshare.core.residency import Residency, ResidencyOptions, _ggml, hostmem


def _cpu_buft() -> int:
    cpu = next(d for d in _ggml.devices() if d.kind == _ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
    return int(_ggml.dev_buffer_type(cpu.handle))


@pytest.fixture
def stand_in_pinned(monkeypatch: pytest.MonkeyPatch) -> int:
    """The CPU buffer type plays the device's host buffer type; at most 1 byte per allocation, so
    every part (each weight buffer's shadow) is an allocation of its own."""
    buft = _cpu_buft()
    monkeypatch.setattr(hostmem, "pinned_buffer_type", lambda device=None: buft)
    monkeypatch.setattr(hostmem, "max_pinned_bytes", lambda _buft: 1)
    return buft


def test_parts_pack_into_segments_without_straddling() -> None:
    assert hostmem.pack_parts([3, 3, 3], 6) == [6, 3]
    assert hostmem.pack_parts([10, 2], 4) == [10, 2]  # a part above the limit stands alone
    assert hostmem.pack_parts([1, 1, 1, 1], 100) == [4]
    assert hostmem.pack_parts([], 4) == [0]


def test_split_memory_is_addressed_by_offset_and_never_straddles(stand_in_pinned: int) -> None:
    mem = hostmem.HostMemory(300, True, parts=[100, 120, 80])
    try:
        assert mem.pinned and mem.pinned_bytes == 300 and mem.note == ""
        assert [(off, size) for off, size, _ in mem.segments] == [(0, 100), (100, 120), (220, 80)]
        for off, size, addr in mem.segments:  # each allocation is a buffer of the stand-in type
            ctypes.memset(addr, off % 251, size)
        assert bytes(mem.view(100, 120)) == bytes([100]) * 120
        assert mem.address(230) == mem.segments[2][2] + 10
        with pytest.raises(ValueError, match="straddles"):
            mem.address(90, 20)
        with pytest.raises(ValueError, match="separate allocations"):
            _ = mem.ptr
        with pytest.raises(ValueError):
            mem.view(250, 60)
    finally:
        mem.close()
    with pytest.raises(ValueError, match="sum"):
        hostmem.HostMemory(10, True, parts=[4, 4])


def test_a_split_shadow_round_trips_bitwise(
    small_q4: llama_cpp.Llama, small_q4_path: Path, stand_in_pinned: int
) -> None:
    greedy = Greedy(small_q4)
    ref = greedy.run()
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace", host_shadow="pinned"))
    assert res.path == "inplace"
    assert res._inplace is not None
    n_buffers = len(res._inplace.buffers)
    assert n_buffers >= 2
    assert res.host_pinned and res.host_note == ""
    assert res.host_parts == n_buffers  # one allocation per weight buffer's shadow
    segs = res._inplace.shadow.segments
    assert sum(size for _, size, _ in segs) == res.host_bytes
    for _ in range(2):
        res.release()
        res.restore()
        assert same(greedy.run(), ref)
    steps = res.restore_steps
    assert steps.buffers == n_buffers and (steps.copy_ms or 0.0) >= 0 and (steps.alloc_ms or 0.0) >= 0
    assert steps.copy_ms is not None and steps.alloc_ms is not None
    assert res.release_steps.buffers == n_buffers
    res.close()


def test_a_host_buffer_type_that_falls_back_is_not_reported_pinned(
    small_q4: llama_cpp.Llama, small_q4_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Injected fault, the way ggml-vulkan and ggml-cuda fail: the host buffer type is asked for
    # pinned memory and hands back a plain CPU buffer (ggml_backend_vk_host_buffer_type_alloc_buffer
    # above max_buffer_size). The type asked for is a stand-in handle; what comes back is real.
    fake = 0x1
    handed: list[int] = []
    freed: list[int] = []
    cpu = _cpu_buft()
    real_free = _ggml.buffer_free

    def cpu_buffer_instead(_buft: int, size: int) -> int | None:
        buf = _ggml.buft_alloc_buffer(cpu, max(size, 1))
        if buf:
            handed.append(buf)
        return buf

    def counting_free(buf: int) -> None:
        freed.append(int(buf))
        real_free(buf)

    monkeypatch.setattr(hostmem, "pinned_buffer_type", lambda device=None: fake)
    monkeypatch.setattr(hostmem, "max_pinned_bytes", lambda _buft: 1 << 62)
    monkeypatch.setattr(hostmem, "alloc_pinned", cpu_buffer_instead)
    monkeypatch.setattr(_ggml, "buffer_free", counting_free)
    greedy = Greedy(small_q4)
    ref = greedy.run()
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace", host_shadow="pinned"))
    assert res.path == "inplace"
    assert not res.host_pinned  # today's lie: the fallback buffer was taken for pinned memory
    assert "could not be allocated" in res.host_note and "pageable" in res.host_note
    assert handed and all(b in freed for b in handed)  # the stray CPU buffer is not kept
    res.release()
    res.restore()
    assert same(greedy.run(), ref)
    res.close()


def test_one_refused_part_of_several_is_reported(
    stand_in_pinned: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real = hostmem.alloc_pinned

    def second_refused(buft: int, size: int) -> int | None:
        calls["n"] += 1
        return None if calls["n"] == 2 else real(buft, size)

    monkeypatch.setattr(hostmem, "alloc_pinned", second_refused)
    mem = hostmem.HostMemory(30, True, parts=[10, 10, 10])
    try:
        assert not mem.pinned and mem.pinned_bytes == 20
        assert "1 of 3 parts" in mem.note
        for _off, size, addr in mem.segments:  # the refused part is pageable memory, still usable
            ctypes.memset(addr, 7, size)
        assert bytes(mem.view(10, 10)) == bytes([7]) * 10
    finally:
        mem.close()


def test_pinned_memory_of_vulkan0_is_not_used_for_another_vulkan_device(stand_in_pinned: int) -> None:
    # ggml-vulkan registers its pinned host memory with device 0 alone: an upload to Vulkan1 would
    # not find it and would go through Vulkan1's staging buffer anyway
    other = _ggml.Device(1, "Vulkan1", _ggml.GGML_BACKEND_DEVICE_TYPE_GPU)
    mem = hostmem.HostMemory(64, True, parts=[32, 32], device=other)
    try:
        assert not mem.pinned and mem.pinned_bytes == 0
        assert "belongs to Vulkan0" in mem.note and "Vulkan1" in mem.note
        assert len(mem.segments) == 1  # pageable memory is one contiguous mapping
        mem.view(0, 64)[:] = bytes(range(64))
        assert bytes(mem.view(32, 32)) == bytes(range(32, 64))
    finally:
        mem.close()


def test_buffers_allocated_and_freed_on_threads_round_trip_bitwise(
    small_q4: llama_cpp.Llama, small_q4_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the parallel mode Vulkan takes (each allocation and free there costs time in proportion to
    # its size), forced on the CPU build: every buffer allocated at once, uploaded as it comes back
    greedy = Greedy(small_q4)
    ref = greedy.run()
    res = Residency.attach(small_q4, small_q4_path, ResidencyOptions(mode="inplace", parallel_buffers=True))
    assert res._inplace is not None and len(res._inplace.buffers) >= 2
    for _ in range(2):
        res.release()
        assert all(b.released for b in res._inplace.buffers)
        res.restore()
        assert same(greedy.run(), ref)
    # an allocation that fails while the others succeed: nothing is left half-restored or leaked
    res.release()
    real = _ggml.buft_alloc_buffer
    live: set[int] = set()
    real_free = _ggml.buffer_free
    calls = {"big": 0}

    def second_big_fails(buft: int, size: int) -> int | None:
        if size > 4096:
            calls["big"] += 1
            if calls["big"] == 2:
                return None
        buf = real(buft, size)
        if buf is not None and size > 4096:
            live.add(buf)
        return buf

    def tracking_free(buf: int) -> None:
        live.discard(int(buf))
        real_free(buf)

    monkeypatch.setattr(_ggml, "buft_alloc_buffer", second_big_fails)
    monkeypatch.setattr(_ggml, "buffer_free", tracking_free)
    with pytest.raises(OutOfDeviceMemoryError, match="stays released"):
        res.restore()
    assert not res.weights_resident and all(b.released for b in res._inplace.buffers)
    assert not live  # every big allocation that came back was freed again
    monkeypatch.setattr(_ggml, "buft_alloc_buffer", real)
    res.restore()
    assert same(greedy.run(), ref)
    res.close()


def test_lazy_memory_allocates_one_segment_at_a_time_and_pins_later(stand_in_pinned: int) -> None:
    """A deferred shadow's memory (issue 29): planned at once, allocated a segment at a time;
    segments allocated pageable on purpose (a release that cannot wait for pinning) are pinned
    later, their bytes kept."""
    mem = hostmem.HostMemory(30, True, parts=[10, 10, 10], lazy=True)
    try:
        assert mem.n_segments == 3 and not mem.complete and mem.segments == []
        with pytest.raises(ValueError, match="not allocated yet"):
            mem.address(0)
        assert mem.allocate_next() == (0, 10)
        ctypes.memset(mem.address(0), 1, 10)
        assert mem.allocate_next(pin=False) == (10, 10)
        assert mem.allocate_next(pin=False) == (20, 10)
        assert mem.allocate_next() is None and mem.complete
        assert not mem.pinned and mem.pinned_bytes == 10 and mem.to_pin == 2 and mem.note == ""
        mem.view(10, 10)[:] = bytes(range(10))
        mem.view(20, 10)[:] = bytes(range(10, 20))
        assert mem.pin_next() and mem.to_pin == 1 and not mem.pinned
        assert mem.pin_next() and mem.to_pin == 0
        assert not mem.pin_next()
        assert mem.pinned and mem.pinned_bytes == 30
        assert bytes(mem.view(0, 10)) == bytes([1]) * 10
        assert bytes(mem.view(10, 10)) + bytes(mem.view(20, 10)) == bytes(range(20))
    finally:
        mem.close()


def test_a_release_during_a_sliced_shadow_goes_pageable_then_pins_when_idle_bitwise(
    small_q4: llama_cpp.Llama, small_q4_path: Path, stand_in_pinned: int
) -> None:
    """A restore that comes while a deferred shadow is half built and the model released (issue
    29): the slices left are read from the file into pageable memory (no pinning to wait for),
    the model comes back bitwise from that, and pin_shadow later moves those allocations into
    pinned memory, bitwise again."""
    greedy = Greedy(small_q4)
    reference = greedy.run()
    opts = ResidencyOptions(mode="inplace", defer_shadow=True, shadow_slice_bytes=64 << 10)
    res = Residency.attach(small_q4, small_q4_path, opts)
    try:
        assert res.fill_shadow(lambda: res.shadow_slices[0] >= 2) is False
        total = res.shadow_slices[1]
        res.release()
        assert res.shadow_pending and res.shadow_to_pin == 0  # the release read nothing
        res.restore()
        assert not res.shadow_pending and res.shadow_to_pin == total - 2
        assert not res.host_pinned
        assert same(greedy.run(), reference), "logits differ after a restore from pageable slices"
        assert res.pin_shadow(lambda: True) is False and res.shadow_to_pin == total - 3
        assert res.pin_shadow() is True and res.shadow_to_pin == 0
        assert res.host_pinned and res.host_note == ""
        res.release()
        res.restore()
        assert same(greedy.run(), reference), "logits differ after the pageable slices were pinned"
    finally:
        res.close()
