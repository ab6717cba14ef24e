"""Answers never pretend to be complete (issue 26): a model stopped (`sleep --level stop`) or
removed by a reload in the middle of an answer is an error with the reason, a 503 for a plain
request and an error event that the official `openai` client raises on for a stream, never a
200 with finish_reason "stop"; in the chat service the user's own Stop is "cancelled" (the window
shows "stopped") while a model stopped under it is an error, and the text so far is saved either
way. A real SmolLM2 worker behind an in-process API; its end-of-generation tokens are banned
(logit_bias in the front ends' defaults) so that no answer can end before the test cuts it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from _proc_util import wait_until
from timeshare.core import sampling
from timeshare.core.api import connections, handlers
from timeshare.core.api.server import ApiServer
from timeshare.core.config.schema import ApiConfig, ArenaConfig, Config, ModelConfig
from timeshare.core.conversations.chat import ChatService
from timeshare.core.conversations.store import Store
from timeshare.core.errors import ModelUnavailableError
from timeshare.core.pool.supervisor import Pool
from timeshare.core.state import ModelState

WAIT = 240.0
#: SmolLM2's end-of-generation tokens (llama_vocab_is_eog): <|endoftext|>, <|im_end|>, <|endoftext|>-likes
NO_EOG = ((0, -1000.0), (2, -1000.0), (4, -1000.0))
LONG = 3000  # tokens an answer may take: far more than the test lets it run


@dataclass
class Stack:
    pool: Pool
    api: ApiServer
    config: Config
    client: openai.OpenAI


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("cut-short")
    config = Config(
        models=(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=4096, idle_sleep_s=None),),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIMESHARE_HOME", str(home))
        for row in ("api_chat", "api_completion", "chat_window"):
            mp.setitem(sampling.DEFAULTS, row, {**sampling.DEFAULTS[row], "logit_bias": NO_EOG})
        pool = Pool(config, arena_dir=home / "arena", log_dir=home / "log", kv_dir=home / "kv")
        pool.start()
        api = ApiServer(pool, ApiConfig(port=0), address_file=home / "api.json")
        api.start()
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
        try:
            pool.wait_ready(timeout=WAIT)
            yield Stack(pool, api, config, client)
        finally:
            client.close()
            api.stop()
            pool.stop()


def _ready(stack: Stack) -> None:
    """The model loaded again (a stopped one starts on the next request; this waits for it)."""
    if stack.pool.snapshot().model("smol").state in (ModelState.STOPPED, ModelState.FAILED):
        stack.pool.start_model("smol")
    stack.pool.wait_ready(timeout=WAIT)


def _stop(stack: Stack) -> None:
    stack.pool.sleep("smol", level="stop")


def _remove(stack: Stack) -> None:
    stack.pool.apply_config(Config(models=(), arena=stack.config.arena))


@pytest.mark.slow
@pytest.mark.parametrize(("cut", "words"), [(_stop, "was stopped"), (_remove, "was removed")])
def test_a_stream_cut_short_raises_in_the_openai_client(stack: Stack, cut: object, words: str) -> None:
    _ready(stack)
    finishes: list[str | None] = []
    text: list[str] = []
    stream = stack.client.completions.create(
        model="smol", prompt="Once upon a time", max_tokens=LONG, temperature=0, stream=True
    )
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.text)
                finishes.append(choice.finish_reason)
            if len(text) == 2:
                cut(stack)  # type: ignore[operator]
    assert words in str(caught.value.message) and "incomplete" in str(caught.value.message)
    assert "".join(text) and set(finishes) == {None}  # text came, and no chunk said it was done
    if cut is _remove:
        stack.pool.apply_config(stack.config)  # back, for the next tests


@pytest.mark.slow
def test_a_plain_request_cut_short_is_a_503_with_the_reason(stack: Stack) -> None:
    _ready(stack)
    answer: list[httpx.Response] = []
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell a long story."}]}
    body["max_tokens"] = LONG  # type: ignore[assignment]
    thread = threading.Thread(
        target=lambda: answer.append(
            httpx.post(f"{stack.api.url}/v1/chat/completions", json=body, timeout=WAIT)
        )
    )
    thread.start()
    wait_until(lambda: stack.pool.snapshot().model("smol").busy, WAIT, "the answer to start")
    _stop(stack)
    thread.join(WAIT)
    (r,) = answer
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "model_unavailable" and "smol was stopped " in error["message"]


@pytest.mark.slow
def test_the_chat_service_tells_the_users_stop_from_a_stopped_model(stack: Stack, tmp_path: Path) -> None:
    _ready(stack)
    store = Store(tmp_path / "conv.sqlite3")
    try:
        chat = ChatService(stack.pool, store, flush_interval_s=0.0)
        conv = chat.new_conversation("smol")

        # the user's own Stop: finished as "cancelled" (the window shows "stopped"), text kept
        turn = chat.send(conv.id, "Tell a long story.", max_tokens=LONG)
        pieces = iter(turn)
        got = [next(pieces), next(pieces)]
        turn.cancel()
        got.extend(pieces)
        result = turn.result(timeout=WAIT)
        assert result.finish_reason == "cancelled"
        saved = store.message(turn.assistant_message_id)
        assert (saved.content, saved.complete, saved.stats.finish_reason) == ("".join(got), True, "cancelled")

        # the model stopped under the answer: an error with the reason, the text so far kept unfinished
        turn = chat.send(conv.id, "Another one, please.", max_tokens=LONG)
        pieces = iter(turn)
        got = [next(pieces), next(pieces)]
        _stop(stack)
        with pytest.raises(ModelUnavailableError, match="was stopped in the middle"):
            for piece in pieces:
                got.append(piece)
        saved = store.message(turn.assistant_message_id)
        assert saved.content == "".join(got) and not saved.complete
        assert saved.stats.error_code == "model_unavailable"
        # the conversation is intact and goes on (the model starts again on demand)
        assert [(m.role, m.complete) for m in store.messages(conv.id)] == [
            ("user", True),
            ("assistant", True),
            ("user", True),
            ("assistant", False),
        ]
        again = chat.regenerate(conv.id, max_tokens=4)
        assert again.result(timeout=WAIT).finish_reason == "length"
    finally:
        store.close()


def _cancelled_by_disconnect(stack: Stack) -> int:
    status = httpx.get(f"{stack.api.url}/timeshare/v1/status", timeout=WAIT).json()
    return int(status["switch_stats"]["cancelled_by_disconnect"])


@pytest.mark.slow
def test_a_client_that_stops_reading_a_stream_has_its_generation_cancelled(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ready(stack)
    monkeypatch.setattr(handlers, "SSE_WRITE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(connections, "SEND_BUFFER_BYTES", 4096)  # full after a few hundred events
    before = _cancelled_by_disconnect(stack)
    body = httpx.Request(
        "POST",
        f"{stack.api.url}/v1/completions",
        json={"model": "smol", "prompt": "Once upon a time", "max_tokens": LONG, "stream": True},
    )
    assert stack.api.port is not None
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # fills after a few events
    reader.connect(("127.0.0.1", stack.api.port))
    try:
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        content = body.read()
        reader.sendall(f"{head}Content-Length: {len(content)}\r\n\r\n".encode() + content)
        # ... and never reads: the generation (LONG tokens, no end-of-generation token possible)
        # must be cancelled once a send has waited SSE_WRITE_TIMEOUT_S, not run to its end
        wait_until(lambda: _cancelled_by_disconnect(stack) > before, 120, "the stream to be given up")
        wait_until(lambda: not stack.pool.snapshot().model("smol").busy, WAIT, "the model to be free")
        status = httpx.get(f"{stack.api.url}/timeshare/v1/status", timeout=WAIT).json()
        assert status["switch_stats"]["recent_cancel_finish_reasons"][-1] == "cancelled"
    finally:
        reader.close()
