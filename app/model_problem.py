"""The chat window's bar for a model that cannot answer now, with what fixes it, where it says so.

A FAILED model: its reason in words (display names, not ids; exit codes, paths and byte dumps
only under Details, with the end of its log), and Locate file… (when its file is missing or
unusable), Restart and Remove; the window disables Send for it. A wait on a model
that another one keeps out of the GPU by a pin: Unpin for that model, in place. The buttons emit
``action_requested`` with the tray's :class:`Action` (the app handles both the same way).
"""

from __future__ import annotations

import re

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from ..core.state import ModelState, ModelStatus, PoolSnapshot
from . import strings
from .menu_model import Action, Command
from .qt_compat import emit

_PINNED_BY = re.compile(r"pinned by ([a-z0-9._-]+)")


def pinned_holder(status: ModelStatus, snapshot: PoolSnapshot) -> ModelStatus | None:
    """The pinned model ``status`` waits for, if its wait is on a pin."""
    found = _PINNED_BY.search(status.reason or "")
    holder = snapshot.model(found.group(1)) if found else None
    return holder if holder is not None and holder.pinned else None


class ModelProblemBar(QWidget):
    action_requested = Signal(object)  # an Action

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("model_problem")
        column = QVBoxLayout(self)
        column.setContentsMargins(0, 2, 0, 2)
        row = QHBoxLayout()
        column.addLayout(row)
        self.label = QLabel()
        self.label.setObjectName("model_problem_reason")
        self.label.setWordWrap(True)
        self.label.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        row.addWidget(self.label, 1)
        self.locate_button = QPushButton(strings.LOCATE_FILE)
        self.restart_button = QPushButton(strings.RESTART)
        self.remove_button = QPushButton(strings.REMOVE)
        self.unpin_button = QPushButton()
        self.details_button = QPushButton(strings.DETAILS)
        self.details_button.setCheckable(True)
        for button, name in (
            (self.details_button, "details"),
            (self.locate_button, "locate_file"),
            (self.restart_button, "restart"),
            (self.remove_button, "remove"),
            (self.unpin_button, "unpin"),
        ):
            button.setObjectName(f"model_problem_{name}")
            row.addWidget(button)
        # what developers need (the pool's own words, exit codes, paths, the log's last lines)
        self.details = QLabel()
        self.details.setObjectName("model_problem_details")
        self.details.setWordWrap(True)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.hide()
        column.addWidget(self.details)
        self.details_button.toggled.connect(self.details.setVisible)
        self._model = ""
        self._holder = ""
        self.locate_button.clicked.connect(lambda: self._request(Command.LOCATE_FILE, self._model))
        self.restart_button.clicked.connect(lambda: self._request(Command.RESTART, self._model))
        self.remove_button.clicked.connect(lambda: self._request(Command.REMOVE_MODEL, self._model))
        self.unpin_button.clicked.connect(lambda: self._request(Command.UNPIN, self._holder))
        self.hide()

    def _request(self, command: Command, model: str) -> None:
        if model:
            emit(self.action_requested, Action(command.value, command, model))

    def show_for(self, status: ModelStatus | None, snapshot: PoolSnapshot) -> None:
        """Show what is wrong with ``status``'s model and the fixes, or hide when nothing is."""
        holder = pinned_holder(status, snapshot) if status is not None else None
        failed = status is not None and status.state is ModelState.FAILED
        if status is None or (not failed and holder is None):
            self._model = self._holder = ""
            self.hide()
            return
        self._model = status.id
        self._holder = holder.id if holder is not None else ""
        if failed:
            title = strings.FAILED_TITLE.format(name=status.display_name)
            said = strings.names_for_people(status.reason, snapshot)
            reason = strings.plain_reason(said) or strings.MISSING_FILE
            self.label.setText(f"<b>{title}</b>: {_escape(reason)}")
            self.details.setText("\n".join([said or strings.MISSING_FILE, *status.log_tail[-8:]]))
        else:
            assert holder is not None
            self.label.setText(
                _escape(
                    strings.pinned_wait(status.display_name, holder.display_name, strings.has_gpu(snapshot))
                )
            )
        self.label.setStyleSheet("color: palette(text)")
        self.locate_button.setVisible(failed and status.failure_code == "model_file")
        self.restart_button.setVisible(failed)
        self.remove_button.setVisible(failed)
        self.details_button.setVisible(failed)
        self.details.setVisible(failed and self.details_button.isChecked())
        self.unpin_button.setVisible(holder is not None)
        if holder is not None:
            self.unpin_button.setText(strings.UNPIN.format(holder=holder.display_name))
        self.show()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
