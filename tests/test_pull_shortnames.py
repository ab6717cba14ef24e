"""`timeshare pull NAME` with Ollama-style short names (core/pull/shortnames.py), against the local
fake hub the pull tests use; offline, the error says "no network" in words."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hub_util import FakeHub, Repo, make_gguf
from timeshare.core.config.files import load_config
from timeshare.core.errors import DownloadError
from timeshare.core.pull import remote, shortnames, sources

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.close()


@pytest.mark.parametrize(
    ("typed", "repo", "quant"),
    [
        ("llama3.2", "bartowski/Llama-3.2-3B-Instruct-GGUF", "Q4_K_M"),
        ("llama3.2:1b", "bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M"),
        ("qwen3:8b", "Qwen/Qwen3-8B-GGUF", "Q4_K_M"),
        ("Qwen3:latest", "Qwen/Qwen3-8B-GGUF", "Q4_K_M"),
        ("gemma3:4b", "ggml-org/gemma-3-4b-it-GGUF", "Q4_K_M"),
        ("hf.co/qwen3:0.6b", "Qwen/Qwen3-0.6B-GGUF", "Q8_0"),
    ],
)
def test_short_names_map_to_a_repo_and_a_default_quantisation(typed: str, repo: str, quant: str) -> None:
    assert sources.parse_source(typed) == sources.HubSource(repo, quant=quant)


def test_quant_picks_another_and_unknown_names_say_what_there_is() -> None:
    assert sources.parse_source("qwen3:8b", "Q8_0") == sources.HubSource("Qwen/Qwen3-8B-GGUF", quant="Q8_0")
    with pytest.raises(
        ValueError, match=r"qwen3 comes in 0\.6b, 4b, 8b, 14b, 32b here \(e\.g\. qwen3:0\.6b\)"
    ):
        sources.parse_source("qwen3:70b")
    with pytest.raises(ValueError, match=r"is not a model source: give a short name \(llama3\.2, "):
        sources.parse_source("llama9")
    # a repo is still a repo
    assert sources.parse_source("user/repo:Q4_0") == sources.HubSource("user/repo", quant="Q4_0")


def test_every_default_size_is_in_the_table_and_the_readme_lists_them() -> None:
    for family, size in shortnames.DEFAULT_SIZES.items():
        assert f"{family}:{size}" in shortnames.SHORT_NAMES
    readme = (ROOT / "README.md").read_text()
    for name, short in shortnames.SHORT_NAMES.items():
        assert f"| `{name}` | `{short.repo_id}` | {short.quant} |" in readme, name


def test_pull_a_short_name_from_the_hub(hub: FakeHub, tmp_path: Path) -> None:
    d = tmp_path / "g"
    hub.repos["Qwen/Qwen3-8B-GGUF"] = Repo(
        {
            "Qwen3-8B-Q4_K_M.gguf": make_gguf(d / "a.gguf", name="Qwen3 8B", floats=8192, file_type=15),
            "Qwen3-8B-Q8_0.gguf": make_gguf(d / "b.gguf", name="Qwen3 8B", floats=16384, file_type=7),
        },
        licence="apache-2.0",
    )
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    config = home / "config" / "config.toml"
    config.write_text("[api]\nport = 8385\n")
    env = {**os.environ, "TIMESHARE_HOME": str(home)}
    env.pop("TIMESHARE_VRAM_ARENA", None)
    done = subprocess.run(
        [sys.executable, "-m", "timeshare", "pull", "qwen3:8b"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Getting Qwen3-8B-Q4_K_M.gguf (Q4_K_M" in done.stderr  # the default: no question asked
    (model,) = load_config(config).models
    assert model.path.endswith("Qwen3-8B-Q4_K_M.gguf")


#: what an offline error must not show people
DEVELOPER = re.compile(r"ConnectError|Errno|HF_ENDPOINT|Name or service")


def test_offline_says_no_network_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://no-such-host.invalid")
    with pytest.raises(DownloadError) as info:
        remote.list_source(sources.parse_source("qwen3:8b"))
    said = str(info.value)
    assert said.startswith("no network: no-such-host.invalid cannot be reached"), said
    assert not DEVELOPER.search(said), said


def test_a_server_that_is_not_there_is_said_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(DownloadError) as info:
        remote.list_source(sources.parse_source("user/repo"))
    said = str(info.value)
    assert said.startswith(f"could not connect to 127.0.0.1:{port}"), said
    assert not DEVELOPER.search(said), said
