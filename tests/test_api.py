"""The OpenAI-compatible API: the official `openai` client against a real `timeshare serve` running
the two demo models (real workers, real llama-cpp-python), plus the request parser on its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from _api_util import (
    GEMMA,
    SMOL,
    Served,
    run_cli,
    serving_demo_models,
    write_config,
)
from timeshare.core.api.errors import BadRequestError
from timeshare.core.api.requests import parse_chat_request, parse_completion_request
from timeshare.core.config.validate import is_loopback

KEY = "test-key-5f1e"
QUEUE_LIMIT = 3  # small, so that the 429 test needs few requests; the interleave test stays within it
PROMPTS = {
    SMOL: ["The capital of France is", "def add(a, b):\n   "],
    GEMMA: ["The capital of France is", "Once upon a time, there was"],
}
MAX_TOKENS = 12

pytestmark = pytest.mark.slow


# ---- the request parser (no server) ------------------------------------------------------------


def test_parse_chat_request_maps_openai_fields() -> None:
    req = parse_chat_request(
        {
            "model": SMOL,
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "frequency_penalty": 0,
        }
    )
    assert [(m.role, m.content) for m in req.messages or ()] == [
        ("system", "Be brief."),
        ("user", "Hi there"),
    ]
    assert (
        req.sampling.max_tokens,
        req.sampling.temperature,
        req.sampling.stop,
        req.stream,
        req.include_usage,
    ) == (
        7,
        0.0,
        ("\n",),
        True,
        True,
    )
    assert req.prompt is None and req.conversation is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "'model' is required"),
        ({"model": SMOL, "messages": []}, "messages", "non-empty list"),
        ({"model": SMOL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "use system"),
        (
            {"model": SMOL, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "the id of the call",
        ),
        ({"model": SMOL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "only text and image_url parts",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "n": 9},
            "n",
            "from 1 to 8",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
            "temperature",
            "0 to 2",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
            "at least 1",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "stop": [1]},
            "stop",
            "non-empty strings",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            "tools[0].function",
            "must be an object",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
            "logprobs",
            "true or false",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "needs 'logprobs': true",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}},
            "logit_bias",
            "not a token id",
        ),
        (
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            "stream",
            "true or false",
        ),
        (
            {
                "model": SMOL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "yaml"},
            },
            "response_format",
            "'yaml' is not one of",
        ),
    ],
)
def test_parse_chat_request_refuses_with_a_sentence(body: dict[str, object], param: str, words: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_chat_request(body)
    assert info.value.param == param
    assert words in info.value.message
    assert info.value.message.endswith(".")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": GEMMA}, "prompt"),
        ({"model": GEMMA, "prompt": ["a", "b"]}, "prompt"),
        ({"model": GEMMA, "prompt": [[1, 2], [3]]}, "prompt"),
        ({"model": GEMMA, "prompt": [1, -2]}, "prompt"),
        ({"model": GEMMA, "prompt": []}, "prompt"),
        ({"model": GEMMA, "prompt": "a", "echo": "yes"}, "echo"),
        ({"model": GEMMA, "prompt": "a", "best_of": 3}, "best_of"),
    ],
)
def test_parse_completion_request_refuses(body: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_completion_request(body)
    assert info.value.param == param


def test_parse_completion_request_defaults_follow_openai() -> None:
    req = parse_completion_request({"model": GEMMA, "prompt": ["one prompt"]})
    assert (req.prompt, req.sampling.max_tokens, req.sampling.temperature, req.stream) == (
        "one prompt",
        16,
        1.0,
        False,
    )


def test_parse_chat_request_defaults() -> None:
    req = parse_chat_request({"model": SMOL, "messages": [{"role": "user", "content": "x"}]})
    s = req.sampling
    # no max_tokens: until a stop or the end of the context, as OpenAI and llama-server
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (None, 1.0, 1.0, 40, None, ())


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [  # a schema rule broken deep in the body: the field path, and what to send instead
        (
            {"messages": [{"role": "user", "content": "x"}, {"content": "y"}]},
            "messages[1].role",
            "messages[1].role None is not supported: use system, user, assistant or tool.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content",
            "messages[0].content: only text and image_url parts are supported",
        ),
        ({"top_p": 1.5}, "top_p", "'top_p' must be a number from 0 to 1; got 1.5."),
        ({"top_k": -1}, "top_k", "'top_k' must be a whole number of at least 0 (0: no limit)."),
        ({"stop": ["a"] * 17}, "stop", "'stop' holds 17 strings; send at most 16."),
        ({"stream_options": []}, "stream_options", "'stream_options' must be an object."),
        ({"conversation": ""}, "conversation", "must be a non-empty string."),
        ({"max_completion_tokens": True}, "max_completion_tokens", "at least 1; got True."),
    ],
)
def test_schema_errors_become_sentences_naming_the_field(
    extra: dict[str, object], param: str, message: str
) -> None:
    body = {"model": SMOL, "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(BadRequestError) as info:
        parse_chat_request(body)
    assert info.value.param == param
    assert message in info.value.message and info.value.message.endswith(".")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("192.168.1.4", False), ("example.org", False), ("", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# ---- `timeshare serve` start-up checks (no generation) -------------------------------------------


def test_serve_refuses_a_non_loopback_bind_without_a_key(tmp_path: Path, smollm2_path: Path) -> None:
    config = write_config(tmp_path / "cfg.toml", [(SMOL, smollm2_path)])
    done = run_cli(tmp_path / "home", "--config", str(config), "serve", "--host", "0.0.0.0", "--port", "0")
    assert done.returncode == 2
    assert "not a loopback address" in done.stderr and "api.key" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "home" / "run" / "api.json").exists()


def test_serve_reports_a_port_in_use(tmp_path: Path, smollm2_path: Path) -> None:
    config = write_config(tmp_path / "cfg.toml", [(SMOL, smollm2_path)])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = run_cli(tmp_path / "home", "--config", str(config), "serve", "--port", str(port))
    assert done.returncode == 2
    assert f"Cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr


def test_serve_reports_a_bad_config(tmp_path: Path) -> None:
    # a type error refuses to start, with the field path (a missing model file does not: that
    # model alone fails, see tests/test_reliability.py)
    config = tmp_path / "cfg.toml"
    text = "[[models]]\nid = 'x'\npath = '/nonexistent/model.gguf'\nn_ctx = 'big'\n"
    config.write_text(text)
    done = run_cli(tmp_path / "home", "--config", str(config), "serve", "--port", "0")
    assert done.returncode == 2
    assert "models[0].n_ctx: must be an integer" in done.stderr
    assert config.read_text() == text


# ---- a served pool with both demo models and a key -----------------------------------------------


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("api-home")
    with serving_demo_models(home, smollm2_path, gemma3_path, key=KEY, queue_limit=QUEUE_LIMIT) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_references(smollm2_path: Path, gemma3_path: Path) -> dict[tuple[str, str], str]:
    """What plain llama-cpp-python answers at temperature 0 (the issue's reference)."""
    import llama_cpp

    refs = {}
    for model_id, path in ((SMOL, smollm2_path), (GEMMA, gemma3_path)):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, verbose=False)
        try:
            for prompt in PROMPTS[model_id]:
                out = llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0)
                refs[(model_id, prompt)] = out["choices"][0]["text"]  # type: ignore[index]
        finally:
            llm.close()
    return refs


def test_models_are_listed(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert {m.id for m in models.data} == {SMOL, GEMMA}
    gemma = client.models.retrieve(GEMMA)
    assert gemma.id == GEMMA and gemma.owned_by == "timeshare"
    assert gemma.model_extra["timeshare"]["chat_format"] == "fallback"


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_chat_with_each_model(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=24, temperature=0
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == model
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.strip(), f"{model} gave an empty answer"
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert "switched" in reply.model_extra["timeshare"]


def test_chat_streams_in_pieces(client: openai.OpenAI) -> None:
    # (stream and plain answers are compared on /v1/completions below: chat requests reuse the KV
    # prefix of the previous chat in the worker, which may change the last bits of the logits)
    chunks = list(
        client.chat.completions.create(
            model=SMOL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1, "not streamed in pieces"
    assert "".join(pieces).strip()
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] in ("stop", "length")
    assert chunks[-1].choices == [] and 0 < chunks[-1].usage.completion_tokens <= 20


def test_stream_ends_with_done(served: Served) -> None:
    body = {"model": GEMMA, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json=body, headers=served.headers(), timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert all(json.loads(d)["object"] == "text_completion" for d in data[:-1])


def test_interleaved_completions_equal_the_greedy_reference(
    served: Served, client: openai.OpenAI, greedy_references: dict[tuple[str, str], str]
) -> None:
    # three requests per model at once, alternating models: 1 in flight + 2 queued per model
    jobs = [(model, PROMPTS[model][i % 2]) for i in range(3) for model in (SMOL, GEMMA)]
    before = served.status()["switch_stats"]["per_model"]  # type: ignore[index]
    base = {m: before.get(m, {}).get("requests", 0) for m in (SMOL, GEMMA)}

    def complete(job: tuple[str, str]) -> tuple[str, str, str, str]:
        model, prompt = job
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.object == "text_completion" and reply.model == model
        return model, prompt, reply.choices[0].text, reply.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        answers = list(pool.map(complete, jobs))
    for model, prompt, text, finish in answers:
        assert text == greedy_references[(model, prompt)], (model, prompt)
        assert finish in ("stop", "length")
    # the switch counter is fed by the pool's REQUEST_DONE events, published on its event thread a
    # moment after each answer: wait for this test's six requests to be counted
    counted = served.wait_until(
        lambda s: all(
            s["switch_stats"]["per_model"].get(m, {}).get("requests", 0) >= base[m] + 3 for m in base
        ),
        "the six requests to reach the switch counter",
    )
    per_model = counted["switch_stats"]["per_model"]  # type: ignore[index]
    assert per_model[SMOL]["switches"] >= 1 and per_model[GEMMA]["switches"] >= 1


def test_streamed_completion_equals_the_greedy_reference(
    client: openai.OpenAI, greedy_references: dict[tuple[str, str], str]
) -> None:
    prompt = PROMPTS[GEMMA][1]
    plain = client.completions.create(model=GEMMA, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].text == greedy_references[(GEMMA, prompt)]
    stream = client.completions.create(
        model=GEMMA, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == greedy_references[(GEMMA, prompt)]


def test_the_timeshare_object_in_plain_and_streamed_answers(served: Served) -> None:
    """Every field of the `timeshare` object (docs/API.md), over HTTP: a plain answer that took the
    GPU from the other model, then a streamed one of the same model (no switch)."""
    fields = {
        "switched",
        "wait_ms",
        "restore_ms",
        "release_ms",
        "first_token_ms",
        "prompt_tokens_evaluated",
        "batch_size",
        "restored_bytes",
        "timings",
    }
    timing_fields = {
        "queue_ms",
        "steps_before",
        "prefill_steps",
        "prefill_ms",
        "first_token_ms",
        "step_sequences",
        "step_prompts",
    }
    url, headers = f"{served.url}/v1/completions", served.headers()
    body = {"prompt": "The colour of the sky is", "max_tokens": 4, "temperature": 0, "cache_prompt": False}
    assert httpx.post(url, json=dict(body, model=SMOL), headers=headers, timeout=180).status_code == 200
    plain = httpx.post(url, json=dict(body, model=GEMMA), headers=headers, timeout=180).json()
    ts = plain["timeshare"]
    assert set(ts) == fields
    assert ts["switched"] is True and ts["restore_ms"] > 0 and ts["first_token_ms"] > 0
    assert ts["wait_ms"] >= 0 and ts["release_ms"] > 0  # the other model released for it
    assert ts["batch_size"] == 1  # it answered alone
    t = ts["timings"]  # where its first token went in the worker: prefilled alone, in one step
    assert set(t) == timing_fields
    assert (t["steps_before"], t["prefill_steps"], t["step_sequences"], t["step_prompts"]) == (0, 1, 1, 1)
    assert t["first_token_ms"] >= t["queue_ms"] + t["prefill_ms"] and t["prefill_ms"] > 0
    assert ts["restored_bytes"] > 0  # the weights it had lost came back
    assert ts["prompt_tokens_evaluated"] == plain["usage"]["prompt_tokens"] > 0  # cache_prompt false
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    streamed = dict(body, model=GEMMA, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url, json=streamed, headers=headers, timeout=180) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    final = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(final) == 1 and all("timeshare" not in e for e in events if e is not final[0])
    ts = final[0]["timeshare"]
    assert set(ts) == fields
    assert ts["switched"] is False and ts["restore_ms"] == 0 and ts["wait_ms"] == 0
    assert ts["restored_bytes"] == 0
    assert ts["first_token_ms"] > 0
    assert set(ts["timings"]) == timing_fields and ts["timings"]["step_prompts"] == 1
    usage = events[-1]["usage"]
    assert ts["prompt_tokens_evaluated"] == usage["prompt_tokens"] > 0
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == plain["choices"][0]["text"]  # same request, same greedy answer
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_malformed_json_is_a_400_in_openai_shape(served: Served) -> None:
    for body in (b'{"model": "gemma3-270m", "prompt": ', b"", b"\xff\xfe", b"[1, 2]"):
        r = httpx.post(
            f"{served.url}/v1/completions",
            content=body,
            headers={**served.headers(), "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, body
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], body
        assert set(error) == {"message", "type", "param", "code"}


def test_a_model_is_named_by_its_id_in_any_case_but_not_a_prefix(
    client: openai.OpenAI, served: Served
) -> None:
    # (display names: test_cli's demo models have them)
    assert client.models.retrieve(GEMMA.upper()).id == GEMMA
    answer = client.completions.create(model=SMOL.upper(), prompt="Hello", max_tokens=2)
    assert answer.choices[0].text
    for prefix in ("smollm2", "gemma"):
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(prefix)
    unpinned = httpx.post(f"{served.url}/timeshare/v1/models/{GEMMA.upper()}/unpin", headers=served.headers())
    assert unpinned.status_code == 200 and unpinned.json()["model"]["id"] == GEMMA


def test_unknown_model_is_a_404_naming_the_models(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="llama-9000", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert SMOL in info.value.message and GEMMA in info.value.message


def test_prompt_longer_than_the_context_is_a_400_and_the_model_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SMOL, prompt="lorem ipsum dolor " * 1500, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SMOL, prompt="lorem ipsum dolor " * 1500, max_tokens=4, stream=True)
    assert info.value.code == "context_length_exceeded"
    after = client.completions.create(model=SMOL, prompt="Hello", max_tokens=2, temperature=0)
    assert after.usage.completion_tokens > 0


def test_oversize_body_is_a_413(served: Served) -> None:
    body = json.dumps({"model": SMOL, "prompt": "x" * (9 * 1024 * 1024)})
    r = httpx.post(f"{served.url}/v1/completions", content=body, headers=served.headers(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_missing_and_wrong_key_are_401(served: Served) -> None:
    r = httpx.get(f"{served.url}/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    r = httpx.get(f"{served.url}/timeshare/v1/status", timeout=30)
    assert r.status_code == 401
    with (
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        wrong.models.list()
    assert info.value.code == "invalid_api_key"


def test_health_answers_without_the_key(served: Served) -> None:
    r = httpx.get(f"{served.url}/health", timeout=30)  # a liveness probe needs no key
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert r.headers["x-served-by"] == "timeshare"


def test_unknown_endpoint_is_a_404_in_openai_shape(served: Served) -> None:
    r = httpx.get(f"{served.url}/v1/audio/speech", headers=served.headers(), timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = httpx.get(f"{served.url}/v1/completions", headers=served.headers(), timeout=30)
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_status_pin_unpin_sleep_wake(served: Served) -> None:
    def post(model: str, command: str, body: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            f"{served.url}/timeshare/v1/models/{model}/{command}",
            json=body,
            headers=served.headers(),
            timeout=60,
        )

    status = served.status()
    assert status["object"] == "timeshare.status"
    assert {m["id"] for m in status["models"]} == {SMOL, GEMMA}  # type: ignore[union-attr]
    assert post(SMOL, "pin").json()["model"]["pinned"] is True
    assert served.model_status(SMOL)["pinned"] is True
    assert post(SMOL, "unpin").json()["model"]["pinned"] is False
    assert post(GEMMA, "sleep").status_code == 200
    served.wait_until(lambda s: _state(s, GEMMA) == "sleeping", "gemma to sleep", timeout=60)
    assert post(GEMMA, "wake").status_code == 200
    served.wait_until(lambda s: s["holder"] == GEMMA and _state(s, GEMMA) == "resident", "gemma to wake", 60)
    bad = post(GEMMA, "sleep", {"level": "deep"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    missing = post("nope", "pin")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _state(status: dict[str, object], model: str) -> str:
    return next(m["state"] for m in status["models"] if m["id"] == model)  # type: ignore[attr-defined]


def test_full_queue_is_a_429_and_a_disconnect_cancels(served: Served) -> None:
    base = served.status()["switch_stats"]["cancelled_by_disconnect"]  # type: ignore[index]
    long_body = {
        "model": GEMMA,
        "prompt": "1, 2, 3, 4, 5, 6,",
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    burst = QUEUE_LIMIT + 2
    codes: list[int] = []
    lock = threading.Lock()

    def short_request() -> None:
        r = httpx.post(
            f"{served.url}/v1/completions",
            json={"model": GEMMA, "prompt": "Hi", "max_tokens": 1, "temperature": 0},
            headers=served.headers(),
            timeout=300,
        )
        if r.status_code == 429:
            error = r.json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        with lock:
            codes.append(r.status_code)

    # every slot of the batch busy with a long generation (a model answers `parallel` at once)
    slots = int(served.model_status(GEMMA)["parallel"])  # type: ignore[call-overload]
    readers = []  # kept: a reader that is collected closes its stream
    with contextlib.ExitStack() as streams:
        for _ in range(slots):
            stream = streams.enter_context(
                httpx.stream(
                    "POST",
                    f"{served.url}/v1/completions",
                    json=long_body,
                    headers=served.headers(),
                    timeout=300,
                )
            )
            assert stream.status_code == 200
            lines = stream.iter_lines()
            readers.append(lines)
            next(line for line in lines if line.startswith("data: "))  # this one is in flight
        threads = [threading.Thread(target=short_request) for _ in range(burst)]
        for t in threads:
            t.start()
        served.wait_until(
            lambda s: len(codes) >= burst - QUEUE_LIMIT and _queued(s, GEMMA) == QUEUE_LIMIT,
            "the queue to fill",
            timeout=120,
        )
        assert served.model_status(GEMMA)["busy"] is True
    # leaving the block closed the connections: the long generations must be cancelled, and the queue drains
    for t in threads:
        t.join(300)
    assert sorted(codes) == [200] * QUEUE_LIMIT + [429] * (burst - QUEUE_LIMIT)
    status = served.wait_until(
        lambda s: s["switch_stats"]["cancelled_by_disconnect"] > base, "the cancel to be recorded", timeout=60
    )
    assert status["switch_stats"]["recent_cancel_finish_reasons"][-1] == "cancelled"  # type: ignore[index]


def _queued(status: dict[str, object], model: str) -> int:
    return int(next(m["queued"] for m in status["models"] if m["id"] == model))  # type: ignore[attr-defined]


def test_cli_finds_the_key_in_the_config(served: Served) -> None:
    assert served.config is not None
    done = run_cli(served.home, "--config", str(served.config), "status", "--json")
    assert done.returncode == 0, done.stderr
    assert {m["id"] for m in json.loads(done.stdout)["models"]} == {SMOL, GEMMA}
    done = run_cli(served.home, "models", env_extra={"TIMESHARE_API_KEY": KEY})
    assert done.returncode == 0 and SMOL in done.stdout, done.stderr
    done = run_cli(served.home, "models")  # the default config has no key
    assert done.returncode == 1 and "needs an API key" in done.stderr
    done = run_cli(served.home, "models", env_extra={"TIMESHARE_API_KEY": "wrong"})
    assert done.returncode == 1 and "Incorrect API key" in done.stderr


def test_abandoned_plain_request_is_cancelled(served: Served) -> None:
    base = served.status()["switch_stats"]["cancelled_by_disconnect"]  # type: ignore[index]
    body = {"model": GEMMA, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 1500, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{served.url}/v1/completions", json=body, headers=served.headers(), timeout=3)
    status = served.wait_until(
        lambda s: s["switch_stats"]["cancelled_by_disconnect"] > base,  # type: ignore[index]
        "the server to cancel the abandoned request",
        timeout=60,
    )
    assert status["switch_stats"]["recent_cancel_finish_reasons"][-1] == "cancelled"  # type: ignore[index]
    served.wait_until(lambda s: _queued(s, GEMMA) == 0 and not _busy(s, GEMMA), "gemma to become idle", 60)


def _busy(status: dict[str, object], model: str) -> bool:
    return bool(next(m["busy"] for m in status["models"] if m["id"] == model))  # type: ignore[attr-defined]


def test_worker_crash_mid_stream_ends_the_stream_with_an_error_event(served: Served) -> None:
    """Runs last against the shared server: it kills a worker (the pool restarts it)."""
    body = {"model": SMOL, "prompt": "1, 2, 3, 4,", "max_tokens": 1500, "temperature": 0, "stream": True}
    pid = served.model_status(SMOL)["pid"]
    assert isinstance(pid, int)
    url = f"{served.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=served.headers(), timeout=120) as r:
        assert r.status_code == 200
        events = (line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(events))["choices"][0]["text"]
        os.kill(pid, signal.SIGKILL)
        rest = list(events)
    error = json.loads(rest[-1])["error"]  # no [DONE]: the stream ends with an OpenAI-style error event
    assert error["code"] == "model_unavailable" and error["type"] == "server_error"
    assert SMOL in error["message"]
    served.wait_until(
        lambda s: _state(s, SMOL) in ("resident", "released") and served.model_status(SMOL)["pid"] != pid,
        "the worker's restart",
        180,
    )
    again = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": SMOL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        headers=served.headers(),
        timeout=120,
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] > 0


# ---- ApiServer in-process (how the tray app runs it) -----------------------------------------------


def test_api_server_in_process_reports_its_port_and_cleans_up(timeshare_home: Path) -> None:
    from timeshare.core import paths
    from timeshare.core.api.server import ApiServer
    from timeshare.core.config.schema import ApiConfig, Config
    from timeshare.core.errors import ConfigError
    from timeshare.core.pool.supervisor import Pool

    pool = Pool(Config())  # no models: nothing to spawn, a real pool all the same
    pool.start()
    try:
        with pytest.raises(ConfigError, match="not a loopback address"):
            ApiServer(pool, ApiConfig(host="0.0.0.0", port=0)).start()
        server = ApiServer(pool, ApiConfig(port=0))
        url = server.start()
        try:
            assert server.port and url == f"http://127.0.0.1:{server.port}"
            assert json.loads(paths.api_address_file().read_text())["url"] == url
            r = httpx.get(f"{url}/v1/models", timeout=30)
            assert r.json() == {"object": "list", "data": []}
            r = httpx.post(f"{url}/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=30)
            assert r.status_code == 404 and "none are configured" in r.json()["error"]["message"]
        finally:
            server.stop()
        assert not paths.api_address_file().exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/v1/models", timeout=5)
    finally:
        pool.stop()
