"""Settings says "GPU" only where there is one (issue 43): its labels, tooltips and special texts come
from the config layer's FieldMeta (core/config/schema.py), whose "{GPU words|CPU words}" choices are
made by core/words.py for the build the models run on.

The dialog here is the real one over a real pool whose real worker (SmolLM2) has loaded on this
CPU-only machine (offscreen Qt); the GPU wording is checked on the same snapshot with only the
device kind pretended (the backend a worker reports: "CUDA0" for "CPU").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timeshare.core import words
from timeshare.core.config.meta import described
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, GeneralConfig, ModelConfig

pytestmark = [pytest.mark.slow, pytest.mark.gui]

SMOL = "smollm2-135m-instruct"
#: words that say there is a GPU
GPU_WORDS = ("GPU", "VRAM")


@pytest.fixture(scope="module")
def pool(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from timeshare.core.pool.supervisor import Pool

    root = tmp_path_factory.mktemp("pool")
    arena = root / "arena"
    arena.mkdir(mode=0o700)
    config = Config(
        models=(ModelConfig(id=SMOL, name="SmolLM2", path=str(smollm2_path), n_ctx=512),),
        api=ApiConfig(enabled=False),
        arena=ArenaConfig(vram_budget="one-model"),
    )
    p = Pool(config, arena_dir=arena, log_dir=root / "log", kv_dir=root / "kv")
    p.start()
    p.wait_ready(timeout=240)
    yield p
    p.stop()


@pytest.fixture
def bridge(qtbot: Any, pool: Any) -> Iterator[Any]:
    from timeshare.app.bridge import PoolBridge

    b = PoolBridge(pool)
    yield b
    b.detach()


def shown_texts(root: Any) -> list[str]:
    """Every text ``root`` and its children show or offer on hover: labels, check boxes, group and
    tab titles, table headers and cells, spin boxes' special texts, placeholders, tooltips."""
    from PySide6.QtWidgets import (
        QAbstractButton,
        QAbstractSpinBox,
        QComboBox,
        QGroupBox,
        QLabel,
        QLineEdit,
        QTableWidget,
        QTabWidget,
        QWidget,
    )

    texts = [root.windowTitle()]
    for w in [root, *root.findChildren(QWidget)]:
        texts.append(w.toolTip())
        if isinstance(w, (QLabel, QAbstractButton)):
            texts.append(w.text())
        elif isinstance(w, QGroupBox):
            texts.append(w.title())
        elif isinstance(w, QAbstractSpinBox):
            texts += [w.specialValueText(), w.text()]
        elif isinstance(w, QLineEdit):
            texts += [w.placeholderText(), w.text()]
        elif isinstance(w, QComboBox):
            texts += [w.itemText(i) for i in range(w.count())]
        elif isinstance(w, QTabWidget):
            texts += [w.tabText(i) for i in range(w.count())]
        elif isinstance(w, QTableWidget):
            for col in range(w.columnCount()):
                header = w.horizontalHeaderItem(col)
                texts.append(header.text() if header else "")
                for row in range(w.rowCount()):
                    item = w.item(row, col)
                    texts.append(item.text() if item else "")
    return [t for t in texts if t]


def gpu_texts(texts: list[str]) -> list[str]:
    return [t for t in texts if any(word in t for word in GPU_WORDS)]


def test_on_this_cpu_machine_no_settings_text_says_gpu(
    qtbot: Any, pool: Any, bridge: Any, tmp_path: Path
) -> None:
    from timeshare.app import strings
    from timeshare.app.settings import SettingsDialog

    snapshot = pool.snapshot()
    assert snapshot.model(SMOL).backend == "CPU"  # this machine: the worker loaded on the CPU
    assert not strings.has_gpu(snapshot)
    dialog = SettingsDialog(pool.config, bridge, tmp_path / "config.toml")
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.tabs.setCurrentIndex(dialog.sharing_index)
    dialog.advanced_button.click()  # the Advanced rows shown
    assert dialog.quantum.isVisible()
    texts = shown_texts(dialog)
    assert gpu_texts(texts) == []
    # the Advanced labels are the config layer's, in the CPU's words
    labels = [dialog.advanced_form.labelForField(w).text() for w, _c, _n in dialog.advanced_rows]
    assert labels == [
        "A busy model keeps its turn at least:",
        "A request waits for its turn at most:",
        "Restart the active model that stops answering after:",
        "Folder the models take turns through:",
    ]
    assert dialog.vram_budget.toolTip().startswith("auto: what host memory has free at start")

    # the model dialog opened from Settings (Edit…) says it too
    model = dialog.model_dialog(0)
    qtbot.addWidget(model)
    assert gpu_texts(shown_texts(model)) == []
    assert model.pinned.text() == "Keep its turn once it has it"
    assert model.parallel.specialValueText() == "auto (1 on a CPU)"


def test_with_a_gpu_the_settings_say_gpu(qtbot: Any, pool: Any, bridge: Any, tmp_path: Path) -> None:
    """The same real snapshot, with only the device kind pretended: the backend a worker reports
    ("CUDA0", as a CUDA build's worker does, for this machine's "CPU")."""
    from timeshare.app import strings
    from timeshare.app.settings import SettingsDialog

    real = pool.snapshot()
    pretend_gpu = dataclasses.replace(
        real,
        models=tuple(dataclasses.replace(m, backend="CUDA0") for m in real.models),
        devices=tuple(dataclasses.replace(d, name="CUDA0") for d in real.devices),
    )
    assert strings.has_gpu(pretend_gpu) and not strings.has_gpu(real)
    dialog = SettingsDialog(pool.config, bridge, tmp_path / "config.toml")
    qtbot.addWidget(dialog)
    dialog._refresh_arena(pretend_gpu)  # as the bridge hands a snapshot on
    labels = [dialog.advanced_form.labelForField(w).text() for w, _c, _n in dialog.advanced_rows]
    assert labels == [
        "A busy model keeps the GPU at least:",
        "A request waits for the GPU at most:",
        "Restart a GPU holder that stops answering after:",
        "Folder the models take turns through:",
    ]
    assert dialog.vram_budget.toolTip().startswith("auto: what the GPU has free at start")
    assert dialog.tabs.tabText(dialog.sharing_index) == "Sharing the GPU"
    # and back: the next snapshot of the real (CPU) pool words it for the CPU again
    dialog._refresh_arena(real)
    assert gpu_texts(shown_texts(dialog)) == []

    from timeshare.app.settings_model import ModelDialog

    model = ModelDialog({"id": "m", "path": "/m.gguf"}, set(), None, gpu=strings.has_gpu(pretend_gpu))
    qtbot.addWidget(model)
    assert model.pinned.text() == "Keep the GPU once it has it"
    assert model.parallel.specialValueText() == "auto (4 on a GPU, fewer when the KV cache does not fit)"


# ---- the words themselves (no Qt) ----------------------------------------------------------------

SECTIONS = (GeneralConfig, ArenaConfig, ApiConfig, ModelConfig)
#: fields about the GPU itself (ignored by a CPU build, and not in its Settings)
GPU_FIELDS = {("ModelConfig", "n_gpu_layers"), ("ModelConfig", "device")}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_every_field_is_worded_for_both_builds(gpu: bool) -> None:
    for cls in SECTIONS:
        for d in described(cls):
            meta = d.meta.worded(gpu)
            for text in (meta.label, meta.help, meta.special):
                assert "{" not in text and "}" not in text and "|" not in text, (d.name, text)
                if not gpu and (cls.__name__, d.name) not in GPU_FIELDS:
                    assert not any(w in text for w in GPU_WORDS), (d.name, text)


def test_for_device_makes_each_choice() -> None:
    text = "A request waits for {the GPU|its turn}; {VRAM|Memory} is {on the GPU|in memory}."
    assert words.for_device(text, gpu=True) == "A request waits for the GPU; VRAM is on the GPU."
    assert words.for_device(text, gpu=False) == "A request waits for its turn; Memory is in memory."
    assert words.for_device("no choice here", gpu=False) == "no choice here"
    # the CPU words are the rest of the app's: a request "waits for its turn", a model is "in memory"
    assert words.waited_for(40, gpu=False).endswith(words.for_device("for {the GPU|its turn}", False))
    assert words.state_words("resident", gpu=False) == words.for_device("{on the GPU|in memory}", False)
