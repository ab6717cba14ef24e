"""Catalog: GGUF headers read without loading weights, and discovery in the tools' folders.

The folder layouts of LM Studio, the Hugging Face cache, llama.cpp's cache and Ollama's store are
built in tmp (the only thing simulated); every file in them is a real GGUF: the demo models
(linked, not copied) or small ones written with the gguf package's GGUFWriter.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeshare.core.config import demo
from timeshare.core.config import files as config_files
from timeshare.core.config import schema as config_schema
from timeshare.core.config import validate as config_validate
from timeshare.core.errors import ModelFileError
from timeshare.core.gguf import catalog
from timeshare.core.gguf.catalog import CatalogEntry


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    name: str | None = "Tiny Test Model",
    context_length: int | None = 256,
    file_type: int | None = 1,
    licence: str | None = "MIT",
    size_label: str | None = "1K",
    chat_template: str | None = None,
    tensors: int = 2,
) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch=arch)
    if name is not None:
        w.add_name(name)
    if context_length is not None:
        w.add_context_length(context_length)
    if file_type is not None:
        w.add_file_type(file_type)
    if licence is not None:
        w.add_license(licence)
    if size_label is not None:
        w.add_size_label(size_label)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for i in range(tensors):
        # F16 for the big one and F32 for the small ones: the dominant type is F16
        dtype = np.float16 if i == 0 else np.float32
        w.add_tensor(f"blk.{i}.weight", np.arange(64 * (8 if i == 0 else 1), dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def link(target: Path, real: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(real)
    return target


# ---- headers -------------------------------------------------------------------------------


def test_header_of_the_smollm2_demo(smollm2_path: Path) -> None:
    entry = catalog.read_gguf_header(smollm2_path)
    assert entry.path == str(smollm2_path)
    assert entry.architecture == "llama"
    assert entry.quantisation == "Q4_1"
    assert entry.context_length == 8192
    assert entry.size == smollm2_path.stat().st_size
    assert entry.has_chat_template  # an instruct model: its template is in the GGUF
    assert entry.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"  # general.name, as the file has it
    assert entry.licence == "apache-2.0"
    assert entry.parameters == "135M"
    assert entry.source == "file"


def test_header_of_the_gemma3_demo(gemma3_path: Path) -> None:
    entry = catalog.read_gguf_header(gemma3_path, "demo")
    assert entry.architecture == "gemma3"
    assert entry.quantisation == "Q4_K_M"
    assert entry.context_length == 32768
    assert entry.source == "demo"


def test_header_of_a_written_gguf(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", chat_template="{{ x }}")
    entry = catalog.read_gguf_header(path)
    assert entry == CatalogEntry(
        path=str(path),
        name="Tiny Test Model",
        size=path.stat().st_size,
        architecture="llama",
        quantisation="F16",
        context_length=256,
        source="file",
        licence="MIT",
        has_chat_template=True,
        parameters="1K",
    )


def test_without_file_type_the_dominant_tensor_type_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bare.gguf", name=None, file_type=None, context_length=None, licence=None)
    entry = catalog.read_gguf_header(path)
    assert entry.quantisation == "F16"
    assert entry.name == "bare"  # no general.name: the file name
    assert entry.context_length == 0
    assert entry.licence == ""
    assert not entry.has_chat_template


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file" + bytes(100))
    with pytest.raises(ModelFileError) as excinfo:
        catalog.read_gguf_header(path)
    assert str(excinfo.value) == (
        f"model file {path} is not a GGUF file (it starts with the bytes 50 4b 03 04, not 'GGUF'; it "
        "looks like a zip archive: unpack it first): choose a .gguf model file"
    )


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        catalog.read_gguf_header(path)


def test_truncated_inside_the_fixed_header(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00")
    with pytest.raises(
        ModelFileError, match=r"cut\.gguf is truncated: the file ends at byte 7, inside the GGUF header"
    ):
        catalog.read_gguf_header(path)


def test_truncated_inside_the_metadata(tmp_path: Path, smollm2_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as src:
        path.write_bytes(src.read(4096))  # the vocabulary alone is far longer than this
    tensors = struct.unpack("<Q", path.read_bytes()[8:16])[0]
    with pytest.raises(ModelFileError) as excinfo:
        catalog.read_gguf_header(path)
    message = str(excinfo.value)
    assert message.startswith(f"cut.gguf is truncated: header says {tensors} tensors")
    assert "the file ends at byte 4096, inside the header" in message
    assert "re-download it" in message


def test_truncated_tensor_data(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) - 200])
    with pytest.raises(ModelFileError) as excinfo:
        catalog.read_gguf_header(cut)
    message = str(excinfo.value)
    assert "cut.gguf is truncated" in message
    assert "header says 2 tensors" in message
    assert f"the file ends at byte {len(data) - 200}" in message
    assert whole.read_bytes() == data  # nothing touched


def test_unsupported_version(tmp_path: Path) -> None:
    path = tmp_path / "future.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 99, 0, 0))
    with pytest.raises(ModelFileError, match="GGUF version 99"):
        catalog.read_gguf_header(path)


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        catalog.read_gguf_header(tmp_path / "gone.gguf")
    with pytest.raises(ModelFileError, match="is a folder"):
        catalog.read_gguf_header(tmp_path)


# ---- discovery -----------------------------------------------------------------------------


@pytest.fixture
def trees(tmp_path: Path, smollm2_path: Path) -> dict[str, Path]:
    """Fake tool folders holding real GGUF files."""
    roots = {name: tmp_path / name for name in ("lmstudio", "lmstudio-cache", "hf", "llama", "ollama")}
    # LM Studio: <publisher>/<repo>/<file>.gguf
    link(roots["lmstudio"] / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF" / "smol.Q4_1.gguf", smollm2_path)
    write_gguf(roots["lmstudio-cache"] / "someone" / "tiny-GGUF" / "tiny-F16.gguf", name="Tiny LM")
    # a vision projector next to a model: not a language model
    write_gguf(roots["lmstudio-cache"] / "someone" / "tiny-GGUF" / "mmproj-tiny.gguf", arch="clip")
    # HF hub cache: two snapshots linking one blob, and a file that is not a GGUF
    blob = write_gguf(roots["hf"] / "models--org--tiny-gguf" / "blobs" / "0123abcd", name="HF Tiny")
    for rev in ("aaaa", "bbbb"):
        link(roots["hf"] / "models--org--tiny-gguf" / "snapshots" / rev / "tiny.gguf", blob)
    (roots["hf"] / "models--org--broken" / "snapshots" / "cccc").mkdir(parents=True)
    (roots["hf"] / "models--org--broken" / "snapshots" / "cccc" / "broken.gguf").write_bytes(
        b"<!DOCTYPE html>"
    )
    # llama.cpp cache: flat files, a split model in two parts
    write_gguf(roots["llama"] / "tiny-split-00001-of-00002.gguf", name="Split Tiny")
    write_gguf(roots["llama"] / "tiny-split-00002-of-00002.gguf", name="Split Tiny")
    # Ollama: manifests/<host>/<namespace>/<model>/<tag> -> blobs/sha256-<hex>
    digest = "sha256-" + "ab" * 32
    (roots["ollama"] / "blobs").mkdir(parents=True)
    shutil.copyfile(blob, roots["ollama"] / "blobs" / digest)
    manifest = {
        "schemaVersion": 2,
        "layers": [
            {
                "mediaType": "application/vnd.ollama.image.model",
                "digest": digest.replace("-", ":"),
                "size": 1,
            },
            {
                "mediaType": "application/vnd.ollama.image.template",
                "digest": "sha256:" + "cd" * 32,
                "size": 1,
            },
        ],
    }
    mdir = roots["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "tiny"
    mdir.mkdir(parents=True)
    (mdir / "latest").write_text(json.dumps(manifest))
    udir = roots["ollama"] / "manifests" / "registry.ollama.ai" / "someone" / "tiny"
    udir.mkdir(parents=True)
    (udir / "q4").write_text("{not json")
    return roots


def scan_trees(trees: dict[str, Path], sources: list[catalog.Source] | None = None) -> catalog.ScanReport:
    return catalog.scan_report(
        sources or ["lmstudio", "hf", "llama.cpp", "ollama"],
        lmstudio=[trees["lmstudio"], trees["lmstudio-cache"]],
        hf=trees["hf"],
        llama_cpp=trees["llama"],
        ollama=trees["ollama"],
    )


def test_scan_finds_every_source(trees: dict[str, Path], smollm2_path: Path) -> None:
    report = scan_trees(trees)
    by_source: dict[str, list[CatalogEntry]] = {}
    for e in report.entries:
        by_source.setdefault(e.source, []).append(e)

    lm = sorted(by_source["lmstudio"], key=lambda e: e.origin)
    assert [e.origin for e in lm] == ["HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "someone/tiny-GGUF"]
    assert lm[0].quantisation == "Q4_1" and lm[0].size == smollm2_path.stat().st_size
    assert lm[1].name == "Tiny LM"

    (hf,) = by_source["hf"]  # two snapshots, one blob: listed once
    assert hf.origin == "org/tiny-gguf" and hf.name == "HF Tiny"

    (split,) = by_source["llama.cpp"]  # only the first part; size of both
    assert split.path.endswith("tiny-split-00001-of-00002.gguf")
    parts = sorted(trees["llama"].glob("tiny-split-*.gguf"))
    assert split.size == sum(p.stat().st_size for p in parts)

    (ollama,) = by_source["ollama"]
    assert ollama.name == "tiny:latest"
    assert ollama.path == str(trees["ollama"] / "blobs" / ("sha256-" + "ab" * 32))
    assert ollama.architecture == "llama"

    skipped = dict(report.skipped)
    broken = str(trees["hf"] / "models--org--broken" / "snapshots" / "cccc" / "broken.gguf")
    assert "not a GGUF file" in skipped[broken]
    mmproj = str(trees["lmstudio-cache"] / "someone" / "tiny-GGUF" / "mmproj-tiny.gguf")
    assert "vision projector" in skipped[mmproj]
    assert len(report.entries) == 5


def test_scan_only_some_sources(trees: dict[str, Path]) -> None:
    report = scan_trees(trees, ["ollama"])
    assert [e.source for e in report.entries] == ["ollama"]
    assert report.roots == (("ollama", str(trees["ollama"])),)


def test_missing_roots_are_not_an_error(tmp_path: Path) -> None:
    report = catalog.scan_report(
        ["lmstudio", "hf", "llama.cpp", "ollama"],
        lmstudio=[tmp_path / "a"],
        hf=tmp_path / "b",
        llama_cpp=tmp_path / "c",
        ollama=tmp_path / "d",
    )
    assert report.entries == () and report.skipped == ()


def test_ollama_blob_that_is_not_gguf_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "ollama"
    digest = "cd" * 32
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(b"\x00" * 64)
    mdir = root / "manifests" / "registry.ollama.ai" / "library" / "weird"
    mdir.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}
    (mdir / "7b").write_text(json.dumps({"layers": [layer]}))
    report = catalog.scan_report(["ollama"], ollama=root)
    assert report.entries == ()
    assert "not a GGUF file" in report.skipped[0][1]


def test_default_roots_follow_the_environment(
    trees: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(trees["hf"]))
    monkeypatch.setenv("LLAMA_CACHE", str(trees["llama"]))
    monkeypatch.setenv("OLLAMA_MODELS", str(trees["ollama"]))
    link(tmp_path / "home" / ".lmstudio" / "models", trees["lmstudio-cache"])
    sources = sorted(e.source for e in catalog.scan(["lmstudio", "hf", "llama.cpp", "ollama"]))
    assert sources == ["hf", "llama.cpp", "lmstudio", "ollama"]
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert catalog.default_hf_root() == tmp_path / "hfhome" / "hub"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert catalog.default_hf_root() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    assert catalog.default_lmstudio_roots()[1] == tmp_path / "home" / ".cache" / "lm-studio" / "models"


def test_demo_source_lists_the_installed_demo_models(smollm2_path: Path) -> None:
    entries = catalog.scan(["demo"])
    assert str(smollm2_path) in {e.path for e in entries}  # the demo models are installed here
    assert sorted(e.name for e in entries) == sorted(d.name for d in demo.available())
    for e in entries:
        assert e.source == "demo" and e.licence and Path(e.path).is_file()


def test_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown catalog source"):
        catalog.scan(["dropbox"])  # type: ignore[list-item]


def test_entry_to_model_config_is_valid(trees: dict[str, Path]) -> None:
    entries = scan_trees(trees).entries
    taken: list[str] = []
    models = []
    for e in entries:
        m = e.to_model_config(taken)
        taken.append(m.id)
        models.append(m)
        assert m.n_ctx == min(4096, e.context_length)
        assert m.name == e.name
    assert len(set(taken)) == len(taken)
    ollama = next(m for m, e in zip(models, entries, strict=True) if e.source == "ollama")
    assert ollama.id == "tiny-latest"
    # the result passes the config's own validation, model files included
    raw = config_files.config_to_dict(config_schema.Config(models=tuple(models)))
    assert config_validate.validate(raw).models == tuple(models)


def _data_offsets(paths: list[Path]) -> list[int]:
    """Where each file's tensor data begins, by ggml's own GGUF reader (the one llama.cpp loads
    with; in a child process: llama_cpp must be imported before numpy, and this module has not)."""
    code = (
        "import sys\n"
        "from timeshare.core.residency import check_gguf\n"
        "for p in sys.argv[1:]: print(check_gguf(p).data_offset)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(line) for line in out.stdout.split()]


def test_header_read_maps_only_the_header(
    gemma3_path: Path, smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header walk never reads the tensor data: handed a mapping that ends where the data
    begins (any read past it raises), it gives the same entry as with the whole file mapped."""
    import mmap
    import types

    small = write_gguf(tmp_path / "tiny.gguf", chat_template="{{ messages }}")
    paths = [smollm2_path, gemma3_path, small]
    for path, data_offset in zip(paths, _data_offsets(paths), strict=True):
        whole = catalog.read_gguf_header(path)
        assert 0 < data_offset < path.stat().st_size
        lengths: list[int] = []

        def header_only(
            fileno: int, length: int, *, _end: int = data_offset, _lengths: list[int] = lengths, **kw: object
        ) -> mmap.mmap:
            _lengths.append(length)
            return mmap.mmap(fileno, _end, **kw)  # type: ignore[arg-type]

        with monkeypatch.context() as m:
            m.setattr(catalog, "mmap", types.SimpleNamespace(mmap=header_only, ACCESS_READ=mmap.ACCESS_READ))
            assert catalog.read_gguf_header(path) == whole
        assert len(lengths) == 1, "the header was not read through the mapping this test restricts"
        if path != small:  # the demo models' weights are nearly all of their files
            assert data_offset < path.stat().st_size // 10


# ---- never anything but an entry or a clear error ------------------------------------------


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = write_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", chat_template="{{ messages }}")
    return path.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_files_give_an_entry_or_a_model_file_error(
    data: st.DataObject, tiny_bytes: bytes, tmp_path: Path
) -> None:
    blob = bytearray(tiny_bytes)
    header_end = len(blob) - 1280  # the tensor data (1280 bytes) comes last
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), label="cut at")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            pos = data.draw(st.integers(0, header_end - 1), label="pos")
            blob[pos] = data.draw(st.integers(0, 255), label="byte")
    path = tmp_path / f"damaged-{len(blob)}.gguf"
    path.write_bytes(bytes(blob))
    try:
        entry = catalog.read_gguf_header(path)
    except ModelFileError as exc:
        # names the file, then says what is wrong (not a GGUF at all: the one GGUF-check wording)
        assert str(exc).startswith((path.name, f"model file {path} "))
    else:
        assert entry.size == len(blob)


@pytest.mark.parametrize(
    ("head", "words"),
    [
        (b"", "it is empty"),
        (b"hello world", "it starts with 'hell', not 'GGUF'"),
        (b"\x00\x01\xfe\xff", "it starts with the bytes 00 01 fe ff, not 'GGUF'"),
        (
            b"<!DOCTYPE html>",
            "it starts with '<!DO', not 'GGUF'; it looks like a web page: the download went wrong",
        ),
        (
            b"version https://git-lfs.github.com/spec/v1\n",
            "it starts with 'vers', not 'GGUF'; it is a Git LFS pointer: the model itself was not downloaded",
        ),
    ],
)
def test_a_files_start_is_worded_for_people(head: bytes, words: str) -> None:
    from timeshare.core.gguf.modelfile import file_start

    assert file_start(head) == words
    assert "b'" not in file_start(head)


def test_the_cheap_model_file_check_says_how_the_file_starts(tmp_path: Path) -> None:
    from timeshare.core.gguf.modelfile import gguf_problem

    path = tmp_path / "hello.gguf"
    path.write_bytes(b"hello")
    assert gguf_problem(str(path)) == (
        f"model file {path} is not a GGUF file (it starts with 'hell', not 'GGUF'): choose a .gguf model file"
    )
