"""Tiny generated models of the architectures people run (issue 38, item 5): random F32 weights
in the layout llama.cpp 0.3.36's loader asks for, a real tokenizer (the first 1024 tokens of
SmolLM2's BPE vocabulary and the merges among them). A model is ~1 MB and loads in milliseconds.

The layouts (``tests/data/arch_specs.json``: metadata and every tensor's shape, 2 layers) were
found with ``scripts/lab/arch_specs.py``, which asks llama.cpp's loader for each missing tensor
and its expected shape; a few tensors the loader calls optional but the graph needs were added by
hand (granitehybrid's ``ssm_conv1d.bias``; qwen3next's ``ssm_in``; qwen35's ``attn_qkv`` and
``attn_gate``). bert carries a classifier head (``cls.*``) that only rank pooling uses: a weight
the warm-up graph does not show."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SPECS = Path(__file__).parent / "data" / "arch_specs.json"
N_VOCAB = 1024

#: the matrix: architecture -> kind (what the doctor and the prompt cache do with it)
KINDS = {
    "llama": "dense",
    "gemma3": "sliding-window",
    "qwen3moe": "moe",
    "gpt-oss": "moe, sliding-window",
    "mamba2": "recurrent",
    "lfm2": "hybrid (short conv + attention)",
    "granitehybrid": "hybrid (mamba2 + attention)",
    "qwen3next": "hybrid (gated delta net + attention, moe)",
    "qwen35": "hybrid (gated delta net + attention)",
    "bert": "encoder",
}


@dataclass(frozen=True)
class Vocab:
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]


@functools.lru_cache(maxsize=2)
def _vocab(tokenizer_gguf: str) -> Vocab:
    """The first N_VOCAB tokens of a BPE vocabulary and the merges among them (read once: reading
    SmolLM2's 49k tokens with GGUFReader takes seconds)."""
    import gguf

    f = gguf.GGUFReader(tokenizer_gguf).fields
    tokens = f["tokenizer.ggml.tokens"].contents()[:N_VOCAB]
    keep = set(tokens)
    merges = []
    for m in f["tokenizer.ggml.merges"].contents():
        a = m.split(" ")
        if len(a) == 2 and a[0] in keep and a[1] in keep and a[0] + a[1] in keep:
            merges.append(m)
    types = f["tokenizer.ggml.token_type"].contents()[:N_VOCAB]
    return Vocab(f["tokenizer.ggml.pre"].contents(), tokens, types, merges)


def specs() -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = json.loads(SPECS.read_text())
    return data


def write_model(arch: str, out: Path, tokenizer_gguf: Path, seed: int = 0) -> Path:
    """Write the tiny ``arch`` model to ``out`` (random weights, scaled small so that the logits
    stay finite)."""
    import gguf

    spec = specs()[arch]
    vocab = _vocab(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in spec["kv"].items():
        key = key.replace("{arch}", arch)
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, str(value))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(seed)
    for name, shape in spec["tensors"].items():
        # numpy's shape is ggml's ne reversed
        w.add_tensor(name, (rng.standard_normal(tuple(reversed(shape))) * 0.05).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def write_reranker(
    out: Path, tokenizer_gguf: Path, seed: int = 0, rerank_template: str | None = None
) -> Path:
    """A tiny generated reranker (issue 42): the bert layout above with pooling ``rank`` (4), its
    classifier head (``cls.*``, one output) scaled up so that the scores of different documents
    differ, and a vocabulary that adds BOS, EOS and SEP (``[BOS] query [EOS] [SEP] document
    [EOS]``, what llama-server builds for such a model: XLM-R's ``<s> q </s></s> d </s>``).
    ``rerank_template``: a ``tokenizer.chat_template.rerank`` (Qwen3-Reranker's conversion
    carries one; ``{query}`` and ``{document}`` are put in)."""
    import gguf

    spec = specs()["bert"]
    vocab = _vocab(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(out), "bert")
    for key, value in spec["kv"].items():
        key = key.replace("{arch}", "bert")
        if key == "bert.pooling_type":
            value = 4  # LLAMA_POOLING_TYPE_RANK
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_sep_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_bool("tokenizer.ggml.add_sep_token", True)
    if rerank_template is not None:
        w.add_string("tokenizer.chat_template.rerank", rerank_template)
    rng = np.random.default_rng(seed)
    for name, shape in spec["tensors"].items():
        scale = 0.5 if name.startswith("cls") else 0.05
        w.add_tensor(name, (rng.standard_normal(tuple(reversed(shape))) * scale).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out
