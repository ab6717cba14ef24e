"""Continuous batching (issue 24) on the real SmolLM2 demo model, CPU build: several requests decoded
together in one context of ``parallel`` sequences give the same greedy answers as a fresh plain
``Llama`` gives each alone (its own oracle: ``create_completion``), one ``llama_decode`` per step for
the whole batch (counted through llama_cpp's own entry point), requests joining mid-batch, one
cancelled among four, a conversation and a keyless request sharing a batch with their prompt-cache
accounting, and a release of the weights (a GPU switch) in the middle of a batch."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _e_worker_util import generate_message as Generate
from _llama_oracle import plain_completions
from timeshare.core.config.schema import ModelConfig
from timeshare.core.worker import decode
from timeshare.core.worker.decode import Live
from timeshare.core.worker.engine import Engine

PROMPTS = (
    "The three primary colours are",
    "def fibonacci(n):\n",
    "Count from one to fifty: one, two, three,",
    "Les capitales européennes les plus connues sont",
)
N = 50


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> list[str]:
    return plain_completions(smollm2_path, PROMPTS, N)


@pytest.fixture(scope="module")
def smol4(smollm2_path: Path) -> Iterator[Engine]:
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048, parallel=4))
    yield e
    e.close()


class Batch:
    """Drives an engine's batch the way the worker's loop does: requests join, steps run."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.text: dict[str, list[str]] = {}
        self.live: dict[str, Live] = {}

    def join(self, name: str, **fields: Any) -> Live:
        fields.setdefault("cache_prompt", False)
        fields.setdefault("max_tokens", N)
        self.text[name] = []
        prepared = self.engine.prepare(Generate(req=name, **fields))
        live = self.engine.start(prepared, self.text[name].append)
        self.live[name] = live
        return live

    def step(self) -> None:
        self.engine.step()

    def run(self) -> None:
        while self.engine.active:
            self.engine.step()

    def answer(self, name: str) -> str:
        assert "".join(self.text[name]) == self.live[name].text.text  # streamed = the answer
        return "".join(self.text[name])


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts llama_decode calls (the batch sizes) through llama_cpp's own function."""
    sizes: list[int] = []
    real = llama_cpp.llama_decode

    def counting(ctx: Any, batch: Any) -> int:
        sizes.append(int(batch.n_tokens))
        return int(real(ctx, batch))

    monkeypatch.setattr(decode.llama_cpp, "llama_decode", counting)
    return sizes


def test_four_concurrent_greedy_answers_equal_four_solo_ones(
    smol4: Engine, reference: list[str], decodes: list[int]
) -> None:
    assert smol4.parallel == 4 and smol4.info.n_ctx == 2048  # every sequence has the whole context
    b = Batch(smol4)
    for i, prompt in enumerate(PROMPTS):
        b.join(f"r{i}", prompt=prompt)
    b.run()
    assert [b.answer(f"r{i}") for i in range(4)] == reference
    outcomes = [smol4.outcome(b.live[f"r{i}"]) for i in range(4)]
    assert all(o.batch_size == 4 for o in outcomes)
    # one decode per step for the whole batch: the four prompts in one, then a token each per step
    assert all(o.completion_tokens == N and o.finish_reason == "length" for o in outcomes), outcomes
    assert 50 <= len(decodes) <= 60, len(decodes)  # not ~200
    assert max(decodes) > 4 and decodes[1:] == [4] * (len(decodes) - 1)
    # and alone, the same engine answers the same
    for i, prompt in enumerate(PROMPTS[:2]):
        solo = smol4.generate(
            Generate(req="s", prompt=prompt, max_tokens=N, cache_prompt=False), lambda _t: None
        )
        assert solo.text == reference[i] and solo.batch_size == 1


def test_a_request_joining_mid_batch_and_chunked_prefill(smol4: Engine, reference: list[str]) -> None:
    # a small n_batch makes the joining prompt take several chunks, interleaved with decode steps
    b = Batch(smol4)
    b.join("a", prompt=PROMPTS[0])
    b.join("b", prompt=PROMPTS[1])
    for _ in range(10):
        b.step()
    assert len(b.text["a"]) >= 5 and not b.live["a"].done
    late = b.join("c", prompt=PROMPTS[2])
    before = smol4.decodes
    b.step()  # the late prompt is prefilled in this step, with a token each for a and b
    assert late.evaluated == late.n_prompt and late.completion == 1
    # the timings the worker reports: a and b were prefilled together in the first step, c alone
    # in a step of three sequences
    a = b.live["a"]
    assert a.first_step == b.live["b"].first_step == before - 10
    assert (a.step_prompts, a.step_sequences, a.prefill_steps) == (2, 2, 1)
    assert (late.first_step, late.step_prompts, late.step_sequences, late.prefill_steps) == (before, 1, 3, 1)
    assert late.prefill_end >= late.prefill_start > a.prefill_end > 0
    for _ in range(5):
        b.step()
    b.join("d", prompt=PROMPTS[3])
    b.run()
    assert [b.answer(x) for x in "abcd"] == reference


def test_chunked_prefill_interleaves_with_the_others_decode_steps(
    smollm2_path: Path, decodes: list[int]
) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(120))  # several chunks of 64
    ref = plain_completions(smollm2_path, (PROMPTS[0], long_prompt), 20)
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=2048 * 2, n_batch=64, verbose=False)
    from timeshare.core.worker.engine import make_sequences  # the load's own context of 2 sequences

    config = ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048, parallel=2)
    make_sequences(llm, 2, config)
    e = Engine(llm, config, None)
    try:
        b = Batch(e)
        b.join("a", prompt=PROMPTS[0], max_tokens=20)
        b.step()
        b.step()
        before = len(b.text["a"])
        late = b.join("b", prompt=long_prompt, max_tokens=20)
        chunks = 0
        while late.pending:
            b.step()
            chunks += 1
            assert len(b.text["a"]) <= before + chunks  # a keeps getting a token per step
        assert chunks >= 3 and len(b.text["a"]) == before + chunks  # no stall longer than a chunk
        assert all(size <= 64 for size in decodes)
        b.run()
        assert [b.answer("a"), b.answer("b")] == ref
    finally:
        e.close()


def test_cancel_one_of_four_mid_stream(smol4: Engine, reference: list[str]) -> None:
    b = Batch(smol4)
    for i, prompt in enumerate(PROMPTS):
        b.join(f"r{i}", prompt=prompt)
    for _ in range(12):
        b.step()
    smol4.cancel(b.live["r2"])
    assert len(smol4.active) == 3
    b.run()
    cut = smol4.outcome(b.live["r2"])
    assert cut.finish_reason == "cancelled" and 0 < cut.completion_tokens < N
    assert reference[2].startswith(b.answer("r2"))
    assert [b.answer(f"r{i}") for i in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]
    # the cancelled sequence's slot serves the next request as if nothing happened
    again = smol4.generate(
        Generate(req="x", prompt=PROMPTS[2], max_tokens=N, cache_prompt=False), lambda _t: None
    )
    assert again.text == reference[2]


SYSTEM = (
    "You are the assistant of a small bakery in a quiet town. The bakery opens at seven in the "
    "morning and closes at six in the evening, every day except Sunday. It bakes sourdough, rye, "
    "spelt and white loaves, croissants, cinnamon rolls and three kinds of cake. Orders for cakes "
    "need two days' notice. Answer customers' questions politely, in one or two short sentences."
)


def _common(a: list[int] | tuple[int, ...], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_conversation_and_a_keyless_request_in_one_batch_keep_their_cache(smollm2_path: Path) -> None:
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048, parallel=2, n_seq=4))
    try:
        conv1 = SYSTEM + "\nUser: When do you open?\nAssistant:"
        key1 = SYSTEM + "\nUser: Do you sell rye bread?\nAssistant:"
        b = Batch(e)
        c = b.join("c1", prompt=conv1, conversation="chat-1", cache_prompt=None, max_tokens=12)
        k = b.join("k1", prompt=key1, cache_prompt=None, max_tokens=12)
        b.run()
        assert e.outcome(c).prompt_tokens_evaluated == e.outcome(c).prompt_tokens  # first turn: all
        held_c, held_k = list(c.ids), list(k.ids)  # what each sequence's KV holds now
        assert e.conversations == ("chat-1",) and e.cached_sequences == 2
        conv2 = conv1 + b.answer("c1") + "\nUser: And on Sunday?\nAssistant:"
        key2 = key1 + b.answer("k1") + "\nUser: How much is it?\nAssistant:"
        b2 = Batch(e)
        c2 = b2.join("c2", prompt=conv2, conversation="chat-1", cache_prompt=None, max_tokens=8)
        k2 = b2.join("k2", prompt=key2, cache_prompt=None, max_tokens=8)
        t_c2 = e.prepare(Generate(req="t", prompt=conv2)).tokens
        t_k2 = e.prepare(Generate(req="t", prompt=key2)).tokens
        b2.run()
        # each continued its own sequence: only the tokens after the common prefix were evaluated
        assert e.outcome(c2).prompt_tokens_evaluated == len(t_c2) - _common(held_c, t_c2) < len(t_c2) // 2
        assert e.outcome(k2).prompt_tokens_evaluated == len(t_k2) - _common(held_k, t_k2) < len(t_k2) // 2
        assert e.conversations == ("chat-1",) and e.cached_sequences == 2
        # a keyless request never takes the conversation's sequence, even when it holds all of its
        # prompt: it reuses what the keyless sequence shares with it (the system prompt)
        held_c2, held_k2 = list(c2.ids), list(k2.ids)
        assert _common(held_c2, t_c2) == len(t_c2)
        k3 = e.generate(Generate(req="k3", prompt=conv2, max_tokens=4), lambda _t: None)
        assert k3.prompt_tokens_evaluated == len(t_c2) - _common(held_k2, t_c2) > len(t_c2) // 4
        assert e.conversations == ("chat-1",)
    finally:
        e.close()
