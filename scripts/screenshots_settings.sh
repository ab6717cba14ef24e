#!/bin/sh
# Screenshots of the Settings dialog's tabs (issue 29: the API and General tabs laid out in group
# boxes), with the real app under Xvfb + trayer and its demo models: Settings… from the tray menu,
# then each tab. Writes docs/screenshots/settings-api.png and settings-general.png.
# Needs what scripts/screenshots.sh needs. Usage: sh scripts/screenshots_settings.sh
set -eu
cd "$(dirname "$0")/.."
NAME=screenshots_settings.sh
DISPLAY_NUM=${DISPLAY_NUM:-:79}
. scripts/screenshots_lib.sh
shots_setup Xvfb trayer xdotool import
shots_start_desktop
shots_start_app
shots_tray_xy
SETTINGS=""
for _ in $(seq 10); do
    xdotool mousemove "$TRAY_X" "$TRAY_Y" click 3
    sleep 1
    # the menu: the demo models' submenus, Open chat, Add model…, Get model…, Settings…
    xdotool key Down Down Down Down Down Down Return
    sleep 1.5
    SETTINGS=$(xdotool search --name "Timeshare — Settings" 2>/dev/null | head -1 || true)
    [ -n "$SETTINGS" ] && break
    xdotool key Escape Escape 2>/dev/null || true
done
[ -n "$SETTINGS" ] || { echo "$NAME: the settings dialog did not open" >&2; cat "$WORK/app.log" >&2; exit 1; }
xdotool windowmove "$SETTINGS" 60 60
xdotool windowfocus --sync "$SETTINGS" 2>/dev/null || true
sleep 0.5
xdotool key ctrl+Tab ctrl+Tab  # Models -> Sharing the GPU -> API
sleep 1
import -window "$SETTINGS" "$OUT/settings-api.png"
xdotool key ctrl+Tab  # General
sleep 1
import -window "$SETTINGS" "$OUT/settings-general.png"
shots_stop_app
echo "screenshots in $OUT"
grep -i -E "traceback" "$WORK/app.log" | head -5 || true
