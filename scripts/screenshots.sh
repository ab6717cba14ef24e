#!/bin/sh
# Screenshots of the real app: Xvfb + a tray host (trayer), Timeshare with the two demo models,
# a question typed into the chat window, then the tray menu opened with a right click.
# Writes docs/screenshots/chat.png and docs/screenshots/tray-menu.png.
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
trap cleanup EXIT INT TERM

# A private home: nothing touches the user's config, conversations or arena.
export TIMESHARE_HOME="$WORK/home"
.venv/bin/python - <<'EOF'
import socket
from timeshare.core import config, demo
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
models = demo.demo_model_configs()
if not models:
    raise SystemExit("screenshots.sh: the demo models are not installed: run make run first")
config.save_config(config.Config(models=models, api=config.ApiConfig(port=port)))
EOF

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
sleep 12

# ask SmolLM2 something (the model selector starts on the first model)
xdotool windowfocus --sync "$WIN" 2>/dev/null || true
xdotool mousemove --window "$WIN" 600 590 click 1
xdotool type --delay 30 "What is a GPU, in two sentences?"
xdotool key Return
sleep 10
# switch the conversation to Gemma (second entry of the model selector) and ask again: a GPU switch
xdotool mousemove --window "$WIN" 580 16 click 1
sleep 0.5
xdotool key Down Return
sleep 0.5
xdotool mousemove --window "$WIN" 600 590 click 1
xdotool type --delay 30 "The three primary colours are"
xdotool key Return
sleep 10
import -window root "$OUT/chat.png"

# right-click the tray icon: trayer's embedded icon sits inside trayer's window at the top right
TRAY=$(xdotool search --onlyvisible --name '^panel$' 2>/dev/null | head -1 || true)
if [ -n "$TRAY" ]; then
    eval "$(xdotool getwindowgeometry --shell "$TRAY")"
    xdotool mousemove $((X + WIDTH / 2)) $((Y + HEIGHT / 2)) click 3
else
    W=$(xdotool getdisplaygeometry | cut -d' ' -f1)
    xdotool mousemove $((W - 16)) 16 click 3
fi
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
