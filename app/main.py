"""Entry point of the tray app (``timeshare`` / ``timeshare tray [--background]``).

Qt is imported only here, after the display check, so a headless machine gets a sentence instead
of a Qt platform-plugin abort.
"""

from __future__ import annotations

import argparse
import os
import sys


def has_display() -> bool:
    return bool(
        os.environ.get("DISPLAY")
        or os.environ.get("WAYLAND_DISPLAY")
        or os.environ.get("QT_QPA_PLATFORM")
        or sys.platform in ("darwin", "win32")
    )


def main(args: argparse.Namespace) -> int:
    if not has_display():
        print(
            "timeshare: no display found (neither DISPLAY nor WAYLAND_DISPLAY is set). Start it from a "
            "desktop session, or run the models and the API headless with `timeshare serve`.",
            file=sys.stderr,
        )
        return 2
    from .application import run

    return run(args)
