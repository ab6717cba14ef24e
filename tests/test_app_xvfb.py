"""The real app on a real X server with a real tray host: Xvfb + trayer, `timeshare tray`.

This is what `make run` does on a desktop; here the check is that the tray host embeds Timeshare's
icon (its panel grows by the icon's width) and that the icon is painted in a state colour, and that
a ``kill -9`` of the tray app leaves none of its workers running. Skips when Xvfb, trayer, xdotool or
ImageMagick's ``import`` are missing (.ci/run installs them): never a check that quietly vanishes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _proc_util import alive, wait_until, workers_of

_TOOLS = ("Xvfb", "trayer", "xdotool", "import")

pytestmark = [
    pytest.mark.gui,
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or not all(shutil.which(t) for t in _TOOLS),
        reason="needs Xvfb, trayer, xdotool, ImageMagick (apt-get install xvfb trayer xdotool imagemagick)",
    ),
]


def _geometry(display: str, window: str) -> dict[str, int]:
    out = subprocess.run(
        ["xdotool", "getwindowgeometry", "--shell", window],
        env=dict(os.environ, DISPLAY=display),
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    return {
        k: int(v) for k, v in (line.split("=") for line in out.split()) if k in ("X", "Y", "WIDTH", "HEIGHT")
    }


def _panel(display: str) -> str | None:
    out = subprocess.run(
        ["xdotool", "search", "--onlyvisible", "--name", "^panel$"],
        env=dict(os.environ, DISPLAY=display),
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.split()
    return out[0] if out else None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def x_with_tray(tmp_path: Path) -> Iterator[str]:
    # -displayfd: Xvfb picks a free display number and writes it to the pipe when it is ready
    xvfb = subprocess.Popen(
        ["Xvfb", "-displayfd", "1", "-screen", "0", "1024x600x24", "-nolisten", "tcp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    trayer = None
    try:
        assert xvfb.stdout is not None
        number = xvfb.stdout.readline().decode().strip()
        xvfb.stdout.close()
        assert number.isdigit(), "Xvfb did not start"
        display = f":{number}"
        trayer = subprocess.Popen(
            ["trayer", "--edge", "top", "--align", "right", "--widthtype", "request", "--height", "32",
             "--transparent", "false", "--tint", "0x000000", "--SetDockType", "true"],
            env=dict(os.environ, DISPLAY=display),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(100):
            if _panel(display):
                break
            time.sleep(0.1)
        yield display
    finally:
        if trayer is not None:
            _stop(trayer)
        _stop(xvfb)


def _shot_colours(display: str, geometry: dict[str, int], shot: Path) -> set[int]:
    """The RGB values of the tray area, read back from the X server (ImageMagick's import)."""
    subprocess.run(
        ["import", "-window", "root", "-crop",
         f"{geometry['WIDTH']}x{geometry['HEIGHT']}+{geometry['X']}+{geometry['Y']}", str(shot)],
        env=dict(os.environ, DISPLAY=display),
        check=True,
        timeout=30,
    )  # fmt: skip
    from PySide6.QtGui import QImage

    image = QImage(str(shot))
    assert not image.isNull()
    return {image.pixelColor(x, y).rgb() for x in range(image.width()) for y in range(image.height())}


def _write_config(home: Path, smollm2_path: Path) -> None:
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'[api]\nenabled = false\n\n[[models]]\nid = "smol"\npath = "{smollm2_path}"\nn_ctx = 512\n'
    )


def _before_the_tray(display: str, home: Path, smollm2_path: Path) -> tuple[str, int, Path]:
    """trayer's panel and its width with no icon yet; a config of SmolLM2 in ``home``; the app's
    log file."""
    panel = _panel(display)
    assert panel, "trayer did not show its panel"
    empty_width = _geometry(display, panel)["WIDTH"]
    _write_config(home, smollm2_path)
    return panel, empty_width, home / "app-output.txt"


def _start_tray(display: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, DISPLAY=display, QT_QPA_PLATFORM="xcb")
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("timeshare")), "tray", "--background"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_embedded(
    display: str, panel: str, empty_width: int, app: subprocess.Popen[bytes], log: Path
) -> dict[str, int]:
    deadline = time.monotonic() + 60
    geometry = _geometry(display, panel)
    while geometry["WIDTH"] <= empty_width and time.monotonic() < deadline:
        assert app.poll() is None, log.read_text()
        time.sleep(0.2)
        geometry = _geometry(display, panel)
    assert geometry["WIDTH"] > empty_width, f"the tray icon was not embedded\n{log.read_text()}"
    return geometry


def test_tray_icon_appears_in_the_tray_host(
    x_with_tray: str, smollm2_path: Path, timeshare_home: Path
) -> None:
    display = x_with_tray
    panel, empty_width, log = _before_the_tray(display, timeshare_home, smollm2_path)
    app = _start_tray(display, log)
    try:
        geometry = _wait_embedded(display, panel, empty_width, app, log)
        # the icon is painted in one of the state colours: wait for it (a first frame may be blank)
        from PySide6.QtGui import QColor
        from timeshare.app.icons import STATE_COLOURS

        wanted = {QColor(c).rgb() for c in STATE_COLOURS.values()}
        shot = timeshare_home / "tray.png"
        wait_until(
            lambda: _shot_colours(display, geometry, shot) & wanted,
            30,
            "a pixel of the tray area in a state colour",
        )
    finally:
        _stop(app)
    assert app.returncode == 0, log.read_text()


def test_kill9_of_the_tray_app_leaves_no_worker_and_the_next_start_is_clean(
    x_with_tray: str, smollm2_path: Path, timeshare_home: Path
) -> None:
    display = x_with_tray
    panel, empty_width, log = _before_the_tray(display, timeshare_home, smollm2_path)
    app = _start_tray(display, log)
    try:
        _wait_embedded(display, panel, empty_width, app, log)
        wait_until(lambda: len(workers_of(timeshare_home)) == 1, 60, "the tray's worker to start")
        workers = workers_of(timeshare_home)
        app.kill()  # SIGKILL: no handler, no cleanup
        assert app.wait(30) == -9
    finally:
        _stop(app)
    wait_until(lambda: not any(alive(pid) for pid in workers), 60, f"worker {workers} to exit")
    # the panel shrinks back once the dead app's icon window is gone; then a clean second start
    wait_until(
        lambda: _geometry(display, panel)["WIDTH"] <= empty_width, 30, "the dead icon to leave the tray"
    )
    again = _start_tray(display, log)
    try:
        _wait_embedded(display, panel, empty_width, again, log)
        wait_until(lambda: len(workers_of(timeshare_home)) == 1, 60, "the second start's worker")
        assert not set(workers_of(timeshare_home)) & set(workers)
    finally:
        _stop(again)
    assert again.returncode == 0, log.read_text()
    wait_until(lambda: workers_of(timeshare_home) == [], 30, "the second start's worker to exit")
