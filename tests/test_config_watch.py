"""A config file edited by hand is applied as `timeshare reload` applies it: the directory is
watched (saves are atomic renames), Timeshare's own saves are not applied again, an invalid file
is reported and the running config stays."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest
from _api_util import GEMMA, SMOL, serving, write_config
from _proc_util import wait_until
from timeshare.core.config.files import load_config, save_config
from timeshare.core.config.schema import Config
from timeshare.core.config.watch import ConfigWatcher
from timeshare.core.errors import ConfigError


def _rename_into_place(path: Path, text: str) -> None:
    """What an editor (or `sed -i`) does: write a temporary file, rename it over the old one."""
    tmp = path.with_name(path.name + ".tmp~")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_hand_edits_are_applied_own_saves_are_not_and_invalid_ones_are_reported(
    tmp_path: Path, smollm2_path: Path
) -> None:
    path = write_config(tmp_path / "conf" / "config.toml", [("a", smollm2_path)])
    applied: list[Config] = []
    invalid: list[ConfigError] = []
    lock = threading.Lock()

    def apply() -> None:
        config = load_config(path, check_paths=False)
        with lock:
            applied.append(config)

    def on_invalid(exc: ConfigError) -> None:
        with lock:
            invalid.append(exc)

    watcher = ConfigWatcher(path, apply, on_invalid).start()
    try:
        _rename_into_place(path, path.read_text() + f'\n[[models]]\nid = "b"\npath = "{smollm2_path}"\n')
        wait_until(lambda: len(applied) == 1, 20, "the renamed file to be applied")
        assert [m.id for m in applied[0].models] == ["a", "b"]

        # Timeshare's own save (the settings window's) is not applied a second time
        save_config(applied[0].__class__(models=applied[0].models[:1]), path)
        _rename_into_place(path.with_name("other.toml"), "x = 1\n")  # another file in the folder
        with path.open("a") as f:  # then a hand edit in place (no rename) is seen again
            f.write("# a comment\n")
        wait_until(lambda: len(applied) == 2, 20, "the in-place edit to be applied")
        assert [m.id for m in applied[1].models] == ["a"]

        _rename_into_place(path, "[[models]]\nid = 'no path'\n")
        wait_until(lambda: len(invalid) == 1, 20, "the invalid file to be reported")
        assert "models[0]" in str(invalid[0]) and len(applied) == 2
    finally:
        watcher.stop()


@pytest.mark.slow
def test_serve_applies_a_hand_edited_config(tmp_path: Path, smollm2_path: Path, gemma3_path: Path) -> None:
    home = tmp_path / "home"
    config = write_config(home / "conf" / "timeshare.toml", [(SMOL, smollm2_path)])
    with serving(home, config=config) as served:
        served.wait_ready([SMOL])
        _rename_into_place(
            config, config.read_text() + f'\n[[models]]\nid = "{GEMMA}"\npath = "{gemma3_path}"\n'
        )
        served.wait_ready([SMOL, GEMMA])
        _rename_into_place(config, "[[models]]\nid = 'broken'\n")
        wait_until(lambda: "the running config stays" in served.log_text(), 30, "the log line")
        status = httpx.get(f"{served.url}/timeshare/v1/status", timeout=30).json()
        assert [m["id"] for m in status["models"]] == [SMOL, GEMMA]
