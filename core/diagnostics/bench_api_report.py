"""``timeshare bench api``'s report: the summary (medians, ratios), the table and the plot."""

from __future__ import annotations

import statistics
from typing import Any

SYSTEMS = (
    "timeshare_switch",
    "timeshare_deep_switch",
    "timeshare_same",
    "timeshare_plain_client",
    "worker_restart",
    "fresh_process",
    "llama_swap",
    "llama_server_coresident",
)
LABELS = {
    "timeshare_switch": "timeshare: switched turn (conversation)",
    "timeshare_deep_switch": "timeshare: deep switch (KV + buffers released)",
    "timeshare_same": "timeshare: same model again, no switch",
    "timeshare_plain_client": "timeshare: switched turn, standard client",
    "worker_restart": "worker restart (sleep level stop), then the turn",
    "fresh_process": "fresh process: load GGUF + prefill + token",
    "llama_swap": "llama-swap: stop, start llama-server, prefill",
    "llama_server_coresident": "llama-server, both models loaded (ideal)",
}
#: the alternatives that fit the VRAM of one model (the coresident pair needs both)
ALTERNATIVES = ("worker_restart", "fresh_process", "llama_swap")


def median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def summarise(
    report: dict[str, Any],
    rows: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    decode: dict[str, Any],
) -> None:
    systems: dict[str, dict[str, Any]] = {}
    for key in SYSTEMS:
        if not rows[key] and key not in skipped:
            continue
        samples = [float(r["ttft_ms"]) for r in rows[key]]
        entry: dict[str, Any] = {"label": LABELS[key], "ttft_ms_median": median(samples), "samples": samples}
        entry["rows"] = rows[key]
        if key in skipped:
            entry["skipped"] = skipped[key]
        systems[key] = entry
    switch = systems["timeshare_switch"]["ttft_ms_median"]
    medians = {
        k: systems[k]["ttft_ms_median"] for k in ALTERNATIVES if systems.get(k, {}).get("ttft_ms_median")
    }
    best = min(medians, key=lambda k: medians[k]) if medians else None
    for entry in systems.values():
        m = entry["ttft_ms_median"]
        entry["x_switch"] = m / switch if m is not None and switch else None
        entry["x_best_alternative"] = m / medians[best] if m is not None and best else None
    ts_rate = decode.get("timeshare", {}).get("tok_s")
    srv_rate = decode.get("llama_server", {}).get("tok_s")
    decode["ratio"] = ts_rate / srv_rate if ts_rate and srv_rate else None
    switched = [r for r in rows["timeshare_switch"] if r["switched"]]
    weights = {m["id"]: int(m.get("weight_bytes") or 0) for m in report.get("models", [])}
    report["systems"] = systems
    report["decode"] = decode
    report["summary"] = {
        "switched_turns": len(switched),
        "switch_turns": len(rows["timeshare_switch"]),
        "switch_restore_ms_median": median([float(r["restore_ms"] or 0.0) for r in switched]),
        # weight bytes each switched turn restored: the whole model under a one-model budget, only
        # the layer parts a partial release took under a byte budget (and its share of the model)
        "switch_restored_bytes_median": median([float(r.get("restored_bytes") or 0) for r in switched]),
        "switch_restored_fraction_median": median(
            [
                float(r.get("restored_bytes") or 0) / weights[r["model"]]
                for r in switched
                if weights.get(r["model"])
            ]
        ),
        "switch_prompt_tokens_evaluated_median": median(
            [float(r["prompt_tokens_evaluated"] or 0) for r in switched]
        ),
        "best_alternative": best,
        "best_alternative_ms": medians[best] if best else None,
        "best_alternative_x_switch": medians[best] / switch if best and switch else None,
    }


# ---- output ---------------------------------------------------------------------------------


def describe_fit(fit: dict[str, Any]) -> str:
    """A fit of :func:`_card_fits` in words."""
    if "unfit" in fit:
        return f"does not fit even alone: {fit['unfit']}"
    layers = "all layers on the GPU" if fit["n_gpu_layers"] < 0 else f"{fit['n_gpu_layers']} GPU layers"
    note = f" ({fit['note']})" if fit.get("note") else ""
    return (
        f"n_ctx {fit['n_ctx']} x parallel {fit['parallel']}, {layers}, KV {fit['kv_bytes'] / 1e9:.2f} GB "
        f"of {fit['room'] / 1e9:.2f} GB{note}"
    )


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(r: dict[str, Any]) -> None:
    for mid, fit in r.get("card_fit", {}).items():
        print(f"{mid} on the card alone (fresh process, llama-server): {describe_fit(fit)}")
    for m in r.get("models", []):
        print(
            f"model {m['id']}: {m['path']} ({m['file_bytes'] / 1e9:.2f} GB), backend {m['backend'] or '?'}, "
            f"residency {m['residency_path'] or '?'}; in timeshare serve n_ctx {m.get('n_ctx') or '?'} x "
            f"parallel {m.get('parallel') or '?'}" + (f" ({m['fit']})" if m.get("fit") else "")
        )
    s = r["summary"]
    print(
        f"conversations of about {r['context']} tokens, n_ctx {r['n_ctx']}, {r['rounds']} rounds, "
        f"{r['max_tokens']} tokens per turn, flash_attn {r['flash_attn']}; "
        f"{s['switched_turns']} of {s['switch_turns']} switch turns switched"
        f" (VRAM budget {r.get('budget', 'one-model')})"
    )
    if s.get("switch_restored_bytes_median") is not None:
        share = s.get("switch_restored_fraction_median")
        print(
            f"weights restored per switched turn (median): {s['switch_restored_bytes_median'] / 1e9:.3f} GB"
            + (f" = {share:.3f} x the model" if share is not None else "")
        )
    head = f"{'first streamed token at the client':50} {'n':>3} {'median ms':>11}"
    print(f"{head} {'x switch':>9} {'x best alt':>10}")
    for e in r["systems"].values():
        med = _fmt(e["ttft_ms_median"], ".1f") if "skipped" not in e else "skipped"
        x, xb = _fmt(e["x_switch"], ".2f"), _fmt(e["x_best_alternative"], ".3f")
        print(f"{e['label']:50} {len(e['samples']):>3} {med:>11} {x:>9} {xb:>10}")
        if "skipped" in e:
            print(f"  ({e['skipped']})")
    if s["best_alternative"]:
        print(
            f"best alternative within one model's VRAM: {s['best_alternative']} "
            f"({_fmt(s['best_alternative_ms'], '.1f')} ms) = {_fmt(s['best_alternative_x_switch'], '.1f')} x "
            "the switched turn"
        )
    deep = r.get("deep")
    if deep:
        print(
            f"deep switch: {deep['deep_turns']} of {deep['turns']} turns deep, median "
            f"{_fmt(deep['deep_ttft_ms_median'], '.1f')} ms against the weights-only switch's "
            f"{_fmt(deep['weights_only_ttft_ms_median'], '.1f')} ms (same model); KV in use "
            f"{deep['kv_bytes_in_use_median'] / 1e6:.1f} MB, "
            f"raw copy {_fmt(deep['raw_copy_gbps'], '.2f')} GB/s; "
            f"restore {_fmt(deep.get('deep_restore_ms_median'), '.1f')} vs "
            f"{_fmt(deep.get('weights_only_restore_ms_median'), '.1f')} ms; "
            f"target {_fmt(deep.get('target_ms'), '.1f')} ms: "
            + ("met" if deep.get("meets_target") else "NOT met" if "meets_target" in deep else "-")
        )
        print(
            "deep switch, releasing side: deep release "
            f"{_fmt(deep.get('deep_release_ms_median'), '.1f')} ms, "
            f"of which the KV save {_fmt(deep.get('kv_save_ms_median'), '.1f')} ms "
            f"({', '.join(deep.get('kv_save_paths') or []) or '-'}); its host memory allocated by "
            f"{deep.get('kv_host_allocs_on_release', '-')} release(s) (at most "
            f"{_fmt(deep.get('kv_host_alloc_ms_on_release_max'), '.1f')} ms), "
            f"{deep.get('kv_host_allocs_ahead', '-')} time(s) ahead while idle (at most "
            f"{_fmt(deep.get('kv_host_alloc_ms_ahead_max'), '.1f')} ms); first deep release "
            + ", ".join(
                f"{m} {_fmt(v, '.1f')} ms" for m, v in (deep.get("first_deep_release_ms") or {}).items()
            )
        )
    d = r["decode"]
    rate = _fmt(d.get("timeshare", {}).get("tok_s"), ".1f")
    line = f"decode ({d['max_tokens']}-token greedy answer): timeshare {rate} tok/s"
    if "llama_server" in d:
        srv = _fmt(d["llama_server"].get("tok_s"), ".1f")
        line += f", llama-server {srv} tok/s ({_fmt(d['ratio'], '.2f')} x)"
    print(line)


def plot(r: dict[str, Any], path: str) -> None:
    """First-token latency per turn for each system (log scale) and a bar chart of the medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = {k: e for k, e in r["systems"].items() if e["samples"]}
    fig, (turns, bars) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    for e in systems.values():
        turns.plot(range(1, len(e["samples"]) + 1), e["samples"], marker="o", label=e["label"])
    turns.set_yscale("log")
    turns.set_xlabel("turn")
    turns.set_ylabel("first token at the client (ms)")
    turns.set_title(f"first-token latency per turn, ~{r['context']}-token conversations")
    turns.grid(True, which="both", alpha=0.3)
    turns.legend(fontsize=7)
    keys = list(systems)
    medians = [systems[k]["ttft_ms_median"] for k in keys]
    colors = ["tab:green" if k.startswith("timeshare") else "tab:gray" for k in keys]
    bars.bar(range(len(keys)), medians, color=colors)
    bars.set_yscale("log")
    bars.set_xticks(range(len(keys)), keys, rotation=35, ha="right", fontsize=8)
    bars.set_ylabel("median (ms)")
    bars.set_title("medians")
    for x, m in enumerate(medians):
        bars.annotate(f"{m:.0f}", (x, m), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
