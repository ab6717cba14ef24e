"""``timeshare bench api --deep``: the deep switch against the weights-only switch (issue 39).

A deep switch is one whose model was parked at the deep level (its KV cache and compute buffers
released in place, the context kept) because the other model needed the room. To make every
switch one, the first model runs twice (two workers on the same file, so either direction is the
same) under an ``auto`` budget on a card just too small for both reserves and one model's weights:

    budget for weights = weights + both reserves - half of one deep release

so each turn's weights fit only once the parked worker has gone deep. The card is found by trial:
a first guess from the weights-only run's figures, then the budget and the reserves the serve's
own workers measured (its arena's records) correct it, up to :data:`ATTEMPTS` serve starts. On a
GPU the card is a ballast (``--card``'s); on the CPU build a host-memory cap.

The rows (``timeshare_deep_switch``) are timed as the weights-only ones, on conversations of the
same size; each says whether its model was deep before the turn. The summary's ``deep`` compares
the medians with the issue's target: the weights-only switch (the first model's rows) plus the KV
bytes in use over the raw copy rate (host to device, measured here with ggml's own copy) plus
15 ms.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import envvars
from ..arena.arena import Arena
from ..arena.budget import auto_margin
from ..errors import TimeshareError
from .bench_api_procs import Serve
from .card import hold_card

ATTEMPTS = 4
#: the issue's allowance on top of the weights-only switch and the KV copy
TARGET_EXTRA_MS = 15.0
_MOVED_RE = re.compile(r"KV cache released, (\d+) bytes of it")
#: the releasing side (residency/kvlevel.py, residency/reports.py): the save of the cells in use
#: (and whether it allocated its host memory then, on the switch's path), then the release as a
#: whole (its save included)
_SAVED_RE = re.compile(
    r"KV cells saved: (\d+) bytes in ([\d.]+) ms \((\w+),[^)\n]*?"
    r"(?:, (none allocated|allocated in ([\d.]+) ms))?\)"
)
#: the KV snapshots' host memory grown while the worker was idle after an answer (kvmemory.py)
_AHEAD_RE = re.compile(
    r"KV snapshot host memory: ([\d.]+) MB \((\w+)\), allocated ahead of a release in ([\d.]+) ms"
)
_DEEP_RELEASED_RE = re.compile(r"released .* \(weights\+kv\): ([\d.]+) ms")


def _arena_view(serve_home: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The auto budget's bytes (before reserves) and each model's reserve (bytes, deepens), as the
    serve's arena records them."""
    arena = Arena(serve_home / "run" / "arena")
    try:
        record = arena.budget_record()
        leases = arena.leases()
    finally:
        arena.close()
    if record is None:
        raise TimeshareError("bench api --deep: the serve's arena has no budget record")
    return record.bytes, {x.model: (x.bytes, x.deepens) for x in leases if x.kind == "reserve"}


def _card_for(budget: int, overhead: int) -> int:
    """The card whose auto budget (before reserves) is ``budget``: its free memory less the margin
    (a share of it, with a floor) and ``overhead`` (what the first worker finds used already)."""
    size = budget + overhead + auto_margin(budget + overhead)
    while size - overhead - auto_margin(size - overhead) < budget:
        size += 1 << 20
    return size


def _raw_copy_gbps(nbytes: int) -> float | None:
    """Host to device copy rate of ``nbytes`` (at least 64 MiB) from pinned host memory where the
    build has it, through ``ggml_backend_tensor_set`` (the call a restore uploads with): the best
    of three into one buffer. None when it cannot be measured here."""
    from ..residency.hostmem import HostMemory
    from ..residency.scratch import ScratchTensor, first_device_buffer_type

    n = max(nbytes, 64 << 20)
    buft = first_device_buffer_type()
    if buft is None:
        return None
    host = HostMemory(n, True)
    try:
        target = ScratchTensor(buft, n)
        try:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                target.set(host.ptr, 0, n)
                times.append(time.perf_counter() - t0)
        finally:
            target.free()
    finally:
        host.close()
    return n / min(times) / 1e9


def run_deep_phase(
    work: Path,
    model: str,
    prompts: Callable[[int, int], str],
    n_ctx: int,
    flash_attn: bool,
    rounds: int,
    guess: dict[str, int],
    say: Callable[[str], None],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Alternating turns of two workers of ``model`` under an auto budget on a card that makes
    every switch deep; returns the rows and what was found (card, budget, reserves, KV moved).
    ``prompts(i, r)``: worker i's prompt at turn r; ``guess``: the weights-only run's figures of
    the model (weight_bytes, kv_bytes, buffer_bytes, context_bytes)."""
    ids = ["deep-a", "deep-b"]
    weights = int(guess.get("weight_bytes") or 0)
    if weights <= 0:
        raise TimeshareError("bench api --deep: the first model's weight bytes are not known")
    parked = int(guess.get("kv_bytes") or 0) + int(guess.get("buffer_bytes") or 0)
    reserve = parked + int(guess.get("context_bytes") or 0)
    deepens = max(parked, 1 << 20)
    overhead = 0
    info: dict[str, Any] = {"model": model, "attempts": []}
    for attempt in range(1, ATTEMPTS + 1):
        target = weights + 2 * reserve - deepens // 2
        size = _card_for(target, overhead)
        say(
            f"deep switch: attempt {attempt}, a card of {size / 1e9:.3f} GB "
            f"(weights budget {target / 1e9:.3f} GB)"
        )
        home = work / f"deep-{attempt}"
        with hold_card(str(size)):
            # auto whatever $TIMESHARE_VRAM_BUDGET says (it replaces "auto": the tests set one-model)
            env = {envvars.VRAM_BUDGET.name: "auto"}
            serve = Serve(home, ids, [model, model], n_ctx, flash_attn, budget="auto", env=env, progress=say)
            try:
                failed = ""
                try:
                    serve.wait_ready(say)
                except TimeshareError as exc:  # too small a card: a model did not fit (corrected below)
                    failed = str(exc)
                budget, reserves = _arena_view(home / "home")
                got = {
                    "card_bytes": size,
                    "budget_bytes": budget,
                    "reserves": {k: {"bytes": b, "deepens": d} for k, (b, d) in reserves.items()},
                    "failed": failed,
                }
                info["attempts"].append(got)
                if not reserves:
                    if attempt == ATTEMPTS:
                        raise TimeshareError(f"bench api --deep: no worker started on the card ({failed})")
                    # the guess was too small for even one model beside its reserve (it comes from
                    # the weights-only run's figures): a card with room for a model's reserve
                    # twice over, the next serve's workers then measure the real one
                    reserve = max(2 * reserve, weights // 2)
                    deepens = max(deepens, reserve // 2)
                    continue
                each = max(b for b, _d in reserves.values())
                least = (
                    min(d for _b, d in reserves.values() if d > 0)
                    if any(d > 0 for _b, d in reserves.values())
                    else deepens
                )
                limit = budget - 2 * each  # the weights' budget with both parked at the weights level
                # every switch deep: one model's weights do not fit beside both reserves, and do
                # once the other's deep release is counted
                if not failed and set(reserves) == set(ids) and limit < weights <= limit + least:
                    rows = _turns(serve, ids, prompts, rounds, say)
                    info.update(got)
                    info["kv_moved_bytes"] = _kv_moved(home / "home" / "log", ids)
                    info["releases"] = deep_releases(home / "home" / "log", ids)
                    info["kv_host_ahead"] = kv_host_ahead(home / "home" / "log", ids)
                    info["overlaps"] = {mid: serve.worker_overlaps(mid) for mid in ids}
                    return rows, info
                # correct the guess with what the workers measured, and try again
                overhead += target - budget  # what the card's first worker found used besides
                reserve, deepens = each, max(least, 1 << 20)
            finally:
                serve.close()
    raise TimeshareError(
        f"bench api --deep: no card made every switch deep in {ATTEMPTS} attempts "
        f"(the last: {info['attempts'][-1] if info['attempts'] else 'none'})"
    )


def _turns(
    serve: Serve, ids: list[str], prompts: Callable[[int, int], str], rounds: int, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    for i, mid in enumerate(ids):  # the first turn of each conversation: a full prefill, not counted
        serve.turn(mid, prompts(i, 0), f"bench-deep-{mid}", what=f"timeshare_deep_switch {mid} first turn")
    rows = []
    for r in range(1, rounds + 1):
        for i, mid in enumerate(ids):
            kv_before = next(
                (int(m.get("kv_bytes") or 0) for m in serve.status().get("models", []) if m["id"] == mid), -1
            )
            row = serve.turn(
                mid, prompts(i, r), f"bench-deep-{mid}", what=f"timeshare_deep_switch {mid} turn {r}/{rounds}"
            )
            row.update(round=r, deep=kv_before == 0)
            rows.append(row)
            say(
                f"timeshare_deep_switch {mid} turn {r}: {row['ttft_ms']:.1f} ms, switched {row['switched']}, "
                f"deep before it {row['deep']}"
            )
    return rows


def _kv_moved(log_dir: Path, ids: list[str]) -> list[int]:
    """The KV bytes each deep release moved to host memory (the cells in use), from the logs."""
    out: list[int] = []
    for _mid, text in _worker_logs(log_dir, ids):
        out += [int(n) for n in _MOVED_RE.findall(text)]
    return out


def _median(values: list[Any]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return statistics.median(got) if got else None


def _worker_logs(log_dir: Path, ids: list[str]) -> list[tuple[str, str]]:
    """(model id, its worker's log text) for each of ``ids`` whose log can be read."""
    out: list[tuple[str, str]] = []
    for mid in ids:
        try:
            out.append((mid, (log_dir / f"worker-{mid}.log").read_text(errors="replace")))
        except OSError:
            continue
    return out


def deep_releases(log_dir: Path, ids: list[str]) -> list[dict[str, Any]]:
    """The releasing side of each deep switch, from the parked workers' logs: the save of the
    KV cells (bytes, ms, way: "raw" straight from the KV tensors or "state") and the whole deep
    release's ms (the save, the KV and compute buffers and the weights freed)."""
    out: list[dict[str, Any]] = []
    for mid, text in _worker_logs(log_dir, ids):
        saves = _SAVED_RE.findall(text)
        released = _DEEP_RELEASED_RE.findall(text)
        for i, (nbytes, ms, way, alloc, alloc_ms) in enumerate(saves):
            row: dict[str, Any] = {"model": mid, "kv_save_bytes": int(nbytes), "kv_save_ms": float(ms)}
            row["kv_save_path"] = way
            if alloc:  # (a log of a build before the allocation was told: not known)
                row["kv_host_grown"] = 0 if alloc == "none allocated" else 1
                row["kv_host_alloc_ms"] = float(alloc_ms) if alloc_ms else 0.0
            if i < len(released):
                row["release_ms"] = float(released[i])
            out.append(row)
    return out


def kv_host_ahead(log_dir: Path, ids: list[str]) -> list[dict[str, Any]]:
    """The KV snapshots' host memory each worker grew while idle after an answer, off the
    switch's path (TIMESHARE_KV_AHEAD): MB, pinned or pageable, milliseconds."""
    out: list[dict[str, Any]] = []
    for mid, text in _worker_logs(log_dir, ids):
        out += [
            {"model": mid, "mb": float(mb), "memory": kind, "alloc_ms": float(ms)}
            for mb, kind, ms in _AHEAD_RE.findall(text)
        ]
    return out


def summarise_deep(
    rows: list[dict[str, Any]], weights_only: list[dict[str, Any]], info: dict[str, Any]
) -> dict[str, Any]:
    """The deep switch against the issue's target: the medians of the switched turns that were
    deep, of the weights-only switches of the same model, the KV bytes in use and the raw copy."""
    deep = [float(r["ttft_ms"]) for r in rows if r.get("switched") and r.get("deep")]
    plain = [float(r["ttft_ms"]) for r in weights_only if r.get("switched")]
    moved = [n for n in info.get("kv_moved_bytes", []) if n > 0]
    kv = float(statistics.median(moved)) if moved else 0.0
    gbps = None
    try:
        gbps = _raw_copy_gbps(int(kv))
    except Exception as exc:  # a figure for the report only
        info["raw_copy_error"] = str(exc)

    def restores(rs: list[dict[str, Any]]) -> float | None:
        ms = [float(r["restore_ms"]) for r in rs if r.get("switched") and r.get("restore_ms") is not None]
        return statistics.median(ms) if ms else None

    out: dict[str, Any] = {
        "deep_turns": len(deep),
        "turns": len(rows),
        "deep_ttft_ms_median": statistics.median(deep) if deep else None,
        "weights_only_ttft_ms_median": statistics.median(plain) if plain else None,
        # the worker's own restore (the switch's share of the first token, from its report)
        "deep_restore_ms_median": restores([r for r in rows if r.get("deep")]),
        "weights_only_restore_ms_median": restores(weights_only),
        "kv_bytes_in_use_median": kv,
        "raw_copy_gbps": gbps,
        # the releasing side: the parked worker's deep release, and its save of the KV cells
        "deep_release_ms_median": _median([r.get("release_ms") for r in info.get("releases", [])]),
        "kv_save_ms_median": _median([r.get("kv_save_ms") for r in info.get("releases", [])]),
        "kv_save_paths": sorted({str(r["kv_save_path"]) for r in info.get("releases", [])}),
        # the KV snapshots' host memory: allocated by a deep release (on the switch's path) or
        # ahead, by the idle worker after an answer (TIMESHARE_KV_AHEAD)
        "kv_host_allocs_on_release": sum(int(r.get("kv_host_grown") or 0) for r in info.get("releases", [])),
        "kv_host_alloc_ms_on_release_max": max(
            (float(r["kv_host_alloc_ms"]) for r in info.get("releases", []) if r.get("kv_host_alloc_ms")),
            default=0.0,
        ),
        "kv_host_allocs_ahead": len(info.get("kv_host_ahead", [])),
        "kv_host_alloc_ms_ahead_max": max(
            (float(r["alloc_ms"]) for r in info.get("kv_host_ahead", [])), default=0.0
        ),
        # each parked worker's first deep release with cells to save, whole (the one that paid
        # the allocation before it was made ahead)
        "first_deep_release_ms": {
            mid: next(
                (
                    r.get("release_ms")
                    for r in info.get("releases", [])
                    if r["model"] == mid and r["kv_save_bytes"] > 0
                ),
                None,
            )
            for mid in sorted({str(r["model"]) for r in info.get("releases", [])})
        },
    }
    if deep and plain and gbps:
        target = statistics.median(plain) + kv / (gbps * 1e9) * 1000 + TARGET_EXTRA_MS
        out["target_ms"] = target
        out["meets_target"] = statistics.median(deep) <= target
    return out
