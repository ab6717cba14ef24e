#!/bin/bash
# Builds llama-server for the CPU from the llama.cpp that the pinned llama-cpp-python vendors
# (vendor/llama.cpp of its sdist), so that `timeshare bench embed|rerank|parallel --llama-server`
# compares Timeshare with llama-server on the same ggml, same machine, no GPU (issue 45's CPU row).
# Same flags as llama-cpp-python's own CPU build otherwise (Release, GGML_NATIVE default: this CPU's
# instruction set); static libraries so the binary runs after the build folder moves.
# usage: bash scripts/lab/build_cpu_llama_server.sh [SDIST] [DEST]
#   SDIST  llama-cpp-python sdist (.tar.gz) with vendor/llama.cpp; default: the one pip downloads
#          (`pip download llama-cpp-python==VER --no-binary :all: --no-deps`, VER from pyproject.toml)
#   DEST   where to unpack and build (default /work/llcpu; kept, outside the repository)
#   JOBS   environment: parallel compile jobs (default 2: ~10 min on 2 cores)
# The binary ends up at DEST/build/bin/llama-server; the log at DEST/build.log.
set -eu
R=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${2:-/work/llcpu}
JOBS=${JOBS:-2}
VER=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$R/pyproject.toml" | head -n1)
mkdir -p "$DEST"
SDIST=${1:-}
if [ -z "$SDIST" ]; then
    python3 -m pip download "llama-cpp-python==$VER" --no-binary :all: --no-deps -d "$DEST"
    SDIST=$(ls "$DEST"/llama_cpp_python-"$VER".tar.gz)
fi
SRC="$DEST/llama_cpp_python-$VER/vendor/llama.cpp"
[ -f "$SRC/tools/server/CMakeLists.txt" ] || tar xzf "$SDIST" -C "$DEST"
[ -f "$SRC/tools/server/CMakeLists.txt" ] || { echo "no tools/server in $SDIST" >&2; exit 1; }
echo "==> llama.cpp from llama-cpp-python $VER ($SDIST), building in $DEST/build (log $DEST/build.log)"
{
    cmake -S "$SRC" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
    cmake --build "$DEST/build" --target llama-server -j "$JOBS"
} > "$DEST/build.log" 2>&1 || { tail -30 "$DEST/build.log" >&2; exit 1; }
"$DEST/build/bin/llama-server" --version 2>&1 | tail -2
echo "==> $DEST/build/bin/llama-server"
