#!/bin/sh
# Installs the pinned llama-cpp-python into the venv, compiling llama.cpp with progress.
# Skips the build when that exact version is already installed.
set -eu
PY=${PY:-.venv/bin/python}
VER=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml | head -n1)
have=$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
if [ "$have" = "$VER" ]; then
    echo "==> llama-cpp-python $VER is already installed"
    exit 0
fi
log=.venv/llama-build.log
# pip reuses a wheel it built before (its cache; whatever CMAKE_ARGS were then): seconds, not minutes
if "$PY" -m pip cache list "llama_cpp_python-$VER-*" 2>/dev/null | grep -q "llama_cpp_python-$VER-"; then
    echo "==> installing llama-cpp-python $VER from the wheel pip built before (its cache)"
else
    echo "==> building llama-cpp-python $VER from source (several minutes; CMAKE_ARGS='${CMAKE_ARGS:-}')"
fi
echo "    full log: $log"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
. "$(dirname "$0")/build_progress.sh"
build_with_progress "$log" llama-cpp-python 5 "$PY" -m pip install --progress-bar off -v "llama-cpp-python==$VER"
echo "==> llama-cpp-python $VER installed"
