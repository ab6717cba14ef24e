"""The worker process on the real demo models: handshake, streaming, chat formats, cancel, bad
frames, prompt too long, bad model files, SIGTERM, and with an arena: alternation, pinning,
conversations without re-prefill, KV across a stop."""

from __future__ import annotations

import dataclasses
import itertools
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _e_worker_util import WorkerHandle
from _llama_oracle import plain_completions
from _proc_util import ResidencyWatch, lease_holders, rss_of
from timeshare.core.api.dialect import reported_format
from timeshare.core.arena.arena import Arena
from timeshare.core.arena.dirs import read_holder
from timeshare.core.chatformat import format as chat_format
from timeshare.core.config.schema import ArenaConfig, ModelConfig
from timeshare.core.observe import read_events
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState, ModelStatus
from timeshare.core.wire import protocol as p

pytestmark = pytest.mark.slow

CHAT = (p.ChatMessage("user", "What is the capital of France?"),)


@pytest.fixture(scope="module")
def smol(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerHandle]:
    """One arena-less SmolLM2 worker shared by the tests that do not change its state."""
    w = WorkerHandle(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256), tmp_path_factory.mktemp("smol-worker")
    )
    w.ready()
    yield w
    w.close()


def test_handshake_and_streamed_generation(smol: WorkerHandle) -> None:
    hello = next(m for m in smol.seen if isinstance(m, p.Hello))
    assert hello.model_id == "smol" and hello.pid == smol.proc.pid and hello.version == p.PROTOCOL_VERSION
    ready = next(m for m in smol.seen if isinstance(m, p.Ready))
    assert ready.info.n_ctx == 256 and ready.info.chat_format == "template" and ready.info.n_vocab > 1000
    text, done = smol.generate("g1", prompt="Once upon a time", sampling=Sampling(max_tokens=12))
    assert isinstance(done, p.Done), done
    tokens = [m for m in smol.seen if isinstance(m, p.Token) and m.req == "g1"]
    assert len(tokens) >= 2  # streamed, not one blob
    assert text.strip() and done.finish_reason == "length"
    assert (
        done.usage.completion_tokens == 12 and done.usage.prompt_tokens_evaluated == done.usage.prompt_tokens
    )
    status = smol.status()
    assert status.state == "resident" and not status.busy and status.prompt_tokens_evaluated >= 4


def test_chat_with_the_gguf_template_is_bounded(smol: WorkerHandle) -> None:
    text, done = smol.generate("c1", messages=CHAT, sampling=Sampling(max_tokens=60))
    assert isinstance(done, p.Done), done
    assert text.strip()
    assert "<|im_end|>" not in text and "<|im_start|>" not in text
    assert done.usage.completion_tokens <= 60


def test_cancel_mid_generation_then_keeps_serving(smol: WorkerHandle) -> None:
    smol.send(
        p.Generate(
            req="long", prompt="List every number from one to a thousand:", sampling=Sampling(max_tokens=200)
        )
    )
    smol.expect(p.Token, req="long")
    smol.send(p.Cancel("long"))
    _, done = smol.collect("long")
    assert isinstance(done, p.Done) and done.finish_reason == "cancelled"
    assert done.usage.completion_tokens < 200
    # a request cancelled while queued behind another never runs
    smol.send(p.Generate(req="a", prompt="One", sampling=Sampling(max_tokens=30)))
    smol.send(p.Generate(req="b", prompt="Two", sampling=Sampling(max_tokens=30)))
    smol.send(p.Cancel("b"))
    _, done_a = smol.collect("a")
    _, done_b = smol.collect("b")
    assert isinstance(done_a, p.Done) and done_a.finish_reason == "length"
    assert isinstance(done_b, p.Done) and done_b.finish_reason == "cancelled"
    assert done_b.usage.completion_tokens == 0
    _text, done = smol.generate("after", prompt="Hello", sampling=Sampling(max_tokens=3))
    assert isinstance(done, p.Done) and done.finish_reason == "length"


def test_a_cancelled_answer_reports_the_tokens_it_generated(smol: WorkerHandle, smollm2_path: Path) -> None:
    """Stop keeps the true count (issue 43): the cancelled request's Done carries the tokens it
    generated before the cancel, its prompt and what was evaluated. The oracle: plain
    llama-cpp-python, greedy, asked for exactly that many tokens, says the text that streamed."""
    prompt = "Count slowly from one to five hundred, in words:"
    smol.send(p.Generate(req="stopped", prompt=prompt, sampling=Sampling(max_tokens=300)))
    for _ in range(3):
        smol.expect(p.Token, req="stopped")
    smol.send(p.Cancel("stopped"))
    text, done = smol.collect("stopped")
    assert isinstance(done, p.Done) and done.finish_reason == "cancelled"
    tokens = [m for m in smol.seen if isinstance(m, p.Token) and m.req == "stopped"]
    n = done.usage.completion_tokens
    assert len(tokens) <= n < 300  # not 0: what it generated before the Stop
    assert done.usage.prompt_tokens > 0
    assert done.usage.prompt_tokens_evaluated == done.usage.prompt_tokens  # a prompt new to it
    assert plain_completions(smollm2_path, [prompt], n, n_ctx=256) == [text]


def test_garbage_frames_get_error_replies_and_the_worker_keeps_serving(smol: WorkerHandle) -> None:
    body = b"\x00\xffnot json"
    smol.sock.sendall(struct.pack(">I", len(body)) + body)
    err = smol.expect(p.Error)
    assert err.code == "protocol" and "not UTF-8 JSON" in err.message and not err.fatal
    body = b'{"v": 42, "type": "Generate", "req": "old", "prompt": "x"}'
    smol.sock.sendall(struct.pack(">I", len(body)) + body)
    err = smol.expect(p.Error)
    assert err.req == "old" and "version 42 is not supported" in err.message
    body = b'{"v": 1, "type": "Generate", "req": "bad", "prompt": "x", "sampling": {"max_tokens": -5}}'
    smol.sock.sendall(struct.pack(">I", len(body)) + body)
    err = smol.expect(p.Error)
    assert err.req == "bad" and "max_tokens" in err.message
    smol.send(p.Hello(pid=1, model_id="confused"))  # an event sent the wrong way
    err = smol.expect(p.Error)
    assert "not a request" in err.message
    _, done = smol.generate("ok", prompt="Hi", sampling=Sampling(max_tokens=2))
    assert isinstance(done, p.Done)


def test_prompt_longer_than_the_context_is_an_error_and_the_worker_serves_on(smol: WorkerHandle) -> None:
    _, err = smol.generate("big", prompt="word " * 400, sampling=Sampling(max_tokens=4))
    assert isinstance(err, p.Error) and err.code == "context_length_exceeded"
    assert "shorten the prompt" in err.message and "256" in err.message
    long_chat = (p.ChatMessage("user", "word " * 400),)
    _, err = smol.generate("bigchat", messages=long_chat, conversation="x", sampling=Sampling(max_tokens=4))
    assert isinstance(err, p.Error) and err.code == "context_length_exceeded"
    _, done = smol.generate("small", prompt="Hi", sampling=Sampling(max_tokens=2))
    assert isinstance(done, p.Done)


def test_gemma_base_model_chats_in_the_fallback_format(
    gemma3_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    w = WorkerHandle(ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=512), tmp_path)
    handles.append(w)
    assert w.ready().info.chat_format == "fallback"
    text, done = w.generate("g", messages=CHAT, sampling=Sampling(max_tokens=48))
    assert isinstance(done, p.Done), done
    assert text.strip(), "a base model's answer must not be empty"
    assert "User:" not in text and "Assistant:" not in text
    assert done.usage.completion_tokens <= 48


def test_ready_reports_the_chat_format_the_api_plans_tool_calls_with(
    smollm2_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    # the API used to read the GGUF and parse its template again to learn this; now the worker
    # says it in Ready (a thinking hermes template here), and the API takes it from the status
    qwen3 = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    w = WorkerHandle(ModelConfig(id="q", path=str(smollm2_path), n_ctx=256, chat_template=qwen3), tmp_path)
    handles.append(w)
    info = w.ready().info
    expected = chat_format.of_source(qwen3)
    assert (expected.family.name, expected.thinks) == ("hermes", True)
    assert (info.chat_format, info.chat_family, info.thinks, info.starts_thinking) == (
        "template",
        "hermes",
        True,
        expected.starts_thinking,
    )
    status = ModelStatus(
        id="q",
        name="q",
        path=str(smollm2_path),
        state=ModelState.RESIDENT,
        chat_format=info.chat_format,
        chat_family=info.chat_family,
        thinks=info.thinks,
        starts_thinking=info.starts_thinking,
    )
    assert reported_format(status) == expected
    assert reported_format(dataclasses.replace(status, chat_format="")) is None  # not loaded yet


@pytest.mark.parametrize("case", ["missing", "not-gguf", "truncated"])
def test_bad_model_file_is_a_fatal_clear_error(
    case: str, smollm2_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    path = tmp_path / "model.gguf"
    if case == "not-gguf":
        path.write_bytes(b"<html>404 not found</html>" * 10)
    elif case == "truncated":
        with smollm2_path.open("rb") as src:
            path.write_bytes(src.read(5_000_000))
    w = WorkerHandle(ModelConfig(id="bad", path=str(path)), tmp_path)
    handles.append(w)
    err = w.expect(p.Error)
    assert err.fatal and err.code == "model_file"
    expected = {"missing": "does not exist", "not-gguf": "not a GGUF", "truncated": "truncated"}[case]
    assert expected in err.message and str(path) in err.message
    w.wait_eof()
    assert w.wait_exit() == 2


def test_bad_spec_is_a_fatal_clear_error(tmp_path: Path, handles: list[WorkerHandle]) -> None:
    w = WorkerHandle(
        ModelConfig(id="x", path="/nonexistent"), tmp_path, spec_override='{"model": {"idd": 1}}'
    )
    handles.append(w)
    err = w.expect(p.Error)
    assert err.fatal and err.code == "invalid_config" and "kv_dir" in err.message
    assert w.wait_exit() == 2


def test_unsyncable_stream_ends_the_session_cleanly(
    smollm2_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    w = WorkerHandle(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256), tmp_path)
    handles.append(w)
    w.ready()
    w.sock.sendall(struct.pack(">I", p.MAX_FRAME + 1) + b"junk")
    err = w.expect(p.Error)
    assert err.code == "protocol" and "over the" in err.message
    w.wait_eof()
    assert w.wait_exit() == 0


def test_truncated_frame_then_close_exits_cleanly(
    smollm2_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    w = WorkerHandle(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256), tmp_path)
    handles.append(w)
    w.ready()
    w.sock.sendall(p.encode(p.Generate(req="t", prompt="hello"))[:-5])
    w.sock.shutdown(2)
    assert w.wait_exit() == 0


# ---- with an arena ---------------------------------------------------------------------------


@pytest.fixture
def arena_dir(tmp_path: Path) -> Path:
    d = tmp_path / "arena"
    d.mkdir(mode=0o700)
    return d


def token_is_free(arena_dir: Path) -> bool:
    """No live lease on the device's budget (the GPU token of a one-model budget)."""
    arena = Arena(arena_dir)
    try:
        return not [x for x in arena.leases() if x.kind == "weights"]
    finally:
        arena.close()


def test_sigterm_releases_the_token_and_exits_zero(
    smollm2_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    w = WorkerHandle(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256), tmp_path, arena_dir=arena_dir)
    handles.append(w)
    w.ready()
    w.send(p.Wake())
    w.expect(p.WorkerStatus, holds_token=True, state="resident")
    holder = read_holder(arena_dir)
    assert holder is not None and holder.model == "smol" and holder.pid == w.proc.pid
    assert not token_is_free(arena_dir)
    w.send(p.Generate(req="long", prompt="Once upon a time", sampling=Sampling(max_tokens=200)))
    w.expect(p.Token, req="long")
    w.proc.send_signal(signal.SIGTERM)  # mid-generation
    _, done = w.collect("long")
    assert isinstance(done, p.Done) and done.finish_reason == "cancelled"
    assert w.wait_exit() == 0
    assert read_holder(arena_dir) is None
    assert token_is_free(arena_dir)


def test_two_workers_alternate_and_the_token_moves(
    smollm2_path: Path, gemma3_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    log = tmp_path / "intervals.jsonl"
    arena = ArenaConfig(min_quantum_ms=50.0, wait_timeout_s=120.0)
    a = WorkerHandle(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256),
        tmp_path / "a",
        arena_dir=arena_dir,
        arena=arena,
        event_log=log,
    )
    handles.append(a)
    a.ready()
    b = WorkerHandle(
        ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=256),
        tmp_path / "b",
        arena_dir=arena_dir,
        arena=arena,
        event_log=log,
    )
    handles.append(b)
    b.ready()
    pids = {"smol": a.proc.pid, "gemma": b.proc.pid}
    weights = {"smol": smollm2_path.stat().st_size, "gemma": gemma3_path.stat().st_size}
    watch = ResidencyWatch(arena_dir, pids).__enter__()
    # reference answers of each model, then alternate: every answer stays the same
    ref_a, done = a.generate("a0", prompt="The capital of France is", sampling=Sampling(max_tokens=8))
    assert isinstance(done, p.Done)
    resident_a = rss_of(a.proc.pid)  # a holds the token, its weights in memory
    assert lease_holders(arena_dir) == {a.proc.pid}
    ref_b, done = b.generate("b0", prompt="The capital of France is", sampling=Sampling(max_tokens=8))
    assert isinstance(done, p.Done) and done.switch.switched
    # b's Done says how long a's release for it took, a's own figure, handed over with the token
    # (a's Released after its answer a0: the one release b's request waited for)
    assert done.switch.release_ms == a.expect(p.Released).release_ms > 0
    # b took the token: a gave its weights back, as the kernel counts a's memory (the GGUF's size
    # stands for the weights: no mmap on this path, they were copied into the process)
    released = next(m for m in a.seen if isinstance(m, p.Released))
    assert lease_holders(arena_dir) == {b.proc.pid}
    freed = resident_a - rss_of(a.proc.pid)
    assert freed > weights["smol"] // 2, (freed, weights["smol"])
    assert abs(released.freed_bytes - freed) < weights["smol"] // 4, (released.freed_bytes, freed)
    for i in range(1):
        text, done = a.generate(
            f"a{i + 1}", prompt="The capital of France is", sampling=Sampling(max_tokens=8)
        )
        assert isinstance(done, p.Done) and text == ref_a and done.switch.switched
        text, done = b.generate(
            f"b{i + 1}", prompt="The capital of France is", sampling=Sampling(max_tokens=8)
        )
        assert isinstance(done, p.Done) and text == ref_b and done.switch.switched
    assert any(isinstance(m, p.Released) for m in a.seen)
    holder = read_holder(arena_dir)
    assert holder is not None and holder.model == "gemma"
    # both busy at once: they alternate at token boundaries after the quantum, and both finish
    concurrent_from = time.monotonic()  # CLOCK_MONOTONIC is shared by all processes
    a.send(p.Generate(req="ca", prompt="Once upon a time", sampling=Sampling(max_tokens=30)))
    b.send(p.Generate(req="cb", prompt="Once upon a time", sampling=Sampling(max_tokens=30)))
    _, done_a = a.collect("ca")
    _, done_b = b.collect("cb")
    assert isinstance(done_a, p.Done) and isinstance(done_b, p.Done)
    assert done_a.usage.completion_tokens >= 10 and done_b.usage.completion_tokens >= 10
    watch.__exit__()
    a.close()
    b.close()
    # weights in memory only while holding a lease, from the kernel's figures (RSS, /proc/locks)
    violations, high_seen = watch.check(weights)
    assert violations == [], violations[:5]
    assert high_seen == {"smol": True, "gemma": True}, (high_seen, len(watch.samples))
    intervals = read_events(log)
    tokens = sorted((r["start"], r["end"], r["model"]) for r in intervals if r["kind"] == "token")
    assert len({m for _, _, m in tokens}) == 2 and len(tokens) >= 4
    for (_, end, _), (start, _, _) in itertools.pairwise(tokens):
        assert end <= start  # never two holders at once
    resident = [r for r in intervals if r["kind"] == "resident"]
    for r in resident:  # weights on the device only while holding the token
        assert any(t[2] == r["model"] and t[0] <= r["start"] and r["end"] <= t[1] for t in tokens), r
    during = [t for t in tokens if t[1] > concurrent_from]
    assert len(during) >= 3, during  # the token went back and forth while both were generating


def test_pinned_holder_makes_the_other_wait_then_time_out(
    smollm2_path: Path, gemma3_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    a = WorkerHandle(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, pinned=True),
        tmp_path / "a",
        arena_dir=arena_dir,
    )
    handles.append(a)
    a.ready()
    a.send(p.Wake())
    a.expect(p.WorkerStatus, holds_token=True)
    b = WorkerHandle(
        ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=256),
        tmp_path / "b",
        arena_dir=arena_dir,
        arena=ArenaConfig(wait_timeout_s=3.0),
    )
    handles.append(b)
    # b loads under the token: it waits (loading) until a is unpinned
    waiting = b.expect(p.WorkerStatus, state="loading")
    while "pinned" not in waiting.waiting_reason:
        waiting = b.expect(p.WorkerStatus)
    assert "smol" in waiting.waiting_reason
    # the reader thread answers status from the published snapshot while the loop thread waits
    assert "pinned by smol" in b.status().waiting_reason
    a.send(p.Pin(False))
    b.ready()
    a.send(p.Pin(True))
    _, done = a.generate(
        "a1", prompt="Hello", sampling=Sampling(max_tokens=2)
    )  # a takes the token back and stays pinned
    assert isinstance(done, p.Done)
    _, err = b.generate("b1", prompt="Hello", sampling=Sampling(max_tokens=2))
    assert isinstance(err, p.Error) and err.code == "gpu_busy"
    assert "pinned" in err.message and "smol" in err.message
    assert any(isinstance(m, p.WorkerStatus) and "pinned by smol" in m.waiting_reason for m in b.seen)
    _, done = a.generate("a2", prompt="Hello", sampling=Sampling(max_tokens=2))
    assert isinstance(done, p.Done) and not done.switch.switched


def _a_wake_waiting_for_a_pinned_holder(
    smollm2_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> tuple[WorkerHandle, WorkerHandle]:
    """A worker "holder" pinned on the GPU, and a worker "waker" whose Wake waits for it (no
    timeout for ten minutes), seen waiting; returns (holder, waker)."""
    a = WorkerHandle(
        ModelConfig(id="holder", path=str(smollm2_path), n_ctx=256), tmp_path / "a", arena_dir=arena_dir
    )
    handles.append(a)
    a.ready()
    b = WorkerHandle(
        ModelConfig(id="waker", path=str(smollm2_path), n_ctx=256),
        tmp_path / "b",
        arena_dir=arena_dir,
        arena=ArenaConfig(wait_timeout_s=600.0),
    )
    handles.append(b)
    b.ready()
    assert not a.status("before-pin").pinned  # the statuses of its load are read first
    a.send(p.Pin(True))
    a.send(p.Wake())
    a.expect(p.WorkerStatus, holds_token=True, pinned=True)
    b.send(p.Wake())
    waiting = b.expect(p.WorkerStatus)
    while "pinned" not in waiting.waiting_reason or "holder" not in waiting.waiting_reason:
        waiting = b.expect(p.WorkerStatus)
    return a, b


def test_a_shutdown_ends_a_wakes_wait_for_the_token(
    smollm2_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    """A Wake (pre-warm) waiting for a pinned holder: a Shutdown ends that wait at once: the
    worker says it is shutting down and exits cleanly, and the holder was never asked to leave."""
    a, b = _a_wake_waiting_for_a_pinned_holder(smollm2_path, tmp_path, arena_dir, handles)
    b.send(p.Shutdown(save_kv=False))
    err = b.expect(p.Error)
    assert err.req is None and err.code == "model_unavailable" and not err.fatal, err
    assert "shutting down" in err.message
    assert b.wait_exit() == 0
    assert a.status().holds_token


def test_a_sleep_ends_a_wakes_wait_for_the_token(
    smollm2_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    """A Wake waiting for a pinned holder is dropped by a Sleep that comes after it: the worker
    stops waiting (no error: the user changed their mind), never takes the token, and answers
    as before; a later Wake, once the holder is unpinned, takes the GPU."""
    a, b = _a_wake_waiting_for_a_pinned_holder(smollm2_path, tmp_path, arena_dir, handles)
    b.send(p.Sleep(level="weights"))
    # the wait ended: the worker answers from its loop again, waiting for nothing, no token
    idle = b.expect(p.WorkerStatus, waiting_reason="")
    assert not idle.holds_token and not any(isinstance(m, p.Error) for m in b.seen)
    assert a.status().holds_token
    a.send(p.Pin(False))
    b.send(p.Wake())
    b.expect(p.WorkerStatus, holds_token=True)


def chat_turns(first_answer: str) -> tuple[tuple[p.ChatMessage, ...], tuple[p.ChatMessage, ...]]:
    one = (p.ChatMessage("user", "Name a fruit."),)
    two = (*one, p.ChatMessage("assistant", first_answer), p.ChatMessage("user", "And a vegetable?"))
    return one, two


def test_conversation_switch_does_not_re_prefill(
    smollm2_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    w = WorkerHandle(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512), tmp_path, arena_dir=arena_dir)
    handles.append(w)
    w.ready()
    text1, d1 = w.generate(
        "c1-1", messages=chat_turns("")[0], conversation="c1", sampling=Sampling(max_tokens=20)
    )
    assert isinstance(d1, p.Done)
    other = (p.ChatMessage("system", "You are terse."), p.ChatMessage("user", "Say something else entirely."))
    _, d_other = w.generate("c2-1", messages=other, conversation="c2", sampling=Sampling(max_tokens=20))
    assert isinstance(d_other, p.Done)
    assert set(w.status().live_conversations) == {"c1", "c2"}
    _, d2 = w.generate(
        "c1-2", messages=chat_turns(text1)[1], conversation="c1", sampling=Sampling(max_tokens=20)
    )
    assert isinstance(d2, p.Done)
    # only the new turn is prefilled, although another conversation used the context in between
    assert 0 < d2.usage.prompt_tokens_evaluated <= d2.usage.prompt_tokens - d1.usage.prompt_tokens
    # the other conversation (its own system prompt) was prefilled nearly whole
    assert d_other.usage.prompt_tokens_evaluated > d_other.usage.prompt_tokens // 2


def test_stop_saves_kv_and_a_new_worker_continues_without_re_prefill(
    smollm2_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    model = ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512)
    kv = tmp_path / "kv"
    w = WorkerHandle(model, tmp_path / "first", arena_dir=arena_dir, kv_dir=kv)
    handles.append(w)
    w.ready()
    text1, d1 = w.generate(
        "t1", messages=chat_turns("")[0], conversation="conv", sampling=Sampling(max_tokens=20)
    )
    assert isinstance(d1, p.Done)
    w.send(p.Shutdown(save_kv=True))
    assert w.wait_exit() == 0
    assert [f.name.startswith("smol-") for f in kv.iterdir()] == [True]
    w2 = WorkerHandle(model, tmp_path / "second", arena_dir=arena_dir, kv_dir=kv)
    handles.append(w2)
    w2.ready()
    _, d2 = w2.generate(
        "t2", messages=chat_turns(text1)[1], conversation="conv", sampling=Sampling(max_tokens=20)
    )
    assert isinstance(d2, p.Done)
    assert 0 < d2.usage.prompt_tokens_evaluated <= d2.usage.prompt_tokens - d1.usage.prompt_tokens
    assert w2.status().prompt_tokens_evaluated == d2.usage.prompt_tokens_evaluated


def test_sleep_and_wake(
    smollm2_path: Path, tmp_path: Path, arena_dir: Path, handles: list[WorkerHandle]
) -> None:
    w = WorkerHandle(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256), tmp_path, arena_dir=arena_dir)
    handles.append(w)
    w.ready()
    ref, _ = w.generate("r0", messages=CHAT, conversation="s", sampling=Sampling(max_tokens=10))
    w.send(p.Sleep("weights+kv"))
    released = w.expect(p.Released)
    assert released.level == "weights+kv"
    w.expect(p.WorkerStatus, state="sleeping", holds_token=False)
    assert token_is_free(arena_dir)
    w.send(p.Wake())
    w.expect(p.WorkerStatus, holds_token=True, state="resident")
    again, done = w.generate("r1", messages=CHAT, conversation="s", sampling=Sampling(max_tokens=10))
    assert isinstance(done, p.Done) and again == ref
    assert done.usage.prompt_tokens_evaluated <= 1  # the conversation's KV survived the sleep
    # yield, then sleep deeper while released, then stop: the conversation still reaches the disk
    w.send(p.Sleep("weights"))
    w.expect(p.WorkerStatus, state="released", holds_token=False)
    w.send(p.Sleep("weights+kv"))
    w.expect(p.WorkerStatus, state="sleeping")
    w.send(p.Shutdown(save_kv=True))
    assert w.wait_exit() == 0
    assert len(list(w.kv_dir.glob("smol-*.kv"))) == 1
