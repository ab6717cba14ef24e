"""Desktop integration: start at login (Linux for real, macOS/Windows by what they would write),
single instance (real QLocalServer/QLocalSocket)."""

from __future__ import annotations

import configparser
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from timeshare.app import autostart

APP_ID = "io.github.timeshare.Timeshare"
#: the entries are checked by desktop-file-validate (.ci/run installs it): a test that needs it
#: skips, visibly, rather than passing without the check
needs_validator = pytest.mark.skipif(
    shutil.which("desktop-file-validate") is None,
    reason="needs desktop-file-validate (apt-get install desktop-file-utils)",
)


@pytest.fixture
def xdg_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "xdg-config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(folder))
    return folder


def parse_desktop(text: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser["Desktop Entry"]


@pytest.mark.skipif(sys.platform != "linux", reason="XDG autostart is the Linux mechanism")
@needs_validator
def test_linux_autostart_on_and_off(xdg_config: Path) -> None:
    target = xdg_config / "autostart" / f"{APP_ID}.desktop"
    assert not autostart.is_enabled()
    plan = autostart.set_enabled(True)
    assert plan.path == str(target)
    assert target.is_file() and autostart.is_enabled()

    entry = parse_desktop(target.read_text())
    packaged = parse_desktop(autostart.packaged_desktop_entry())
    assert entry["Name"] == packaged["Name"] and entry["Icon"] == packaged["Icon"]  # generated from it
    assert entry["Exec"].endswith("tray --background")
    assert entry["X-GNOME-Autostart-Delay"] == str(autostart.AUTOSTART_DELAY_S)
    assert "TryExec" not in entry  # the login session's PATH may not have the venv
    assert Path(entry["Exec"].split()[0]).is_absolute()

    out = subprocess.run(["desktop-file-validate", str(target)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout

    autostart.set_enabled(False)
    assert not target.exists() and not autostart.is_enabled()
    autostart.set_enabled(False)  # turning it off twice is fine


@pytest.mark.skipif(sys.platform != "linux", reason="XDG autostart is the Linux mechanism")
def test_autostart_command_really_starts_timeshare(xdg_config: Path) -> None:
    # the Exec line must name a runnable Timeshare: run it with --help instead of starting the tray
    autostart.set_enabled(True)
    entry = parse_desktop((xdg_config / "autostart" / f"{APP_ID}.desktop").read_text())
    argv = entry["Exec"].replace('"', "").split()
    assert argv[-2:] == ["tray", "--background"]
    out = subprocess.run([*argv[:-2], "tray", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--background" in out.stdout


def test_xdg_config_home_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert autostart.plan("linux").path == str(tmp_path / ".config" / "autostart" / f"{APP_ID}.desktop")
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")  # the spec: relative paths are invalid
    assert autostart.plan("linux").path.startswith(str(tmp_path / ".config"))


def test_exec_line_quotes_paths_with_spaces() -> None:
    text = autostart.xdg_autostart_entry(
        "[Desktop Entry]\nType=Application\nName=T\nExec=timeshare\nTryExec=timeshare\n"
        "[Desktop Action x]\nName=X\nExec=y\n",
        ["/opt/my apps/timeshare", "tray", "--background"],
    )
    entry = parse_desktop(text)
    assert entry["Exec"] == '"/opt/my apps/timeshare" tray --background'
    # only the main group changes
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    assert parser["Desktop Action x"]["Exec"] == "y"
    assert "X-GNOME-Autostart-Delay" not in parser["Desktop Action x"]


def test_macos_launch_agent_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    plan = autostart.plan(
        "darwin", ["/Applications/Timeshare.app/Contents/MacOS/timeshare", "tray", "--background"]
    )
    assert plan.path == str(tmp_path / "Library" / "LaunchAgents" / f"{APP_ID}.plist")
    data = plistlib.loads(plan.content)
    assert data["Label"] == APP_ID
    assert data["RunAtLoad"] is True
    assert data["ProgramArguments"] == [
        "/Applications/Timeshare.app/Contents/MacOS/timeshare",
        "tray",
        "--background",
    ]


def test_windows_run_key_plan() -> None:
    plan = autostart.plan("win32", [r"C:\Program Files\Timeshare\timeshare.exe", "tray", "--background"])
    assert plan.path == r"HKEY_CURRENT_USER\Software\Microsoft\Windows\CurrentVersion\Run"
    assert plan.value_name == "Timeshare"
    assert plan.content.decode() == r'"C:\Program Files\Timeshare\timeshare.exe" tray --background'


@pytest.mark.skipif(sys.platform == "win32", reason="checks the refusal off Windows")
def test_windows_registry_is_not_written_elsewhere() -> None:
    with pytest.raises(OSError, match="only be written on Windows"):
        autostart.set_enabled(True, platform="win32")


# ---- single instance ---------------------------------------------------------------------------


def test_second_instance_asks_the_first_to_show(qtbot: object) -> None:
    from timeshare.app.single_instance import SingleInstance, server_name

    first = SingleInstance()
    assert first.claim() is True
    try:
        second = SingleInstance()
        with qtbot.waitSignal(first.message_received, timeout=5000) as blocker:  # type: ignore[attr-defined]
            assert second.claim() is False
        assert blocker.args == ["show"]
        assert first.name == second.name == server_name()
    finally:
        first.close()
    # once the first is gone, the next launch becomes the first
    third = SingleInstance()
    assert third.claim() is True
    third.close()


def test_instances_in_different_homes_do_not_see_each_other(
    qtbot: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from timeshare.app.single_instance import SingleInstance

    first = SingleInstance()
    assert first.claim()
    monkeypatch.setenv("TIMESHARE_HOME", str(tmp_path / "other-home"))
    other = SingleInstance()
    try:
        assert other.name != first.name
        assert other.claim() is True
    finally:
        other.close()
        first.close()


def test_stale_socket_file_does_not_block_a_new_instance(qtbot: object) -> None:
    # a crashed instance leaves its socket file behind; the next launch must still start
    from PySide6.QtNetwork import QLocalServer
    from timeshare.app.single_instance import SingleInstance

    instance = SingleInstance()
    stale = QLocalServer()
    assert stale.listen(instance.name)
    socket_path = Path(stale.fullServerName())
    stale.close()
    socket_path.touch()  # close() removed it; put a dead file back, as a crash would leave it
    assert instance.claim() is True
    instance.close()


@pytest.mark.skipif(sys.platform != "linux", reason="XDG autostart is the Linux mechanism")
def test_autostart_keeps_the_configuration_it_runs_with(xdg_config: Path, tmp_path: Path) -> None:
    from timeshare.core import paths

    mine = tmp_path / "my config.toml"
    plan = autostart.set_enabled(True, config=mine)
    argv = parse_desktop(Path(plan.path).read_text())["Exec"]
    assert f'--config "{mine}" tray --background' in argv
    # the default file needs no flag
    plan = autostart.set_enabled(True, config=paths.config_file())
    assert "--config" not in parse_desktop(Path(plan.path).read_text())["Exec"]
    assert "--config" not in autostart.launch_command()


# ---- the menu entry and the icons for a pip/venv install ----------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="XDG desktop entries are the Linux mechanism")
@needs_validator
def test_desktop_install_and_uninstall(tmp_path: Path) -> None:
    import os

    data = tmp_path / "xdg-data"
    env = dict(os.environ, XDG_DATA_HOME=str(data))
    exe = Path(sys.executable).with_name("timeshare")
    timeshare = [str(exe)] if exe.exists() else [sys.executable, "-m", "timeshare"]
    done = subprocess.run(
        [*timeshare, "desktop", "install"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    entry_path = data / "applications" / f"{APP_ID}.desktop"
    assert f"installed {entry_path}" in done.stdout
    entry = parse_desktop(entry_path.read_text())
    # Exec and TryExec name this installation's launcher by its absolute path
    argv = entry["Exec"].split()
    assert argv[0] == timeshare[0] and Path(argv[0]).is_absolute() and entry["TryExec"] == timeshare[0]
    # Icon= resolves in the user's hicolor theme
    assert (data / "icons" / "hicolor" / "scalable" / "apps" / f"{entry['Icon']}.svg").is_file()
    assert (data / "icons" / "hicolor" / "symbolic" / "apps" / f"{entry['Icon']}-symbolic.svg").is_file()
    out = subprocess.run(["desktop-file-validate", str(entry_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    # the entry really starts Timeshare: run its command with --help instead of the tray
    out = subprocess.run([*argv, "tray", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--background" in out.stdout, out.stderr

    done = subprocess.run(
        [*timeshare, "desktop", "uninstall"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert not entry_path.exists()
    assert not list((data / "icons").rglob("*.svg"))
