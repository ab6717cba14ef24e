"""The chat window: conversations on the left, the transcript (Markdown) and the input on the right.

Send starts the answer through the bridge (``PoolBridge.start_answer``: the GUI thread never waits
for the pool); the answer's own thread feeds an ``AnswerStream`` that only emits signals
(answer_stream.py); everything that touches widgets runs on the GUI thread. Focusing the
input or typing in it pre-wakes the conversation's model (restore ahead of the request) unless the
setting is off.
While the user waits (a load, the GPU, a restore, the prompt being read) a line under the
transcript says for what and for how long. Each conversation keeps its answer settings (system
prompt, temperature, max tokens), edited in the panel the "Answer settings" button opens
(chat_widgets.py, with the input box and the model picker).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QEvent, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QCloseEvent, QDesktopServices, QGuiApplication, QImage, QPixmap
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ..core.sampling import new_conversation
from ..core.state import ModelState, PoolSnapshot
from ..core.wire.protocol import ImagePart
from . import conversation_export, icons, rich_transcript, scheme, strings
from .answer_stream import AnswerStream, StreamListener
from .bridge import PoolBridge
from .chat_widgets import AnswerSettingsPanel, ImageBrowser, InputBox, ModelPicker
from .menu_model import display_state
from .model_problem import ModelProblemBar
from .qt_compat import emit
from .transcript import (
    NO_CONVERSATION,
    answer_line,
    continuation_block,
    failure_line,
    first_run,
    history_blocks,
    image_key,
    live_block,
    live_rate,
    switched_defaults,
)
from .waits import WaitClock, chat_wait_kind, chat_wait_line

if TYPE_CHECKING:
    from ..core.conversations.chat import ChatResult, ChatService, ChatTurn
    from ..core.conversations.store import AnswerStats, Store

log = logging.getLogger(__name__)

PREWAKE_INTERVAL_S = 5.0  # ask a model to wake at most this often while the user types
RENDER_INTERVAL_MS = 50  # streamed text is re-rendered at most 20 times a second
WAIT_TICK_MS = 500  # the waiting line's seconds are updated this often
SEARCH_DELAY_MS = 200  # the conversation list is filtered this long after the last key


class ChatWindow(QMainWindow):
    #: emitted when the user closes the window (the app decides whether to keep running)
    closed = Signal()
    #: (model id) whenever the window asks the pool to wake a model ahead of a request
    prewake_requested = Signal(str)
    #: an answer finished: (conversation id, AnswerStats or None, error message)
    answer_finished = Signal(str, object, str)
    #: a fix offered where a model's problem is shown (Locate file…, Restart, Remove, Unpin): an Action
    action_requested = Signal(object)

    def __init__(
        self,
        bridge: PoolBridge,
        store: Store,
        chat: ChatService,
        prewake_enabled: Callable[[], bool] = lambda: True,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.store = store
        self.chat = chat
        self._prewake_enabled = prewake_enabled
        self._last_prewake: dict[str, float] = {}
        self._stream: AnswerStream | None = None
        self._stream_conversation: str | None = None
        self._partial = ""
        # (conversation id, its model id, Markdown of its stored messages): what render ticks reuse
        self._history: tuple[str, str, str] | None = None  # (conversation, model, its HTML)
        self._history_copies: list[str] = []
        #: a base model's answer streaming now continues this message of the user's (its text)
        self._live_prompt: str | None = None
        #: the first-run suggestions shown (try:N links): (model id, prompt)
        self.suggestions: list[tuple[str, str]] = []
        #: what each copy:N link of the transcript shown copies
        self.copies: list[str] = []
        self._pieces = 0  # pieces of the answer streaming now (its live tokens/s)
        self._got_first_token = False
        #: when set, every answer gets at most this many tokens (the tests keep answers short)
        self.max_tokens: int | None = None
        self._wait_clock = WaitClock()
        self._names: tuple[tuple[str, str], ...] = ()  # (id, name) of the models the transcript names
        self._detached = False
        #: the user message being edited (its id in the store): Send replaces it and what follows
        self.editing: int | None = None
        self.setWindowTitle("Timeshare — Chat")
        self.setWindowIcon(icons.app_icon())
        self.resize(980, 640)
        self._build()
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._render_live)
        self._wait_timer = QTimer(self)  # runs while the user waits: the seconds go on
        self._wait_timer.setInterval(WAIT_TICK_MS)
        self._wait_timer.timeout.connect(self._update_model_state)
        bridge.snapshot_changed.connect(self._on_snapshot)
        scheme.on_change(self.render_transcript)  # the code blocks' colours follow light and dark
        self._on_snapshot(bridge.snapshot)
        self.reload_conversations()

    # ---- layout ------------------------------------------------------------------------------

    def _build(self) -> None:
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(6, 6, 6, 6)
        self.search = QLineEdit()
        self.search.setObjectName("search")
        self.search.setPlaceholderText(strings.SEARCH_PLACEHOLDER)
        self.search.setClearButtonEnabled(True)
        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(SEARCH_DELAY_MS)
        self._search_timer.timeout.connect(lambda: self.reload_conversations())
        self.search.textChanged.connect(lambda _t: self._search_timer.start())
        self.conversations = QListWidget()
        self.conversations.setObjectName("conversations")
        # a long title wraps inside the list (no sideways scroll bar hiding its end)
        self.conversations.setWordWrap(True)
        self.conversations.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conversations.setTextElideMode(Qt.TextElideMode.ElideNone)
        self.conversations.setHorizontalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.conversations.setResizeMode(QListWidget.ResizeMode.Adjust)
        self.conversations.setSpacing(1)
        self.conversations.currentItemChanged.connect(lambda *_: self._on_conversation_changed())
        self.new_button = QPushButton("New")
        self.rename_button = QPushButton("Rename…")
        self.delete_button = QPushButton("Delete")
        self.export_button = QPushButton("Export…")
        self.export_button.setObjectName("export")
        self.export_button.setToolTip(strings.EXPORT_TIP)
        self.new_button.clicked.connect(lambda: self.new_conversation())
        self.rename_button.clicked.connect(self.rename_conversation)
        self.delete_button.clicked.connect(self.delete_conversation)
        self.export_button.clicked.connect(lambda: self.export_conversation())
        buttons = QGridLayout()
        buttons.addWidget(self.new_button, 0, 0)
        buttons.addWidget(self.rename_button, 0, 1)
        buttons.addWidget(self.export_button, 1, 0)
        buttons.addWidget(self.delete_button, 1, 1)
        lv.addWidget(self.search)
        lv.addWidget(self.conversations)
        lv.addLayout(buttons)

        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(6, 6, 6, 6)
        top = QHBoxLayout()
        top.addWidget(QLabel("Model:"))
        self.model_box = ModelPicker()
        self.model_box.setObjectName("model")
        self.model_box.setMinimumWidth(320)
        self.model_box.activated.connect(lambda _i: self._on_model_picked())
        top.addWidget(self.model_box, 1)
        self.model_state = QLabel()
        self.model_state.setObjectName("model_state")
        top.addWidget(self.model_state)
        self.settings_button = QToolButton()
        self.settings_button.setObjectName("answer_settings")
        self.settings_button.setText("Answer settings")
        self.settings_button.setCheckable(True)
        self.settings_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.settings_button.setArrowType(Qt.ArrowType.RightArrow)
        self.settings_button.toggled.connect(self._show_settings)
        top.addWidget(self.settings_button)
        rv.addLayout(top)
        second = QHBoxLayout()
        self.licence = QLabel()
        self.licence.setObjectName("licence")
        self.licence.setStyleSheet("color: gray")
        self.licence.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        second.addWidget(self.licence, 1)
        self.settings_summary = QLabel()  # what the conversation's answers are made with
        self.settings_summary.setObjectName("settings_summary")
        self.settings_summary.setStyleSheet("color: gray")
        second.addWidget(self.settings_summary)
        rv.addLayout(second)
        self.problem_bar = ModelProblemBar()
        self.problem_bar.action_requested.connect(lambda action: emit(self.action_requested, action))
        rv.addWidget(self.problem_bar)
        self.settings_panel = AnswerSettingsPanel(store=self.store)
        self.settings_panel.summary_changed.connect(self._show_summary)
        self.settings_panel.failed.connect(lambda line: self.statusBar().showMessage(line, 10000))
        rv.addWidget(self.settings_panel)

        self.transcript = ImageBrowser()  # a QTextBrowser that shows the messages' images
        self.transcript.setObjectName("transcript")
        self.transcript.setOpenLinks(False)  # copy:N links copy; the others open in the browser
        self.transcript.anchorClicked.connect(self._on_link)
        rv.addWidget(self.transcript, 1)

        # what the user waits for, in words beside the bar (an indeterminate bar shows no text)
        self.progress = QProgressBar()
        self.progress.setObjectName("progress")
        self.progress.setRange(0, 0)  # indeterminate: a restore, the prompt; a load sets a fraction
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(14)
        self.progress.setFixedWidth(140)
        self.wait_label = QLabel()
        self.wait_label.setObjectName("waiting")
        # a long line is cut by the window, not widening it (the whole line is its tooltip)
        self.wait_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.wait_row = QWidget()
        wait_layout = QHBoxLayout(self.wait_row)
        wait_layout.setContentsMargins(0, 0, 0, 0)
        wait_layout.addWidget(self.progress)
        wait_layout.addWidget(self.wait_label, 1)
        self.wait_row.hide()
        rv.addWidget(self.wait_row)

        # shown while a message of the user's is being edited: Send resends it
        self.edit_bar = QWidget()
        self.edit_bar.setObjectName("edit_bar")
        edit_layout = QHBoxLayout(self.edit_bar)
        edit_layout.setContentsMargins(0, 0, 0, 0)
        self.edit_label = QLabel(strings.EDITING)
        self.edit_label.setWordWrap(True)
        edit_layout.addWidget(self.edit_label, 1)
        self.cancel_edit_button = QPushButton("Cancel edit")
        self.cancel_edit_button.setObjectName("cancel_edit")
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        edit_layout.addWidget(self.cancel_edit_button)
        self.edit_bar.hide()
        rv.addWidget(self.edit_bar)

        # images waiting to go with the next message (attached, pasted or dropped; issue 41)
        self.pending_images: list[tuple[bytes, str]] = []
        self.images_bar = QWidget()
        self.images_bar.setObjectName("images_bar")
        images_layout = QHBoxLayout(self.images_bar)
        images_layout.setContentsMargins(0, 0, 0, 0)
        self.images_thumbs = QHBoxLayout()
        images_layout.addLayout(self.images_thumbs)
        self.images_label = QLabel()
        self.images_label.setWordWrap(True)
        images_layout.addWidget(self.images_label, 1)
        self.remove_images_button = QPushButton(strings.REMOVE_IMAGES)
        self.remove_images_button.setObjectName("remove_images")
        self.remove_images_button.clicked.connect(self.clear_images)
        images_layout.addWidget(self.remove_images_button)
        self.images_bar.hide()
        rv.addWidget(self.images_bar)

        bottom = QHBoxLayout()
        self.input = InputBox()
        self.input.setObjectName("input")
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter: new line)")
        self.input.setMaximumHeight(96)
        self.input.submitted.connect(self.send)
        self.input.focused.connect(self.prewake)
        self.input.textChanged.connect(self._on_typing)
        self.input.image.connect(self.attach_image)
        bottom.addWidget(self.input, 1)
        col = QVBoxLayout()
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.retry_button = QPushButton(strings.REGENERATE)
        self.retry_button.setObjectName("retry")
        self.retry_button.setEnabled(False)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stop)
        self.retry_button.clicked.connect(self.regenerate)
        self.attach_button = QPushButton(strings.ATTACH)
        self.attach_button.setObjectName("attach")
        self.attach_button.setToolTip(strings.ATTACH_TIP)
        self.attach_button.clicked.connect(self.choose_images)
        col.addWidget(self.send_button)
        col.addWidget(self.attach_button)
        col.addWidget(self.stop_button)
        col.addWidget(self.retry_button)
        bottom.addLayout(col)
        rv.addLayout(bottom)

        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 3)
        splitter.setSizes([240, 740])
        self.setCentralWidget(splitter)
        self.statusBar()

    def _show_settings(self, shown: bool) -> None:
        self.settings_panel.setVisible(shown)
        self.settings_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    def _show_summary(self, summary: str) -> None:
        self.settings_button.setToolTip(f"This conversation's answers: {summary}")
        self.settings_summary.setText(f"Answers: {summary}")

    # ---- state from the pool -----------------------------------------------------------------

    def _on_snapshot(self, snapshot: PoolSnapshot) -> None:
        current = self.model_box.currentData()
        self.model_box.show_models(snapshot)
        if current is None and self.current_conversation() is not None:
            self._select_model_of_current()
        names = tuple((m.id, m.display_name) for m in snapshot.models)
        if names != self._names:
            # the transcript names each answer's model: models that arrived (the pool's first
            # snapshot can be empty) or were renamed change what it says
            self._names = names
            if self._history is not None:
                self.render_transcript()
        self._update_model_state()

    def _update_model_state(self) -> None:
        snapshot = self.bridge.snapshot
        model_id = self.model_box.currentData()
        status = snapshot.model(model_id) if model_id else None
        self.problem_bar.show_for(status, snapshot)
        self._update_buttons()
        if status is None:
            self.model_state.setText("")
            self.licence.setText("")
            self._show_wait("", None)
            return
        text = display_state(status, strings.has_gpu(snapshot))
        if status.id == snapshot.holder and status.state is not ModelState.RESIDENT:
            text += f" · {strings.holds(strings.has_gpu(snapshot))}"
        self.model_state.setText(text)
        self.licence.setText(f"Licence: {status.licence}" if status.licence else "")
        self.licence.setToolTip(self.licence.text())
        # the wait of this window's answer; the model's own (a load, a wake) when none streams
        answering = (
            self._stream is not None
            and not self._got_first_token
            and self._stream_conversation == self.current_conversation()
        )
        kind = chat_wait_kind(status, snapshot.holder, answering=answering)
        seconds = self._wait_clock.mark(status.id, kind, time.monotonic())
        self._wait_clock.keep([status.id])
        stage, fraction = self.bridge.loading.get(status.id, ("", 0.0))
        line = chat_wait_line(status, snapshot.holder, answering=answering, seconds=seconds, stage=stage)
        line = strings.for_people(line, snapshot)  # display names; "memory" without a GPU
        self._show_wait(line, fraction if kind == "loading" else None)

    def _show_wait(self, line: str, fraction: float | None) -> None:
        """Show what the user waits for (or hide the line); ``fraction`` of a load makes the bar
        determinate."""
        if not line:
            self.wait_row.hide()
            self._wait_timer.stop()
            return
        if fraction:
            self.progress.setRange(0, 100)
            self.progress.setValue(round(fraction * 100))
        else:
            self.progress.setRange(0, 0)
        self.wait_label.setText(line)
        self.wait_label.setToolTip(line)
        self.wait_row.show()
        if not self._wait_timer.isActive():
            self._wait_timer.start()

    # ---- conversations -----------------------------------------------------------------------

    def current_conversation(self) -> str | None:
        item = self.conversations.currentItem()
        return str(item.data(Qt.ItemDataRole.UserRole)) if item is not None else None

    def reload_conversations(self, select: str | None = None) -> None:
        select = select or self.current_conversation()
        self.conversations.blockSignals(True)
        self.conversations.clear()
        query = self.search.text()
        for conv in self.store.list_conversations():
            if query.strip() and not conversation_export.matches(query, conv, self.store.messages(conv.id)):
                continue
            item = QListWidgetItem(conv.title or "New conversation")
            item.setToolTip(conv.title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            self.conversations.addItem(item)
            if conv.id == select:
                self.conversations.setCurrentItem(item)
        if self.conversations.currentItem() is None and self.conversations.count():
            self.conversations.setCurrentRow(0)
        self.conversations.blockSignals(False)
        self._on_conversation_changed()

    def _on_conversation_changed(self) -> None:
        self.settings_panel.save_typed()  # a system prompt still being typed belongs to the one left
        conv_id = self.current_conversation()
        if conv_id != self.settings_panel.conversation_id:
            self.statusBar().clearMessage()  # the last answer's line belongs to the one left
        if self.editing is not None and not self._is_message_of(self.editing, conv_id):
            self.cancel_edit()  # the message being edited belongs to the one left
        self.settings_panel.load(self.store.get(conv_id) if conv_id is not None else None)
        self._select_model_of_current()
        self.render_transcript()
        self._update_buttons()
        if self.isVisible() and self.current_conversation() is not None:
            self.prewake()  # focusing a conversation: its model is probably next

    def _select_model_of_current(self) -> None:
        conv_id = self.current_conversation()
        if conv_id is None:
            return
        model_id = self.store.get(conv_id).model_id
        index = self.model_box.findData(model_id)
        if index >= 0:
            self.model_box.setCurrentIndex(index)
        self._update_model_state()

    def new_conversation(self, model_id: str | None = None) -> str | None:
        model_id = model_id or self.model_box.currentData()
        if not model_id:
            self.statusBar().showMessage("Add a model first (tray menu → Add model…).", 8000)
            return None
        base = strings.is_base_model(self.bridge.snapshot.model(model_id))
        conv = self.store.create_conversation(model_id, answers=new_conversation(base))
        panel = self.settings_panel
        if panel.conversation_id is None and panel.pending:  # settings chosen before there was one
            panel.conversation_id = conv.id
            panel.pending = False
            panel.save()
        self.reload_conversations(select=conv.id)
        self.input.setFocus()
        return str(conv.id)

    def open_for_model(self, model_id: str) -> None:
        """Chat… from the tray: a conversation with this model (the current one if it uses it)."""
        conv_id = self.current_conversation()
        if conv_id is None or self.store.get(conv_id).model_id != model_id:
            existing = [c for c in self.store.list_conversations(model_id) if c.message_count == 0]
            if existing:
                self.reload_conversations(select=existing[0].id)
            else:
                self.new_conversation(model_id)
        self.show_and_raise()

    def rename_conversation(self) -> None:
        conv_id = self.current_conversation()
        if conv_id is None:
            return
        title, ok = QInputDialog.getText(
            self, "Rename conversation", "Title:", text=self.store.get(conv_id).title
        )
        if ok and title.strip():
            self.store.rename(conv_id, title.strip())
            self.reload_conversations(select=conv_id)

    def delete_conversation(self) -> None:
        conv_id = self.current_conversation()
        if conv_id is None:
            return
        if conv_id == self._stream_conversation:
            self.statusBar().showMessage("Stop the answer first, then delete the conversation.", 8000)
            return
        title = self.store.get(conv_id).title or "this conversation"
        answer = QMessageBox.question(self, "Delete conversation", f"Delete “{title}” and all its messages?")
        if answer == QMessageBox.StandardButton.Yes:
            self.chat.delete(conv_id)  # its KV files too
            self.reload_conversations()

    def _on_model_picked(self) -> None:
        model_id = self.model_box.currentData()
        conv_id = self.current_conversation()
        if conv_id is not None and model_id and conv_id != self._stream_conversation:
            conv = self.store.set_model(conv_id, model_id)
            # a conversation still on one kind of model's defaults gets the other kind's
            base = strings.is_base_model(self.bridge.snapshot.model(model_id))
            answers = switched_defaults(conv, base)
            if answers is not None:
                conv = self.store.set_options(
                    conv_id,
                    temperature=answers.temperature,
                    max_tokens=answers.max_tokens or 0,
                    repeat_penalty=answers.repeat_penalty,
                )
                self.settings_panel.load(conv)
        self._update_model_state()
        self.prewake()

    # ---- transcript --------------------------------------------------------------------------

    def render_transcript(self) -> None:
        """Rebuild the transcript from the store: the conversation changed, an answer began or ended."""
        if self._detached:
            return
        conv_id = self.current_conversation()
        query = self.search.text().strip()
        if conv_id is None and query:
            self._history = None
            self.copies = []
            self.transcript.setMarkdown(strings.no_match(query))
            return
        messages = self.store.messages(conv_id) if conv_id is not None else []
        if conv_id is None or (not messages and conv_id != self._stream_conversation):
            self._show_first_run(conv_id)
            return
        conv_model = self.store.get(conv_id).model_id
        live = conv_id == self._stream_conversation
        if live and messages and messages[-1].role == "assistant" and not messages[-1].complete:
            messages.pop()  # the periodically saved partial answer: the live text replaces it
        gpu = strings.has_gpu(self.bridge.snapshot)
        for message in messages:  # the thumbnails the transcript shows
            for image in message.images:
                self.transcript.add_image(image_key(image.data), image.data, rich_transcript.THUMBNAIL_PX)
        blocks = history_blocks(messages, conv_model, self._who, gpu=gpu, base=self._is_base)
        self._live_prompt = None
        if live and self._is_base(conv_model) and messages and messages[-1].role == "user":
            blocks.pop()  # the text being continued: the live block shows it, continued
            self._live_prompt = messages[-1].content
        copies: list[str] = []
        dark = scheme.is_dark()
        # the history's HTML is made once per change (Pygments included); a live tick adds only its answer
        shown = [rich_transcript.render_block(b, dark, copies) for b in blocks]
        self._history = (conv_id, conv_model, "<hr/>".join(shown))
        self._history_copies = copies
        self._show_transcript()

    def _render_live(self) -> None:
        """A render tick while an answer streams: the cached history and the live text, no store reads."""
        if self._detached:
            return
        if self._history is None or self._history[0] != self.current_conversation():
            self.render_transcript()
            return
        self._show_transcript()

    def _show_transcript(self) -> None:
        assert self._history is not None
        conv_id, conv_model, text = self._history
        self.copies = list(self._history_copies)
        if conv_id == self._stream_conversation:
            if self._live_prompt is not None:
                who = self._who(conv_model)
                rate = self.live_rate()
                live = continuation_block(who, self._live_prompt, self._partial, rate=rate)
            else:
                live = live_block(self._who(conv_model), self._partial, self.live_rate())
            answer = rich_transcript.render_block(live, scheme.is_dark(), self.copies)
            text = f"{text}<hr/>{answer}" if text else answer
        self.transcript.setHtml(text)
        bar = self.transcript.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _show_first_run(self, conv_id: str | None) -> None:
        """No message yet: a prompt to try for each model (one that answers, one that continues
        a text), and what switching between them shows."""
        self._history = None
        self.copies = []
        snapshot = self.bridge.snapshot
        models = [(m.id, m.display_name, strings.is_base_model(m)) for m in snapshot.models]
        if conv_id is not None:  # an empty conversation: its model first
            conv_model = self.store.get(conv_id).model_id
            models.sort(key=lambda m: m[0] != conv_model)
        text, self.suggestions = first_run(models, gpu=strings.has_gpu(snapshot))
        self.transcript.setHtml(rich_transcript.markdown_html(text) if models else "")
        if not models:
            self.transcript.setMarkdown(NO_CONVERSATION)

    def try_suggestion(self, index: int) -> None:
        """A first-run suggestion clicked: its prompt sent to its model (in the empty conversation
        shown if it uses that model, else in a new one)."""
        if not 0 <= index < len(self.suggestions) or self._stream is not None:
            return
        model_id, prompt = self.suggestions[index]
        conv_id = self.current_conversation()
        reuse = conv_id is not None and not self.store.messages(conv_id)
        if not (reuse and conv_id is not None and self.store.get(conv_id).model_id == model_id):
            self.new_conversation(model_id)
        self.input.setPlainText(prompt)
        self.send()

    def _is_base(self, model_id: str) -> bool:
        """A base model (no chat template): its answers continue the text."""
        return strings.is_base_model(self.bridge.snapshot.model(model_id))

    def live_rate(self) -> str:
        """ "42 tokens · 18.3 tokens/s" while an answer streams ("" before its first token)."""
        stream = self._stream
        if stream is None or stream.first_at is None:
            return ""
        return live_rate(self._pieces, time.monotonic() - stream.first_at)

    def _on_link(self, url: QUrl) -> None:
        """A copy:N link puts text N on the clipboard, an edit:ID link edits the user's message
        ID; any other link opens in the browser."""
        if url.scheme() == "copy":
            index = int(url.path()) if url.path().isdigit() else -1
            if 0 <= index < len(self.copies):
                QGuiApplication.clipboard().setText(self.copies[index])
                self.statusBar().showMessage(strings.COPIED, 3000)
            return
        if url.scheme() == "try":
            if url.path().isdigit():
                self.try_suggestion(int(url.path()))
            return
        if url.scheme() == "edit":
            if url.path().isdigit():
                self.edit_message(int(url.path()))
            return
        QDesktopServices.openUrl(url)

    # ---- edit and resend ---------------------------------------------------------------------

    def _is_message_of(self, message_id: int, conv_id: str | None) -> bool:
        return conv_id is not None and any(
            m.id == message_id and m.role == "user" for m in self.store.messages(conv_id)
        )

    def edit_message(self, message_id: int) -> None:
        """Put one of the user's messages back in the input box: Send replaces it (and every
        message after it) with what the box then holds, and the model answers that."""
        conv_id = self.current_conversation()
        if not self._is_message_of(message_id, conv_id):
            return
        if self._stream is not None and self._stream_conversation == conv_id:
            self.statusBar().showMessage(strings.EDIT_WHILE_ANSWERING, 8000)
            return
        self.editing = message_id
        self.input.setPlainText(self.store.message(message_id).content)
        self.input.setFocus()
        self.edit_bar.show()
        self.send_button.setText(strings.RESEND)

    def cancel_edit(self) -> None:
        """Leave editing: the conversation stays as it was; the box is emptied."""
        if self.editing is None:
            return
        self.editing = None
        self.edit_bar.hide()
        self.send_button.setText("Send")
        self.input.clear()

    # ---- export ------------------------------------------------------------------------------

    def export_conversation(self, path: Path | None = None) -> Path | None:
        """Write the current conversation to a Markdown or JSON file (asked for when ``path`` is
        None); returns the file written, None when nothing was."""
        conv_id = self.current_conversation()
        if conv_id is None:
            self.statusBar().showMessage(strings.NOTHING_TO_EXPORT, 8000)
            return None
        conv = self.store.get(conv_id)
        if path is None:
            chosen, kind = QFileDialog.getSaveFileName(
                self,
                "Export conversation",
                str(Path.home() / conversation_export.file_name(conv, ".md")),
                ";;".join(conversation_export.FORMATS),
            )
            if not chosen:
                return None
            path = Path(chosen)
            if not path.suffix:
                path = path.with_suffix(conversation_export.FORMATS.get(kind, ".md"))
        try:
            written = conversation_export.export(path, conv, self.store.messages(conv_id), self._who)
        except OSError as exc:
            QMessageBox.warning(self, "Export conversation", strings.export_failed(path, exc))
            return None
        self.statusBar().showMessage(strings.exported(written), 10000)
        return written

    def _who(self, model_id: str) -> str:
        status = self.bridge.snapshot.model(model_id)
        return status.display_name if status else model_id

    # ---- sending -----------------------------------------------------------------------------

    def _cannot_answer(self) -> str:
        """Why the picked model cannot answer (it FAILED: Send is off for it), else ""."""
        model_id = self.model_box.currentData()
        status = self.bridge.snapshot.model(model_id) if model_id else None
        if status is None or status.state is not ModelState.FAILED:
            return ""
        return strings.SEND_DISABLED.format(name=status.display_name)

    def _update_buttons(self) -> None:
        streaming = self._stream is not None
        blocked = self._cannot_answer()
        self.send_button.setEnabled(not streaming and not blocked)
        self.send_button.setToolTip(blocked)
        self.stop_button.setEnabled(streaming)
        kind = "" if self._detached else self.retry_kind(self.current_conversation())
        self.retry_button.setText(strings.RETRY if kind == "retry" else strings.REGENERATE)
        self.retry_button.setToolTip(strings.RETRY_TIP if kind == "retry" else strings.REGENERATE_TIP)
        self.retry_button.setEnabled(bool(kind) and not streaming and not blocked)

    def _unanswered(self, conv_id: str) -> bool:
        messages = self.store.messages(conv_id)
        return bool(messages) and messages[-1].role == "user"

    def retry_kind(self, conv_id: str | None) -> str:
        """What the Retry/Regenerate button does for this conversation: "retry" (its last
        message has no finished answer: a crash, a Stop, an error, a refusal), "regenerate"
        (another answer to its last message) or "" (nothing to answer yet)."""
        if conv_id is None:
            return ""
        messages = [m for m in self.store.messages(conv_id) if m.role != "system"]
        if not any(m.role == "user" for m in messages):
            return ""
        last = messages[-1]
        if last.role == "user" or not last.complete:
            return "retry"
        if last.stats is not None and last.stats.finish_reason in ("cancelled", "error"):
            return "retry"
        return "regenerate"

    def regenerate(self) -> None:
        """Answer the conversation's last message again (the answer there, if any, is replaced):
        Retry after a crash, a Stop or an error; Regenerate for another answer."""
        if self._stream is None and self.retry_kind(self.current_conversation()):
            self._start_answer("", with_images=False)

    # ---- images (issue 41) --------------------------------------------------------------------

    def choose_images(self) -> None:
        paths, _filter = QFileDialog.getOpenFileNames(self, strings.ATTACH, "", strings.ATTACH_FILTER)
        for name in paths:
            try:
                self.attach_image(Path(name).read_bytes(), Path(name).name)
            except OSError as exc:
                self.statusBar().showMessage(f"{name}: {exc.strerror}", 10000)

    def attach_image(self, data: bytes, name: str) -> None:
        """An image goes with the next message (the model's server checks it again)."""
        if QImage.fromData(data).isNull():
            self.statusBar().showMessage(strings.NOT_AN_IMAGE.format(name=name), 10000)
            return
        self.pending_images.append((data, name))
        self._show_pending_images()

    def clear_images(self) -> None:
        self.pending_images = []
        self._show_pending_images()

    def _show_pending_images(self) -> None:
        while self.images_thumbs.count():
            item = self.images_thumbs.takeAt(0)
            widget = item.widget() if item is not None else None
            if widget is not None:
                widget.deleteLater()
        for data, name in self.pending_images:
            thumb = QLabel()
            thumb.setToolTip(name)
            thumb.setPixmap(QPixmap.fromImage(QImage.fromData(data)).scaledToHeight(48))
            self.images_thumbs.addWidget(thumb)
        self.images_label.setText(strings.images_attached([n for _d, n in self.pending_images]))
        self.images_bar.setVisible(bool(self.pending_images))
        self._update_buttons()

    def send(self) -> None:
        """Send the typed message (and the images attached); with an empty box and no images,
        answer an unanswered last message again."""
        text = self.input.toPlainText().strip()
        if self._stream is not None:
            return
        conv_id = self.current_conversation()
        if self.editing is not None and not text:
            self.statusBar().showMessage(strings.EDIT_EMPTY, 8000)
            return
        if not text and not self.pending_images and (conv_id is None or not self._unanswered(conv_id)):
            return
        self._start_answer(text)

    def _start_answer(self, text: str, with_images: bool = True) -> None:
        """Send ``text`` (and the images attached, ``with_images``), or with "" and no images answer
        the conversation's last message again."""
        conv_id = self.current_conversation()
        blocked = self._cannot_answer()
        if blocked:  # nothing is saved for a model that cannot answer; the bar says what to do
            self.statusBar().showMessage(blocked, 20000)
            return
        if conv_id is None:
            conv_id = self.new_conversation()
            if conv_id is None:
                return
        self.settings_panel.save_typed()  # the system prompt just typed counts for this answer
        model_id = self.store.get(conv_id).model_id
        # the images go before the text, as Ollama places a message's images
        images = tuple(ImagePart(data, 0) for data, _name in self.pending_images) if with_images else ()
        status = self.bridge.snapshot.model(model_id)
        if images and status is not None and not status.vision:
            self.statusBar().showMessage(strings.no_vision(self._who(model_id)), 20000)
            return
        continuation = self._is_base(model_id)  # a base model continues the text
        prewoken = model_id in self._last_prewake  # the window restored it while the user typed
        # the conversation's settings apply (ChatService reads them); the tests' cap wins
        sampling = {"max_tokens": self.max_tokens} if self.max_tokens is not None else {}
        chat = self.chat
        store = self.store
        # an edited message: it and everything after it give way to the new text
        replaced = self.editing if text and self._is_message_of(self.editing or -1, conv_id) else None
        if replaced is not None:
            self.editing = None
            self.edit_bar.hide()
            self.send_button.setText("Send")

        def start(listener: StreamListener) -> ChatTurn:  # on the bridge's thread
            if replaced is not None:
                for message in store.messages(conv_id):
                    if message.id >= replaced:
                        store.delete_message(message.id)
            if text or images:
                return chat.send(
                    conv_id,
                    text,
                    prewoken=prewoken,
                    listener=listener,
                    continuation=continuation,
                    images=images,
                    **sampling,
                )
            return chat.regenerate(
                conv_id, prewoken=prewoken, listener=listener, continuation=continuation, **sampling
            )

        self._partial = ""
        self._pieces = 0
        self._got_first_token = False
        self._stream_conversation = conv_id
        stream = AnswerStream()
        stream.started.connect(lambda: self._on_started(stream, conv_id, model_id))
        stream.refused.connect(lambda error: self._on_refused(stream, conv_id, text, error))
        stream.piece.connect(self._on_piece)
        stream.first_token.connect(self._on_first_token)
        stream.finished.connect(self._on_finished)
        self._stream = stream
        self.statusBar().clearMessage()  # the previous answer's line: this one's comes at its end
        self._update_buttons()
        self._update_model_state()
        # the pool may be busy (another model loading, a switch): the GUI thread never waits for it
        self.bridge.start_answer(stream, start)

    def _on_started(self, stream: AnswerStream, conv_id: str, model_id: str) -> None:
        """The answer's turn exists: the user's message is saved (and the conversation titled)."""
        self.input.clear()
        self.clear_images()  # they went with it
        self.reload_conversations(select=conv_id)  # ChatService titles new conversations
        self._last_prewake.pop(model_id, None)
        self.render_transcript()

    def _on_refused(self, stream: AnswerStream, conv_id: str, text: str, error: BaseException) -> None:
        if stream is self._stream:
            self._stream = None
            self._stream_conversation = None
        self._update_buttons()
        self._update_model_state()
        # ChatService keeps a user message it saved; the box keeps the text only if it was not
        if text and self._unanswered(conv_id) and self.store.messages(conv_id)[-1].content == text:
            self.input.clear()
        self.render_transcript()
        said = strings.for_people(str(error), self.bridge.snapshot)  # no CLI or HTTP advice
        self.statusBar().showMessage(f"{said} — press Retry to try again", 20000)
        QMessageBox.warning(self, "Could not send", said)

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self.statusBar().showMessage("Stopping…", 3000)

    def _on_first_token(self) -> None:
        self._got_first_token = True
        self._update_model_state()

    def _on_piece(self, text: str) -> None:
        self._partial += text
        self._pieces += 1
        if self._stream_conversation == self.current_conversation() and not self._render_timer.isActive():
            self._render_timer.start()

    def _on_finished(self, result: ChatResult | None, error: BaseException | None) -> None:
        conv_id = self._stream_conversation
        self._stream = None
        self._stream_conversation = None
        stats: AnswerStats | None = None
        message = ""
        if error is not None:
            message = str(error) or type(error).__name__
            log.warning("answer failed: %s", message)
            self.statusBar().showMessage(failure_line(message), 20000)
        elif result is not None:
            stats = result.stats
            if conv_id == self.current_conversation():  # not over another conversation
                gpu = strings.has_gpu(self.bridge.snapshot)
                self.statusBar().showMessage(answer_line(stats, gpu=gpu), 15000)
        self._partial = ""
        self._pieces = 0
        self._got_first_token = False
        self._update_buttons()
        self._update_model_state()
        self.render_transcript()
        if conv_id is not None:
            emit(self.answer_finished, conv_id, stats, message)

    # ---- pre-wake ----------------------------------------------------------------------------

    def _on_typing(self) -> None:
        if self.input.toPlainText():
            self.prewake()

    def prewake(self) -> None:
        """Restore the model of this conversation ahead of the request, while the user types."""
        if not self._prewake_enabled():
            return
        model_id = self.model_box.currentData()
        snapshot = self.bridge.snapshot
        status = snapshot.model(model_id) if model_id else None
        if status is None or snapshot.holder == model_id:
            return
        if status.state not in (ModelState.RELEASED, ModelState.SLEEPING):
            return
        now = time.monotonic()
        if now - self._last_prewake.get(model_id, -1e9) < PREWAKE_INTERVAL_S:
            return
        self._last_prewake[model_id] = now
        log.info("pre-waking %s (the user is typing)", model_id)
        self.bridge.wake(model_id)
        emit(self.prewake_requested, model_id)

    # ---- window ------------------------------------------------------------------------------

    def show_and_raise(self) -> None:
        self.show()
        self.setWindowState(self.windowState() & ~Qt.WindowState.WindowMinimized)
        if QGuiApplication.platformName() not in ("offscreen", "minimal"):  # no window manager there
            self.raise_()
            self.activateWindow()

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QEvent.Type.ActivationChange and self.isActiveWindow() and self.input.hasFocus():
            self.prewake()

    def detach(self) -> None:
        """Stop reacting to the pool and to timers (before the store closes)."""
        self._render_timer.stop()
        self._wait_timer.stop()
        self.settings_panel.detach()
        if self._stream is not None:
            self._stream.cancel()
        with contextlib.suppress(RuntimeError, TypeError):
            self.bridge.snapshot_changed.disconnect(self._on_snapshot)
        self._detached = True

    def closeEvent(self, event: QCloseEvent) -> None:
        emit(self.closed)
        super().closeEvent(event)
