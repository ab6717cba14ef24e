"""Tray app entry point (placeholder until the tray issue lands: shows the icon and a Quit item)."""

from __future__ import annotations

import argparse
import os
import sys


def main(args: argparse.Namespace) -> int:
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("QT_QPA_PLATFORM")):
        print("timeshare: no display found (DISPLAY/WAYLAND_DISPLAY unset); use `timeshare serve` headless.")
        return 2
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication, QMenu, QSystemTrayIcon

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Timeshare")
    tray = QSystemTrayIcon(QIcon.fromTheme("timeshare", app.style().standardIcon(app.style().StandardPixmap.SP_ComputerIcon)))
    menu = QMenu()
    menu.addAction("Quit", app.quit)
    tray.setContextMenu(menu)
    tray.setToolTip("Timeshare")
    tray.show()
    return app.exec()
