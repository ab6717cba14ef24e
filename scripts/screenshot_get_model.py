"""Screenshots of "Get model…" without a network: Qt's offscreen platform and the test suite's local
stand-in for the Hugging Face hub (tests/_hub_util.py), holding a few repositories of tiny GGUF
files (so their sizes are KiB, not GB). Saves get-model.png (the suggestions: the short-name table)
and get-model-search.png (a search, each hit with its sizes per quantisation, one hit picked: its
quantisations with sizes and GPU fit against a budget) in docs/screenshots/.

Usage: .venv/bin/python scripts/screenshot_get_model.py [OUT_DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
WORK = Path(tempfile.mkdtemp(prefix="timeshare-shot-"))
os.environ["TIMESHARE_HOME"] = str(WORK)
os.environ["HF_HUB_CACHE"] = str(WORK / "hf")

from _hub_util import FakeHub, Repo, make_gguf  # noqa: E402
from PySide6.QtCore import QEventLoop, QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402
from timeshare.app import strings  # noqa: E402
from timeshare.app.get_model import GetModelDialog  # noqa: E402
from timeshare.core.state import DeviceStatus, PoolSnapshot  # noqa: E402


def wait(ms: int) -> None:
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots")
    out.mkdir(parents=True, exist_ok=True)
    hub = FakeHub()
    os.environ["HF_ENDPOINT"] = hub.url
    q4 = make_gguf(WORK / "a.gguf", name="Tiny", floats=8192, file_type=15)
    q8 = make_gguf(WORK / "b.gguf", name="Tiny", floats=16384, file_type=7)
    f16 = make_gguf(WORK / "c.gguf", name="Tiny", floats=32768, file_type=1)
    hub.repos["tiny-org/Tiny-Coder-1B-GGUF"] = Repo(
        {"Tiny-Coder-1B-Q4_K_M.gguf": q4, "Tiny-Coder-1B-Q8_0.gguf": q8, "Tiny-Coder-1B-F16.gguf": f16},
        downloads=48_210,
        parameters=1_100_000_000,
        licence="apache-2.0",
    )
    hub.repos["other/Tiny-Coder-3B-GGUF"] = Repo(
        {"Tiny-Coder-3B-Q4_K_M.gguf": q4}, downloads=9_300, parameters=3_090_000_000
    )
    hub.repos["someone/tiny-coder-merge-GGUF"] = Repo({"merge-Q4_K_M.gguf": q4}, downloads=120)
    qapp = QApplication(sys.argv[:1])
    gpu = PoolSnapshot(devices=(DeviceStatus(0, "CUDA0", "20GB", budget_bytes=int(len(q8) * 1.5)),))
    dialog = GetModelDialog(lambda: gpu, WORK / "config.toml")
    dialog.show()
    wait(300)
    dialog.grab().save(str(out / "get-model.png"))
    dialog.source.setText("tiny coder")
    dialog.look_up()
    while dialog.busy or dialog.found.count() != 3:
        wait(100)
    dialog.found.setCurrentRow(0)
    dialog.pick(dialog.found.item(0))
    while dialog.busy or dialog.table.rowCount() != 3:
        wait(100)
    # each hit's sizes per quantisation come on their own thread
    while any(strings.SIZES_COMING in dialog.found.item(i).text() for i in range(dialog.found.count())):
        wait(100)
    wait(300)
    dialog.grab().save(str(out / "get-model-search.png"))
    dialog.reject()
    hub.close()
    qapp.quit()
    print(f"wrote the screenshots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
