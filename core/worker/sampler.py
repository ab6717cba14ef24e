"""One sequence's sampler: the llama_sampler chain a request's ``Sampling`` asks for.

The per-sequence contract shared by the generation loop (``decode``) and the features built on the
sampler (grammar, penalties, logit bias, logprobs): the loop owns the batch and the sequences; for
each sequence whose logits the last ``llama_decode`` produced it calls ``sample(ctx, idx)`` with the
row of that sequence's output in the batch (``llama_get_logits_ith`` semantics; -1 = the last row),
and gets the token, already accepted by the chain. What else a feature records per token (a
logprob entry, the grammar's state) lives on the Sampler, one per sequence, freed with ``close``.

Greedy (temperature 0) is ``greedy`` alone; otherwise ``top_k``, ``top_p``, ``min_p``, ``temp``,
``dist(seed)``: the chain llama-cpp-python builds (its ``penalties`` and ``typical`` samplers are
no-ops at their default values and are left out), so a seeded request answers as before.
"""

from __future__ import annotations

from typing import Any

import llama_cpp

from ..sampling import Sampling


class Sampler:
    """A llama_sampler chain for one request (free it with ``close``)."""

    def __init__(self, llm: Any, sampling: Sampling) -> None:
        temperature, top_k, top_p, seed = sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed
        self.chain: Any = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not self.chain:
            raise RuntimeError("llama_sampler_chain_init failed")
        self.greedy = temperature == 0.0
        seed_u32 = llama_cpp.LLAMA_DEFAULT_SEED if seed is None else int(seed) & 0xFFFFFFFF
        links: list[Any]
        if self.greedy:
            links = [llama_cpp.llama_sampler_init_greedy()]
        elif temperature < 0.0:
            links = [llama_cpp.llama_sampler_init_dist(seed_u32)]
        else:
            links = [
                llama_cpp.llama_sampler_init_top_k(int(top_k)),
                llama_cpp.llama_sampler_init_top_p(float(top_p), 1),
                llama_cpp.llama_sampler_init_min_p(float(sampling.min_p), 1),
                llama_cpp.llama_sampler_init_temp(float(temperature)),
                llama_cpp.llama_sampler_init_dist(seed_u32),
            ]
        for link in links:
            llama_cpp.llama_sampler_chain_add(self.chain, link)  # the chain owns it now

    def sample(self, ctx: Any, idx: int = -1) -> int:
        """Sample (and accept) a token from output row ``idx`` of the last decode (-1: the last)."""
        return int(llama_cpp.llama_sampler_sample(self.chain, ctx, idx))

    def close(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)  # frees the samplers of the chain too
            self.chain = None
