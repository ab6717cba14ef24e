# Sourced (not run) by scripts/install-llama.sh and scripts/vulkan-check.sh, which both compile
# llama-cpp-python through pip: minutes of output that only a log should hold.
#
#   build_with_progress LOG WHAT EVERY CMD...
#
# runs CMD in the background with its output in LOG, printing ninja's latest [i/n] step every
# EVERY seconds when it moved, as a percentage with the time left at the pace so far
# ("compiling 36% (70/193), about 4 min left"); if CMD fails, prints LOG's last 40 lines, says
# that WHAT failed to build and exits with CMD's status.

# build_eta ELAPSED_S STEP TOTAL: "36% (70/193), about 4 min left" (the time left at the pace of
# the steps so far; "less than a minute" near the end)
build_eta() {
    be_elapsed=$1 be_i=$2 be_n=$3
    be_pct=$((be_i * 100 / be_n))
    if [ "$be_i" -le 0 ] || [ "$be_i" -ge "$be_n" ]; then
        echo "$be_pct% ($be_i/$be_n)"
        return
    fi
    be_left=$(((be_n - be_i) * be_elapsed / be_i))
    if [ "$be_left" -lt 60 ]; then
        be_words="less than a minute left"
    else
        be_words="about $(((be_left + 30) / 60)) min left"
    fi
    echo "$be_pct% ($be_i/$be_n), $be_words"
}

build_with_progress() {
    bp_log=$1 bp_what=$2 bp_every=$3
    shift 3
    set +e
    "$@" >"$bp_log" 2>&1 &
    bp_pid=$!
    bp_last=""
    bp_start=""  # when ninja's first step showed: pip's download and cmake's configure come first
    while kill -0 "$bp_pid" 2>/dev/null; do
        sleep "$bp_every"
        bp_step=$(grep -oE '^ *\[[0-9]+/[0-9]+\]' "$bp_log" | tail -n1 | tr -d ' []')
        if [ -n "$bp_step" ] && [ "$bp_step" != "$bp_last" ]; then
            [ -n "$bp_start" ] || bp_start=$(($(date +%s) - bp_every))
            bp_i=${bp_step%/*} bp_n=${bp_step#*/}
            echo "    compiling $(build_eta $(($(date +%s) - bp_start)) "$bp_i" "$bp_n")"
            bp_last=$bp_step
        fi
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
