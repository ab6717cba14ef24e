"""No developer words in what the GUI shows: the string literals of app/ (docstrings and
comments aside) hold no HTTP paths, config keys or internal terms; "GPU" only where there is one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from timeshare.app import strings
from timeshare.core.state import ModelState, ModelStatus, PoolSnapshot

APP = Path(__file__).resolve().parent.parent / "app"
FORBIDDEN = ("POST /", "arena.", "Residency:", "/timeshare/v1", "(GPU)")
#: a config key as the settings file spells it (api.ollama_listen, models[].idle_sleep_s, ...)
CONFIG_KEY = re.compile(r"\b(api|arena|general|models)(\[\])?\.[a-z_]+")


def _shown_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module except docstrings (f-string parts included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_http_paths_config_keys_or_internal_terms_in_the_gui() -> None:
    found = [
        f"{path.name}:{line}: {text!r}"
        for path in sorted(APP.glob("*.py"))
        for line, text in _shown_strings(path)
        if any(word in text for word in FORBIDDEN) or CONFIG_KEY.search(text)
    ]
    assert found == []


def test_the_grep_sees_a_forbidden_word() -> None:  # the oracle works: it finds one when there is one
    probe = APP.parent / "tests" / "_strings_probe.py"
    probe.write_text('"""POST /x in a docstring is fine."""\nTEXT = f"run POST /timeshare/v1/{1}"\n')
    try:
        assert [t for _, t in _shown_strings(probe) if "POST /" in t] == ["run POST /timeshare/v1/"]
        probe.write_text('TIP = "A second address (api.ollama_listen, HOST:PORT)"\n')
        assert [t for _, t in _shown_strings(probe) if CONFIG_KEY.search(t)]
    finally:
        probe.unlink()


def _status(model_id: str, name: str, backend: str) -> ModelStatus:
    return ModelStatus(id=model_id, name=name, path="x", state=ModelState.RESIDENT, backend=backend)


def test_gpu_only_where_there_is_one_and_display_names_for_ids() -> None:
    reason = "waiting for the GPU: pinned by gemma3-270m"
    cpu = PoolSnapshot(models=(_status("gemma3-270m", "Gemma 3", "CPU"), _status("smol", "Smol", "CPU")))
    cuda = PoolSnapshot(models=(_status("gemma3-270m", "Gemma 3", "CUDA0"),))
    assert strings.for_people(reason, cpu) == "waiting for its turn: pinned by Gemma 3"
    assert strings.for_people(reason, cuda) == "waiting for the GPU: pinned by Gemma 3"
    assert strings.holds(strings.has_gpu(cpu)) == "is active"
    assert strings.holds(strings.has_gpu(cuda)) == "holds the GPU"
    # an id inside another word is left alone
    assert strings.names_for_people("smol-2 and smol", cpu) == "smol-2 and Smol"


def test_the_pools_cli_and_http_advice_is_not_shown_in_the_gui() -> None:
    snap = PoolSnapshot(models=(_status("ghost", "Ghost", "CUDA0"),))
    said = (
        "ghost is not available: its file is gone (to start it: `timeshare start ghost`, "
        "POST /timeshare/v1/models/ghost/start, or Restart in the tray)"
    )
    assert strings.for_people(said, snap) == "Ghost is not available: its file is gone"
