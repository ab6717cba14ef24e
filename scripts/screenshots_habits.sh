#!/bin/sh
# Screenshots for issue 29 (as a user coming from Ollama/LM Studio would see it), with the real
# app under Xvfb + trayer: two models pulled with the real `timeshare pull` (from a local HTTP
# server serving the demo GGUF files) and one whose file is gone. Writes to docs/screenshots/:
# chat-failed-model.png (the chat window with the failed model picked), tray-pulled.png (the tray
# menu with the pulled models' names), repl-help.png (`timeshare run`'s /? in a terminal,
# rendered from the real pty session with ImageMagick: no terminal emulator needed).
# Needs what scripts/screenshots.sh needs. Usage: sh scripts/screenshots_habits.sh
set -eu
cd "$(dirname "$0")/.."
NAME=screenshots_habits.sh
DISPLAY_NUM=${DISPLAY_NUM:-:78}
. scripts/screenshots_lib.sh
shots_setup Xvfb trayer xdotool import convert

# the files a user would pull, served over HTTP as a model host would
mkdir -p "$WORK/www"
$PY - "$WORK/www" <<'EOF'
import os, sys
from timeshare.core.config import demo
www = sys.argv[1]
os.symlink(demo.smollm2_path(), os.path.join(www, "SmolLM2-135M-Instruct-Q4_1.gguf"))
os.symlink(demo.gemma3_path(), os.path.join(www, "gemma-3-270m-Q4_K_M.gguf"))
EOF
PORT=$(shots_free_port)
$PY -m http.server "$PORT" --bind 127.0.0.1 --directory "$WORK/www" >"$WORK/www.log" 2>&1 &
PIDS="$! $PIDS"
sleep 1
# a config with one model whose file has gone (a deleted download), then two pulls
$PY - "$(shots_free_port)" <<'EOF'
import sys
from timeshare.core.config import files, schema
gone = schema.ModelConfig(id="llama-3.2-1b-instruct-q4_k_m", name="Llama-3.2-1B-Instruct Q4_K_M",
                          path="/home/user/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf")
files.save_config(schema.Config(models=(gone,), api=schema.ApiConfig(port=int(sys.argv[1]))))
EOF
$TS pull "http://127.0.0.1:$PORT/SmolLM2-135M-Instruct-Q4_1.gguf"
$TS pull "http://127.0.0.1:$PORT/gemma-3-270m-Q4_K_M.gguf"
$TS ls

shots_start_desktop
shots_start_app
# the pulled models loaded, the one whose file is gone failed
GONE=llama-3.2-1b-instruct-q4_k_m
shots_wait_for "m['$GONE']['state'] == 'failed' and [x['state'] for x in s['models']].count('failed') == 1 and all(x['state'] in ('resident', 'released', 'failed') for x in s['models'])"
# pick the failed model (the first entry of the model selector)
xdotool windowfocus --sync "$WIN" 2>/dev/null || true
xdotool mousemove --window "$WIN" 450 16 click 1
sleep 0.5
xdotool key Home Return
sleep 0.5
xdotool mousemove --window "$WIN" 600 575 click 1
xdotool type --delay 20 "Hello?"
sleep 1
import -window root "$OUT/chat-failed-model.png"

shots_tray_xy
xdotool mousemove "$TRAY_X" "$TRAY_Y" click 3
sleep 1.5
import -window root "$OUT/tray-pulled.png"
xdotool key Escape Escape 2>/dev/null || true

# the REPL's help, in a real pty
$PY - "$WORK/repl.txt" <<'EOF'
import os, pty, re, select, subprocess, sys, time
master, slave = pty.openpty()
proc = subprocess.Popen([".venv/bin/timeshare", "run", "smol"], stdin=slave, stdout=slave, stderr=slave)
os.close(slave)
seen = b""
def expect(token, timeout=120):
    global seen
    end = time.monotonic() + timeout
    while token not in seen.split(b"\n")[-1] and time.monotonic() < end:
        if select.select([master], [], [], 0.5)[0]:
            seen += os.read(master, 65536)
    time.sleep(0.3)
expect(b">>> ")
for line in (b"/?\n", b"/set parameter temperature 0\n", b"/bye\n"):
    os.write(master, line)
    expect(b">>> ", 10)
proc.wait(30)
while select.select([master], [], [], 0.2)[0]:
    try:
        seen += os.read(master, 65536)
    except OSError:
        break
text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", seen).replace(b"\r", b"").decode()
open(sys.argv[1], "w").write("$ timeshare run smol\n" + text)
EOF
convert -background '#1e1e1e' -fill '#e0e0e0' -font DejaVu-Sans-Mono -pointsize 15 \
    -bordercolor '#1e1e1e' -border 16 label:"$(cat "$WORK/repl.txt")" "$OUT/repl-help.png"
echo "screenshots in $OUT"
grep -i -E "traceback" "$WORK/app.log" | head -5 || true
