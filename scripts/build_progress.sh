# Sourced (not run) by scripts/install-llama.sh and scripts/vulkan-check.sh, which both compile
# llama-cpp-python through pip: minutes of output that only a log should hold.
#
#   build_with_progress LOG WHAT EVERY CMD...
#
# runs CMD in the background with its output in LOG, printing ninja's latest [i/n] step every
# EVERY seconds when it moved; if CMD fails, prints LOG's last 40 lines, says that WHAT failed to
# build and exits with CMD's status.
build_with_progress() {
    bp_log=$1 bp_what=$2 bp_every=$3
    shift 3
    set +e
    "$@" >"$bp_log" 2>&1 &
    bp_pid=$!
    bp_last=""
    while kill -0 "$bp_pid" 2>/dev/null; do
        sleep "$bp_every"
        bp_step=$(grep -oE '^ *\[[0-9]+/[0-9]+\]' "$bp_log" | tail -n1 | tr -d ' ')
        if [ -n "$bp_step" ] && [ "$bp_step" != "$bp_last" ]; then echo "    compiling $bp_step"; bp_last=$bp_step; fi
    done
    wait "$bp_pid"
    bp_rc=$?
    set -e
    if [ "$bp_rc" -ne 0 ]; then
        tail -n 40 "$bp_log"
        echo "$bp_what failed to build (exit $bp_rc); see $bp_log" >&2
        exit "$bp_rc"
    fi
}
