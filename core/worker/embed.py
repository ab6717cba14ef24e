"""Embeddings from a loaded model, in the worker: one vector per input, L2-normalised (OpenAI's
embeddings are unit vectors; llama-server normalises by default too).

Two kinds of model embed:

- a model entry with ``embedding = true``: its context is made for it (``Llama(embedding=True)``,
  pooling from the GGUF's ``<arch>.pooling_type``). Pooling ``mean``, ``cls`` or ``last`` is
  llama.cpp's (``llama_get_embeddings_seq``); a GGUF that sets none (a causal LM) gets mean
  pooling, done here over the tokens' embeddings. ``rank`` (rerankers) is refused.
- a chat model, on request: its context is switched to embeddings (``llama_set_embeddings``) for
  the request and back. Its pooling is ``none``: mean pooling is done here. The input is decoded
  in a sequence of its own (``seq_id``), whose KV cells are removed afterwards: the sequence of a
  conversation is not touched. The logits of the context's last decode are gone, so the caller
  must evaluate the next prompt's last token again (``Llama._requires_eval``).

Never ``Llama.embed``: it clears the whole KV cache. Inputs longer than the context's batch are
refused (``PromptTooLongError``), as llama-server refuses them; an input is one ``llama_decode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from ..errors import PromptTooLongError

POOLING_NAMES = {
    llama_cpp.LLAMA_POOLING_TYPE_NONE: "none (mean here)",
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
    llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank",
}


def embed_tokens(
    llm: Any,
    inputs: Sequence[Sequence[int]],
    *,
    seq_id: int = 0,
    switch: bool = False,
    before_step: Callable[[], None] = lambda: None,
) -> list[list[float]]:
    """One unit vector per token list. ``switch``: the context is a chat model's (embeddings are
    switched on for the call and off again). ``before_step`` runs before each decode (the worker's
    residency and cancel check; it may raise)."""
    ctx = llm.ctx
    n_embd = int(llm.n_embd())
    n_batch = int(llm.n_batch)
    pooling = int(llama_cpp.llama_pooling_type(ctx))
    if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK:
        raise PromptTooLongError(  # a 400 either way; a reranker answers scores, not embeddings
            "this model pools for ranking (a reranker): it has no embeddings to give"
        )
    for tokens in inputs:
        if not tokens:
            raise PromptTooLongError("an embedding input is empty: give some text or tokens")
        if len(tokens) > n_batch:
            raise PromptTooLongError(
                f"an embedding input is {len(tokens)} tokens but this model embeds at most {n_batch} "
                "at once (n_ctx / n_batch): shorten it or split it"
            )
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(max(len(t) for t in inputs) if inputs else 1, 0, 1)
    out: list[list[float]] = []
    if switch:
        llama_cpp.llama_set_embeddings(ctx, True)
    try:
        for tokens in inputs:
            before_step()
            llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
            batch.n_tokens = len(tokens)
            for i, token in enumerate(tokens):
                batch.token[i] = int(token)
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = 1  # every token is an output (llama.cpp wants it for pooling)
            rc = int(llama_cpp.llama_decode(ctx, batch))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} while embedding")
            if pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
                rows = np.stack(
                    [
                        np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_ith(ctx, i), shape=(n_embd,))
                        for i in range(len(tokens))
                    ]
                ).astype(np.float64)
                vector = rows.mean(axis=0)
            else:
                ptr = llama_cpp.llama_get_embeddings_seq(ctx, seq_id)
                if not ptr:
                    raise RuntimeError("llama.cpp gave no pooled embedding")
                vector = np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
            norm = float(np.linalg.norm(vector))
            out.append((vector / norm if norm > 0 else vector).tolist())
    finally:
        llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
        if switch:
            llama_cpp.llama_set_embeddings(ctx, False)
        llama_cpp.llama_batch_free(batch)
    return out
