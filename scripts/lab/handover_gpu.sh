#!/bin/bash
# Issue 40 on the GPU: device memory handed from the releasing worker to the restoring one (CUDA
# VMM, POSIX fds through the arena's holder). Builds nothing; one command prints everything:
#   1. the VMM device and the holder alone (two processes: A exports, exits; B imports, reads A's
#      bytes back; cuMemCreate count; device memory back after)
#   2. doctor --handover: the path, bitwise, chunks handed over vs allocated
#   3. bench residency --handover: restore vs the raw copy into reused memory (target >= 0.98)
#   4. bench switch, 10 rounds = 20 alternating switched turns, with and without the hand-over in
#      the same run: cuMemCreate calls during the switches (target 0), switched first token,
#      bitwise exactness
#   5. device memory used before and after everything (no leak), no holder left
# Needs the prepared machine (.gpu/build.sh + .gpu/setup.sh: llama-cpp-python CUDA in /tmp/site,
# `timeshare` on /tmp/bin pointing at this checkout, /tmp/A.gguf and /tmp/B.gguf).
# usage: bash scripts/lab/handover_gpu.sh            (results under $OUT, default /tmp/handover-out)
set -u
R=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/handover-out}
mkdir -p "$OUT"
export PATH=/tmp/bin:$PATH
A=${A:-/tmp/A.gguf}
B=${B:-/tmp/B.gguf}
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
U0=$(used)
el "device memory used at start: ${U0} MiB"

# 1. the device and the holder alone
timeout 60 python3 -P "$R/scripts/lab/handover_vmm_probe.py" > "$OUT/probe.txt" 2>&1
el "vmm probe rc=$?"; tail -12 "$OUT/probe.txt"

# 2. doctor
timeout 120 timeshare doctor --handover --model "$A" --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
el "doctor --handover rc=$?"
python3 - "$OUT/doctor.json" <<'EOF' 2>&1 | tail -4
import json, sys
d = json.load(open(sys.argv[1]))
print({k: d.get(k) for k in ("path", "backend", "bitwise_identical", "kv_level_bitwise_identical", "restore_ms", "release_ms")})
h = d.get("handover", {})
print({k: h.get(k) for k in ("on", "note", "device", "chunk_bytes", "handed_chunks", "created_chunks", "creates", "padding_bytes", "source_note")})
print("restore steps:", [s["restore"].get("handed_chunks") for s in d.get("steps", [])], [s["restore"].get("created_chunks") for s in d.get("steps", [])])
EOF
[ -s "$OUT/doctor.json" ] || tail -c 2000 "$OUT/doctor.err"

# 3. bench residency: restore into handed (reused) memory vs the raw copy
timeout 180 timeshare bench residency --handover --model "$A" --cycles 5 --n-ctx 2048 --no-copy-probe --json > "$OUT/bres.json" 2> "$OUT/bres.err"
el "bench residency --handover rc=$?"
python3 - "$OUT/bres.json" <<'EOF' 2>&1 | tail -4
import json, sys
d = json.load(open(sys.argv[1]))
keys = ("bitwise_identical", "restore_ms", "restore_ms_all", "raw_copy_ms", "raw_copy_ms_reps", "restore_vs_raw", "best_restore_vs_raw", "release_ms", "handover_handed_bytes", "handover_created_bytes")
print({k: d.get(k) for k in keys})
print("handover:", {k: v for k, v in d.get("handover", {}).items() if k != "holder"})
print("restore steps:", [{k: round(v, 2) for k, v in s.items() if k in ("alloc_ms", "handover_ms", "copy_ms", "total_ms", "handed_chunks", "created_chunks")} for s in d.get("restore_steps_all", [])])
EOF
[ -s "$OUT/bres.json" ] || tail -c 2000 "$OUT/bres.err"

# 4. 20 alternating switched turns, with and without the hand-over, same run
for H in 1 0; do
  timeout 200 python3 -P - "$A" "$B" "$H" > "$OUT/switch$H.json" 2> "$OUT/switch$H.err" <<'EOF'
import json, sys
from timeshare.core.diagnostics.bench_switch import run_switch_bench
a, b, h = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
r = run_switch_bench([a, b], 10, restarts=0, reload=False, handover=h, progress=lambda m: print(m, file=sys.stderr))
print(json.dumps(r))
EOF
  el "switch handover=$H rc=$?"
  python3 - "$OUT/switch$H.json" <<'EOF' 2>&1 | tail -3
import json, sys
d = json.load(open(sys.argv[1]))
s = d["summary"]
print({k: s.get(k) for k in ("switched_turns", "turns", "switch_ttft_ms", "switch_restore_ms", "switch_release_ms", "switch_worker_first_token_ms", "no_switch_ttft_ms")}, "bitwise:", d["exactness"]["bitwise_identical"])
h = d.get("handover")
print("handover:", None if h is None else {k: v for k, v in h.items() if k != "holder"}, "holder:", None if h is None else h.get("holder"))
EOF
  [ -s "$OUT/switch$H.json" ] || tail -c 2000 "$OUT/switch$H.err"
done

# 5. nothing left
sleep 3
U1=$(used)
el "device memory used at start ${U0} MiB, now ${U1} MiB (no leak: equal, within the driver's noise)"
pgrep -af "arena.holder" || echo "no hand-over holder left"
