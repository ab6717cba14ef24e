"""A stand-in worker for the hand-over tests (tests/test_handover.py): a real process with the
real hand-over client, the real holder and the memfd stand-in device (``MemfdDevice``, named as
such: no GPU), driven line by line on stdin; each command answers one line on stdout.

    map KEY NBYTES [LATER]  map a buffer from handed chunks (creating what the holder lacks);
                            LATER: bytes allocated after the mapping (not room for chunks)
    fill KEY BYTE           write BYTE over the whole buffer
    check KEY BYTE          "ok" when every byte of the buffer is BYTE, else "bad <first byte>"
    unmap KEY               unmap and put the chunks back
    release KEY             release as a worker does: kept mapped where the holder can ask it back
    unmap_some KEY N        unmap the first N chunks only, put nothing back (a release cut short)
    take N                  take N chunks and import them, map none (a restore cut short)
    report                  the last mapping's report and the device's create, map and unmap counts
    status                  the holder's status
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

from timeshare.core.arena.handclient import HandoverClient
from timeshare.core.devmem.mapped import HandedMemory
from timeshare.core.devmem.memfd import MemfdDevice


def main() -> None:
    arena, tag, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    free = int(sys.argv[4]) if len(sys.argv) > 4 else None  # the stand-in's free bytes (0: full)
    client = HandoverClient(arena, f"w{os.getpid()}", chunk_bytes=chunk, idle_s=600.0)
    client.connect()
    device = MemfdDevice(tag, free_bytes=free)
    mem = HandedMemory(device, client, client.chunk_bytes)
    sizes: dict[int, int] = {}
    held: list[int] = []  # handles of a cut-short restore
    print(f"ready {os.getpid()}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd, args = words[0], [int(x) for x in words[1:]]
        if cmd == "map":
            sizes[args[0]] = args[1]
            rep = mem.map_all([(args[0], args[1])], later=args[2] if len(args) > 2 else 0)
            out = (
                f"ok handed={rep.handed} created={rep.created} adopted={rep.adopted} "
                f"kept={rep.kept} mapped={rep.mapped} note={rep.note!r} room={rep.room}"
            )
        elif cmd == "fill":  # the whole mapped range (a taker may get the chunks in any order)
            ctypes.memset(mem.address(args[0]), args[1], mem.chunks_for(sizes[args[0]]) * mem.chunk_bytes)
            out = "ok"
        elif cmd == "check":
            data = ctypes.string_at(mem.address(args[0]), mem.chunks_for(sizes[args[0]]) * mem.chunk_bytes)
            want = bytes([args[1]])
            out = "ok" if data.count(want) == len(data) else f"bad {data[0]}"
        elif cmd == "unmap":
            out = f"ok {mem.unmap([args[0]], keep_mapped=False)}"
        elif cmd == "release":
            out = f"ok {mem.unmap([args[0]])} kept={mem.kept(args[0])}"
        elif cmd == "unmap_some":
            base = mem.address(args[0])
            for i in range(args[1]):
                device.unmap(base + i * mem.chunk_bytes, mem.chunk_bytes)
            out = "ok"
        elif cmd == "take":
            for _id, fd in client.take(args[0]).chunks:
                held.append(device.import_fd(fd))
                os.close(fd)
            out = f"ok {len(held)}"
        elif cmd == "report":
            rep = mem.last
            out = json.dumps(
                {
                    "handed": rep.handed,
                    "created": rep.created,
                    "kept": rep.kept,
                    "mapped": rep.mapped,
                    "creates": device.creates,
                    "maps": device.maps,
                    "unmaps": device.unmaps,
                    "reclaimed": mem.reclaimed_chunks,
                }
            )
        elif cmd == "status":
            out = json.dumps(client.status())
        else:
            out = f"unknown {cmd}"
        print(out, flush=True)


if __name__ == "__main__":
    main()
