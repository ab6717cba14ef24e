"""Get model… finds models: words search the hub for repositories with GGUF files (most downloaded
first, with their size in parameters), a pick lists its quantisations with sizes and whether they
fit the GPU budget; before any search the list offers the short-name table; offline the dialog
says "no network" in words. Against the local fake hub the pull tests use (tests/_hub_util.py)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hub_util import FakeHub, Repo, make_gguf
from PySide6.QtCore import Qt
from timeshare.core.errors import DownloadError
from timeshare.core.pull import search, shortnames
from timeshare.core.state import DeviceStatus, PoolSnapshot
from timeshare.core.util.units import human_bytes


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def quants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("quants")
    return {
        "q4": make_gguf(d / "a.gguf", name="Tiny", floats=8192, file_type=15),
        "q8": make_gguf(d / "b.gguf", name="Tiny", floats=16384, file_type=7),
        "f16": make_gguf(d / "c.gguf", name="Tiny", floats=32768, file_type=1),
    }


def _fill(hub: FakeHub, quants: dict[str, bytes]) -> None:
    hub.repos["tiny-org/Tiny-Coder-GGUF"] = Repo(
        {
            "Tiny-Coder-Q4_K_M.gguf": quants["q4"],
            "Tiny-Coder-Q8_0.gguf": quants["q8"],
            "Tiny-Coder-F16.gguf": quants["f16"],
        },
        downloads=900,
        parameters=135_000_000,
    )
    hub.repos["other/tiny-coder-GGUF"] = Repo({"tiny-coder-Q4_K_M.gguf": quants["q4"]}, downloads=50_000)
    hub.repos["tiny-org/Tiny-Coder"] = Repo({"model.safetensors": b"not a gguf"}, downloads=10**6)
    hub.repos["tiny-org/Tiny-Chat-GGUF"] = Repo({"Tiny-Chat-Q4_K_M.gguf": quants["q4"]}, downloads=10)


def test_search_lists_gguf_repos_most_downloaded_first(hub: FakeHub, quants: dict[str, bytes]) -> None:
    _fill(hub, quants)
    found = search.search_hub("tiny  coder")
    assert [f.repo_id for f in found] == ["other/tiny-coder-GGUF", "tiny-org/Tiny-Coder-GGUF"]
    assert found[1].describe() == "135 M parameters · llama · 900 downloads"
    asked = hub.seen("GET", "/api/models?")[-1].path
    assert "filter=gguf" in asked and "sort=downloads" in asked
    assert search.search_hub("nothing-like-it") == []
    with pytest.raises(ValueError, match="type what to search for"):
        search.search_hub("  ")


def test_each_hit_gets_its_gguf_sizes_per_quantisation_from_the_hub(
    hub: FakeHub, quants: dict[str, bytes]
) -> None:
    """The search listing tells no sizes: each hit's model info (``?blobs=true``) does, over HTTP
    from the fake hub; the sizes are the byte counts of the files it serves."""
    _fill(hub, quants)
    sizes = search.hub_sizes("tiny-org/Tiny-Coder-GGUF")
    assert sizes.problem == ""
    assert [(c.label, c.size) for c in sizes.choices] == [
        ("Q4_K_M", len(quants["q4"])),
        ("Q8_0", len(quants["q8"])),
        ("F16", len(quants["f16"])),
    ]
    asked = hub.seen("GET", "/api/models/tiny-org/Tiny-Coder-GGUF")
    assert asked and "blobs=true" in asked[-1].path  # huggingface_hub's files_metadata
    q4, q8, f16 = (human_bytes(len(quants[k])) for k in ("q4", "q8", "f16"))
    assert sizes.describe() == f"Q4_K_M {q4} · Q8_0 {q8} · F16 {f16}"
    # with a GPU budget known: which fit (the weights and a tenth for buffers)
    budget = int(len(quants["q8"]) * 1.5)
    assert sizes.describe(budget) == f"weights fit the GPU: Q4_K_M {q4}, Q8_0 {q8} · too big: F16 {f16}"
    assert sizes.describe(10) == f"too big: Q4_K_M {q4}, Q8_0 {q8}, F16 {f16}"
    # a repo gone since the search: why, in words, not an exception
    gone = search.hub_sizes("tiny-org/Gone-GGUF")
    assert gone.choices == () and "Gone-GGUF" in gone.problem
    assert gone.describe().startswith("sizes unknown: ")


def test_sizes_are_looked_up_for_every_hit_a_few_at_a_time(hub: FakeHub, quants: dict[str, bytes]) -> None:
    _fill(hub, quants)
    hits = [f.repo_id for f in search.search_hub("tiny")]
    got: list[search.Sizes] = []
    search.look_up_sizes(hits, got.append, workers=2)
    assert sorted(s.repo_id for s in got) == sorted(hits)  # each once
    by_repo = {s.repo_id: s for s in got}
    assert [c.label for c in by_repo["other/tiny-coder-GGUF"].choices] == ["Q4_K_M"]
    assert by_repo["tiny-org/Tiny-Chat-GGUF"].choices[0].size == len(quants["q4"])
    # once cancelled, nothing more is asked or handed on
    before = len(hub.seen("GET", "/api/models/"))
    cancel = threading.Event()
    cancel.set()
    late: list[search.Sizes] = []
    search.look_up_sizes(hits, late.append, cancel=cancel, workers=1)
    assert late == [] and len(hub.seen("GET", "/api/models/")) - before <= 1  # one under way at most


def test_suggestions_are_the_short_name_table() -> None:
    offered = search.suggestions()
    assert [s.name for s in offered] == list(shortnames.SHORT_NAMES)
    assert all(shortnames.resolve(s.source).repo_id == s.repo_id for s in offered)


#: what an offline error must not show people
DEVELOPER = re.compile(r"ConnectError|Errno|HF_ENDPOINT|Name or service")


def test_offline_search_says_no_network_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://no-such-host.invalid")
    with pytest.raises(DownloadError) as info:
        search.search_hub("qwen")
    said = str(info.value)
    assert said.startswith("no network: no-such-host.invalid cannot be reached"), said
    assert not DEVELOPER.search(said)


@pytest.mark.gui
def test_the_dialog_searches_picks_and_tells_what_fits(
    qtbot: Any, hub: FakeHub, quants: dict[str, bytes], tmp_path: Path
) -> None:
    from timeshare.app.get_model import WEIGHTS_FIT, GetModelDialog

    _fill(hub, quants)
    budget = int(len(quants["q8"]) * 1.5)  # Q4_K_M and Q8_0 fit, F16 not
    gpu = PoolSnapshot(devices=(DeviceStatus(0, "CUDA0", "20GB", budget_bytes=budget),))
    dialog = GetModelDialog(lambda: gpu, tmp_path / "config.toml")
    qtbot.addWidget(dialog)
    dialog.show()
    # before any search: the suggestions (the short names `timeshare pull` takes)
    assert dialog.found.count() == len(shortnames.SHORT_NAMES)
    assert dialog.found.item(0).text() == "llama3.2:1b\nbartowski/Llama-3.2-1B-Instruct-GGUF · Q4_K_M"

    qtbot.keyClicks(dialog.source, "tiny coder")
    qtbot.keyClick(dialog.source, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not dialog.busy and dialog.found.count() == 2, timeout=20000)
    assert "2 models with GGUF files match “tiny coder”" in dialog.found_label.text()
    assert (
        dialog.found.item(1)
        .text()
        .startswith("tiny-org/Tiny-Coder-GGUF\n135 M parameters · llama · 900 downloads\n")
    )
    # then each hit's sizes per quantisation, and which fit the GPU budget (the weights)
    q4, q8, f16 = (human_bytes(len(quants[k])) for k in ("q4", "q8", "f16"))
    sized = f"weights fit the GPU: Q4_K_M {q4}, Q8_0 {q8} · too big: F16 {f16}"
    qtbot.waitUntil(lambda: dialog.found.item(1).text().endswith(sized), timeout=20000)
    assert (
        dialog.found.item(1).text()
        == f"tiny-org/Tiny-Coder-GGUF\n135 M parameters · llama · 900 downloads\n{sized}"
    )
    qtbot.waitUntil(
        lambda: dialog.found.item(0).text().endswith(f"weights fit the GPU: Q4_K_M {q4}"), timeout=20000
    )  # its sizes come from the hub on another thread, as the other hit's did

    item = dialog.found.item(1)
    qtbot.mouseClick(
        dialog.found.viewport(), Qt.MouseButton.LeftButton, pos=dialog.found.visualItemRect(item).center()
    )
    qtbot.waitUntil(lambda: not dialog.busy and dialog.table.rowCount() == 3, timeout=20000)
    assert dialog.source.text() == "tiny-org/Tiny-Coder-GGUF"
    cells = [[dialog.table.item(r, c).text() for c in range(3)] for r in range(3)]
    assert [row[0] for row in cells] == ["Q4_K_M", "Q8_0", "F16"]
    assert [row[2] for row in cells] == [WEIGHTS_FIT, WEIGHTS_FIT, "too big"]  # against the budget

    dialog.source.setText("no such words at all")
    qtbot.mouseClick(dialog.lookup_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not dialog.busy and dialog.found.count() == 0, timeout=20000)
    assert "No model with GGUF files matches" in dialog.found_label.text()
    dialog.reject()


@pytest.mark.gui
def test_the_dialog_offline_says_no_network(
    qtbot: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from timeshare.app.get_model import GetModelDialog

    monkeypatch.setenv("HF_ENDPOINT", "http://no-such-host.invalid")
    dialog = GetModelDialog(PoolSnapshot, tmp_path / "config.toml", source="qwen coder")
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.mouseClick(dialog.lookup_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not dialog.busy and dialog.problem.isVisible(), timeout=20000)
    said = dialog.problem.text()
    assert said.startswith("no network:") and not DEVELOPER.search(said)
    assert dialog.found.count() == len(shortnames.SHORT_NAMES)  # the suggestions stay
    dialog.reject()
