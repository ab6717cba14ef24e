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
NAME=screenshots.sh
DISPLAY_NUM=${DISPLAY_NUM:-:77}
. scripts/screenshots_lib.sh
shots_setup Xvfb trayer xdotool import
$PY - "$(shots_free_port)" <<'EOF'
import sys
from timeshare.core.config import demo, files, schema
models = demo.demo_model_configs()
if not models:
    raise SystemExit("screenshots.sh: the demo models are not installed: run make run first")
files.save_config(schema.Config(models=models, api=schema.ApiConfig(port=int(sys.argv[1]))))
EOF

shots_start_desktop
shots_start_app
# wait for the models to load
shots_wait_for "m['$SMOL']['state'] in ('resident', 'released') and m['$GEMMA']['state'] in ('resident', 'released')"
IDLE="not any(x['busy'] for x in s['models'])"
input_box() { xdotool mousemove --window "$WIN" 600 575 click 1; }
shots_tray_xy

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
shots_wait_for "$IDLE"
# switch the conversation to Gemma (second entry of the model selector) and ask again: a GPU switch
xdotool mousemove --window "$WIN" 450 16 click 1
sleep 0.5
xdotool key Down Return
sleep 0.5
input_box
xdotool type --delay 30 "The three primary colours are"
xdotool key Return
sleep 2
shots_wait_for "$IDLE and s['holder'] == '$GEMMA'"
sleep 1
import -window root "$OUT/chat.png"

# Gemma keeps the GPU (pinned); back on SmolLM2, the answer waits: the window and the tray say so
$TS pin "$GEMMA" >/dev/null
xdotool mousemove --window "$WIN" 930 17 click 1  # the answer settings close again
sleep 0.5
xdotool mousemove --window "$WIN" 450 16 click 1
sleep 0.5
xdotool key Up Return
sleep 0.5
input_box
xdotool type --delay 30 "And what is a CPU?"
xdotool key Return
shots_wait_for "m['$SMOL']['busy'] and m['$SMOL']['reason'].startswith('waiting')"
sleep 5
xdotool mousemove "$TRAY_X" "$TRAY_Y"  # hovering the tray icon shows its tooltip
sleep 2.5
import -window root "$OUT/waiting.png"
$TS unpin "$GEMMA" >/dev/null
sleep 2
shots_wait_for "$IDLE"

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
shots_stop_app
grep -i -E "error|traceback" "$WORK/app.log" | head -5 || true
