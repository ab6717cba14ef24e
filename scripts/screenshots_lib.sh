# Sourced (not run) by scripts/screenshots.sh and scripts/screenshots_habits.sh: the steps they
# share to take screenshots of the real app under Xvfb with a tray host (trayer), in a private
# TIMESHARE_HOME. A script sets NAME (its name, for messages) and DISPLAY_NUM, then sources this
# from the repository root:
#   shots_setup TOOL...    checks the tools and the venv; sets OUT (docs/screenshots/ unless set),
#                          WORK (a temporary folder, removed on exit with every process in PIDS),
#                          TIMESHARE_HOME (in WORK) and TIMESHARE_VRAM_BUDGET=one-model
#   shots_free_port        prints a free TCP port on 127.0.0.1
#   shots_wait_for EXPR    until EXPR holds over `timeshare status --json` (see below)
#   shots_start_desktop    Xvfb on DISPLAY_NUM (exports DISPLAY) and trayer at the top right
#   shots_start_app        the tray app; sets APP and WIN (its chat window, moved and sized)
#   shots_tray_xy          sets TRAY_X TRAY_Y, where trayer's embedded icon is
#   shots_stop_app         stops the app (so its log is complete)
PY=.venv/bin/python
TS=.venv/bin/timeshare
SMOL=smollm2-135m-instruct
GEMMA=gemma3-270m
PIDS=""

shots_cleanup() {
    for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
    for pid in $PIDS; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}

shots_setup() {
    for tool in "$@"; do
        command -v "$tool" >/dev/null || { echo "$NAME: $tool is missing: apt-get install -y xvfb trayer xdotool imagemagick" >&2; exit 2; }
    done
    [ -x "$TS" ] || { echo "$NAME: $TS is missing: run make run first" >&2; exit 2; }
    OUT=${OUT:-$(pwd)/docs/screenshots}
    mkdir -p "$OUT"
    WORK=$(mktemp -d)
    trap shots_cleanup EXIT
    trap 'exit 1' INT TERM  # the EXIT trap cleans up
    # A private home: nothing touches the user's config, conversations or arena.
    export TIMESHARE_HOME="$WORK/home"
    # one model on the GPU at a time, as on a GPU that holds one of them: the demo models are
    # small enough for the default budget (auto) to keep both resident, and nothing would wait
    export TIMESHARE_VRAM_BUDGET=one-model
}

shots_free_port() {
    $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"
}

# shots_wait_for EXPR: until EXPR (Python over s, the `timeshare status --json` object, and m, its
# models by id) is true; at most about 5 minutes
shots_wait_for() {
    for _ in $(seq 600); do
        $TS status --json 2>/dev/null | $PY -c "
import json, sys
s = json.load(sys.stdin)
m = {x['id']: x for x in s['models']}
sys.exit(0 if ($1) else 1)" 2>/dev/null && return 0
        sleep 0.5
    done
    echo "$NAME: gave up waiting for: $1" >&2
    return 1
}

shots_start_desktop() {
    Xvfb "$DISPLAY_NUM" -screen 0 1280x800x24 -nolisten tcp >"$WORK/xvfb.log" 2>&1 &
    PIDS="$! $PIDS"
    export DISPLAY="$DISPLAY_NUM"
    for _ in $(seq 50); do xdotool getdisplaygeometry >/dev/null 2>&1 && break; sleep 0.1; done
    xsetroot -solid '#3b4252' 2>/dev/null || true
    trayer --edge top --align right --widthtype request --height 32 --SetDockType true \
        --transparent true --alpha 0 --tint 0x2e3440 --expand true >"$WORK/trayer.log" 2>&1 &
    PIDS="$! $PIDS"
    sleep 1
}

shots_start_app() {
    QT_QPA_PLATFORM=xcb $TS >"$WORK/app.log" 2>&1 &
    APP=$!
    PIDS="$APP $PIDS"
    WIN=""
    for _ in $(seq 100); do
        WIN=$(xdotool search --name "Timeshare — Chat" 2>/dev/null | head -1 || true)
        [ -n "$WIN" ] && break
        sleep 0.2
    done
    [ -n "$WIN" ] || { echo "$NAME: the chat window did not appear" >&2; cat "$WORK/app.log" >&2; exit 1; }
    xdotool windowmove "$WIN" 40 60 windowsize "$WIN" 1000 620
}

shots_tray_xy() {
    TRAY=$(xdotool search --onlyvisible --name '^panel$' 2>/dev/null | head -1 || true)
    if [ -n "$TRAY" ]; then
        eval "$(xdotool getwindowgeometry --shell "$TRAY")"
        TRAY_X=$((X + WIDTH / 2)) TRAY_Y=$((Y + HEIGHT / 2))
    else
        TRAY_X=$(($(xdotool getdisplaygeometry | cut -d' ' -f1) - 16)) TRAY_Y=16
    fi
}

shots_stop_app() {
    kill "$APP" 2>/dev/null || true
    wait "$APP" 2>/dev/null || true
    PIDS=$(echo "$PIDS" | sed "s/^$APP //")
}
