"""The worker's per-sequence sampler (core/worker/sampler.py) on the real SmolLM2 demo model: logprobs
against an independent ``Llama(logits_all=True)`` run, grammar by rejection against grammar first
and against the JSON schema (the ``jsonschema`` package), penalties against llama-cpp-python's
``create_completion``, logit bias, and a lazy grammar that starts at its trigger."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from llama_cpp.llama_grammar import json_schema_to_gbnf
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import InvalidSamplingError
from timeshare.core.sampling import Sampling
from timeshare.core.wire.protocol import Generate
from timeshare.core.worker.decode import Decoder
from timeshare.core.worker.engine import Engine
from timeshare.core.worker.sampler import GrammarError, Sampler

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "colours": {"type": "array", "items": {"enum": ["black", "white", "ginger"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colours"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> Iterator[Any]:
    model = llama_cpp.Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    yield model
    model.close()


def tokens_of(llm: Any, text: str) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=False, special=True))


def drive(llm: Any, prompt: list[int], sampling: Sampling, n: int, **kw: Any) -> tuple[list[int], Sampler]:
    """The test's own loop over the Sampler contract: prefill, then sample(ctx, -1) / decode one."""
    llm.reset()
    llm.eval(prompt)
    sampler = Sampler(llm, sampling, **kw)
    out: list[int] = []
    eog = llama_cpp.llama_vocab_is_eog
    try:
        for _ in range(n):
            token = sampler.sample(llm.ctx, -1)
            if eog(llm._model.vocab, token):
                break
            out.append(token)
            llm.eval([token])
    finally:
        sampler.close()
    return out, sampler


def text_of(llm: Any, tokens: list[int]) -> str:
    return bytes(llm.detokenize(tokens)).decode("utf-8", errors="replace")


def test_logprobs_equal_log_softmax_of_an_independent_run(llm: Any, smollm2_path: Path) -> None:
    prompt = tokens_of(llm, CHAT.format("Name three rivers."))
    for sampling in (
        Sampling(logprobs=True, top_logprobs=5),
        Sampling(temperature=0.8, seed=3, top_logprobs=3),
    ):
        out, sampler = drive(llm, prompt, sampling, 12)
        assert [r.token for r in sampler.records][: len(out)] == out
        oracle = llama_cpp.Llama(str(smollm2_path), n_ctx=1024, logits_all=True, verbose=False)
        try:
            oracle.eval(prompt)  # the same batches as the sampled run (batch size changes the last bits)
            for token in out:
                oracle.eval([token])
            scores = np.asarray(oracle.scores[: len(prompt) + len(out)], dtype=np.float64)
        finally:
            oracle.close()
        for i, record in enumerate(sampler.records[: len(out)]):
            row = scores[len(prompt) - 1 + i]
            logsm = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            assert abs(record.logprob - logsm[record.token]) < 1e-3
            k = sampling.top_logprobs
            assert len(record.top) == k
            best = np.sort(logsm)[::-1][:k]
            assert np.allclose([lp for _, lp in record.top], best, atol=1e-3)
            for token, lp in record.top:
                assert abs(lp - logsm[token]) < 1e-3
            if sampling.greedy:
                assert record.top[0][0] == record.token


def test_grammar_by_rejection_equals_grammar_first_and_validates(llm: Any) -> None:
    grammar = json_schema_to_gbnf(json.dumps(CAT_SCHEMA))
    prompt = tokens_of(llm, CHAT.format("Describe a cat in JSON."))
    greedy, rejecting = drive(llm, prompt, Sampling(grammar=grammar), 96)
    first, _ = drive(llm, prompt, Sampling(grammar=grammar), 96, grammar_first=True)
    assert greedy == first
    assert rejecting.rejections > 0  # the model wanted something else at least once
    jsonschema.validate(json.loads(text_of(llm, greedy)), CAT_SCHEMA)
    sampled, _ = drive(llm, prompt, Sampling(grammar=grammar, temperature=1.0, seed=1), 96)
    jsonschema.validate(json.loads(text_of(llm, sampled)), CAT_SCHEMA)
    with pytest.raises(GrammarError, match="GBNF"):
        Sampler(llm, Sampling(grammar="root ::= (("))


def test_penalties_equal_create_completion(llm: Any, smollm2_path: Path) -> None:
    prompt = "List the days of the week: Monday, Tuesday,"
    penalties = {"repeat_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.4}
    ref = llama_cpp.Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        want = ref.create_completion(prompt, max_tokens=40, temperature=0.0, **penalties)
        plain = ref.create_completion(prompt, max_tokens=40, temperature=0.0)
    finally:
        ref.close()
    want_text, plain_text = (str(r["choices"][0]["text"]) for r in (want, plain))  # type: ignore[index]
    assert want_text != plain_text  # the penalties change this answer
    decoder = Decoder(llm)
    tokens = [int(llm.token_bos()), *llm.tokenize(prompt.encode(), add_bos=False, special=True)]
    if not llm._model.add_bos_token():
        tokens = tokens[1:]
    llm.reset()
    out = decoder.run(
        0,
        [],
        tokens,
        Sampling(max_tokens=40, **penalties),
        stop=(),
        emit=lambda _: None,
        before_step=lambda: None,
    )
    decoder.close()
    assert out.text == want_text


def test_logit_bias_bans_and_forces(llm: Any) -> None:
    prompt = tokens_of(llm, CHAT.format("Say hello."))
    plain, _ = drive(llm, prompt, Sampling(), 6)
    banned, _ = drive(llm, prompt, Sampling(logit_bias=((plain[0], float("-inf")),)), 6)
    assert banned[0] != plain[0] and plain[0] not in banned
    forced_token = tokens_of(llm, " banana")[0]
    forced, _ = drive(llm, prompt, Sampling(temperature=0.7, seed=1, logit_bias=((forced_token, 100.0),)), 4)
    assert forced == [forced_token] * 4
    with pytest.raises(InvalidSamplingError, match="vocabulary"):
        Sampler(llm, Sampling(logit_bias=((10**7, 1.0),)))


def test_a_lazy_grammar_applies_from_its_trigger_on(llm: Any) -> None:
    prompt = tokens_of(llm, "The three primary colours are")
    free, _ = drive(llm, prompt, Sampling(), 40)
    free_text = text_of(llm, free)
    at = free_text.index("red")
    grammar = 'root ::= "red, " [a-z]+ " and " [a-z]+ "."'
    lazy, _ = drive(llm, prompt, Sampling(grammar=grammar, grammar_triggers=("red",)), 40)
    text = text_of(llm, lazy)
    assert text[:at] == free_text[:at]  # unconstrained until the trigger
    assert re.fullmatch(r"red, [a-z]+ and [a-z]+\.", text[at:]), text  # then the grammar, then the end
    with pytest.raises(GrammarError, match="regular expression"):
        Sampler(llm, Sampling(grammar=grammar, grammar_triggers=("(",)))


def test_a_models_max_tokens_setting_caps_every_answer(smollm2_path: Path) -> None:
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512, max_tokens=6))
    try:
        for asked in (None, 50, 3):
            out = engine.generate(
                Generate(req="c", prompt="Count: 1, 2, 3,", sampling=Sampling(max_tokens=asked)),
                lambda _: None,
            )
            assert out.completion_tokens == min(asked or 6, 6) and out.finish_reason == "length"
    finally:
        engine.close()
