"""The desktop's light or dark scheme (Qt's ``QStyleHints.colorScheme``), for the colours the app
chooses itself (the transcript's code blocks and links); Qt's own widgets follow it by themselves.
``TIMESHARE_COLOR_SCHEME=dark|light`` decides instead (screenshots, and desktops that say nothing).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QPalette

from ..core import envvars


def is_dark() -> bool:
    """Whether the desktop is in a dark scheme: what it says, else the window colour's lightness."""
    forced = envvars.COLOR_SCHEME.text().lower()
    if forced in ("dark", "light"):
        return forced == "dark"
    app = QGuiApplication.instance()
    if not isinstance(app, QGuiApplication):
        return False
    said = app.styleHints().colorScheme()
    if said is not Qt.ColorScheme.Unknown:
        return said is Qt.ColorScheme.Dark
    return app.palette().color(QPalette.ColorRole.Window).lightness() < 128


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` when the desktop switches between light and dark."""
    app = QGuiApplication.instance()
    if isinstance(app, QGuiApplication):
        app.styleHints().colorSchemeChanged.connect(lambda _scheme: callback())
