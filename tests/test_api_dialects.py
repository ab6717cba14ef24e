"""The Ollama API and the Anthropic Messages API on `timeshare serve`, through the real clients
from PyPI (``ollama``, ``anthropic``) against the demo models, one server for the module."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import pytest
import tomllib
from _api_util import GEMMA, SMOL, Served, serving_demo_models
from _hub_util import FakeHub, make_gguf

pytestmark = pytest.mark.slow

KEY = "dialects-key"
#: a short answer keeps the module fast (the demo models are tiny; greedy answers are fixed)
N = 12
#: this SDK has no temperature argument any more (the API still takes the field)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("dialects-home")
    with serving_demo_models(home, smollm2_path, gemma3_path, key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def claude(served: Served) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def llama(served: Served) -> Iterator[ollama.Client]:
    with ollama.Client(host=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=180) as c:
        yield c


def _openai_greedy(served: Served, model: str, messages: list[dict[str, str]], n: int = N) -> str:
    """The oracle: the same conversation through the OpenAI surface, greedy."""
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=served.headers(), timeout=180)
    r.raise_for_status()
    text: str = r.json()["choices"][0]["message"]["content"]
    return text


# ---- Anthropic -----------------------------------------------------------------------------------


def test_anthropic_create_matches_the_openai_surface(served: Served, claude: anthropic.Anthropic) -> None:
    system = "You are terse."
    question = "Name a colour."
    message = claude.messages.create(
        model=SMOL,
        max_tokens=N,
        extra_body=GREEDY,
        system=system,
        messages=[{"role": "user", "content": question}],
    )
    expected = _openai_greedy(
        served, SMOL, [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text"
    assert message.content[0].text == expected
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens >= 1 and message.usage.input_tokens > 5
    assert "switched" in message.model_extra["timeshare"]  # type: ignore[index]


def test_anthropic_stream_assembled_by_the_sdk(served: Served, claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    with claude.messages.stream(model=SMOL, max_tokens=N, extra_body=GREEDY, messages=messages) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds
    assert final.content[0].text == _openai_greedy(served, SMOL, messages)  # type: ignore[union-attr]
    # the model may end its answer before N tokens (what it writes is its own, issue 38 item 6)
    assert 0 < final.usage.output_tokens <= N
    assert final.stop_reason == ("max_tokens" if final.usage.output_tokens == N else "end_turn")


def test_anthropic_stop_sequence_and_count_tokens(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Write the numbers 1 2 3 4 5 6 7 8 9 with spaces."}]
    free = claude.messages.create(model=SMOL, max_tokens=40, extra_body=GREEDY, messages=messages)  # type: ignore[arg-type]
    text = free.content[0].text  # type: ignore[union-attr]
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = claude.messages.create(
        model=SMOL,
        max_tokens=40,
        extra_body=GREEDY,
        messages=messages,
        stop_sequences=[stop],  # type: ignore[arg-type]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    counted = claude.messages.count_tokens(model=SMOL, messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == free.usage.input_tokens


def test_anthropic_errors_are_the_sdks_own(served: Served, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert "nope" in missing.value.message and missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model=SMOL,
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],  # type: ignore[list-item]
        )
    assert "image" in bad.value.message
    wrong = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=SMOL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    wrong.close()
    # max_tokens is required, as Anthropic requires it
    r = httpx.post(
        f"{served.url}/v1/messages",
        json={"model": SMOL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": KEY},
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


# ---- Ollama --------------------------------------------------------------------------------------


def _ollama(served: Served, path: str, **body: object) -> dict[str, Any]:
    """A whole (not streamed) greedy answer as JSON (the client's types drop the timeshare field)."""
    body = {"stream": False, "options": {"temperature": 0, "num_predict": N}, **body}
    r = httpx.post(f"{served.url}{path}", json=body, headers=served.headers(), timeout=180)
    answer: dict[str, Any] = r.raise_for_status().json()
    return answer


def test_ollama_root_and_version(served: Served) -> None:
    assert httpx.get(served.url + "/", headers=served.headers()).text == "Ollama is running"
    assert httpx.head(served.url + "/", headers=served.headers()).status_code == 200
    assert httpx.get(served.url + "/api/version", headers=served.headers()).json()["version"]


def test_ollama_chat_whole_and_streamed(served: Served, llama: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    options = {"temperature": 0, "num_predict": N, "repeat_penalty": 1.0}
    whole = llama.chat(model=f"{SMOL}:latest", messages=messages, options=options, stream=False)
    expected = _openai_greedy(served, SMOL, messages)
    assert whole.message.role == "assistant" and whole.message.content == expected
    assert whole.done and whole.done_reason == "length"
    assert whole.eval_count == N and (whole.eval_duration or 0) > 0
    assert (whole.total_duration or 0) >= (whole.eval_duration or 0)
    assert whole.prompt_eval_count is not None
    parts = list(llama.chat(model=SMOL, messages=messages, options=options, stream=True))
    assert len(parts) >= 2 and parts[-1].done and not parts[0].done
    assert "".join(p.message.content or "" for p in parts) == expected
    assert parts[-1].eval_count == N


def test_ollama_errors_are_the_clients_own(served: Served, llama: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        llama.chat(model="nope:latest", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and "nope" in missing.value.error
    with pytest.raises(ollama.ResponseError) as images:
        llama.chat(model=SMOL, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert images.value.status_code == 400 and "images" in images.value.error
    r = httpx.post(f"{served.url}/api/chat", content=b"{not json", headers=served.headers())
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(f"{served.url}/api/chat", json={"model": SMOL}, headers={})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert httpx.get(f"{served.url}/api/version", headers=served.headers()).status_code == 200


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = claude.messages.create(
        model=SMOL,
        max_tokens=60,
        messages=[ask],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(calls[0].input) == {"city"} and isinstance(calls[0].input["city"], str)  # type: ignore[arg-type]
    assert calls[0].id.startswith("toolu_")
    # the streamed form of the same call, assembled by the SDK
    with claude.messages.stream(
        model=SMOL,
        max_tokens=60,
        messages=[ask],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    streamed_calls = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_calls[0].input == calls[0].input  # type: ignore[union-attr]
    # "any" lets the model write more calls: one that max_tokens cut is there too, as far as it was
    # written, and the answer says max_tokens (as Anthropic's API answers)
    assert streamed.stop_reason in ("tool_use", "max_tokens")
    assert streamed.stop_reason == "tool_use" or len(streamed_calls) > 1
    # the result goes back as a tool_result block; the answer is text
    second = claude.messages.create(
        model=SMOL,
        max_tokens=N,
        messages=[
            ask,  # type: ignore[list-item]
            {"role": "assistant", "content": [c.model_dump() for c in calls]},  # type: ignore[misc]
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 24 C"}],
            },
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content[0].type == "text" and second.content[0].text  # type: ignore[union-attr]


def test_ollama_tool_call_and_format_schema(served: Served, llama: ollama.Client) -> None:
    tool = {
        "type": "function",
        "function": {
            **{k: v for k, v in WEATHER.items() if k != "input_schema"},
            "parameters": WEATHER["input_schema"],
        },
    }
    options = {"temperature": 0, "num_predict": 60}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # Ollama has no tool_choice; Timeshare's extension forces the call (a grammar from the first
    # token), and the client's own response type reads the answer
    body = {"model": SMOL, "messages": messages, "tools": [tool], "tool_choice": "required", "stream": False}
    r = httpx.post(
        f"{served.url}/api/chat", json={**body, "options": options}, headers=served.headers(), timeout=180
    )
    forced = ollama.ChatResponse.model_validate(r.raise_for_status().json())
    calls = forced.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert set(calls[0].function.arguments) == {"city"} and isinstance(
        calls[0].function.arguments["city"], str
    )
    # auto, through the client: a call or text, never a broken call
    auto = llama.chat(model=SMOL, messages=messages, tools=[tool], options=options)
    for call in auto.message.tool_calls or []:
        assert call.function.name == "get_weather" and set(call.function.arguments) == {"city"}
    # the call and its result back in the history: the answer is text
    history = [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "content": "Sunny, 24 C", "tool_name": "get_weather"},
    ]
    after = llama.chat(model=SMOL, messages=history, tools=[tool], options={**options, "num_predict": N})
    assert after.message.content and not after.message.tool_calls
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    answer = llama.chat(
        model=SMOL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        format=schema,
        options=options,
    )
    jsonschema.validate(json.loads(answer.message.content or ""), schema)
    plain = llama.generate(model=SMOL, prompt="Give me a JSON object.", format="json", options=options)
    assert isinstance(json.loads(plain.response), dict)


def test_ollama_list_show_ps(served: Served, llama: ollama.Client, smollm2_path: Path) -> None:
    listed = {m.model: m for m in llama.list().models}
    assert set(listed) == {f"{SMOL}:latest", f"{GEMMA}:latest"}
    smol = listed[f"{SMOL}:latest"]
    assert smol.size == smollm2_path.stat().st_size
    assert smol.digest == hashlib.sha256(smollm2_path.read_bytes()).hexdigest()  # an oracle of its own
    assert smol.details is not None and smol.details.format == "gguf" and smol.details.family == "llama"
    assert smol.details.quantization_level and smol.details.parameter_size
    shown = llama.show(SMOL)
    assert "{%" in (shown.template or "") and "completion" in (shown.capabilities or [])
    assert (shown.modelinfo or {})["general.architecture"] == "llama"
    assert "num_ctx" in (shown.parameters or "")
    running = {m.model: m for m in llama.ps().models}
    assert f"{SMOL}:latest" in running and running[f"{SMOL}:latest"].expires_at is not None


def test_ollama_generate_context_and_keep_alive(served: Served, llama: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": N}
    first = llama.generate(model=SMOL, prompt="My name is Ada.", options=options)
    assert first.context and first.response
    again = _ollama(served, "/api/generate", model=SMOL, prompt="What is my name?", context=first.context)
    assert again["response"] and again["context"] != first.context
    # the context holds the first turn: only the new turn's tokens are evaluated
    assert 0 < again["prompt_eval_count"] < again["timeshare"]["prompt_tokens"]
    # Ollama's default repeat_penalty (1.1) off, to compare with the OpenAI surface's answer
    plain = {**options, "repeat_penalty": 1.0}
    raw = llama.generate(model=SMOL, prompt="The capital of France is", raw=True, options=plain)
    body = {"model": SMOL, "prompt": "The capital of France is", "max_tokens": N, "temperature": 0}
    r = httpx.post(f"{served.url}/v1/completions", json=body, headers=served.headers(), timeout=180)
    assert raw.response == r.json()["choices"][0]["text"]
    with pytest.raises(ollama.ResponseError) as template:
        llama.generate(model=SMOL, prompt="hi", template="{{ .Prompt }}")
    assert template.value.status_code == 400 and "template" in template.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        llama.generate(model=SMOL, prompt="hi", context=[12345])
    assert unknown.value.status_code == 400 and "context" in unknown.value.error
    # keep_alive 0: the weights go now (KV kept), the model stays listed with no VRAM
    llama.generate(model=SMOL, prompt="", keep_alive=0)
    assert served.model_status(SMOL)["state"] in ("released", "sleeping")
    assert served.model_status(SMOL)["pinned"] is False
    llama.generate(model=SMOL, prompt="", keep_alive="1h")  # a duration sets the idle timer
    expires = next(m.expires_at for m in llama.ps().models if m.model == f"{SMOL}:latest")
    assert expires is not None and expires.year == dt.datetime.now(dt.timezone.utc).year


def test_a_switch_mid_conversation_keeps_the_prompt_cache(served: Served, llama: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": N}
    # the prompt cache reuses a prefix of 64 tokens or more (docs/API.md)
    system = "You are a patient guide to the oceans of the world. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me about the sea."}]
    first = _ollama(served, "/api/chat", model=SMOL, messages=messages)
    assert first["prompt_eval_count"] >= 80
    llama.chat(model=GEMMA, messages=[{"role": "user", "content": "Hi"}], options=options)  # takes the GPU
    messages += [
        {"role": "assistant", "content": first["message"]["content"]},
        {"role": "user", "content": "More."},
    ]
    second = _ollama(served, "/api/chat", model=SMOL, messages=messages)
    assert second["timeshare"]["switched"] is True
    # the first turn's prompt was in the KV cache: it is not evaluated again
    new_tokens = second["timeshare"]["prompt_tokens"] - first["timeshare"]["prompt_tokens"]
    assert 0 < second["prompt_eval_count"] <= new_tokens
    assert second["load_duration"] > 0 and second["total_duration"] >= second["load_duration"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/chat", {"model": SMOL, "messages": "hi"}),
        ("/api/chat", {"model": SMOL, "messages": [{"role": "wizard", "content": "x"}]}),
        (
            "/api/chat",
            {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "options": {"bogus": 1}},
        ),
        ("/api/chat", {"model": SMOL, "messages": [], "keep_alive": "forever"}),
        ("/api/chat", {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "format": {"not": {}}}),
        ("/api/generate", {"model": SMOL, "prompt": 5}),
        ("/api/generate", {"model": SMOL, "prompt": "x", "options": {"num_predict": -7}}),
        ("/api/show", {}),
        ("/v1/messages", {"model": SMOL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/messages", {"model": SMOL, "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
        (
            "/v1/messages",
            {"model": SMOL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "x"}]}]},
        ),
        ("/v1/messages/count_tokens", {"model": SMOL, "messages": []}),
    ],
)
def test_hostile_inputs_are_clear_4xx(served: Served, path: str, body: object) -> None:
    r = httpx.post(f"{served.url}{path}", json=body, headers=served.headers(), timeout=60)
    assert 400 <= r.status_code < 500, r.text
    answer = r.json()
    message = answer["error"]["message"] if path.startswith("/v1") else answer["error"]
    assert isinstance(message, str) and len(message) > 20
    if path.startswith("/v1"):
        assert answer["type"] == "error"
    assert httpx.get(f"{served.url}/api/version", headers=served.headers()).status_code == 200


def test_ollama_pull_from_a_url_then_delete(served: Served, llama: ollama.Client, tmp_path: Path) -> None:
    hub = FakeHub()
    try:
        data = make_gguf(tmp_path / "Tiny-Q4_K_M.gguf")
        hub.files["Tiny-Q4_K_M.gguf"] = data
        events = list(llama.pull(f"{hub.url}/files/Tiny-Q4_K_M.gguf", stream=True))
    finally:
        hub.close()
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    done = [e for e in events if e.completed is not None]
    assert done and done[-1].completed == len(data) and done[-1].total == len(data)
    assert served.config is not None
    added = [m for m in tomllib.loads(served.config.read_text())["models"] if m["id"] not in (SMOL, GEMMA)]
    assert len(added) == 1 and Path(added[0]["path"]).read_bytes() == data
    pulled = added[0]["id"]
    assert f"{pulled}:latest" in {m.model for m in llama.list().models}
    llama.delete(f"{pulled}:latest")
    # the pool stops and forgets it (on its own thread)
    served.wait_until(lambda st: pulled not in [m["id"] for m in st["models"]], "the model to go", 60)
    assert f"{pulled}:latest" not in {m.model for m in llama.list().models}
    assert pulled not in [m["id"] for m in tomllib.loads(served.config.read_text())["models"]]
    assert Path(added[0]["path"]).exists()  # the file stays unless asked
    with pytest.raises(ollama.ResponseError) as bad:
        llama.pull("hf.co/", stream=False)
    assert bad.value.status_code == 400


def test_ollama_embed_is_the_pools_embedding(served: Served, llama: ollama.Client) -> None:
    texts = ["The sea is blue.", "Bonjour"]
    answer = llama.embed(model=SMOL, input=texts)
    assert len(answer.embeddings) == 2
    for vector in answer.embeddings:
        assert abs(sum(x * x for x in vector) - 1.0) < 1e-4  # unit vectors
    r = httpx.post(
        f"{served.url}/v1/embeddings",
        json={"model": SMOL, "input": texts},
        headers=served.headers(),
        timeout=180,
    )
    reference = [d["embedding"] for d in r.json()["data"]]
    for ours, theirs in zip(answer.embeddings, reference, strict=True):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-5
    legacy = llama.embeddings(model=SMOL, prompt=texts[0])
    assert max(abs(a - b) for a, b in zip(legacy.embedding, reference[0], strict=True)) < 1e-5
