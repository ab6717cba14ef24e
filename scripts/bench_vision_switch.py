"""A switched turn with an image already in the KV cache, against the same switch without a
projector (issue 41's targets; run on the lent GPU by the lead, one run):

    .venv/bin/python scripts/bench_vision_switch.py --model /path/synthetic-8b-q4_0.gguf \
        --other /path/other.gguf --rounds 5 [--projector-embd 1024 --projector-layers 24] [--json]

Two `timeshare serve` runs in a temporary TIMESHARE_HOME (a one-model budget: every turn below
switches the GPU). In the first, MODEL has a generated projector (random weights,
core/diagnostics/synthetic_projector.py; ``--projector-embd`` / ``--projector-layers`` make it
bigger, near a real one's bytes); in the second it has none. Each run: a first turn of a
conversation on MODEL (with an image in the first run, the same text without it in the second),
then ``rounds`` times: a turn on OTHER (MODEL is set aside), then the conversation's next turn on
MODEL (switched back: its weights, and the projector's, restored; the image stays in the KV
cache, so only the new text is evaluated). Reported per run: the switched turns' first-token
time as the API measured it, restore_ms and restored_bytes (timeshare extras), the projector's
own restore ms (it runs after the model's, off the first token's path: the worker log's
"restored off the first token's path" lines), and the ratio of
the medians (target: first token with projector <= 1.1 x without; restored bytes with - without =
the projector's weight bytes). Not a test: numbers, for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def _png() -> bytes:
    from PIL import Image

    im = Image.new("RGB", (320, 240))
    im.putdata([(x % 256, y % 256, (x * y) % 256) for y in range(240) for x in range(320)])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _serve(home: Path, config: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = dict(os.environ, TIMESHARE_HOME=str(home), TIMESHARE_VRAM_BUDGET="one-model")
    log = (home / "serve.log").open("wb")
    cmd = [sys.executable, "-m", "timeshare", "--config", str(config), "serve", "--port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    address = home / "run" / "api.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"timeshare serve exited: see {home / 'serve.log'}")
        try:
            record = json.loads(address.read_text())
            if record.get("pid") == proc.pid:
                url = str(record["url"])
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    else:
        raise SystemExit("timeshare serve wrote no address")
    while time.monotonic() < deadline:  # every model loaded
        models = httpx.get(f"{url}/timeshare/v1/status", timeout=30).json()["models"]
        if any(m["state"] == "failed" for m in models):
            raise SystemExit(f"a model failed: {[m['reason'] for m in models if m['state'] == 'failed']}")
        if all(m["state"] in ("resident", "released", "sleeping") for m in models):
            return proc, url
        time.sleep(0.5)
    raise SystemExit("the models did not load in 10 minutes")


def _ask(url: str, model: str, messages: list[dict[str, Any]], conversation: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    if conversation:
        body["conversation"] = conversation
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    out["_wall_ms"] = (time.perf_counter() - t0) * 1000
    return out


def _run(model: str, other: str, projector: Path | None, rounds: int, image: bytes) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="timeshare-bench-vision-"))
    config = home / "config.toml"
    lines = ['[[models]]\nid = "m"\n', f'path = "{model}"\n']
    if projector is not None:
        lines.append(f'mmproj = "{projector}"\n')
    lines.append(f'\n[[models]]\nid = "other"\npath = "{other}"\n')
    config.write_text("".join(lines))
    proc, url = _serve(home, config)
    try:
        question = "Describe this picture in detail."
        content: Any = question
        if projector is not None:
            data = base64.b64encode(image).decode()
            content = [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "text", "text": question},
            ]
        history: list[dict[str, Any]] = [{"role": "user", "content": content}]
        first = _ask(url, "m", history, "bench")
        history.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
        turns = []
        for i in range(rounds):
            _ask(url, "other", [{"role": "user", "content": f"Say a number: {i}"}], None)
            history.append({"role": "user", "content": f"And now, part {i}?"})
            got = _ask(url, "m", history, "bench")
            history.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
            extras = got.get("timeshare") or {}
            turns.append(
                {
                    "switched": extras.get("switched"),
                    "first_token_ms": extras.get("first_token_ms"),
                    "restore_ms": extras.get("restore_ms"),
                    "restored_bytes": extras.get("restored_bytes"),
                    "prompt_tokens_evaluated": extras.get("prompt_tokens_evaluated"),
                    "wall_ms": got["_wall_ms"],
                }
            )
        status = httpx.get(f"{url}/timeshare/v1/status", timeout=30).json()
        m = next(x for x in status["models"] if x["id"] == "m")
        result: dict[str, Any] = {
            "projector": str(projector) if projector else None,
            "weight_bytes": m.get("weight_bytes"),
            "projector_bytes": m.get("projector_bytes"),
            "turns": turns,
            "median_first_token_ms": statistics.median(t["first_token_ms"] or 0 for t in turns),
            "median_restore_ms": statistics.median(t["restore_ms"] or 0 for t in turns),
            "median_restored_bytes": statistics.median(t["restored_bytes"] or 0 for t in turns),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        try:
            log_text = (home / "log" / "worker-m.log").read_text(errors="replace")
        except OSError:
            log_text = ""
        shutil.rmtree(home, ignore_errors=True)
    # the model's own restore lines (where its weights came back: moved ones rebuild the graphs)
    result["restore_lines"] = [
        line.split(" INFO ", 1)[-1][:300]
        for line in log_text.splitlines()
        if ("restored " in line and "ms" in line) or "settled" in line or "graphs" in line
    ][-4 * rounds :]
    # the projector's restores, off the first token's path on their own thread (one line each)
    restores = _projector_restores(log_text)
    result["projector_restores"] = restores
    result["median_projector_ms"] = (
        statistics.median(r["projector_ms"] for r in restores) if restores else None
    )
    result["median_projector_after_ms"] = (
        statistics.median(r["projector_after_ms"] for r in restores) if restores else None
    )
    return result


_PROJECTOR_RE = re.compile(r"projector .* restored off the first token's path: (\{.*\})\s*$")


def _projector_restores(text: str) -> list[dict[str, float]]:
    """The "restored off the first token's path" lines of a worker log (core/residency/projector.py):
    each restore's projector_ms (its allocation and upload), projector_after_ms (waiting for the
    model's uploads first) and projector_bytes."""
    out: list[dict[str, float]] = []
    for line in text.splitlines():
        if m := _PROJECTOR_RE.search(line):
            with contextlib.suppress(ValueError):
                out.append(json.loads(m.group(1)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model that reads images (e.g. the synthetic 8B)")
    ap.add_argument("--other", required=True, help="the model it switches with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--projector-embd", type=int, default=1024, help="the generated vision tower's width")
    ap.add_argument("--projector-layers", type=int, default=24, help="its layers")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-lines", action="store_true", help="print the worker's restore lines of each run")
    args = ap.parse_args()
    args.model, args.other = str(Path(args.model).resolve()), str(Path(args.other).resolve())

    from timeshare.core.diagnostics.synthetic_projector import ProjectorShape, write_projector_for

    folder = Path(tempfile.mkdtemp(prefix="timeshare-bench-proj-"))
    shape = ProjectorShape(
        image_size=336,
        patch_size=14,
        n_embd=args.projector_embd,
        n_head=16,
        n_ff=4 * args.projector_embd,
        n_layer=args.projector_layers,
    )
    projector = write_projector_for(Path(args.model), folder / "mmproj-generated.gguf", shape)
    image = _png()
    try:
        with_proj = _run(args.model, args.other, projector, args.rounds, image)
        without = _run(args.model, args.other, None, args.rounds, image)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ratio = (
        with_proj["median_first_token_ms"] / without["median_first_token_ms"]
        if without["median_first_token_ms"]
        else None
    )
    report = {
        "with_projector": with_proj,
        "without_projector": without,
        "first_token_ratio": ratio,
        "extra_restored_bytes": with_proj["median_restored_bytes"] - without["median_restored_bytes"],
        "projector_bytes": with_proj["projector_bytes"],
    }
    report["projector_ms"] = with_proj["median_projector_ms"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"projector: {projector} ({(with_proj['projector_bytes'] or 0) / 1e6:.1f} MB on the device)")
        for name, r in (("with projector", with_proj), ("without", without)):
            print(
                f"{name:15s} switched turn: first token {r['median_first_token_ms']:.1f} ms, restore "
                f"{r['median_restore_ms']:.1f} ms, {r['median_restored_bytes'] / 1e9:.3f} GB restored "
                f"(median of {len(r['turns'])})"
            )
        print(f"ratio (first token, with / without): {ratio:.3f} (target <= 1.1)" if ratio else "ratio: n/a")
        if with_proj["median_projector_ms"] is not None:
            print(
                f"projector restore (off the first token's path, its own thread): "
                f"{with_proj['median_projector_ms']:.1f} ms, begun "
                f"{with_proj['median_projector_after_ms']:.1f} ms after the model's restore returned "
                f"(median of {len(with_proj['projector_restores'])})"
            )
        else:
            print("projector restore: no line in the worker log")
        print(
            f"restored bytes with - without: {report['extra_restored_bytes'] / 1e6:.1f} MB "
            f"(projector: {(report['projector_bytes'] or 0) / 1e6:.1f} MB)"
        )
        if args.log_lines:
            for name, r in (("with projector", with_proj), ("without", without)):
                print(f"-- {name}: the worker's restore lines")
                for line in r["restore_lines"]:
                    print("  ", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
