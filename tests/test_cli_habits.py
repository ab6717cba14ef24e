"""The habits of Ollama and LM Studio users on the command line: the REPL's slash commands, the
verbs unload/stop/load/show/rm/reload, `run M "prompt"`, models named by display name or prefix,
and `ls`/`show` without a running instance."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _api_util import GEMMA, SMOL, Served, serve_env, serving_demo_models, woken

from timeshare.repl_commands import HELP, Session, handle


def _cli(home: Path, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeshare", *argv],
        env=serve_env(home),
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


# ---- the REPL's commands (no server) -------------------------------------------------------------


def test_slash_commands_are_never_sent_to_the_model() -> None:
    session = Session()
    model = lambda: "Model x\n"  # noqa: E731
    for line in ("/?", "/help"):
        out = handle(line, session, model)
        assert out.send is None and out.output == HELP
    for command in ("/set parameter", "/show", "/clear", "/bye"):
        assert command in HELP
    assert handle("/bye", session, model).exit and handle("/exit", session, model).exit
    assert handle("/nope", session, model).output.startswith("Unknown command '/nope'")
    assert handle("//etc/passwd is a path", session, model).send == "/etc/passwd is a path"
    assert handle("hello", session, model).send == "hello"

    assert "Set parameter 'num_predict'" in handle("/set parameter num_predict 7", session, model).output
    assert handle("/set parameter temperature 0.5", session, model).output
    assert session.parameters == {"max_tokens": 7, "temperature": 0.5}
    assert "not a valid value" in handle("/set parameter seed many", session, model).output
    assert "NAME one of" in handle("/set parameter bogus 1", session, model).output
    handle("/set system Answer in French.", session, model)
    session.messages += [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert session.request_messages("c") == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    shown = handle("/show", session, model).output
    assert "Model x" in shown and '"max_tokens": 7' in shown and "Answer in French." in shown
    assert handle("/clear", session, model).cleared and session.messages == []
    assert session.system == "Answer in French."  # /clear keeps the settings


# ---- without a running instance ------------------------------------------------------------------


def _config(path: Path, models: list[tuple[str, str, Path]]) -> Path:
    lines = []
    for model_id, name, file in models:
        lines += ["[[models]]", f'id = "{model_id}"', f'name = "{name}"', f'path = "{file}"', ""]
    path.write_text("\n".join(lines))
    return path


def test_ls_and_show_without_a_running_instance(tmp_path: Path, smollm2_path: Path) -> None:
    home = tmp_path / "home"
    config = _config(
        tmp_path / "c.toml",
        [
            ("smol-a", "Smol A", smollm2_path),
            ("smol-b", "Smol B", smollm2_path),
            ("gone", "Gone", tmp_path / "x.gguf"),
        ],
    )
    done = _cli(home, "--config", str(config), "ls")
    assert done.returncode == 0, done.stderr
    assert "Timeshare is not running" in done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["smol-a", "smol-b", "gone"]
    assert all("not running" in line for line in done.stdout.splitlines()[1:])

    shown = _cli(home, "--config", str(config), "show", "smol b")  # a display name, any case
    assert shown.returncode == 0, shown.stderr
    assert (
        "smol-b (Smol B)" in shown.stdout
        and "Q4_1" in shown.stdout
        and "Capabilities  completion, chat" in shown.stdout
        # issue 39: n_ctx and parallel left unset are fitted when the model loads, and show says so
        and "auto tokens × auto sequences (trained: 8192), KV cache default" in shown.stdout
        and "settings left on auto are fitted to the device when the model loads" in shown.stdout
    )
    assert "Name in file" in shown.stdout and "<|im_start|>" in shown.stdout  # general.name, the template
    ambiguous = _cli(home, "--config", str(config), "show", "smol")
    assert (
        ambiguous.returncode == 1 and "'smol' could be smol-a (Smol A), smol-b (Smol B)" in ambiguous.stderr
    )
    missing = _cli(home, "--config", str(config), "show", "gon")  # a unique prefix; its file is gone
    assert missing.returncode == 0 and "cannot read the file" in missing.stdout


def test_rm_removes_the_model_and_deletes_its_file_only_when_asked(
    tmp_path: Path, smollm2_path: Path
) -> None:
    home = tmp_path / "home"
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_path, copy)
    config = _config(tmp_path / "c.toml", [("keep", "Keep", smollm2_path), ("copy", "Copy", copy)])
    refused = _cli(home, "--config", str(config), "rm", "copy", "--delete-file")  # no terminal to ask on
    assert refused.returncode == 2 and "nothing removed" in refused.stderr
    assert copy.exists() and 'id = "copy"' in config.read_text()
    done = _cli(home, "--config", str(config), "rm", "cop", "--delete-file", "--yes")
    assert done.returncode == 0, done.stderr
    assert f"Removed copy (Copy) from {config}" in done.stdout and not copy.exists()
    assert 'id = "copy"' not in config.read_text() and 'id = "keep"' in config.read_text()
    kept = _cli(home, "--config", str(config), "rm", "keep")
    assert kept.returncode == 0 and smollm2_path.exists()


# ---- against a running instance ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("habits-home")
    # no config file: the demo models, with their display names
    with serving_demo_models(home, smollm2_path, gemma3_path, config_file=False) as server:
        yield server


def _state(served: Served, model: str) -> str:
    return str(served.model_status(model)["state"])


@pytest.mark.slow
def test_run_with_a_prompt_answers_once_and_the_verbs_take_display_names(served: Served) -> None:
    done = _cli(
        served.home, "run", "SmolLM2-135M-Instruct", "Say hi.", "--max-tokens", "8", "--temperature", "0"
    )
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    piped = _cli(served.home, "run", "smol", "--max-tokens", "8", "--temperature", "0", stdin="Say hi.\n")
    assert piped.returncode == 0 and piped.stdout == done.stdout, piped.stderr  # stdin: the same one answer

    assert _cli(served.home, "load", "gemma-3").stdout in woken(GEMMA)
    unloaded = _cli(served.home, "unload", "Gemma-3-270M (base)", "--wait", "60")
    assert unloaded.stdout == f"{GEMMA}: unloaded (off the GPU, KV cache kept) (now set aside)\n", (
        unloaded.stderr
    )
    stopped = _cli(served.home, "stop", "gem", "--wait", "60")
    assert stopped.stdout == f"{GEMMA}: stopped (KV saved) (now stopped)\n", stopped.stderr
    loaded = _cli(served.home, "load", "gem", "--wait", "120")
    assert loaded.returncode == 0 and _state(served, GEMMA) == "resident", loaded.stdout + loaded.stderr

    shown = _cli(served.home, "show", "smol")
    assert shown.returncode == 0, shown.stderr
    assert f"Model         {SMOL} (SmolLM2-135M-Instruct)" in shown.stdout and "Gemma" not in shown.stdout
    reload = _cli(served.home, "reload")
    assert reload.returncode == 0 and SMOL in reload.stdout, reload.stderr
    unknown = _cli(served.home, "unload", "llama")
    assert unknown.returncode == 1 and "no model is called 'llama'" in unknown.stderr
