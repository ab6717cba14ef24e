"""Numbers and names the dialects answer with (issue 38): Ollama's durations of a whole answer,
Anthropic's stop_reason and stop_sequence, /v1/embeddings' code for a token outside the
vocabulary. The API runs in-process over a pool with the SmolLM2 demo model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from timeshare.core.api.anthropic import stop_reason
from timeshare.core.api.server import ApiServer
from timeshare.core.config.schema import ApiConfig, Config, ModelConfig
from timeshare.core.pool.supervisor import Pool

SMOL = "smol"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[str]:
    pool = Pool(Config(models=(ModelConfig(id=SMOL, path=str(smollm2_path), n_ctx=512, n_seq=2),)))
    pool.start()
    server = ApiServer(pool, ApiConfig(port=0), address_file=tmp_path_factory.mktemp("api") / "api.json")
    try:
        server.start()
        pool.wait_ready([SMOL], timeout=300)
        assert server.url is not None
        yield server.url
    finally:
        server.stop()
        pool.stop()


def test_a_whole_ollama_answer_reports_the_decode_time_of_its_tokens(url: str) -> None:
    # issue 38: eval_duration was the gap between the first piece and the end as the waiter saw
    # them (both at the end): 471 ns for 8 tokens, 17 million tokens/s
    body = {
        "model": SMOL,
        "prompt": "Count from 1 to 20:",
        "raw": True,
        "stream": False,
        "options": {"temperature": 0, "num_predict": 12},
    }
    answer = httpx.post(f"{url}/api/generate", json=body, timeout=300).json()
    n = answer["eval_count"]
    assert n == 12, answer
    # each token after the first is a decode step of its own, and a step of a model on a
    # device takes far more than 10 us (a generous floor: 100,000 tokens/s)
    assert answer["eval_duration"] >= 10_000 * (n - 1), answer
    parts = answer["load_duration"] + answer["prompt_eval_duration"] + answer["eval_duration"]
    assert parts <= answer["total_duration"]


@pytest.mark.parametrize(
    ("finish", "stop", "called", "asked", "cut", "want"),
    [
        ("stop", "STOP", False, ("STOP",), False, ("stop_sequence", "STOP")),
        ("stop", "STOP", True, ("STOP",), False, ("stop_sequence", "STOP")),  # after a tool call too
        ("stop", "", True, (), False, ("tool_use", None)),
        ("stop", "\nUser:", False, (), False, ("end_turn", None)),  # the model format's own stop string
        ("length", "", True, (), True, ("max_tokens", None)),  # a tool_use cut short
        ("length", "", True, (), False, ("tool_use", None)),  # whole calls (what followed is dropped)
        ("length", "", False, (), False, ("max_tokens", None)),
        ("stop", "", False, (), False, ("end_turn", None)),
    ],
)
def test_the_anthropic_stop_reason_names_what_stopped_the_answer(
    finish: str, stop: str, called: bool, asked: tuple[str, ...], cut: bool, want: tuple[str, str | None]
) -> None:
    assert stop_reason(finish, stop, called, asked, cut) == want


def test_an_anthropic_stop_sequence_is_named(url: str) -> None:
    body = {
        "model": SMOL,
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Write the numbers 1 2 3 4 5 6 7 8 9 with spaces."}],
    }
    free = httpx.post(f"{url}/v1/messages", json=body, timeout=300).json()
    words = free["content"][0]["text"].split()
    assert len(words) >= 3, free
    cut = httpx.post(f"{url}/v1/messages", json={**body, "stop_sequences": [words[2]]}, timeout=300).json()
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", words[2])


def test_a_token_outside_the_vocabulary_is_invalid_input(url: str) -> None:
    r = httpx.post(f"{url}/v1/embeddings", json={"model": SMOL, "input": [1, 2, 10**7]}, timeout=300)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_input",
        "input",
        "invalid_request_error",
    )
    assert "10000000" in error["message"] and "vocabulary" in error["message"]
