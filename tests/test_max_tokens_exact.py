"""``max_tokens`` is never exceeded, also when it falls inside a multi-byte character (issue 45):
SmolLM2 answers "Say hello to me." with an emoji of several tokens; a limit that cuts it ends the
answer on the last whole character, with exactly that many completion tokens and the finish reason
of a length limit, on all three dialects through their official clients (OpenAI ``max_tokens``,
Anthropic ``max_tokens``, Ollama ``num_predict``), whole and streamed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import ollama
import openai
import pytest
from _api_util import SMOL, Served, serving, write_config

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Say hello to me."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("max-tokens-home")
    config = write_config(home / "timeshare.toml", [(SMOL, smollm2_path)], extra_model_lines="n_ctx = 512")
    with serving(home, config=config) as server:
        server.wait_ready([SMOL])
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def _whole(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def cut(client: openai.OpenAI) -> tuple[int, str]:
    """The first token count that ends inside a character of the greedy answer, and the text up
    to the last whole character before it (from the tokens' bytes in the logprobs)."""
    full = client.chat.completions.create(
        model=SMOL,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        logprobs=True,  # type: ignore[arg-type]
    )
    assert full.choices[0].logprobs is not None and full.choices[0].logprobs.content
    pieces = [bytes(e.bytes or []) for e in full.choices[0].logprobs.content]
    n = next((k for k in range(1, len(pieces) + 1) if not _whole(b"".join(pieces[:k]))), None)
    assert n is not None, f"the greedy answer has no character of several tokens: {pieces}"
    text = b"".join(pieces[:n]).decode("utf-8", errors="ignore")  # the cut character dropped
    assert full.choices[0].message.content is not None
    assert full.choices[0].message.content.startswith(text) and len(full.choices[0].message.content) > len(
        text
    )
    return n, text


def test_openai_max_tokens_inside_a_character(client: openai.OpenAI, cut: tuple[int, str]) -> None:
    n, text = cut
    answer = client.chat.completions.create(model=SMOL, messages=MESSAGES, max_tokens=n, temperature=0)  # type: ignore[arg-type]
    assert answer.usage is not None and answer.usage.completion_tokens == n
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content == text
    parts: list[str] = []
    finish = None
    tokens = None
    for chunk in client.chat.completions.create(
        model=SMOL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert "".join(parts) == text and finish == "length" and tokens == n


def test_anthropic_max_tokens_inside_a_character(served: Served, cut: tuple[int, str]) -> None:
    n, text = cut
    with anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=180) as claude:
        message = claude.messages.create(
            model=SMOL,
            max_tokens=n,
            extra_body={"temperature": 0},
            messages=MESSAGES,  # type: ignore[arg-type]
        )
        assert message.usage.output_tokens == n and message.stop_reason == "max_tokens"
        assert message.content[0].text == text  # type: ignore[union-attr]
        with claude.messages.stream(
            model=SMOL,
            max_tokens=n,
            extra_body={"temperature": 0},
            messages=MESSAGES,  # type: ignore[arg-type]
        ) as stream:
            final = stream.get_final_message()
        assert final.usage.output_tokens == n and final.stop_reason == "max_tokens"
        assert final.content[0].text == text  # type: ignore[union-attr]


def test_ollama_num_predict_inside_a_character(served: Served, cut: tuple[int, str]) -> None:
    n, text = cut
    with ollama.Client(host=served.url, timeout=180) as llama:
        options = {"num_predict": n, "temperature": 0}
        answer = llama.chat(model=SMOL, messages=MESSAGES, options=options)
        assert answer.eval_count == n and answer.done_reason == "length"
        assert answer.message.content == text
        chunks = list(llama.chat(model=SMOL, messages=MESSAGES, options=options, stream=True))
        assert "".join(c.message.content or "" for c in chunks) == text
        assert chunks[-1].eval_count == n and chunks[-1].done_reason == "length"
