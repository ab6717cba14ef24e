"""Discover GGUF models already on this machine, reading only their headers.

Sources: the demo packages, LM Studio's models folder, the Hugging Face hub cache, llama.cpp's
download cache and Ollama's store (manifests that point at GGUF blobs). Each entry carries what a
user needs to pick a model (name, size, architecture, quantisation, context length, licence),
read from the GGUF header (a memory-mapped walk of the metadata and tensor table; the weights are
never read). Every root can be overridden (tests build fake trees with real GGUF files).

Imports numpy (through ``gguf``): for the app process, not for workers.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from .. import envvars
from ..config.schema import ModelConfig, suggest_model_id
from ..errors import ModelFileError
from .header import (
    GgufCorruptError,
    GgufCursor,
    GgufTruncatedError,
    Header,
    check_fixed_header,
    parse_header,
    quantisation,
)
from .modelfile import SPLIT_RE

log = logging.getLogger(__name__)

Source = Literal["demo", "lmstudio", "hf", "llama.cpp", "ollama", "file"]
ALL_SOURCES: tuple[Source, ...] = ("demo", "lmstudio", "hf", "llama.cpp", "ollama")

OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class CatalogEntry:
    path: str  # the file to load (for a split model: its first part)
    name: str  # what to show: the GGUF's general.name, Ollama's "<name>:<tag>", or the file name
    size: int  # bytes on disk (all parts of a split model)
    architecture: str  # general.architecture ("llama", "gemma3", ...)
    quantisation: str  # file type name ("Q4_K_M", "F16", ...), or the dominant tensor type
    context_length: int  # training context from the header (0 when it does not say)
    source: Source = "file"
    licence: str = ""  # general.license, or the demo package's licence
    has_chat_template: bool = False  # tokenizer.chat_template present (else: fallback format)
    origin: str = ""  # where it came from, for display: "org/repo", "publisher/repo", "name:tag"
    parameters: str = ""  # general.size_label ("135M", "8B") when the header has it
    #: the vision projector paired with it (issue 41): an mmproj GGUF in the same folder whose
    #: output width is the model's n_embd ("": none found)
    mmproj: str = ""
    #: the model's n_embd, or a projector's output width (clip.vision.projection_dim); 0: unknown
    width: int = 0
    pooling: str = ""  # <arch>.pooling_type's name ("rank": a reranker; "": none set, a causal LM)

    def to_model_config(self, taken_ids: Iterable[str] = ()) -> ModelConfig:
        """A ModelConfig for this file with a fresh id (settings dialog: "add from catalog")."""
        return model_config_from_entry(self, taken_ids)


@dataclass(frozen=True)
class ScanReport:
    entries: tuple[CatalogEntry, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # (path, reason) for files that are not usable GGUFs
    roots: tuple[tuple[Source, str], ...] = field(default=())  # folders looked at (existing or not)


def model_config_from_entry(entry: CatalogEntry, taken_ids: Iterable[str] = ()) -> ModelConfig:
    # Ollama blobs have no useful file name; elsewhere the file name says model and quantisation
    label = entry.name if entry.source == "ollama" else _display_stem(Path(entry.path))
    model_id = suggest_model_id(label.replace(":", "-").replace("/", "-"), taken_ids)
    n_ctx = min(4096, entry.context_length) if entry.context_length > 0 else 2048
    return ModelConfig(
        id=model_id,
        path=entry.path,
        name=entry.name,
        n_ctx=n_ctx,
        licence=entry.licence,
        mmproj=entry.mmproj,
        # a reranker (rank pooling, issue 42) answers /v1/rerank only: its context is an embedding one
        embedding=entry.pooling == "rank",
    )


def read_gguf_header(path: str | Path, source: Source = "file", *, size: int | None = None) -> CatalogEntry:
    """Read a GGUF file's header (never its weights) into a CatalogEntry.

    Raises ModelFileError with a sentence for a missing, non-GGUF, truncated or corrupt file.
    ``size`` overrides the reported size (a split model counts all its parts).
    """
    p = Path(path)
    header, file_size = _read_header(p)
    return _entry(p, header, file_size, source, size)


def _read_header(p: Path) -> tuple[Header, int]:
    file_size, tensor_count = check_fixed_header(p)
    try:
        with p.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = parse_header(buf, file_size)
    except GgufTruncatedError:
        raise ModelFileError(
            f"{p.name} is truncated: header says {tensor_count} tensors but the file ends at byte "
            f"{file_size}, inside the header — re-download it"
        ) from None
    except GgufCorruptError as exc:
        raise ModelFileError(f"{p.name} is corrupt: {exc} — re-download it") from None
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{p.name} cannot be read ({exc}): check the file") from exc
    if header.data_end > file_size:
        raise ModelFileError(
            f"{p.name} is truncated: header says {tensor_count} tensors ending at byte {header.data_end} "
            f"but the file ends at byte {file_size} — re-download it"
        )
    return header, file_size


def read_gguf_header_values(path: str | Path) -> tuple[dict[str, Any], int]:
    """A GGUF file's metadata values (``header.parse_header``'s) and its tensors' bytes. Raises
    ModelFileError as :func:`read_gguf_header` does."""
    header, _ = _read_header(Path(path))
    return header.values, sum(header.type_bytes.values())


def _entry(p: Path, header: Header, file_size: int, source: Source, size: int | None) -> CatalogEntry:
    v = header.values

    def text(key: str) -> str:
        value = v.get(key)
        return value.strip() if isinstance(value, str) else ""

    ctx = v.get("_context_length")
    arch = text("general.architecture")
    width = v.get("clip.vision.projection_dim") if arch == "clip" else v.get(f"{arch}.embedding_length")
    return CatalogEntry(
        path=str(p),
        name=text("general.name") or _display_stem(p),
        size=file_size if size is None else size,
        architecture=text("general.architecture"),
        quantisation=quantisation(header),
        context_length=int(ctx) if isinstance(ctx, int) and not isinstance(ctx, bool) else 0,
        source=source,
        licence=text("general.license"),
        has_chat_template=isinstance(v.get("tokenizer.chat_template"), str),
        parameters=text("general.size_label"),
        width=width if isinstance(width, int) and not isinstance(width, bool) else 0,
        pooling=pooling_name(v),
    )


def is_projector(entry: CatalogEntry) -> bool:
    """A vision projector (mmproj), not a language model."""
    return entry.architecture == "clip" or entry.architecture.startswith("mmproj")


def pair_projectors(entries: list[CatalogEntry], projectors: list[CatalogEntry]) -> list[CatalogEntry]:
    """Each model with the projector beside it (the same folder: a hub snapshot holds one repo's
    files) whose output width is the model's n_embd; where widths are unknown, the folder's only
    projector. A model with none, or several that fit, keeps none."""
    by_folder: dict[str, list[CatalogEntry]] = {}
    for proj in projectors:
        by_folder.setdefault(str(Path(proj.path).parent), []).append(proj)
    out = []
    for entry in entries:
        here = by_folder.get(str(Path(entry.path).parent), [])
        fits = [p for p in here if p.width and entry.width and p.width == entry.width]
        if not fits and len(here) == 1 and not (here[0].width and entry.width):
            fits = here
        if fits:
            chosen = min(fits, key=lambda p: (_PROJECTOR_TYPES.get(p.quantisation, 9), p.size))
            entry = replace(entry, mmproj=chosen.path)
        out.append(entry)
    return out


#: which of a repo's projectors to take when several fit: F16 first (what llama.cpp's converters
#: write by default), then BF16, Q8_0, F32
_PROJECTOR_TYPES = {
    "F16": 0,
    "MOSTLY_F16": 0,
    "BF16": 1,
    "MOSTLY_BF16": 1,
    "Q8_0": 2,
    "MOSTLY_Q8_0": 2,
    "F32": 3,
}


#: llama.cpp's ``enum llama_pooling_type`` by value (``<arch>.pooling_type`` in a GGUF)
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_name(values: dict[str, Any]) -> str:
    """The pooling a GGUF's metadata sets (``POOLING_NAMES``; "rank": a reranker), "" when it
    sets none (a causal LM)."""
    arch = values.get("general.architecture")
    value = values.get(f"{arch}.pooling_type") if isinstance(arch, str) else None
    if not isinstance(value, int) or isinstance(value, bool):
        return ""
    return POOLING_NAMES.get(value, "")


def _read_values(path: str | Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values whose keys ``wanted(key)`` accepts, read from the header (no tensor
    table, so no gguf package: the API process and the worker read this). Raises
    ModelFileError as ``read_gguf_header`` does."""
    p = Path(path)
    file_size, _ = check_fixed_header(p)
    found: dict[str, Any] = {}
    try:
        with p.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            endian = "<" if struct.unpack_from("<I", buf, 4)[0] in (2, 3) else ">"
            cur = GgufCursor(buf, file_size, endian)
            cur.pos = 4
            cur.take("I")  # version
            cur.take("Q")  # tensor count
            for _ in range(cur.take("Q")):
                key = cur.string()
                keep = bool(wanted(key))
                value = cur.value(cur.take("I"), keep)
                if keep:
                    found[key] = value
    except (GgufTruncatedError, GgufCorruptError, OSError, ValueError, struct.error) as exc:
        raise ModelFileError(f"{p.name} cannot be read ({exc}): check the file") from None
    return found


def read_chat_template(path: str | Path) -> str | None:
    """The GGUF's ``tokenizer.chat_template`` (None: it has none), read from its header. Raises
    ModelFileError as ``read_gguf_header`` does."""
    value = _read_values(path, lambda key: key == "tokenizer.chat_template").get("tokenizer.chat_template")
    return value if isinstance(value, str) else None


def read_pooling(path: str | Path) -> str:
    """The pooling the GGUF sets (see ``pooling_name``: "rank" for a reranker), read from its
    header. Raises ModelFileError as ``read_gguf_header`` does."""
    return pooling_name(
        _read_values(path, lambda key: key == "general.architecture" or key.endswith(".pooling_type"))
    )


def _display_stem(path: Path) -> str:
    m = SPLIT_RE.match(path.name)
    return m.group("stem") if m else path.stem


# ---- sources -------------------------------------------------------------------------------


def _env_path(var: envvars.EnvVar) -> Path | None:
    value = var.raw()
    return Path(value).expanduser() if value else None


def default_lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def default_hf_root() -> Path:
    explicit = _env_path(envvars.HF_HUB_CACHE)
    if explicit:
        return explicit
    hf_home = _env_path(envvars.HF_HOME)
    if hf_home:
        return hf_home / "hub"
    xdg = _env_path(envvars.XDG_CACHE_HOME)
    return (xdg or Path.home() / ".cache") / "huggingface" / "hub"


def default_llama_cpp_root() -> Path:
    explicit = _env_path(envvars.LLAMA_CACHE)
    if explicit:
        return explicit
    xdg = _env_path(envvars.XDG_CACHE_HOME)
    return (xdg or Path.home() / ".cache") / "llama.cpp"


def default_ollama_root() -> Path:
    return _env_path(envvars.OLLAMA_MODELS) or Path.home() / ".ollama" / "models"


@dataclass(frozen=True)
class _Candidate:
    path: Path
    source: Source
    name: str = ""  # overrides the header's name (Ollama)
    origin: str = ""
    licence: str = ""


def _gguf_files(root: Path) -> Iterator[Path]:
    """*.gguf under root (following symlinked files, as the HF cache uses), sorted, first parts only."""
    if not root.is_dir():
        return
    found: list[Path] = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        for fn in filenames:
            if fn.lower().endswith(".gguf"):
                m = SPLIT_RE.match(fn)
                if m and int(m.group("part")) != 1:
                    continue  # later parts of a split model: loaded through the first one
                found.append(Path(dirpath) / fn)
    yield from sorted(found)


def _relative_origin(root: Path, file: Path, depth: int) -> str:
    try:
        parts = file.relative_to(root).parts[:-1]
    except ValueError:
        return ""
    return "/".join(parts[:depth])


def _lmstudio(roots: Sequence[Path]) -> Iterator[_Candidate]:
    for root in roots:
        for f in _gguf_files(root):
            yield _Candidate(f, "lmstudio", origin=_relative_origin(root, f, 2))


def _hf(root: Path) -> Iterator[_Candidate]:
    if not root.is_dir():
        return
    for repo in sorted(root.glob("models--*")):
        origin = "/".join(repo.name.split("--")[1:])
        snapshots = repo / "snapshots"
        for f in _gguf_files(snapshots):
            yield _Candidate(f, "hf", origin=origin)


def _llama_cpp(root: Path) -> Iterator[_Candidate]:
    for f in _gguf_files(root):
        yield _Candidate(f, "llama.cpp", origin=_relative_origin(root, f, 2))


def _ollama(root: Path) -> Iterator[_Candidate]:
    """Ollama keeps manifests/<host>/<namespace>/<name>/<tag> (JSON) pointing at blobs/sha256-<hex>."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        rel = manifest.relative_to(manifests).parts
        if len(rel) < 4:
            continue
        host, *namespace, model, tag = rel
        if host == "registry.ollama.ai" and namespace == ["library"]:
            label = f"{model}:{tag}"
        elif host == "registry.ollama.ai":
            label = f"{'/'.join(namespace)}/{model}:{tag}"
        else:
            label = f"{host}/{'/'.join(namespace)}/{model}:{tag}"
        try:
            doc = json.loads(manifest.read_text(encoding="utf-8"))
            layers = doc["layers"]
            digests = [
                layer["digest"]
                for layer in layers
                if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE
            ]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("skipping unreadable Ollama manifest %s: %s", manifest, exc)
            continue
        for digest in digests:
            if not isinstance(digest, str) or not re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
                continue
            blob = root / "blobs" / digest.replace(":", "-")
            yield _Candidate(blob, "ollama", name=label, origin=label)


def _demo(paths: Sequence[Path] | None) -> Iterator[_Candidate]:
    from ..config import demo

    licences = {d.id: d.licence for d in demo.DEMO_MODELS}
    if paths is not None:
        for p in paths:
            yield _Candidate(Path(p), "demo")
        return
    for d in demo.available():
        try:
            p = demo.smollm2_path() if d.id == demo.SMOLLM2_ID else demo.gemma3_path()
        except (demo.DemoUnavailableError, OSError) as exc:
            log.warning("demo model %s unavailable: %s", d.id, exc)
            continue
        yield _Candidate(p, "demo", name=d.name, origin=d.package, licence=licences[d.id])


def _split_size(path: Path) -> int | None:
    m = SPLIT_RE.match(path.name)
    if not m:
        return None
    total = 0
    for i in range(1, int(m.group("total")) + 1):
        part = path.with_name(f"{m.group('stem')}-{i:05d}-of-{m.group('total')}.gguf")
        try:
            total += part.stat().st_size
        except OSError:
            return None
    return total


def scan_report(
    sources: Iterable[Source] | None = None,
    *,
    lmstudio: Sequence[Path] | None = None,
    hf: Path | None = None,
    llama_cpp: Path | None = None,
    ollama: Path | None = None,
    demo_paths: Sequence[Path] | None = None,
    files: Sequence[Path] = (),
) -> ScanReport:
    """Scan the given sources (default: all) and return the entries plus the files skipped and why.

    Each root defaults to where the tool keeps its models (environment variables honoured).
    ``files`` adds single files (source "file"). The same file reached twice (HF snapshots link
    one blob) is listed once.
    """
    wanted = tuple(sources) if sources is not None else ALL_SOURCES
    unknown = [s for s in wanted if s not in (*ALL_SOURCES, "file")]
    if unknown:
        raise ValueError(f"unknown catalog source(s) {unknown}: use some of {', '.join(ALL_SOURCES)}")
    lm_roots = list(lmstudio) if lmstudio is not None else default_lmstudio_roots()
    hf_root = hf if hf is not None else default_hf_root()
    llama_root = llama_cpp if llama_cpp is not None else default_llama_cpp_root()
    ollama_root = ollama if ollama is not None else default_ollama_root()
    roots: list[tuple[Source, str]] = []
    candidates: list[_Candidate] = []
    if "demo" in wanted:
        candidates.extend(_demo(demo_paths))
    if "lmstudio" in wanted:
        roots.extend(("lmstudio", str(r)) for r in lm_roots)
        candidates.extend(_lmstudio(lm_roots))
    if "hf" in wanted:
        roots.append(("hf", str(hf_root)))
        candidates.extend(_hf(hf_root))
    if "llama.cpp" in wanted:
        roots.append(("llama.cpp", str(llama_root)))
        candidates.extend(_llama_cpp(llama_root))
    if "ollama" in wanted:
        roots.append(("ollama", str(ollama_root)))
        candidates.extend(_ollama(ollama_root))
    candidates.extend(_Candidate(Path(f), "file") for f in files)

    entries: list[CatalogEntry] = []
    projectors: list[CatalogEntry] = []
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()
    for cand in candidates:
        try:
            real = str(cand.path.resolve())
        except OSError:
            real = str(cand.path)
        if real in seen:
            continue
        seen.add(real)
        try:
            entry = read_gguf_header(cand.path, cand.source, size=_split_size(cand.path))
        except ModelFileError as exc:
            log.info("catalog: skipping %s: %s", cand.path, exc)
            skipped.append((str(cand.path), str(exc)))
            continue
        if is_projector(entry):
            skipped.append((str(cand.path), "a vision projector (mmproj), not a language model"))
            projectors.append(entry)
            continue
        changes: dict[str, Any] = {"origin": cand.origin}
        if cand.name:
            changes["name"] = cand.name
        if cand.licence and not entry.licence:
            changes["licence"] = cand.licence
        entries.append(replace(entry, **changes))
    entries = pair_projectors(entries, projectors)
    return ScanReport(entries=tuple(entries), skipped=tuple(skipped), roots=tuple(roots))


def scan(sources: Iterable[Source] | None = None, **roots: Any) -> list[CatalogEntry]:
    """The usable GGUF models found in ``sources`` (see :func:`scan_report` for the roots)."""
    return list(scan_report(sources, **roots).entries)
