"""Images in the chat window (issue 41, item 6), with a real worker (SmolLM2 and a generated
projector, offscreen Qt): a picture pasted into the box or a file dropped on it goes with the next
message, is saved with it and shown as a thumbnail in the transcript; the same conversation's next
turn keeps the image in the model's KV (only the new text is evaluated); a file that is not an
image is refused in words."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _app_util import running_app
from _vision_util import png, projector_for
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig

pytestmark = [pytest.mark.slow, pytest.mark.gui]

VISION = "smol-vision"


@pytest.fixture(scope="module")
def pool(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from timeshare.core.pool.supervisor import Pool

    root = tmp_path_factory.mktemp("pool")
    arena = root / "arena"
    arena.mkdir(mode=0o700)
    proj = projector_for(smollm2_path, root)
    config = Config(
        models=(
            ModelConfig(id=VISION, name="Smol Vision", path=str(smollm2_path), n_ctx=1024, mmproj=str(proj)),
        ),
        api=ApiConfig(enabled=False),
        arena=ArenaConfig(vram_budget="one-model"),
    )
    p = Pool(config, arena_dir=arena, log_dir=root / "log", kv_dir=root / "kv")
    p.start()
    p.wait_ready(timeout=240)
    yield p
    p.stop()


@pytest.fixture
def app(qtbot: Any, pool: Any, tmp_path: Path) -> Iterator[Any]:
    with running_app(qtbot, pool, tmp_path, max_tokens=8) as ta:
        yield ta


def test_a_pasted_picture_goes_with_the_message_and_shows_in_the_transcript(
    qtbot: Any, app: Any, tmp_path: Path
) -> None:
    from PySide6.QtCore import QMimeData, QUrl
    from PySide6.QtGui import QImage

    window = app.window
    conv = window.new_conversation(VISION)
    picture = QImage.fromData(png((255, 0, 0), (64, 48)))
    pasted = QMimeData()
    pasted.setImageData(picture)
    window.input.insertFromMimeData(pasted)
    assert len(window.pending_images) == 1 and window.images_bar.isVisibleTo(window)
    # a dropped file that is not an image is refused in words; an image file is taken
    (tmp_path / "notes.png").write_bytes(b"not really a png")
    (tmp_path / "blue.png").write_bytes(png((0, 0, 255)))
    dropped = QMimeData()
    dropped.setUrls(
        [QUrl.fromLocalFile(str(tmp_path / "notes.png")), QUrl.fromLocalFile(str(tmp_path / "blue.png"))]
    )
    window.input.insertFromMimeData(dropped)
    assert [n for _d, n in window.pending_images] == ["pasted image", "blue.png"]
    assert "notes.png is not an image" in window.statusBar().currentMessage()
    with qtbot.waitSignal(window.answer_finished, timeout=120_000) as done:
        qtbot.keyClicks(window.input, "What is in these pictures?")
        qtbot.keyClick(window.input, "\r")
    assert done.args[2] == "", done.args  # no error
    assert window.pending_images == [] and not window.images_bar.isVisibleTo(window)
    user = next(m for m in app.store.messages(conv) if m.role == "user")
    assert len(user.images) == 2 and user.content == "What is in these pictures?"
    html = window.transcript.toHtml()
    assert html.count("image:") >= 2
    key = html.split('src="image:')[1].split('"')[0]
    shown = window.transcript.loadResource(2, QUrl(f"image:{key}"))  # QTextDocument.ImageResource
    assert isinstance(shown, QImage) and not shown.isNull() and shown.height() <= 120
    # the next turn: the images stay in the conversation's KV, only the new text is evaluated
    with qtbot.waitSignal(window.answer_finished, timeout=120_000) as second:
        qtbot.keyClicks(window.input, "And their colours?")
        qtbot.keyClick(window.input, "\r")
    stats = second.args[1]
    assert stats is not None and 0 < stats.prompt_tokens_evaluated < stats.prompt_tokens - 32
