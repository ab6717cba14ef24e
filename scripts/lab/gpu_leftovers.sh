#!/bin/bash
# The GPU measurements left open by 2026-12-07's sessions, in one command, every result printed to
# stdout (the device tool brings back at most 8 files: a result only in a file can be lost).
# Default steps (left open by sessions 9-11; 10 and 11 had no GPU): switch, deep, vision, fullcard,
# visionoff, f16 (about 12 min after the build: two calls); embed separately (long); rerank and
# handover measured.
# Needs the prepared machine (.gpu/build.sh + .gpu/setup.sh: llama-cpp-python CUDA in /tmp/site with
# libmtmd, llama-server in /tmp/llbuild/bin, `timeshare` on /tmp/bin, /tmp/A.gguf and /tmp/B.gguf).
# usage: bash scripts/lab/gpu_leftovers.sh [STEP ...]   (default: every step; LIMIT=seconds caps the run)
#   rerank   issue 42: 32 documents of ~200 tokens, timeshare vs llama-server --reranking (target ≥ 0.9 ×)
#   vision   issue 41: switched turn with a 1.3 GB generated projector ÷ without (target ≤ 1.1 ×)
#   switch   a moved restore drops the previous graph (TIMESHARE_GRAPH_RESET=rebuild, new default):
#            20 switched turns without the hand-over, bitwise, the worker's restore lines (moved?)
#   deep     issue 39: deep switch vs weights-only, flash attention and not (target weights-only + KV ÷ copy + 15 ms);
#            `timeshare serve` defaults: the hand-over on (CUDA) and the KV memory grown ahead; TIMESHARE_HANDOVER=0
#            and TIMESHARE_KV_AHEAD=0 in the environment give session 9's way on the same machine
#   handover issue 40: scripts/lab/handover_gpu.sh (kept mappings, 20 switches, chunk sizes)
#   embed    issue 45: 2,048 inputs vs llama-server (llama-server alone needs ~6.5 min: run it last)
#   visionoff issue 41 without the hand-over (TIMESHARE_HANDOVER=0: the weights may move; the graph drop)
#   fullcard issue 40: 20 switches on a "full card" taken apart (scripts/lab/switch_steps.py: each
#            restore step's median, the hand-over's take and map apart from the copy): the default
#            (auto: given back at each release), the same unmapped after the release returned
#            (TIMESHARE_HANDOVER_LAZY_UNMAP=1), kept and asked back (TIMESHARE_HANDOVER_KEEP=1), no
#            hand-over, and the raw copy (target: first token <= raw copy + 10 ms)
#   f16      issue 40: an F16 8B (made here, ~16 GB, if missing): restore into reused memory vs the
#            raw copy, and its switched first token on a full card (target: raw copy + 15 ms)
set -u
R=$(cd "$(dirname "$0")/../.." && pwd)
export PATH=/tmp/bin:$PATH
LS=${LS:-/tmp/llbuild/bin/llama-server}
W=$(mktemp -d /tmp/leftovers-XXXX)
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
cap() { local l=$(( ${LIMIT:-580} - ($(date +%s) - T0) )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
show() {  # $1: a JSON file; the rest: dotted keys to print (all scalars at the top level when none)
  python3 - "$@" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:  # noqa: BLE001 - a lab script: say what happened
    print("  (no JSON:", exc, ")"); sys.exit(0)
def get(o, k):
    for part in k.split("."):
        o = o.get(part) if isinstance(o, dict) else None
    return o
keys = sys.argv[2:] or [k for k, v in d.items() if not isinstance(v, (dict, list))]
for k in keys:
    print(" ", k, "=", json.dumps(get(d, k))[:400])
PY
}
residency_vs_raw() {  # $1 model, $2 cycles: a restore into kept memory, every byte uploaded, vs the raw copy
  TIMESHARE_HANDOVER_INTACT=0 timeout "$(cap 120)" timeshare bench residency --handover --model "$1" --cycles "$2" --n-ctx 2048 --json > "$W/res.json" 2> "$W/res.err"
  el "bench residency --handover $(basename "$1") rc=$?"; show "$W/res.json" bitwise_identical restore_ms raw_copy_ms restore_ms_all raw_copy_ms_reps
}
# libmtmd (vision): .gpu/build.sh builds llama-cpp-python with LLAVA_BUILD=OFF (llama.cpp's tools
# build mtmd themselves; adding tools/mtmd twice fails), so llama_cpp/lib lacks it: copy it there
if [ ! -e /tmp/site/llama_cpp/lib/libmtmd.so ]; then
  for f in $(find /tmp/llbuild -name "libmtmd.so*" 2>/dev/null); do cp -a "$f" /tmp/site/llama_cpp/lib/; done
  ls /tmp/site/llama_cpp/lib/libmtmd.so > /dev/null 2>&1 && el "libmtmd copied into llama_cpp/lib" || el "no libmtmd built: the vision step will fail"
fi
steps=${*:-switch deep vision fullcard visionoff f16}
cd /tmp
for s in $steps; do
  case $s in
  rerank)
    timeout "$(cap 120)" timeshare bench rerank --vocab "$R/.gpu/vocab.gguf" --llama-server "$LS" --json > "$W/rerank.json" 2> "$W/rerank.err"
    el "rerank rc=$?"; show "$W/rerank.json"; show "$W/rerank.json" systems summary ratio
    ;;
  switch)
    timeout "$(cap 90)" python3 -P - /tmp/A.gguf /tmp/B.gguf <<'PY' 2>&1 | tail -6
import json, sys
from timeshare.core.diagnostics.bench_switch import run_switch_bench
r = run_switch_bench([sys.argv[1], sys.argv[2]], 10, restarts=0, reload=False, handover=False)
s = r["summary"]
print({k: s.get(k) for k in ("switched_turns", "switch_ttft_ms", "switch_worker_first_token_ms", "switch_restore_ms", "no_switch_ttft_ms")}, "bitwise:", r["exactness"]["bitwise_identical"])
print("switch restore ms:", [round(t["restore_ms"], 2) for t in r["turns"] if t["switched"]])
PY
    el "switch rc=${PIPESTATUS[0]}"
    ;;
  vision)
    timeout "$(cap 150)" python3 -P "$R/scripts/bench_vision_switch.py" --model /tmp/A.gguf --other /tmp/B.gguf --rounds 5 --projector-embd 1024 --projector-layers 24 --log-lines 2>&1 | grep -v "^llama\|^load\|^print_info\|^clip" | cut -c1-260 | tail -40
    el "vision rc=${PIPESTATUS[0]}"
    ;;
  deep)
    for fa in --flash-attn --no-flash-attn; do
      timeout "$(cap 150)" timeshare bench api --model /tmp/A.gguf --model /tmp/B.gguf --context 7500 --rounds 3 --switch-only --deep ${fa/--no-flash-attn/} --json > "$W/deep.json" 2> "$W/deep.err"
      rc=$?; el "deep $fa rc=$rc"; [ "$rc" -ne 0 ] && { show "$W/deep.json" error; grep "deep switch" "$W/deep.err" | tail -5 | cut -c1-400; }
      show "$W/deep.json" deep.deep_ttft_ms_median deep.weights_only_ttft_ms_median deep.deep_restore_ms_median deep.weights_only_restore_ms_median deep.kv_bytes_in_use_median deep.deep_release_ms_median deep.kv_save_ms_median deep.kv_save_paths deep.target_ms deep.meets_target
    done
    ;;
  handover)
    BUDGET_S=$(cap 220) OUT="$W/ho" timeout "$(cap 230)" bash "$R/scripts/lab/handover_gpu.sh" 2>&1 | tail -60
    el "handover rc=${PIPESTATUS[0]}"
    ;;
  embed)
    timeout "$(cap 560)" timeshare bench embed --model /tmp/A.gguf --parallel 4 --llama-server "$LS" --counts 2048 --rounds 1 --timeout 540 --json > "$W/embed.json" 2> "$W/embed.err"
    el "embed rc=$?"; show "$W/embed.json" systems; grep -v "so far" "$W/embed.err" | tail -5
    ;;
  visionoff)
    TIMESHARE_HANDOVER=0 timeout "$(cap 150)" python3 -P "$R/scripts/bench_vision_switch.py" --model /tmp/A.gguf --other /tmp/B.gguf --rounds 5 --projector-embd 1024 --projector-layers 24 --log-lines 2>&1 | grep -v "^llama\|^load\|^print_info\|^clip" | cut -c1-260 | tail -40
    el "vision without the hand-over rc=${PIPESTATUS[0]}"
    ;;
  fullcard)
    residency_vs_raw /tmp/A.gguf 4
    TIMESHARE_HANDOVER_ROOM=0 timeout "$(cap 100)" python3 -P "$R/scripts/lab/switch_steps.py" full /tmp/A.gguf /tmp/B.gguf 10 1 2>&1 | grep "^full"
    el "full card, the default (auto: given back at each release)"
    TIMESHARE_HANDOVER_ROOM=0 TIMESHARE_HANDOVER_LAZY_UNMAP=1 timeout "$(cap 100)" python3 -P "$R/scripts/lab/switch_steps.py" lazy /tmp/A.gguf /tmp/B.gguf 10 1 2>&1 | grep "^lazy"
    el "full card, given back and unmapped after the release (TIMESHARE_HANDOVER_LAZY_UNMAP=1)"
    TIMESHARE_HANDOVER_ROOM=0 TIMESHARE_HANDOVER_KEEP=1 timeout "$(cap 100)" python3 -P "$R/scripts/lab/switch_steps.py" kept /tmp/A.gguf /tmp/B.gguf 10 1 2>&1 | grep "^kept"
    el "full card, kept and asked back (TIMESHARE_HANDOVER_KEEP=1)"
    timeout "$(cap 100)" python3 -P "$R/scripts/lab/switch_steps.py" off /tmp/A.gguf /tmp/B.gguf 10 0 2>&1 | grep "^off"
    el "no hand-over"
    ;;
  f16)
    if [ ! -f /tmp/F16.gguf ]; then
      mkdir -p /tmp/mkf && python3 -m pip install -q --no-index --no-deps --target /tmp/mkf "$R"/.gpu/gguf-*.whl
      PYTHONPATH=/tmp/mkf timeout "$(cap 240)" python3 "$R/.gpu/make_synthetic_gguf.py" /tmp/F16.gguf F16 32 "$R/.gpu/vocab.gguf"; el "F16 made rc=$?"
    fi
    residency_vs_raw /tmp/F16.gguf 3
    TIMESHARE_HANDOVER_ROOM=0 timeout "$(cap 150)" python3 -P "$R/scripts/lab/switch_steps.py" f16 /tmp/F16.gguf /tmp/A.gguf 4 1 2>&1 | grep "^f16"
    el "F16 switched (model a is the F16)"
    ;;
  *) echo "unknown step $s (switch deep vision embed rerank handover visionoff fullcard f16)"; exit 2 ;;
  esac
done
