"""Embeddings from a loaded model, in the worker: one vector per input, L2-normalised (OpenAI's
embeddings are unit vectors; llama-server normalises by default too).

Two kinds of model embed:

- a model entry with ``embedding = true``: its context is made for it (``Llama(embedding=True)``,
  pooling from the GGUF's ``<arch>.pooling_type``). Pooling ``mean``, ``cls`` or ``last`` is
  llama.cpp's (``llama_get_embeddings_seq``); a GGUF that sets none (a causal LM) gets mean
  pooling, done here over the tokens' embeddings. ``rank`` (rerankers) gives no embeddings: its
  pooled output is the classifier's scores (``rank_tokens``, for ``/v1/rerank``; issue 42).
- a chat model, on request: its context is switched to embeddings (``llama_set_embeddings``) for
  the request and back. Its pooling is ``none``: mean pooling is done here. The inputs are decoded
  in sequences of their own (``seq_ids``, idle sequences the engine emptied), whose KV cells are
  removed after each decode: the sequence of a conversation is not touched. The logits of the
  context's last decode are gone, so the caller must evaluate the next prompt's last token again
  (``Llama._requires_eval``).

**Batches** (issue 45). One ``llama_decode`` holds as many inputs as there are sequences and as
fit in its tokens (``n_batch``; ``n_ubatch`` where llama.cpp pools), each input in a sequence of
its own, at positions from 0: an input's attention sees only its own cells, so its vector is the
one it has alone (tests/test_embed.py compares each with llama-cpp-python's ``Llama.embed`` of
that input alone). The inputs are packed shortest first: llama.cpp splits a batch over separate
KV streams (``kv_unified`` false) into micro-batches of equally many tokens from each sequence, so
inputs of like length make fewer of them. Where llama.cpp pools, a pooled sequence must lie in
one micro-batch (its pooled vector is taken per micro-batch): a decode holds at most ``n_ubatch``
tokens, and on a context with a KV cache of several streams only inputs of one length. A context
whose KV cache is one stream for all sequences (``kv_unified``: llama-cpp-python's own embedding
context) embeds one input per decode: there a longer input packed after shorter ones came out
2e-3 off its own vector. The worker's contexts have a stream per sequence (engine._sequences).

Never ``Llama.embed``: it clears the whole KV cache. Inputs longer than one decode may hold are
refused (``PromptTooLongError``), as llama-server refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from ..errors import InvalidInputError, PromptTooLongError
from .decode import TokenBatch

POOLING_NAMES = {
    llama_cpp.LLAMA_POOLING_TYPE_NONE: "none (mean here)",
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
    llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank",
}


def pack(lengths: Sequence[int], limit: int, n_seq: int, *, equal: bool = False) -> list[list[int]]:
    """The inputs (indices into ``lengths``) of each decode: shortest first, at most ``n_seq``
    inputs and ``limit`` tokens per decode; ``equal``: only inputs of one length together."""
    groups: list[list[int]] = []
    group: list[int] = []
    used = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]
        if group and (len(group) >= n_seq or used + n > limit or (equal and n != lengths[group[0]])):
            groups.append(group)
            group, used = [], 0
        group.append(i)
        used += n
    if group:
        groups.append(group)
    return groups


def embed_tokens(
    llm: Any,
    inputs: Sequence[Sequence[int]],
    *,
    seq_ids: Sequence[int] = (0,),
    switch: bool = False,
    before_step: Callable[[], None] = lambda: None,
) -> list[list[float]]:
    """One unit vector per token list, in order. ``seq_ids``: the empty sequences the inputs may
    use (one decode packs up to that many inputs; see the module docstring). ``switch``: the
    context is a chat model's (embeddings are switched on for the call and off again).
    ``before_step`` runs before each decode (the worker's residency and cancel check; it may
    raise)."""
    if int(llama_cpp.llama_pooling_type(llm.ctx)) == llama_cpp.LLAMA_POOLING_TYPE_RANK:
        raise InvalidInputError(
            "this model is a reranker (pooling rank): it scores query and document pairs on "
            "/v1/rerank and has no embeddings to give"
        )
    rows = pooled(llm, inputs, seq_ids=seq_ids, switch=switch, before_step=before_step)
    return [_unit(row.astype(np.float64)) for row in rows]


def rank_tokens(
    llm: Any,
    inputs: Sequence[Sequence[int]],
    *,
    seq_ids: Sequence[int] = (0,),
    before_step: Callable[[], None] = lambda: None,
) -> list[list[float]]:
    """A reranker's scores (its classifier's ``n_cls_out`` outputs, as llama.cpp's rank pooling
    gives them: no sigmoid) for each token list, one query and document pair each (see
    ``rerank_tokens``), packed as ``embed_tokens`` packs its inputs. The context must pool by
    rank."""
    if int(llama_cpp.llama_pooling_type(llm.ctx)) != llama_cpp.LLAMA_POOLING_TYPE_RANK:
        raise InvalidInputError("this model is not a reranker (its pooling is not rank)")
    rows = pooled(llm, inputs, seq_ids=seq_ids, before_step=before_step)
    return [[float(x) for x in row] for row in rows]


def rerank_tokens(llm: Any, query: str, document: str) -> list[int]:
    """The tokens of one query and document pair, as llama-server's ``format_prompt_rerank``
    makes them: the model's ``rerank`` chat template with ``{query}`` and ``{document}`` put in
    (tokenized without BOS, special tokens parsed) when its GGUF has one
    (``tokenizer.chat_template.rerank``: Qwen3-Reranker's conversion); otherwise
    ``[BOS] query [EOS] [SEP] document [EOS]``, each of BOS, EOS and SEP only where the vocabulary
    adds it (EOS falls back to SEP where there is none: BERT's ``[CLS] q [SEP] d [SEP]``,
    XLM-R's ``<s> q </s></s> d </s>``), query and document tokenized without special tokens."""
    model = llm._model.model
    vocab = llm._model.vocab
    template = llama_cpp.llama_model_chat_template(model, b"rerank")
    if template:
        text = template.decode("utf-8", errors="replace")
        text = text.replace("{query}", query).replace("{document}", document)
        return list(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))
    q = list(llm.tokenize(query.encode("utf-8"), add_bos=False, special=False))
    d = list(llm.tokenize(document.encode("utf-8"), add_bos=False, special=False))
    eos = int(llama_cpp.llama_vocab_eos(vocab))
    sep = int(llama_cpp.llama_vocab_sep(vocab))
    if eos == llama_cpp.LLAMA_TOKEN_NULL:
        eos = sep
    add_eos = bool(llama_cpp.llama_vocab_get_add_eos(vocab))
    out: list[int] = []
    if llama_cpp.llama_vocab_get_add_bos(vocab):
        out.append(int(llama_cpp.llama_vocab_bos(vocab)))
    out += q
    if add_eos:
        out.append(eos)
    if llama_cpp.llama_vocab_get_add_sep(vocab):
        out.append(sep)
    out += d
    if add_eos:
        out.append(eos)
    return out


def pooled(
    llm: Any,
    inputs: Sequence[Sequence[int]],
    *,
    seq_ids: Sequence[int] = (0,),
    switch: bool = False,
    before_step: Callable[[], None] = lambda: None,
) -> list[Any]:
    """Each input's pooled output (a float32 numpy row: ``n_embd`` numbers, or a reranker's
    ``n_cls_out`` scores), in order; the work of ``embed_tokens`` and ``rank_tokens`` (see the
    module docstring)."""
    if not seq_ids:
        raise ValueError("embed_tokens needs at least one sequence")
    ctx = llm.ctx
    n_embd = int(llm.n_embd())
    pooling = int(llama_cpp.llama_pooling_type(ctx))
    width = n_embd
    if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK:
        width = max(1, int(llama_cpp.llama_model_n_cls_out(llm._model.model)))
    memory = llama_cpp.llama_get_memory(ctx)
    is_pooled = pooling != llama_cpp.LLAMA_POOLING_TYPE_NONE
    limit = int(llm.n_batch)
    if is_pooled:
        limit = min(limit, int(llama_cpp.llama_n_ubatch(ctx)))
    what = (
        "a query and document pair" if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK else "an embedding input"
    )
    for tokens in inputs:
        if not tokens:
            raise PromptTooLongError(f"{what} is empty: give some text or tokens")
        if len(tokens) > limit:
            raise PromptTooLongError(
                f"{what} is {len(tokens)} tokens but this model takes at most {limit} "
                "at once (n_ctx / n_batch): shorten it or split it"
            )
    if not inputs:
        return []
    seqs = sorted(int(s) for s in seq_ids)
    if memory and bool(getattr(llm.context_params, "kv_unified", False)):
        # one KV stream for all sequences: a longer input packed after shorter ones came out 2e-3
        # off its own vector (SmolLM2, llama-cpp-python 0.3.36); separate streams are bit for bit
        seqs = seqs[:1]
    # several KV streams split a batch into micro-batches of equally many tokens per sequence
    equal = is_pooled and bool(memory) and int(llama_cpp.llama_n_seq_max(ctx)) > 1
    groups = pack([len(t) for t in inputs], limit, len(seqs), equal=equal)
    size = max(sum(len(inputs[i]) for i in group) for group in groups)
    batch = TokenBatch(size)  # numpy arrays under the llama_batch: a decode fills whole slices
    out: list[Any] = [None for _ in inputs]
    if switch:
        llama_cpp.llama_set_embeddings(ctx, True)
    try:
        for seq in seqs:
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
        for group in groups:
            before_step()
            n = 0
            for seq, i in zip(seqs, group, strict=False):
                k = len(inputs[i])
                batch.token[n : n + k] = inputs[i]
                batch.pos[n : n + k] = batch.arange[:k]
                batch.seq[n : n + k] = seq
                n += k
            batch.logits[:n] = 1  # every token is an output (llama.cpp wants it for pooling)
            batch.struct.n_tokens = n
            rc = int(llama_cpp.llama_decode(ctx, batch.struct))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} while embedding")
            if is_pooled:
                for seq, i in zip(seqs, group, strict=False):
                    ptr = llama_cpp.llama_get_embeddings_seq(ctx, seq)
                    if not ptr:
                        raise RuntimeError("llama.cpp gave no pooled embedding")
                    out[i] = np.ctypeslib.as_array(ptr, shape=(width,)).copy()
            else:
                ptr = llama_cpp.llama_get_embeddings(ctx)  # every token's row, in batch order
                if not ptr:
                    raise RuntimeError("llama.cpp gave no token embeddings")
                rows = np.ctypeslib.as_array(ptr, shape=(n, n_embd))
                start = 0
                for i in group:
                    end = start + len(inputs[i])
                    out[i] = rows[start:end].astype(np.float64).mean(axis=0)
                    start = end
            for seq in seqs[: len(group)]:
                llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
    finally:
        for seq in seqs:
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
        if switch:
            llama_cpp.llama_set_embeddings(ctx, False)
    return out


def _unit(vector: Any) -> list[float]:
    norm = float(np.linalg.norm(vector))
    result: list[float] = (vector / norm if norm > 0 else vector).tolist()
    return result
