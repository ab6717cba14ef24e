#!/bin/bash
# Issue 40 on the GPU: device memory handed from the releasing worker to the restoring one (CUDA
# VMM, POSIX fds through the arena's holder), with kept mappings (a released worker keeps its
# chunks mapped until another worker needs them: its next restore maps nothing). Builds nothing;
# one command prints everything, in this order (the later steps are skipped when the run nears
# BUDGET_S seconds, default 220; each says so):
#   1. bench residency --handover (a release and restore of one worker: sleep/wake): the restore
#      into its kept chunks, which nobody else mapped since, uploads nothing -- restore ms vs the
#      raw copy, bytes skipped and uploaded per restore, bitwise
#   1b. the same with TIMESHARE_HANDOVER_INTACT=0 (kept mappings, every byte uploaded): restore
#      vs the raw copy into reused memory (target >= 0.98), chunks mapped per restore (0 after
#      the first, kept), cuMemMap/cuMemCreate counts
#   2. bench switch, 10 rounds = 20 alternating switched turns (one-model budget): with the
#      hand-over and kept mappings -- the other model fits beside, so each switch back finds its
#      kept chunks intact and uploads nothing: switch restore ms vs the raw copy, bytes skipped
#      per switch --, and without the hand-over, same run: switched first token (target: raw
#      copy + 10 ms), cuMemCreate calls (target 0) and chunks mapped (cuMemMap) during the 20
#      switches, bitwise exactness
#   3. the same 20 switches on a "full card" (TIMESHARE_HANDOVER_ROOM=0: each restore has the
#      other worker's kept chunks asked back, unmapped by its reclaim thread, then mapped)
#   4. bench residency --handover with TIMESHARE_HANDOVER_KEEP=0 (unmap at each release: the
#      mapping cost per restore, as before this change), with 64 MiB chunks and with 256 MiB
#      chunks (TIMESHARE_HANDOVER_CHUNK: fewer cuMemMap calls when memory passes, more padding)
#   5. the VMM probe without ggml (scripts/lab/handover_vmm_probe.py: memory passes from an
#      exited worker, kill -9 mid-release, a kept mapping asked back from a live worker)
#   6. device memory used before and after everything (no leak), no holder left
# Needs the prepared machine (.gpu/build.sh + .gpu/setup.sh: llama-cpp-python CUDA in /tmp/site,
# `timeshare` on /tmp/bin pointing at this checkout, /tmp/A.gguf and /tmp/B.gguf).
# usage: OUT=/tmp/out bash scripts/lab/handover_gpu.sh   (results under $OUT, default /tmp/handover-out)
set -u
R=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/handover-out}
mkdir -p "$OUT"
# not from the checkout: a worker started with `python -m` there would import its top-level
# timeshare/ package (the CLI's), not the installed one
cd /tmp
export PATH=/tmp/bin:$PATH
A=${A:-/tmp/A.gguf}
B=${B:-/tmp/B.gguf}
BUDGET_S=${BUDGET_S:-220}
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
cap() { local l; l=$(( $(left) - 5 )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # a step's timeout (never 0: no limit)
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
U0=$(used)
el "device memory used at start: ${U0} MiB"

bres() {  # $1: label; environment from the caller
  local f="$OUT/bres_$1"
  timeout "$(cap 90)" timeshare bench residency --handover --model "$A" --cycles 5 --n-ctx 2048 --no-copy-probe --json > "$f.json" 2> "$f.err"
  el "bench residency --handover ($1) rc=$?"
  python3 - "$f.json" <<'EOF' 2>&1 | tail -4
import json, sys
d = json.load(open(sys.argv[1]))
keys = ("bitwise_identical", "restore_ms", "raw_copy_ms", "restore_vs_raw", "best_restore_vs_raw", "release_ms", "restore_uploaded_bytes", "restore_skipped_bytes")
print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items() if k in keys})
print("restore_ms_all:", [round(x, 1) for x in d.get("restore_ms_all", [])], "raw copies:", [round(x, 1) for x in d.get("raw_copy_ms_reps", [])])
h = d.get("handover", {})
print("handover:", {k: h.get(k) for k in ("on", "note", "chunk_bytes", "creates", "maps", "unmaps", "reused_chunks", "intact_chunks", "skipped_upload_bytes", "reuse_contents", "handed_chunks", "created_chunks", "padding_bytes", "lease_padding_bytes", "source_note")})
print("per restore (ms, chunks, bytes):", [{k: round(v, 2) for k, v in s.items() if k in ("handover_ms", "copy_ms", "total_ms", "mapped_chunks", "kept_chunks", "intact_chunks", "created_chunks", "uploaded_bytes", "skipped_upload_bytes")} for s in d.get("restore_steps_all", [])])
if "raw_copy_ms" in d:
    print(f"restore {d['restore_ms']:.2f} ms (median) vs raw copy {d['raw_copy_ms']:.2f} ms = {d['restore_ms'] / d['raw_copy_ms']:.3f} x its time; last restore uploaded {d.get('restore_uploaded_bytes', '?')} B, skipped {d.get('restore_skipped_bytes', 0)} B (still in its kept memory)")
EOF
  [ -s "$f.json" ] || tail -c 1500 "$f.err"
}

bswitch() {  # $1: label, $2: 1/0 hand-over; environment from the caller
  local f="$OUT/switch_$1"
  timeout "$(cap 120)" python3 -P - "$A" "$B" "$2" > "$f.json" 2> "$f.err" <<'EOF'
import json, sys
from timeshare.core.diagnostics.bench_switch import run_switch_bench
a, b, h = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
r = run_switch_bench([a, b], 10, restarts=0, reload=False, handover=h, progress=lambda m: print(m, file=sys.stderr))
print(json.dumps(r))
EOF
  el "bench switch ($1) rc=$?"
  python3 - "$f.json" "$OUT/bres_keep.json" <<'EOF' 2>&1 | tail -3
import json, sys
d = json.load(open(sys.argv[1]))
s = d["summary"]
print({k: s.get(k) for k in ("switched_turns", "turns", "switch_ttft_ms", "switch_restore_ms", "switch_restored_bytes", "switch_release_ms", "switch_worker_first_token_ms", "no_switch_ttft_ms")}, "bitwise:", d["exactness"]["bitwise_identical"])
h = d.get("handover")
if h is not None:
    print("20 switches:", {k: h.get(k) for k in ("turns", "creates", "maps", "reused", "intact", "asked_back", "given", "skipped_bytes", "skipped_bytes_per_switch", "error")})
print("switch restore ms:", [round(t["restore_ms"], 2) for t in d["turns"] if t["switched"]])
try:
    raw = json.load(open(sys.argv[2]))["raw_copy_ms"]
    print(f"first token {s['switch_ttft_ms']:.1f} ms vs raw copy {raw:.1f} + 10 = {raw + 10:.1f} ms (bres_keep's raw copy)")
    if h is not None and "error" not in h:
        per = h.get("skipped_bytes_per_switch") or 0
        print(f"switch back: restore {s['switch_restore_ms']:.2f} ms (median) vs raw copy {raw:.2f} ms = {s['switch_restore_ms'] / raw:.3f} x; skipped {per / 1e9:.3f} GB per switch ({(h.get('skipped_bytes') or 0) / 1e9:.2f} GB in {h.get('turns')} turns), uploaded {s.get('switch_restored_bytes')} B per switch (median)")
except Exception as exc:
    print("no raw copy to compare with:", exc)
EOF
  [ -s "$f.json" ] || tail -c 1500 "$f.err"
}

# 1. restore vs the raw copy, kept mappings (the default): the restore into intact kept chunks
#    uploads nothing
bres keep
# 1b. kept mappings, every byte uploaded (the copy into reused memory vs the raw copy)
if [ "$(left)" -gt 150 ]; then TIMESHARE_HANDOVER_INTACT=0 bres keepcopy; else el "skipped: bench residency, kept, uploads on (time)"; fi
# 2. 20 switches with the hand-over (kept mappings), then without it: same run
bswitch keep 1
if [ "$(left)" -gt 60 ]; then bswitch off 0; else el "skipped: bench switch without the hand-over (time)"; fi
# 3. a full card: every switch asks the other's kept chunks back
if [ "$(left)" -gt 55 ]; then TIMESHARE_HANDOVER_ROOM=0 bswitch fullcard 1; else el "skipped: full-card switch (time)"; fi
# 4. unmapped at each release, as before this change
if [ "$(left)" -gt 40 ]; then TIMESHARE_HANDOVER_KEEP=0 bres nokeep; else el "skipped: bench residency keep off (time)"; fi
if [ "$(left)" -gt 35 ]; then
  TIMESHARE_HANDOVER_KEEP=0 TIMESHARE_HANDOVER_CHUNK=256MiB bres nokeep256
else
  el "skipped: bench residency keep off, 256 MiB chunks (time)"
fi
# 5. the VMM probe (no ggml)
if [ "$(left)" -gt 15 ]; then
  timeout "$(cap 40)" python3 -P "$R/scripts/lab/handover_vmm_probe.py" > "$OUT/probe.txt" 2>&1
  el "vmm probe rc=$?"; tail -16 "$OUT/probe.txt"
else
  el "skipped: vmm probe (time)"
fi

# 6. nothing left
sleep 2
U1=$(used)
el "device memory used at start ${U0} MiB, now ${U1} MiB (no leak: equal, within the driver's noise)"
pgrep -af "arena.holder" || echo "no hand-over holder left"
