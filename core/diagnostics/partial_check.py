"""``timeshare doctor --partial``: the layer parts of the in-place path (issue 28) on this
machine's backend.

Loads the model as the doctor does, records the reference (8 greedy decode steps), then:
1. whole buffers (``parts=1``): ``cycles`` releases down to half the weights (which with one part
   releases everything) and restores, each followed by the replay compared bitwise;
2. ``parts=N``: the same cycles (about half the weights move), then a pattern of partial
   releases and restores (keep 70 %, 30 %, restore, keep 0, restore, keep 50 % with the KV cache,
   restore), each restore followed by the replay compared bitwise.
Reports the release/restore milliseconds and bytes of both, and every step of the pattern.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

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
            steps: list[dict[str, dict[str, float]]] = []
            for i in range(cycles):
                step(f"{label}: release down to 50 % and restore, cycle {i + 1}/{cycles}")
                rel = res.release(keep_bytes=keep)
                rst = res.restore()
                ok = replay.run() == reference
                same.append(ok)
                rel_ms.append(rel.ms)
                rst_ms.append(rst.ms)
                released.append(rel.released_bytes)
                freed.append(rel.freed_bytes)
                restored.append(rst.bytes)
                steps.append({"release": res.release_steps, "restore": res.restore_steps})
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
        res = Residency.attach(llm, model, ResidencyOptions(mode="inplace", parts=parts))
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
                    rst = res.restore()
                    ok = replay.run() == reference
                    same.append(ok)
                    pattern.append(
                        {"step": "restore", "ms": rst.ms, "bytes": rst.bytes, "bitwise_identical": ok}
                    )
            report["pattern"] = pattern
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
    print("\n".join(lines))
