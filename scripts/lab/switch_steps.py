"""A switch's cost taken apart (issue 40's full-card target): `run_switch_bench` (20 alternating
switched turns of two models under a one-model budget) with the workers' logs kept, then the
median of every restore step the workers logged for the switched restores ("restore steps" and
"overlapped restore settled" lines: the hand-over's take and map, the copy, the first node's wait).
The environment chooses the way (TIMESHARE_HANDOVER_ROOM=0 for a full card, TIMESHARE_HANDOVER_KEEP,
TIMESHARE_HANDOVER_CHUNK, TIMESHARE_HANDOVER_INTACT). Run from /tmp on the prepared GPU machine:

    python3 -P scripts/lab/switch_steps.py LABEL A.gguf B.gguf [ROUNDS] [HANDOVER 1|0]

Prints one summary line and one line of step medians; not a test.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

from timeshare.core.diagnostics.bench_switch import run_switch_bench

STEP_RE = re.compile(r"(restore steps|overlapped restore settled) \([^)]*\): (\{.*\})\s*$")


def main() -> None:
    label, a, b = sys.argv[1:4]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    handover = (sys.argv[5] if len(sys.argv) > 5 else "1") == "1"
    work = Path(tempfile.mkdtemp(prefix=f"steps-{label}-"))
    r = run_switch_bench([a, b], rounds, restarts=0, reload=False, handover=handover, work_dir=work)
    s = r["summary"]
    keys = (
        "switched_turns",
        "switch_ttft_ms",
        "switch_worker_first_token_ms",
        "switch_restore_ms",
        "switch_release_ms",
        "no_switch_ttft_ms",
    )
    print(label, {k: s.get(k) for k in keys}, "bitwise:", r["exactness"]["bitwise_identical"])
    for i, mid in enumerate(("a", "b")):  # each model's own switched turns (a: the first --model)
        mine = [t["client_ttft_ms"] for t in r["turns"] if t["switched"] and t["i"] % 2 == i]
        if mine:
            print(
                label,
                f"model {mid} ({(a, b)[i]}): switched first token median",
                round(statistics.median(mine), 2),
                "ms of",
                len(mine),
            )
    h = r.get("handover")
    if h:
        print(
            label,
            "holder:",
            {k: h.get(k) for k in ("creates", "maps", "reused", "intact", "asked_back", "given", "error")},
        )
    rows: dict[str, list[dict[str, float]]] = {"restore steps": [], "overlapped restore settled": []}
    for log in sorted((work / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = STEP_RE.search(line)
            if m:
                rows[m.group(1)].append(json.loads(m.group(2)))
    for kind, got in rows.items():
        # the first restore of each worker is its load's or a cold one: the switches are the rest
        got = got[2:] if len(got) > 4 else got
        if not got:
            print(label, kind, ": none logged")
            continue
        med = {
            k: round(statistics.median(g.get(k, 0.0) for g in got), 2)
            for k in sorted({k for g in got for k in g})
        }
        print(label, kind, f"(median of {len(got)}):", json.dumps(med))


if __name__ == "__main__":
    main()
