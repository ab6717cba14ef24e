"""Continuous batching on the real Gemma-3-270M demo model (CPU build): a sequence's greedy tokens
are the same whether it decodes alone or joins a batch where another Gemma-3 sequence is already
decoding: a prompt longer than the sliding window, the next turn of a conversation continued from
its cached prefix, a conversation restored from a host snapshot, four sequences at once; and a
host snapshot of a sequence longer than the window, which holds only the window's positions in the
SWA layers, is never cut back and continued (a prompt diverging inside it starts over).

Gemma-3-270M's Q4_K tensors are the ones llama.cpp's CPU backend repacks (AVX2) and its
sliding-window attention is the other thing a batch could change; SmolLM2's Q4_1 is neither, so
tests/test_batch.py alone cannot see either. The oracle is a fresh plain ``Llama`` with the engine's
own model parameters, driven through llama-cpp-python's ``Llama.generate`` (its own prefix matching
for a next turn) with the token ids the engine prepared, so tokenization is not what is compared.
Before the fixes, a prompt joining the batch differed at its 4th token (repacked weights) and the
diverging prompt at its 3rd (the window's lost positions)."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
from _e_worker_util import generate_message as Generate
from timeshare.core.config.schema import ModelConfig
from timeshare.core.worker.decode import Live
from timeshare.core.worker.engine import Engine

N_CTX = 1024  # per sequence: room for a prompt longer than the sliding window
SHORT = ("The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):")
N = 16


def _window(path: Path) -> int:
    field = gguf.GGUFReader(str(path)).fields["gemma3.attention.sliding_window"]
    return int(field.parts[field.data[0]][0])


class Oracle:
    """A fresh plain Llama (the engine's model parameters, one sequence) answering token ids."""

    def __init__(self, path: Path) -> None:
        self.llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, verbose=False)

    def answer(self, tokens: list[int], n: int, *, reset: bool = True) -> list[int]:
        """Greedy ids after ``tokens`` (``reset``: from an empty KV cache; else llama-cpp-python's
        prefix matching continues what the context holds)."""
        if reset:
            self.llm.reset()
        out: list[int] = []
        for token in self.llm.generate(tokens, temp=0.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token):
                break
            out.append(int(token))
            if len(out) == n:
                break
        return out


@pytest.fixture(scope="module")
def gemma2(gemma3_path: Path) -> Iterator[Engine]:
    e = Engine.load(ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=N_CTX, parallel=2, n_seq=4))
    yield e
    e.close()


@pytest.fixture(scope="module")
def oracle(gemma3_path: Path, gemma2: Engine) -> Iterator[Oracle]:
    # the oracle lays the weights out as the engine did (llama-cpp-python's Llama takes no
    # use_extra_bufts: its default model parameters are given the engine's)
    real = llama_cpp.llama_cpp.llama_model_default_params
    extra = bool(gemma2.llm.model_params.use_extra_bufts)

    def same() -> Any:
        p = real()
        p.use_extra_bufts = extra
        return p

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_cpp.llama_cpp, "llama_model_default_params", same)
        o = Oracle(gemma3_path)
    yield o
    o.llm.close()


class Batch:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.live: dict[str, Live] = {}

    def join(self, name: str, **fields: Any) -> Live:
        fields.setdefault("cache_prompt", False)
        fields.setdefault("max_tokens", N)
        prepared = self.engine.prepare(Generate(req=name, logprobs=True, **fields))
        live = self.engine.start(prepared, lambda _piece: None)
        self.live[name] = live
        return live

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.engine.step()

    def run(self) -> None:
        while self.engine.active:
            self.engine.step()

    def ids(self, name: str) -> list[int]:
        """The answer's token ids (the sampler's records: one per sampled token)."""
        return [r.token for r in self.live[name].sampler.records]


def _long_prompt(window: int) -> str:
    return "Notes: " + " ".join(f"item {i} is {['red', 'blue', 'green'][i % 3]};" for i in range(window // 4))


def test_the_sliding_window_is_read_from_the_gguf(gemma3_path: Path, gemma2: Engine) -> None:
    window = _window(gemma3_path)
    assert window == int(llama_cpp.llama_model_n_swa(gemma2.llm.model)) > 0


def test_a_sequence_joining_a_decoding_gemma3_one_answers_as_alone(
    gemma3_path: Path, gemma2: Engine, oracle: Oracle
) -> None:
    window = _window(gemma3_path)
    long = _long_prompt(window)
    cases = [(SHORT[0], SHORT[1], 3), (SHORT[2], SHORT[1], 1), (SHORT[1], long, 2), (long, SHORT[2], 5)]
    for first, second, lag in cases:
        b = Batch(gemma2)
        a = b.join("a", prompt=first)
        b.steps(lag)  # a is decoding when b joins
        assert a.completion >= 1 and not a.done
        late = b.join("b", prompt=second)
        b.run()
        tokens_a = gemma2.prepare(Generate(req="t", prompt=first)).tokens
        tokens_b = gemma2.prepare(Generate(req="t", prompt=second)).tokens
        if second is long or first is long:
            assert max(len(tokens_a), len(tokens_b)) > window + 16  # the window is crossed
        assert late.batch_size == 2
        assert b.ids("a") == oracle.answer(tokens_a, N), (first, second, lag)
        assert b.ids("b") == oracle.answer(tokens_b, N), (first, second, lag)


def test_a_second_turn_and_a_restored_conversation_in_a_batch_answer_as_alone(
    gemma3_path: Path, gemma2: Engine, oracle: Oracle
) -> None:
    window = _window(gemma3_path)
    system = _long_prompt(window // 2) + "\nAnswer in one short sentence."
    turn1 = f"{system}\nUser: Which colour is item 7?\nAssistant:"
    # turn 1 alone; the oracle does the same turn in its own context
    b = Batch(gemma2)
    b.join("t1", prompt=turn1, conversation="chat-1", cache_prompt=None)
    b.run()
    answer1 = gemma2.outcome(b.live["t1"]).text
    tokens1 = gemma2.prepare(Generate(req="t", prompt=turn1)).tokens
    assert b.ids("t1") == oracle.answer(tokens1, N)
    turn2 = f"{turn1}{answer1}\nUser: And item 8?\nAssistant:"
    tokens2 = gemma2.prepare(Generate(req="t", prompt=turn2)).tokens
    assert len(tokens2) + N < window  # the sliding window holds the whole conversation
    # turn 2 of chat-1 joins while another sequence decodes: it continues its cached prefix
    b2 = Batch(gemma2)
    b2.join("other", prompt=SHORT[1])
    b2.steps(2)
    t2 = b2.join("t2", prompt=turn2, conversation="chat-1", cache_prompt=None)
    b2.run()
    assert gemma2.outcome(t2).prompt_tokens_evaluated < len(tokens2) // 2  # the prefix was reused
    expected2 = oracle.answer(tokens2, N, reset=False)  # llama-cpp-python continues its turn 1
    assert b2.ids("t2") == expected2
    assert b2.ids("other") == oracle.answer(gemma2.prepare(Generate(req="t", prompt=SHORT[1])).tokens, N)
    # two other conversations take both sequences: chat-1 goes to a host snapshot
    for i, prompt in enumerate(SHORT[:2]):
        b3 = Batch(gemma2)
        b3.join(f"c{i}", prompt=prompt, conversation=f"chat-x{i}", cache_prompt=None)
        b3.run()
    assert "chat-1" in gemma2.conversations and not any(s.key == "chat-1" for s in gemma2.sequences.slots)
    # chat-1's turn 2 again (a regenerate): restored from the snapshot (llama_state_seq_set_data),
    # cut back to the prompt, joining a decoding sequence
    b4 = Batch(gemma2)
    b4.join("other", prompt=SHORT[2])
    b4.steps(3)
    t2b = b4.join("t2b", prompt=turn2, conversation="chat-1", cache_prompt=None)
    b4.run()
    assert gemma2.outcome(t2b).prompt_tokens_evaluated == 1  # restored: only the last prompt token again
    assert b4.ids("t2b") == expected2
    assert b4.ids("other") == oracle.answer(gemma2.prepare(Generate(req="t", prompt=SHORT[2])).tokens, N)


def test_a_host_snapshot_holds_only_the_sliding_window_so_a_diverging_prompt_starts_over(
    gemma3_path: Path, gemma2: Engine, oracle: Oracle
) -> None:
    """``llama_state_seq_get_data`` leaves out the cells the sliding window masks: a Gemma-3
    sequence longer than the window comes back from a host snapshot with only its last n_swa
    positions in the SWA layers. A keyless prompt that diverges inside it would attend to positions
    that are gone (its answer differed from the 3rd token): it is evaluated from scratch."""
    window = _window(gemma3_path)
    notes = _long_prompt(window)
    first = notes + " Which colour is item 7? Answer:"
    second = notes + " Which colour is item 9? Answer:"
    b = Batch(gemma2)
    b.join("k1", prompt=first, cache_prompt=None)
    b.run()
    held = list(b.live["k1"].ids)
    tokens2 = gemma2.prepare(Generate(req="t", prompt=second)).tokens
    shared = next(i for i, (x, y) in enumerate(zip(held, tokens2, strict=False)) if x != y)
    assert shared > window + 64 and len(held) - shared > 2  # long shared prefix, diverging inside
    gemma2.park()  # every idle sequence goes to a host snapshot
    b2 = Batch(gemma2)
    b2.join("other", prompt=SHORT[0])
    b2.steps(2)
    k2 = b2.join("k2", prompt=second, cache_prompt=None)
    b2.run()
    assert b2.ids("k2") == oracle.answer(tokens2, N)
    assert gemma2.outcome(k2).prompt_tokens_evaluated == len(tokens2)
    # what the window still holds is reused: the same prompt continued (the next request extends it)
    third = second + gemma2.outcome(k2).text + " And item 10? Answer:"
    tokens3 = gemma2.prepare(Generate(req="t", prompt=third)).tokens
    k3 = gemma2.generate(Generate(req="k3", prompt=third, max_tokens=N, logprobs=True), lambda _p: None)
    assert k3.prompt_tokens_evaluated < len(tokens3) // 4
    assert [r.token for r in k3.logprobs] == oracle.answer(tokens3, N)


def test_four_gemma3_sequences_decode_as_alone(gemma3_path: Path, oracle: Oracle) -> None:
    """Four sequences: every decode step has four rows, the repacked kernels' group size (with
    repacked weights these steps went through gemm where a solo step goes through gemv)."""
    prompts = (*SHORT, _long_prompt(160) + " Item 7 is")
    e = Engine.load(ModelConfig(id="gemma4", path=str(gemma3_path), n_ctx=N_CTX, parallel=4))
    try:
        for order in ((0, 1, 2, 3), (3, 2, 1, 0)):
            b = Batch(e)
            for k, i in enumerate(order):
                b.join(str(i), prompt=prompts[i])
                b.steps(k % 3)  # joining at different steps
            b.run()
            for i in order:
                assert b.live[str(i)].batch_size == 4
                tokens = e.prepare(Generate(req="t", prompt=prompts[i])).tokens
                assert b.ids(str(i)) == oracle.answer(tokens, N), (order, i)
    finally:
        e.close()
