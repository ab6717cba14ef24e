"""``timeshare bench residency``: in-place release/restore of one model against the physical
limit measured in the same run (a raw copy of the same bytes from the same pinned shadow through
the same ggml call) and against the alternatives (reload from the page cache; KV snapshot +
rebuild). Prints a table of times and ratios, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from ..errors import TimeshareError
from .doctor import report_failure
from .handover_check import handover_lines, handover_report, handover_source

if TYPE_CHECKING:
    from ..arena.handclient import HandoverClient

log = logging.getLogger(__name__)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def run_residency_bench(
    model: str,
    cycles: int,
    n_ctx: int,
    n_prefill: int | None = None,
    parts: int = 1,
    probe_copy: bool = True,
    handover: bool = False,
) -> dict[str, Any]:
    """``parts``: the layer parts the weights are held in (1: the model's own buffers);
    ``probe_copy``: also copy the shadow under a restore's conditions (rawcopy.copy_probe);
    ``handover``: restores map handed-over memory (issue 40) from a holder of this run's own."""
    with handover_source(handover) as source:
        return _run_residency_bench(model, cycles, n_ctx, n_prefill, parts, probe_copy, source)


def _run_residency_bench(
    model: str,
    cycles: int,
    n_ctx: int,
    n_prefill: int | None,
    parts: int,
    probe_copy: bool,
    source: HandoverClient | None,
) -> dict[str, Any]:
    import llama_cpp  # before numpy

    from ..residency import Residency, ResidencyOptions
    from .copy_baseline import vulkan_baseline
    from .rawcopy import copy_probe, raw_copy_seconds
    from .residency_check import GreedyReplay, load_for_check, run_cycles

    prefill = n_prefill if n_prefill is not None else min(2048, n_ctx // 2)
    loaded = load_for_check(model, cycles, n_ctx=n_ctx, n_batch=min(2048, n_ctx), n_ubatch=512)
    llm, probe = loaded.llm, loaded.probe
    out: dict[str, Any] = {
        "model": model,
        "file_bytes": loaded.info.file_bytes,
        "n_ctx": n_ctx,
        "n_prefill": prefill,
    }
    out["backend_probe"] = probe.backend
    out["llama_cpp_version"] = probe.version
    out["first_load_s"] = loaded.load_s
    try:
        t0 = time.perf_counter()
        replay = GreedyReplay(llm, n_prefill=prefill)
        out["prefill_s"] = time.perf_counter() - t0
        reference = replay.run()
        t0 = time.perf_counter()
        res = Residency.attach(
            llm,
            model,
            ResidencyOptions(mode="auto", parts=parts, overlap_restore=False, handover=source is not None),
            chunk_source=source,
        )
        out["attach_s"] = time.perf_counter() - t0
        out.update(path=res.path, reason=res.reason, backend=res.backend, weight_bytes=res.weight_bytes)
        out["parts"] = len(res.parts())
        out.update(host_bytes=res.host_bytes, host_pinned=res.host_pinned, host_note=res.host_note)
        view = res.inplace_view
        if view is not None:
            out["shadow_fill_s"] = view.shadow_fill_s
            out["n_weight_tensors_seen"] = view.n_weight_tensors_seen
            out["n_buffers"] = len(view.buffers)
            out["one_copy_buffers"] = sum(1 for b in view.buffers if b.mirror)
        raw: list[float] = []
        baseline: list[dict[str, Any]] = []

        def measure_raw_copy() -> None:  # the limit, measured while the model is released
            if res.path == "inplace" and view is not None:
                raw.extend(raw_copy_seconds(view, reps=3))
                if probe_copy:
                    out["copy_probe"] = copy_probe(view)
            found = vulkan_baseline(res)  # Vulkan builds: the plain-Vulkan copy, independent of ggml
            if found is not None:
                baseline.append(found)

        steps: list[dict[str, float]] = []
        done = run_cycles(
            res,
            replay,
            reference,
            cycles,
            while_first_released=measure_raw_copy,
            after_restore=lambda: steps.append(res.restore_steps.as_dict()),
        )
        rel = [r.ms for r in done.releases]
        rst = [r.ms for r in done.restores]
        freed = [r.freed_bytes for r in done.releases]
        same = done.same
        # the weight bytes a restore brings back: uploaded, or found still in kept handed memory
        # (issue 40: a restore into kept chunks nobody else mapped since uploads nothing)
        skipped = int(steps[-1].get("skipped_upload_bytes", 0)) if steps else 0
        rst_bytes = done.restores[-1].bytes + skipped
        out["restore_uploaded_bytes"] = done.restores[-1].bytes
        out["restore_skipped_bytes"] = skipped
        out.update(
            cycles=cycles,
            bitwise_identical=all(same),
            release_ms=_median(rel),
            release_ms_max=max(rel),
            restore_ms=_median(rst),
            restore_ms_min=min(rst),
            restore_ms_all=rst,  # cycle 0 follows the raw copy measurement, the others a release
            restore_bytes=rst_bytes,
            released_bytes=int(statistics.median(freed)),
            released_fraction=statistics.median(freed) / res.weight_bytes if res.weight_bytes else 0.0,
        )
        out["restore_gbps"] = rst_bytes / 1e9 / (out["restore_ms"] / 1000) if out["restore_ms"] else 0.0
        if raw:
            best = min(raw)
            out["raw_copy_ms"] = best * 1000
            out["raw_copy_ms_reps"] = [x * 1000 for x in raw]  # the first into fresh memory
            out["raw_copy_gbps"] = rst_bytes / 1e9 / best
            out["restore_vs_raw"] = out["restore_gbps"] / out["raw_copy_gbps"]
            out["best_restore_vs_raw"] = (rst_bytes / 1e9 / (out["restore_ms_min"] / 1000)) / out[
                "raw_copy_gbps"
            ]
        if baseline:
            out["baseline"] = baseline[0]
            if baseline[0].get("gbps"):
                out["baseline_gbps"] = baseline[0]["gbps"]
                out["restore_vs_baseline"] = out["restore_gbps"] / baseline[0]["gbps"]
        out["release_steps"] = res.release_steps.as_dict()
        out["restore_steps"] = res.restore_steps.as_dict()
        out["restore_steps_all"] = steps
        out["handover"] = handover_report(res, source)
        # bytes handed over vs allocated, over the measured cycles
        out["handover_handed_bytes"] = sum(s.get("handed_chunks", 0.0) for s in steps) * _chunk(out)
        out["handover_created_bytes"] = sum(s.get("created_chunks", 0.0) for s in steps) * _chunk(out)
        # alternative 1: reload from the page cache (what a process swap pays, without the process)
        res.release()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = -1
        mp.load_mode = llm.model_params.load_mode
        t0 = time.perf_counter()
        m2 = llama_cpp.llama_model_load_from_file(model.encode(), mp)
        t1 = time.perf_counter()
        c2 = llama_cpp.llama_init_from_model(m2, llm.context_params) if m2 else None
        t2 = time.perf_counter()
        if c2:
            llama_cpp.llama_free(c2)
        if m2:
            llama_cpp.llama_model_free(m2)
        out["reload_model_ms"] = (t1 - t0) * 1000
        out["reload_model_ctx_ms"] = (t2 - t0) * 1000
        out["reload_plus_prefill_ms"] = out["reload_model_ctx_ms"] + out["prefill_s"] * 1000
        res.restore()
        res.close()
        # alternative 2: KV snapshot + free model and context, load again + KV back (rebuild path)
        reb = Residency.attach(llm, model, ResidencyOptions(mode="rebuild"))
        rdone = run_cycles(reb, replay, reference, min(cycles, 2))
        out.update(
            rebuild_release_ms=_median([r.ms for r in rdone.releases]),
            rebuild_restore_ms=_median([r.ms for r in rdone.restores]),
            rebuild_bitwise_identical=all(rdone.same),
        )
        reb.close()
    finally:
        llm.close()
    base = out["restore_ms"] or 1e-9
    out["table"] = [
        {"what": "in-place restore (median)", "ms": out["restore_ms"], "x_inplace": 1.0},
        {
            "what": "raw pinned copy, same bytes, same ggml path",
            "ms": out.get("raw_copy_ms"),
            "x_inplace": (out["raw_copy_ms"] / base) if "raw_copy_ms" in out else None,
        },
        {"what": "in-place release (median)", "ms": out["release_ms"], "x_inplace": out["release_ms"] / base},
        {
            "what": "reload model + context from page cache",
            "ms": out["reload_model_ctx_ms"],
            "x_inplace": out["reload_model_ctx_ms"] / base,
        },
        {
            "what": f"reload + re-prefill {prefill} tokens",
            "ms": out["reload_plus_prefill_ms"],
            "x_inplace": out["reload_plus_prefill_ms"] / base,
        },
        {
            "what": "KV snapshot + rebuild: release",
            "ms": out["rebuild_release_ms"],
            "x_inplace": out["rebuild_release_ms"] / base,
        },
        {
            "what": "KV snapshot + rebuild: restore",
            "ms": out["rebuild_restore_ms"],
            "x_inplace": out["rebuild_restore_ms"] / base,
        },
    ]
    return out


def _chunk(out: dict[str, Any]) -> float:
    return float(out["handover"].get("chunk_bytes", 0))


def _print_table(r: dict[str, Any]) -> None:
    print(
        f"model {r['model']} ({r['file_bytes'] / 1e9:.2f} GB), backend {r['backend']}, path {r['path']}"
        + (f" ({r['reason']})" if r["reason"] else "")
    )
    print(
        f"weights {r['weight_bytes'] / 1e9:.2f} GB, freed {100 * r['released_fraction']:.1f} %, "
        f"bitwise identical: {r['bitwise_identical']} ({r['cycles']} cycles), "
        f"rebuild bitwise identical: {r['rebuild_bitwise_identical']}"
    )
    if "restore_vs_baseline" in r:
        print(
            f"restore {r['restore_gbps']:.1f} GB/s vs the plain-Vulkan copy baseline "
            f"{r['baseline_gbps']:.1f} GB/s: {r['restore_vs_baseline']:.3f}"
        )
    if "raw_copy_gbps" in r:
        print(
            f"restore {r['restore_gbps']:.1f} GB/s vs raw copy {r['raw_copy_gbps']:.1f} GB/s: "
            f"{r['restore_vs_raw']:.3f} (best cycle {r['best_restore_vs_raw']:.3f})"
        )
    for line in handover_lines(r.get("handover")):
        print(line)
    print(f"{'':48} {'ms':>10} {'x in-place restore':>20}")
    for row in r["table"]:
        ms = "-" if row["ms"] is None else f"{row['ms']:.2f}"
        x = "-" if row["x_inplace"] is None else f"{row['x_inplace']:.2f}"
        print(f"{row['what']:48} {ms:>10} {x:>20}")


def main(args: argparse.Namespace) -> int:
    if args.bench == "switch":
        from .bench_switch import main as switch_main

        return switch_main(args)
    if args.bench == "api" and getattr(args, "responses", False):
        from .bench_api_responses import main as responses_main

        return responses_main(args)
    if args.bench == "api":
        from .bench_api import main as api_main

        return api_main(args)
    if args.bench == "embed":
        from .bench_embed import main as embed_main

        return embed_main(args)
    if args.bench == "rerank":
        from .bench_rerank import main as rerank_main

        return rerank_main(args)
    if args.bench == "parallel":
        from .bench_parallel import main as parallel_main

        return parallel_main(args)
    if args.bench == "vk-handover":
        from .vkhandover import main as vk_handover_main

        return vk_handover_main(args)
    if args.bench != "residency":
        print(
            f"timeshare bench {args.bench}: not part of this build yet (only `timeshare bench residency` is)",
            file=sys.stderr,
        )
        return 2
    try:
        report = run_residency_bench(
            args.model,
            int(args.cycles),
            int(args.n_ctx),
            parts=int(args.parts),
            probe_copy=not args.no_copy_probe,
            handover=bool(getattr(args, "handover", False)),
        )
    except TimeshareError as exc:
        return report_failure("bench", exc, bool(args.json))
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0 if report["bitwise_identical"] and report["rebuild_bitwise_identical"] else 1
