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
set +e
"$PY" -m pip install --progress-bar off -v "llama-cpp-python==$VER" >"$log" 2>&1 &
pid=$!
last=""
while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    step=$(grep -oE '^ *\[[0-9]+/[0-9]+\]' "$log" | tail -n1 | tr -d ' ')
    if [ -n "$step" ] && [ "$step" != "$last" ]; then echo "    compiling llama.cpp $step"; last=$step; fi
done
wait "$pid"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
    tail -n 40 "$log"
    echo "llama-cpp-python failed to build (exit $rc); see $log" >&2
    exit "$rc"
fi
echo "==> llama-cpp-python $VER installed"
