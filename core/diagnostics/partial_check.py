"""``timeshare doctor --partial``: the layer parts of the in-place path (issue 28) on this
machine's backend.

Loads the model as the doctor does, records the reference (8 greedy decode steps), then:
1. whole buffers (``parts=1``): ``cycles`` releases down to half the weights (which with one part
   releases everything) and restores, each followed by the replay compared bitwise;
2. ``parts=N``: the same cycles (about half the weights move; synchronous restores), then a
   pattern of partial releases and restores (keep 70 %, 30 %, restore, keep 0, restore, keep 50 %
   with the KV cache, restore), each restore (overlapped where the probe passes) followed by the
   replay compared bitwise;
3. the first decode after a restore (issue 28, item 2): restore of every part + a 128-token
   prefill timed together, synchronous and overlapped in turn, each compared bitwise with the
   never-released prefill and 4 greedy steps after it; beside them the raw copy and the prefill
   alone.
Reports the release/restore milliseconds and bytes of both, and every step of the pattern.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

#: the prompt of the first decode after a restore (restore + prefill timed together)
PREFILL_TOKENS = 128

#: the pattern after the timed cycles: (what, keep fraction of the weights, with the KV cache)
PATTERN: list[tuple[str, float, bool]] = [
    ("release", 0.7, False),
    ("release", 0.3, False),
    ("restore", 0.0, False),
    ("release", 0.0, False),
    ("restore", 0.0, False),
    ("release", 0.5, True),
    ("restore", 0.0, False),
]


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _last_logits(llm: Any) -> bytes:
    import llama_cpp
    import numpy as np

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return bytes(np.ctypeslib.as_array(ptr, shape=(int(llm.n_vocab()),)).tobytes())


def first_decode_after_restore(
    llm: Any, res: Any, cycles: int, step: Callable[[str], None], n_prompt: int = PREFILL_TOKENS
) -> dict[str, Any]:
    """Restore of all the parts + the first decode (a prefill of ``n_prompt`` tokens from an
    empty KV cache) timed together, synchronous and overlapped restores in turn (``cycles`` of
    each), every prefill's last logits and 4 greedy steps after it compared bitwise with the
    same with the weights never released; and the raw copy of the weights (the limit) and the
    prefill alone, for the ratios."""
    import time

    import llama_cpp  # noqa: F401  (before numpy)
    import numpy as np

    from .rawcopy import raw_copy_seconds
    from .residency_check import PROMPT

    tokens = list(llm.tokenize(PROMPT))
    tokens = (tokens * (n_prompt // max(len(tokens), 1) + 1))[:n_prompt]

    def greedy_after_prefill() -> list[bytes]:
        """The prefill's last logits and those of 4 greedy steps after it."""
        out = [_last_logits(llm)]
        for _ in range(4):
            row = np.frombuffer(out[-1], dtype=np.float32)
            llm.eval([int(row.argmax())])
            out.append(_last_logits(llm))
        return out

    step(f"first decode after a restore: the reference ({n_prompt}-token prefill, weights resident)")
    resident_s = []
    reference: list[bytes] = []
    for _ in range(max(2, cycles)):
        llm.n_tokens = 0  # eval() drops every KV cell from n_tokens on
        t0 = time.perf_counter()
        llm.eval(tokens)
        resident_s.append(time.perf_counter() - t0)
        reference = greedy_after_prefill()
    raw: list[float] = []
    rows: dict[str, list[float]] = {"sync": [], "overlapped": []}
    restore_ms: dict[str, list[float]] = {"sync": [], "overlapped": []}
    gate: dict[str, float] = {}
    sync_steps: dict[str, float] = {}
    same: list[bool] = []
    overlapped_seen = False
    for i in range(cycles):
        for mode in ("sync", "overlapped"):
            step(f"first decode after a {mode} restore, cycle {i + 1}/{cycles}")
            res.release()
            if not raw:
                view = res.inplace_view
                raw = raw_copy_seconds(view, reps=3) if view is not None else []
            llm.n_tokens = 0
            t0 = time.perf_counter()
            rst = res.restore(overlap=mode == "overlapped")
            llm.eval(tokens)
            dt = time.perf_counter() - t0
            res.settle()
            overlapped_seen = overlapped_seen or rst.overlapped
            if rst.overlapped:
                gate = res.last_overlap.as_dict() if res.last_overlap is not None else {}
            else:
                sync_steps = res.restore_steps.as_dict()
            same.append(greedy_after_prefill() == reference)
            rows[mode].append(dt * 1000)
            restore_ms[mode].append(rst.ms)
    sync_ms, ovl_ms = _median(rows["sync"]), _median(rows["overlapped"])
    raw_ms = min(raw) * 1000 if raw else 0.0
    prefill_ms = _median(resident_s) * 1000
    return {
        "prompt_tokens": n_prompt,
        "overlap_available": bool(res.overlap_available),
        "overlap_note": res.overlap_note,
        "overlapped": overlapped_seen,
        "sync_ms": sync_ms,
        "overlapped_ms": ovl_ms,
        "ratio": ovl_ms / sync_ms if sync_ms else 0.0,
        "restore_sync_ms": _median(restore_ms["sync"]),
        "restore_overlapped_ms": _median(restore_ms["overlapped"]),
        "prefill_ms": prefill_ms,
        "raw_copy_ms": raw_ms,
        "raw_copy_ms_reps": [x * 1000 for x in raw],  # the first into fresh memory
        "sync_steps": sync_steps,  # the last synchronous restore's restore_steps
        "sync_over_raw_plus_prefill": sync_ms / (raw_ms + prefill_ms) if raw_ms else 0.0,
        "overlapped_minus_raw_ms": ovl_ms - raw_ms if raw_ms else 0.0,
        "gate": gate,
        "bitwise_identical": all(same) and bool(same),
    }


def run_partial_check(
    model: str, cycles: int, parts: int, step: Callable[[str], None], n_ctx: int = 512
) -> dict[str, Any]:
    """Run the check; returns the report (raises TimeshareError on bad input)."""
    from ..errors import TimeshareError
    from ..residency import Residency, ResidencyOptions
    from .residency_check import GreedyReplay, load_for_check

    if parts < 2:
        raise TimeshareError("--parts must be at least 2 for the partial check")
    step(f"loading {model}")
    loaded = load_for_check(
        model, cycles, failure_hint=": check that it is a supported GGUF model", n_ctx=n_ctx, n_batch=128
    )
    llm = loaded.llm
    report: dict[str, Any] = {
        "mode": "partial",
        "model": model,
        "llama_cpp_version": loaded.probe.version,
        "cycles": cycles,
        "parts_asked": parts,
    }
    same: list[bool] = []
    try:
        replay = GreedyReplay(llm)
        step("recording the reference: 8 greedy decode steps")
        reference = replay.run()

        def timed(res: Residency, label: str) -> dict[str, Any]:
            keep = res.weight_bytes // 2
            rel_ms, rst_ms, released, restored, freed = [], [], [], [], []
            steps: list[dict[str, Mapping[str, float | str]]] = []
            for i in range(cycles):
                step(f"{label}: release down to 50 % and restore, cycle {i + 1}/{cycles}")
                rel = res.release(keep_bytes=keep)
                rst = res.restore(overlap=False)  # the restore's own time (item 3 of issue 28)
                ok = replay.run() == reference
                same.append(ok)
                rel_ms.append(rel.ms)
                rst_ms.append(rst.ms)
                released.append(rel.released_bytes)
                freed.append(rel.freed_bytes)
                restored.append(rst.bytes)
                steps.append({"release": res.release_steps.as_dict(), "restore": res.restore_steps.as_dict()})
            return {
                "parts": len(res.parts()),
                "weight_bytes": res.weight_bytes,
                "keep_bytes": keep,
                "release_ms": _median(rel_ms),
                "restore_ms": _median(rst_ms),
                "released_bytes": int(_median([float(x) for x in released])),
                "freed_bytes": int(_median([float(x) for x in freed])),
                "restored_bytes": int(_median([float(x) for x in restored])),
                "restore_gbps": _median(
                    [b / 1e9 / (ms / 1000) for b, ms in zip(restored, rst_ms, strict=True) if ms > 0]
                ),
                "bitwise_identical": all(same[-cycles:]),
                "steps": steps,
            }

        step("attaching the residency mechanism with whole buffers (parts=1)")
        whole = Residency.attach(llm, model, ResidencyOptions(mode="inplace"))
        try:
            report["parts_1"] = timed(whole, "parts=1")
        finally:
            whole.close()
        step(f"attaching with {parts} layer parts (the weights move into them)")
        # overlapped restores on wherever the probe passes (also the CPU build, where they are off
        # by default): the pattern's restores and the first-decode section measure them
        res = Residency.attach(
            llm, model, ResidencyOptions(mode="inplace", parts=parts, overlap_restore=True)
        )
        try:
            report.update(path=res.path, backend=res.backend, parts_note=res.parts_note)
            report["memory_measure"] = res.memory_measure
            same.append(replay.run() == reference)
            report["after_split_bitwise_identical"] = same[-1]
            report["layer_parts"] = [
                {"index": p.index, "first_layer": p.first_layer, "last_layer": p.last_layer, "bytes": p.bytes}
                for p in res.parts()
            ]
            report[f"parts_{parts}"] = timed(res, f"parts={parts}")
            pattern: list[dict[str, Any]] = []
            for what, frac, kv in PATTERN:
                if what == "release":
                    keep = int(frac * res.weight_bytes)
                    step(
                        f"pattern: release down to {100 * frac:.0f} %" + (" with the KV cache" if kv else "")
                    )
                    rel = res.release(kv=kv, keep_bytes=keep)
                    pattern.append(
                        {
                            "step": f"keep {100 * frac:.0f} %" + (" +kv" if kv else ""),
                            "keep_bytes": keep,
                            "ms": rel.ms,
                            "released_bytes": rel.released_bytes,
                            "resident_bytes": rel.resident_bytes,
                            "freed_bytes": rel.freed_bytes,
                            "within_keep": rel.resident_bytes <= keep,
                        }
                    )
                else:
                    step("pattern: restore, then the replay compared bitwise")
                    rst = res.restore()  # overlapped where possible: the replay's first decode is gated
                    ok = replay.run() == reference
                    res.settle()
                    same.append(ok)
                    pattern.append(
                        {"step": "restore", "ms": rst.ms, "bytes": rst.bytes, "bitwise_identical": ok}
                    )
            report["pattern"] = pattern
            report["first_decode"] = first_decode_after_restore(llm, res, cycles, step)
            same.append(report["first_decode"]["bitwise_identical"])
        finally:
            res.close()
    finally:
        llm.close()
    p1, pn = report["parts_1"], report[f"parts_{parts}"]
    report["restore_ms_ratio"] = pn["restore_ms"] / p1["restore_ms"] if p1["restore_ms"] else 0.0
    report["restored_bytes_ratio"] = (
        pn["restored_bytes"] / p1["restored_bytes"] if p1["restored_bytes"] else 0.0
    )
    report["bitwise_identical"] = all(same) and all(
        s.get("within_keep", True) for s in report.get("pattern", [])
    )
    return report


def print_partial(r: dict[str, Any]) -> None:
    ok = "yes" if r["bitwise_identical"] else "NO"
    n = r["parts_asked"]
    lines = [
        f"model:              {r['model']}",
        f"backend:            {r.get('backend', '?')} (llama-cpp-python {r['llama_cpp_version']})",
        f"path:               {r.get('path', '?')}"
        + (f" ({r['parts_note']})" if r.get("parts_note") else ""),
        f"layer parts:        {len(r.get('layer_parts', []))} of {n} asked: "
        + ", ".join(
            f"{p['first_layer']}-{p['last_layer']} {p['bytes'] / 1e6:.1f} MB"
            for p in r.get("layer_parts", [])
        ),
        f"bitwise identical:  {ok} (every restore of {r['cycles']} cycles each and of the pattern)",
    ]
    for key in ("parts_1", f"parts_{n}"):
        m = r[key]
        lines.append(
            f"{key + ', keep 50 %:':20}release {m['release_ms']:.2f} ms "
            f"({m['released_bytes'] / 1e6:.1f} MB), restore {m['restore_ms']:.2f} ms "
            f"({m['restored_bytes'] / 1e6:.1f} MB, {m['restore_gbps']:.2f} GB/s)"
        )
    lines.append(
        f"parts {n} / 1:        restore time x{r['restore_ms_ratio']:.3f}, "
        f"bytes moved x{r['restored_bytes_ratio']:.3f}"
    )
    for s in r.get("pattern", []):
        if s["step"] == "restore":
            lines.append(
                f"  restore:          {s['ms']:.2f} ms, {s['bytes'] / 1e6:.1f} MB, "
                f"bitwise {'yes' if s['bitwise_identical'] else 'NO'}"
            )
        else:
            lines.append(
                f"  {s['step'] + ':':17} {s['ms']:.2f} ms, released {s['released_bytes'] / 1e6:.1f} MB "
                f"(freed {s['freed_bytes'] / 1e6:.1f} MB), resident {s['resident_bytes'] / 1e6:.1f} MB"
            )
    fd = r.get("first_decode")
    if fd:
        g = fd.get("gate") or {}
        lines.append(
            f"restore + first decode ({fd['prompt_tokens']}-token prefill): "
            f"synchronous {fd['sync_ms']:.1f} ms, overlapped {fd['overlapped_ms']:.1f} ms "
            f"(x{fd['ratio']:.3f}); raw copy {fd['raw_copy_ms']:.1f} ms, "
            f"prefill alone {fd['prefill_ms']:.1f} ms; bitwise {'yes' if fd['bitwise_identical'] else 'NO'}"
        )
        if fd["overlapped"]:
            lines.append(
                f"  overlapped:       allocation {fd['restore_overlapped_ms']:.2f} ms, then "
                f"{g.get('pending_bytes_at_first_node', 0) / 1e6:.1f} MB still uploading at the first node; "
                f"the gate waited {g.get('gate_waits', 0):.0f} times, {g.get('gate_wait_ms', 0):.1f} ms, "
                f"{g.get('gate_ranges', 0):.0f} early ranges; uploads {g.get('uploads_ms', 0):.1f} ms"
            )
            lines.append(
                f"  from the restore: first copy at {g.get('first_upload_at_ms', 0):.2f} ms, returned at "
                f"{g.get('returned_ms', 0):.2f} ms, first node at {g.get('first_node_at_ms', 0):.2f} ms, "
                f"last copy done at {g.get('last_upload_end_at_ms', 0):.1f} ms, last wait over at "
                f"{g.get('last_wait_end_at_ms', 0):.1f} ms; "
                f"upload thread idle {g.get('upload_gaps_ms', 0):.2f} ms"
            )
        else:
            lines.append(f"  overlapped restore off: {fd['overlap_note']}")
    print("\n".join(lines))
