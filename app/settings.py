"""Settings: models (catalog, file picker, edit, remove), arena, API, general.

The dialog edits a *draft*: plain TOML-shaped data, as the config file would hold it. Saving runs
the config layer's own validation (``timeshare.core.config.validate``) and shows its field-path
messages; an invalid draft is never written and nothing typed is lost.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QSlider,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ..core import paths
from ..core.config import files as config_files
from ..core.config import validate as config_validate
from ..core.config.meta import describe
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

from .settings_catalog import CatalogDialog
from .settings_form import (
    BUDGET_SLIDER_MAX_GB,
    BUDGET_SLIDER_MIN_GB,
    Table,
    budget_gb,
    clear_on_edit,
    error_label,
    field_label,
    field_meta,
    folder_row,
    group_boxes,
    idle_box,
    idle_minutes,
    idle_seconds,
    initial,
    lay_out,
    new_form,
    note_label,
    problems_text,
    resolved,
    reword_row,
    spin,
    text_field,
)
from .settings_model import ModelDialog


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
        self.sharing_index = self.tabs.addTab(self._arena_tab(), strings.SHARING_TAB)
        self.tabs.addTab(self._api_tab(), "API")
        self.tabs.addTab(self._general_tab(), "General")
        self.problems = error_label()
        lay_out(self, [self.tabs, self.problems], QDialogButtonBox.StandardButton.Save, self.save)
        clear_on_edit(
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
            if resolved(entry.path) in self._known_paths():
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
        return {resolved(m["path"]) for m in self.draft["models"] if m.get("path")}

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
        dialog = self.model_dialog(row)
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return False
        self.draft["models"][row] = dialog.value()
        self._refresh_models()
        self._show_problems([])
        return True

    def model_dialog(self, row: int) -> ModelDialog:
        """The dialog that edits model ``row`` of the draft (not shown), in this build's words."""
        model = self.draft["models"][row]
        snapshot = self.bridge.snapshot
        status = snapshot.model(str(model.get("id", "")))
        return ModelDialog(
            model,
            self._taken_ids(except_row=row),
            self.config_path,
            self,
            fitted=strings.fitted(status),
            gpu=strings.has_gpu(snapshot),
        )

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
        """Sharing the GPU, at a glance: who has it, what each model takes, the budget (a slider in
        GB, or automatic / one model at a time); the engineering knobs under Advanced."""
        tab = QWidget()
        self.holder_label = QLabel()
        self.holder_label.setObjectName("holder")
        font = self.holder_label.font()
        font.setBold(True)
        self.holder_label.setFont(font)
        self.sharing_table = QTableWidget(0, 3)
        self.sharing_table.setObjectName("sharing")
        self.sharing_table.setHorizontalHeaderLabels(strings.SHARING_COLUMNS)
        self.sharing_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.sharing_table.verticalHeader().hide()
        header = self.sharing_table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in (1, 2):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        arena = self.draft["arena"]
        gpu = strings.has_gpu(self.bridge.snapshot)  # known once a model has loaded: _refresh_arena
        budget = field_meta(ArenaConfig, "vram_budget", gpu)
        self.vram_budget = QComboBox()
        self.vram_budget.setEditable(True)  # or a size ("20GB", "12000MiB") or a share ("80%")
        self.vram_budget.addItems(budget.choices)
        self.vram_budget.setCurrentText(str(initial(arena, ArenaConfig, "vram_budget")))
        self.vram_budget.setToolTip(budget.help)
        self.budget_slider = QSlider(Qt.Orientation.Horizontal)
        self.budget_slider.setObjectName("budget_slider")
        self.budget_slider.setRange(BUDGET_SLIDER_MIN_GB, BUDGET_SLIDER_MAX_GB)
        self.budget_slider.setToolTip(strings.BUDGET_SLIDER_TIP)
        gb = budget_gb(self.vram_budget.currentText())
        self.budget_slider.setValue(gb or BUDGET_SLIDER_MIN_GB)  # at its start: not a size (auto)
        self.budget_slider.valueChanged.connect(self._budget_slid)
        budget_row = QHBoxLayout()
        budget_row.addWidget(self.budget_slider, 1)
        budget_row.addWidget(self.vram_budget)
        glance = QFormLayout()
        glance.addRow(strings.BUDGET_LABEL, budget_row)
        self.budget_note = note_label(strings.BUDGET_NOTE)
        glance.addRow(self.budget_note)

        self.quantum = QDoubleSpinBox()
        self.wait_timeout = QDoubleSpinBox()
        self.hung_holder = QDoubleSpinBox()
        for box, name in (
            (self.quantum, "min_quantum_ms"),
            (self.wait_timeout, "wait_timeout_s"),
            (self.hung_holder, "hung_holder_s"),
        ):
            spin(box, ArenaConfig, name, initial(arena, ArenaConfig, name), gpu)
        self.arena_dir = QLineEdit(str(arena.get("dir") or ""))
        self.arena_dir.setPlaceholderText(field_meta(ArenaConfig, "dir", gpu).special)
        # the engineering view: how each model switches and what it holds where
        self.arena_table = QTableWidget(0, 5)
        self.arena_table.setObjectName("arena")
        self.arena_table.setHorizontalHeaderLabels(strings.ADVANCED_COLUMNS)
        self.arena_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.arena_table.verticalHeader().hide()
        self.arena_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.arena_table.horizontalHeader().setStretchLastSection(True)
        form = QFormLayout()
        #: the Advanced rows, worded again for the build once a model has loaded (_refresh_arena)
        self.advanced_form = form
        self.advanced_rows: list[tuple[QWidget, type, str]] = [
            (self.quantum, ArenaConfig, "min_quantum_ms"),
            (self.wait_timeout, ArenaConfig, "wait_timeout_s"),
            (self.hung_holder, ArenaConfig, "hung_holder_s"),
            (self.arena_dir, ArenaConfig, "dir"),
        ]
        for widget, cls, name in self.advanced_rows:
            form.addRow(field_label(cls, name, gpu), widget)
        self.advanced = QWidget()
        self.advanced.setObjectName("advanced")
        advanced_layout = QVBoxLayout(self.advanced)
        advanced_layout.setContentsMargins(0, 0, 0, 0)
        advanced_layout.addLayout(form)
        advanced_layout.addWidget(self.arena_table)
        self.advanced.hide()
        self.advanced_button = QToolButton()
        self.advanced_button.setObjectName("advanced_button")
        self.advanced_button.setText(strings.ADVANCED)
        self.advanced_button.setCheckable(True)
        self.advanced_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.advanced_button.setArrowType(Qt.ArrowType.RightArrow)
        self.advanced_button.toggled.connect(self._show_advanced)
        layout = QVBoxLayout(tab)
        layout.addWidget(self.holder_label)
        layout.addWidget(self.sharing_table, 1)
        layout.addLayout(glance)
        layout.addWidget(self.advanced_button)
        layout.addWidget(self.advanced, 1)
        return tab

    def _budget_slid(self, gb: int) -> None:
        if gb > BUDGET_SLIDER_MIN_GB:  # back at the start leaves the budget as it is (auto, one-model)
            self.vram_budget.setCurrentText(f"{gb}GB")

    def _show_advanced(self, shown: bool) -> None:
        self.advanced.setVisible(shown)
        self.advanced_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    def _refresh_arena(self, snapshot: PoolSnapshot) -> None:
        gpu = strings.has_gpu(snapshot)
        # "GPU" only where there is one: the page's name and notes say memory on a CPU build
        self.tabs.setTabText(self.sharing_index, strings.sharing_tab(gpu))
        self.budget_note.setText(strings.budget_note(gpu))
        self.budget_slider.setToolTip(strings.budget_slider_tip(gpu))
        self.vram_budget.setToolTip(field_meta(ArenaConfig, "vram_budget", gpu).help)
        for widget, cls, name in self.advanced_rows:
            reword_row(self.advanced_form, widget, cls, name, gpu)
        holder = snapshot.model(snapshot.holder) if snapshot.holder else None
        self.holder_label.setText(
            f"{holder.display_name} {strings.holds(gpu)} now."
            if holder
            else f"{strings.nobody_holds(gpu)} now."
        )
        self.sharing_table.setRowCount(len(snapshot.models))
        self.arena_table.setRowCount(len(snapshot.models))
        for row, m in enumerate(snapshot.models):
            glance = [m.display_name, display_state(m, gpu), human_bytes(m.weight_bytes, empty="–")]
            for col, text in enumerate(glance):
                self.sharing_table.setItem(row, col, QTableWidgetItem(text))
            method = strings.SWITCHING_METHODS.get(m.residency_path, m.residency_path or "–")
            if m.residency_reason:
                method += f" ({m.residency_reason})"
            cells = [
                m.display_name,
                m.backend or "–",
                method,
                human_bytes(m.device_bytes),
                human_bytes(m.host_pinned_bytes),
            ]
            for col, text in enumerate(cells):
                self.arena_table.setItem(row, col, QTableWidgetItem(text))
        if self.isVisible():
            self._refresh_models()

    # ---- API and general ---------------------------------------------------------------------

    def _api_tab(self) -> QWidget:
        api = self.draft["api"]
        self.api_enabled = QCheckBox(field_meta(ApiConfig, "enabled").label)
        self.api_enabled.setChecked(bool(initial(api, ApiConfig, "enabled")))
        self.api_host = QLineEdit(str(initial(api, ApiConfig, "host")))
        text_field(self.api_host, ApiConfig, "host")
        self.api_port = QSpinBox()
        spin(self.api_port, ApiConfig, "port", initial(api, ApiConfig, "port"))
        self.api_url = QLabel()
        self.api_url.setObjectName("api_url")
        self.api_url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.api_host.setMaximumWidth(280)
        self.api_port.setMinimumWidth(90)
        address = QHBoxLayout()
        address.addWidget(self.api_host)
        address.addWidget(QLabel(field_label(ApiConfig, "port")))
        address.addWidget(self.api_port)
        address.addStretch(1)
        server = QFormLayout()
        server.addRow(self.api_enabled)
        server.addRow(field_label(ApiConfig, "host"), address)
        server.addRow("Clients connect to:", self.api_url)

        self.api_key = QLineEdit(str(api.get("key") or ""))
        self.api_key.setPlaceholderText(field_meta(ApiConfig, "key").special)
        self.api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.api_allowed_hosts = QLineEdit(
            ", ".join(str(h) for h in initial(api, ApiConfig, "allowed_hosts"))
        )
        text_field(self.api_allowed_hosts, ApiConfig, "allowed_hosts")
        self.api_allowed_origins = QLineEdit(
            ", ".join(str(o) for o in initial(api, ApiConfig, "allowed_origins"))
        )
        text_field(self.api_allowed_origins, ApiConfig, "allowed_origins")
        access = QFormLayout()
        access.addRow(field_label(ApiConfig, "key"), self.api_key)
        access.addRow(field_label(ApiConfig, "allowed_hosts"), self.api_allowed_hosts)
        access.addRow(field_label(ApiConfig, "allowed_origins"), self.api_allowed_origins)
        access.addRow(
            note_label("Clients send the key as a bearer token (OpenAI, Ollama) or as x-api-key (Anthropic).")
        )

        self.api_ollama = QLineEdit(str(api.get("ollama_listen") or ""))
        text_field(self.api_ollama, ApiConfig, "ollama_listen")
        self.api_queue_limit = QSpinBox()
        spin(self.api_queue_limit, ApiConfig, "queue_limit", initial(api, ApiConfig, "queue_limit"))
        self.api_queue_limit.setMinimumWidth(200)
        self.api_responses_kept = QSpinBox()
        spin(self.api_responses_kept, ApiConfig, "responses_kept", initial(api, ApiConfig, "responses_kept"))
        self.api_responses_days = QSpinBox()
        spin(self.api_responses_days, ApiConfig, "responses_days", initial(api, ApiConfig, "responses_days"))
        clients = new_form()
        clients.addRow(field_label(ApiConfig, "ollama_listen"), self.api_ollama)
        clients.addRow(field_label(ApiConfig, "queue_limit"), self.api_queue_limit)
        clients.addRow(field_label(ApiConfig, "responses_kept"), self.api_responses_kept)
        clients.addRow(field_label(ApiConfig, "responses_days"), self.api_responses_days)
        self.api_fetch_images = QCheckBox(field_meta(ApiConfig, "fetch_image_urls").label)
        self.api_fetch_images.setToolTip(field_meta(ApiConfig, "fetch_image_urls").help)
        self.api_fetch_images.setChecked(bool(initial(api, ApiConfig, "fetch_image_urls")))
        clients.addRow(self.api_fetch_images)

        self.api_enabled.toggled.connect(self._show_api_url)
        self.api_host.textChanged.connect(self._show_api_url)
        self.api_port.valueChanged.connect(self._show_api_url)
        self._show_api_url()
        return group_boxes(
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
        self.start_at_login = QCheckBox(field_meta(GeneralConfig, "start_at_login").label)
        self.start_at_login.setChecked(bool(initial(general, GeneralConfig, "start_at_login")))
        startup = QFormLayout()
        startup.addRow(self.start_at_login)

        self.prewake = QCheckBox(field_meta(GeneralConfig, "prewake_on_typing").label)
        self.prewake.setChecked(bool(initial(general, GeneralConfig, "prewake_on_typing")))
        chat = QFormLayout()
        chat.addRow(self.prewake)

        first = initial(self.draft["models"][0] if self.draft["models"] else {}, ModelConfig, "idle_sleep_s")
        self._idle_initial = idle_minutes(first)
        self.idle_all = idle_box(self._idle_initial)
        self.idle_all.setMinimumWidth(120)
        idle = new_form()
        idle.addRow("Release models idle for:", self.idle_all)
        idle.addRow(
            note_label("For every model (each model's own setting is on the Models tab, under Edit…).")
        )

        files = QFormLayout()
        for label, path in (
            ("Settings file:", self.config_path or paths.config_file()),
            ("Logs:", paths.log_dir()),
            ("Chats and saved context:", paths.data_dir()),
        ):
            files.addRow(label, folder_row(Path(path)))
        return group_boxes(
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
        api["responses_kept"] = self.api_responses_kept.value()
        api["responses_days"] = self.api_responses_days.value()
        api["fetch_image_urls"] = self.api_fetch_images.isChecked()
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
            idle = idle_seconds(self.idle_all.value())
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
