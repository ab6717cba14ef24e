"""The real app on a real X server with a real tray host: Xvfb + trayer, `timeshare tray`.

This is what `make run` does on a desktop; here the check is that the tray host embeds Timeshare's
icon (its panel grows by the icon's width) and that the icon is painted in a state colour. Skips
when Xvfb, trayer or xdotool are missing (.ci/run installs them).
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

pytestmark = [
    pytest.mark.gui,
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux")
        or not all(shutil.which(t) for t in ("Xvfb", "trayer", "xdotool")),
        reason="needs Xvfb, trayer and xdotool (apt-get install -y xvfb trayer xdotool)",
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


def test_tray_icon_appears_in_the_tray_host(
    x_with_tray: str, smollm2_path: Path, timeshare_home: Path
) -> None:
    display = x_with_tray
    panel = _panel(display)
    assert panel, "trayer did not show its panel"
    empty_width = _geometry(display, panel)["WIDTH"]

    config = timeshare_home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'[api]\nenabled = false\n\n[[models]]\nid = "smol"\npath = "{smollm2_path}"\nn_ctx = 512\n'
    )
    env = dict(os.environ, DISPLAY=display, QT_QPA_PLATFORM="xcb")
    log = timeshare_home / "app-output.txt"
    with log.open("wb") as out:
        app = subprocess.Popen(
            [str(Path(sys.executable).with_name("timeshare")), "tray", "--background"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        geometry = _geometry(display, panel)
        while geometry["WIDTH"] <= empty_width and time.monotonic() < deadline:
            assert app.poll() is None, log.read_text()
            time.sleep(0.2)
            geometry = _geometry(display, panel)
        assert geometry["WIDTH"] > empty_width, f"the tray icon was not embedded\n{log.read_text()}"

        # the icon is painted in one of the state colours (read back from the X server)
        if shutil.which("import"):
            time.sleep(1.0)
            shot = timeshare_home / "tray.png"
            subprocess.run(
                ["import", "-window", "root", "-crop",
                 f"{geometry['WIDTH']}x{geometry['HEIGHT']}+{geometry['X']}+{geometry['Y']}", str(shot)],
                env=dict(os.environ, DISPLAY=display),
                check=True,
                timeout=30,
            )  # fmt: skip
            from PySide6.QtGui import QColor, QImage
            from timeshare.app.icons import STATE_COLOURS

            image = QImage(str(shot))
            assert not image.isNull()
            pixels = {
                image.pixelColor(x, y).rgb() for x in range(image.width()) for y in range(image.height())
            }
            wanted = {QColor(c).rgb() for c in STATE_COLOURS.values()}
            assert pixels & wanted, "no pixel of the tray area has a state colour"
    finally:
        _stop(app)
    assert app.returncode == 0, log.read_text()
