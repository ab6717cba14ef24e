#!/bin/sh
# Screenshots of the real app: Xvfb + a tray host (trayer), Timeshare with the two demo models.
# chat.png: a question to SmolLM2 with the answer settings open (a system prompt), then one to
# Gemma (a GPU switch); waiting.png: Gemma pinned, SmolLM2's answer waits for the GPU (the window's
# line and the tray's tooltip say so, with the seconds); tray-menu.png: the tray menu.
# Writes them to docs/screenshots/.
#
# Needs: xvfb trayer xdotool imagemagick (apt-get install -y xvfb trayer xdotool imagemagick)
# and the venv with the demo models (`make run` installs them). Usage: sh scripts/screenshots.sh
set -eu
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/docs/screenshots}
DISPLAY_NUM=${DISPLAY_NUM:-:77}
for tool in Xvfb trayer xdotool import; do
    command -v "$tool" >/dev/null || { echo "screenshots.sh: $tool is missing: apt-get install -y xvfb trayer xdotool imagemagick" >&2; exit 2; }
done
[ -x .venv/bin/timeshare ] || { echo "screenshots.sh: .venv/bin/timeshare is missing: run make run first" >&2; exit 2; }
mkdir -p "$OUT"

WORK=$(mktemp -d)
PIDS=""
cleanup() {
    for pid in $PIDS; do kill "$pid" 2>/dev/null || true; done
    for pid in $PIDS; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM  # the EXIT trap cleans up

# A private home: nothing touches the user's config, conversations or arena.
export TIMESHARE_HOME="$WORK/home"
# one model on the GPU at a time, as on a GPU that holds one of them: the demo models are small
# enough for the default budget (auto) to keep both resident, and nothing would wait
export TIMESHARE_VRAM_BUDGET=one-model
.venv/bin/python - <<'EOF'
import socket
from timeshare.core.config import demo, files, schema
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
models = demo.demo_model_configs()
if not models:
    raise SystemExit("screenshots.sh: the demo models are not installed: run make run first")
files.save_config(schema.Config(models=models, api=schema.ApiConfig(port=port)))
EOF

# wait_for EXPR: until EXPR (Python over s, the `timeshare status --json` object, and m, its
# models by id) is true; at most about 5 minutes
wait_for() {
    for _ in $(seq 600); do
        .venv/bin/timeshare status --json 2>/dev/null | .venv/bin/python -c "
import json, sys
s = json.load(sys.stdin)
m = {x['id']: x for x in s['models']}
sys.exit(0 if ($1) else 1)" 2>/dev/null && return 0
        sleep 0.5
    done
    echo "screenshots.sh: gave up waiting for: $1" >&2
    return 1
}
SMOL=smollm2-135m-instruct
GEMMA=gemma3-270m

Xvfb "$DISPLAY_NUM" -screen 0 1280x800x24 -nolisten tcp >"$WORK/xvfb.log" 2>&1 &
PIDS="$!"
export DISPLAY="$DISPLAY_NUM"
for _ in $(seq 50); do xdotool getdisplaygeometry >/dev/null 2>&1 && break; sleep 0.1; done
xsetroot -solid '#3b4252' 2>/dev/null || true

trayer --edge top --align right --widthtype request --height 32 --SetDockType true \
    --transparent true --alpha 0 --tint 0x2e3440 --expand true >"$WORK/trayer.log" 2>&1 &
PIDS="$! $PIDS"
sleep 1

QT_QPA_PLATFORM=xcb .venv/bin/timeshare >"$WORK/app.log" 2>&1 &
APP=$!
PIDS="$APP $PIDS"

# wait for the chat window, then for the models to load
WIN=""
for _ in $(seq 100); do
    WIN=$(xdotool search --name "Timeshare — Chat" 2>/dev/null | head -1 || true)
    [ -n "$WIN" ] && break
    sleep 0.2
done
[ -n "$WIN" ] || { echo "screenshots.sh: the chat window did not appear"; cat "$WORK/app.log"; exit 1; }
xdotool windowmove "$WIN" 40 60 windowsize "$WIN" 1000 620
wait_for "m['$SMOL']['state'] in ('resident', 'released') and m['$GEMMA']['state'] in ('resident', 'released')"
IDLE="not any(x['busy'] for x in s['models'])"
input_box() { xdotool mousemove --window "$WIN" 600 575 click 1; }
# where trayer's embedded icon is: inside trayer's window at the top right
TRAY=$(xdotool search --onlyvisible --name '^panel$' 2>/dev/null | head -1 || true)
if [ -n "$TRAY" ]; then
    eval "$(xdotool getwindowgeometry --shell "$TRAY")"
    TRAY_X=$((X + WIDTH / 2)) TRAY_Y=$((Y + HEIGHT / 2))
else
    TRAY_X=$(($(xdotool getdisplaygeometry | cut -d' ' -f1) - 16)) TRAY_Y=16
fi

# open the answer settings, give the conversation a system prompt, ask SmolLM2 (the selector
# starts on the first model)
xdotool windowfocus --sync "$WIN" 2>/dev/null || true
xdotool mousemove --window "$WIN" 930 17 click 1
sleep 0.5
xdotool mousemove --window "$WIN" 600 85 click 1
xdotool type --delay 20 "Answer in two short sentences."
input_box
xdotool type --delay 30 "What is a GPU?"
xdotool key Return
sleep 2
wait_for "$IDLE"
# switch the conversation to Gemma (second entry of the model selector) and ask again: a GPU switch
xdotool mousemove --window "$WIN" 450 16 click 1
sleep 0.5
xdotool key Down Return
sleep 0.5
input_box
xdotool type --delay 30 "The three primary colours are"
xdotool key Return
sleep 2
wait_for "$IDLE and s['holder'] == '$GEMMA'"
sleep 1
import -window root "$OUT/chat.png"

# Gemma keeps the GPU (pinned); back on SmolLM2, the answer waits: the window and the tray say so
.venv/bin/timeshare pin "$GEMMA" >/dev/null
xdotool mousemove --window "$WIN" 930 17 click 1  # the answer settings close again
sleep 0.5
xdotool mousemove --window "$WIN" 450 16 click 1
sleep 0.5
xdotool key Up Return
sleep 0.5
input_box
xdotool type --delay 30 "And what is a CPU?"
xdotool key Return
wait_for "m['$SMOL']['busy'] and m['$SMOL']['reason'].startswith('waiting')"
sleep 5
xdotool mousemove "$TRAY_X" "$TRAY_Y"  # hovering the tray icon shows its tooltip
sleep 2.5
import -window root "$OUT/waiting.png"
.venv/bin/timeshare unpin "$GEMMA" >/dev/null
sleep 2
wait_for "$IDLE"

# right-click the tray icon: trayer's embedded icon sits inside trayer's window at the top right
xdotool mousemove "$TRAY_X" "$TRAY_Y" click 3
sleep 1.5
# open the first model's submenu as well (the first line is a disabled summary)
xdotool key Down Right 2>/dev/null || true
sleep 1
import -window root "$OUT/tray-menu.png"
xdotool key Escape Escape Escape 2>/dev/null || true

echo "screenshots in $OUT:"
ls -l "$OUT"
kill "$APP" 2>/dev/null || true
wait "$APP" 2>/dev/null || true
PIDS=$(echo "$PIDS" | sed "s/^$APP //")
grep -i -E "error|traceback" "$WORK/app.log" | head -5 || true
