"""The Vulkan hand-over (issue 40 item 4): device memory exported as opaque fds
(``VK_KHR_external_memory_fd``, core/devmem/vulkan.py), held by the arena's real holder process and
imported elsewhere; the probe (core/diagnostics/vkhandover.py) and its command.

Real Vulkan through the loader: Mesa's lavapipe (apt mesa-vulkan-drivers, which .ci/run installs)
is enough, no GPU and no ggml involved. Without a loader, a device or the extension the device
tests skip, saying which; the rest (messages, bad input) runs everywhere."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import llama_cpp  # noqa: F401  (before the residency, which loads the ggml libraries)
import pytest
from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.devmem.device import ChunkDeviceError
from timeshare.core.devmem.vulkan import VulkanChunkDevice, can_hand_over, external_support
from timeshare.core.diagnostics import vkhandover
from timeshare.core.residency import _ggml, residency
from timeshare.core.vulkan.devices import MemoryType, PhysDev

from timeshare import cli

MIB = 1 << 20
AVAILABLE, WHY = can_hand_over()
needs_vulkan = pytest.mark.skipif(
    not AVAILABLE, reason=f"no Vulkan device with opaque-fd export here ({WHY}): apt mesa-vulkan-drivers"
)


def _own_device_memory() -> tuple[list[str], list[str]]:
    """This process's fds and mappings of lavapipe's exportable memory (its memfds)."""
    fds = []
    for x in os.listdir("/proc/self/fd"):
        with_name = ""
        with contextlib.suppress(OSError):  # the listing's own fd is gone
            with_name = os.readlink(f"/proc/self/fd/{x}")
        if "llvmpipe memory" in with_name:
            fds.append(with_name)
    with open("/proc/self/maps") as f:
        maps = [line for line in f if "llvmpipe memory" in line]
    return fds, maps


@pytest.fixture
def holder() -> Iterator[HandoverClient]:
    """A real hand-over holder (its own process, no Vulkan) in a fresh arena of 4 MiB chunks."""
    work = Path(tempfile.mkdtemp(prefix="ts-vkhand-"))
    client = HandoverClient(work / "arena", "test", chunk_bytes=4 * MIB)
    try:
        client.connect()
        yield client
    finally:
        client.close()
        shutil.rmtree(work, ignore_errors=True)


@needs_vulkan
def test_memory_passes_from_an_exited_process_to_another_through_the_holder() -> None:
    r = vkhandover.probe(chunks=3, chunk_bytes=4 * MIB)
    assert r["available"] and r["ok"], r
    a, b, h = r["exporter"], r["importer"], r["holder"]
    # the exporter exited before the importer started: the holder's fds alone kept the memory
    assert not h["exporter_alive"] and a["pid"] != b["pid"]
    assert h["on_hand_after_export"] == 3 * 4 * MIB and not h["loaded_vulkan"]
    # every byte of the exporter's pattern (its nonce, each chunk's number) came back, and the
    # importer's own write landed in the same memory
    assert b["taken"] == 3 and b["exporter_bytes_intact"] and b["problems"] == [] and b["own_bytes_written"]
    # nothing left: the holder closed what it was given back, no fd more than before
    assert (
        h["on_hand_after_import"] == 0 and h["lent_after_import"] == 0 and h["fds_after"] == h["fds_before"]
    )
    for key in ("alloc_ms", "copy_ms", "export_ms", "send_ms", "free_ms"):
        assert a[key] >= 0
    for key in (
        "take_ms",
        "import_ms",
        "copy_imported_ms",
        "copy_fresh_ms",
        "alloc_fresh_ms",
        "free_fresh_ms",
    ):
        assert b[key] >= 0
    # whether a sparse buffer could bind the chunks (the shape the ggml wiring can take): said
    # either way; Mesa 22's lavapipe has no sparse binding
    assert isinstance(r["sparse_binding"], bool) and r["sparse_note"]
    if "llvmpipe" in r["device"]:
        assert not r["sparse_binding"] and "no sparse binding" in r["sparse_note"]
    text = "\n".join(vkhandover.probe_lines(r))
    assert "works on" in text and "sparse binding:" in text and "path used:        alloc/free" in text


@needs_vulkan
def test_chunks_held_by_the_holder_keep_their_bytes_for_another_device_and_leak_nothing(
    holder: HandoverClient,
) -> None:
    size = 4 * MIB
    fds_before = len(os.listdir(f"/proc/{holder.holder_pid}/fd"))
    a = VulkanChunkDevice(chunk_bytes=size)
    st = a.staging(2 * size)
    handles = [a.create(size) for _ in range(2)]
    for k, h in enumerate(handles):
        ctypes.memset(st.pointer + k * size, 0x30 + k, size)
        ctypes.memmove(st.pointer + k * size, b"chunk-%d" % k, 7)
        a.upload(st, k * size, h)
    fds = [a.export(h) for h in handles]
    ids = holder.adopt(fds)
    for fd in fds:
        os.close(fd)
    for h in handles:
        a.release(h)
    holder.put(ids, keep=True)
    a.close()  # its instance and device are gone: only the holder's fds keep the memory
    assert a.creates == 2 and holder.status()["on_hand_bytes"] == 2 * size

    b = VulkanChunkDevice(chunk_bytes=size)  # a new instance and device
    try:
        given = holder.take(2)
        assert sorted(i for i, _ in given.chunks) == sorted(ids)
        got = []
        for _, fd in given.chunks:
            got.append(b.import_fd(fd))
            os.fstat(fd)  # the caller's fd is still open (the import took a dup)
            os.close(fd)
        st = b.staging(size)
        seen = set()
        for h in got:
            b.download(h, st)
            raw = ctypes.string_at(st.pointer, size)
            k = int(raw[6:7])
            seen.add(k)
            assert raw == b"chunk-%d" % k + bytes([0x30 + k]) * (size - 7)
        assert seen == {0, 1} and b.imports == 2 and b.creates == 0
        for h in got:
            b.release(h)
        holder.put([i for i, _ in given.chunks], keep=False)
    finally:
        b.close()
    st_after = holder.status()
    assert st_after["on_hand_bytes"] == 0 and st_after["lent_bytes"] == 0
    assert len(os.listdir(f"/proc/{holder.holder_pid}/fd")) == fds_before
    assert _own_device_memory() == ([], [])  # no fd and no mapping of device memory left here


@needs_vulkan
def test_bad_chunk_calls_are_clear_errors() -> None:
    dev = VulkanChunkDevice(chunk_bytes=4 * MIB)
    try:
        with pytest.raises(ChunkDeviceError, match="not a multiple"):
            dev.create(dev.granularity + 1)
        with pytest.raises(ChunkDeviceError, match="no chunk"):
            dev.release(12345)
        with pytest.raises(ChunkDeviceError, match="no chunk"):
            dev.export(12345)
        assert dev.chunks() == 0 and dev.creates == 0
        free, total = dev.memory()
        assert 0 < free <= total
    finally:
        dev.close()


@needs_vulkan
def test_a_device_that_is_not_there_is_named() -> None:
    ok, why = can_hand_over(name="no such GPU")
    assert not ok and "no Vulkan device named 'no such GPU'" in why
    r = vkhandover.probe(chunks=1, chunk_bytes=MIB, name="no such GPU")
    assert not r["available"] and not r["ok"] and "exporter" not in r
    assert "not available: no Vulkan device named" in vkhandover.probe_lines(r)[0]


def _physdev(extensions: frozenset[str]) -> PhysDev:
    return PhysDev(1, "GPU X", 2, "", 1 << 30, [MemoryType(0, 1, 0, 1 << 30)], [(0x7, 1)], extensions)


def test_a_device_without_the_extension_says_so() -> None:
    # decided from the device's extension list before any Vulkan call (vk is not touched)
    features, why = external_support(None, _physdev(frozenset({"VK_KHR_swapchain"})))  # type: ignore[arg-type]
    assert (
        features == 0
        and why == "GPU X has no VK_KHR_external_memory_fd (its driver exports no memory as an fd)"
    )


def test_a_failed_check_is_named_in_the_report() -> None:
    r = {
        "available": True,
        "ok": False,
        "bytes": 8 * MIB,
        "importer": {"exporter_bytes_intact": False, "problems": ["chunk 0: not the exporter's bytes"]},
        "holder": {"on_hand_after_export": 8 * MIB, "fds_before": 5, "fds_after": 6, "loaded_vulkan": False},
    }
    failed = vkhandover.failed_checks(r)
    assert "the exporter's bytes were not read back: chunk 0: not the exporter's bytes" in failed
    assert "the holder has more fds open than before (a leak)" in failed
    assert "the holder loaded Vulkan" not in failed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunks", "0"], "--chunks 0: at least 1"),
        (["--chunk-mib", "0"], "--chunk-mib 0: 1 to 4096"),
        (["--chunk-mib", "5000"], "--chunk-mib 5000: 1 to 4096"),
    ],
)
def test_bad_command_line_is_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "vk-handover", *argv]) == 2
    assert message in capsys.readouterr().err


@needs_vulkan
@pytest.mark.parametrize("found", [True, False])
def test_a_model_on_vulkan_says_whether_its_device_could_hand_memory_over(
    monkeypatch: pytest.MonkeyPatch, found: bool
) -> None:
    # the attach-time check (residency.handed_memory) on a ggml device named as ggml-vulkan names
    # it, matched to the Vulkan device by its description; this build's ggml has no Vulkan, so
    # its device list is played, the Vulkan check is real
    dev = VulkanChunkDevice(chunk_bytes=MIB)
    real_name = dev.phys.name
    dev.close()
    gpu = _ggml.Device(handle=7, name="Vulkan0", kind=_ggml.GGML_BACKEND_DEVICE_TYPE_GPU)
    monkeypatch.setattr(_ggml, "devices", lambda: [gpu])
    monkeypatch.setattr(_ggml, "device_id", lambda handle: "")
    monkeypatch.setattr(_ggml, "device_description", lambda handle: real_name if found else "GPU Z")
    mem, note = residency.handed_memory(gpu, None)
    assert mem is None and note.startswith("Vulkan0: ") and "the alloc/free path is used" in note
    if found:
        assert f"the device can hand memory over (Vulkan opaque fd ({real_name}))" in note
    else:
        assert "the device cannot hand memory over: no Vulkan device named 'GPU Z'" in note


@needs_vulkan
def test_host_memory_for_many_chunks_is_split_at_the_largest_allocation() -> None:
    # a 4 GiB probe on a driver whose largest allocation is smaller: several staging buffers
    dev = VulkanChunkDevice(chunk_bytes=MIB)
    try:
        dev.phys.max_alloc = 2 * MIB
        stg = vkhandover._stagings(dev, 5, MIB)
        assert [off for _, off in stg] == [0, MIB, 0, MIB, 0]
        assert len({s.buffer for s, _ in stg}) == 3
        assert [s.nbytes for s, _ in stg][::2] == [2 * MIB, 2 * MIB, MIB]
    finally:
        dev.close()


VALIDATION_LAYER = Path("/usr/share/vulkan/explicit_layer.d/VkLayer_khronos_validation.json")

# every Vulkan call the chunks make, in a process of its own under the Khronos validation layer:
# create (an exportable allocation, a buffer with external-memory info over it), upload, export,
# import of the fd (a second buffer over the same memory), download, release, close
_UNDER_VALIDATION = """
import ctypes, os
from timeshare.core.devmem.vulkan import VulkanChunkDevice
size = 1 << 20
d = VulkanChunkDevice(chunk_bytes=size)
st = d.staging(size)
ctypes.memset(st.pointer, 0x5A, size)
h = d.create(size)
d.upload(st, 0, h)
fd = d.export(h)
g = d.import_fd(fd)
os.close(fd)
ctypes.memset(st.pointer, 0, size)
d.download(g, st)
assert ctypes.string_at(st.pointer, size) == b"\\x5a" * size
d.release(g)
d.release(h)
d.close()
print("chunks done")
"""


@needs_vulkan
@pytest.mark.skipif(
    not VALIDATION_LAYER.exists(), reason="no Khronos validation layer: apt vulkan-validationlayers"
)
def test_the_chunks_vulkan_calls_pass_the_khronos_validation_layer() -> None:
    # the oracle is Khronos' own checker of the spec's valid-usage rules: a wrong structure type
    # in a pNext chain (an external-memory buffer created with the image's sType once: lavapipe
    # ignored it, another driver need not) or a missing flag is reported as a VUID
    env = dict(os.environ, VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation")
    out = subprocess.run(
        [sys.executable, "-c", _UNDER_VALIDATION],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "chunks done" in out.stdout, text[-3000:]
    assert "VUID-" not in text and "Validation Error" not in text and "Validation Warning" not in text, text[
        -3000:
    ]
