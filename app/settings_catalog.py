"""The models found on this computer (Settings → Models → Add from catalog…), to add in one go."""

from __future__ import annotations

from collections.abc import Iterable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QWidget,
)

from ..core.gguf import catalog
from ..core.util.units import human_bytes
from .settings_form import (
    lay_out,
    resolved,
)


class CatalogDialog(QDialog):
    """Pick GGUF models found on this machine (demo packages, LM Studio, HF cache, llama.cpp, Ollama)."""

    def __init__(
        self,
        entries: list[catalog.CatalogEntry],
        parent: QWidget | None = None,
        added: Iterable[str] = (),
    ) -> None:
        """``added``: the resolved paths of the models already configured (shown, not selectable)."""
        super().__init__(parent)
        self.setWindowTitle("Add model from the catalog")
        self.resize(820, 380)
        self.entries = entries
        known = set(added)
        self.already_added = {i for i, e in enumerate(entries) if resolved(e.path) in known}
        self.table = QTableWidget(len(entries), 6)
        self.table.setObjectName("catalog")
        self.table.setHorizontalHeaderLabels(["Name", "Size", "Quant.", "Source", "Licence", "File"])
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        for row, e in enumerate(entries):
            name = e.name + (f" ({e.parameters})" if e.parameters else "")
            if not e.has_chat_template:
                name += " — no chat template"
            if row in self.already_added:
                name += " — already added"
            for col, text in enumerate(
                [name, human_bytes(e.size), e.quantisation, e.source, e.licence or "–", e.path]
            ):
                item = QTableWidgetItem(text)
                if row in self.already_added:  # shown so people find it, greyed out: not picked again
                    item.setFlags(item.flags() & ~(Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsEnabled))
                    item.setToolTip("This model is already in Timeshare's list")
                self.table.setItem(row, col, item)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.cellDoubleClicked.connect(lambda *_: self.accept())
        empty = QLabel(
            "No GGUF models were found. Use “Add file…” to pick one, or download one with LM Studio, "
            "Ollama or huggingface-cli."
        )
        empty.setWordWrap(True)
        empty.setVisible(not entries)
        lay_out(self, [self.table, empty], QDialogButtonBox.StandardButton.Ok, self.accept)

    def selected(self) -> list[catalog.CatalogEntry]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()} - self.already_added)
        return [self.entries[r] for r in rows]
