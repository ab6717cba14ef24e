"""The deep release's save of the KV cells in use, alone (issue 39, the releasing side): straight
from the KV tensors (core/residency/kvsave.py) against ``llama_state_seq_get_data`` (the portable
way), on one context filled with ``--tokens`` cells, flash attention on and off. Not a test:
numbers, for docs/PERFORMANCE.md (the lead runs it on the lent GPU, one run):

    .venv/bin/python scripts/bench_kv_save.py --model /tmp/A.gguf --tokens 7500 [--json]

Per way and flash attention setting: the median of ``--repeat`` saves into host memory kept from
one save to the next (as a worker's KV level keeps it: the first save's allocation is reported
apart, ``first_ms``), the bytes, and whether both ways gave the same bytes (they must). The cells
are filled by a prefill of ``--tokens`` tokens (the model's own token ids, not text: the values do
not matter for a copy).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
import zlib
from typing import Any

import llama_cpp
from timeshare.core.residency.kv import KvSnapshot
from timeshare.core.residency.kvbuffer import KvBuffers
from timeshare.core.residency.kvmemory import KvHostMemory
from timeshare.core.residency.kvsave import KvSaver


def _fill(llm: llama_cpp.Llama, n: int) -> None:
    """Prefill ``n`` tokens (cycling through a few ordinary token ids) into sequence 0."""
    text = b"The history of Lyon, its rivers, its silk and its food, told at length. "
    base = llm.tokenize(text, add_bos=False)
    tokens = (base * (n // len(base) + 1))[:n]
    llm.eval(tokens)


def _crc(snap: KvSnapshot) -> int:
    crc = 0
    for _s, addr, size in snap.segments():
        crc = zlib.crc32(ctypes.string_at(addr, size), crc)
    return crc


def _time(take: Any, repeat: int) -> dict[str, Any]:
    times, crc, nbytes = [], 0, 0
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        snap = take()
        ms = (time.perf_counter() - t0) * 1000
        if i == 0:
            first, crc, nbytes = ms, _crc(snap), snap.nbytes
        else:
            times.append(ms)
        snap.close()
    return {"first_ms": first, "median_ms": statistics.median(times), "bytes": nbytes, "crc": crc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "runs": []}
    for flash in (True, False):
        llm = llama_cpp.Llama(
            args.model,
            n_ctx=args.tokens + 256,
            n_batch=512,
            n_gpu_layers=args.n_gpu_layers,
            flash_attn=flash,
            verbose=False,
        )
        try:
            _fill(llm, args.tokens)
            ctx, model = int(llm._ctx.ctx), int(llm._model.model)
            kvbuf = KvBuffers.find(model, ctx)
            saver = KvSaver(kvbuf, model)
            raw_mem, state_mem = KvHostMemory(True), KvHostMemory(True)
            raw = _time(lambda: saver.take(ctx, raw_mem), args.repeat)  # noqa: B023
            state = _time(lambda: KvSnapshot.take(ctx, state_mem), args.repeat)  # noqa: B023
            row = {
                "flash_attn": flash,
                "v_trans": kvbuf.v_trans,
                "pinned": raw_mem.pinned,
                "host_memory_bytes": raw_mem.nbytes,
                "raw": raw,
                "state": state,
                "same_bytes": raw["crc"] == state["crc"] and raw["bytes"] == state["bytes"],
            }
            raw_mem.close()
            state_mem.close()
        finally:
            llm.close()
        out["runs"].append(row)
        if not args.json:
            print(
                f"flash_attn={flash}: {row['raw']['bytes'] / 1e6:.1f} MB; raw {raw['median_ms']:.1f} ms "
                f"(first {raw['first_ms']:.1f}), state {state['median_ms']:.1f} ms "
                f"(first {state['first_ms']:.1f}); "
                f"same bytes {row['same_bytes']}, pinned {row['pinned']}",
                flush=True,
            )
    if args.json:
        print(json.dumps(out, indent=1))
    return 0 if all(r["same_bytes"] for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
