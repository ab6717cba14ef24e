"""Settings: models (catalog, file picker, edit, remove), arena, API, general.

The dialog edits a *draft*: plain TOML-shaped data, as the config file would hold it. Saving runs
the config layer's own validation (``timeshare.core.config.validate``) and shows its field-path
messages; an invalid draft is never written and nothing typed is lost.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLayout,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from ..core import paths
from ..core.config import files as config_files
from ..core.config import validate as config_validate
from ..core.config.meta import FieldMeta, describe
from ..core.config.schema import ApiConfig, ArenaConfig, Config, GeneralConfig, ModelConfig
from ..core.errors import ConfigError, ModelFileError
from ..core.gguf import catalog
from ..core.state import PoolSnapshot
from ..core.util.units import human_bytes
from . import strings
from .bridge import PoolBridge
from .menu_model import display_state
from .qt_compat import emit

if TYPE_CHECKING:
    from .get_model import GetModelDialog

log = logging.getLogger(__name__)

#: the idle spin boxes show minutes (``idle_sleep_s`` holds seconds)
IDLE_UNIT = "min"

#: TOML-shaped data, as ``config_files.config_to_dict`` makes it (its values are whatever TOML holds)
Table = dict[str, Any]


def _meta(cls: type, name: str) -> FieldMeta:
    """What the config layer says about field ``name`` of ``cls`` (label, unit, range, help)."""
    return describe(cls, name).meta


def _initial(table: Table, cls: type, name: str) -> Any:
    """The draft's value of ``name``, or the field's default (``config/schema.py``)."""
    return table.get(name, describe(cls, name).default)


def _label(cls: type, name: str) -> str:
    return f"{_meta(cls, name).label}:"


def _spin(box: QSpinBox | QDoubleSpinBox, cls: type, name: str, value: object) -> None:
    """``box`` set up from the field's metadata: range, unit, special value, tooltip; then ``value``."""
    meta = _meta(cls, name)
    low = meta.minimum if meta.minimum is not None else 0
    high = meta.top if meta.top is not None else low
    if isinstance(box, QSpinBox):
        box.setRange(int(low), int(high))
        box.setValue(int(value))  # type: ignore[call-overload]
    else:
        box.setRange(float(low), float(high))
        box.setValue(float(value))  # type: ignore[arg-type]
    if meta.unit:
        box.setSuffix(f" {meta.unit}")
    if meta.special:
        box.setSpecialValueText(meta.special)
    if meta.help:
        box.setToolTip(meta.help)


def _text(edit: QLineEdit, cls: type, name: str) -> None:
    """A text field's placeholder (what empty means) and tooltip from the field's metadata."""
    meta = _meta(cls, name)
    if meta.special:
        edit.setPlaceholderText(meta.special)
    if meta.help:
        edit.setToolTip(meta.help)


def _resolved(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def problems_text(problems: Iterable[str]) -> str:
    """Problems (e.g. a ConfigError's) as a bulleted list, one a line."""
    return "\n".join(f"• {p}" for p in problems)


def _error_label() -> QLabel:
    label = QLabel()
    label.setObjectName("problems")
    label.setWordWrap(True)
    label.setStyleSheet("color: #c0392b")
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    label.hide()
    return label


def _clear_on_edit(problems: QLabel, *fields: QWidget) -> None:
    """Hide ``problems`` as soon as one of ``fields`` is edited: they said what was wrong before."""

    def clear() -> None:
        problems.clear()
        problems.hide()

    for w in fields:
        if isinstance(w, QLineEdit):
            w.textEdited.connect(lambda _t: clear())
        elif isinstance(w, (QSpinBox, QDoubleSpinBox)):
            w.valueChanged.connect(lambda _v: clear())
        elif isinstance(w, QCheckBox):
            w.toggled.connect(lambda _c: clear())
        elif isinstance(w, QComboBox):
            w.currentIndexChanged.connect(lambda _i: clear())
            if w.isEditable():
                w.editTextChanged.connect(lambda _t: clear())


def _lay_out(
    dialog: QDialog,
    parts: Sequence[QWidget | QLayout],
    ok: QDialogButtonBox.StandardButton,
    on_ok: Callable[[], object],
) -> None:
    """``parts`` from top to bottom, then ``ok`` and Cancel (Cancel rejects the dialog)."""
    buttons = QDialogButtonBox(ok | QDialogButtonBox.StandardButton.Cancel)
    buttons.accepted.connect(on_ok)
    buttons.rejected.connect(dialog.reject)
    layout = QVBoxLayout(dialog)
    for part in parts:
        if isinstance(part, QLayout):
            layout.addLayout(part)
        else:
            layout.addWidget(part)
    layout.addWidget(buttons)


def _idle_minutes(idle_sleep_s: object) -> float:
    """The spin box value for a config ``idle_sleep_s`` (False/None: never, shown as 0)."""
    if idle_sleep_s is False or not isinstance(idle_sleep_s, (int, float, str)):
        return 0.0
    return float(idle_sleep_s) / 60.0


def _idle_seconds(minutes: float) -> float | bool:
    """The config ``idle_sleep_s`` for a spin box value (0 means never: False)."""
    return False if minutes == 0 else round(minutes * 60.0, 1)


def _idle_box(minutes: float) -> QDoubleSpinBox:
    """``idle_sleep_s`` in minutes (the config holds seconds)."""
    meta = _meta(ModelConfig, "idle_sleep_s")
    box = QDoubleSpinBox()
    box.setRange((meta.minimum or 0) / 60.0, (meta.top or 0) / 60.0)
    box.setDecimals(1)
    box.setSuffix(f" {IDLE_UNIT}")
    box.setSpecialValueText(meta.special)
    box.setValue(minutes)
    return box


def _note(text: str) -> QLabel:
    """A grey explanatory line under a group's fields."""
    label = QLabel(text)
    label.setWordWrap(True)
    label.setStyleSheet("color: gray")
    return label


def _form() -> QFormLayout:
    """A group's form whose number fields keep their own width (text fields still fill the row)."""
    form = QFormLayout()
    form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
    return form


def _boxes(groups: Sequence[tuple[str, QLayout]]) -> QWidget:
    """A settings tab: titled group boxes stacked from the top, the space left below them."""
    tab = QWidget()
    column = QVBoxLayout(tab)
    for title, layout in groups:
        box = QGroupBox(title)
        box.setLayout(layout)
        column.addWidget(box)
    column.addStretch(1)
    return tab


def _path_row(path: Path) -> QWidget:
    """A folder or file the app uses, selectable, with a button that opens its folder."""
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    shown = QLabel(str(path))
    shown.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    folder = path if path.is_dir() else path.parent
    button = QPushButton("Open folder")
    button.clicked.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))))
    layout.addWidget(shown, 1)
    layout.addWidget(button)
    return row


class ModelDialog(QDialog):
    """Add or edit one model. OK validates the model through the config layer."""

    def __init__(
        self,
        model: Table,
        taken_ids: set[str],
        config_path: Path | None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Model")
        self._original = dict(model)
        self._taken = taken_ids
        self._config_path = config_path
        form = QFormLayout()
        self.id_edit = QLineEdit(str(model.get("id", "")))
        self.name_edit = QLineEdit(str(_initial(model, ModelConfig, "name")))
        self.path_edit = QLineEdit(str(model.get("path", "")))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        path_row = QHBoxLayout()
        path_row.addWidget(self.path_edit, 1)
        path_row.addWidget(browse)
        self.n_ctx = QSpinBox()
        _spin(self.n_ctx, ModelConfig, "n_ctx", _initial(model, ModelConfig, "n_ctx"))
        self.n_seq = QSpinBox()
        _spin(self.n_seq, ModelConfig, "n_seq", _initial(model, ModelConfig, "n_seq"))
        self.parallel = QSpinBox()
        _spin(self.parallel, ModelConfig, "parallel", _initial(model, ModelConfig, "parallel"))
        self.chat_format = QComboBox()
        self.chat_format.addItems(_meta(ModelConfig, "chat_format").choices)
        self.chat_format.setCurrentText(str(_initial(model, ModelConfig, "chat_format")))
        self.pinned = QCheckBox(_meta(ModelConfig, "pinned").help)
        self.pinned.setChecked(bool(_initial(model, ModelConfig, "pinned")))
        self.idle = _idle_box(_idle_minutes(_initial(model, ModelConfig, "idle_sleep_s")))
        self.licence = QLabel(str(_initial(model, ModelConfig, "licence")) or "–")
        self.licence.setObjectName("licence")
        form.addRow(_label(ModelConfig, "id"), self.id_edit)
        form.addRow(_label(ModelConfig, "name"), self.name_edit)
        form.addRow(_label(ModelConfig, "path"), path_row)
        form.addRow(_label(ModelConfig, "n_ctx"), self.n_ctx)
        form.addRow(_label(ModelConfig, "n_seq"), self.n_seq)
        form.addRow(_label(ModelConfig, "parallel"), self.parallel)
        form.addRow(_label(ModelConfig, "chat_format"), self.chat_format)
        form.addRow(_label(ModelConfig, "pinned"), self.pinned)
        form.addRow(_label(ModelConfig, "idle_sleep_s"), self.idle)
        form.addRow(_label(ModelConfig, "licence"), self.licence)
        self.problems = _error_label()
        _lay_out(self, [form, self.problems], QDialogButtonBox.StandardButton.Ok, self.accept)
        _clear_on_edit(
            self.problems,
            self.id_edit,
            self.name_edit,
            self.path_edit,
            self.n_ctx,
            self.n_seq,
            self.parallel,
            self.chat_format,
            self.pinned,
            self.idle,
        )

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "GGUF model", self.path_edit.text(), "GGUF models (*.gguf)"
        )
        if path:
            self.path_edit.setText(path)
            self.problems.hide()

    def value(self) -> Table:
        model = dict(self._original)
        model.update(
            id=self.id_edit.text().strip(),
            path=self.path_edit.text().strip(),
            n_ctx=self.n_ctx.value(),
            n_seq=self.n_seq.value(),
            chat_format=self.chat_format.currentText(),
            pinned=self.pinned.isChecked(),
            idle_sleep_s=_idle_seconds(self.idle.value()),
        )
        if self.parallel.value():
            model["parallel"] = self.parallel.value()
        else:
            model.pop("parallel", None)  # auto
        name = self.name_edit.text().strip()
        if name:
            model["name"] = name
        else:
            model.pop("name", None)
        return model

    def accept(self) -> None:
        model = self.value()
        problems: list[str] = []
        if model["id"] in self._taken:
            problems.append(f"id: {model['id']!r} is already used by another model: choose another id")
        try:
            config_validate.validate({"models": [model]}, path=self._config_path, check_paths=True)
        except ConfigError as e:
            problems += [p.replace("models[0].", "", 1) for p in e.problems]
        if problems:
            self.problems.setText(problems_text(problems))
            self.problems.show()
            return
        super().accept()


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
        self.already_added = {i for i, e in enumerate(entries) if _resolved(e.path) in known}
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
        _lay_out(self, [self.table, empty], QDialogButtonBox.StandardButton.Ok, self.accept)

    def selected(self) -> list[catalog.CatalogEntry]:
        rows = sorted({i.row() for i in self.table.selectedIndexes()} - self.already_added)
        return [self.entries[r] for r in rows]


class _DraftRefused(Exception):
    """The draft, with what was saved elsewhere merged in, does not validate: nothing is written."""


class SettingsDialog(QDialog):
    #: the Config that was saved
    saved = Signal(object)

    def __init__(
        self,
        config: Config,
        bridge: PoolBridge,
        config_path: Path | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Timeshare — Settings")
        self.resize(860, 520)
        self.bridge = bridge
        self.config_path = config_path
        self.draft: Table = config_files.config_to_dict(config)  # a fresh dict of scalars
        self._base = config  # the config the draft was made from, or last adopted
        self.tabs = QTabWidget()
        self.tabs.addTab(self._models_tab(), "Models")
        self.tabs.addTab(self._arena_tab(), "Arena")
        self.tabs.addTab(self._api_tab(), "API")
        self.tabs.addTab(self._general_tab(), "General")
        self.problems = _error_label()
        _lay_out(self, [self.tabs, self.problems], QDialogButtonBox.StandardButton.Save, self.save)
        _clear_on_edit(
            self.problems,
            self.quantum,
            self.wait_timeout,
            self.vram_budget,
            self.hung_holder,
            self.arena_dir,
            self.api_enabled,
            self.api_host,
            self.api_port,
            self.api_key,
            self.api_ollama,
            self.api_allowed_hosts,
            self.api_allowed_origins,
            self.api_queue_limit,
            self.start_at_login,
            self.prewake,
            self.idle_all,
        )
        bridge.snapshot_changed.connect(self._refresh_arena)
        self._refresh_models()
        self._refresh_arena(bridge.snapshot)

    # ---- models ------------------------------------------------------------------------------

    def _models_tab(self) -> QWidget:
        tab = QWidget()
        self.models_table = QTableWidget(0, 5)
        self.models_table.setObjectName("models")
        self.models_table.setHorizontalHeaderLabels(["Name", "Id", "State", "Licence", "File"])
        self.models_table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.models_table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.models_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        header = self.models_table.horizontalHeader()
        # names and ids whole (they were cut); a long file path is elided in the middle instead
        for column in range(4):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.Stretch)
        self.models_table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.models_table.cellDoubleClicked.connect(lambda row, _c: self.edit_model(row))
        self.catalog_button = QPushButton("Add from catalog…")
        self.get_button = QPushButton("Get model…")
        self.get_button.setToolTip("Download a GGUF from Hugging Face or a URL")
        self.get_button.clicked.connect(lambda: self.get_model())
        self.file_button = QPushButton("Add file…")
        self.edit_button = QPushButton("Edit…")
        self.remove_button = QPushButton("Remove")
        self.catalog_button.clicked.connect(lambda: self.add_from_catalog())
        self.file_button.clicked.connect(lambda: self.add_file())
        self.edit_button.clicked.connect(lambda: self.edit_model())
        self.remove_button.clicked.connect(lambda: self.remove_model())
        row = QHBoxLayout()
        for b in (
            self.catalog_button,
            self.get_button,
            self.file_button,
            self.edit_button,
            self.remove_button,
        ):
            row.addWidget(b)
        row.addStretch(1)
        layout = QVBoxLayout(tab)
        layout.addWidget(self.models_table)
        layout.addLayout(row)
        return tab

    def _refresh_models(self) -> None:
        snapshot = self.bridge.snapshot
        models = self.draft["models"]
        self.models_table.setRowCount(len(models))
        for row, m in enumerate(models):
            status = snapshot.model(m["id"])
            state = (
                display_state(status, strings.has_gpu(snapshot))
                if status
                else "not started (save to start it)"
            )
            for col, text in enumerate(
                [m.get("name") or m["id"], m["id"], state, m.get("licence") or "–", m["path"]]
            ):
                item = QTableWidgetItem(str(text))
                item.setToolTip(str(text))
                self.models_table.setItem(row, col, item)

    def adopt_saved_elsewhere(self, old: Config, new: Config) -> list[str]:
        """The config file changed while this dialog is open ("Get model…", a reload through the
        API, a located model file): bring those model changes into the draft, so that saving the
        draft does not undo them. A three-way merge by model id against ``old`` (what this dialog
        was opened with, or last adopted): a model added elsewhere joins the draft (unless the
        draft already has that id); one changed or removed elsewhere follows only where the draft
        still holds it as it was. Returns the ids whose draft entry changed. Saving the draft
        itself comes back here as a no-op (the draft already equals ``new``)."""
        self._base = new
        before = {m["id"]: m for m in config_files.config_to_dict(old)["models"]}
        after = {m["id"]: m for m in config_files.config_to_dict(new)["models"]}
        models: list[Table] = self.draft["models"]
        changed: list[str] = []
        for i in reversed(range(len(models))):
            mid = models[i]["id"]
            if mid in before and models[i] == before[mid] and after.get(mid) != before[mid]:
                if mid in after:
                    models[i] = after[mid]
                else:
                    del models[i]
                changed.append(mid)
        drafted = {m["id"] for m in models}
        for mid, model in after.items():
            if mid not in before and mid not in drafted:
                models.append(model)
                changed.append(mid)
        if changed:
            self._refresh_models()
        return changed

    def _taken_ids(self, except_row: int | None = None) -> set[str]:
        return {m["id"] for i, m in enumerate(self.draft["models"]) if i != except_row}

    def _selected_row(self) -> int | None:
        rows = {i.row() for i in self.models_table.selectedIndexes()}
        return next(iter(rows)) if rows else None

    def _append_model(self, model: Table) -> None:
        self.draft["models"].append(model)
        self._refresh_models()
        self.models_table.selectRow(len(self.draft["models"]) - 1)

    def add_from_catalog(self, entries: list[catalog.CatalogEntry] | None = None) -> list[str]:
        """Pick from the catalog (scanned now); with ``entries`` given, add those without asking."""
        if entries is None:
            QGuiApplication.setOverrideCursor(Qt.CursorShape.WaitCursor)
            try:
                report = catalog.scan_report()
            finally:
                QGuiApplication.restoreOverrideCursor()
            dialog = CatalogDialog(list(report.entries), self, added=self._known_paths())
            if dialog.exec() != QDialog.DialogCode.Accepted:
                return []
            entries = dialog.selected()
        added = []
        problems = []
        for entry in entries:
            if _resolved(entry.path) in self._known_paths():
                problems.append(f"{entry.name} is already in the list ({entry.path})")
                continue
            model = config_files.config_to_dict(Config(models=(entry.to_model_config(self._taken_ids()),)))[
                "models"
            ][0]
            self._append_model(model)
            added.append(model["id"])
        self._show_problems(problems)  # what went wrong now, if anything: older messages go
        return added

    def _known_paths(self) -> set[str]:
        """The resolved files of the models in the list."""
        return {_resolved(m["path"]) for m in self.draft["models"] if m.get("path")}

    def get_model(self, source: str = "") -> GetModelDialog:
        """Download a model ("Get model…"); once checked it joins the draft as a catalog pick
        does (saved with the settings)."""
        from .get_model import GetModelDialog

        dialog = GetModelDialog(
            lambda: self.bridge.snapshot, self.config_path, add_to_config=False, source=source, parent=self
        )
        dialog.pulled.connect(lambda result: self.add_from_catalog([result.entry]))
        dialog.open()  # window-modal, without a nested event loop
        return dialog

    def add_file(self, path: str | None = None) -> str | None:
        """Add a GGUF file (asks with a file picker when ``path`` is None); returns the new id."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(
                self, "Add a GGUF model", str(Path.home()), "GGUF models (*.gguf)"
            )
            if not path:
                return None
        try:
            entry = catalog.read_gguf_header(path)
        except ModelFileError as e:
            self._show_problems([str(e)])
            QMessageBox.warning(self, "Not a usable model", str(e))
            return None
        added = self.add_from_catalog([entry])
        return added[0] if added else None

    def edit_model(self, row: int | None = None) -> bool:
        row = self._selected_row() if row is None else row
        if row is None:
            return False
        dialog = ModelDialog(
            self.draft["models"][row], self._taken_ids(except_row=row), self.config_path, self
        )
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return False
        self.draft["models"][row] = dialog.value()
        self._refresh_models()
        self._show_problems([])
        return True

    def remove_model(self, row: int | None = None) -> bool:
        row = self._selected_row() if row is None else row
        if row is None:
            return False
        model = self.draft["models"][row]
        answer = QMessageBox.question(
            self,
            "Remove model",
            f"Remove {model.get('name') or model['id']} from Timeshare? The file stays on disk.",
        )
        if answer != QMessageBox.StandardButton.Yes:
            return False
        del self.draft["models"][row]
        self._refresh_models()
        self._show_problems([])
        return True

    # ---- arena -------------------------------------------------------------------------------

    def _arena_tab(self) -> QWidget:
        tab = QWidget()
        self.holder_label = QLabel()
        self.holder_label.setObjectName("holder")
        self.arena_table = QTableWidget(0, 7)
        self.arena_table.setObjectName("arena")
        self.arena_table.setHorizontalHeaderLabels(
            ["Model", "State", "Backend", "Switching method", "Device memory", "Host shadow", "Weights"]
        )
        self.arena_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.arena_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        arena = self.draft["arena"]
        self.quantum = QDoubleSpinBox()
        _spin(self.quantum, ArenaConfig, "min_quantum_ms", _initial(arena, ArenaConfig, "min_quantum_ms"))
        self.wait_timeout = QDoubleSpinBox()
        _spin(
            self.wait_timeout, ArenaConfig, "wait_timeout_s", _initial(arena, ArenaConfig, "wait_timeout_s")
        )
        self.arena_dir = QLineEdit(str(arena.get("dir") or ""))
        self.arena_dir.setPlaceholderText(_meta(ArenaConfig, "dir").special)
        budget = _meta(ArenaConfig, "vram_budget")
        self.vram_budget = QComboBox()
        self.vram_budget.setEditable(True)  # or a size ("20GB", "12000MiB") or a share ("80%")
        self.vram_budget.addItems(budget.choices)
        self.vram_budget.setCurrentText(str(_initial(arena, ArenaConfig, "vram_budget")))
        self.vram_budget.setToolTip(budget.help)
        self.hung_holder = QDoubleSpinBox()
        _spin(self.hung_holder, ArenaConfig, "hung_holder_s", _initial(arena, ArenaConfig, "hung_holder_s"))
        form = QFormLayout()
        form.addRow(_label(ArenaConfig, "min_quantum_ms"), self.quantum)
        form.addRow(_label(ArenaConfig, "wait_timeout_s"), self.wait_timeout)
        form.addRow(_label(ArenaConfig, "vram_budget"), self.vram_budget)
        form.addRow(_label(ArenaConfig, "hung_holder_s"), self.hung_holder)
        form.addRow(_label(ArenaConfig, "dir"), self.arena_dir)
        layout = QVBoxLayout(tab)
        layout.addWidget(self.holder_label)
        layout.addWidget(self.arena_table)
        layout.addLayout(form)
        return tab

    def _refresh_arena(self, snapshot: PoolSnapshot) -> None:
        holder = snapshot.model(snapshot.holder) if snapshot.holder else None
        self.holder_label.setText(
            f"Holds the GPU: {holder.display_name}" if holder else "No model holds the GPU now."
        )
        self.arena_table.setRowCount(len(snapshot.models))
        for row, m in enumerate(snapshot.models):
            residency = m.residency_path + (f" ({m.residency_reason})" if m.residency_reason else "")
            cells = [
                m.display_name + (" ★" if m.id == snapshot.holder else ""),
                display_state(m, strings.has_gpu(snapshot)),
                m.backend or "–",
                residency or "–",
                human_bytes(m.device_bytes),
                human_bytes(m.host_pinned_bytes),
                human_bytes(m.weight_bytes),
            ]
            for col, text in enumerate(cells):
                self.arena_table.setItem(row, col, QTableWidgetItem(text))
        if self.isVisible():
            self._refresh_models()

    # ---- API and general ---------------------------------------------------------------------

    def _api_tab(self) -> QWidget:
        api = self.draft["api"]
        self.api_enabled = QCheckBox(_meta(ApiConfig, "enabled").label)
        self.api_enabled.setChecked(bool(_initial(api, ApiConfig, "enabled")))
        self.api_host = QLineEdit(str(_initial(api, ApiConfig, "host")))
        _text(self.api_host, ApiConfig, "host")
        self.api_port = QSpinBox()
        _spin(self.api_port, ApiConfig, "port", _initial(api, ApiConfig, "port"))
        self.api_url = QLabel()
        self.api_url.setObjectName("api_url")
        self.api_url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.api_host.setMaximumWidth(280)
        self.api_port.setMinimumWidth(90)
        address = QHBoxLayout()
        address.addWidget(self.api_host)
        address.addWidget(QLabel(_label(ApiConfig, "port")))
        address.addWidget(self.api_port)
        address.addStretch(1)
        server = QFormLayout()
        server.addRow(self.api_enabled)
        server.addRow(_label(ApiConfig, "host"), address)
        server.addRow("Clients connect to:", self.api_url)

        self.api_key = QLineEdit(str(api.get("key") or ""))
        self.api_key.setPlaceholderText(_meta(ApiConfig, "key").special)
        self.api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.api_allowed_hosts = QLineEdit(
            ", ".join(str(h) for h in _initial(api, ApiConfig, "allowed_hosts"))
        )
        _text(self.api_allowed_hosts, ApiConfig, "allowed_hosts")
        self.api_allowed_origins = QLineEdit(
            ", ".join(str(o) for o in _initial(api, ApiConfig, "allowed_origins"))
        )
        _text(self.api_allowed_origins, ApiConfig, "allowed_origins")
        access = QFormLayout()
        access.addRow(_label(ApiConfig, "key"), self.api_key)
        access.addRow(_label(ApiConfig, "allowed_hosts"), self.api_allowed_hosts)
        access.addRow(_label(ApiConfig, "allowed_origins"), self.api_allowed_origins)
        access.addRow(
            _note("Clients send the key as a bearer token (OpenAI, Ollama) or as x-api-key (Anthropic).")
        )

        self.api_ollama = QLineEdit(str(api.get("ollama_listen") or ""))
        _text(self.api_ollama, ApiConfig, "ollama_listen")
        self.api_queue_limit = QSpinBox()
        _spin(self.api_queue_limit, ApiConfig, "queue_limit", _initial(api, ApiConfig, "queue_limit"))
        self.api_queue_limit.setMinimumWidth(200)
        clients = _form()
        clients.addRow(_label(ApiConfig, "ollama_listen"), self.api_ollama)
        clients.addRow(_label(ApiConfig, "queue_limit"), self.api_queue_limit)

        self.api_enabled.toggled.connect(self._show_api_url)
        self.api_host.textChanged.connect(self._show_api_url)
        self.api_port.valueChanged.connect(self._show_api_url)
        self._show_api_url()
        return _boxes(
            [
                ("Server", server),
                ("Access", access),
                ("Clients", clients),
            ]
        )

    def _show_api_url(self, *_args: object) -> None:
        if not self.api_enabled.isChecked():
            self.api_url.setText("nothing: the API is off")
            return
        host = self.api_host.text().strip() or str(describe(ApiConfig, "host").default)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        if ":" in shown:
            shown = f"[{shown}]"
        base = f"http://{shown}:{self.api_port.value()}"
        self.api_url.setText(f"{base}/v1 (OpenAI) · {base} (Anthropic, Ollama)")

    def _general_tab(self) -> QWidget:
        general = self.draft["general"]
        self.start_at_login = QCheckBox(_meta(GeneralConfig, "start_at_login").label)
        self.start_at_login.setChecked(bool(_initial(general, GeneralConfig, "start_at_login")))
        startup = QFormLayout()
        startup.addRow(self.start_at_login)

        self.prewake = QCheckBox(_meta(GeneralConfig, "prewake_on_typing").label)
        self.prewake.setChecked(bool(_initial(general, GeneralConfig, "prewake_on_typing")))
        chat = QFormLayout()
        chat.addRow(self.prewake)

        first = _initial(self.draft["models"][0] if self.draft["models"] else {}, ModelConfig, "idle_sleep_s")
        self._idle_initial = _idle_minutes(first)
        self.idle_all = _idle_box(self._idle_initial)
        self.idle_all.setMinimumWidth(120)
        idle = _form()
        idle.addRow("Release models idle for:", self.idle_all)
        idle.addRow(_note("For every model (each model's own setting is on the Models tab, under Edit…)."))

        files = QFormLayout()
        for label, path in (
            ("Settings file:", self.config_path or paths.config_file()),
            ("Logs:", paths.log_dir()),
            ("Chats and saved context:", paths.data_dir()),
        ):
            files.addRow(label, _path_row(Path(path)))
        return _boxes(
            [
                ("Startup", startup),
                ("Chat window", chat),
                ("Idle models", idle),
                ("Files", files),
            ]
        )

    # ---- saving ------------------------------------------------------------------------------

    def collect(self) -> Table:
        """The draft with the form fields applied (TOML-shaped data)."""
        draft = copy.deepcopy(self.draft)
        arena = draft["arena"]
        arena["min_quantum_ms"] = self.quantum.value()
        arena["wait_timeout_s"] = self.wait_timeout.value()
        arena["vram_budget"] = self.vram_budget.currentText().strip()
        arena["hung_holder_s"] = self.hung_holder.value()
        if self.arena_dir.text().strip():
            arena["dir"] = self.arena_dir.text().strip()
        else:
            arena.pop("dir", None)
        api = draft["api"]
        api["enabled"] = self.api_enabled.isChecked()
        api["host"] = self.api_host.text().strip()
        api["port"] = self.api_port.value()
        if self.api_key.text():
            api["key"] = self.api_key.text()
        else:
            api.pop("key", None)
        if self.api_ollama.text().strip():
            api["ollama_listen"] = self.api_ollama.text().strip()
        else:
            api.pop("ollama_listen", None)
        api["queue_limit"] = self.api_queue_limit.value()
        for key, line in (
            ("allowed_hosts", self.api_allowed_hosts),
            ("allowed_origins", self.api_allowed_origins),
        ):
            items = [x.strip() for x in line.text().split(",") if x.strip()]
            if items:
                api[key] = items
            else:
                api.pop(key, None)
        draft["general"]["start_at_login"] = self.start_at_login.isChecked()
        draft["general"]["prewake_on_typing"] = self.prewake.isChecked()
        if self.idle_all.value() != self._idle_initial:
            idle = _idle_seconds(self.idle_all.value())
            for m in draft["models"]:
                m["idle_sleep_s"] = idle
        return draft

    def _show_problems(self, problems: list[str]) -> None:
        self.problems.setText(problems_text(problems))
        self.problems.setVisible(bool(problems))

    def validated(self) -> Config | None:
        try:
            config = config_validate.validate(self.collect(), path=self.config_path, check_paths=True)
        except ConfigError as e:
            self._show_problems(list(e.problems))
            return None
        self._show_problems([])
        return config

    def save(self) -> bool:
        config = self.validated()
        if config is None:
            return False
        target = self.config_path or paths.config_file()
        chosen = [config]

        def merged(current: Config) -> Config:
            # the one writer (issue 44): a model change saved since the dialog last heard of one
            # (an API pull or keep_alive, `timeshare pull`) comes into the draft first
            if target.exists() and self.adopt_saved_elsewhere(self._base, current):
                again = self.validated()
                if again is None:
                    raise _DraftRefused
                chosen[0] = again
            return chosen[0]

        try:
            config_files.update_config(merged, self.config_path)
        except _DraftRefused:
            return False  # validated() shows why
        except (ConfigError, OSError) as e:
            self._show_problems([f"could not save the settings: {e}"])
            return False
        config = chosen[0]
        emit(self.saved, config)
        self.accept()
        return True
