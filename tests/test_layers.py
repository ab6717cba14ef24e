"""House rules that keep the layers apart: core/ never imports Qt; app/ never imports llama_cpp
or ctypes. Checked on the syntax tree, so an import hidden in a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value.split(".")[0])
    return names


def offenders(folder: str, forbidden: set[str]) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        hits = imported_modules(path) & forbidden
        if hits:
            bad.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(hits))}")
    return bad


QT = {"PySide6", "PyQt5", "PyQt6", "shiboken6", "PySide2"}


def test_core_never_imports_qt() -> None:
    assert offenders("core", QT) == []


def test_app_never_imports_llama_cpp_or_ctypes() -> None:
    assert offenders("app", {"llama_cpp", "ctypes"}) == []


@pytest.mark.parametrize(
    ("source", "forbidden", "expected"),
    [
        ("from PySide6.QtCore import QObject\n", QT, {"PySide6"}),
        ("def f():\n    import llama_cpp\n", {"llama_cpp"}, {"llama_cpp"}),
        ("import importlib\nimportlib.import_module('ctypes.util')\n", {"ctypes"}, {"ctypes"}),
        ("from . import ctypes_free\n", {"ctypes"}, set()),
    ],
)
def test_checker_sees_imports(tmp_path: Path, source: str, forbidden: set[str], expected: set[str]) -> None:
    # the checker itself must catch what it is for, or the two tests above prove nothing
    mod = tmp_path / "m.py"
    mod.write_text(source)
    assert imported_modules(mod) & forbidden == expected
