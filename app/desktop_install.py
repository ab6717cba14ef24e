"""``timeshare desktop install|uninstall``: the application-menu entry and the icons for a pip or
venv install (a distribution package or the PyInstaller build installs its own).

Writes into the user's XDG data dir (``$XDG_DATA_HOME``, else ~/.local/share):
``applications/io.github.timeshare.Timeshare.desktop`` (the packaged entry, with ``Exec=`` and
``TryExec=`` naming this installation's ``timeshare`` by its absolute path) and the hicolor icons
(``icons/hicolor/{scalable,symbolic}/apps/``) that its ``Icon=`` names. Nothing here imports Qt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..core.util.atomic import atomic_write_text
from .autostart import APP_ID, DESKTOP_FILE, desktop_exec_quote, launcher, packaged_desktop_entry

ICONS = (
    ("scalable", f"{APP_ID}.svg"),
    ("symbolic", f"{APP_ID}-symbolic.svg"),
)


def data_home() -> Path:
    """``$XDG_DATA_HOME`` if it is an absolute path (the spec ignores relative ones), else ~/.local/share."""
    value = os.environ.get("XDG_DATA_HOME")
    return Path(value) if value and os.path.isabs(value) else Path.home() / ".local" / "share"


def menu_entry(template: str, command: list[str]) -> str:
    """The packaged .desktop text with ``Exec=`` running ``command`` and ``TryExec=`` naming its
    program (absolute paths: the menu's PATH may not have the venv)."""
    out: list[str] = []
    in_main = False
    for line in template.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            in_main = stripped == "[Desktop Entry]"
        elif in_main and stripped.startswith("Exec="):
            line = "Exec=" + " ".join(desktop_exec_quote(a) for a in command)
        elif in_main and stripped.startswith("TryExec="):
            line = f"TryExec={command[0]}"
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class DesktopFile:
    path: Path
    content: bytes


def plan(command: list[str] | None = None, where: Path | None = None) -> list[DesktopFile]:
    """What ``install`` writes: the menu entry first, then the icons."""
    base = where or data_home()
    entry = menu_entry(packaged_desktop_entry(), command or launcher())
    files = [DesktopFile(base / "applications" / DESKTOP_FILE, entry.encode())]
    icons = resources.files("timeshare.resources") / "icons" / "hicolor"
    for size, name in ICONS:
        files.append(
            DesktopFile(
                base / "icons" / "hicolor" / size / "apps" / name, (icons / size / "apps" / name).read_bytes()
            )
        )
    return files


def install(command: list[str] | None = None, where: Path | None = None) -> list[Path]:
    written = []
    for f in plan(command, where):
        f.path.parent.mkdir(parents=True, exist_ok=True)
        if f.path.suffix == ".desktop":
            atomic_write_text(f.path, f.content.decode("utf-8"), backup=False, mode=0o644)
        else:
            f.path.write_bytes(f.content)
            f.path.chmod(0o644)
        written.append(f.path)
    _refresh(where or data_home())
    return written


def uninstall(where: Path | None = None) -> list[Path]:
    removed = []
    for f in plan(["timeshare"], where):
        if f.path.exists():
            f.path.unlink()
            removed.append(f.path)
    _refresh(where or data_home())
    return removed


def _refresh(base: Path) -> None:
    """Tell the menu about the change where the desktop has the tool (optional: menus also watch
    the folder)."""
    tool = shutil.which("update-desktop-database")
    if tool and (base / "applications").is_dir():
        subprocess.run([tool, "-q", str(base / "applications")], check=False, timeout=60)


def main(args: argparse.Namespace) -> int:
    if sys.platform != "linux":
        print("timeshare desktop: the .desktop entry is for Linux desktops.", file=sys.stderr)
        return 2
    config = getattr(args, "config", None)
    command = launcher() + (["--config", str(Path(config).expanduser().resolve())] if config else [])
    try:
        if args.action == "install":
            for path in install(command):
                print(f"installed {path}")
        else:
            removed = uninstall()
            for path in removed:
                print(f"removed {path}")
            if not removed:
                print(f"nothing to remove in {data_home()}")
    except OSError as exc:
        print(f"timeshare desktop: {exc}", file=sys.stderr)
        return 1
    return 0
