"""The chat window's widgets that keep their own state: the input box (Enter sends, focus is
reported for the pre-wake), the model picker (each model labelled with its state) and the
answer-settings panel (a conversation's system prompt, temperature and longest answer, shown and
saved to the store). chat_window.py places and wires them; it keeps the conversations, the
transcript, the answer's stream and the waits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QBuffer, QIODevice, QMimeData, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QFocusEvent, QImage, QKeyEvent, QPixmap
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QTextBrowser,
    QWidget,
)

from ..core.conversations.store import DEFAULT_MAX_TOKENS, DEFAULT_REPEAT_PENALTY, DEFAULT_TEMPERATURE
from ..core.errors import TimeshareError
from ..core.state import ModelState
from . import strings
from .menu_model import display_state
from .qt_compat import emit
from .transcript import settings_summary

if TYPE_CHECKING:
    from ..core.conversations.store import Conversation, Store
    from ..core.state import PoolSnapshot

log = logging.getLogger(__name__)

SAVE_PROMPT_MS = 400  # a typed system prompt is saved this long after the last key
MAX_TOKENS_LIMIT = 32768  # the most the max-tokens box allows (the model's context limits it anyway)


class InputBox(QPlainTextEdit):
    """Enter sends, Shift+Enter makes a new line; focus is reported (pre-wake). An image pasted
    or dropped (a picture, or an image file) is reported as ``image`` (its file's bytes, PNG for a
    pasted picture) instead of being inserted as text."""

    submitted = Signal()
    focused = Signal()
    image = Signal(bytes, str)  # the image file's bytes, and a name for it

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return bool(image_files(source)) or source.hasImage() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        files = image_files(source)
        if files:
            for path in files:
                try:
                    emit(self.image, path.read_bytes(), path.name)
                except OSError as exc:
                    log.warning("could not read %s: %s", path, exc)
            return
        if source.hasImage():
            data = png_bytes(source.imageData())
            if data:
                emit(self.image, data, "pasted image")
            return
        super().insertFromMimeData(source)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            emit(self.submitted)
            return
        super().keyPressEvent(event)

    def focusInEvent(self, event: QFocusEvent) -> None:
        super().focusInEvent(event)
        emit(self.focused)


#: the image files the chat window takes (their suffixes)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")


def image_files(source: QMimeData) -> list[Path]:
    """The local image files a paste or drop names."""
    if not source.hasUrls():
        return []
    paths = [Path(u.toLocalFile()) for u in source.urls() if u.isLocalFile()]
    return [p for p in paths if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]


def png_bytes(image: object) -> bytes:
    """A pasted picture (a QImage, or a QPixmap) as PNG bytes ("" when it is none)."""
    if isinstance(image, QPixmap):
        image = image.toImage()
    if not isinstance(image, QImage) or image.isNull():
        return b""
    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    # (a QIODevice: the stubs name only paths)
    image.save(buf, "PNG")  # type: ignore[call-overload]
    return bytes(buf.data().data())


class ImageBrowser(QTextBrowser):
    """The transcript: a QTextBrowser that shows the messages' images (``image:KEY`` sources,
    registered with :meth:`add_image`, kept small)."""

    def __init__(self) -> None:
        super().__init__()
        self._images: dict[str, QImage] = {}

    def add_image(self, key: str, data: bytes, height: int) -> None:
        if key in self._images:
            return
        image = QImage.fromData(data)
        if not image.isNull() and image.height() > height:
            image = image.scaledToHeight(height, Qt.TransformationMode.SmoothTransformation)
        self._images[key] = image

    def loadResource(self, kind: int, name: QUrl | str) -> object:
        url = QUrl(name) if isinstance(name, str) else name
        if url.scheme() == "image" and url.path() in self._images:
            return self._images[url.path()]
        return super().loadResource(kind, name)


class ModelPicker(QComboBox):
    """The models to chat with, each labelled with its state (and "holds the GPU" on the holder)."""

    def show_models(self, snapshot: PoolSnapshot) -> None:
        """Relabel the models in place (an open popup stays open) or, when they changed, refill
        the list and keep the chosen model chosen; no signal is emitted either way."""
        current = self.currentData()
        ids = [m.id for m in snapshot.models]
        same_models = ids == [self.itemData(i) for i in range(self.count())]
        self.blockSignals(True)
        if not same_models:
            self.clear()
        for index, m in enumerate(snapshot.models):
            label = f"{m.display_name} — {display_state(m, strings.has_gpu(snapshot))}"
            if m.id == snapshot.holder and m.state is not ModelState.RESIDENT:
                label += f", {strings.holds(strings.has_gpu(snapshot))}"
            if same_models:  # relabel in place: an open popup stays open
                self.setItemText(index, label)
            else:
                self.addItem(label, m.id)
            tip = f"{m.path}\nLicence: {m.licence}" if m.licence else m.path
            self.setItemData(index, tip, Qt.ItemDataRole.ToolTipRole)
        if not same_models and current is not None:
            index = self.findData(current)
            if index >= 0:
                self.setCurrentIndex(index)
        self.blockSignals(False)


class AnswerSettingsPanel(QWidget):
    """The current conversation's answer settings (hidden until "Answer settings" is pressed).

    ``load`` shows a conversation's values (nothing is saved by doing so); an edit is saved to that
    conversation: the numbers at once, a typed system prompt ``SAVE_PROMPT_MS`` after the last key.
    """

    #: the settings shown are now these (``settings_summary``'s words)
    summary_changed = Signal(str)
    #: saving failed: the line for the status bar
    failed = Signal(str)

    def __init__(self, store: Store, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        #: the conversation whose settings the panel shows (None: kept for the first one made)
        self.conversation_id: str | None = None
        #: the user changed the settings while there was no conversation: the first one gets them
        self.pending = False
        self.detached = False
        self.setObjectName("answer_settings_panel")
        self._prompt_timer = QTimer(self)
        self._prompt_timer.setSingleShot(True)
        self._prompt_timer.setInterval(SAVE_PROMPT_MS)
        self._prompt_timer.timeout.connect(self.save)
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setObjectName("system_prompt")
        self.system_prompt.setPlaceholderText("none — e.g. “Answer in one short paragraph.”")
        self.system_prompt.setMaximumHeight(60)
        self.system_prompt.textChanged.connect(lambda: self._prompt_timer.start())
        self.temperature = QDoubleSpinBox()
        self.temperature.setObjectName("temperature")
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setDecimals(2)
        self.temperature.setSpecialValueText(strings.GREEDY)
        self.temperature.setToolTip(strings.TEMPERATURE_TIP)
        self.temperature.setValue(DEFAULT_TEMPERATURE)
        self.temperature.valueChanged.connect(lambda _v: self.save())
        self.max_tokens_box = QSpinBox()
        self.max_tokens_box.setObjectName("max_tokens")
        self.max_tokens_box.setRange(0, MAX_TOKENS_LIMIT)
        self.max_tokens_box.setSuffix(" tokens")
        self.max_tokens_box.setSpecialValueText("no limit")  # 0: until the answer ends
        self.max_tokens_box.setValue(DEFAULT_MAX_TOKENS or 0)
        self.max_tokens_box.setToolTip(
            "An answer stops after this many tokens (about ¾ of a word each); "
            "no limit: when the model ends it or the context is full"
        )
        self.max_tokens_box.valueChanged.connect(lambda _v: self.save())
        self.repeat_box = QDoubleSpinBox()
        self.repeat_box.setObjectName("repeat_penalty")
        self.repeat_box.setRange(1.0, 2.0)
        self.repeat_box.setSingleStep(0.1)
        self.repeat_box.setDecimals(2)
        self.repeat_box.setSpecialValueText("off")  # 1.0: no penalty
        self.repeat_box.setToolTip(strings.REPETITION_GUARD_TIP)
        self.repeat_box.setValue(DEFAULT_REPEAT_PENALTY)
        self.repeat_box.valueChanged.connect(lambda _v: self.save())
        self.greedy_note = QLabel(strings.GREEDY_MEANS)
        self.greedy_note.setObjectName("greedy_note")
        self.greedy_note.setWordWrap(True)
        self.greedy_note.setStyleSheet("color: gray")
        self.temperature.valueChanged.connect(lambda v: self.greedy_note.setVisible(v == 0))
        numbers = QHBoxLayout()
        numbers.addWidget(self.temperature)
        numbers.addWidget(QLabel("Longest answer:"))
        numbers.addWidget(self.max_tokens_box)
        numbers.addWidget(QLabel("Repetition guard:"))
        numbers.addWidget(self.repeat_box)
        numbers.addStretch(1)
        form.addRow("System prompt:", self.system_prompt)
        form.addRow("Temperature:", numbers)
        form.addRow(self.greedy_note)
        note = QLabel("Kept with the conversation; used from its next answer on.")
        note.setStyleSheet("color: gray")
        form.addRow(note)
        self.hide()

    def load(self, conversation: Conversation | None) -> None:
        """Show a conversation's settings in the panel (nothing is saved by doing so). With no
        conversation the panel keeps what it shows: the first conversation made gets it."""
        self._prompt_timer.stop()
        self.conversation_id = conversation.id if conversation is not None else None
        if conversation is None:
            return
        boxes = (self.system_prompt, self.temperature, self.max_tokens_box, self.repeat_box)
        for box in boxes:
            box.blockSignals(True)
        self.system_prompt.setPlainText(conversation.system_prompt)
        self.temperature.setValue(conversation.temperature)
        self.max_tokens_box.setValue(conversation.max_tokens or 0)
        self.repeat_box.setValue(conversation.repeat_penalty)
        for box in boxes:
            box.blockSignals(False)
        self.greedy_note.setVisible(conversation.temperature == 0)
        emit(self.summary_changed, settings_summary(conversation))

    def save(self) -> None:
        """Save the panel's values to the conversation they belong to."""
        self._prompt_timer.stop()
        conv_id = self.conversation_id
        if conv_id is None:
            self.pending = True  # no conversation yet: the panel keeps the values for the first one
            return
        if self.detached:
            return
        try:
            conversation = self.store.set_options(
                conv_id,
                system_prompt=self.system_prompt.toPlainText().strip(),
                temperature=round(self.temperature.value(), 2),
                max_tokens=self.max_tokens_box.value(),
                repeat_penalty=round(self.repeat_box.value(), 2),
            )
        except (TimeshareError, ValueError) as e:
            emit(self.failed, f"Could not save the answer settings: {e}")
            return
        emit(self.summary_changed, settings_summary(conversation))

    def save_typed(self) -> None:
        """Save a system prompt still being typed now (it belongs to the conversation shown)."""
        if self._prompt_timer.isActive():
            self.save()

    def detach(self) -> None:
        """Save what is being typed, then save nothing more (before the store closes)."""
        self.save_typed()
        self.detached = True
