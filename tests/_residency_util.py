"""Helpers for the residency tests: a small synthetic Llama-shaped Q4_0 GGUF (same recipe as
/work/shared/tools/make_synthetic_gguf.py, scaled down, with SmolLM2's real tokenizer) and the
8-step greedy logits used by the bitwise checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp  # before numpy (worker rule)
import numpy as np


def make_small_q4_0(out: Path, tokenizer_gguf: Path, n_layers: int = 2, n_embd: int = 256) -> Path:
    """Random Q4_0 weights in a Llama layout; Q4_0 makes the CPU backend repack them (CPU_REPACK)."""
    import gguf

    voc = gguf.GGUFReader(str(tokenizer_gguf))
    f = voc.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    e, ff, heads, kv_heads = n_embd, 2 * n_embd, 4, 2
    head_dim = e // heads
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(e)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(len(tokens))
    w.add_file_type(2)
    w.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens)
    w.add_token_types(f["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(f["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"].contents())
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"].contents())
    rng = np.random.default_rng(0)

    def q4(n_out: int, n_in: int) -> np.ndarray[Any, Any]:
        blocks = n_in // 32
        a = rng.integers(0, 256, size=(n_out, blocks * 18), dtype=np.uint8)
        d = np.frombuffer(np.float16(0.02).tobytes(), dtype=np.uint8)
        a[:, 0::18] = d[0]
        a[:, 1::18] = d[1]
        return a

    norm = np.ones(e, dtype=np.float32)
    q4t = gguf.GGMLQuantizationType.Q4_0
    w.add_tensor("token_embd.weight", q4(len(tokens), e), raw_dtype=q4t)
    w.add_tensor("output_norm.weight", norm)
    w.add_tensor("output.weight", q4(len(tokens), e), raw_dtype=q4t)
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
        for name, shape in {
            "attn_q": (e, e),
            "attn_k": (kv_heads * head_dim, e),
            "attn_v": (kv_heads * head_dim, e),
            "attn_output": (e, e),
            "ffn_gate": (ff, e),
            "ffn_up": (ff, e),
            "ffn_down": (e, ff),
        }.items():
            w.add_tensor(f"blk.{i}.{name}.weight", q4(*shape), raw_dtype=q4t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def load(path: Path, n_ctx: int = 256, **kwargs: Any) -> llama_cpp.Llama:
    """Load as a worker does on a CPU build: no mmap (the weights are this process's memory) and
    glibc told to give freed large blocks back at once (what the worker sets before loading), so
    a release shows in the RSS."""
    from timeshare.core.residency.hostmem import fix_malloc_mmap_threshold

    fix_malloc_mmap_threshold()
    kwargs.setdefault("use_mmap", False)
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=64, n_gpu_layers=-1, verbose=False, **kwargs)


class Greedy:
    """Prefill a prompt once; ``run()`` rewinds to it and returns the logits of 8 greedy steps."""

    def __init__(
        self, llm: llama_cpp.Llama, prompt: bytes = b"The quick brown fox jumps over the lazy dog."
    ) -> None:
        self.llm = llm
        self.tokens = llm.tokenize(prompt)
        llm.eval(self.tokens[:-1])
        self.n_prefix = llm.n_tokens
        self.n_vocab = llm.n_vocab()

    def run(self, steps: int = 8) -> list[np.ndarray[Any, Any]]:
        llm = self.llm
        llm.n_tokens = self.n_prefix  # eval() drops the KV cells after it: only the prefix is reused
        tok = self.tokens[-1]
        out = []
        for _ in range(steps):
            llm.eval([tok])
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(self.n_vocab,)
            ).copy()
            out.append(logits)
            tok = int(logits.argmax())
        return out


def same(a: list[np.ndarray[Any, Any]], b: list[np.ndarray[Any, Any]]) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


def decode_seq(ctx: Any, tokens: list[int], seq: int, start: int) -> None:
    """Decode ``tokens`` into sequence ``seq`` of the llama context object ``ctx`` from position
    ``start`` (logits for the last one only), with a batch of its own."""
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i == len(tokens) - 1
        assert llama_cpp.llama_decode(ctx.ctx, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)
