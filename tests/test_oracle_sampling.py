"""Seeded sampling end to end: the official `openai` client sends seed, temperature, top_p and top_k
through a real `timeshare serve` (HTTP, the pool, a worker); the answer must equal what
llama-cpp-python's own ``create_completion`` / ``create_chat_completion`` sample from a fresh
``Llama`` with the same settings (computed here, independently of Timeshare's code), and other
seeds must give other answers. ``cache_prompt: false`` makes the server's evaluation schedule a
fresh one, so equality is exact, not approximate."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from _api_util import SMOL, Served, serving, write_config

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
MAX_TOKENS = 16
SAMPLED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.9, "top_k": 20}
SEED = 7
OTHER_SEEDS = (1, 2)


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=2048, verbose=False)
    yield llm
    llm.close()


def _ref_completion(llm: llama_cpp.Llama, seed: int) -> str:
    llm.reset()  # a fresh context: no prefix shared with the previous call
    out = llm.create_completion(PROMPT, max_tokens=MAX_TOKENS, seed=seed, **SAMPLED)
    return str(out["choices"][0]["text"])  # type: ignore[index]


def _ref_chat(llm: llama_cpp.Llama, seed: int) -> str:
    llm.reset()
    out = llm.create_chat_completion(MESSAGES, max_tokens=MAX_TOKENS, seed=seed, **SAMPLED)  # type: ignore[arg-type]
    return str(out["choices"][0]["message"]["content"])  # type: ignore[index]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("oracle-sampling-home")
    config = write_config(home / "timeshare.toml", [(SMOL, smollm2_path)], extra_model_lines="n_ctx = 2048")
    with serving(home, config=config) as server:
        server.wait_ready([SMOL])
        yield server
    assert server.proc.returncode == 0, server.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=180) as c:
        yield c


def _extra() -> dict[str, Any]:
    return {"top_k": SAMPLED["top_k"], "cache_prompt": False}


def _completion(client: openai.OpenAI, seed: int) -> str:
    reply = client.completions.create(
        model=SMOL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=SAMPLED["temperature"],
        top_p=SAMPLED["top_p"],
        seed=seed,
        extra_body=_extra(),
    )
    return reply.choices[0].text


def _chat(client: openai.OpenAI, seed: int) -> str:
    reply = client.chat.completions.create(
        model=SMOL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=SAMPLED["temperature"],
        top_p=SAMPLED["top_p"],
        seed=seed,
        extra_body=_extra(),
    )
    return reply.choices[0].message.content or ""


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_seeded_sampling_through_http_equals_llama_cpp_python(
    endpoint: str, client: openai.OpenAI, reference: llama_cpp.Llama
) -> None:
    served_answer = _completion if endpoint == "completions" else _chat
    ref_answer = _ref_completion if endpoint == "completions" else _ref_chat
    expected = ref_answer(reference, SEED)
    greedy_like = {ref_answer(reference, s) for s in OTHER_SEEDS}
    assert greedy_like - {expected}, "the reference itself gives one text for every seed: no teeth"
    got = served_answer(client, SEED)
    assert got == expected, (endpoint, got, expected)
    assert served_answer(client, SEED) == got  # the same seed again: the same answer
    # each other seed as llama-cpp-python samples it, so a dropped or altered seed cannot pass
    for seed in OTHER_SEEDS:
        assert served_answer(client, seed) == ref_answer(reference, seed), (endpoint, seed)


def test_top_k_and_top_p_reach_the_sampler(client: openai.OpenAI, reference: llama_cpp.Llama) -> None:
    # top_k 1 keeps only the most likely token whatever the seed: the greedy answer; without the
    # top_k the same seeds sample other texts (a dropped top_k is seen)
    reference.reset()
    greedy = str(
        reference.create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]  # type: ignore[index]
    )
    common: dict[str, Any] = {"model": SMOL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.5}
    fresh = {"cache_prompt": False}
    for seed in OTHER_SEEDS:
        top1 = client.completions.create(**common, seed=seed, extra_body={"top_k": 1, "cache_prompt": False})
        assert top1.choices[0].text == greedy, seed
        tiny_p = client.completions.create(**common, seed=seed, top_p=1e-6, extra_body=fresh)
        assert tiny_p.choices[0].text == greedy, seed
    wide = {
        client.completions.create(**common, seed=s, extra_body=fresh).choices[0].text for s in OTHER_SEEDS
    }
    assert wide - {greedy}, "temperature 1.5 without top_k/top_p gave the greedy text for every seed"
