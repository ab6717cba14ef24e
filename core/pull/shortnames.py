"""Ollama-style short names (``llama3.2``, ``qwen3:8b``, ``gemma3:4b``) for ``timeshare pull`` and
"Get model…": a maintained table from the name Ollama users type to a GGUF repository on the
Hugging Face hub and the quantisation Timeshare gets by default (``--quant`` or ``NAME:…`` with a
quantisation picks another: ``qwen3:8b`` is a size, ``user/repo:Q8_0`` a quantisation).

To add a model: one line in :data:`SHORT_NAMES` (family:size → repo, quantisation) and, if it is
the size Ollama pulls for the bare family name, one line in :data:`DEFAULT_SIZES`. README's "Short
names" section lists the table (tests/test_pull_shortnames.py checks it does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShortName:
    repo_id: str  # "user/repo" on the hub
    quant: str  # the default quantisation ("Q4_K_M")


#: family:size → where its GGUF is. Instruct (chat) builds, as Ollama's tags are.
SHORT_NAMES: dict[str, ShortName] = {
    "llama3.2:1b": ShortName("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M"),
    "llama3.2:3b": ShortName("bartowski/Llama-3.2-3B-Instruct-GGUF", "Q4_K_M"),
    "llama3.1:8b": ShortName("bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", "Q4_K_M"),
    "qwen3:0.6b": ShortName("Qwen/Qwen3-0.6B-GGUF", "Q8_0"),
    "qwen3:4b": ShortName("Qwen/Qwen3-4B-GGUF", "Q4_K_M"),
    "qwen3:8b": ShortName("Qwen/Qwen3-8B-GGUF", "Q4_K_M"),
    "qwen3:14b": ShortName("Qwen/Qwen3-14B-GGUF", "Q4_K_M"),
    "qwen3:32b": ShortName("Qwen/Qwen3-32B-GGUF", "Q4_K_M"),
    "qwen2.5:0.5b": ShortName("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M"),
    "qwen2.5:1.5b": ShortName("bartowski/Qwen2.5-1.5B-Instruct-GGUF", "Q4_K_M"),
    "qwen2.5:3b": ShortName("bartowski/Qwen2.5-3B-Instruct-GGUF", "Q4_K_M"),
    "qwen2.5:7b": ShortName("bartowski/Qwen2.5-7B-Instruct-GGUF", "Q4_K_M"),
    "gemma3:1b": ShortName("ggml-org/gemma-3-1b-it-GGUF", "Q4_K_M"),
    "gemma3:4b": ShortName("ggml-org/gemma-3-4b-it-GGUF", "Q4_K_M"),
    "gemma3:12b": ShortName("ggml-org/gemma-3-12b-it-GGUF", "Q4_K_M"),
    "gemma3:27b": ShortName("ggml-org/gemma-3-27b-it-GGUF", "Q4_K_M"),
    "mistral:7b": ShortName("bartowski/Mistral-7B-Instruct-v0.3-GGUF", "Q4_K_M"),
}

#: the size a bare family name means (Ollama's ``latest`` tag)
DEFAULT_SIZES: dict[str, str] = {
    "llama3.2": "3b",
    "llama3.1": "8b",
    "qwen3": "8b",
    "qwen2.5": "7b",
    "gemma3": "4b",
    "mistral": "7b",
}


def is_short_name(text: str) -> bool:
    """Whether ``text`` is shaped like a short name (no "/", no scheme): then it is looked up here."""
    return bool(text) and "/" not in text and "://" not in text and not text.lower().endswith(".gguf")


def resolve(text: str) -> ShortName:
    """The repo and default quantisation of a short name (``qwen3:8b``, ``llama3.2``,
    ``gemma3:latest``; any case). Raises ValueError with a sentence naming the known ones."""
    name = text.strip().lower()
    family, _, size = name.partition(":")
    if not size or size == "latest":
        size = DEFAULT_SIZES.get(family, "")
    found = SHORT_NAMES.get(f"{family}:{size}")
    if found is not None:
        return found
    sizes = sorted((key.split(":")[1] for key in SHORT_NAMES if key.split(":")[0] == family), key=_size_key)
    if sizes:
        raise ValueError(
            f"{text!r}: {family} comes in {', '.join(sizes)} here (e.g. {family}:{sizes[0]}); "
            "or give a Hugging Face repo (user/repo)"
        )
    raise ValueError(
        f"{text!r} is not a model source: give a short name ({', '.join(known_names())}), a Hugging "
        "Face repo (user/repo, user/repo:Q4_K_M) or the http(s):// URL of a .gguf file"
    )


def known_names() -> list[str]:
    """The family names, in the table's order (for messages and the docs)."""
    return list(dict.fromkeys(key.split(":")[0] for key in SHORT_NAMES))


def _size_key(size: str) -> float:
    try:
        return float(size.rstrip("bm")) * (1e-3 if size.endswith("m") else 1.0)
    except ValueError:
        return 0.0
