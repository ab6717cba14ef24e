"""ChatService: messages saved before, during and after generation; history from the store.

Two halves. The first drives ChatService with ``ScriptedPool``, a fake pool whose generations
hand out pieces only when the test says so and can fail on cue: that is the only way to look at
the store *while* an answer streams and to make a worker fail at an exact point, every time. The
second half runs the same service on the real Pool with a real SmolLM2 worker: no re-prefill of a
continued conversation, and a worker killed mid-answer losing nothing that was saved.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from timeshare.core.conversations.chat import ChatService
from timeshare.core.conversations.store import Store
from timeshare.core.errors import (
    ConversationBusyError,
    EmptyMessageError,
    ModelUnavailableError,
    TimeshareError,
    UnknownConversationError,
    UnknownModelError,
)
from timeshare.core.sampling import Sampling
from timeshare.core.state import SwitchStats
from timeshare.core.util.stream import TextStream
from timeshare.core.wire.protocol import ChatMessage, Usage

WAIT = 120.0  # an upper bound for waits on a loaded 2-core machine; nothing is timed


def wait_until(pred: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# ---- the scripted fake pool ----------------------------------------------------------------


@dataclass(frozen=True)
class FakeResult:
    finish_reason: str
    usage: Usage
    switch: SwitchStats
    stop: str = ""


class ScriptedGeneration:
    """Pieces are released by the test (``feed``); ``finish`` or ``fail`` ends the stream."""

    def __init__(self, model_id: str, kwargs: dict[str, Any]) -> None:
        self.model_id = model_id
        self.kwargs = kwargs
        self._stream = TextStream()
        self._result: FakeResult | None = None
        self.cancelled = False
        self._pieces = 0

    # test side
    def feed(self, *pieces: str) -> None:
        for p in pieces:
            self._pieces += 1
            self._stream.put(p)

    def finish(self, finish_reason: str = "stop", switched: bool = True) -> None:
        # a cancelled request's usage counts what it generated, as the worker reports it
        # (core/worker/loop.py: _apply_cancels); here a token per piece
        n = self._pieces
        usage = Usage(
            prompt_tokens=20 if n else 0, completion_tokens=n, prompt_tokens_evaluated=7 if n else 0
        )
        self._result = FakeResult(finish_reason, usage, SwitchStats(switched, wait_ms=3.0, restore_ms=2.0))
        self._stream.close()

    def fail(self, error: TimeshareError) -> None:
        self._stream.close(error)

    # pool side (the Generation API of core/pool.py)
    def __iter__(self) -> Iterator[str]:
        return iter(self._stream)

    def cancel(self) -> None:
        self.cancelled = True
        self.finish("cancelled")

    def result(self, timeout: float | None = None) -> FakeResult:
        assert self._stream.wait(timeout)
        if self._stream.error is not None:
            raise self._stream.error
        assert self._result is not None
        return self._result


class ScriptedPool:
    def __init__(self, models: Sequence[str] = ("smol",)) -> None:
        self.models = set(models)
        self.generations: list[ScriptedGeneration] = []

    def generate(self, model_id: str, *, sampling: Sampling, **kwargs: Any) -> ScriptedGeneration:
        if model_id not in self.models:
            raise UnknownModelError(f"there is no model {model_id!r}")
        # recorded flat: the conversation's two settings, and whatever else differs from the defaults
        kwargs["max_tokens"], kwargs["temperature"] = sampling.max_tokens, sampling.temperature
        kwargs.update(
            (k, v) for k, v in msgspec.structs.asdict(sampling).items() if v != getattr(Sampling(), k)
        )
        gen = ScriptedGeneration(model_id, kwargs)
        self.generations.append(gen)
        return gen


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "conv.sqlite3")
    yield s
    s.close()


def contents(store: Store, conv_id: str) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.complete) for m in store.messages(conv_id)]


# ---- with the scripted pool ----------------------------------------------------------------


def test_messages_are_saved_before_during_and_after_generation(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store, flush_interval_s=0.0)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "Hello there", max_tokens=32, temperature=0.5)
    (gen,) = pool.generations
    # before the first token: the user's message and an empty, unfinished answer are on disk
    assert contents(store, conv.id) == [("user", "Hello there", True), ("assistant", "", False)]
    assert gen.kwargs == {
        "messages": (ChatMessage("user", "Hello there"),),
        "conversation": conv.id,
        "max_tokens": 32,
        "temperature": 0.5,
    }
    # while streaming: the partial text is saved
    gen.feed("Hi", "!")
    pieces = iter(turn)
    assert [next(pieces), next(pieces)] == ["Hi", "!"]
    wait_until(lambda: store.message(turn.assistant_message_id).content == "Hi!", "the partial answer")
    assert not store.message(turn.assistant_message_id).complete
    # at the end: complete, with its stats
    gen.feed(" How")
    gen.finish()
    assert list(pieces) == [" How"]
    result = turn.result(timeout=WAIT)
    assert result.text == "Hi! How" and result.finish_reason == "stop"
    saved = store.message(turn.assistant_message_id)
    assert (saved.content, saved.complete) == ("Hi! How", True)
    stats = saved.stats
    assert stats is not None and stats == result.stats  # read back from the store as it was saved
    assert stats.finish_reason == "stop"
    assert stats.completion_tokens == 3 and stats.prompt_tokens == 20
    assert stats.prompt_tokens_evaluated == 7
    assert stats.switched is True and stats.wait_ms == 3.0 and stats.restore_ms == 2.0
    assert stats.ttft_ms is not None and stats.ttft_ms >= 0
    assert stats.tokens_per_s >= 0 and stats.model_id == "smol"
    assert not stats.prewoken and stats.error == ""
    assert store.get(conv.id).title == "Hello there"  # titled from the first message


def test_partial_text_is_flushed_periodically_not_per_token(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store, flush_interval_s=3600.0)  # never within this test
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "hi")
    gen = pool.generations[0]
    gen.feed("a", "b", "c")
    it = iter(turn)
    assert [next(it) for _ in range(3)] == ["a", "b", "c"]
    assert store.message(turn.assistant_message_id).content == ""  # not yet: the interval has not passed
    gen.finish()
    turn.result(timeout=WAIT)
    assert store.message(turn.assistant_message_id).content == "abc"


def test_the_model_sees_the_stored_history(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store, system_prompt="Be brief.")
    conv = chat.new_conversation("smol", "kept title")
    first = chat.send(conv.id, "one")
    pool.generations[0].feed("uno")
    pool.generations[0].finish()
    first.result(timeout=WAIT)
    second = chat.send(conv.id, "two")
    assert pool.generations[1].kwargs["messages"] == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "one"),
        ChatMessage("assistant", "uno"),
        ChatMessage("user", "two"),
    )
    assert store.get(conv.id).title == "kept title"
    pool.generations[1].finish()
    second.result(timeout=WAIT)


def test_the_conversations_settings_make_its_answers(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store, system_prompt="Be brief.")
    conv = chat.new_conversation("smol")
    # the defaults: greedy, a finite length limit, no repetition guard, the service's system prompt
    first = chat.send(conv.id, "one")
    assert pool.generations[0].kwargs["temperature"] == 0.0
    assert pool.generations[0].kwargs["max_tokens"] == 1024
    assert "repeat_penalty" not in pool.generations[0].kwargs  # Sampling's default: off
    assert pool.generations[0].kwargs["messages"][0] == ChatMessage("system", "Be brief.")
    pool.generations[0].feed("uno")
    pool.generations[0].finish()
    first.result(timeout=WAIT)
    store.set_options(conv.id, system_prompt="Answer in French.", temperature=0.8, max_tokens=64)
    second = chat.send(conv.id, "two")
    kwargs = pool.generations[1].kwargs
    assert (kwargs["temperature"], kwargs["max_tokens"]) == (0.8, 64)
    assert kwargs["messages"][0] == ChatMessage("system", "Answer in French.")
    assert chat.model_messages(conv.id)[0] == ChatMessage("system", "Answer in French.")
    pool.generations[1].finish()
    second.result(timeout=WAIT)
    # regenerate uses them too; a value given by the caller wins
    third = chat.regenerate(conv.id, max_tokens=8)
    kwargs = pool.generations[2].kwargs
    assert (kwargs["temperature"], kwargs["max_tokens"]) == (0.8, 8)
    assert kwargs["messages"][0] == ChatMessage("system", "Answer in French.")
    pool.generations[2].finish()
    third.result(timeout=WAIT)


def test_the_stop_string_that_ended_an_answer_is_saved(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "hello")
    gen = pool.generations[0]
    gen._result = FakeResult("stop", Usage(5, 0, 5), SwitchStats(False), stop="\nUser:")
    gen._stream.close()  # the model stopped at once
    result = turn.result(timeout=WAIT)
    assert (result.text, result.stats.stop) == ("", "\nUser:")
    assert store.message(turn.assistant_message_id).stats.stop == "\nUser:"  # type: ignore[union-attr]


def test_a_failure_mid_answer_keeps_the_partial_text_and_regenerate_answers_again(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store, flush_interval_s=0.0)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "tell me a story")
    gen = pool.generations[0]
    gen.feed("Once", " upon")
    gen.fail(ModelUnavailableError("smol crashed while answering; it is being restarted"))
    streamed: list[str] = []
    with pytest.raises(ModelUnavailableError, match="crashed while answering"):
        for piece in turn:
            streamed.append(piece)
    assert streamed == ["Once", " upon"]
    with pytest.raises(ModelUnavailableError):
        turn.result(timeout=WAIT)
    msgs = store.messages(conv.id)
    assert [(m.role, m.content, m.complete) for m in msgs] == [
        ("user", "tell me a story", True),
        ("assistant", "Once upon", False),
    ]
    failed = msgs[1].stats
    assert failed is not None and failed.finish_reason == "error"
    assert failed.error_code == "model_unavailable"
    assert "crashed while answering" in failed.error

    again = chat.regenerate(conv.id)
    assert pool.generations[1].kwargs["messages"] == (ChatMessage("user", "tell me a story"),)
    pool.generations[1].feed("Fine.")
    pool.generations[1].finish()
    again.result(timeout=WAIT)
    assert contents(store, conv.id) == [("user", "tell me a story", True), ("assistant", "Fine.", True)]


def test_a_refused_request_keeps_the_users_message(store: Store) -> None:
    pool = ScriptedPool(models=())
    chat = ChatService(pool, store)
    conv = chat.new_conversation("gone-model")
    with pytest.raises(UnknownModelError):
        chat.send(conv.id, "anyone there?")
    # nothing generated: no empty answer left behind, but the user's text is not lost
    assert contents(store, conv.id) == [("user", "anyone there?", True)]
    pool.models.add("gone-model")
    turn = chat.regenerate(conv.id)
    pool.generations[0].feed("yes")
    pool.generations[0].finish()
    assert turn.result(timeout=WAIT).text == "yes"


def test_bad_input_is_refused_and_saves_nothing(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol")
    with pytest.raises(EmptyMessageError, match="type something"):
        chat.send(conv.id, "   \n")
    with pytest.raises(TypeError, match=r"unknown sampling option\(s\) \['temprature'\]"):
        chat.send(conv.id, "hi", temprature=0.2)
    with pytest.raises(UnknownConversationError, match="start a new one"):
        chat.send("no-such-conversation", "hi")
    with pytest.raises(EmptyMessageError, match="no message to answer"):
        chat.regenerate(conv.id)
    assert store.messages(conv.id) == []
    assert pool.generations == []


def test_one_answer_at_a_time_per_conversation(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol")
    other = chat.new_conversation("smol")
    turn = chat.send(conv.id, "first")
    with pytest.raises(ConversationBusyError, match="still answering"):
        chat.send(conv.id, "second")
    assert chat.active_turn(conv.id) is turn
    other_turn = chat.send(other.id, "elsewhere")  # other conversations are not blocked
    pool.generations[0].finish()
    turn.result(timeout=WAIT)
    assert chat.active_turn(conv.id) is None
    second = chat.send(conv.id, "second")
    assert [m.content for m in store.messages(conv.id) if m.role == "user"] == ["first", "second"]
    for gen in pool.generations[1:]:
        gen.finish()
    other_turn.result(timeout=WAIT)
    second.result(timeout=WAIT)


def test_simultaneous_sends_to_one_conversation_start_one_answer(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol")
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def send(i: int) -> None:
        barrier.wait()
        try:
            chat.send(conv.id, f"message {i}")
            outcomes.append("sent")
        except ConversationBusyError:
            outcomes.append("busy")

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["busy"] * 7 + ["sent"]
    assert [m.role for m in store.messages(conv.id)] == ["user", "assistant"]
    pool.generations[0].finish()
    turn = chat.active_turn(conv.id)
    assert turn is not None
    turn.result(timeout=WAIT)


def test_cancel_keeps_the_text_so_far(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "go")
    pool.generations[0].feed("part", "ial")
    stream = iter(turn)
    assert next(stream) + next(stream) == "partial"
    turn.cancel()
    result = turn.result(timeout=WAIT)
    assert pool.generations[0].cancelled
    assert (result.text, result.finish_reason) == ("partial", "cancelled")
    saved = store.message(turn.assistant_message_id)
    assert (saved.content, saved.complete, saved.stats.finish_reason) == ("partial", True, "cancelled")
    # Stop keeps the count the worker reports for the cancelled request
    assert result.stats.completion_tokens == saved.stats.completion_tokens == 2


@pytest.mark.parametrize("switched", [False, True])
def test_a_prewoken_answer_says_so_unless_it_switched_anyway(store: Store, switched: bool) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "go", prewoken=True)
    pool.generations[0].feed("ok")
    pool.generations[0].finish(switched=switched)
    stats = turn.result(timeout=WAIT).stats
    assert (stats.switched, stats.prewoken) == (switched, not switched)
    assert store.message(turn.assistant_message_id).stats == stats


def test_after_a_restart_the_conversation_continues_from_the_store(tmp_path: Path) -> None:
    path = tmp_path / "conv.sqlite3"
    with Store(path) as store:
        conv = store.create_conversation("smol", "t")
        store.add_message(conv.id, "user", "q1")
        store.add_message(conv.id, "assistant", "half an ans", complete=False)  # the app died here
        store.add_message(conv.id, "user", "q2")
        store.add_message(conv.id, "assistant", "", complete=False)  # and here, before any token
    with Store(path) as store:  # the app again: a new store, a new service, a new pool
        pool = ScriptedPool()
        chat = ChatService(pool, store)
        turn = chat.regenerate(conv.id)
        assert pool.generations[0].kwargs["messages"] == (
            ChatMessage("user", "q1"),
            ChatMessage("assistant", "half an ans"),
            ChatMessage("user", "q2"),
        )
        pool.generations[0].finish()
        turn.result(timeout=WAIT)
        assert [m.role for m in store.messages(conv.id)] == ["user", "assistant", "user", "assistant"]


def test_deleting_the_conversation_while_it_answers_does_not_crash_the_pump(store: Store) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store, flush_interval_s=0.0)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "hi")
    store.delete(conv.id)
    pool.generations[0].feed("x")
    pool.generations[0].finish()
    with pytest.raises(TimeshareError, match="there is no message"):
        turn.result(timeout=WAIT)


# ---- with the real pool and a real worker --------------------------------------------------


@pytest.fixture(scope="module")
def real_pool(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Any]:
    from timeshare.core.config.schema import ArenaConfig, Config, ModelConfig
    from timeshare.core.pool.supervisor import Pool

    home = tmp_path_factory.mktemp("chat-pool")
    config = Config(
        models=(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=1024, idle_sleep_s=None),),
        arena=ArenaConfig(min_quantum_ms=0.0, wait_timeout_s=WAIT),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIMESHARE_HOME", str(home))
        pool = Pool(config, arena_dir=home / "arena", log_dir=home / "log", kv_dir=home / "kv")
        pool.start()
        try:
            pool.wait_ready(timeout=WAIT)
            yield pool
        finally:
            pool.stop()


@pytest.mark.slow
def test_real_pool_continues_a_conversation_without_prefilling_it_again(real_pool: Any, store: Store) -> None:
    chat = ChatService(real_pool, store)
    conv = chat.new_conversation("smol")
    first = chat.send(conv.id, "What is the capital of France?", max_tokens=16)
    streamed = "".join(first)
    r1 = first.result(timeout=WAIT)
    assert streamed == r1.text and r1.text.strip()
    assert r1.stats.prompt_tokens_evaluated == r1.stats.prompt_tokens > 0

    second = chat.send(conv.id, "And of Italy?", max_tokens=16)
    r2 = second.result(timeout=WAIT)
    assert r2.text.strip()
    # the worker kept the conversation's KV sequence: only the new turn was evaluated
    # (a full re-prefill would evaluate all of r2's prompt_tokens)
    assert 0 < r2.stats.prompt_tokens_evaluated <= r2.stats.prompt_tokens - r1.stats.prompt_tokens
    saved = store.messages(conv.id)
    assert [(m.role, m.complete) for m in saved] == [
        ("user", True),
        ("assistant", True),
        ("user", True),
        ("assistant", True),
    ]
    assert [m.content for m in saved if m.role == "assistant"] == [r1.text, r2.text]


@pytest.mark.slow
def test_real_worker_killed_mid_answer_loses_nothing_saved(real_pool: Any, store: Store) -> None:
    chat = ChatService(real_pool, store, flush_interval_s=0.0)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "Count from 1 to 1000, separated by commas.", max_tokens=2000)
    pieces = iter(turn)
    got = [next(pieces) for _ in range(3)]
    pid = real_pool.snapshot().model("smol").pid
    # saved as it streams: the first pieces are in the store (the answer goes on meanwhile, so the
    # saved text only starts with them by the time this looks)
    wait_until(
        lambda: store.message(turn.assistant_message_id).content.startswith("".join(got)),
        "the partial answer",
    )
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ModelUnavailableError):
        for piece in pieces:
            got.append(piece)
    user, answer = store.messages(conv.id)
    assert (user.content, user.complete) == ("Count from 1 to 1000, separated by commas.", True)
    # everything streamed before the crash was saved (flush on every piece here), marked unfinished
    assert answer.content == "".join(got) and not answer.complete
    assert answer.stats.error_code == "model_unavailable"

    # the pool restarts the worker; the conversation goes on from the store
    real_pool.wait_ready(timeout=WAIT)
    again = chat.regenerate(conv.id, max_tokens=8)
    assert again.result(timeout=WAIT).text
    assert [m.role for m in store.messages(conv.id)] == ["user", "assistant"]
    assert store.messages(conv.id)[1].complete


@pytest.mark.slow
def test_real_pool_cancel_keeps_what_was_streamed(real_pool: Any, store: Store) -> None:
    from timeshare.core.state import EventKind

    done: list[dict[str, Any]] = []
    unsubscribe = real_pool.subscribe(
        lambda e: done.append(dict(e.extra)) if e.kind == EventKind.REQUEST_DONE else None
    )
    chat = ChatService(real_pool, store)
    conv = chat.new_conversation("smol")
    turn = chat.send(conv.id, "Write a long story about a lighthouse keeper.", max_tokens=1500)
    pieces = iter(turn)
    got = [next(pieces), next(pieces)]
    turn.cancel()
    got.extend(pieces)  # whatever was already on its way
    result = turn.result(timeout=WAIT)
    # the pool publishes the worker's REQUEST_DONE on its event thread, which may come a moment
    # after the turn's result: wait for it rather than reading the list at once (flaky under load)
    wait_until(
        lambda: any(e.get("finish_reason") == "cancelled" for e in done),
        "the worker's cancelled REQUEST_DONE",
    )
    unsubscribe()
    assert result.finish_reason == "cancelled"
    assert result.text == "".join(got)
    saved = store.message(turn.assistant_message_id)
    assert (saved.content, saved.complete, saved.stats.finish_reason) == (result.text, True, "cancelled")
    # Stop keeps the true count: the tokens the worker generated before it (not "0 tokens" after
    # a Stop, nor the pieces counted); tests/test_worker.py checks that count against llama.cpp
    (worker_said,) = [e for e in done if e.get("finish_reason") == "cancelled"]
    assert saved.stats.completion_tokens == worker_said["completion_tokens"] >= len(got) >= 2
    assert saved.stats.prompt_tokens == worker_said["prompt_tokens"] > 0
    # the model is free again at once
    assert chat.send(conv.id, "Thanks.", max_tokens=4).result(timeout=WAIT).finish_reason in (
        "stop",
        "length",
    )


def test_a_base_models_conversation_has_a_limit_and_a_repetition_guard_and_no_limit_stays_none(
    store: Store,
) -> None:
    pool = ScriptedPool()
    chat = ChatService(pool, store)
    conv = chat.new_conversation("smol", base_model=True)
    first = chat.send(conv.id, "The capital of France is")
    kwargs = pool.generations[0].kwargs
    assert kwargs["max_tokens"] == 200 and kwargs["repeat_penalty"] == 1.3
    pool.generations[0].finish()
    first.result(timeout=WAIT)
    store.set_options(conv.id, max_tokens=0)  # "no limit" in Answer settings
    second = chat.send(conv.id, "more")
    assert pool.generations[1].kwargs["max_tokens"] is None
    pool.generations[1].finish()
    second.result(timeout=WAIT)
