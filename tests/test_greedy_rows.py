"""``sampler.GreedyRows`` (the plain greedy step's one argmax) against llama.cpp's own greedy
sampler on the same logits: ties go to the lowest id, all -inf rows to id 0, rows taken out of
order and in any number; a row with a NaN is left to the sampler chain (None)."""

from __future__ import annotations

# isort: off
import llama_cpp
# isort: on

import ctypes
from typing import Any

import numpy as np
import pytest
from timeshare.core.worker import sampler
from timeshare.core.worker.sampler import GreedyRows

N_VOCAB = 4099


def llama_greedy(row: np.ndarray[Any, Any]) -> int:
    """The token llama.cpp's greedy sampler selects from ``row`` (its candidates built as
    llama_sampler_sample builds them: every id in order)."""
    data = (llama_cpp.llama_token_data * len(row))()
    view = np.ctypeslib.as_array(data)
    view["id"] = np.arange(len(row), dtype=np.int32)
    view["logit"] = row
    view["p"] = 0.0
    cur = llama_cpp.llama_token_data_array(
        data=ctypes.cast(data, llama_cpp.llama_token_data_p), size=len(row), selected=-1, sorted=False
    )
    greedy = llama_cpp.llama_sampler_init_greedy()
    try:
        llama_cpp.llama_sampler_apply(greedy, ctypes.byref(cur))
    finally:
        llama_cpp.llama_sampler_free(greedy)
    return int(data[cur.selected].id)


def test_the_argmax_picks_what_llamas_greedy_sampler_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(24)
    block = rng.standard_normal((6, N_VOCAB)).astype(np.float32)
    block[1, [17, 2000, 4098]] = block[1].max() + 1.0  # a three-way tie for the top
    block[2, :] = -np.inf  # nothing is likely: id 0
    block[3, :] = 0.5  # every logit equal: id 0
    block[3, 4098] = 0.25
    block[4, 300] = np.nan  # a NaN: the chain decides
    block[5, 0] = np.nan
    base = block.ctypes.data

    def logits_ith(_ctx: Any, i: int) -> Any:
        return ctypes.cast(base + 4 * N_VOCAB * i, ctypes.POINTER(ctypes.c_float))

    monkeypatch.setattr(sampler.llama_cpp, "llama_get_logits_ith", logits_ith)
    want = [llama_greedy(block[i]) for i in range(4)]
    assert want[1] == 17 and want[2] == 0 and want[3] == 0  # the oracle's own tie rule
    greedy = GreedyRows(N_VOCAB)
    assert greedy.tokens(None, [0, 1, 2, 3]) == want
    assert greedy.tokens(None, [3, 1]) == [want[3], want[1]]
    assert greedy.tokens(None, [2]) == [want[2]]  # another block (it starts at row 2)
    assert greedy.tokens(None, [4, 0, 5]) == [None, want[0], None]
    assert greedy.tokens(None, [0, 1, 2, 3]) == want  # the same again (the view kept)
    block[1, 3000] = block[1, 17] + 1.0  # new logits in the same buffer: a new answer
    assert greedy.tokens(None, [1]) == [3000] == [llama_greedy(block[1])]
    assert greedy.tokens(None, []) == []
