"""scripts/build_progress.sh: the first build's progress as a percentage with the time left."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build_progress.sh"


def _sh(command: str) -> str:
    done = subprocess.run(
        ["sh", "-c", f". {SCRIPT}; {command}"], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


def test_the_time_left_is_the_pace_so_far() -> None:
    assert _sh("build_eta 600 70 193") == "36% (70/193), about 18 min left\n"
    assert _sh("build_eta 10 190 193") == "98% (190/193), less than a minute left\n"
    assert _sh("build_eta 0 0 193") == "0% (0/193)\n"
    assert _sh("build_eta 900 193 193") == "100% (193/193)\n"


def test_a_build_prints_percentages_and_a_failure_its_log(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    steps = 'for i in 1 2 3 4; do echo "[$i/4] Building CXX x.o"; sleep 1; done'
    out = _sh(f"build_with_progress {log} demo 1 sh -c '{steps}'")
    lines = out.splitlines()
    assert lines and all(line.startswith("    compiling ") and "%" in line for line in lines)
    assert "(4/4)" in out or "(3/4)" in out  # the last steps seen
    failed = subprocess.run(
        ["sh", "-c", f". {SCRIPT}; build_with_progress {log} demo 1 sh -c 'echo broken; exit 3'"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failed.returncode == 3 and "broken" in failed.stdout and "demo failed to build" in failed.stderr
