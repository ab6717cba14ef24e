"""One model's settings (Settings → Models → Add file… / Edit…): its file, name, context and load options."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from ..core.config import validate as config_validate
from ..core.config.schema import ModelConfig
from ..core.errors import ConfigError
from .settings_form import (
    Table,
    clear_on_edit,
    error_label,
    field_label,
    field_meta,
    idle_box,
    idle_minutes,
    idle_seconds,
    initial,
    lay_out,
    problems_text,
    spin,
)


class ModelDialog(QDialog):
    """Add or edit one model. OK validates the model through the config layer."""

    def __init__(
        self,
        model: Table,
        taken_ids: set[str],
        config_path: Path | None,
        parent: QWidget | None = None,
        fitted: str = "",
        gpu: bool = True,
    ) -> None:
        """``gpu``: the models run on a GPU (the labels say "GPU" only then)."""
        super().__init__(parent)
        self.setWindowTitle("Model")
        self._original = dict(model)
        self._taken = taken_ids
        self._config_path = config_path
        form = QFormLayout()
        self.id_edit = QLineEdit(str(model.get("id", "")))
        self.name_edit = QLineEdit(str(initial(model, ModelConfig, "name")))
        self.path_edit = QLineEdit(str(model.get("path", "")))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        path_row = QHBoxLayout()
        path_row.addWidget(self.path_edit, 1)
        path_row.addWidget(browse)
        self.n_ctx = QSpinBox()
        spin(self.n_ctx, ModelConfig, "n_ctx", initial(model, ModelConfig, "n_ctx"), gpu)
        self.n_seq = QSpinBox()
        spin(self.n_seq, ModelConfig, "n_seq", initial(model, ModelConfig, "n_seq"), gpu)
        self.parallel = QSpinBox()
        spin(self.parallel, ModelConfig, "parallel", initial(model, ModelConfig, "parallel"), gpu)
        self.chat_format = QComboBox()
        self.chat_format.addItems(field_meta(ModelConfig, "chat_format").choices)
        self.chat_format.setCurrentText(str(initial(model, ModelConfig, "chat_format")))
        self.pinned = QCheckBox(field_meta(ModelConfig, "pinned", gpu).help)
        self.pinned.setChecked(bool(initial(model, ModelConfig, "pinned")))
        self.idle = idle_box(idle_minutes(initial(model, ModelConfig, "idle_sleep_s")))
        self.licence = QLabel(str(initial(model, ModelConfig, "licence")) or "–")
        self.licence.setObjectName("licence")
        form.addRow(field_label(ModelConfig, "id", gpu), self.id_edit)
        form.addRow(field_label(ModelConfig, "name", gpu), self.name_edit)
        form.addRow(field_label(ModelConfig, "path", gpu), path_row)
        form.addRow(field_label(ModelConfig, "n_ctx", gpu), self.n_ctx)
        form.addRow(field_label(ModelConfig, "n_seq", gpu), self.n_seq)
        form.addRow(field_label(ModelConfig, "parallel", gpu), self.parallel)
        # read-only: what the running worker loaded with (the fit of settings left on auto)
        self.fitted = QLabel(fitted or "–")
        self.fitted.setObjectName("fitted")
        self.fitted.setWordWrap(True)
        form.addRow("Running with:", self.fitted)
        form.addRow(field_label(ModelConfig, "chat_format", gpu), self.chat_format)
        form.addRow(field_label(ModelConfig, "pinned", gpu), self.pinned)
        form.addRow(field_label(ModelConfig, "idle_sleep_s", gpu), self.idle)
        form.addRow(field_label(ModelConfig, "licence", gpu), self.licence)
        self.problems = error_label()
        lay_out(self, [form, self.problems], QDialogButtonBox.StandardButton.Ok, self.accept)
        clear_on_edit(
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
            idle_sleep_s=idle_seconds(self.idle.value()),
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
