"""Screenshots without a desktop: Qt's offscreen platform and each window's own grab (no Xvfb, no
tray host). The real app with the demo models: the first-run suggestions (chat-first-run.png), the
base model's suggestion clicked and its text continued (chat-continuation.png), Settings → Sharing
the GPU once both have loaded (settings-sharing.png), then SmolLM2 is asked for a Python function,
its answer streams in, and the chat window is saved as chat-code.png (light), with the message
being edited and the list searched (chat-edit-search.png), and chat-code-dark.png
(TIMESHARE_COLOR_SCHEME=dark and a dark palette, as a dark desktop gives), all in docs/screenshots/.

Usage: .venv/bin/python scripts/screenshots_offscreen.py [OUT_DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
WORK = tempfile.mkdtemp(prefix="timeshare-shot-")
os.environ["TIMESHARE_HOME"] = WORK
os.environ["TIMESHARE_VRAM_BUDGET"] = "one-model"

from PySide6.QtCore import QEventLoop, QTimer, QUrl  # noqa: E402
from PySide6.QtGui import QColor, QPalette  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402
from timeshare.app.application import TimeshareApp  # noqa: E402
from timeshare.core.config import demo, schema  # noqa: E402
from timeshare.core.conversations.chat import ChatService  # noqa: E402
from timeshare.core.conversations.store import Store  # noqa: E402
from timeshare.core.pool.supervisor import Pool  # noqa: E402

QUESTION = "Write a Python function that returns the sum of a list of numbers, in a code block."


def wait(ms: int) -> None:
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def dark_palette() -> QPalette:
    p = QPalette()
    for role, colour in (
        (QPalette.ColorRole.Window, "#2b2b2b"),
        (QPalette.ColorRole.WindowText, "#e6e6e6"),
        (QPalette.ColorRole.Base, "#1e1e1e"),
        (QPalette.ColorRole.Text, "#e6e6e6"),
        (QPalette.ColorRole.Button, "#3a3a3a"),
        (QPalette.ColorRole.ButtonText, "#e6e6e6"),
    ):
        p.setColor(role, QColor(colour))
    return p


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots")
    out.mkdir(parents=True, exist_ok=True)
    qapp = QApplication(sys.argv[:1])
    models = demo.demo_model_configs()
    if not models:
        raise SystemExit("the demo models are not installed: run make run first")
    config = schema.Config(models=models, api=schema.ApiConfig(enabled=False))
    pool = Pool(config)
    pool.start()
    pool.wait_ready(timeout=240)
    store = Store(Path(WORK) / "conversations.sqlite3")
    app = TimeshareApp(config, pool, store, ChatService(pool, store), config_path=Path(WORK) / "c.toml")
    app.start(background=False)
    window = app.window
    window.resize(980, 700)
    wait(500)
    window.grab().save(str(out / "chat-first-run.png"))
    gemma = next(i for i, (model, _) in enumerate(window.suggestions) if "gemma" in model)
    done: list[bool] = []
    window.answer_finished.connect(lambda *_: done.append(True))
    window.max_tokens = 60
    window.transcript.anchorClicked.emit(QUrl(f"try:{gemma}"))
    while not done:
        wait(200)
    wait(500)
    window.grab().save(str(out / "chat-continuation.png"))
    settings = app.open_settings()
    settings.resize(820, 560)
    settings.tabs.setCurrentIndex(1)  # Sharing the GPU
    wait(500)
    settings.grab().save(str(out / "settings-sharing.png"))
    settings.advanced_button.click()
    wait(300)
    settings.grab().save(str(out / "settings-sharing-advanced.png"))
    settings.close()
    smol = next(m.id for m in models if "smol" in m.id)
    conv = window.new_conversation(smol)
    window.max_tokens = 160
    done.clear()
    window.input.setPlainText(QUESTION)
    window.send()
    while not done:
        wait(200)
    wait(500)
    window.grab().save(str(out / "chat-code.png"))
    assert conv is not None
    window.search.setText("python")
    wait(600)
    window.transcript.anchorClicked.emit(QUrl(f"edit:{store.messages(conv)[0].id}"))
    wait(300)
    window.grab().save(str(out / "chat-edit-search.png"))
    window.cancel_edit()
    window.search.clear()
    wait(600)
    os.environ["TIMESHARE_COLOR_SCHEME"] = "dark"
    qapp.setPalette(dark_palette())
    window.render_transcript()
    wait(300)
    window.grab().save(str(out / "chat-code-dark.png"))
    window.detach()
    app.bridge.detach()
    store.close()
    pool.stop()
    print(f"wrote the screenshots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
