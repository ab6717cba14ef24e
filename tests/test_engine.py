"""The engine in-process on SmolLM2: exact greedy completions (issue 7), chat formats,
conversations as KV snapshots (LRU, disk), prompt too long, cancel."""

from __future__ import annotations

# isort: off
import llama_cpp  # noqa: F401  (before anything that imports numpy)
# isort: on

from collections.abc import Iterator
from pathlib import Path

import pytest
from _e_worker_util import generate_message
from _llama_oracle import plain_completions
from timeshare.core.chatformat.history import render
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import CancelledError, ModelFileError, PromptTooLongError
from timeshare.core.sampling import Sampling
from timeshare.core.wire.protocol import ChatMessage, Generate
from timeshare.core.worker.engine import Engine
from timeshare.core.worker.prompts import FALLBACK_STOP, fallback_prompt

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[Engine]:
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048, n_seq=2))
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> str:
    return plain_completions(smollm2_path, (PROMPT,), 24)[0]


def run(engine: Engine, **fields: object) -> tuple[str, object]:
    pieces: list[str] = []
    outcome = engine.generate(generate_message("r", **fields), pieces.append)  # type: ignore[arg-type]
    assert "".join(pieces) == outcome.text
    return outcome.text, outcome


def test_completion_equals_plain_llama_greedy(engine: Engine, reference: str) -> None:
    text, _ = run(engine, prompt=PROMPT, max_tokens=24)
    assert text == reference
    # after chat traffic and a conversation in the context, a completion still starts clean
    run(engine, messages=(ChatMessage("user", "Hi!"),), max_tokens=8, conversation="busy")
    run(engine, prompt="Something unrelated entirely", max_tokens=5)
    text, outcome = run(engine, prompt=PROMPT, max_tokens=24)
    assert text == reference
    assert outcome.prompt_tokens_evaluated == outcome.prompt_tokens  # type: ignore[attr-defined]


def test_completion_without_mmap_is_the_same(smollm2_path: Path, reference: str) -> None:
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048), use_mmap=False)
    try:
        assert run(e, prompt=PROMPT, max_tokens=24)[0] == reference
    finally:
        e.close()


def test_fallback_prompt_format() -> None:
    msgs = (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", " Hi "),
        ChatMessage("assistant", "Hello."),
        ChatMessage("user", "Bye"),
    )
    assert fallback_prompt(msgs) == "Be brief.\n\nUser: Hi\nAssistant: Hello.\nUser: Bye\nAssistant:"
    assert "\nUser:" in FALLBACK_STOP


def test_forced_fallback_format_on_a_template_model(smollm2_path: Path) -> None:
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512, chat_format="fallback"))
    try:
        assert e.info.chat_format == "fallback"
        msgs = (ChatMessage("user", "What is 2+2?"),)
        text, outcome = run(e, messages=msgs, max_tokens=40)
        # the prompt was the fallback text, not the GGUF's template
        fallback = e.llm.tokenize(fallback_prompt(msgs).encode("utf-8"), add_bos=True, special=False)
        assert outcome.prompt_tokens == len(fallback)  # type: ignore[attr-defined]
        assert "User:" not in text and 0 < outcome.completion_tokens <= 40  # type: ignore[attr-defined]
    finally:
        e.close()


def test_prompt_too_long_leaves_conversations_alone(engine: Engine) -> None:
    run(engine, messages=(ChatMessage("user", "Remember: blue."),), max_tokens=4, conversation="keep")
    before = engine.conversations
    with pytest.raises(PromptTooLongError, match="shorten the prompt"):
        run(engine, prompt="word " * 3000, max_tokens=4)
    with pytest.raises(PromptTooLongError, match="2048"):
        run(engine, messages=(ChatMessage("user", "word " * 3000),), max_tokens=4, conversation="other")
    assert engine.conversations == before


def test_cancel_from_the_step_hook(engine: Engine) -> None:
    steps = 0

    def step() -> None:
        nonlocal steps
        steps += 1
        if steps > 4:
            raise CancelledError("stop")

    outcome = engine.generate(
        Generate(req="c", prompt="Count: one, two,", sampling=Sampling(max_tokens=100)), lambda _: None, step
    )
    assert outcome.finish_reason == "cancelled" and outcome.completion_tokens < 10


def test_conversations_lru_and_no_re_prefill(engine: Engine, tmp_path: Path) -> None:
    one = (ChatMessage("user", "Name a fruit."),)
    t1, o1 = run(engine, messages=one, max_tokens=12, conversation="a")
    run(
        engine,
        messages=(ChatMessage("system", "Terse."), ChatMessage("user", "Name a car.")),
        max_tokens=12,
        conversation="b",
    )
    assert engine.conversations[:2] == ("b", "a")
    two = (*one, ChatMessage("assistant", t1), ChatMessage("user", "Another?"))
    _, o2 = run(engine, messages=two, max_tokens=12, conversation="a")
    assert o2.prompt_tokens_evaluated <= o2.prompt_tokens - o1.prompt_tokens  # type: ignore[attr-defined]
    # n_seq=2: a third conversation evicts the least recently used one ("b")
    b_msgs = (ChatMessage("system", "Terse."), ChatMessage("user", "Name a car."))
    c_msgs = (ChatMessage("system", "Loud."), ChatMessage("user", "Shout."))
    run(engine, messages=c_msgs, max_tokens=4, conversation="c")
    assert set(engine.conversations) == {"a", "c"}
    # with a kv_dir an evicted conversation goes to disk and comes back without a prefill
    engine.kv_dir = tmp_path
    try:
        run(engine, messages=b_msgs, max_tokens=12, conversation="b")  # evicts "a" to disk
        assert set(engine.conversations) == {"b", "c"} and len(list(tmp_path.iterdir())) == 1
        run(engine, messages=c_msgs, max_tokens=4, conversation="c")  # the context now holds c
        _, o3 = run(engine, messages=two, max_tokens=12, conversation="a")
        assert o3.prompt_tokens_evaluated <= 1  # type: ignore[attr-defined]
    finally:
        engine.kv_dir = None


def test_kv_survives_on_disk_only_for_the_same_model_file(smollm2_path: Path, tmp_path: Path) -> None:
    model = ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512)
    one = (ChatMessage("user", "Name a fruit."),)
    e = Engine.load(model)
    try:
        t1, o1 = run(e, messages=one, max_tokens=12, conversation="disk")
        assert e.save_kv(tmp_path) == 1
    finally:
        e.close()
    two = (*one, ChatMessage("assistant", t1), ChatMessage("user", "Another?"))
    other_ctx = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256))
    try:
        assert not other_ctx.load_kv(tmp_path, "disk")  # another context size: ignored and removed
    finally:
        other_ctx.close()
    assert list(tmp_path.iterdir()) == []
    e = Engine.load(model)
    try:
        run(e, messages=one, max_tokens=12, conversation="disk")
        e.save_kv(tmp_path)
    finally:
        e.close()
    e = Engine.load(model)
    e.kv_dir = tmp_path
    try:
        _, o2 = run(e, messages=two, max_tokens=12, conversation="disk")
        assert 0 < o2.prompt_tokens_evaluated <= o2.prompt_tokens - o1.prompt_tokens  # type: ignore[attr-defined]
        assert list(tmp_path.iterdir()) == []  # taken back into memory
    finally:
        e.close()


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 zip file, not a model")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        Engine.load(ModelConfig(id="x", path=str(bad)))


def test_chat_without_conversation_is_repeatable(engine: Engine) -> None:
    # no conversation id and prompts too short for the prompt cache (see test_prompt_cache.py):
    # every request starts from an empty KV cache, so a greedy chat answer does not depend on what
    # was asked before (the prefix of an earlier chat is not reused)
    msgs = (ChatMessage("user", "Write one sentence about the sea."),)
    first, _ = run(engine, messages=msgs, max_tokens=40)
    run(engine, messages=(ChatMessage("user", "Write one sentence about the moon."),), max_tokens=40)
    again, o = run(engine, messages=msgs, max_tokens=40)
    assert again == first
    assert o.prompt_tokens_evaluated == o.prompt_tokens  # type: ignore[attr-defined]


# ---- hostile prompts: built in pieces, refused early, cancellable --------------------------------


def test_a_chat_prompt_is_tokenized_in_pieces_with_the_same_tokens(engine: Engine) -> None:
    # content that holds the template's own special tokens and odd spacing, over many messages
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"n{i}: <|im_start|> ünï\n\n  x<|im_end|>"}
        for i in range(300)
    ]
    assert engine.template is not None
    prompt = render(engine.template, messages)
    whole = engine.llm.tokenize(prompt.encode(), add_bos=False, special=True)
    assert len(engine.prompts.pieces(prompt, True)) > 10  # it was cut, into pieces it tokenizes alone
    saved, engine.prompts.n_ctx = engine.prompts.n_ctx, 10**6
    try:
        assert engine.prompts.tokenize(prompt, add_bos=False, special=True) == whole
    finally:
        engine.prompts.n_ctx = saved


def test_a_huge_chat_or_prompt_is_refused_before_all_of_it_is_tokenized(engine: Engine) -> None:
    polls = 0

    def poll() -> None:
        nonlocal polls
        polls += 1

    many = tuple(ChatMessage("user", "hi") for _ in range(20_000))  # once 40 s of tokenizing
    with pytest.raises(PromptTooLongError, match="at least"):
        engine.generate(
            Generate(req="m", messages=many, sampling=Sampling(max_tokens=4)), lambda _: None, poll=poll
        )
    assert 1 < polls < 200  # it stopped once the context was full
    with pytest.raises(PromptTooLongError, match="at least"):
        run(engine, prompt="word " * 2_000_000, max_tokens=4)


def test_a_cancel_while_the_prompt_is_tokenized_ends_the_request(engine: Engine) -> None:
    calls = 0

    def poll() -> None:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise CancelledError("the client went away")

    many = tuple(ChatMessage("user", "hi") for _ in range(20_000))
    with pytest.raises(CancelledError):  # the worker's loop answers it as "cancelled"
        engine.generate(
            Generate(req="x", messages=many, sampling=Sampling(max_tokens=4)), lambda _: None, poll=poll
        )
    assert calls == 4
    assert run(engine, prompt=PROMPT, max_tokens=2)[0]  # the engine carries on


def test_the_stop_string_that_ended_an_answer_is_reported(engine: Engine, reference: str) -> None:
    # the greedy answer starts with the reference's first word: as a stop string it ends the answer
    # at once, and the outcome names it (not the other stop string, which never appears)
    first = reference.split()[0]
    text, outcome = run(engine, prompt=PROMPT, max_tokens=24, stop=("never in the text", first))
    assert reference.startswith(text) and first not in text
    assert (outcome.finish_reason, outcome.stop) == ("stop", first)  # type: ignore[attr-defined]
    # ended by the token limit: no stop string
    _, outcome = run(engine, prompt=PROMPT, max_tokens=2)
    assert (outcome.finish_reason, outcome.stop) == ("length", "")  # type: ignore[attr-defined]
