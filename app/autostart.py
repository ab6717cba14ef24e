"""Start at login: an XDG autostart entry (Linux), a LaunchAgent (macOS), the Run key (Windows).

The Linux entry is generated from the packaged .desktop file, with ``tray --background`` appended
to the command and a short delay so the desktop's tray exists when Timeshare starts. The macOS and
Windows variants are described by the files/values they would write (``plan()``), so they are
tested on any machine; only writing them needs the real platform.
"""

from __future__ import annotations

import contextlib
import logging
import os
import plistlib
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..core.util.atomic import atomic_write_text

log = logging.getLogger(__name__)

APP_ID = "io.github.timeshare.Timeshare"
DESKTOP_FILE = f"{APP_ID}.desktop"
AUTOSTART_DELAY_S = 5  # the tray of some desktops (KDE) appears a few seconds after autostart runs
WINDOWS_RUN_KEY = r"HKEY_CURRENT_USER\Software\Microsoft\Windows\CurrentVersion\Run"
WINDOWS_VALUE_NAME = "Timeshare"


def launcher() -> list[str]:
    """The command that runs this very installation's ``timeshare`` (absolute paths: the login
    session's or the menu's PATH may not have the venv)."""
    if getattr(sys, "frozen", False):  # PyInstaller build: the executable is the app
        return [sys.executable]
    script = Path(sys.executable).with_name("timeshare")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "timeshare"]


def _config_args(config: Path | None) -> list[str]:
    """``--config ABSOLUTE`` for a configuration other than the default file (none for that one)."""
    if config is None:
        return []
    from ..core import paths

    absolute = Path(config).expanduser().resolve()
    if absolute == paths.config_file().resolve():
        return []
    return ["--config", str(absolute)]


def launch_command(config: Path | None = None) -> list[str]:
    """How to start this very installation at login, with the configuration it runs with now
    (``config``: the file it was started with; the default file needs no flag)."""
    return [*launcher(), *_config_args(config), "tray", "--background"]


def packaged_desktop_entry() -> str:
    return resources.files("timeshare.resources").joinpath(DESKTOP_FILE).read_text(encoding="utf-8")


def desktop_exec_quote(arg: str) -> str:
    # Desktop Entry spec: quote with double quotes when the argument has reserved characters
    if arg and not any(c in arg for c in " \t\n\"'\\><~|&;$*?#()`%="):
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`").replace("$", "\\$")
    return f'"{escaped.replace("%", "%%")}"'


def xdg_autostart_entry(template: str, command: list[str], delay_s: int = AUTOSTART_DELAY_S) -> str:
    """The autostart .desktop text: the packaged entry with our command, no TryExec, and a delay."""
    out: list[str] = []
    in_main = False
    for line in template.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            if in_main:
                out += [f"X-GNOME-Autostart-Delay={delay_s}", "X-GNOME-Autostart-enabled=true"]
            in_main = stripped == "[Desktop Entry]"
        elif in_main and stripped.startswith(("Exec=", "TryExec=", "X-GNOME-Autostart")):
            if stripped.startswith("Exec="):
                out.append("Exec=" + " ".join(desktop_exec_quote(a) for a in command))
            continue
        out.append(line)
    if in_main:
        out += [f"X-GNOME-Autostart-Delay={delay_s}", "X-GNOME-Autostart-enabled=true"]
    return "\n".join(out) + "\n"


def launch_agent_plist(command: list[str]) -> bytes:
    return plistlib.dumps(
        {
            "Label": APP_ID,
            "ProgramArguments": command,
            "RunAtLoad": True,
            "ProcessType": "Interactive",
        }
    )


def windows_run_value(command: list[str]) -> str:
    return " ".join(f'"{a}"' if (" " in a or not a) else a for a in command)


@dataclass(frozen=True)
class AutostartPlan:
    """What enabling start-at-login writes on a platform."""

    platform: str  # "linux" | "darwin" | "win32"
    path: str  # file written (Linux, macOS) or registry key (Windows)
    content: bytes  # file content, or the Run value (UTF-8) on Windows
    value_name: str = ""  # Windows only


def _xdg_config_home() -> Path:
    value = os.environ.get("XDG_CONFIG_HOME")
    return Path(value) if value and os.path.isabs(value) else Path.home() / ".config"


def plan(
    platform: str | None = None, command: list[str] | None = None, config: Path | None = None
) -> AutostartPlan:
    platform = platform or sys.platform
    command = command or launch_command(config)
    if platform == "darwin":
        path = Path.home() / "Library" / "LaunchAgents" / f"{APP_ID}.plist"
        return AutostartPlan("darwin", str(path), launch_agent_plist(command))
    if platform == "win32":
        value = windows_run_value(command).encode("utf-8")
        return AutostartPlan("win32", WINDOWS_RUN_KEY, value, WINDOWS_VALUE_NAME)
    path = _xdg_config_home() / "autostart" / DESKTOP_FILE
    return AutostartPlan("linux", str(path), xdg_autostart_entry(packaged_desktop_entry(), command).encode())


def is_enabled(platform: str | None = None) -> bool:
    p = plan(platform, command=["timeshare"])
    if p.platform == "win32":
        return _windows_read(p) is not None
    return Path(p.path).is_file()


def set_enabled(enabled: bool, platform: str | None = None, config: Path | None = None) -> AutostartPlan:
    """Write or remove the start-at-login entry (starting Timeshare with ``config`` when that is
    not the default file); returns what was (or would have been) written."""
    p = plan(platform, config=config)
    if p.platform == "win32":
        _windows_write(p, enabled)
    elif enabled:
        # the .desktop entry and the plist are UTF-8 text
        atomic_write_text(Path(p.path), p.content.decode("utf-8"), backup=False, mode=0o644)
        log.info("start at login enabled: %s", p.path)
    else:
        Path(p.path).unlink(missing_ok=True)
        log.info("start at login disabled: removed %s", p.path)
    return p


def _windows_read(p: AutostartPlan) -> str | None:
    if sys.platform != "win32":
        return None
    import winreg

    try:
        with winreg.OpenKey(winreg.HKEY_CURRENT_USER, p.path.split("\\", 1)[1]) as key:
            value, _ = winreg.QueryValueEx(key, p.value_name)
            return str(value)
    except OSError:
        return None


def _windows_write(p: AutostartPlan, enabled: bool) -> None:
    if sys.platform != "win32":
        raise OSError(f"the Windows Run key can only be written on Windows, not on {sys.platform}")
    import winreg

    with winreg.CreateKey(winreg.HKEY_CURRENT_USER, p.path.split("\\", 1)[1]) as key:
        if enabled:
            winreg.SetValueEx(key, p.value_name, 0, winreg.REG_SZ, p.content.decode("utf-8"))
        else:
            with contextlib.suppress(FileNotFoundError):
                winreg.DeleteValue(key, p.value_name)


def describe(p: AutostartPlan) -> str:
    if p.platform == "win32":
        return f"{p.path}\\{p.value_name} = {p.content.decode()}"
    return p.path


__all__ = ["AutostartPlan", "describe", "is_enabled", "launch_command", "plan", "set_enabled"]
