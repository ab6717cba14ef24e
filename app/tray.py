"""The tray icon: its image and tooltip follow the pool; its menu is rebuilt on every opening.
While a model waits (loads, waits for the GPU, restores), the tooltip counts the seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from ..core.state import PoolSnapshot
from . import icons
from .bridge import PoolBridge
from .menu_model import Action, Entry, Label, Separator, Submenu, menu_entries, tooltip, tray_state
from .qt_compat import emit
from .waits import WaitClock

log = logging.getLogger(__name__)


def populate(menu: QMenu, entries: tuple[Entry, ...], on_action: Callable[[Action], None]) -> None:
    """Turn menu_model entries into QActions of ``menu`` (cleared first)."""
    # clear() deletes the menu's actions but not the submenus it created: drop those now
    for sub in menu.findChildren(QMenu, options=Qt.FindChildOption.FindDirectChildrenOnly):
        sub.setParent(None)
        sub.deleteLater()
    menu.clear()
    for entry in entries:
        if isinstance(entry, Separator):
            menu.addSeparator()
        elif isinstance(entry, Label):
            qaction = menu.addAction(entry.text)
            qaction.setEnabled(False)
        elif isinstance(entry, Submenu):
            sub = menu.addMenu(entry.text)
            sub.setObjectName(f"model:{entry.model}")
            populate(sub, entry.entries, on_action)
        else:
            qaction = menu.addAction(entry.text)
            qaction.setEnabled(entry.enabled)
            if entry.checkable:
                qaction.setCheckable(True)
                qaction.setChecked(entry.checked)
            qaction.setObjectName(f"{entry.command.value}:{entry.model or ''}")
            qaction.triggered.connect(lambda _checked=False, a=entry: on_action(a))


def relabel(menu: QMenu, entries: tuple[Entry, ...]) -> bool:
    """Rewrite the texts of ``menu``'s items in place from ``entries`` (an open menu stays open,
    its submenus too); False when the entries no longer match the items (rebuild instead)."""
    actions = menu.actions()
    if len(actions) != len(entries):
        return False
    for qaction, entry in zip(actions, entries, strict=True):
        if isinstance(entry, Separator) != qaction.isSeparator():
            return False
        if isinstance(entry, Separator):
            continue
        sub = qaction.menu()
        if isinstance(entry, Submenu) != (sub is not None):
            return False
        qaction.setText(entry.text)
        if isinstance(entry, Submenu) and isinstance(sub, QMenu) and not relabel(sub, entry.entries):
            return False
    return True


class Tray(QObject):
    #: a menu_model.Action the user picked
    action_triggered = Signal(object)

    def __init__(
        self, bridge: PoolBridge, start_at_login: Callable[[], bool], parent: QObject | None = None
    ) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self._start_at_login = start_at_login
        self.icon = QSystemTrayIcon(self)
        self.menu = QMenu()
        self.menu.aboutToShow.connect(self.rebuild_menu)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._on_activated)
        self._clock = WaitClock()
        self.waited: dict[str, float] = {}  # model id → seconds it has waited (see waits.py)
        self._tick = QTimer(self)  # runs while a model waits: the tooltip's seconds go on
        self._tick.setInterval(1000)
        self._tick.timeout.connect(lambda: self.update_from(self.bridge.snapshot))
        bridge.snapshot_changed.connect(self.update_from)
        bridge.notification.connect(self.notify)
        bridge.command_failed.connect(lambda what, msg: self.notify(f"Could not {what}", msg, error=True))
        self.update_from(bridge.snapshot)
        self.rebuild_menu()

    def show(self) -> None:
        self.icon.show()

    def hide(self) -> None:
        self.icon.hide()

    def update_from(self, snapshot: PoolSnapshot) -> None:
        self.state = tray_state(snapshot)
        holder = snapshot.model(snapshot.holder) if snapshot.holder else None
        self.holder_initial = holder.display_name[:1].upper() if holder is not None else ""
        self.icon.setIcon(icons.tray_icon(self.state, self.holder_initial))
        self.waited = self._clock.observe(snapshot, time.monotonic())
        self.icon.setToolTip(tooltip(snapshot, self.waited))
        if self.menu.isVisible():  # an open menu's wait seconds go on too (they stood still)
            entries = menu_entries(snapshot, start_at_login=self._start_at_login(), waited=self.waited)
            relabel(self.menu, entries)
        if self.waited and not self._tick.isActive():
            self._tick.start()
        elif not self.waited:
            self._tick.stop()

    def rebuild_menu(self) -> None:
        self.waited = self._clock.observe(self.bridge.snapshot, time.monotonic())
        entries = menu_entries(
            self.bridge.snapshot, start_at_login=self._start_at_login(), waited=self.waited
        )
        populate(self.menu, entries, lambda action: emit(self.action_triggered, action))

    def notify(self, title: str, message: str, error: bool = False) -> None:
        log.info("tray message: %s: %s", title, message)
        kind = QSystemTrayIcon.MessageIcon.Critical if error else QSystemTrayIcon.MessageIcon.Warning
        if self.icon.isVisible() and QSystemTrayIcon.supportsMessages():
            self.icon.showMessage(title, message, kind, 8000)

    #: emitted when the icon itself is clicked (not the menu)
    clicked = Signal()

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            emit(self.clicked)
