"""Issue 39 on Vulkan: is releasing a llama context's compute buffers in place safe on this driver?
Not a test: the check behind kvlevel.VULKAN_COMPUTE_KEPT, for a real Vulkan driver (the lead runs
it on the lent GPU with the Vulkan build; lavapipe here):

    GGML_VK_VISIBLE_DEVICES=0 .venv-vulkan/bin/python scripts/vk_compute_release_check.py \\
        --model /tmp/A.gguf [--rounds 3] [--json]

Only the compute buffers (core/residency/computebuf.py) go and come back, the weights and the KV
cache stay; after each round the 8-step greedy replay of ``timeshare doctor`` is compared bitwise
with the reference recorded before. Each way runs in its own child process, so a crash is a
result (its exit status), not the end of the check:

- ``release``: the product's way (memory swapped with a tiny placeholder and freed, a buffer of
  the same size allocated again and swapped back, the previous graph dropped);
- ``keep_memory``: swapped out and back with the SAME memory (nothing freed), graph dropped;
- ``graph_only``: nothing released, only the previous graph dropped;
- ``alloc_first``: fresh memory put under the buffers first, the previous memory freed at once
  (so the new buffer cannot take the freed one's driver objects: it exists before they are freed);
- ``free_after``: as alloc_first, but the previous memory freed only after that round's replay (so
  from the second round on the new buffer is made after a free).

Measured on lavapipe (Mesa 22.3.6, llama-cpp-python 0.3.36, SmolLM2, 2026-12-07), over several
runs: keep_memory and graph_only never crashed (all rounds bitwise); release crashed in the first
round in 7 of 8 processes (SIGSEGV in lavapipe's queue thread; with GGML_VK_SERIALIZE_SUBMISSIONS=1
glibc aborts on a corrupted heap), alloc_first in 1 of 3, free_after in 3 of 4 (in a later round):
freeing a compute buffer's memory and giving it new memory is what crashes, in whatever order
(kvlevel.py's note). A driver where all five are bitwise every round, run after run, is one where
TIMESHARE_VK_COMPUTE_INPLACE=1 can be measured with ``timeshare doctor``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WAYS = ("release", "keep_memory", "graph_only", "alloc_first", "free_after")


def child(model: str, way: str, rounds: int) -> int:
    """One way, ``rounds`` rounds; prints one line per round; 0 when every replay was bitwise."""
    from timeshare.core.diagnostics.residency_check import GreedyReplay, load_for_check
    from timeshare.core.residency import _ggml
    from timeshare.core.residency.computebuf import ComputeBufferFinder, forget_graph
    from timeshare.core.residency.swaps import PLACEHOLDER_BYTES

    llm = load_for_check(model, 1, n_ctx=512, n_batch=128).llm
    replay = GreedyReplay(llm)
    reference = replay.run()
    ctx = int(llm._ctx.ctx)
    finder = ComputeBufferFinder.probe(ctx, include_host=_ggml.first_gpu() is None)
    bad = 0
    for r in range(rounds):
        found = finder.find(ctx)
        later: list[int] = []
        if way == "release":
            found.release()
            found.restore()
        elif way == "graph_only":
            forget_graph(ctx)
        else:
            for b in found.live.items:
                size = PLACEHOLDER_BYTES if way == "keep_memory" else b.size
                other = _ggml.buft_alloc_buffer(b.buft, size)
                if other is None:
                    raise SystemExit(f"cannot allocate {size} bytes of {_ggml.buffer_type_name(b.buft)}")
                _ggml.swap_buffer_memory(b.ptr, other, b.layout)
                later.append(other)
            if way == "alloc_first":  # the previous memory freed at once
                for old in later:
                    _ggml.buffer_free(old)
                later = []
            if way == "keep_memory":  # the same memory back under each buffer
                for b, other in zip(found.live.items, later, strict=True):
                    _ggml.swap_buffer_memory(b.ptr, other, b.layout)
                    _ggml.buffer_free(other)
                later = []
            forget_graph(ctx)
        same = replay.run() == reference
        for old in later:  # free_after: the memory the round replaced, freed after its replay
            _ggml.buffer_free(old)
        bad += not same
        print(f"round {r + 1}: {found.live.nbytes} bytes, replay bitwise: {same}", flush=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.way:
        return child(args.model, args.way, args.rounds)
    report = {}
    for way in WAYS:
        cmd = [sys.executable, __file__, "--model", args.model, "--rounds", str(args.rounds), "--way", way]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
        rounds = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
        report[way] = {
            "exit_status": proc.returncode,  # negative: killed by that signal (-11: SIGSEGV)
            "rounds_done": len(rounds),
            "bitwise_rounds": sum(line.endswith("True") for line in rounds),
            "ok": proc.returncode == 0 and len(rounds) == args.rounds,
        }
        if not args.json:
            print(f"{way}: {report[way]}", flush=True)
    if args.json:
        print(json.dumps(report))
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
