"""Issue 40's probe, through the product's own pieces and no ggml: CudaVmmDevice (core/devmem/vmm.py),
the arena's hand-over holder and client, HandedMemory. Run by scripts/lab/handover_gpu.sh.

1. A maps 1 GiB of chunks (allocated: cuMemCreate, handed to the holder), fills it with a byte,
   unmaps, exits. B maps 1 GiB: every chunk handed over, no cuMemCreate, A's byte read back.
2. C maps, fills, unmaps half and is killed (-9) mid-release; D gets all its chunks (after C's
   exit), reads C's byte back.
3. Kept mappings: E maps, fills, releases keeping its mapping, maps again (0 map calls, its
   bytes still there), releases again and waits; F, with no room to allocate
   (``room_bytes`` 0: a full card), maps 1 GiB: the holder asks E's chunks back, E's reclaim
   thread unmaps them (cuMemUnmap on a thread of its own), then F gets them and reads E's bytes.
4. Everything exits: the device's free memory is back to its value before (measured here).

usage: python3 -P scripts/lab/handover_vmm_probe.py
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30


def child(arena: str, role: str) -> None:
    from timeshare.core.arena.handclient import HandoverClient
    from timeshare.core.devmem.mapped import HandedMemory
    from timeshare.core.devmem.vmm import CudaVmmDevice

    dev = CudaVmmDevice(ordinal=0)
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemsetD8_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_ubyte, ctypes.c_size_t]
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t]
    client = HandoverClient(arena, role)
    client.connect()
    mem = HandedMemory(dev, client, client.chunk_bytes)
    if role == "E":
        kept_probe(dev, lib, mem)
        client.close()
        return
    if role == "F":
        mem.room_bytes = 0  # a full card: the memory E keeps must be asked back
    t0 = time.perf_counter()
    rep = mem.map_all([(1, GIB)])
    ms = (time.perf_counter() - t0) * 1000
    addr = mem.address(1)
    byte = {"A": 0x5A, "C": 0x3C}.get(role)
    want = {"B": 0x5A, "D": 0x3C, "F": 0x7E}.get(role, 0)
    if byte is not None:
        assert lib.cuMemsetD8_v2(addr, byte, GIB) == 0
        lib.cuCtxSynchronize()
    else:
        buf = ctypes.create_string_buffer(4096)
        ok = True
        for off in range(0, GIB, GIB // 16):
            assert lib.cuMemcpyDtoH_v2(buf, addr + off, 4096) == 0
            ok = ok and buf.raw == bytes([want]) * 4096
        print(f"{role}: read the releaser's bytes back: {ok}", flush=True)
    print(
        f"{role}: mapped 1 GiB in {ms:.1f} ms: {rep.handed} chunk(s) handed over, {rep.created} created; "
        f"cuMemCreate calls {dev.creates}, cuMemMap calls {dev.maps}{'; ' + rep.note if rep.note else ''}",
        flush=True,
    )
    if role == "C":  # mid-release: half unmapped, nothing put back, then killed by the parent
        dev.synchronize()
        for i in range(rep.chunks // 2):
            dev.unmap(addr + i * mem.chunk_bytes, mem.chunk_bytes)
        print("C: half released", flush=True)
        time.sleep(60)
    t0 = time.perf_counter()
    mem.unmap([1], keep_mapped=False)
    print(f"{role}: unmapped and put back in {(time.perf_counter() - t0) * 1000:.1f} ms", flush=True)
    mem.close()
    client.close()


def kept_probe(dev: object, lib: ctypes.CDLL, mem: object) -> None:
    """E: map, fill, release keeping the mapping, map again (nothing mapped), release, then wait
    (stdin) while F takes the memory; print what the holder asked back."""
    from timeshare.core.devmem.mapped import HandedMemory
    from timeshare.core.devmem.vmm import CudaVmmDevice

    assert isinstance(dev, CudaVmmDevice) and isinstance(mem, HandedMemory)
    first = mem.map_all([(1, GIB)])
    addr = mem.address(1)
    assert lib.cuMemsetD8_v2(addr, 0x7E, GIB) == 0
    lib.cuCtxSynchronize()
    t0 = time.perf_counter()
    mem.unmap([1])
    rel_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    again = mem.map_all([(1, GIB)])
    map_ms = (time.perf_counter() - t0) * 1000
    buf = ctypes.create_string_buffer(4096)
    assert lib.cuMemcpyDtoH_v2(buf, addr + GIB // 2, 4096) == 0
    print(
        f"E: mapped {first.mapped} chunk(s) (created {first.created}); released keeping them in "
        f"{rel_ms:.2f} ms; mapped again in {map_ms:.2f} ms: {again.mapped} mapped, {again.kept} kept "
        f"(cuMemMap calls {dev.maps}); its bytes there: {buf.raw == bytes([0x7E]) * 4096}",
        flush=True,
    )
    mem.unmap([1])
    print("E: released, kept mapped", flush=True)
    sys.stdin.read()  # until the parent says F is done
    print(
        f"E: unmapped {mem.reclaimed_chunks} kept chunk(s) at the holder's request "
        f"(cuMemUnmap calls {dev.unmaps}); kept now {mem.kept_bytes} bytes",
        flush=True,
    )
    mem.close()


def main() -> None:
    from timeshare.core.arena.handclient import HandoverClient
    from timeshare.core.devmem.vmm import CudaVmmDevice

    me = CudaVmmDevice(ordinal=0)
    print(f"{me.name}: granularity {me.granularity} bytes", flush=True)
    free0, total = me.memory()
    work = Path(tempfile.mkdtemp(prefix="timeshare-vmm-probe-"))
    arena = str(work / "arena")
    keeper = HandoverClient(arena, "probe")  # keeps the holder up between the children
    keeper.connect()
    run = [sys.executable, "-P", __file__, arena]
    subprocess.run([*run, "A"], check=True)
    print(f"after A's exit: holder {keeper.status()['on_hand_bytes'] / GIB:.2f} GiB on hand", flush=True)
    subprocess.run([*run, "B"], check=True)
    c = subprocess.Popen([*run, "C"], stdout=subprocess.PIPE, text=True)
    assert c.stdout is not None
    for line in c.stdout:
        print(line, end="", flush=True)
        if "half released" in line:
            break
    os.kill(c.pid, signal.SIGKILL)
    c.wait()
    c.stdout.close()
    deadline = time.monotonic() + 10
    while keeper.status()["lent_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    st = keeper.status()
    print(
        f"after C's kill -9: {st['on_hand_bytes'] / GIB:.2f} GiB on hand, {st['lent_bytes']} lent", flush=True
    )
    subprocess.run([*run, "D"], check=True)
    e = subprocess.Popen([*run, "E"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert e.stdout is not None and e.stdin is not None
    for line in e.stdout:
        print(line, end="", flush=True)
        if "kept mapped" in line:
            break
    subprocess.run([*run, "F"], check=True)
    e.stdin.close()
    for line in e.stdout:
        print(line, end="", flush=True)
    e.wait()
    st = keeper.status()
    print(
        f"holder: kept {st['kept']}, reused {st['reused']}, asked back {st['asked_back']}, "
        f"released {st['released']} chunk(s)",
        flush=True,
    )
    holder_pid = keeper.status()["pid"]
    keeper.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(holder_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    free1, _ = me.memory()
    print(
        f"device free memory before {free0 / 2**20:.0f} MiB, after everything exited {free1 / 2**20:.0f} MiB "
        f"(of {total / 2**20:.0f}): {'no leak' if abs(free1 - free0) <= 4 << 20 else 'LEAK?'}",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) == 3:
        child(sys.argv[1], sys.argv[2])
    else:
        main()
