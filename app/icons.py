"""Icons: the application icon (SVG from resources) and the tray's state icons (painted).

The tray icon's colour and glyph show the state: grey ring (idle), green chip (a model holds the
GPU), amber arrows (switching or loading), red "!" (a model failed).
"""

from __future__ import annotations

from importlib import resources

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPainterPath, QPen, QPixmap

from .autostart import APP_ID
from .menu_model import TrayState

STATE_COLOURS = {
    TrayState.IDLE: QColor("#8a939c"),
    TrayState.HOLDING: QColor("#2fa36b"),
    TrayState.SWITCHING: QColor("#e0a020"),
    TrayState.ERROR: QColor("#d64541"),
}


def _resource_path(*parts: str) -> str:
    path = resources.files("timeshare.resources") / "icons" / "hicolor"
    for part in parts:
        path = path / part
    return str(path)


def app_icon() -> QIcon:
    icon = QIcon.fromTheme(APP_ID)
    if icon.isNull():
        icon = QIcon(_resource_path("scalable", "apps", f"{APP_ID}.svg"))
    return icon


def paint_state(state: TrayState, size: int, holder: str = "") -> QPixmap:
    """The tray icon of ``state``; while a model holds the GPU, the first letter of its name
    (``holder``) on the chip, so the tray tells who has it at a glance."""
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    colour = STATE_COLOURS[state]
    p = QPainter(pixmap)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = float(size)
    body = QRectF(s * 0.08, s * 0.08, s * 0.84, s * 0.84)
    if state is TrayState.IDLE:
        p.setPen(QPen(colour, max(1.0, s * 0.1)))
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawRoundedRect(body.adjusted(s * 0.05, s * 0.05, -s * 0.05, -s * 0.05), s * 0.18, s * 0.18)
    else:
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(colour)
        p.drawRoundedRect(body, s * 0.2, s * 0.2)
    white = QColor("#ffffff")
    if state is TrayState.HOLDING and holder:  # the holder's initial, white on the chip
        font = p.font()
        font.setBold(True)
        font.setPixelSize(max(6, int(s * 0.62)))
        p.setFont(font)
        p.setPen(white)
        p.drawText(body, Qt.AlignmentFlag.AlignCenter, holder[:1].upper())
    elif state is TrayState.HOLDING:  # a chip: a filled square in the middle
        p.setBrush(white)
        p.drawRect(QRectF(s * 0.32, s * 0.32, s * 0.36, s * 0.36))
    elif state is TrayState.SWITCHING:  # two arrows: one model out, one in
        p.setPen(QPen(white, max(1.0, s * 0.09), Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap))
        for y, direction in ((0.38, 1.0), (0.62, -1.0)):
            x0, x1 = (0.28, 0.72) if direction > 0 else (0.72, 0.28)
            p.drawLine(QPointF(s * x0, s * y), QPointF(s * x1, s * y))
            head = QPainterPath(QPointF(s * x1, s * y))
            head.lineTo(QPointF(s * (x1 - 0.12 * direction), s * (y - 0.09)))
            head.moveTo(QPointF(s * x1, s * y))
            head.lineTo(QPointF(s * (x1 - 0.12 * direction), s * (y + 0.09)))
            p.drawPath(head)
    elif state is TrayState.ERROR:  # "!"
        p.setBrush(white)
        p.drawRoundedRect(QRectF(s * 0.44, s * 0.24, s * 0.12, s * 0.34), s * 0.05, s * 0.05)
        p.drawEllipse(QRectF(s * 0.43, s * 0.64, s * 0.14, s * 0.14))
    p.end()
    return pixmap


_cache: dict[tuple[TrayState, str], QIcon] = {}


def tray_icon(state: TrayState, holder: str = "") -> QIcon:
    """``state``'s icon; ``holder``: the name of the model that holds the GPU (its initial shows)."""
    key = (state, holder[:1].upper() if state is TrayState.HOLDING else "")
    if key not in _cache:
        icon = QIcon()
        for size in (16, 22, 24, 32, 48, 64):
            icon.addPixmap(paint_state(state, size, key[1]))
        _cache[key] = icon
    return _cache[key]
