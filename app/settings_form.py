"""The Settings dialogs' shared pieces: fields described by the config layer (labels, ranges,
help from ``core/config/meta``), the idle box, the problems label, the button row."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLayout,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from ..core.config.meta import FieldMeta, describe
from ..core.config.schema import ModelConfig
from ..core.util.units import parse_size

#: the idle spin boxes show minutes (``idle_sleep_s`` holds seconds)
IDLE_UNIT = "min"

#: TOML-shaped data, as ``config_files.config_to_dict`` makes it (its values are whatever TOML holds)
Table = dict[str, Any]


def field_meta(cls: type, name: str, gpu: bool = True) -> FieldMeta:
    """What the config layer says about field ``name`` of ``cls`` (label, unit, range, help), in
    the words of a build with (``gpu``) or without a GPU ("GPU" only where there is one)."""
    return describe(cls, name).meta.worded(gpu)


def initial(table: Table, cls: type, name: str) -> Any:
    """The draft's value of ``name``, or the field's default (``config/schema.py``)."""
    return table.get(name, describe(cls, name).default)


def field_label(cls: type, name: str, gpu: bool = True) -> str:
    return f"{field_meta(cls, name, gpu).label}:"


def spin(box: QSpinBox | QDoubleSpinBox, cls: type, name: str, value: object, gpu: bool = True) -> None:
    """``box`` set up from the field's metadata: range, unit, special value, tooltip; then ``value``."""
    meta = field_meta(cls, name, gpu)
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


def text_field(edit: QLineEdit, cls: type, name: str, gpu: bool = True) -> None:
    """A text field's placeholder (what empty means) and tooltip from the field's metadata."""
    meta = field_meta(cls, name, gpu)
    if meta.special:
        edit.setPlaceholderText(meta.special)
    if meta.help:
        edit.setToolTip(meta.help)


def reword_row(form: QFormLayout, widget: QWidget, cls: type, name: str, gpu: bool) -> None:
    """The row of ``widget`` in ``form`` (field ``name`` of ``cls``) in the words of a build with
    or without a GPU: its label, tooltip and special text (known once a model has loaded)."""
    meta = field_meta(cls, name, gpu)
    label = form.labelForField(widget)
    if isinstance(label, QLabel):
        label.setText(f"{meta.label}:")
    if meta.help:
        widget.setToolTip(meta.help)
    if meta.special and isinstance(widget, (QSpinBox, QDoubleSpinBox)):
        widget.setSpecialValueText(meta.special)
    elif meta.special and isinstance(widget, QLineEdit):
        widget.setPlaceholderText(meta.special)


def resolved(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def problems_text(problems: Iterable[str]) -> str:
    """Problems (e.g. a ConfigError's) as a bulleted list, one a line."""
    return "\n".join(f"• {p}" for p in problems)


def error_label() -> QLabel:
    label = QLabel()
    label.setObjectName("problems")
    label.setWordWrap(True)
    label.setStyleSheet("color: #c0392b")
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    label.hide()
    return label


def clear_on_edit(problems: QLabel, *fields: QWidget) -> None:
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


def lay_out(
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


def idle_minutes(idle_sleep_s: object) -> float:
    """The spin box value for a config ``idle_sleep_s`` (False/None: never, shown as 0)."""
    if idle_sleep_s is False or not isinstance(idle_sleep_s, (int, float, str)):
        return 0.0
    return float(idle_sleep_s) / 60.0


def idle_seconds(minutes: float) -> float | bool:
    """The config ``idle_sleep_s`` for a spin box value (0 means never: False)."""
    return False if minutes == 0 else round(minutes * 60.0, 1)


def idle_box(minutes: float) -> QDoubleSpinBox:
    """``idle_sleep_s`` in minutes (the config holds seconds)."""
    meta = field_meta(ModelConfig, "idle_sleep_s")
    box = QDoubleSpinBox()
    box.setRange((meta.minimum or 0) / 60.0, (meta.top or 0) / 60.0)
    box.setDecimals(1)
    box.setSuffix(f" {IDLE_UNIT}")
    box.setSpecialValueText(meta.special)
    box.setValue(minutes)
    return box


def note_label(text: str) -> QLabel:
    """A grey explanatory line under a group's fields."""
    label = QLabel(text)
    label.setWordWrap(True)
    label.setStyleSheet("color: gray")
    return label


def new_form() -> QFormLayout:
    """A group's form whose number fields keep their own width (text fields still fill the row)."""
    form = QFormLayout()
    form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
    return form


def group_boxes(groups: Sequence[tuple[str, QLayout]]) -> QWidget:
    """A settings tab: titled group boxes stacked from the top, the space left below them."""
    tab = QWidget()
    column = QVBoxLayout(tab)
    for title, layout in groups:
        box = QGroupBox(title)
        box.setLayout(layout)
        column.addWidget(box)
    column.addStretch(1)
    return tab


def folder_row(path: Path) -> QWidget:
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


#: the budget slider's ends, in GB (the largest single GPUs sold hold less than its top); at its
#: start the budget is not a size but "auto" or "one-model"
BUDGET_SLIDER_MIN_GB = 0
BUDGET_SLIDER_MAX_GB = 192


def budget_gb(text: str) -> int | None:
    """A budget setting as whole GB for the slider ("20GB" → 20, "12000MiB" → 13); None for one
    that is not a size ("auto", "one-model", "80%")."""
    try:
        size = parse_size(text)
    except ValueError:
        return None
    return max(1, min(BUDGET_SLIDER_MAX_GB, round(size / 1e9)))
