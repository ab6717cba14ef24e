"""The OpenAI surface beyond plain text, through the official ``openai`` client against a real
``timeshare serve`` with the SmolLM2 demo model (once as a chat model, once as an ``embedding =
true`` entry): structured output (``.parse()``, json_object; answers validated with the
``jsonschema`` package), logprobs against an independent ``Llama(logits_all=True)``, ``n`` with a
seed, a chat answer without max_tokens past 512 tokens, embeddings against llama-cpp-python's own
``Llama(embedding=True, pooling_type=MEAN).embed``, and ``GET /v1/models``' capabilities."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from _api_util import SMOL, Served, serving, write_config

EMB = "smol-embed"
N_CTX = 640  # small: an answer without max_tokens reaches the end of the context soon


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("api-openai-home")
    config = write_config(
        home / "timeshare.toml", [(SMOL, smollm2_path)], extra_model_lines=f"n_ctx = {N_CTX}"
    )
    with config.open("a") as f:
        f.write(f'\n[[models]]\nid = "{EMB}"\npath = "{smollm2_path}"\nembedding = true\nn_ctx = 512\n')
    with serving(home, config=config) as server:
        server.wait_ready([SMOL, EMB])
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int


class Owner(pydantic.BaseModel):  # bounded lengths: a 135M model would go on and on
    name: Annotated[str, pydantic.Field(max_length=16)]
    age: int
    pets: Annotated[list[Pet], pydantic.Field(max_length=2)]


def test_json_schema_answers_validate_and_parse_works(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Invent a person and their pets."}]
    completion = client.beta.chat.completions.parse(
        model=SMOL, messages=messages, response_format=Owner, max_tokens=200, temperature=0
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content or ""), Owner.model_json_schema())
    assert isinstance(message.parsed, Owner)
    # json_object: one JSON object, any keys
    reply = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "A colour as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        seed=3,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=SMOL,
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}},
            },
        )
    assert info.value.param == "response_format" and "'not'" in info.value.message


def _oracle_greedy(path: Path, prompt: str, n: int, top: int) -> list[tuple[bytes, float, list[float]]]:
    """The test's own greedy run: a fresh Llama(logits_all=True), the prompt as create_completion
    tokenizes it, one token per eval; per token its bytes, log-softmax and the top values."""
    llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, logits_all=True, verbose=False)
    try:
        tokens = list(llm.tokenize(prompt.encode(), special=True))
        llm.eval(tokens)
        out = []
        for _ in range(n):
            row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            logsm = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            token = int(np.argmax(row))
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                break
            out.append((bytes(llm.detokenize([token])), float(logsm[token]), sorted(logsm)[::-1][:top]))
            llm.eval([token])
        return out
    finally:
        llm.close()


def test_logprobs_equal_an_independent_runs_log_softmax(client: openai.OpenAI, smollm2_path: Path) -> None:
    prompt = "The capital of France is"
    want = _oracle_greedy(smollm2_path, prompt, 8, 3)
    body: Any = {"cache_prompt": False}
    done = client.completions.create(
        model=SMOL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, extra_body=body
    )
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(want)
    for (piece, value, top), token, got, alternatives in zip(
        want, lp.tokens, lp.token_logprobs, lp.top_logprobs or [], strict=True
    ):
        assert token == piece.decode(errors="replace") and abs(got - value) < 1e-3
        assert np.allclose(sorted(alternatives.values(), reverse=True), top, atol=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # chat, streamed: every chunk carries its own tokens; together they are the answer
    stream = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    text, entries = "", []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            assert chunk.choices[0].logprobs is not None and chunk.choices[0].logprobs.content
            entries += chunk.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes or []) for e in entries).decode() == text
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    plain = client.chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_n_choices_are_seeded_seed_plus_i(client: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": SMOL,
        "messages": [{"role": "user", "content": "Name an animal."}],
        "max_tokens": 8,
        "temperature": 1.0,
        "extra_body": {"cache_prompt": False},
    }
    first = client.chat.completions.create(n=2, seed=11, **kwargs)
    again = client.chat.completions.create(n=2, seed=11, **kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices]  # reproducible
    assert texts[0] != texts[1]
    alone = client.chat.completions.create(seed=12, **kwargs)  # choice 1 is seed + 1
    assert alone.choices[0].message.content == texts[1]
    assert first.usage is not None and first.usage.prompt_tokens == alone.usage.prompt_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(n=9, **kwargs)
    assert info.value.param == "n"


def _end_of_generation_tokens(path: Path) -> list[int]:
    """The vocabulary's end-of-generation tokens (the oracle: llama.cpp's own attribute)."""
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        vocab = llm._model.vocab
        return [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    finally:
        llm.close()


def test_a_chat_answer_without_max_tokens_runs_to_the_end_of_the_context(
    client: openai.OpenAI, smollm2_path: Path
) -> None:
    # the model may not end its answer (issue 38: where it chose to stop changed with the machine)
    banned = _end_of_generation_tokens(smollm2_path)
    assert banned
    reply = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        temperature=0,
        logit_bias={str(t): -100 for t in banned},
    )
    assert reply.usage is not None and reply.usage.completion_tokens > 512  # the old default cut here
    assert reply.choices[0].finish_reason == "length"  # the context (N_CTX) was full


def test_embeddings_equal_llama_cpp_pythons_mean_pooling(
    client: openai.OpenAI, served: Served, smollm2_path: Path
) -> None:
    texts = ["A cat sat on the mat.", "Timeshare shares one GPU."]
    oracle = llama_cpp.Llama(
        str(smollm2_path),
        n_ctx=512,
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        verbose=False,
    )
    try:
        want = np.asarray(oracle.embed(texts, normalize=True))
        tokens = [list(oracle.tokenize(t.encode())) for t in texts]
    finally:
        oracle.close()
    for model in (SMOL, EMB):  # a chat model on request, and an embedding model entry
        got = client.embeddings.create(model=model, input=texts)  # the client asks for base64
        assert [d.index for d in got.data] == [0, 1]
        assert np.abs(np.asarray([d.embedding for d in got.data]) - want).max() < 1e-5
        assert got.usage.prompt_tokens == sum(len(t) for t in tokens)
    floats = client.embeddings.create(model=EMB, input=tokens, encoding_format="float")
    assert np.abs(np.asarray([d.embedding for d in floats.data]) - want).max() < 1e-5
    one = client.embeddings.create(model=EMB, input=texts[0], encoding_format="float")
    assert np.abs(np.asarray(one.data[0].embedding) - want[0]).max() < 1e-5
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=EMB, input="x", dimensions=8)
    assert info.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=EMB, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "embedding model" in bad.value.message
    # the chat model still answers (its context went back to logits)
    assert client.completions.create(model=SMOL, prompt="Hello", max_tokens=4).choices[0].text
    models = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
    caps = {m["id"]: m["capabilities"] for m in models}
    assert caps == {SMOL: ["chat", "completion", "tools", "embedding"], EMB: ["embedding"]}
