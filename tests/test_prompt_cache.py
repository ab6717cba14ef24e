"""The prompt cache: requests without the `conversation` extension reuse the longest cached prefix.

Engine-level tests on SmolLM2 (growing chats and prompts, interleaved chats, divergence, the
similarity rule, `cache_prompt`, bounded memory, disk), Gemma-3-270M's sliding window, and a real
`timeshare serve` driven by the official `openai` client (usage, a GPU switch, sleep and stop)."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from _api_util import GEMMA, SMOL, Served, serving_demo_models
from _e_worker_util import generate_message
from timeshare.core.config.schema import ModelConfig
from timeshare.core.wire.protocol import ChatMessage
from timeshare.core.worker.decode import common_prefix
from timeshare.core.worker.engine import Engine, GenerationOutcome
from timeshare.core.worker.sequences import BRANCH_MIN_FRACTION, PROMPT_CACHE_MIN_TOKENS

SYSTEM = (
    "You are the assistant of a small bakery in a quiet town. The bakery opens at seven in the "
    "morning and closes at six in the evening, every day except Sunday. It bakes sourdough, rye, "
    "spelt and white loaves, croissants, cinnamon rolls and three kinds of cake. Orders for cakes "
    "need two days' notice. Answer customers' questions politely, in one or two short sentences, "
    "and never invent products the bakery does not sell."
)
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He counted the steps "
    "as he went, one hundred and twelve of them, and at the top he wound the great clockwork that "
    "turned the lens. Ships passing in the night saw the beam sweep across the water every ten "
    "seconds. In winter the storms came from the north, and the spray reached the windows of the "
    "lamp room. He kept a logbook in which he wrote the weather, the ships he saw and the time the "
    "lamp was lit. One night in November, a small fishing boat lost its way in the fog"
)


def _engine(path: Path, **settings: object) -> Engine:
    return Engine.load(ModelConfig(id="smol", path=str(path), n_ctx=2048, **settings))  # type: ignore[arg-type]


def run(engine: Engine, **fields: object) -> GenerationOutcome:
    fields.setdefault("temperature", 0.0)
    return engine.generate(generate_message("r", **fields), lambda _text: None)  # type: ignore[arg-type]


def chat(*turns: str, system: str = SYSTEM) -> tuple[ChatMessage, ...]:
    """Messages: the system prompt, then user/assistant turns alternating, starting with a user."""
    roles = ("user", "assistant")
    turn_messages = (ChatMessage(roles[i % 2], text) for i, text in enumerate(turns))  # type: ignore[arg-type]
    return (ChatMessage("system", system), *turn_messages)


@pytest.fixture
def smol(smollm2_path: Path) -> Iterator[Engine]:
    e = _engine(smollm2_path, n_seq=2)
    yield e
    e.close()


# ---- engine: reuse ------------------------------------------------------------------------------


def test_growing_chat_reuses_its_prefix(smol: Engine) -> None:
    o1 = run(smol, messages=chat("What bread do you bake?"), max_tokens=24)
    assert o1.prompt_tokens_evaluated == o1.prompt_tokens >= PROMPT_CACHE_MIN_TOKENS
    o2 = run(smol, messages=chat("What bread do you bake?", o1.text, "And on Saturdays?"), max_tokens=24)
    assert 0 < o2.prompt_tokens_evaluated < o2.prompt_tokens / 4, o2
    o3 = run(
        smol,
        messages=chat("What bread do you bake?", o1.text, "And on Saturdays?", o2.text, "Thanks!"),
        max_tokens=8,
    )
    assert 0 < o3.prompt_tokens_evaluated < o3.prompt_tokens / 4, o3
    assert smol.conversations == () and smol.cached_sequences == 1  # one chat: one sequence


def test_interleaved_chats_both_keep_reusing(smol: Engine) -> None:
    # A and B share the long system prompt: B1 branches from a copy of A, so A stays whole
    a1 = run(smol, messages=chat("Do you sell rye bread?"), max_tokens=16)
    b1 = run(smol, messages=chat("When do you open?"), max_tokens=16)
    assert b1.prompt_tokens_evaluated < b1.prompt_tokens / 2  # the system prompt was reused
    a2 = run(smol, messages=chat("Do you sell rye bread?", a1.text, "Is it sliced?"), max_tokens=16)
    b2 = run(smol, messages=chat("When do you open?", b1.text, "And on Sunday?"), max_tokens=16)
    a3 = run(
        smol,
        messages=chat("Do you sell rye bread?", a1.text, "Is it sliced?", a2.text, "How much?"),
        max_tokens=8,
    )
    for o in (a2, b2, a3):
        assert 0 < o.prompt_tokens_evaluated < o.prompt_tokens / 4, o
    assert smol.cached_sequences == 2  # n_seq


def test_growing_completion_prompt_reuses(smol: Engine) -> None:
    o1 = run(smol, prompt=STORY, max_tokens=16)
    assert o1.prompt_tokens_evaluated == o1.prompt_tokens
    longer = STORY + o1.text + " The keeper lit a flare and"
    o2 = run(smol, prompt=longer, max_tokens=8)
    new = o2.prompt_tokens - o1.prompt_tokens  # the answer and the added words
    assert 0 < o2.prompt_tokens_evaluated < new and o2.prompt_tokens_evaluated < o2.prompt_tokens / 4, (
        o2,
        new,
    )


def test_a_prompt_that_diverges_at_k_evaluates_from_k(smol: Engine) -> None:
    full = smol.prompts.completion_tokens(STORY)
    run(smol, prompt=STORY, max_tokens=1)
    cut = STORY[: STORY.index(" One night")]
    other = cut + " Nobody in the village had ever seen him leave the tower."
    k = common_prefix(full, smol.prompts.completion_tokens(other))
    assert k >= PROMPT_CACHE_MIN_TOKENS
    o = run(smol, prompt=other, max_tokens=1)
    assert o.prompt_tokens_evaluated == o.prompt_tokens - k
    # it branched: the whole story is still cached, only its last token is evaluated again
    again = run(smol, prompt=STORY, max_tokens=1)
    assert again.prompt_tokens_evaluated == 1


def test_a_small_cut_takes_the_sequence_over_instead_of_copying_it(smol: Engine) -> None:
    # a client that rewrites only the end of a long prompt: cutting the sequence back costs less
    # than copying its whole KV state, so no second sequence is made
    full = smol.prompts.completion_tokens(STORY)
    run(smol, prompt=STORY, max_tokens=1)
    other = STORY[: STORY.rindex(" ")] + " and the sea."
    k = common_prefix(full, smol.prompts.completion_tokens(other))
    assert len(full) - k < BRANCH_MIN_FRACTION * len(full)
    o = run(smol, prompt=other, max_tokens=1)
    assert o.prompt_tokens_evaluated == o.prompt_tokens - k
    assert smol.cached_sequences == 1  # taken over, not copied
    again = run(smol, prompt=STORY, max_tokens=1)  # the cut-off end is evaluated again
    assert again.prompt_tokens_evaluated == len(full) - common_prefix(
        full, smol.prompts.completion_tokens(other)
    )


def test_an_unrelated_prompt_starts_fresh_and_evicts_the_oldest(smol: Engine) -> None:
    run(smol, messages=chat("Do you sell rye bread?"), max_tokens=8)
    run(smol, prompt=STORY, max_tokens=8)
    short = run(smol, prompt="The capital of France is", max_tokens=4)  # shares too little
    assert short.prompt_tokens_evaluated == short.prompt_tokens
    assert smol.cached_sequences == 2
    # the chat (least recently used) went; the story is still there
    assert run(smol, prompt=STORY, max_tokens=1).prompt_tokens_evaluated == 1
    chat_again = run(smol, messages=chat("Do you sell rye bread?"), max_tokens=1)
    assert chat_again.prompt_tokens_evaluated == chat_again.prompt_tokens


def test_keyless_requests_never_touch_a_conversation(smol: Engine) -> None:
    messages = chat("Do you sell rye bread?")
    c1 = run(smol, messages=messages, max_tokens=16, conversation="c")
    keyless = run(smol, messages=messages, max_tokens=16)
    assert keyless.prompt_tokens_evaluated == keyless.prompt_tokens  # conversations are not candidates
    c2 = run(
        smol,
        messages=chat("Do you sell rye bread?", c1.text, "Is it sliced?"),
        max_tokens=8,
        conversation="c",
    )
    assert 0 < c2.prompt_tokens_evaluated < c2.prompt_tokens / 4
    assert smol.conversations == ("c",)


def test_a_new_conversation_with_cache_prompt_true_adopts_the_prompt_cache(smol: Engine) -> None:
    """The Responses API's first previous_response_id turn: a conversation seen for the first time
    whose request says cache_prompt true continues the keyless sequence its prompt extends (which
    becomes the conversation's); without it, a new conversation starts from an empty KV cache."""
    first = run(smol, messages=chat("Do you sell rye bread?"), max_tokens=16)  # keyless
    assert first.prompt_tokens_evaluated == first.prompt_tokens
    follow = chat("Do you sell rye bread?", first.text, "Is it sliced?")
    plain = run(smol, messages=follow, max_tokens=8, conversation="plain")
    assert plain.prompt_tokens_evaluated == plain.prompt_tokens  # a new conversation: from empty
    adopted = run(smol, messages=follow, max_tokens=8, conversation="adopted", cache_prompt=True)
    # everything the keyless sequence held (the first prompt and its answer) was reused
    reused = adopted.prompt_tokens - adopted.prompt_tokens_evaluated
    assert reused >= first.prompt_tokens + first.completion_tokens - 1, (first, adopted)
    assert "adopted" in smol.conversations
    # the conversation goes on in its own sequence (the keyless one became it)
    third = chat("Do you sell rye bread?", first.text, "Is it sliced?", adopted.text, "Thanks.")
    again = run(smol, messages=third, max_tokens=4, conversation="adopted")
    assert 0 < again.prompt_tokens_evaluated < again.prompt_tokens - adopted.prompt_tokens


# ---- engine: exactness, bounds, disk -------------------------------------------------------------


def test_cache_prompt_false_equals_plain_llama(smollm2_path: Path, smol: Engine) -> None:
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        reference = str(llm.create_completion(STORY, max_tokens=16, temperature=0)["choices"][0]["text"])  # type: ignore[index]
    finally:
        llm.close()
    first = run(smol, prompt=STORY, max_tokens=16)  # nothing cached yet: from an empty KV cache
    assert first.text == reference
    assert run(smol, prompt=STORY, max_tokens=16).prompt_tokens_evaluated == 1  # cached
    exact = run(smol, prompt=STORY, max_tokens=16, cache_prompt=False)
    assert exact.prompt_tokens_evaluated == exact.prompt_tokens and exact.text == reference
    off = _engine(smollm2_path, cache_prompt=False)  # the model setting
    try:
        for _ in range(2):
            o = run(off, prompt=STORY, max_tokens=1)
            assert o.prompt_tokens_evaluated == o.prompt_tokens
    finally:
        off.close()


def test_memory_stays_bounded_over_many_distinct_prompts(smollm2_path: Path) -> None:
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, n_seq=3))
    try:
        # one-token prompts: the test is about bookkeeping, not prefill
        prompts: list[str] = []
        for token in range(2000, 6000):
            text = e.llm.detokenize([token]).decode("utf-8", errors="replace")
            if text.strip().isalpha() and e.prompts.completion_tokens(text) == [token]:
                prompts.append(text)
            if len(prompts) == 200:
                break
        sizes = []
        for text in prompts:
            run(e, prompt=text, max_tokens=1)
            assert e.cached_sequences <= 3
            sizes.append(e.snapshot_bytes)
        assert len(sizes) == 200
        assert max(sizes[10:]) <= 2 * max(sizes[:10]), (sizes[:10], max(sizes))
    finally:
        e.close()


def test_cached_prompts_survive_a_restart_through_kv_dir(smollm2_path: Path, tmp_path: Path) -> None:
    e = _engine(smollm2_path, n_seq=3)
    e.kv_dir = tmp_path
    try:
        first = run(e, prompt=STORY, max_tokens=8)
        run(e, messages=chat("Do you sell rye bread?"), max_tokens=8)
        assert e.save_kv(tmp_path) == 2
    finally:
        e.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol-prompt-0.kvp", "smol-prompt-1.kvp"]
    e = _engine(smollm2_path, n_seq=3)
    e.kv_dir = tmp_path
    try:
        again = run(e, prompt=STORY, max_tokens=8)
        assert again.prompt_tokens_evaluated == 1 and again.prompt_tokens == first.prompt_tokens
        assert list(tmp_path.iterdir()) == []  # taken back into memory
        assert e.cached_sequences == 2
    finally:
        e.close()


# ---- engine: Gemma 3's sliding window ---------------------------------------------------------


def test_gemma_reuses_only_what_its_sliding_window_still_holds(gemma3_path: Path) -> None:
    # swa_full=False keeps only the window (plus a batch) of the SWA layers' KV, as llama-server
    # does, so a long sequence really loses its early positions (Timeshare's default context keeps
    # the full SWA cache; the rule holds either way)
    llm = llama_cpp.Llama(str(gemma3_path), n_ctx=2048, swa_full=False, verbose=False)
    e = Engine(llm, ModelConfig(id="gemma", path=str(gemma3_path), n_ctx=2048, chat_format="fallback"), None)
    try:
        n_swa = e.sequences._n_swa
        assert n_swa > 0, "Gemma 3 has sliding-window attention"
        words = " ".join(f"w{i}" for i in range(300))  # 1091 tokens
        full = e.prompts.completion_tokens(words)
        assert len(full) > 2 * n_swa, len(full)  # more than the window and a batch
        run(e, prompt=words, max_tokens=1)
        pos_min = llama_cpp.llama_memory_seq_pos_min(
            llama_cpp.llama_get_memory(llm.ctx), 0
        )  # its one sequence
        assert pos_min > 0, "the sliding window dropped nothing: the test proves nothing"
        # diverging late, while the long sequence is live: the window still holds what the new
        # tokens need, so the prefix is reused (first: once this sequence has gone through a host
        # snapshot, the snapshot keeps only the window's last cells and a restore holds less)
        late = words[: words.index(" w280 ")] + " and then something else entirely"
        k_late = common_prefix(full, e.prompts.completion_tokens(late))
        assert k_late - n_swa >= pos_min
        o_late = run(e, prompt=late, max_tokens=8)
        assert o_late.prompt_tokens_evaluated == o_late.prompt_tokens - k_late
        # diverging early: the positions the new tokens attend to are gone (from the long
        # sequence and from its late branch alike), so from scratch
        early = words[: words.index(" w100 ")] + " and then something else entirely"
        k_early = common_prefix(full, e.prompts.completion_tokens(early))
        assert k_early - n_swa < pos_min and k_early >= PROMPT_CACHE_MIN_TOKENS
        o_early = run(e, prompt=early, max_tokens=8)
        assert o_early.prompt_tokens_evaluated == o_early.prompt_tokens
    finally:
        e.close()


# ---- through `timeshare serve` and the openai client ---------------------------------------------


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, gemma3_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("prompt-cache-home")
    with serving_demo_models(home, smollm2_path, gemma3_path) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=180) as c:
        yield c


def _evaluated(reply: object) -> int:
    return int(reply.model_extra["timeshare"]["prompt_tokens_evaluated"])  # type: ignore[attr-defined]


def _cached(reply: object) -> int:
    return int(reply.usage.prompt_tokens_details.cached_tokens)  # type: ignore[attr-defined]


def _state(status: dict[str, object], model: str) -> str:
    return str(next(m["state"] for m in status["models"] if m["id"] == model))  # type: ignore[attr-defined]


def _sleep(served: Served, model: str, level: str) -> None:
    r = httpx.post(f"{served.url}/timeshare/v1/models/{model}/sleep", json={"level": level}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_openai_chat_reuses_across_turns_switches_sleep_and_stop(
    served: Served, client: openai.OpenAI
) -> None:
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What cakes do you make?"}]

    def turn(question: str | None, max_tokens: int = 16) -> object:
        if question is not None:
            history.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model=SMOL,
            messages=history,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
        )
        history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        assert _cached(reply) == reply.usage.prompt_tokens - _evaluated(reply)  # type: ignore[union-attr]
        return reply

    def assert_reused(reply: object) -> None:
        prompt_tokens = reply.usage.prompt_tokens  # type: ignore[attr-defined]
        assert 0 < _evaluated(reply) < prompt_tokens / 4, (_evaluated(reply), prompt_tokens)

    first = turn(None)
    assert _cached(first) == 0
    assert_reused(turn("Do they need notice?"))
    # the other model takes the GPU; SmolLM2's KV cache stays on the device (release level weights)
    client.completions.create(model=GEMMA, prompt="The capital of France is", max_tokens=2, temperature=0)
    switched = turn("What about bread?")
    assert switched.model_extra["timeshare"]["switched"] is True  # type: ignore[attr-defined]
    assert_reused(switched)
    _sleep(served, SMOL, "weights+kv")  # KV to host memory
    served.wait_until(lambda s: _state(s, SMOL) == "sleeping", "smol to sleep", 60)
    assert_reused(turn("And croissants?"))
    _sleep(served, SMOL, "stop")  # the worker exits; the cached prompts go to disk
    served.wait_until(lambda s: _state(s, SMOL) == "stopped", "smol to stop", 60)
    assert_reused(turn("Thank you!", max_tokens=4))  # started on demand, the prefix read back


@pytest.mark.slow
def test_openai_completions_reuse_and_cache_prompt_false_is_exact(
    served: Served, client: openai.OpenAI, gemma3_path: Path
) -> None:
    llm = llama_cpp.Llama(str(gemma3_path), n_ctx=2048, verbose=False)
    try:
        reference = str(llm.create_completion(STORY, max_tokens=12, temperature=0)["choices"][0]["text"])  # type: ignore[index]
    finally:
        llm.close()
    first = client.completions.create(model=GEMMA, prompt=STORY, max_tokens=12, temperature=0)
    longer = STORY + first.choices[0].text + " He rowed out"
    grown = client.completions.create(model=GEMMA, prompt=longer, max_tokens=4, temperature=0)
    assert 0 < _evaluated(grown) <= grown.usage.prompt_tokens - first.usage.prompt_tokens + 2  # type: ignore[union-attr]
    exact = client.completions.create(
        model=GEMMA, prompt=STORY, max_tokens=12, temperature=0, extra_body={"cache_prompt": False}
    )
    assert exact.choices[0].text == reference
    assert _evaluated(exact) == exact.usage.prompt_tokens and _cached(exact) == 0  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=GEMMA, prompt="x", max_tokens=1, extra_body={"cache_prompt": "yes"})
    assert bad.value.body["param"] == "cache_prompt"  # type: ignore[index]
