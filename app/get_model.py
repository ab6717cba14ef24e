"""“Get model…”: find a model (a search of the hub, or the suggested short names), download a GGUF
from Hugging Face or a URL, with progress and Cancel, and add it.

Words that are no source (``qwen coder``) search the hub for repositories with GGUF files
(core/pull/search.py); the list on the left shows the hits, or before any search the suggestions
(the short-name table: ``qwen3:8b``…). Under each hit come its GGUF sizes per quantisation and
which fit the GPU budget, as the hub tells them (a few hits at a time, on a thread of their own that
never makes the dialog busy). Picking one looks it up.

The dialog takes the same SOURCE as ``timeshare pull`` (``user/repo``, ``user/repo:Q4_K_M``,
``user/repo/file.gguf``, ``hf.co/…``, or the URL of a ``.gguf`` file), lists the quantisations
with their sizes and whether they fit the GPU (the weights, a tenth for compute buffers, and the KV
cache of a new model entry: ``n_ctx`` × the GPU's auto ``parallel`` cells, from the GGUF metadata
read with a Range request), and downloads the chosen one. The look-up and the
download run on a worker thread (``core/pull/`` does the work); what they report crosses into
Qt through signals, so the window stays responsive. Cancel keeps what was downloaded: getting the
same model again resumes.

From the tray the model is added to the config file (``config_saved`` carries the new Config);
from Settings it goes into the dialog's draft instead (``pulled`` carries the PullResult).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..core.config.fit import auto_n_ctx
from ..core.config.parallel import auto_parallel
from ..core.errors import CancelledError, ConfigError, TimeshareError
from ..core.gguf.kvcache import KvShape, kv_shape
from ..core.pull import add, progress, remote, search, shortnames, sources
from ..core.pull.download import PullResult, pull, pull_projector
from ..core.state import PoolSnapshot
from ..core.util.units import human_bytes
from . import strings
from .qt_compat import emit

log = logging.getLogger(__name__)

PLACEHOLDER = (
    "a model to search for (qwen coder), a short name (llama3.2), user/repo, or https://…/model.gguf"
)
SUGGESTED = "Suggested (pick one to see its sizes):"


def vram_budget(snapshot: PoolSnapshot) -> int | None:
    """The GPU memory a new model's weights may use: the largest weights budget of this pool's
    GPUs (``devices[].budget_bytes``: an ``auto`` budget after the reserves, or a size or share of
    ``arena.vram_budget``; other models are released to make room). None when nothing tells it:
    no worker has loaded on a GPU yet, or the budget is ``one-model`` (then the dialog says the
    fit is unknown)."""
    budgets = [
        d.budget_bytes
        for d in snapshot.devices
        if d.budget_bytes is not None and d.name and not d.name.upper().startswith("CPU")
    ]
    return max(budgets, default=None)


#: the column's text when the weights fit but the KV cache could not be told (no guess is made)
WEIGHTS_FIT = "weights fit; KV unknown"


@dataclass(frozen=True)
class KvEstimate:
    """The KV cache a new entry of the looked-up model needs on a GPU, or why it is not known."""

    bytes: int | None
    n_ctx: int = 0
    parallel: int = 0
    why: str = ""  # when bytes is None

    @classmethod
    def of(cls, shape: KvShape | str) -> KvEstimate:
        """For a new model entry: ``n_ctx`` and ``parallel`` auto on a GPU (before the fit to the memory)."""
        if isinstance(shape, str):
            return cls(None, why=shape)
        n_ctx, parallel = auto_n_ctx(0, gpu=True), auto_parallel(gpu=True)
        return cls(shape.bytes(n_ctx, parallel), n_ctx, parallel)

    def describe(self) -> str:
        if self.bytes is None:
            return f"KV cache unknown ({self.why}): the Fits column counts the weights only."
        return (
            f"The Fits column counts the weights, a tenth for compute buffers and a KV cache of "
            f"{human_bytes(self.bytes)} (n_ctx {self.n_ctx} × {self.parallel} sequences, "
            "the new entry's auto settings, before they are fitted to the memory)."
        )


#: the Fits column on a machine without a GPU
CPU_BUILD = "CPU build: host memory"


def fit_text(size: int | None, snapshot: PoolSnapshot, kv: KvEstimate | None = None) -> str:
    """The "Fits" column: "fits", "too big", "weights fit; KV unknown", or why it is unknown."""
    backends = {m.backend for m in snapshot.models if m.backend}
    if backends and all(b.upper().startswith("CPU") for b in backends):
        return CPU_BUILD
    kv_bytes = kv.bytes if kv is not None else None
    fit = sources.gpu_fit(size, vram_budget(snapshot), kv_bytes)
    if fit == "fits" and kv_bytes is None:
        return WEIGHTS_FIT
    return fit


def default_choice(listing: sources.Listing) -> sources.Choice:
    """The choice the dialog selects first: the one the source names, else Q4_K_M, else the first."""
    try:
        return sources.choose(listing)
    except TimeshareError:
        labels = [c.label.upper() for c in listing.choices]
        return listing.choices[labels.index("Q4_K_M")] if "Q4_K_M" in labels else listing.choices[0]


def look_up_kv(listing: sources.Listing) -> KvEstimate | None:
    """The KV estimate of the listing's model, from the metadata of one file (network: a Range
    request of the first part of the default choice; the quantisations of a repo are one model, so
    their KV caches are the same). None when the listing has no choice."""
    if not listing.choices:
        return None
    choice = default_choice(listing)
    values = remote.remote_metadata(choice.files[0], hub=isinstance(listing.source, sources.HubSource))
    if isinstance(values, str):
        return KvEstimate(None, why=f"the header of {choice.filename} could not be read: {values}")
    return KvEstimate.of(kv_shape(values))


class GetModelDialog(QDialog):
    #: the PullResult of a finished, checked download
    pulled = Signal(object)
    #: the Config saved with the model added (only with ``add_to_config``)
    config_saved = Signal(object)

    # from the worker thread to the GUI thread
    _listed = Signal(object, object)  # Listing, KvEstimate | None
    _searched = Signal(str, object)  # the query, list[search.Found]
    _sized = Signal(int, object)  # the search it belongs to, search.Sizes
    _progressed = Signal(object)  # Progress
    _done = Signal(object)  # PullResult
    _failed = Signal(str, bool)  # message, whether it was a cancel

    def __init__(
        self,
        snapshot: Callable[[], PoolSnapshot],
        config_path: Path | None = None,
        *,
        add_to_config: bool = True,
        source: str = "",
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Get model")
        self.resize(920, 480)
        self._snapshot = snapshot
        self.config_path = config_path
        self.add_to_config = add_to_config
        self.listing: sources.Listing | None = None
        self.kv: KvEstimate | None = None  # the looked-up model's KV cache
        self.pulled_result: PullResult | None = None
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()
        # the hits shown (repo id -> its item and what the search said), and their sizes' look-up:
        # a search of its own number, stopped by its event when the list shows something else
        self._hits: dict[str, tuple[QListWidgetItem, search.Found]] = {}
        self._search_number = 0
        self._sizes_cancel = threading.Event()

        self.source = QLineEdit(source)
        self.source.setObjectName("source")
        self.source.setPlaceholderText(PLACEHOLDER)
        self.source.returnPressed.connect(self.look_up)
        self.lookup_button = QPushButton("Look up")
        self.lookup_button.setObjectName("lookup")
        self.lookup_button.clicked.connect(self.look_up)
        row = QHBoxLayout()
        row.addWidget(QLabel("Model:"))
        row.addWidget(self.source, 1)
        row.addWidget(self.lookup_button)

        # the suggestions, or a search's hits: picking one looks it up
        self.found_label = QLabel(SUGGESTED)
        self.found_label.setObjectName("found_label")
        self.found_label.setWordWrap(True)
        self.found = QListWidget()
        self.found.setObjectName("found")
        self.found.setWordWrap(True)
        self.found.setSpacing(2)
        self.found.itemClicked.connect(self.pick)
        self.found.itemActivated.connect(self.pick)
        self.show_suggestions()
        found_pane = QWidget()
        found_layout = QVBoxLayout(found_pane)
        found_layout.setContentsMargins(0, 0, 0, 0)
        found_layout.addWidget(self.found_label)
        found_layout.addWidget(self.found, 1)

        self.table = QTableWidget(0, 4)
        self.table.setObjectName("choices")
        self.table.setHorizontalHeaderLabels(["Quantisation", "Size", "Fits", "File"])
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.table.cellDoubleClicked.connect(lambda *_: self.download())
        self.table.itemSelectionChanged.connect(self._update_buttons)

        self.info = QLabel()
        self.info.setObjectName("info")
        self.info.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setObjectName("progress")
        self.progress.hide()
        self.status = QLabel()
        self.status.setObjectName("status")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.problem = QLabel()
        self.problem.setObjectName("problem")
        self.problem.setWordWrap(True)
        self.problem.setStyleSheet("color: #c0392b")
        self.problem.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.problem.hide()

        self.download_button = QPushButton("Download")
        self.download_button.setObjectName("download")
        self.download_button.setDefault(True)
        self.download_button.clicked.connect(self.download)
        self.cancel_button = QPushButton("Close")
        self.cancel_button.setObjectName("cancel")
        self.cancel_button.clicked.connect(self._cancel_or_close)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.download_button)
        buttons.addWidget(self.cancel_button)

        split = QSplitter()
        split.addWidget(found_pane)
        split.addWidget(self.table)
        split.setStretchFactor(1, 2)
        split.setSizes([300, 600])
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(split, 1)
        layout.addWidget(self.info)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(self.problem)
        layout.addLayout(buttons)

        self._listed.connect(self._on_listed)
        self._searched.connect(self._on_searched)
        self._sized.connect(self._on_sized)
        self._progressed.connect(self._on_progress)
        self._done.connect(self._on_done)
        self._failed.connect(self._on_failed)
        self._update_buttons()
        if not source:
            self.info.setText(strings.GET_MODEL_START)

    # ---- state ---------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def _update_buttons(self) -> None:
        busy = self.busy
        self.source.setEnabled(not busy)
        self.lookup_button.setEnabled(not busy)
        self.found.setEnabled(not busy)
        self.table.setEnabled(not busy)
        self.download_button.setEnabled(not busy and self.selected() is not None)
        self.cancel_button.setText("Cancel" if busy else "Close")

    def _show_problem(self, text: str) -> None:
        self.problem.setText(text)
        self.problem.setVisible(bool(text))

    def selected(self) -> sources.Choice | None:
        if self.listing is None:
            return None
        rows = {i.row() for i in self.table.selectedIndexes()}
        return self.listing.choices[next(iter(rows))] if rows else None

    def _start(self, target: Callable[[], None], name: str) -> None:
        self._cancel = threading.Event()
        self._worker = threading.Thread(target=target, name=name, daemon=True)
        self._worker.start()
        self._update_buttons()

    # ---- look-up -------------------------------------------------------------------------------

    def show_suggestions(self) -> None:
        """The list shows the suggested models (the short-name table)."""
        self._forget_hits()
        self.found.clear()
        self.found_label.setText(SUGGESTED)
        for s in search.suggestions():
            item = QListWidgetItem(f"{s.name}\n{s.repo_id} · {s.quant}")
            item.setData(Qt.ItemDataRole.UserRole, s.source)
            item.setToolTip(f"The same as: timeshare pull {s.name}")
            self.found.addItem(item)

    def pick(self, item: QListWidgetItem) -> None:
        """Look up a suggestion or a search hit (what clicking it does)."""
        source = item.data(Qt.ItemDataRole.UserRole)
        if self.busy or not source:
            return
        self.source.setText(str(source))
        self.look_up()

    def look_up(self) -> None:
        """Parse the source and list what it offers (on a worker thread); words that are no source
        search the hub instead."""
        if self.busy:
            return
        self._show_problem("")
        text = self.source.text().strip()
        try:
            source = sources.parse_source(text)
        except ValueError as exc:
            if shortnames.is_short_name(text) and ":" not in text:  # words, not a source: a search
                self.start_search(text)
            else:
                self._show_problem(str(exc))
            return
        self.listing = None
        self.table.setRowCount(0)
        self.info.setText("")
        self.status.setText(f"Looking up {source}…")

        def work() -> None:
            try:
                listing = remote.list_source(source)
                emit(self._listed, listing, look_up_kv(listing))
            except TimeshareError as exc:
                emit(self._failed, str(exc), False)
            except Exception as exc:  # a bug or a library's own error: shown, not lost in a thread
                log.exception("looking up %s failed", source)
                emit(self._failed, f"{type(exc).__name__}: {exc}", False)

        self._start(work, "get-model-lookup")

    def start_search(self, query: str) -> None:
        """Search the hub for repositories with GGUF files (on a worker thread)."""
        if self.busy:
            return
        self._show_problem("")
        self.status.setText(f"Searching the hub for “{query}”…")

        def work() -> None:
            try:
                emit(self._searched, query, search.search_hub(query))
            except (TimeshareError, ValueError) as exc:
                emit(self._failed, str(exc), False)
            except Exception as exc:  # a bug or a library's own error: shown, not lost in a thread
                log.exception("searching for %s failed", query)
                emit(self._failed, f"{type(exc).__name__}: {exc}", False)

        self._start(work, "get-model-search")

    def _on_searched(self, query: str, found: list[search.Found]) -> None:
        self._worker = None
        self.status.setText("")
        self._forget_hits()
        self.found.clear()
        if found:
            self.found_label.setText(strings.search_hits(len(found), query))
        else:
            self.found_label.setText(strings.search_none(query))
        for hit in found:
            item = QListWidgetItem(f"{hit.repo_id}\n{hit.describe()}\n{strings.SIZES_COMING}")
            item.setData(Qt.ItemDataRole.UserRole, hit.repo_id)
            self.found.addItem(item)
            self._hits[hit.repo_id] = (item, hit)
        self._update_buttons()
        self._look_up_sizes([hit.repo_id for hit in found])

    def _forget_hits(self) -> None:
        """The list is about to show something else: the sizes still coming are not wanted."""
        self._sizes_cancel.set()
        self._search_number += 1
        self._hits = {}

    def _look_up_sizes(self, repo_ids: list[str]) -> None:
        """Each hit's GGUF sizes per quantisation (core/pull/search.py), on a thread of its own."""
        if not repo_ids:
            return
        number, cancel = self._search_number, threading.Event()
        self._sizes_cancel = cancel

        def work() -> None:
            try:
                search.look_up_sizes(repo_ids, lambda sizes: emit(self._sized, number, sizes), cancel=cancel)
            except Exception:  # a bug: the hits stay without sizes, the log says why
                log.exception("looking up the sizes of %d hits failed", len(repo_ids))

        threading.Thread(target=work, name="get-model-sizes", daemon=True).start()

    def _on_sized(self, number: int, sizes: search.Sizes) -> None:
        shown = self._hits.get(sizes.repo_id)
        if number != self._search_number or shown is None:
            return  # an older search's
        item, hit = shown
        item.setText(f"{hit.repo_id}\n{hit.describe()}\n{sizes.describe(vram_budget(self._snapshot()))}")

    def _on_listed(self, listing: sources.Listing, kv: KvEstimate | None) -> None:
        self._worker = None
        self.listing = listing
        self.kv = kv
        self.status.setText("")
        snapshot = self._snapshot()
        self.table.setRowCount(len(listing.choices))
        for row, choice in enumerate(listing.choices):
            parts = f" (+{len(choice.files) - 1} parts)" if len(choice.files) > 1 else ""
            cells = [
                choice.label,
                human_bytes(choice.size or 0, empty="?"),
                fit_text(choice.size, snapshot, kv),
                choice.filename + parts,
            ]
            for col, text in enumerate(cells):
                self.table.setItem(row, col, QTableWidgetItem(text))
        notes = []
        if not listing.choices:
            notes.append(f"{listing.title} has no GGUF model file.")
        if listing.licence:
            notes.append(f"Licence (repo card): {listing.licence}.")
        if listing.gated:
            notes.append(
                "This repository is gated: accept its conditions on the hub and log in "
                "(`hf auth login` or HF_TOKEN) before downloading."
            )
        if listing.choices and fit_text(listing.choices[0].size, snapshot, kv) == CPU_BUILD:
            notes.append(
                "The models run in this computer's memory (no GPU): the size is what the weights need."
            )
        elif listing.choices and not any(
            fit_text(c.size, snapshot, kv) in ("fits", "too big", WEIGHTS_FIT) for c in listing.choices
        ):
            one_model = any(d.budget == "one-model" for d in snapshot.devices)
            why = (
                'with the setting "one model at a time" Timeshare does not measure the memory'
                if one_model
                else "Timeshare does not know the memory budget yet (no model has loaded)"
            )
            notes.append(f"Fit unknown: {why}; the size is what the weights need.")
        elif listing.choices and kv is not None:
            notes.append(kv.describe())
        self.info.setText(" ".join(notes))
        self._select_default(listing)
        self._update_buttons()

    def _select_default(self, listing: sources.Listing) -> None:
        if not listing.choices:
            return
        self.table.selectRow(listing.choices.index(default_choice(listing)))

    # ---- download ------------------------------------------------------------------------------

    def download(self) -> None:
        """Download the selected choice (on a worker thread)."""
        choice = self.selected()
        listing = self.listing
        if self.busy or choice is None or listing is None:
            return
        self._show_problem("")
        self.progress.setRange(0, 1000 if choice.size else 0)
        self.progress.setValue(0)
        self.progress.show()
        self.status.setText(f"Getting {choice.filename}…")
        cancel = threading.Event()

        def work() -> None:
            try:
                result = pull(listing, choice, progress=lambda p: emit(self._progressed, p), cancel=cancel)
                # the repo's vision projector comes beside the model; its entry names it (issue 41)
                projector = pull_projector(
                    listing, progress=lambda p: emit(self._progressed, p), cancel=cancel
                )
                if projector is not None:
                    result = replace(result, entry=replace(result.entry, mmproj=str(projector.path)))
            except CancelledError:
                emit(
                    self._failed,
                    "Cancelled: what was downloaded is kept; get the model again to resume.",
                    True,
                )
            except TimeshareError as exc:
                emit(self._failed, str(exc), False)
            except Exception as exc:
                log.exception("getting %s failed", choice.filename)
                emit(self._failed, f"{type(exc).__name__}: {exc}", False)
            else:
                emit(self._done, result)

        self._start(work, "get-model-download")
        self._cancel = cancel

    def _on_progress(self, p: progress.Progress) -> None:
        if not self.busy:
            return  # a late report after cancel or failure
        fraction = p.fraction
        if fraction is not None:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))
        self.status.setText(p.describe())

    def _on_done(self, result: PullResult) -> None:
        self._worker = None
        self.pulled_result = result
        self.progress.setValue(self.progress.maximum())
        entry = result.entry
        text = f"Downloaded and checked {result.path.name}: {entry.architecture}, {entry.quantisation}"
        if self.add_to_config:
            try:
                config, model, added = add.add_to_config(result, self.config_path)
            except (ConfigError, OSError) as exc:
                self._update_buttons()
                self._show_problem(f"The model is in {result.path}, but it was not added: {exc}")
                return
            if added:
                emit(self.config_saved, config)
            # the tray's dialog stays open with the outcome: closing it is the user's "OK"
            self.status.setText(strings.pulled(model.display_name, added, text))
            emit(self.pulled, result)
            self._update_buttons()
            self.cancel_button.setFocus()
            return
        self.status.setText(text)
        emit(self.pulled, result)
        self._update_buttons()
        self.accept()

    def _on_failed(self, message: str, cancelled: bool) -> None:
        self._worker = None
        self.progress.hide()
        self.status.setText("")
        self._show_problem(message)
        self._update_buttons()

    # ---- closing -------------------------------------------------------------------------------

    def _cancel_or_close(self) -> None:
        if self.busy:
            self._cancel.set()
            self.status.setText("Cancelling…")
        else:
            self.reject()

    def done(self, result: int) -> None:
        self._sizes_cancel.set()  # closed (accepted or not): the sizes still coming are not wanted
        super().done(result)

    def reject(self) -> None:
        if self.busy:  # closing the window cancels the download; its partial file stays
            self._cancel.set()
            if self._worker is not None:
                self._worker.join(timeout=5.0)
        super().reject()
