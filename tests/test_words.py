"""One vocabulary for a model's state (core/words.py), the same in the tray, the chat window,
Settings, the CLI and the docs; "GPU" only where there is one."""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest
from timeshare.app import strings
from timeshare.app.menu_model import menu_entries, tooltip
from timeshare.app.transcript import answer_line
from timeshare.core import words
from timeshare.core.state import ModelState, ModelStatus, PoolSnapshot, SwitchStats

from timeshare.client import print_status

ROOT = Path(__file__).resolve().parent.parent
#: the internal state names and the old words people were shown ("busy · holds memory",
#: "No model is loaded · 2 released" while both were loaded)
OLD_WORDS = re.compile(r"\b(released|resident|is loaded|busy ·)\b")


def test_every_state_has_a_word_and_a_meaning() -> None:
    assert set(words.STATE_WORDS) == {s.value for s in ModelState} == set(words.STATE_MEANINGS)
    assert words.state_words("resident") == "on the GPU"
    assert words.state_words("resident", gpu=False) == "in memory"
    assert words.state_words("released", restore_ms=93) == "set aside — ready in 0.1 s"
    assert words.state_words("released", restore_ms=2440) == "set aside — ready in 2.4 s"
    assert words.state_words("released") == "set aside"
    assert words.state_words("sleeping") == "asleep"
    assert words.state_words("stopped") == "stopped"
    assert words.state_words("failed") == "failed"
    assert words.state_words("resident", busy=True) == "answering"
    assert words.state_words("released", busy=True) == "waiting for the GPU"
    assert words.state_words("released", busy=True, gpu=False) == "waiting for its turn"
    assert words.state_words("released", resident_fraction=0.62) == "partly on the GPU (62 %)"


def test_readme_lists_the_same_words() -> None:
    readme = (ROOT / "README.md").read_text()
    for state, word in words.STATE_WORDS.items():
        assert f"| {word} | {words.STATE_MEANINGS[state]} |" in readme


def _status(mid: str, state: ModelState, backend: str = "CUDA0", **kw: object) -> ModelStatus:
    return ModelStatus(id=mid, name=mid.upper(), path="x", state=state, backend=backend, **kw)  # type: ignore[arg-type]


def _snapshot(backend: str) -> PoolSnapshot:
    return PoolSnapshot(
        models=(
            _status("aaa", ModelState.RESIDENT, backend),
            _status(
                "bbb",
                ModelState.RELEASED,
                backend,
                last_switch=SwitchStats(switched=True, restore_ms=120.0),
            ),
            _status("ccc", ModelState.SLEEPING, backend),
        ),
        holder="aaa",
    )


def _menu_text(snapshot: PoolSnapshot) -> str:
    entries = menu_entries(snapshot, start_at_login=False)
    return "\n".join(getattr(e, "text", "") for e in entries)


def test_the_tray_and_the_cli_say_the_same_words() -> None:
    snap = _snapshot("CUDA0")
    assert tooltip(snap) == "AAA holds the GPU · 1 other set aside · 1 asleep"
    menu = _menu_text(snap)
    assert "AAA — on the GPU" in menu and "BBB — set aside — ready in 0.1 s" in menu
    assert "CCC — asleep" in menu
    out = io.StringIO()
    print_status(
        {
            "holder": "aaa",
            "models": [
                {"id": "aaa", "state": "resident", "backend": "CUDA0"},
                {
                    "id": "bbb",
                    "state": "released",
                    "backend": "CUDA0",
                    "last_switch": {"switched": True, "restore_ms": 120.0},
                },
                {"id": "ccc", "state": "sleeping", "backend": "CUDA0"},
            ],
        },
        out,
    )
    table = out.getvalue()
    assert "on the GPU" in table and "set aside — ready in 0.1 s" in table and "asleep" in table
    assert not OLD_WORDS.search(table.split("\n", 2)[2])  # the model rows (the header names columns)


def test_no_gpu_words_on_a_cpu_build() -> None:
    snap = _snapshot("CPU")
    shown = tooltip(snap) + "\n" + _menu_text(snap)
    assert "GPU" not in shown, shown
    assert "AAA is active" in shown and "AAA — in memory" in shown
    stats_line = answer_line(
        _answer_stats(switched=True, wait_ms=13175.0, restore_ms=40.0), gpu=strings.has_gpu(snap)
    )
    assert "GPU" not in stats_line and "waited 13175 ms for its turn" in stats_line
    assert "no switch" in answer_line(_answer_stats(switched=False), gpu=False)
    assert "GPU switch" in answer_line(_answer_stats(switched=True, restore_ms=40.0), gpu=True)


def _answer_stats(**kw: object) -> object:
    from timeshare.core.conversations.store import AnswerStats

    base = dict(ttft_ms=30.0, tokens_per_s=50.0, completion_tokens=10, finish_reason="stop")
    return AnswerStats(**{**base, **kw})  # type: ignore[arg-type]


def _string_constants(path: Path) -> list[tuple[int, str]]:
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


@pytest.mark.parametrize("folder", ["app", "timeshare"])
def test_the_old_state_words_are_not_shown(folder: str) -> None:
    """The GUI's strings never show the internal state names as words ("released", "resident",
    "busy · ..."): they come from core/words.py."""
    found = [
        f"{path.name}:{line}: {text!r}"
        for path in sorted((ROOT / folder).glob("*.py"))
        for line, text in _string_constants(path)
        if OLD_WORDS.search(text) and " " in text  # a phrase, not an enum value or a key
    ]
    assert found == []


# ---- no exit codes, paths, byte dumps or env names in dialogs: they go under Details ----------

CRASHED = (
    "smollm2 crashed 3 times within 60 s (last exit status -9); see its log "
    "/home/u/.local/state/timeshare/log/smollm2.log, then start it again"
)
NOT_GGUF = (
    "model file /tmp/m/x.gguf is not a GGUF file (it starts with 'hell', not 'GGUF'): "
    "choose a .gguf model file"
)
DEVELOPER = re.compile(r"exit status|/tmp/|/home/|'hell'|\bpid\b|TIMESHARE_|`")


def test_plain_reasons_keep_the_sentence_and_drop_the_details() -> None:
    assert strings.plain_reason(CRASHED) == "smollm2 crashed 3 times within 60 s; restart it"
    assert strings.plain_reason("restarting in 2 s after a crash (exit status 9)") == (
        "restarting in 2 s after a crash"
    )
    assert strings.plain_reason(NOT_GGUF) == "the model file is not a GGUF file: choose a .gguf model file"
    zip_start = "the bytes 50 4b 03 04, not 'GGUF'; it looks like a zip)"
    zipped = NOT_GGUF.replace("'hell', not 'GGUF')", zip_start)
    assert strings.plain_reason(zipped) == (
        "the model file is not a GGUF file (it looks like a zip): choose a .gguf model file"
    )


def test_a_crashed_models_bar_says_it_in_words_with_the_rest_under_details(qtbot: object) -> None:
    from timeshare.app.model_problem import ModelProblemBar

    bar = ModelProblemBar()
    qtbot.addWidget(bar)  # type: ignore[attr-defined]
    failed = ModelStatus(
        id="smollm2",
        name="SmolLM2",
        path="/tmp/m/x.gguf",
        state=ModelState.FAILED,
        reason=CRASHED,
        log_tail=("Traceback (most recent call last):", "SIGKILL"),
    )
    bar.show_for(failed, PoolSnapshot(models=(failed,)))
    assert "SmolLM2 crashed 3 times within 60 s; restart it" in bar.label.text()
    assert not DEVELOPER.search(bar.label.text())
    assert bar.details.isHidden() and not bar.details_button.isHidden()
    bar.details_button.click()
    assert not bar.details.isHidden()
    assert "exit status -9" in bar.details.text() and "SIGKILL" in bar.details.text()


def test_the_cannot_start_dialogs_keep_paths_and_pids_under_details(qtbot: object) -> None:
    from timeshare.app.application import fatal_box

    running = "another Timeshare (pid 4242) holds /run/user/0/timeshare: set TIMESHARE_HOME"
    box = fatal_box("Timeshare is already running", strings.ALREADY_RUNNING, running)
    assert not DEVELOPER.search(box.text()) and box.detailedText() == running
    for text in (strings.SETTINGS_FILE_BROKEN, strings.CONVERSATIONS_UNREADABLE):
        assert not DEVELOPER.search(text)
