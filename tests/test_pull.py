"""Getting models (core/pull/, `timeshare pull`, the "Get model…" dialog) against a local server
that plays the Hugging Face hub and a plain file server (tests/_hub_util.py). Nothing reaches the
internet; the GGUFs are tiny real ones written with the gguf package."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _hub_util import GOOD_TOKEN, FakeHub, Repo, git_sha1, make_gguf, sha256
from PySide6.QtCore import QObject, Qt, Signal
from timeshare.core.config.files import load_config
from timeshare.core.errors import (
    CancelledError,
    ChooseQuantisationError,
    ConfigError,
    CorruptDownloadError,
    DownloadError,
    DownloadTooLargeError,
    NoSpaceError,
    RemoteAccessError,
    RemoteNotFoundError,
    UnsafeNameError,
    UnsupportedArchitectureError,
)
from timeshare.core.gguf import catalog
from timeshare.core.gguf.llama_archs import supported_architectures
from timeshare.core.pull import add, download, progress, remote, sources, verify
from timeshare.core.state import PoolSnapshot
from timeshare.core.util.units import human_bytes

REPO = "tiny-org/Tiny-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.05)
    yield server
    server.close()


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Tiny GGUFs: three quantisations of one model (sizes differ), a split model, odd ones."""
    d = tmp_path_factory.mktemp("ggufs")
    return {
        "q4": make_gguf(d / "a.gguf", name="Tiny", floats=8192, file_type=15),
        "q8": make_gguf(d / "b.gguf", name="Tiny", floats=16384, file_type=7),
        "f16": make_gguf(d / "c.gguf", name="Tiny", floats=32768, file_type=1),
        "mit": make_gguf(d / "d.gguf", name="Licensed", licence="MIT", floats=4096),
        "part1": make_gguf(d / "e.gguf", name="Split", floats=8192),
        "part2": make_gguf(d / "f.gguf", name="Split", floats=8192),
        "alien": make_gguf(d / "g.gguf", arch="nosucharch", name="Alien", floats=65536),
        "mmproj": make_gguf(d / "h.gguf", arch="clip", name="Projector", floats=1024),
    }


def _three_quants(ggufs: dict[str, bytes]) -> Repo:
    return Repo(
        {
            "Tiny-Q8_0.gguf": ggufs["q8"],
            "Tiny-Q4_K_M.gguf": ggufs["q4"],
            "Tiny-F16.gguf": ggufs["f16"],
            "mmproj-Tiny-F16.gguf": ggufs["mmproj"],
            "README.md": b"# Tiny\n",
        },
        commit=COMMIT,
        licence="apache-2.0",
    )


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[api]\nport = 8385\n")
    return path


# ---- sources -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("user/repo", sources.HubSource("user/repo")),
        ("user/repo:Q4_K_M", sources.HubSource("user/repo", quant="Q4_K_M")),
        ("hf.co/user/repo:q8_0", sources.HubSource("user/repo", quant="q8_0")),
        ("huggingface.co/user/repo", sources.HubSource("user/repo")),
        ("user/repo/sub/x-Q4_0.gguf", sources.HubSource("user/repo", "sub/x-Q4_0.gguf")),
        (
            "https://huggingface.co/user/repo/resolve/main/x.gguf",
            sources.HubSource("user/repo", "x.gguf", revision="main"),
        ),
        ("https://hf.co/user/repo/blob/v1/x.gguf", sources.HubSource("user/repo", "x.gguf", revision="v1")),
        ("https://example.com/m/x.gguf", sources.UrlSource("https://example.com/m/x.gguf")),
    ],
)
def test_sources_parse(text: str, expected: sources.Source) -> None:
    assert sources.parse_source(text) == expected


@pytest.mark.parametrize(
    ("text", "sentence"),
    [
        ("", "no source given: a Hugging Face repo (user/repo) or the URL of a .gguf file"),
        ("justaname", "'justaname' is not a model source: give a short name (llama3.2, "),  # or a repo
        ("user/repo/README.md", "'README.md' is not a .gguf file: name a GGUF file of the repo"),
        ("https://example.com/page", "does not name a .gguf file: give the URL of the GGUF file itself"),
        ("user/repo:", "nothing follows the ':'; give a quantisation, e.g. user/repo:Q4_K_M"),
        ("-x/y", "'-x/y' is not a model source"),
        # a mistyped scheme is echoed whole (it was cut to 'htp://127.0.0.1')
        ("htp://127.0.0.1:8999/x.gguf", "'htp://127.0.0.1:8999/x.gguf' is not a model source: htp:// is not"),
    ],
)
def test_bad_sources_say_what_a_source_is(text: str, sentence: str) -> None:
    with pytest.raises(ValueError, match=re.escape(sentence)):
        sources.parse_source(text)


def test_quant_given_twice_must_agree() -> None:
    assert sources.parse_source("u/r", "Q4_K_M") == sources.HubSource("u/r", quant="Q4_K_M")
    assert sources.parse_source("u/r:q4_k_m", "Q4_K_M").quant == "q4_k_m"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="two quantisations"):
        sources.parse_source("u/r:Q8_0", "Q4_K_M")


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("qwen2.5-0.5b-instruct-q8_0.gguf", "Q8_0"),
        ("gemma-3-270m-it-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
        ("model.IQ4_XS.gguf", "IQ4_XS"),
        ("sub/model-bf16-00001-of-00003.gguf", "BF16"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("plain.gguf", ""),
    ],
)
def test_quant_labels_come_from_file_names(name: str, label: str) -> None:
    assert sources.quant_label(name) == label


def test_architectures_come_from_the_installed_llama_cpp() -> None:
    support = supported_architectures()
    assert support.exact, support.source  # read from libllama itself, not the fallback table
    assert {"llama", "gemma3", "qwen2"} <= support.names
    assert support.supports("llama") and not support.supports("nosucharch")
    assert not support.supports("clip")  # a vision projector: not a chat model


# ---- the hub -------------------------------------------------------------------------------


def test_a_repo_lists_its_quantisations_and_pulls_the_one_asked_for(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    listing = remote.list_source(sources.parse_source(REPO))
    assert [c.label for c in listing.choices] == ["Q4_K_M", "Q8_0", "F16"]  # by size; mmproj left out
    assert [c.size for c in listing.choices] == [len(ggufs["q4"]), len(ggufs["q8"]), len(ggufs["f16"])]
    assert listing.licence == "apache-2.0"
    with pytest.raises(ChooseQuantisationError) as asked:
        sources.choose(listing)
    assert asked.value.choices == ("Q4_K_M", "Q8_0", "F16")
    with pytest.raises(RemoteNotFoundError, match="no quantisation Q2_K; it has: Q4_K_M, Q8_0, F16"):
        sources.choose(listing, "Q2_K")

    choice = sources.choose(listing, "q8_0")
    seen: list[progress.Progress] = []
    result = download.pull(listing, choice, progress=seen.append)

    # the Hugging Face cache layout, so `hf`, llama.cpp and the catalog share the file
    storage = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF"
    digest = sha256(ggufs["q8"])
    assert result.path == storage / "snapshots" / COMMIT / "Tiny-Q8_0.gguf"
    assert result.path.is_symlink() and os.readlink(result.path) == f"../../blobs/{digest}"
    assert (storage / "blobs" / digest).read_bytes() == ggufs["q8"]
    assert (storage / "refs" / "main").read_text() == COMMIT
    assert not list((storage / "blobs").glob("*.incomplete"))
    found = catalog.scan(["hf"], hf=tmp_path / "hf" / "hub")
    assert [e.path for e in found] == [str(result.path)]

    assert result.entry.architecture == "llama" and result.entry.quantisation == "Q8_0"
    assert result.entry.licence == "apache-2.0"  # the GGUF names none: the repo card's
    assert result.downloaded == len(ggufs["q8"]) and result.architecture_checked
    assert seen and seen[-1].done == seen[-1].total == len(ggufs["q8"])
    # the file came from the "CDN" host, without the hub's token
    cdn = hub.seen("GET", "/cdn/")
    assert len(cdn) == 1 and cdn[0].auth is None

    # pulled again: nothing is downloaded, the cached file is checked and used
    again = download.pull(listing, choice)
    assert again.path == result.path and again.downloaded == 0
    assert len(hub.seen("GET", "/cdn/")) == 1


def test_the_model_goes_into_the_config_once(hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q4_K_M"))
    result = download.pull(listing, sources.choose(listing))
    config_path = _config(tmp_path)
    _, model, added = add.add_to_config(result, config_path)
    # named from what was pulled (the repo and the quantisation), not from the GGUF's general.name
    assert added and model.id == "tiny-q4_k_m" and model.name == "Tiny Q4_K_M"
    assert model.path == str(result.path) and model.licence == "apache-2.0"
    assert load_config(config_path).models == (model,)
    # the same file again: left as it is; another id for it is refused only when taken
    _, same, added_again = add.add_to_config(result, config_path)
    assert not added_again and same == model
    assert len(load_config(config_path).models) == 1
    _, renamed, added_renamed = add.add_to_config(result, config_path, model_id="tiny-two")
    assert added_renamed and renamed.id == "tiny-two"
    assert renamed.name == "Tiny Q4_K_M (2)"  # display names stay unique too
    with pytest.raises(ConfigError, match="--name: 'tiny q4_k_m' is already"):
        add.add_to_config(result, config_path, model_id="tiny-three", name="tiny q4_k_m")
    with pytest.raises(ConfigError, match="--id: 'Tiny' may contain only"):
        add.add_to_config(result, config_path, model_id="Tiny")
    _, named, _ = add.add_to_config(result, config_path, model_id="tiny-three", name="My tiny")
    assert (named.id, named.name) == ("tiny-three", "My tiny")


def test_the_repos_vision_projector_comes_beside_the_model(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    """Issue 41: a repo's mmproj-*.gguf is listed apart from the quantisations, pulled beside the
    model (the F16 one of several), checked to be a projector (clip), named by the model's entry
    (mmproj) in the config, and paired with the model by the catalog."""
    repo = _three_quants(ggufs)
    repo.files["mmproj-Tiny-Q8_0.gguf"] = make_gguf(tmp_path / "q.gguf", arch="clip", name="P8", floats=512)
    hub.repos[REPO] = repo
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q4_K_M"))
    assert sorted(f.name for f in listing.projectors) == ["mmproj-Tiny-F16.gguf", "mmproj-Tiny-Q8_0.gguf"]
    projector = sources.projector_choice(listing)
    assert projector is not None and projector.filename == "mmproj-Tiny-F16.gguf"
    result = download.pull(listing, sources.choose(listing))
    got = download.pull_projector(listing)
    assert got is not None and got.path.parent == result.path.parent  # the same snapshot
    assert got.entry.architecture == "clip" and got.path.read_bytes() == ggufs["mmproj"]
    config_path = _config(tmp_path)
    _, model, added = add.add_to_config(result, config_path, mmproj=got.path)
    assert added and model.mmproj == str(got.path)
    assert load_config(config_path).model(model.id).mmproj == str(got.path)  # type: ignore[union-attr]
    found = catalog.scan(["hf"], hf=tmp_path / "hf" / "hub")
    assert [(e.path, e.mmproj) for e in found] == [(str(result.path), str(got.path))]
    # a "projector" that is a language model is refused (and deleted)
    hub.repos[REPO].files["mmproj-Tiny-F16.gguf"] = ggufs["q4"]
    other = remote.list_source(sources.parse_source(f"{REPO}:Q4_K_M"))
    with pytest.raises(UnsupportedArchitectureError, match="not a vision projector"):
        download.pull_projector(other, dest_dir=tmp_path / "elsewhere")
    assert not list((tmp_path / "elsewhere").glob("*.gguf"))


def test_a_file_named_in_a_repo_or_a_url_is_named_by_its_stem(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    config_path = _config(tmp_path)
    listing = remote.list_source(sources.parse_source(f"{REPO}/Tiny-Q8_0.gguf"))
    result = download.pull(listing, sources.choose(listing))
    _, model, _ = add.add_to_config(result, config_path)
    assert (model.id, model.name) == ("tiny-q8_0", "Tiny-Q8_0")


def test_without_a_config_file_the_demo_models_stay(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_path: Path
) -> None:
    from timeshare.core.config import demo
    from timeshare.core.config.schema import ModelConfig

    demo_model = ModelConfig(id="smollm2-135m-instruct", path=str(smollm2_path), licence="Apache-2.0")
    monkeypatch.setattr(demo, "demo_model_configs", lambda: (demo_model,))
    hub.repos[REPO] = Repo({"Tiny-Q4_K_M.gguf": ggufs["mit"]}, commit=COMMIT)
    listing = remote.list_source(sources.parse_source(REPO))
    result = download.pull(listing, sources.choose(listing))
    assert result.entry.licence == "MIT"  # the GGUF's own licence
    target = tmp_path / "new" / "config.toml"
    add.add_to_config(result, target)
    ids = [m.id for m in load_config(target).models]
    assert ids == ["smollm2-135m-instruct", "tiny-q4_k_m"]


def test_a_split_model_downloads_whole(hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path) -> None:
    hub.repos[REPO] = Repo(
        {
            "Q4_K_M/Split-Q4_K_M-00001-of-00002.gguf": ggufs["part1"],
            "Q4_K_M/Split-Q4_K_M-00002-of-00002.gguf": ggufs["part2"],
            "Split-Q8_0-00001-of-00002.gguf": ggufs["part1"],  # incomplete: not offered
        },
        commit=COMMIT,
    )
    listing = remote.list_source(sources.parse_source(REPO))
    assert [(c.label, len(c.files)) for c in listing.choices] == [("Q4_K_M", 2)]
    result = download.pull(listing, listing.choices[0])
    snap = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "snapshots" / COMMIT / "Q4_K_M"
    assert result.files == (
        snap / "Split-Q4_K_M-00001-of-00002.gguf",
        snap / "Split-Q4_K_M-00002-of-00002.gguf",
    )
    assert result.path == result.files[0]
    assert result.entry.size == len(ggufs["part1"]) + len(ggufs["part2"])
    # naming the second part pulls the whole model too
    by_part = remote.list_source(sources.parse_source(f"{REPO}/Q4_K_M/Split-Q4_K_M-00002-of-00002.gguf"))
    assert [len(c.files) for c in by_part.choices] == [2]


def test_dir_puts_hub_files_outside_the_cache_and_resumes_there(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.drop_after["Tiny-Q8_0.gguf"] = 16384
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q8_0"))
    target = tmp_path / "models"
    result = download.pull(listing, sources.choose(listing), dest_dir=target, chunk_size=4096)
    assert result.path == target / "Tiny-Q8_0.gguf" and result.path.read_bytes() == ggufs["q8"]
    assert result.entry.source == "file" and result.entry.origin == REPO
    assert sorted(p.name for p in target.iterdir()) == ["Tiny-Q8_0.gguf"]  # no partial, no sidecar
    assert not (tmp_path / "hf" / "hub").exists()
    assert [r.range for r in hub.seen("GET", "/cdn/")] == [None, "bytes=16384-"]


def test_a_dropped_connection_resumes_where_it_stopped(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.drop_after["Tiny-F16.gguf"] = 40960  # a multiple of the chunk size
    listing = remote.list_source(sources.parse_source(f"{REPO}:F16"))
    result = download.pull(listing, sources.choose(listing), chunk_size=4096)
    assert result.path.read_bytes() == ggufs["f16"]
    assert [r.range for r in hub.seen("GET", "/cdn/")] == [None, "bytes=40960-"]


def test_cancel_keeps_what_was_downloaded_and_the_next_pull_resumes(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.delay_per_chunk = 0.02  # 8 KiB every 20 ms: progress reports come mid-file
    listing = remote.list_source(sources.parse_source(f"{REPO}:F16"))
    choice = sources.choose(listing)
    cancel = threading.Event()

    def stop_midway(p: progress.Progress) -> None:
        if p.done >= 40000:
            cancel.set()

    with pytest.raises(CancelledError):
        download.pull(listing, choice, progress=stop_midway, cancel=cancel, chunk_size=4096)
    blobs = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs"
    (partial,) = blobs.glob("*.incomplete")
    kept = partial.stat().st_size
    assert 40000 <= kept < len(ggufs["f16"])
    assert not list(blobs.glob(sha256(ggufs["f16"])))  # never used before it is whole

    hub.faults.delay_per_chunk = 0
    result = download.pull(listing, choice, chunk_size=4096)
    assert result.path.read_bytes() == ggufs["f16"]
    assert result.downloaded == len(ggufs["f16"]) - kept
    assert hub.seen("GET", "/cdn/")[-1].range == f"bytes={kept}-"
    assert not partial.exists()


def test_a_corrupted_download_is_refused_and_deleted(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    bad = bytearray(ggufs["q4"])
    bad[-100] ^= 0xFF  # one bit flipped in the tensor data: same size, another sha256
    hub.faults.serve_instead["Tiny-Q4_K_M.gguf"] = bytes(bad)
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q4_K_M"))
    with pytest.raises(CorruptDownloadError, match="sha256"):
        download.pull(listing, sources.choose(listing))
    storage = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF"
    assert not [p for p in (storage / "blobs").iterdir() if not p.name.endswith(".lock")]
    assert not (storage / "snapshots").exists() or not list((storage / "snapshots").rglob("*.gguf"))


def test_a_short_download_is_refused(hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.announce_size["Tiny-Q4_K_M.gguf"] = len(ggufs["q4"]) + 1000
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q4_K_M"))
    with pytest.raises(CorruptDownloadError, match=f"arrived with {len(ggufs['q4'])} bytes"):
        download.pull(listing, sources.choose(listing))
    blobs = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs"
    assert not [p for p in blobs.iterdir() if not p.name.endswith(".lock")]


def test_an_architecture_llama_cpp_cannot_load_is_refused_before_the_download(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify, "PEEK_BYTES", 4096)
    hub.repos[REPO] = Repo({"Alien-F32.gguf": ggufs["alien"]}, commit=COMMIT)
    listing = remote.list_source(sources.parse_source(REPO))
    with pytest.raises(UnsupportedArchitectureError, match=r"'nosucharch'.*cannot load"):
        download.pull(listing, listing.choices[0], chunk_size=4096)
    blobs = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs"
    assert not [p for p in blobs.iterdir() if not p.name.endswith(".lock")]


def test_a_missing_repo_and_a_gated_one_say_what_to_do(
    hub: FakeHub, ggufs: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        RemoteNotFoundError, match=r"tiny-org/nope was not found on http://127.0.0.1:.*check the name"
    ):
        remote.list_source(sources.parse_source("tiny-org/nope"))
    hub.repos[REPO] = Repo({"Tiny-Q4_K_M.gguf": ggufs["q4"]}, commit=COMMIT, gated=True)
    listing = remote.list_source(sources.parse_source(REPO))
    assert listing.gated
    with pytest.raises(RemoteAccessError, match=r"gated repository: accept its conditions.*HF_TOKEN"):
        download.pull(listing, listing.choices[0])
    assert hub.seen("HEAD", "/resolve/")[-1].auth is None
    with pytest.raises(RemoteNotFoundError, match=r"has no GGUF file other.gguf"):
        remote.list_source(sources.parse_source(f"{REPO}/other.gguf"))
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)  # the token from its usual place
    result = download.pull(listing, listing.choices[0])
    assert result.path.read_bytes() == ggufs["q4"]


def test_no_space_left_is_a_clear_error(
    hub: FakeHub, ggufs: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    monkeypatch.setattr(download, "_free_bytes", lambda folder: 10_000)
    listing = remote.list_source(sources.parse_source(f"{REPO}:F16"))
    with pytest.raises(NoSpaceError, match=r"not enough disk space .* Free some space"):
        download.pull(listing, sources.choose(listing))
    assert not hub.seen("GET", "/cdn/")


# ---- plain URLs ----------------------------------------------------------------------------


def test_a_url_downloads_into_the_models_folder(
    hub: FakeHub, ggufs: dict[str, bytes], timeshare_home: Path
) -> None:
    hub.files["Tiny-Q4_K_M.gguf"] = ggufs["q4"]
    hub.faults.drop_after["Tiny-Q4_K_M.gguf"] = 8192
    listing = remote.list_source(sources.parse_source(f"{hub.url}/files/Tiny-Q4_K_M.gguf"))
    result = download.pull(listing, sources.choose(listing), chunk_size=4096)
    assert result.path == timeshare_home / "data" / "models" / "Tiny-Q4_K_M.gguf"
    assert result.path.read_bytes() == ggufs["q4"]
    assert [r.range for r in hub.seen("GET", "/files/")] == [None, "bytes=8192-"]
    assert sorted(p.name for p in result.path.parent.iterdir()) == ["Tiny-Q4_K_M.gguf"]


def test_a_url_split_model_and_dir(hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path) -> None:
    hub.files["S-Q4_0-00001-of-00002.gguf"] = ggufs["part1"]
    hub.files["S-Q4_0-00002-of-00002.gguf"] = ggufs["part2"]
    listing = remote.list_source(sources.parse_source(f"{hub.url}/files/S-Q4_0-00002-of-00002.gguf"))
    result = download.pull(listing, sources.choose(listing), dest_dir=tmp_path / "mine")
    assert [p.name for p in result.files] == ["S-Q4_0-00001-of-00002.gguf", "S-Q4_0-00002-of-00002.gguf"]
    assert result.path.parent == tmp_path / "mine" and result.files[1].read_bytes() == ggufs["part2"]


def test_a_url_that_is_not_a_gguf_is_refused(hub: FakeHub, timeshare_home: Path) -> None:
    hub.files["page.gguf"] = b"<!doctype html><html><body>Download page</body></html>" * 50
    listing = remote.list_source(sources.parse_source(f"{hub.url}/files/page.gguf"))
    with pytest.raises(CorruptDownloadError, match="not a GGUF model file"):
        download.pull(listing, sources.choose(listing))
    assert list((timeshare_home / "data" / "models").iterdir()) == []


def test_a_url_404_and_401_say_so(hub: FakeHub) -> None:
    with pytest.raises(RemoteNotFoundError, match="was not found \\(HTTP 404\\)"):
        remote.list_source(sources.parse_source(f"{hub.url}/files/missing.gguf"))
    with pytest.raises(RemoteAccessError, match="refused access \\(HTTP 401\\)"):
        remote.list_source(sources.parse_source(f"{hub.url}/files/private/x.gguf"))


# ---- the command ---------------------------------------------------------------------------


def _cli(home: Path, *argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env, "TIMESHARE_HOME": str(home)}
    full.pop("TIMESHARE_VRAM_ARENA", None)
    return subprocess.run(
        [sys.executable, "-m", "timeshare", *argv],
        capture_output=True,
        text=True,
        env=full,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


def test_the_command_pulls_adds_and_lists_quantisations(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    home = tmp_path / "home"
    config = _config(home / "config")
    env = {k: os.environ[k] for k in ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HUB_CACHE")}

    asked = _cli(home, "pull", REPO, env=env)
    assert asked.returncode == 2, asked.stderr
    assert "has 3 quantisations" in asked.stderr and "--quant" in asked.stderr
    assert "Q4_K_M" in asked.stderr and "Q8_0" in asked.stderr

    done = _cli(home, "pull", f"hf.co/{REPO}", "--quant", "Q4_K_M", "--id", "tiny", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Added model tiny (Tiny Q4_K_M, {tmp_path / 'hf' / 'hub'}")
    assert (
        "Checked size, sha256, GGUF header and architecture: llama, Q4_K_M, licence apache-2.0" in done.stderr
    )
    assert "No running Timeshare to reload" in done.stderr
    assert "Tiny-Q4_K_M.gguf" in done.stderr and "100%" in done.stderr  # progress lines on stderr
    (model,) = load_config(config).models
    assert model.id == "tiny" and model.licence == "apache-2.0"

    missing = _cli(home, "pull", "tiny-org/nope", env=env)
    assert missing.returncode == 1
    assert missing.stderr.strip().endswith(
        "if it is private, log in with `hf auth login` or set HF_TOKEN to a token with read access"
    )
    bad = _cli(home, "pull", "not-a-source", env=env)
    assert bad.returncode == 2 and "is not a model source" in bad.stderr


@pytest.mark.slow
def test_a_running_instance_picks_the_model_up(hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path) -> None:
    from _api_util import serving

    hub.repos[REPO] = _three_quants(ggufs)
    home = tmp_path / "home"
    _config(home / "config")
    env = {k: os.environ[k] for k in ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HUB_CACHE")}
    with serving(home) as served:
        done = _cli(home, "pull", f"{REPO}:Q4_K_M", env=env)
        assert done.returncode == 0, done.stderr
        assert "The running Timeshare reloaded its configuration and starts tiny-q4_k_m" in done.stderr
        status = httpx.get(f"{served.url}/timeshare/v1/status").json()
        assert [m["id"] for m in status["models"]] == ["tiny-q4_k_m"]
        # a broken config file is refused with its problems, and nothing changes
        (home / "config" / "config.toml").write_text("[[models]]\nid = 'x'\n")
        refused = httpx.post(f"{served.url}/timeshare/v1/reload")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_config"
        status = httpx.get(f"{served.url}/timeshare/v1/status").json()
        assert [m["id"] for m in status["models"]] == ["tiny-q4_k_m"]


# ---- the dialog ----------------------------------------------------------------------------


class _StubBridge(QObject):
    """What SettingsDialog reads of a PoolBridge: the snapshot and its change signal."""

    snapshot_changed = Signal(object)

    def __init__(self) -> None:
        super().__init__()
        self.snapshot = PoolSnapshot()


def _look_up(qtbot: Any, dialog: Any, rows: int) -> None:
    qtbot.mouseClick(dialog.lookup_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.table.rowCount() == rows and not dialog.busy, timeout=20000)


@pytest.mark.gui
def test_the_dialog_lists_downloads_and_adds_the_model(
    qtbot: Any, hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    from timeshare.app.get_model import GetModelDialog

    hub.repos[REPO] = _three_quants(ggufs)
    config_path = _config(tmp_path)
    dialog = GetModelDialog(PoolSnapshot, config_path, source=f"hf.co/{REPO}")
    qtbot.addWidget(dialog)
    dialog.show()
    _look_up(qtbot, dialog, 3)
    cells = [[dialog.table.item(r, c).text() for c in range(4)] for r in range(3)]
    assert [row[0] for row in cells] == ["Q4_K_M", "Q8_0", "F16"]
    assert (
        cells[1][1] == human_bytes(len(ggufs["q8"]))
        and cells[1][2] == "unknown"
        and cells[1][3] == "Tiny-Q8_0.gguf"
    )
    assert "Licence (repo card): apache-2.0" in dialog.info.text()
    assert "Fit unknown" in dialog.info.text()
    selected = dialog.selected()
    assert selected is not None and selected.label == "Q4_K_M"  # the usual default
    dialog.table.selectRow(1)
    with qtbot.waitSignals([dialog.pulled, dialog.config_saved], timeout=30000):
        qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    (model,) = load_config(config_path).models
    assert model.id == "tiny-q8_0" and model.licence == "apache-2.0"
    # the dialog stays open and says so (it closed with no confirmation)
    assert dialog.isVisible() and "Added Tiny Q8_0: it is starting now" in dialog.status.text()
    assert dialog.cancel_button.text() == "Close"
    dialog.reject()


@pytest.mark.gui
def test_the_dialog_cancels_and_the_next_download_resumes(
    qtbot: Any, hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    from timeshare.app.get_model import GetModelDialog

    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.delay_per_chunk = 0.05  # slow enough to press Cancel mid-file
    config_path = _config(tmp_path)
    dialog = GetModelDialog(PoolSnapshot, config_path, source=f"{REPO}:F16")
    qtbot.addWidget(dialog)
    dialog.show()
    _look_up(qtbot, dialog, 3)
    selected = dialog.selected()
    assert selected is not None and selected.label == "F16"  # the one the source names
    qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    # the window stays responsive while the worker thread downloads: progress arrives
    qtbot.waitUntil(lambda: dialog.progress.value() > 0, timeout=20000)
    assert dialog.cancel_button.text() == "Cancel" and not dialog.download_button.isEnabled()
    assert "KiB" in dialog.status.text()
    qtbot.mouseClick(dialog.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not dialog.busy and dialog.problem.isVisible(), timeout=20000)
    assert dialog.problem.text().startswith("Cancelled: what was downloaded is kept")
    assert dialog.cancel_button.text() == "Close" and dialog.download_button.isEnabled()
    (partial,) = (tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs").glob("*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < len(ggufs["f16"])
    assert load_config(config_path).models == ()

    hub.faults.delay_per_chunk = 0
    with qtbot.waitSignal(dialog.pulled, timeout=30000):
        qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    # the model's file resumed (then the repo's vision projector came beside it, whole)
    assert [s.range for s in hub.seen("GET", "/cdn/")][-2:] == [f"bytes={kept}-", None]
    (model,) = load_config(config_path).models
    assert model.id == "tiny-f16" and Path(model.mmproj).name == "mmproj-Tiny-F16.gguf"


@pytest.mark.gui
def test_the_dialog_shows_what_went_wrong(qtbot: Any, hub: FakeHub) -> None:
    from timeshare.app.get_model import GetModelDialog

    dialog = GetModelDialog(PoolSnapshot, source="tiny-org/nope")
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.mouseClick(dialog.lookup_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.problem.isVisible(), timeout=20000)
    assert "tiny-org/nope was not found" in dialog.problem.text()
    assert dialog.table.rowCount() == 0 and not dialog.download_button.isEnabled()
    dialog.source.setText("ftp://example.org/x.gguf")
    qtbot.mouseClick(dialog.lookup_button, Qt.MouseButton.LeftButton)
    assert "is not a model source" in dialog.problem.text()


@pytest.mark.gui
def test_settings_get_model_adds_to_the_draft(
    qtbot: Any, hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    from timeshare.app.settings import SettingsDialog
    from timeshare.core.config.schema import Config

    hub.repos[REPO] = _three_quants(ggufs)
    config_path = _config(tmp_path)
    settings = SettingsDialog(Config(), _StubBridge(), config_path)  # type: ignore[arg-type]
    qtbot.addWidget(settings)
    assert settings.get_button.text() == "Get model…"
    dialog = settings.get_model(f"{REPO}:Q4_K_M")
    _look_up(qtbot, dialog, 3)
    with qtbot.waitSignal(dialog.pulled, timeout=30000):
        qtbot.mouseClick(dialog.download_button, Qt.MouseButton.LeftButton)
    assert [m["id"] for m in settings.draft["models"]] == ["tiny-q4_k_m"]
    assert load_config(config_path).models == ()  # saved with the settings, not before


@pytest.mark.gui
def test_the_gpu_column_uses_the_pools_vram_budget(
    qtbot: Any, hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    """With a byte budget on a GPU the column says fits / too big against the weights budget the
    pool reports (devices[].budget_bytes); under one-model it says why it cannot tell."""
    from timeshare.app.get_model import WEIGHTS_FIT, GetModelDialog, fit_text
    from timeshare.core.state import DeviceStatus

    q8 = len(ggufs["q8"])
    budget = int(q8 * 1.5)  # Q4_K_M and Q8_0 fit (with the tenth for compute buffers), F16 not
    assert len(ggufs["f16"]) * 1.1 > budget >= q8 * 1.1
    gpu = PoolSnapshot(devices=(DeviceStatus(0, "CUDA0", "20GB", budget_bytes=budget),))
    assert fit_text(q8, gpu) == WEIGHTS_FIT and fit_text(len(ggufs["f16"]), gpu) == "too big"
    hub.repos[REPO] = _three_quants(ggufs)
    dialog = GetModelDialog(lambda: gpu, _config(tmp_path), source=f"hf.co/{REPO}")
    qtbot.addWidget(dialog)
    dialog.show()
    _look_up(qtbot, dialog, 3)
    # these tiny files have no layers or heads: the KV cache is not guessed, the weights are compared
    assert [dialog.table.item(r, 2).text() for r in range(3)] == [WEIGHTS_FIT, WEIGHTS_FIT, "too big"]
    assert "Fit unknown" not in dialog.info.text()
    assert "KV cache unknown (the file has no llama.block_count" in dialog.info.text()
    assert hub.seen("GET", "/cdn/")[-1].range == f"bytes=0-{remote.METADATA_LIMIT - 1}"

    one_model = PoolSnapshot(devices=(DeviceStatus(0, "CUDA0", "one-model"),))
    assert fit_text(q8, one_model) == "unknown"
    other = GetModelDialog(lambda: one_model, _config(tmp_path / "b"), source=f"hf.co/{REPO}")
    qtbot.addWidget(other)
    other.show()
    _look_up(qtbot, other, 3)
    assert 'with the setting "one model at a time"' in other.info.text()


@pytest.mark.gui
def test_on_a_cpu_build_the_dialog_says_host_memory_and_never_gpu(
    qtbot: Any, hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    """A pool whose models run on the CPU: the fit column says so, and no header or note says GPU."""
    from timeshare.app.get_model import CPU_BUILD, GetModelDialog
    from timeshare.core.state import ModelState, ModelStatus

    cpu = PoolSnapshot(models=(ModelStatus("smol", "smol", "/m.gguf", ModelState.RELEASED, backend="CPU"),))
    hub.repos[REPO] = _three_quants(ggufs)
    dialog = GetModelDialog(lambda: cpu, _config(tmp_path), source=f"hf.co/{REPO}")
    qtbot.addWidget(dialog)
    dialog.show()
    _look_up(qtbot, dialog, 3)
    headers = [dialog.table.horizontalHeaderItem(c).text() for c in range(4)]
    assert headers == ["Quantisation", "Size", "Fits", "File"]
    assert [dialog.table.item(r, 2).text() for r in range(3)] == [CPU_BUILD] * 3
    assert "no GPU" in dialog.info.text() and "GPU" not in dialog.info.text().replace("no GPU", "")


#: SmolLM2-135M's attention: 30 layers of 3 KV heads of 64 (the embedding 576 over 9 heads)
SMOL_SHAPE = {
    "llama.block_count": 30,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "llama.embedding_length": 576,
}


@pytest.mark.gui
def test_the_gpu_column_counts_the_kv_cache_of_a_new_entry(qtbot: Any, hub: FakeHub, tmp_path: Path) -> None:
    """The KV cache of n_ctx 4096 x 4 sequences (a new entry's auto settings on a GPU) is read from the
    looked-up file's metadata and counted: a budget the weights fit with room to spare for one
    sequence's cache says "too big" for one quantisation and "fits" for the smaller."""
    from timeshare.app.get_model import GetModelDialog, fit_text
    from timeshare.core.gguf.kvcache import KvShape
    from timeshare.core.state import DeviceStatus

    q4 = make_gguf(tmp_path / "k4.gguf", name="Smol", floats=8192, file_type=15, uint32s=SMOL_SHAPE)
    q8 = make_gguf(tmp_path / "k8.gguf", name="Smol", floats=65536, file_type=7, uint32s=SMOL_SHAPE)
    kv = KvShape(30, 3, 64, 64).bytes(4096, 4)
    assert kv == 30 * 3 * 128 * 2 * 16384  # 360 MiB: K and V, f16, 16384 cells
    budget = int(len(q4) * 1.1) + kv + 1  # Q4_K_M fits with its cache; Q8_0 does not
    assert len(q8) * 1.1 + kv > budget and len(q8) * 1.1 + kv // 4 < budget
    gpu = PoolSnapshot(devices=(DeviceStatus(0, "CUDA0", "20GB", budget_bytes=budget),))
    hub.repos["smol-org/Smol-GGUF"] = Repo({"Smol-Q4_K_M.gguf": q4, "Smol-Q8_0.gguf": q8})
    dialog = GetModelDialog(lambda: gpu, _config(tmp_path), source="hf.co/smol-org/Smol-GGUF")
    qtbot.addWidget(dialog)
    dialog.show()
    _look_up(qtbot, dialog, 2)
    cells = {dialog.table.item(r, 0).text(): dialog.table.item(r, 2).text() for r in range(2)}
    assert cells == {"Q4_K_M": "fits", "Q8_0": "too big"}
    assert dialog.kv is not None and dialog.kv.bytes == kv
    assert f"a KV cache of {human_bytes(kv)} (n_ctx 4096 × 4 sequences" in dialog.info.text()
    # the header is read once, for the default choice, from its first bytes
    (read,) = [r for r in hub.seen("GET", "/cdn/") if r.range is not None]
    assert read.range == f"bytes=0-{remote.METADATA_LIMIT - 1}"
    assert fit_text(len(q8), gpu, dialog.kv) == "too big"


def test_a_remote_header_that_cannot_be_read_says_why(hub: FakeHub, ggufs: dict[str, bytes]) -> None:
    hub.files["page.gguf"] = b"<html>not a model</html>"
    hub.files["Tiny-Q8_0.gguf"] = ggufs["q8"]
    page = remote.RemoteFile("page.gguf", f"{hub.url}/files/page.gguf")
    assert remote.remote_metadata(page, hub=False) == "the file does not start like a GGUF"
    gone = remote.RemoteFile("gone.gguf", f"{hub.url}/files/gone.gguf")
    assert remote.remote_metadata(gone, hub=False) == "the server answered HTTP 404"
    tiny = remote.RemoteFile("Tiny-Q8_0.gguf", f"{hub.url}/files/Tiny-Q8_0.gguf")
    values = remote.remote_metadata(tiny, hub=False)
    assert isinstance(values, dict) and values["general.architecture"] == "llama"
    assert (
        remote.remote_metadata(tiny, hub=False, limit=64) == f"its metadata is longer than {human_bytes(64)}"
    )
    hub.faults.ignore_range = True  # a 200 of the whole file: read up to what the header needs
    assert remote.remote_metadata(tiny, hub=False) == values


# ---- hostile remotes: names checked before any path is built (issue 22) ---------------------


def _tree(*roots: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under ``roots`` (links not followed): a link's target, a file's size and sha256."""
    seen: dict[str, tuple[object, ...]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    seen[p] = ("link", os.readlink(p))
                elif stat.S_ISDIR(st.st_mode):
                    seen[p] = ("dir",)
                else:
                    seen[p] = ("file", st.st_size, sha256(Path(p).read_bytes()))
    return seen


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A user's file next to the cache that nothing may open for writing."""
    path = tmp_path / "victim-of-etag.txt"
    path.write_text("my notes\n")
    yield path
    assert path.read_text() == "my notes\n" and not path.is_symlink()


def _escaped(tmp_path: Path) -> list[str]:
    """Anything named escape-* anywhere under the test's folder, or next to it."""
    near = [p.name for p in tmp_path.parent.iterdir() if p.name.startswith("escape")]
    return near + [str(p) for p in tmp_path.rglob("escape*")]


@pytest.mark.parametrize(
    ("fault", "value"),
    [
        ("rfilename", "../../../../escape-hubname.gguf"),
        ("rfilename", "{tmp}/escape-absolute.gguf"),
        ("rfilename", "sub\\..\\..\\escape-backslash.gguf"),
        ("rfilename", "escape-nul\x00.gguf"),
        ("rfilename", "sub//escape-empty.gguf"),
        ("rfilename", "./escape-dot.gguf"),
        ("etag", "../../../../escape-etag"),
        ("etag", "../../../../victim-of-etag.txt"),
        ("etag", "{tmp}/escape-absolute-etag"),
        ("etag", "E" * 64),  # upper case: not how the hub writes a digest
        ("commit", "../../../../escape-commit"),
        ("commit", "0123456789abcdef0123456789abcdef0123456/"),
    ],
)
def test_a_hostile_hub_name_is_refused_and_nothing_is_written(
    hub: FakeHub,
    ggufs: dict[str, bytes],
    tmp_path: Path,
    timeshare_home: Path,
    victim: Path,
    fault: str,
    value: str,
) -> None:
    value = value.replace("{tmp}", str(tmp_path))
    files = {"Tiny-Q4_K_M.gguf": ggufs["q4"]}
    if fault == "rfilename":
        files = {value: ggufs["q4"]}
    elif fault == "etag":
        hub.faults.linked_etag = f'"{value}"'
    else:
        hub.faults.repo_commit = value
    hub.repos[REPO] = Repo(files, commit=COMMIT)
    before = _tree(tmp_path, timeshare_home)
    with pytest.raises(UnsafeNameError) as refused:
        listing = remote.list_source(sources.parse_source(REPO))
        download.pull(listing, listing.choices[0])
    message = str(refused.value)
    assert repr(value)[:30] in message and "nothing was written" in message
    assert _tree(tmp_path, timeshare_home) == before
    assert _escaped(tmp_path) == []
    assert not hub.seen("GET", "/cdn/")  # not a byte fetched


def test_a_long_hostile_value_is_quoted_short(hub: FakeHub, ggufs: dict[str, bytes]) -> None:
    hub.repos[REPO] = Repo({"Tiny-Q4_K_M.gguf": ggufs["q4"]}, commit=COMMIT)
    hub.faults.linked_etag = '"' + "../" * 300 + 'x"'
    listing = remote.list_source(sources.parse_source(REPO))
    with pytest.raises(UnsafeNameError, match=r"sent the ETag '\.\./\.\./.*…, which is not a git SHA-1") as e:
        download.pull(listing, listing.choices[0])
    assert len(str(e.value)) < 400


@pytest.mark.parametrize(
    "url_path",
    [
        "/trav/..%2F..%2Fescape-url.gguf",
        "/trav/..%5C..%5Cescape-url.gguf",  # backslashes
        "/trav/escape%00-url.gguf",
        "/trav/%2Ftmp%2Fescape-url.gguf",
    ],
)
def test_a_url_whose_file_name_hides_a_path_is_refused(
    hub: FakeHub, tmp_path: Path, timeshare_home: Path, victim: Path, url_path: str
) -> None:
    before = _tree(tmp_path, timeshare_home)
    with pytest.raises(UnsafeNameError, match=r"sent the URL's file name '.*', which is not one file name"):
        listing = remote.list_source(sources.parse_source(hub.url + url_path))
        download.pull(listing, listing.choices[0], dest_dir=tmp_path / "models" / "sub")
    assert _tree(tmp_path, timeshare_home) == before
    assert _escaped(tmp_path) == [] and hub.requests == []  # refused before the HEAD


@pytest.mark.parametrize(
    "plant", ["partial-symlink", "blob-symlink", "partial-hardlink", "blobs-dir", "snapshot-dir"]
)
def test_a_link_planted_in_the_cache_is_not_followed(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path, timeshare_home: Path, victim: Path, plant: str
) -> None:
    hub.repos[REPO] = Repo({"Tiny-Q4_K_M.gguf": ggufs["q4"]}, commit=COMMIT)
    storage = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF"
    blob = storage / "blobs" / sha256(ggufs["q4"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if plant == "blobs-dir":
        storage.mkdir(parents=True)
        (storage / "blobs").symlink_to(elsewhere)
    elif plant == "snapshot-dir":
        (storage / "snapshots").mkdir(parents=True)
        (storage / "snapshots" / COMMIT).symlink_to(elsewhere)
    else:
        blob.parent.mkdir(parents=True)
        if plant == "partial-symlink":
            blob.with_name(blob.name + ".incomplete").symlink_to(victim)
        elif plant == "blob-symlink":
            blob.symlink_to(victim)
        else:
            os.link(victim, blob.with_name(blob.name + ".incomplete"))
    listing = remote.list_source(sources.parse_source(REPO))
    before = _tree(tmp_path, timeshare_home)
    with pytest.raises(UnsafeNameError, match=r"nothing was written"):
        download.pull(listing, listing.choices[0])
    assert _tree(tmp_path, timeshare_home) == before
    assert list(elsewhere.iterdir()) == []


def test_the_endless_body_stops_at_the_cap_and_leaves_no_partial(
    hub: FakeHub, ggufs: dict[str, bytes], timeshare_home: Path
) -> None:
    hub.files["Endless-Q4_K_M.gguf"] = ggufs["q4"]
    hub.faults.endless.add("Endless-Q4_K_M.gguf")
    listing = remote.list_source(sources.parse_source(f"{hub.url}/files/Endless-Q4_K_M.gguf"))
    assert listing.choices[0].size is None  # the server says no size
    cap = 2 << 20
    with pytest.raises(
        DownloadTooLargeError, match=r"did not say its size and sent more than 2\.0 MiB .*--max-size SIZE"
    ):
        download.pull(listing, listing.choices[0], max_size=cap)
    assert list((timeshare_home / "data" / "models").iterdir()) == []  # no partial, no sidecar
    # the client hung up: the server got no further than the cap and what the sockets buffer
    assert hub.endless_done.wait(60)
    assert cap < hub.endless_sent < cap + (32 << 20)


def test_a_get_that_announces_more_than_the_cap_writes_nothing(
    hub: FakeHub, ggufs: dict[str, bytes], timeshare_home: Path
) -> None:
    """No size from the HEAD (405), a Content-Length past the cap on the GET: refused at once."""
    hub.files["Tiny-Q4_K_M.gguf"] = ggufs["q4"]
    hub.faults.no_head.add("Tiny-Q4_K_M.gguf")
    listing = remote.list_source(sources.parse_source(f"{hub.url}/files/Tiny-Q4_K_M.gguf"))
    assert listing.choices[0].size is None
    with pytest.raises(DownloadTooLargeError, match=r"did not say its size and sent more than 1000 B"):
        download.pull(listing, listing.choices[0], max_size=1000)
    assert list((timeshare_home / "data" / "models").iterdir()) == []
    result = download.pull(listing, listing.choices[0])  # under the default cap it comes whole
    assert result.path.read_bytes() == ggufs["q4"]


def test_a_server_that_sends_more_than_it_announced_is_stopped(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.announce_size["Tiny-Q4_K_M.gguf"] = len(ggufs["q4"]) - 1000
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q4_K_M"))
    seen: list[int] = []
    with pytest.raises(DownloadTooLargeError, match=r"sent more than the \d+ bytes it announced"):
        download.pull(listing, sources.choose(listing), progress=lambda p: seen.append(p.done))
    assert max(seen) <= len(ggufs["q4"]) - 1000
    blobs = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs"
    assert list(blobs.iterdir()) == []


def _small_disk(monkeypatch: pytest.MonkeyPatch, root: Path, capacity: int, *, others: int = 1) -> None:
    """A fake statvfs: a disk of ``capacity`` bytes holding the files under ``root``; with
    ``others`` > 1 another program fills it as fast as the download (each byte written costs
    ``others``)."""

    def free(folder: Path) -> int:
        used = sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        return max(0, capacity - used * others)

    monkeypatch.setattr(download, "_free_bytes", free)
    monkeypatch.setattr(download, "SPACE_MARGIN", 16384)
    monkeypatch.setattr(download, "SPACE_CHECK_BYTES", 8192)


def test_a_full_disk_stops_an_endless_body_and_leaves_no_partial(
    hub: FakeHub, ggufs: dict[str, bytes], timeshare_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.files["Endless-Q4_K_M.gguf"] = ggufs["q4"]
    hub.faults.endless.add("Endless-Q4_K_M.gguf")
    _small_disk(monkeypatch, timeshare_home, 1 << 20)
    listing = remote.list_source(sources.parse_source(f"{hub.url}/files/Endless-Q4_K_M.gguf"))
    with pytest.raises(NoSpaceError, match=r"not enough disk space .*; what arrived was deleted"):
        download.pull(listing, listing.choices[0])
    assert list((timeshare_home / "data" / "models").iterdir()) == []


def test_a_disk_that_fills_keeps_a_resumable_partial_only(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub file (size and ETag known, Range honoured) keeps what arrived for a resume, and the
    resume is whole; a server that does not say it honours Range gets its partial deleted."""
    hub.repos[REPO] = _three_quants(ggufs)
    size = len(ggufs["f16"])
    with monkeypatch.context() as m:
        _small_disk(m, tmp_path / "hf", size + 65536, others=3)
        listing = remote.list_source(sources.parse_source(f"{REPO}:F16"))
        with pytest.raises(
            NoSpaceError, match=r"not enough disk space .* kept in .*\.incomplete: get it again"
        ):
            download.pull(listing, sources.choose(listing), chunk_size=4096)
    blobs = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs"
    (partial,) = blobs.glob("*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < size and partial.read_bytes() == ggufs["f16"][:kept]
    result = download.pull(listing, sources.choose(listing), chunk_size=4096)
    assert result.path.read_bytes() == ggufs["f16"]
    assert hub.seen("GET", "/cdn/")[-1].range == f"bytes={kept}-"

    hub.faults.no_accept_ranges = True
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q8_0"))
    with monkeypatch.context() as m:
        _small_disk(m, tmp_path / "hf", 3 * size + len(ggufs["q8"]) + 32768, others=3)
        with pytest.raises(NoSpaceError, match=r"what arrived was deleted"):
            download.pull(listing, sources.choose(listing), chunk_size=4096)
    assert not list(blobs.glob("*.incomplete"))


def test_the_real_hub_layout_small_files_and_huggingface_hubs_own_reading(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the hub keeps in git (not LFS) is named by its 40-digit git SHA-1 and served by the hub
    itself, with the token; huggingface_hub's own cache reader finds what pull wrote."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    hub.repos[REPO] = Repo({"Tiny-Q4_K_M.gguf": ggufs["q4"]}, commit=COMMIT, lfs=False, gated=True)
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    listing = remote.list_source(sources.parse_source(REPO))
    result = download.pull(listing, listing.choices[0])
    cache = tmp_path / "hf" / "hub"
    blob_id = git_sha1(ggufs["q4"])
    assert os.readlink(result.path) == f"../../blobs/{blob_id}"
    assert try_to_load_from_cache(REPO, "Tiny-Q4_K_M.gguf", cache_dir=cache) == str(result.path)
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and [r.commit_hash for r in repo.revisions] == [COMMIT]
    (got,) = hub.seen("GET", "/resolve/")
    assert got.auth == f"Bearer {GOOD_TOKEN}"  # the hub itself: the token goes with it


def test_pull_and_huggingface_hub_share_the_blob_lock(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = Repo({"Tiny-Q4_K_M.gguf": ggufs["q4"]}, commit=COMMIT)
    listing = remote.list_source(sources.parse_source(REPO))
    lock = tmp_path / "hf" / "hub" / ".locks" / "models--tiny-org--Tiny-GGUF" / f"{sha256(ggufs['q4'])}.lock"
    lock.parent.mkdir(parents=True)
    script = (
        "import filelock, sys; held = filelock.FileLock(sys.argv[1]); held.acquire(); "
        "print('held', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:  # huggingface_hub locks a blob with filelock on this path
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(DownloadError, match=r"being downloaded by another program right now"):
            download.pull(listing, listing.choices[0])
        holder.communicate("", timeout=30)
    assert download.pull(listing, listing.choices[0]).path.read_bytes() == ggufs["q4"]


def test_the_command_refuses_a_hostile_url_and_caps_an_endless_one(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    config = _config(home / "config")
    before = config.read_text()
    env = {k: os.environ[k] for k in ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HUB_CACHE")}
    sub = tmp_path / "models" / "sub"
    trav = _cli(home, "pull", f"{hub.url}/trav/..%2F..%2Fescape-url.gguf", "--dir", str(sub), env=env)
    assert trav.returncode == 1, trav.stderr
    assert "sent the URL's file name '../../escape-url.gguf'" in trav.stderr
    assert _escaped(tmp_path) == [] and not (tmp_path / "models").exists()
    assert config.read_text() == before

    hub.files["Endless-Q4_K_M.gguf"] = ggufs["q4"]
    hub.faults.endless.add("Endless-Q4_K_M.gguf")
    capped = _cli(
        home, "pull", f"{hub.url}/files/Endless-Q4_K_M.gguf", "--max-size", "1MiB", "--dir", str(sub), env=env
    )
    assert capped.returncode == 1, capped.stderr
    assert "sent more than 1.0 MiB" in capped.stderr and "--max-size" in capped.stderr
    assert list(sub.iterdir()) == [] and config.read_text() == before
    bad = _cli(home, "pull", f"{hub.url}/files/x.gguf", "--max-size", "lots", env=env)
    assert bad.returncode == 2 and "'lots' is not a size" in bad.stderr


# ---- what is already on disk, and servers that ignore Range (issue 30) ----------------------


def _other_version(data: bytes) -> bytes:
    """The same GGUF with other tensor values: same size, a valid header, another sha256."""
    changed = bytearray(data)
    for i in range(len(changed) - 4096, len(changed), 64):
        changed[i] ^= 0x5A
    return bytes(changed)


def _cancel_midway(listing: sources.Listing, at: int = 40000, **kw: Any) -> None:
    cancel = threading.Event()

    def stop(p: progress.Progress) -> None:
        if p.done >= at:
            cancel.set()

    with pytest.raises(CancelledError):
        download.pull(listing, sources.choose(listing), progress=stop, cancel=cancel, chunk_size=4096, **kw)


def test_a_server_that_ignores_range_is_followed_from_byte_0(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    """A dropped connection retried against a server that answers the Range with the whole file
    (200): the file and its sha256 start over, and the result is the hub's file, byte for byte."""
    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.ignore_range = True
    hub.faults.drop_after["Tiny-F16.gguf"] = 40960
    listing = remote.list_source(sources.parse_source(f"{REPO}:F16"))
    result = download.pull(listing, sources.choose(listing), chunk_size=4096)
    assert result.path.read_bytes() == ggufs["f16"]
    assert [r.range for r in hub.seen("GET", "/cdn/")] == [None, "bytes=40960-"]


def test_a_partial_resumed_from_a_server_that_now_ignores_range(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    """The next pull hashes the kept partial, asks for the rest, gets the whole file again: it must
    not count the kept bytes twice."""
    hub.repos[REPO] = _three_quants(ggufs)
    hub.faults.delay_per_chunk = 0.01
    listing = remote.list_source(sources.parse_source(f"{REPO}:F16"))
    _cancel_midway(listing)
    blobs = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs"
    (partial,) = blobs.glob("*.incomplete")
    kept = partial.stat().st_size
    hub.faults.delay_per_chunk = 0
    hub.faults.ignore_range = True
    result = download.pull(listing, sources.choose(listing), chunk_size=4096)
    assert result.path.read_bytes() == ggufs["f16"]
    assert hub.seen("GET", "/cdn/")[-1].range == f"bytes={kept}-"
    assert result.downloaded == len(ggufs["f16"]) and not partial.exists()


def test_a_url_partial_from_a_server_that_ignores_range_starts_over(
    hub: FakeHub, ggufs: dict[str, bytes], timeshare_home: Path
) -> None:
    hub.files["Tiny-F16.gguf"] = ggufs["f16"]
    hub.faults.delay_per_chunk = 0.01
    listing = remote.list_source(sources.parse_source(f"{hub.url}/files/Tiny-F16.gguf"))
    _cancel_midway(listing)
    hub.faults.delay_per_chunk = 0
    hub.faults.ignore_range = True
    result = download.pull(listing, listing.choices[0], chunk_size=4096)
    assert result.path.read_bytes() == ggufs["f16"]
    assert sorted(p.name for p in result.path.parent.iterdir()) == ["Tiny-F16.gguf"]


@pytest.mark.parametrize("damage", ["bit", "truncated", "not-a-gguf"])
def test_a_damaged_file_already_in_the_cache_is_checked_and_downloaded_again(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path, damage: str
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q8_0"))
    first = download.pull(listing, sources.choose(listing))
    blob = first.path.resolve()
    good = ggufs["q8"]
    if damage == "bit":
        blob.write_bytes(good[:-100] + bytes([good[-100] ^ 1]) + good[-99:])
    elif damage == "truncated":
        blob.write_bytes(good[: len(good) // 2])
    else:
        blob.write_bytes(b"<html>" + bytes(len(good) - 6))
    again = download.pull(listing, sources.choose(listing))
    assert again.path == first.path and blob.read_bytes() == good
    assert again.downloaded == len(good)
    assert len(hub.seen("GET", "/cdn/")) == 2


def test_a_damaged_file_in_dir_is_downloaded_again(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path
) -> None:
    hub.repos[REPO] = _three_quants(ggufs)
    listing = remote.list_source(sources.parse_source(f"{REPO}:Q4_K_M"))
    target = tmp_path / "models"
    target.mkdir()
    (target / "Tiny-Q4_K_M.gguf").write_bytes(_other_version(ggufs["q4"]))  # a GGUF, the right size
    result = download.pull(listing, sources.choose(listing), dest_dir=target)
    assert result.path.read_bytes() == ggufs["q4"] and result.downloaded == len(ggufs["q4"])


def test_a_partial_of_another_version_is_not_resumed(
    hub: FakeHub, ggufs: dict[str, bytes], tmp_path: Path, timeshare_home: Path
) -> None:
    """The server's file changed (another ETag) between a cancelled pull and the next: a URL's or a
    --dir partial is deleted and the download starts over; in the hub cache the new version is
    another blob, downloaded from byte 0, and the old partial is left as huggingface_hub leaves it."""
    old, new = ggufs["f16"], _other_version(ggufs["f16"])
    hub.faults.delay_per_chunk = 0.01

    hub.files["Tiny-F16.gguf"] = old
    url = f"{hub.url}/files/Tiny-F16.gguf"
    _cancel_midway(remote.list_source(sources.parse_source(url)))
    hub.files["Tiny-F16.gguf"] = new
    hub.faults.delay_per_chunk = 0
    listing = remote.list_source(sources.parse_source(url))
    result = download.pull(listing, listing.choices[0], chunk_size=4096)
    assert result.path.read_bytes() == new
    assert hub.seen("GET", "/files/")[-1].range is None

    for dest in (tmp_path / "mine", None):
        hub.faults.delay_per_chunk = 0.01
        hub.repos[REPO] = Repo({"Tiny-F16.gguf": old}, commit=COMMIT)
        _cancel_midway(remote.list_source(sources.parse_source(REPO)), dest_dir=dest)
        hub.repos[REPO] = Repo({"Tiny-F16.gguf": new}, commit="89abcdef" * 5)
        hub.faults.delay_per_chunk = 0
        listing = remote.list_source(sources.parse_source(REPO))
        result = download.pull(listing, listing.choices[0], dest_dir=dest, chunk_size=4096)
        assert result.path.read_bytes() == new
        assert hub.seen("GET", "/cdn/")[-1].range is None
    blobs = tmp_path / "hf" / "hub" / "models--tiny-org--Tiny-GGUF" / "blobs"
    assert sorted(p.name for p in blobs.iterdir()) == sorted([sha256(new), sha256(old) + ".incomplete"])
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["Tiny-F16.gguf"]


def test_a_second_url_with_the_same_file_name_gets_its_own_file(
    hub: FakeHub, ggufs: dict[str, bytes], timeshare_home: Path
) -> None:
    hub.files["a/model.gguf"] = ggufs["q4"]
    hub.files["b/model.gguf"] = ggufs["q8"]
    first = download.pull(*_listed(f"{hub.url}/files/a/model.gguf"))
    second = download.pull(*_listed(f"{hub.url}/files/b/model.gguf"))
    # it silently reused the first URL's file
    assert first.path.name == "model.gguf" and second.path.name == "model-2.gguf"
    assert first.path.read_bytes() == ggufs["q4"] and second.path.read_bytes() == ggufs["q8"]
    again = download.pull(*_listed(f"{hub.url}/files/b/model.gguf"))  # the same URL again: its file
    assert again.path == second.path and again.downloaded == 0


def _listed(url: str) -> tuple[sources.Listing, sources.Choice]:
    listing = remote.list_source(sources.parse_source(url))
    return listing, sources.choose(listing)
