"""The Python the shell scripts run (heredocs and ``-c`` one-liners in scripts/*.sh) imports names
that exist: a module moved in a refactor broke `make vulkan-check`'s arena step (an
ImportError after an 85-minute build) without any test noticing."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))
_HEREDOC = re.compile(r"<<'?(\w+)'?[^\n]*\n(.*?)\n\1\n", re.S)
_ONE_LINER = re.compile(r"-c '([^']*import[^']*)'")


def _python_blocks(text: str) -> list[str]:
    blocks = [body for _tag, body in _HEREDOC.findall(text) if "import " in body]
    blocks += _ONE_LINER.findall(text)
    return blocks


def _imports(block: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("timeshare"):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("timeshare")]
    return out


def test_the_scripts_have_python_to_check() -> None:
    names = {p.name: _python_blocks(p.read_text()) for p in SCRIPTS}
    assert len(names["vulkan-check.sh"]) >= 4, names["vulkan-check.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_python_imports_what_exists(script: Path) -> None:
    for block in _python_blocks(script.read_text()):
        for module, name in _imports(block):
            mod = importlib.import_module(module)
            assert not name or hasattr(mod, name) or _is_submodule(module, name), (
                f"{script.name}: `from {module} import {name}`: {module} has no {name}"
            )


def _is_submodule(module: str, name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except ModuleNotFoundError:  # ``module`` is not a package
        return False
