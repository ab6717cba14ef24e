#!/bin/bash
# A cold device call in one go: build llama-cpp-python (CUDA) and llama-server (.gpu/build.sh, about
# 350 s on the H100) while .gpu/setup.sh makes the synthetic models, then gpu_leftovers.sh's STEPS
# with what is left of BUDGET seconds. A warm machine (built already) goes straight to the steps.
# usage (from the project root, carry [".gpu"]): BUDGET=560 bash scripts/lab/gpu_cold.sh vision deep
set -u
R=$(cd "$(dirname "$0")/../.." && pwd)
cd "$R"
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
[ -x .gpu/build.sh ] && [ -f .gpu/setup.sh ] || { echo "no .gpu/ here: run ../shared/tools/gpu-prepare.sh and carry .gpu"; exit 2; }
if [ ! -f /tmp/build.end ]; then
  setsid nohup bash .gpu/build.sh > /tmp/build.outer 2>&1 < /dev/null &
  bash .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log; el "setup done"
  while [ ! -f /tmp/build.end ]; do sleep 2; done; grep -E "rc=" /tmp/build.log | tail -1; el "build done"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
LIMIT=$(( ${BUDGET:-560} - ($(date +%s) - T0) - 5 )) bash scripts/lab/gpu_leftovers.sh "$@"
el end
