"""The Vulkan hand-over probe (issue 40 item 4): device memory passes from one process to another
as opaque fds (``VK_KHR_external_memory_fd``) through the arena's holder, nothing copied and
nothing freed; ``timeshare bench vk-handover`` runs it and ``doctor`` (on a Vulkan device) reports
it.

Three processes besides this one, each a fresh interpreter:

- the arena's hand-over holder (core/arena/holder.py), started for this run in a temporary folder
  (a running Timeshare's arena is never touched); it never initialises Vulkan (checked: no
  ``libvulkan`` in its memory map) and keeps the memory alive by its fds alone;
- the exporter: makes ``chunks`` chunks of exportable device memory (devmem/vulkan.py), writes a
  pattern into them (a fenced copy from host memory), exports their fds, hands them to the holder
  over its Unix socket (SCM_RIGHTS; peer credentials checked), frees its own handles and **exits**;
- the importer, started after the exporter's exit: takes the fds from the holder, imports them,
  reads the exporter's pattern back (the same memory: its nonce and each chunk's number, at both
  ends of every chunk, every byte compared), writes its own pattern into them and reads that back,
  then times a copy into the imported memory against the same copy into memory it allocates
  fresh, frees those and hands the imported chunks back to be closed.

Then the holder holds nothing and has as many fds open as before the exporter started (no leak).
The timings (milliseconds): the exporter's allocation, upload, export, hand-over and free; the
importer's take and import, and the copy into imported vs fresh memory with the fresh memory's
allocation and free. On Mesa's lavapipe (a CPU device) they say nothing of a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import envvars
from ..arena.handclient import MAX_CHUNK_BYTES, HandoverClient
from ..arena.handover import HandoverError
from ..devmem.device import ChunkDeviceError
from ..devmem.vulkan import Staging, VulkanChunkDevice

MIB = 1 << 20
#: the probe's default: 8 chunks of 64 MiB (the arena's chunk), 512 MiB in all
CHUNKS = 8
CHUNK_BYTES = 64 << 20
TIMEOUT_S = 300.0
_MAGIC = b"TSVK"


class ProbeError(Exception):
    """One side of the probe failed: the message says which and why."""


def _header(nonce: bytes, k: int) -> bytes:
    return _MAGIC + nonce + k.to_bytes(4, "little")  # 16 bytes


def _fill_byte(nonce: bytes, k: int) -> int:
    return (nonce[0] + 29 * k + 7) & 0xFF


def expected(nonce: bytes, k: int, nbytes: int) -> bytes:
    """Chunk ``k``'s pattern: one byte value throughout, the header (magic, nonce, ``k``) at both
    ends."""
    head = _header(nonce, k)
    return head + bytes([_fill_byte(nonce, k)]) * (nbytes - 2 * len(head)) + head


def _write_pattern(st: Staging, offset: int, nonce: bytes, k: int, nbytes: int) -> None:
    head = _header(nonce, k)
    ctypes.memset(st.pointer + offset, _fill_byte(nonce, k), nbytes)
    ctypes.memmove(st.pointer + offset, head, len(head))
    ctypes.memmove(st.pointer + offset + nbytes - len(head), head, len(head))


def _stagings(dev: VulkanChunkDevice, n: int, size: int) -> list[tuple[Staging, int]]:
    """Host memory for ``n`` chunks of ``size``: each chunk's (staging buffer, offset), in buffers
    no larger than the device's largest allocation (maxMemoryAllocationSize)."""
    most = dev.phys.max_alloc or n * size
    per = max(1, most // size)
    out: list[tuple[Staging, int]] = []
    for first in range(0, n, per):
        count = min(per, n - first)
        st = dev.staging(count * size)
        out.extend((st, j * size) for j in range(count))
    return out


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)


def _device(cfg: dict[str, Any]) -> VulkanChunkDevice:
    return VulkanChunkDevice(
        cfg.get("name") or None, cfg.get("pci") or None, int(cfg.get("ordinal", 0)), cfg["chunk"]
    )


def _export_side(cfg: dict[str, Any]) -> dict[str, Any]:
    """The exporter: create, fill, export, hand over, free; its figures."""
    n, size = int(cfg["chunks"]), int(cfg["chunk"])
    nonce = os.urandom(8)
    client = HandoverClient(cfg["arena"], "vk-probe-export", chunk_bytes=size, start=False)
    client.connect()
    dev = _device(cfg)
    out: dict[str, Any] = {"pid": os.getpid(), "device": dev.phys.name, "nonce": nonce.hex()}
    out.update(device_uuid=dev.phys.device_uuid, driver_uuid=dev.phys.driver_uuid, dedicated=dev.dedicated)
    try:
        stg = _stagings(dev, n, size)
        for k, (st, off) in enumerate(stg):
            _write_pattern(st, off, nonce, k, size)
        t0 = time.perf_counter()
        handles = [dev.create(size) for _ in range(n)]
        out["alloc_ms"] = _ms(t0)
        t0 = time.perf_counter()
        for k, h in enumerate(handles):
            dev.upload(*stg[k], h)
        out["copy_ms"] = _ms(t0)
        t0 = time.perf_counter()
        fds = [dev.export(h) for h in handles]
        out["export_ms"] = _ms(t0)
        try:
            t0 = time.perf_counter()
            ids = client.adopt(fds)
            out["send_ms"] = _ms(t0)
        finally:
            for fd in fds:
                os.close(fd)
        dev.synchronize()
        t0 = time.perf_counter()
        for h in handles:
            dev.release(h)
        out["free_ms"] = _ms(t0)
        client.put(ids, keep=True)  # on hand at the holder, nobody's
        out["ids"] = ids
    finally:
        dev.close()
        client.close()
    return out


def _import_side(cfg: dict[str, Any]) -> dict[str, Any]:
    """The importer: take, import, check the exporter's bytes, write its own, time copies into
    imported and fresh memory, free and hand back; its figures."""
    n, size = int(cfg["chunks"]), int(cfg["chunk"])
    nonce = bytes.fromhex(cfg["nonce"])
    dev = _device(cfg)
    out: dict[str, Any] = {"pid": os.getpid()}
    client = HandoverClient(cfg["arena"], "vk-probe-import", chunk_bytes=size, start=False)
    try:
        same = (dev.phys.device_uuid, dev.phys.driver_uuid) == (cfg["device_uuid"], cfg["driver_uuid"])
        if not same:
            raise ProbeError(
                f"the importer's device ({dev.phys.name}) is not the exporter's: an opaque fd imports "
                "only on the same device and driver (UUIDs differ)"
            )
        client.connect()
        t0 = time.perf_counter()
        given = client.take(n)
        out["take_ms"] = _ms(t0)
        ids = [i for i, _ in given.chunks]
        out["taken"] = len(ids)
        handles: list[int] = []
        try:
            t0 = time.perf_counter()
            for _, fd in given.chunks:
                handles.append(dev.import_fd(fd, size))
            out["import_ms"] = _ms(t0)
        finally:
            for _, fd in given.chunks:
                os.close(fd)
        stg = _stagings(dev, n, size)
        # the exporter's bytes: each chunk says which it is (the holder gives them in its order)
        seen: list[int] = []
        bad: list[str] = []
        for j, h in enumerate(handles):
            st, off = stg[j]
            dev.download(h, st, off)
            raw = ctypes.string_at(st.pointer + off, size)
            k = int.from_bytes(raw[12:16], "little")
            if raw[:4] != _MAGIC or raw[4:12] != nonce or k >= n or raw != expected(nonce, k, size):
                bad.append(f"chunk {j}: not the exporter's bytes (starts {raw[:16].hex()})")
            seen.append(k)
        out["exporter_bytes_intact"] = not bad and sorted(seen) == list(range(n)) and len(handles) == n
        out["problems"] = bad
        # its own bytes into the imported memory: the copy a restore makes, timed
        mine = os.urandom(8)
        for j in range(n):
            _write_pattern(*stg[j], mine, j, size)
        dev.synchronize()
        t0 = time.perf_counter()
        for j, h in enumerate(handles):
            dev.upload(*stg[j], h)
        out["copy_imported_ms"] = _ms(t0)
        st, off = stg[0]
        ctypes.memset(st.pointer + off, 0, size)
        if handles:
            dev.download(handles[-1], st, off)
        out["own_bytes_written"] = bool(handles) and ctypes.string_at(st.pointer + off, size) == expected(
            mine, len(handles) - 1, size
        )
        # the same copy into memory allocated now (the fallback path's allocation and free)
        t0 = time.perf_counter()
        fresh = [dev.create(size) for _ in range(n)]
        out["alloc_fresh_ms"] = _ms(t0)
        t0 = time.perf_counter()
        for j, h in enumerate(fresh):
            dev.upload(*stg[j], h)
        out["copy_fresh_ms"] = _ms(t0)
        dev.synchronize()
        t0 = time.perf_counter()
        for h in fresh:
            dev.release(h)
        out["free_fresh_ms"] = _ms(t0)
        t0 = time.perf_counter()
        for h in handles:
            dev.release(h)
        out["release_imported_ms"] = _ms(t0)
        client.put(ids, keep=False)  # the holder closes them: the memory goes back to the driver
        out["chunks_left"] = dev.chunks()
    finally:
        dev.close()
        client.close()
    return out


def _side_main(role: str, cfg_json: str) -> int:
    """``python -m ...vkhandover --export|--import CONFIG``: one side; prints its JSON (one line)."""
    cfg = json.loads(cfg_json)
    try:
        out = _export_side(cfg) if role == "--export" else _import_side(cfg)
    except (ChunkDeviceError, HandoverError, ProbeError, OSError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


def _run_side(role: str, cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", f"{__package__}.vkhandover", role, json.dumps(cfg)]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=envvars.environment(), check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(f"the {role[2:]}er did not finish within {timeout_s:.0f} s") from exc
    lines = [x for x in done.stdout.strip().splitlines() if x.startswith("{")]
    try:
        out: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError) as exc:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ProbeError(f"the {role[2:]}er exited {done.returncode}: {' | '.join(tail)}") from exc
    if "error" in out:
        raise ProbeError(f"the {role[2:]}er: {out['error']}")
    return out


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _fds_settled(pid: int, want: int, timeout_s: float = 5.0) -> int:
    """The holder's fd count once it is ``want`` (the importer's connection, closed at its exit,
    may still be open there for a moment), or what it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (n := _fds(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def _loaded_vulkan(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libvulkan" in line for line in f)
    except OSError:
        return False


def _availability(name: str | None, pci_bus_id: str | None, ordinal: int) -> tuple[bool, str, dict[str, Any]]:
    try:
        dev = VulkanChunkDevice(name, pci_bus_id, ordinal, MIB)
    except ChunkDeviceError as exc:
        return False, str(exc), {}
    try:
        extra = {"sparse_binding": dev.sparse, "sparse_note": dev.sparse_note, "dedicated": dev.dedicated}
        return True, dev.name + (" (dedicated allocations)" if dev.dedicated else ""), extra
    finally:
        dev.close()


def probe(
    chunks: int = CHUNKS,
    chunk_bytes: int = CHUNK_BYTES,
    name: str | None = None,
    pci_bus_id: str | None = None,
    ordinal: int = 0,
    timeout_s: float = TIMEOUT_S,
) -> dict[str, Any]:
    """Run the hand-over between two processes on the Vulkan device (``name``/``pci_bus_id``/
    ``ordinal`` as the copy baseline picks it). The report: ``ok`` (the exporter's bytes read back
    by the importer, its own written, nothing left at the holder), ``available`` and ``why``
    (False: the device cannot, or the probe failed: ``error``), both sides' figures and the
    holder's."""
    if chunks < 1:
        raise ValueError(f"chunks: {chunks} (at least 1)")
    if chunk_bytes < MIB or chunk_bytes % MIB or chunk_bytes > MAX_CHUNK_BYTES:
        raise ValueError(
            f"chunk size: {chunk_bytes} bytes (a whole number of MiB, 1 to {MAX_CHUNK_BYTES // MIB})"
        )
    report: dict[str, Any] = {"chunks": chunks, "chunk_bytes": chunk_bytes, "bytes": chunks * chunk_bytes}
    ok, why, extra = _availability(name, pci_bus_id, ordinal)
    report.update(available=ok, why=why, ok=False, **extra)
    if not ok:
        return report
    work = Path(tempfile.mkdtemp(prefix="timeshare-vkhandover-"))
    client = HandoverClient(work / "arena", "vk-probe", chunk_bytes=chunk_bytes, idle_s=TIMEOUT_S)
    try:
        client.connect()
        holder = client.holder_pid
        fds_before = _fds(holder)
        cfg: dict[str, Any] = {
            "arena": str(work / "arena"),
            "chunks": chunks,
            "chunk": chunk_bytes,
            "name": name,
            "pci": pci_bus_id,
            "ordinal": ordinal,
        }
        a = _run_side("--export", cfg, timeout_s)
        at_holder = client.status()
        b = _run_side(
            "--import", {**cfg, **{k: a[k] for k in ("nonce", "device_uuid", "driver_uuid")}}, timeout_s
        )
        after = client.status()
        report.update(
            device=a["device"],
            exporter=a,
            importer=b,
            holder={
                "pid": holder,
                "loaded_vulkan": _loaded_vulkan(holder),
                "on_hand_after_export": at_holder.get("on_hand_bytes"),
                "on_hand_after_import": after.get("on_hand_bytes"),
                "lent_after_import": after.get("lent_bytes"),
                "fds_before": fds_before,
                "fds_after": _fds_settled(holder, fds_before),
                "exporter_alive": os.path.exists(f"/proc/{a['pid']}"),
            },
        )
        h = report["holder"]
        report["ok"] = bool(
            b.get("exporter_bytes_intact")
            and b.get("own_bytes_written")
            and b.get("chunks_left") == 0
            and h["on_hand_after_export"] == chunks * chunk_bytes
            and h["on_hand_after_import"] == 0
            and h["lent_after_import"] == 0
            and h["fds_after"] == h["fds_before"]
            and not h["loaded_vulkan"]
        )
        if not report["ok"]:
            report["why"] = "the probe ran but a check failed: " + "; ".join(failed_checks(report))
    except (HandoverError, ProbeError, KeyError) as exc:
        report.update(ok=False, error=str(exc), why=f"the probe failed: {exc}")
    finally:
        client.close()
        shutil.rmtree(work, ignore_errors=True)
    return report


def failed_checks(r: dict[str, Any]) -> list[str]:
    b, h = r.get("importer", {}), r.get("holder", {})
    checks = [
        (
            b.get("exporter_bytes_intact"),
            "the exporter's bytes were not read back: " + "; ".join(b.get("problems", [])),
        ),
        (b.get("own_bytes_written"), "the importer's write did not read back"),
        (b.get("chunks_left") == 0, "the importer kept chunks"),
        (h.get("on_hand_after_export") == r["bytes"], "the holder did not hold every exported chunk"),
        (
            h.get("on_hand_after_import") == 0 and h.get("lent_after_import") == 0,
            "the holder holds chunks at the end",
        ),
        (h.get("fds_after") == h.get("fds_before"), "the holder has more fds open than before (a leak)"),
        (not h.get("loaded_vulkan"), "the holder loaded Vulkan"),
    ]
    return [text for good, text in checks if not good]


def probe_lines(r: dict[str, Any]) -> list[str]:
    """The report as text (bench vk-handover, doctor)."""
    if not r.get("available"):
        return [f"vulkan hand-over:   not available: {r.get('why', '')}; the alloc/free path is used"]
    if not r.get("ok"):
        return [f"vulkan hand-over:   {r.get('why', 'failed')}; the alloc/free path is used"]
    a, b, h = r["exporter"], r["importer"], r["holder"]
    gb = r["bytes"] / 1e9
    lines = [
        f"vulkan hand-over:   works on {r['device']}: {r['chunks']} chunks of {r['chunk_bytes'] // MIB} MiB "
        f"({gb:.2f} GB) passed from pid {a['pid']} (exited) through the holder (pid {h['pid']}, no Vulkan) "
        f"to pid {b['pid']}: the exporter's bytes read back, nothing copied, no fd left",
        f"  exporter:         alloc {a['alloc_ms']:.1f} ms, upload {a['copy_ms']:.1f} ms, export "
        f"{a['export_ms']:.1f} ms, hand to holder {a['send_ms']:.1f} ms, free {a['free_ms']:.1f} ms",
        f"  importer:         take {b['take_ms']:.1f} ms, import {b['import_ms']:.1f} ms; copy into imported "
        f"{b['copy_imported_ms']:.1f} ms vs fresh {b['copy_fresh_ms']:.1f} ms (fresh alloc "
        f"{b['alloc_fresh_ms']:.1f} ms, free {b['free_fresh_ms']:.1f} ms)",
    ]
    if "llvmpipe" in r["device"] or "lavapipe" in r["device"]:
        lines.append("  (lavapipe: a CPU device; its timings say nothing of a GPU)")
    sparse = "yes" if r.get("sparse_binding") else "no"
    lines.append(f"  sparse binding:   {sparse}: {r.get('sparse_note', '')}")
    lines.append(f"  path used:        alloc/free: {NOT_WIRED}")
    return lines


#: why a worker on Vulkan still allocates and frees its weight buffers where the probe works
NOT_WIRED = "ggml-vulkan's weight buffers are not made of handed-over chunks yet (docs/lab/HISTORY.md)"


def probe_for_ggml_device(dev: Any, chunks: int = 4, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """:func:`probe` on the Vulkan device behind a ggml device (``residency.GgmlDevice``), found
    as the copy baseline finds it (PCI bus id, else name and rank): doctor's check."""
    from ..residency import ggml_device_description, ggml_device_id, ggml_devices

    desc = ggml_device_description(dev.handle)
    same = [d for d in ggml_devices() if d.is_gpu and ggml_device_description(d.handle) == desc]
    ordinal = next((i for i, d in enumerate(same) if d.handle == dev.handle), 0)
    return probe(chunks, chunk_bytes, desc, ggml_device_id(dev.handle) or None, ordinal)


def main(args: Any) -> int:
    """``timeshare bench vk-handover``."""
    most = MAX_CHUNK_BYTES // MIB
    bad = (
        f"--chunks {args.chunks}: at least 1"
        if args.chunks < 1
        else f"--chunk-mib {args.chunk_mib}: 1 to {most}"
        if not 1 <= args.chunk_mib <= most
        else ""
    )
    if bad:
        print(f"timeshare bench vk-handover: {bad}", file=sys.stderr)
        return 2
    report = probe(int(args.chunks), int(args.chunk_mib) * MIB, name=getattr(args, "device", None))
    if getattr(args, "json", False):
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(probe_lines(report)))
    return 0 if report.get("ok") else 1


if __name__ == "__main__":  # one side of the probe, started by _run_side
    if len(sys.argv) == 3 and sys.argv[1] in ("--export", "--import"):
        sys.exit(_side_main(sys.argv[1], sys.argv[2]))
    with contextlib.suppress(KeyboardInterrupt):
        print(json.dumps(probe(), indent=1))
