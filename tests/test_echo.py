"""``echo`` and ``max_tokens: 0`` on /v1/completions (issue 42, item 3): the prompt tokens'
logprobs, as OpenAI's legacy completions and llama-cpp-python give them (lm-evaluation-harness's
log-likelihood scoring). The oracle is llama-cpp-python itself: ``Llama(logits_all=True)``
evaluating the prompt, the log-softmax of row i at prompt token i + 1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp  # before numpy (worker rule)
import openai
import pytest
from _api_util import SMOL, Served, start_serve, stop_serve_proc, write_config
from timeshare.core.api.requests import parse_completion_request
from timeshare.core.config.schema import ModelConfig
from timeshare.core.sampling import Sampling
from timeshare.core.wire.protocol import Generate, TokenLogprobs
from timeshare.core.worker.decode import PROMPT_LOGPROB_ROWS
from timeshare.core.worker.engine import Engine

PROMPT = "The capital of France is Paris. The capital of Germany is"
#: past one step's rows (PROMPT_LOGPROB_ROWS): the prompt's logprobs come in several steps
LONG = " ".join(f"word{i % 37} is the {i}th." for i in range(120))
#: the worker's float64 log-softmax of the same float32 logits against llama-cpp-python's float32 one
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def oracle(smollm2_path: Path) -> Iterator[Any]:
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=2048, logits_all=True, verbose=False)
    yield llm
    llm.close()


def oracle_logprobs(llm: Any, prompt: str) -> tuple[list[int], list[float], list[list[int]]]:
    """The prompt's tokens (as create_completion makes them), each following token's logprob and
    the 3 most likely tokens at each position."""
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(tokens)
    rows = llama_cpp.Llama.logits_to_logprobs(llm.scores[: len(tokens)])
    values = [float(rows[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]
    top = [[int(t) for t in (-rows[i]).argsort()[:3]] for i in range(len(tokens) - 1)]
    return list(tokens), values, top


def test_prompt_logprobs_equal_llama_cpp_logits_all(smollm2_path: Path, oracle: Any) -> None:
    assert len(oracle.tokenize(LONG.encode(), add_bos=True, special=True)) > PROMPT_LOGPROB_ROWS
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048, parallel=2))
    try:
        for prompt in (PROMPT, LONG):
            tokens, want, top = oracle_logprobs(oracle, prompt)
            got: list[TokenLogprobs] = []
            sampling = Sampling(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=3)
            out = engine.generate(
                Generate(req="r", prompt=prompt, prompt_logprobs=True, sampling=sampling),
                lambda _t: None,
                prompt_logprobs=got.extend,
            )
            assert out.completion_tokens == 3 and len(out.logprobs) == 3
            # SmolLM2 adds no BOS: every prompt token has an entry, the first one no logprob
            assert len(got) == len(tokens)
            assert got[0].logprob == 0.0 and got[0].top == ()
            assert b"".join(e.piece for e in got).decode() == prompt
            assert [e.piece for e in got] == [oracle.detokenize([t]) for t in tokens]
            assert [e.logprob for e in got[1:]] == pytest.approx(want, abs=TOLERANCE)
            for entry, best in zip(got[1:], top, strict=True):
                assert [a.piece for a in entry.top] == [oracle.detokenize([t]) for t in best]
            # the prompt cache was not used (every row needed): all of it evaluated again
            assert out.prompt_tokens_evaluated == len(tokens)
    finally:
        engine.close()


def test_score_only_evaluates_the_prompt_and_samples_nothing(smollm2_path: Path, oracle: Any) -> None:
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048, parallel=2))
    try:
        _tokens, want, _top = oracle_logprobs(oracle, PROMPT)
        got: list[TokenLogprobs] = []
        texts: list[str] = []
        out = engine.generate(
            Generate(
                req="r", prompt=PROMPT, prompt_logprobs=True, score_only=True, sampling=Sampling(max_tokens=1)
            ),
            texts.append,
            prompt_logprobs=got.extend,
        )
        assert (out.finish_reason, out.completion_tokens, out.text, texts) == ("length", 0, "", [])
        assert [e.logprob for e in got[1:]] == pytest.approx(want, abs=TOLERANCE)
        # without the prompt's logprobs: only evaluated (the prompt cache keeps it)
        out = engine.generate(Generate(req="r2", prompt=PROMPT, score_only=True), texts.append)
        assert (out.finish_reason, out.completion_tokens, texts) == ("length", 0, [])
    finally:
        engine.close()


def test_an_echo_beside_another_request_leaves_its_answer_alone(smollm2_path: Path) -> None:
    """The echo's prompt rows join the batch of another sequence: that one's answer is the one it
    gives alone (only the echo's own sequence has extra output rows)."""
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048, parallel=2))
    try:
        greedy = Sampling(max_tokens=12, temperature=0.0)
        alone = engine.generate(
            Generate(req="a", prompt="Once upon a time", sampling=greedy, cache_prompt=False), lambda _t: None
        )
        texts: list[str] = []
        other = engine.start(
            engine.prepare(Generate(req="b", prompt="Once upon a time", sampling=greedy, cache_prompt=False)),
            texts.append,
        )
        got: list[TokenLogprobs] = []
        echo = engine.start(
            engine.prepare(
                Generate(
                    req="c", prompt=LONG, prompt_logprobs=True, sampling=Sampling(max_tokens=2, logprobs=True)
                )
            ),
            lambda _t: None,
            lambda _e: None,
            got.extend,
        )
        while not (other.done and echo.done):
            engine.step()
        assert "".join(texts) == alone.text
        assert engine.outcome(other).text == alone.text
        assert len(got) == engine.outcome(echo).prompt_tokens
    finally:
        engine.close()


def test_parse_echo_and_max_tokens_zero() -> None:
    req = parse_completion_request(
        {"model": SMOL, "prompt": "a", "echo": True, "logprobs": 2, "max_tokens": 0}
    )
    assert (req.echo, req.score_only, req.logprobs, req.sampling.top_logprobs) == (True, True, True, 2)
    fields = req.pool_fields()
    assert fields["prompt_logprobs"] and fields["score_only"]
    req = parse_completion_request({"model": SMOL, "prompt": "a", "echo": True})
    assert req.echo and not req.pool_fields()["prompt_logprobs"] and not req.score_only


# ---- through a real `timeshare serve`, with the official client ---------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("echo-home")
    config = write_config(home / "config.toml", [(SMOL, smollm2_path)], extra_model_lines="n_ctx = 2048")
    server = start_serve(home / "home", config=config)
    try:
        server.wait_ready([SMOL])
        yield server
    finally:
        stop_serve_proc(server.proc)


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=180) as c:
        yield c


def test_max_tokens_zero_with_echo_scores_the_prompt(client: openai.OpenAI, oracle: Any) -> None:
    """lm-evaluation-harness's loglikelihood request, as its local-completions model sends it."""
    tokens, want, top = oracle_logprobs(oracle, PROMPT)
    answer = client.completions.create(
        model=SMOL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(tokens) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=TOLERANCE)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(tokens))]
    for alternatives, best in zip(lp.top_logprobs[1:], top, strict=True):
        assert alternatives is not None
        assert list(alternatives)[:2] == [oracle.detokenize([t]).decode() for t in best[:2]]
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(tokens), 0)


def test_echo_with_an_answer_and_logprobs(client: openai.OpenAI, oracle: Any) -> None:
    tokens, want, _top = oracle_logprobs(oracle, PROMPT)
    answer = client.completions.create(
        model=SMOL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0
    )
    plain = client.completions.create(model=SMOL, prompt=PROMPT, logprobs=1, max_tokens=4, temperature=0)
    choice, alone = answer.choices[0], plain.choices[0]
    assert choice.text == PROMPT + alone.text
    lp, alone_lp = choice.logprobs, alone.logprobs
    assert lp is not None and alone_lp is not None and lp.token_logprobs is not None
    assert lp.tokens == [*oracle_pieces(oracle, tokens), *(alone_lp.tokens or [])]
    assert lp.token_logprobs[1 : len(tokens)] == pytest.approx(want, abs=TOLERANCE)
    assert lp.token_logprobs[len(tokens) :] == pytest.approx(alone_lp.token_logprobs, abs=TOLERANCE)
    assert lp.text_offset is not None and lp.text_offset[len(tokens)] == len(PROMPT)
    # echo without logprobs: the text only (the prompt cache may serve it)
    echo_only = client.completions.create(model=SMOL, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    assert echo_only.choices[0].text == PROMPT + alone.text and echo_only.choices[0].logprobs is None
    # max_tokens 0 without echo: an empty answer
    empty = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=0)
    assert (empty.choices[0].text, empty.choices[0].finish_reason) == ("", "length")


def test_lm_evaluation_harness_loglikelihood_request(served: Served, oracle: Any) -> None:
    """What lm-evaluation-harness's local-completions model sends for a loglikelihood request
    (tokenized_requests, its default: a batch of one token list; max_tokens 1, logprobs 1, echo)
    and how it reads the answer: token_logprobs[ctxlen:-1] are the continuation's."""
    context, continuation = "The capital of France is", " Paris"
    ctx = oracle.tokenize(context.encode(), add_bos=False, special=False)
    cont = oracle.tokenize(continuation.encode(), add_bos=False, special=False)
    body = {
        "model": SMOL,
        "prompt": [ctx + cont],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert (
        len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1
    )  # one entry per token sent, then the answer's
    assert choice["text"].startswith(context + continuation)
    _tokens, want, _top = oracle_logprobs(oracle, context + continuation)
    assert _tokens == ctx + cont
    scored = lp["token_logprobs"][len(ctx) : -1]
    assert scored == pytest.approx(want[len(ctx) - 1 :], abs=TOLERANCE)
    # is_greedy as the harness decides it: each token's logprob against its top alternative
    assert all(isinstance(top, dict) and top for top in lp["top_logprobs"][len(ctx) : -1])
    # echo of a token-array prompt without logprobs: its text
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": SMOL, "prompt": ctx, "echo": True, "max_tokens": 0},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == context, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    # a token outside the vocabulary: 400
    r = httpx.post(f"{served.url}/v1/completions", json={"model": SMOL, "prompt": [1, 10**7]}, timeout=60)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text


def oracle_pieces(llm: Any, tokens: list[int]) -> list[str]:
    return [llm.detokenize([t]).decode() for t in tokens]


def test_echo_streams_the_prompt_first(client: openai.OpenAI, oracle: Any) -> None:
    tokens, want, _top = oracle_logprobs(oracle, PROMPT)
    chunks = list(
        client.completions.create(
            model=SMOL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=3, temperature=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs is not None and first.logprobs.token_logprobs is not None
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(want, abs=TOLERANCE)
    whole = client.completions.create(model=SMOL, prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    # scoring only, streamed: the prompt, then the end
    chunks = list(client.completions.create(model=SMOL, prompt=PROMPT, echo=True, max_tokens=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(tokens) > 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_echo_requests_are_400s(served: Served, body: dict[str, object], param: str) -> None:
    r = httpx.post(f"{served.url}/v1/completions", json={"model": SMOL, "prompt": "a", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_keeps_max_tokens_at_least_one(served: Served) -> None:
    r = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={"model": SMOL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
