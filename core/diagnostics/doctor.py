"""``timeshare doctor``: run the whole residency mechanism on this machine's backend and report.

Loads a model (default: the smallest demo model) the way the engine does when it wants the
mechanism (no mmap on a CPU-only build, so host weight buffers play the device), prefills a
prompt, records the logits of 8 greedy decode steps, then runs release/restore cycles and
compares the logits bitwise after each (a recurrent or hybrid model's state cannot rewind: its
prompt's state is saved and put back; an encoder's embeddings are compared instead;
residency_check.replay_kind). With ``--json`` stdout carries only the JSON report.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import envvars
from ..errors import TimeshareError
from .card import hold_card
from .handover_check import handover_lines, handover_report, handover_source
from .vkhandover import probe_lines

if TYPE_CHECKING:  # importing residency loads llama_cpp: run_doctor imports it when it runs
    from ..arena.handclient import HandoverClient
    from ..residency.options import Mode

log = logging.getLogger(__name__)


def _default_model() -> str:
    from ..config import demo

    try:
        return str(demo.smollm2_path())
    except demo.DemoUnavailableError as exc:
        raise TimeshareError(
            f"no --model given and the demo model is not installed ({exc}): pass --model PATH.gguf"
        ) from exc


_MEASURES = {
    "device": "device free memory (ggml_backend_dev_memory)",
    "rss": "process RSS (mmap threshold fixed)",
}


def run_doctor(
    model: str,
    cycles: int,
    n_ctx: int = 512,
    mode: Mode = "auto",
    budget: str = "one-model",
    mmproj: str = "",
    handover: bool = False,
) -> dict[str, Any]:
    """Run the check; returns the report (raises TimeshareError on bad input). ``mode`` forces
    the in-place or the rebuild path (``make vulkan-check`` checks the rebuild path with it).
    ``budget``: the VRAM budget setting to report for device 0 (``--budget``; e.g. auto).
    ``mmproj``: a vision projector for the model (a path, or "generated": one made for it with
    random weights, core/diagnostics/synthetic_projector.py), released and restored with the
    weights and checked bitwise (the same image's embeddings after each restore).
    ``handover``: restores map handed-over memory (issue 40) from a holder of this run's own."""
    with handover_source(handover) as source:
        return _run_doctor(model, cycles, n_ctx, mode, budget, source, mmproj)


def _run_doctor(
    model: str,
    cycles: int,
    n_ctx: int,
    mode: Mode,
    budget: str,
    source: HandoverClient | None,
    mmproj: str = "",
) -> dict[str, Any]:
    from ..residency import Residency, ResidencyOptions
    from .copy_baseline import vulkan_baseline
    from .residency_check import Cycles, GreedyReplay, load_for_check, run_cycles

    _step(f"loading {model}")
    loaded = load_for_check(
        model,
        cycles,
        failure_hint=": check that it is a supported GGUF model",
        n_ctx=n_ctx,
        n_batch=128,
    )
    llm, probe = loaded.llm, loaded.probe
    try:
        replay = GreedyReplay(llm)
        _step("recording the reference: 8 greedy decode steps")
        reference = replay.run()
        projector = ProjectorCheck.start(llm, model, mmproj) if mmproj else None
        _step("attaching the residency mechanism")
        res = Residency.attach(
            llm, model, ResidencyOptions(mode=mode, handover=source is not None), chunk_source=source
        )
        _step(f"{res.path} path on {res.backend}" + (f" ({res.reason})" if res.reason else ""))
        if projector is not None:
            projector.attach(res)
        done = Cycles()
        steps: list[dict[str, Mapping[str, float | str]]] = []
        baseline: list[dict[str, Any]] = []

        def measure_baseline() -> None:  # while released: the device memory is free for it
            if not res.backend.startswith("Vulkan"):
                return
            _step("the copy baseline: one fenced plain-Vulkan copy of 1 GiB, host -> device")
            found = vulkan_baseline(res)
            if found is not None:
                baseline.append(found)

        for i in range(cycles):
            _step(f"release/restore cycle {i + 1}/{cycles}, then the replay compared bitwise")
            one = run_cycles(
                res,
                replay,
                reference,
                1,
                while_first_released=measure_baseline if i == 0 else None,
                after_restore=projector.after_restore if projector is not None else None,
            )
            done.releases += one.releases
            done.restores += one.restores
            done.same += one.same
            steps.append({"release": res.release_steps.as_dict(), "restore": res.restore_steps.as_dict()})
        releases = [r.ms for r in done.releases]
        restores = [r.ms for r in done.restores]
        freed = [r.freed_bytes for r in done.releases]
        gbps = [r.gbps for r in done.restores]
        same = done.same
        # one deeper cycle: weights + KV cache (a deep release on contention: in place where the
        # cache is a plain one, else the context freed and made again)
        _step("release/restore with the KV cache (the deep level)")
        res.release(kv=True)
        kv_level = {
            "in_place": res.kv_in_place,
            "compute_buffers_released": res.compute_released_bytes > 0 or not res.kv_in_place,
            "compute_released_bytes": res.compute_released_bytes,
            "kv_saved_bytes": res.kv_host_bytes,
            # the save of the cells: its milliseconds and way (kv_save_path "raw" or "state")
            "release_steps": res.release_steps.as_dict(),
            "note": res.deep_note,
        }
        res.restore()
        kv_same = replay.run() == reference
        kv_level["restore_steps"] = res.restore_steps.as_dict()
        report: dict[str, Any] = {
            "path": res.path,
            "reason": res.reason,
            "backend": res.backend,
            "model": model,
            "llama_cpp_version": probe.version,
            "cycles": cycles,
            # how the check replays (residency_check.replay_kind): "rewind" (the KV cache goes back
            # to the prompt), "saved state" (recurrent, hybrid, a short sliding window: the prompt's
            # state is put back) or "embeddings" (an encoder: the embeddings are compared)
            "check": replay.kind,
            "bitwise_identical": all(same),
            "bitwise_identical_cycles": sum(same),
            "kv_level_bitwise_identical": kv_same,
            # how the KV level went (issue 39): in place, or the context freed, and why
            "kv_level": kv_level,
            "weight_bytes": res.weight_bytes,
            "released_bytes": int(statistics.median(freed)),
            "released_fraction": (statistics.median(freed) / res.weight_bytes) if res.weight_bytes else 0.0,
            "release_ms": statistics.median(releases),
            "restore_ms": statistics.median(restores),
            "restore_gbps": statistics.median(gbps),
            "host_bytes": res.host_bytes,
            "host_pinned": res.host_pinned,
            "host_parts": res.host_parts,
            "host_note": res.host_note,
            "steps": steps,  # per cycle: milliseconds of each step of release and restore
            "memory_measure": _MEASURES[res.memory_measure],
            # why the measure is not the device's own report (a driver without memory usage)
            "memory_note": res.memory_note,
        }
        if baseline:
            report["baseline"] = baseline[0]
            if "gbps" in baseline[0] and baseline[0]["gbps"] > 0:
                report["restore_vs_baseline"] = report["restore_gbps"] / baseline[0]["gbps"]
        dev = res.device_memory()
        if dev is not None:  # what ggml_backend_dev_memory says now (weights restored)
            report["device_memory"] = {"device": dev[0], "free_bytes": dev[1], "total_bytes": dev[2]}
        view = res.inplace_view
        if view is not None:  # how the in-place path found the weights (residency/discovery.py)
            report["weights_seen_by_graph"] = view.n_weight_tensors_seen
            report["weights_from_tensor_list"] = list(view.weights_listed)
        report["vram_budget"] = budget_report(budget, res.weight_bytes)
        if projector is not None:
            report["projector"] = projector.report(res)
        report["handover"] = handover_report(res, source)
        if res.backend.startswith("Vulkan") and res.device is not None:
            from .vkhandover import probe_for_ggml_device

            _step("the Vulkan hand-over: opaque fds from one process to another through a holder")
            report["vk_handover"] = probe_for_ggml_device(res.device)
        res.close()
        if projector is not None:
            projector.close()
    finally:
        llm.close()
    return report


class ProjectorCheck:
    """A vision projector beside the model (``--mmproj``): its embeddings of one image before the
    cycles, and after each restore (the image encoded again by the restored projector), compared
    bitwise."""

    def __init__(self, vision: Any, path: str, generated: bool) -> None:
        self.vision = vision
        self.path = path
        self.generated = generated
        self.image = _test_image()
        self.reference = vision.encode_image(self.image)
        self.same: list[bool] = []
        self.attached = False

    @classmethod
    def start(cls, llm: Any, model: str, mmproj: str) -> ProjectorCheck:
        from ..residency import ggml_devices
        from ..worker.vision import Vision
        from .synthetic_projector import write_projector_for

        generated = mmproj == "generated"
        if generated:
            folder = Path(tempfile.mkdtemp(prefix="timeshare-doctor-"))
            _step("writing a generated projector for the model (random weights)")
            path = str(write_projector_for(Path(model), folder / "mmproj-generated.gguf"))
        else:
            path = mmproj
        _step(f"loading the projector {path}")
        gpus = [d for d in ggml_devices() if d.is_gpu]
        vision = Vision(
            llm,
            path,
            n_threads=max(1, int(llm.n_threads_batch or 1)),
            device=gpus[0].handle if gpus else None,
            use_gpu=bool(gpus),
        )
        return cls(vision, path, generated)

    def attach(self, res: Any) -> None:
        self.attached = res.attach_projector(self.vision.watch, self.path)
        if self.attached:  # its restore runs off the caller's path: an encode waits for it
            self.vision.ready = res.projector_ready
        _step(
            f"the projector's {res.projector_bytes / 1e6:.1f} MB go with the weights"
            if self.attached
            else f"the projector stays on the device: {res.projector_note}"
        )

    def after_restore(self) -> None:
        self.same.append(bool((self.vision.encode_image(self.image) == self.reference).all()))

    def report(self, res: Any) -> dict[str, Any]:
        return {
            "path": self.path if not self.generated else "generated (random weights)",
            "weight_bytes": self.vision.weight_bytes,
            "released_with_weights": self.attached,
            "device_bytes": res.projector_bytes,
            "note": res.projector_note,
            "bitwise_identical": bool(self.same) and all(self.same),
            "bitwise_identical_cycles": sum(self.same),
        }

    def close(self) -> None:
        self.vision.close()
        if self.generated:
            shutil.rmtree(Path(self.path).parent, ignore_errors=True)


def _test_image() -> bytes:
    """A small PNG with some structure (a gradient), made with Pillow."""
    import io

    from PIL import Image

    im = Image.new("RGB", (48, 40))
    im.putdata([(x * 5 % 256, y * 6 % 256, (x + y) * 3 % 256) for y in range(40) for x in range(48)])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


#: each step of the check as it starts (``main`` shows them: on stdout, on stderr with --json)
_steps = logging.getLogger(__name__ + ".steps")


def _step(text: str) -> None:
    _steps.info(text)


def _show_steps(to_stderr: bool) -> None:
    handler = logging.StreamHandler(sys.stderr if to_stderr else sys.stdout)
    handler.setFormatter(logging.Formatter("doctor: %(message)s"))
    _steps.addHandler(handler)
    _steps.setLevel(logging.INFO)
    _steps.propagate = False


def report_failure(command: str, exc: TimeshareError, as_json: bool) -> int:
    """A doctor or bench run that could not start: the error as JSON on stdout (with ``--json``)
    and as a line on stderr; returns exit status 2."""
    if as_json:
        print(json.dumps({"error": str(exc), "code": exc.code}))
    print(f"timeshare {command}: {exc}", file=sys.stderr)
    return 2


def budget_report(setting: str, weight_bytes: int) -> dict[str, Any]:
    """What ``setting`` gives on device 0 now (measured with this model loaded: an auto budget
    counts it among what others use), and whether this model's weights fit it."""
    from ..arena.budget import compute_budget, parse_budget
    from ..worker.device import device_memory

    try:
        parsed = parse_budget(setting)
    except ValueError as exc:
        raise TimeshareError(f"--budget: {exc}") from None
    mem = device_memory(0)
    record = compute_budget(parsed, total=mem.total, free=mem.free + weight_bytes, device_name=mem.name)
    limit = record.weights_budget(0)
    return {
        "setting": record.setting,
        "device": mem.name,
        "budget_bytes": limit,  # None: one model at a time
        "device_total_bytes": mem.total,
        "others_bytes": record.others_bytes,
        "margin_bytes": record.margin_bytes,
        "weights_fit": limit is None or weight_bytes <= limit,
    }


def _budget_line(b: dict[str, Any] | None) -> list[str]:
    if not b:
        return []
    if b["budget_bytes"] is None:
        return [f"VRAM budget:        {b['setting']} (one model's weights at a time on {b['device']})"]
    gb = b["budget_bytes"] / 1e9
    text = f"VRAM budget:        {b['setting']}: {gb:.2f} GB for weights on {b['device']}"
    if b["margin_bytes"]:
        text += f" (of {b['device_total_bytes'] / 1e9:.2f}; others {b['others_bytes'] / 1e9:.2f}, margin "
        text += f"{b['margin_bytes'] / 1e9:.2f})"
    return [text + ("" if b["weights_fit"] else "; this model does NOT fit")]


def _baseline_lines(r: dict[str, Any]) -> list[str]:
    b = r.get("baseline")
    if not b:
        return []
    if "error" in b:
        return [f"copy baseline:      none ({b['error']})"]
    return [
        f"copy baseline:      {b['gbps']:.2f} GB/s ({b['bytes'] / 2**30:.2f} GiB, fenced vkCmdCopyBuffer on "
        f"{b['queue']}, {b['src_memory']} -> {b['dst_memory']}); restore = "
        f"{r.get('restore_vs_baseline', 0.0):.3f} of it",
        f"device buffers:     {b['device_buffers']}",
    ]


#: what the bitwise check compared, per replay kind (residency_check.replay_kind)
_CHECKS = {
    "rewind": "8 greedy steps' logits, the KV cache rewound to the prompt",
    "saved state": "the prompt's state kept, then 8 greedy steps' logits; the state put back after each",
    "embeddings": "the embeddings of the prompt (an encoder)",
}


def _kv_level_line(k: dict[str, Any] | None) -> str:
    if not k:
        return "KV level:           -"
    if k["in_place"]:
        text = "KV level:           in place (the context kept; the KV cells in use"
        text += f", {k['kv_saved_bytes'] / 1e6:.2f} MB, back with the weights' parts"
        save = k.get("release_steps", {})
        if save.get("kv_save_path"):
            text += f"; saved in {save['kv_save_ms']:.1f} ms, {save['kv_save_path']}"
        if k["compute_released_bytes"]:
            text += f"; compute buffers {k['compute_released_bytes'] / 1e6:.1f} MB released too"
        text += ")"
    else:
        text = "KV level:           the context freed and made again"
    return text + (f"; {k['note']}" if k["note"] else "")


def _found_lines(r: dict[str, Any]) -> list[str]:
    if "weights_seen_by_graph" not in r:
        return []
    listed = r["weights_from_tensor_list"]
    text = f"weights found:      {r['weights_seen_by_graph']} tensors by the warm-up graph"
    if listed:
        names = ", ".join(listed[:4]) + (f" and {len(listed) - 4} more" if len(listed) > 4 else "")
        text += f", {len(listed)} more from the model's tensor list ({names})"
    return [text]


def _print_text(r: dict[str, Any]) -> None:
    ok = "yes" if r["bitwise_identical"] and r["kv_level_bitwise_identical"] else "NO"
    lines = [
        f"model:              {r['model']}",
        f"backend:            {r['backend']} (llama-cpp-python {r['llama_cpp_version']})",
        f"path:               {r['path']}" + (f" ({r['reason']})" if r["reason"] else ""),
        f"cycles:             {r['cycles']} (+1 with the KV cache)",
        _kv_level_line(r.get("kv_level")),
        f"bitwise identical:  {ok} ({r['bitwise_identical_cycles']}/{r['cycles']}; {_CHECKS[r['check']]})",
        f"weights:            {r['weight_bytes'] / 1e6:.1f} MB, freed {r['released_bytes'] / 1e6:.1f} MB "
        f"({100 * r['released_fraction']:.1f} %, {r['memory_measure']})"
        + (
            "; handed over: the holder keeps it for the next restore"
            if r.get("handover", {}).get("on")
            else ""
        ),
        *([f"memory note:        {r['memory_note']}"] if r.get("memory_note") else []),
        *_found_lines(r),
        f"release:            {r['release_ms']:.2f} ms (median)",
        f"restore:            {r['restore_ms']:.2f} ms (median), {r['restore_gbps']:.2f} GB/s",
        f"host shadow:        {r['host_bytes'] / 1e6:.1f} MB in {r['host_parts']} allocation(s), "
        f"pinned={r['host_pinned']}" + (f" ({r['host_note']})" if r["host_note"] else ""),
        *_baseline_lines(r),
        *_budget_line(r.get("vram_budget")),
        *_projector_lines(r.get("projector")),
        *handover_lines(r.get("handover")),
        *(probe_lines(r["vk_handover"]) if r.get("vk_handover") else []),
    ]
    print("\n".join(lines))


def _projector_lines(p: dict[str, Any] | None) -> list[str]:
    if not p:
        return []
    same = "yes" if p["bitwise_identical"] else "NO"
    where = (
        f"released and restored with the weights ({p['device_bytes'] / 1e6:.1f} MB)"
        if p["released_with_weights"]
        else f"stays on the device ({p['note']})"
    )
    return [
        f"projector:          {p['path']}, {p['weight_bytes'] / 1e6:.1f} MB: {where}",
        f"projector bitwise:  {same} ({p['bitwise_identical_cycles']} restores; one image's embeddings)",
    ]


def print_env(as_json: bool) -> None:
    """``timeshare doctor --env``: every variable of the registry (core/envvars.py)."""
    rows = envvars.table()
    if as_json:
        keys = ("name", "kind", "type", "default", "value", "help")
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows]))
        return
    for kind in envvars.KINDS:
        print(f"{kind}:")
        for name, k, type_, default, value, help_ in rows:
            if k != kind:
                continue
            now = f"= {value}" if value else "(unset)"
            print(f"  {name} {now}")
            print(f"      {help_}")
            print(f"      {type_}; when unset: {default or '-'}")
        print()


def main(args: argparse.Namespace) -> int:
    model = args.model
    as_json = bool(getattr(args, "json", False))
    if getattr(args, "env", False):
        print_env(as_json)
        return 0
    _show_steps(to_stderr=as_json)  # stdout stays pure JSON
    try:
        if not model:
            model = _default_model()
        with hold_card(getattr(args, "card", None)) as card:  # before anything loads
            if card is not None:
                _step(card.describe())
            if getattr(args, "deep_floor", False):
                from .deep_floor import print_report, run_deep_floor

                context, prompt = int(getattr(args, "context", 0)), int(getattr(args, "prompt_tokens", 1500))
                if context < 0 or prompt < 1:
                    raise TimeshareError("--context must be 0 (fitted) or more, --prompt-tokens at least 1")
                report = run_deep_floor(
                    model, context, prompt, bool(getattr(args, "flash_attn", False)), _step
                )
                if card is not None:
                    report["card"] = card.to_json()
                if as_json:
                    print(json.dumps(report))
                else:
                    print_report(report)
                return 0
            if getattr(args, "partial", False):
                from .partial_check import print_partial, run_partial_check

                report = run_partial_check(model, int(args.cycles), int(getattr(args, "parts", 8)), _step)
            else:
                report = run_doctor(
                    model,
                    int(args.cycles),
                    budget=getattr(args, "budget", None) or "one-model",
                    mmproj=getattr(args, "mmproj", None) or "",
                    handover=bool(getattr(args, "handover", False)),
                )
        if card is not None:
            report["card"] = card.to_json()
    except TimeshareError as exc:
        return report_failure("doctor", exc, as_json)
    if as_json:
        print(json.dumps(report))
    elif report.get("mode") == "partial":
        print_partial(report)
    else:
        _print_text(report)
    projector_ok = report.get("projector", {}).get("bitwise_identical", True)
    ok = report["bitwise_identical"] and report.get("kv_level_bitwise_identical", True) and projector_ok
    return 0 if ok else 1
