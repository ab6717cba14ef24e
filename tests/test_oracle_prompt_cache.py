"""The prompt cache gives *correct* answers, not only fewer evaluated tokens: on every reuse path
(a conversation, the keyless longest prefix, the copy-on-diverge cut, after a release and restore of
the weights and KV, after a restart from saved KV) the greedy answer and the first answer token's
logits equal those of a fresh llama-cpp-python context that replays the cached path's evaluation
schedule, and the evaluated count is the one the documented rules give.

The schedule comes from docs/API.md (*Prompt cache and determinism*) and engine.py's contract, not
from the product's helpers: a sequence holds its prompt and every answer token but the last (an
end-of-generation token is never evaluated); a request on a sequence evaluates the prompt after the
longest common prefix of what the sequence holds and the prompt, and at least the last prompt
token; the evaluation is ``Llama.eval`` of that suffix (in ``n_batch`` chunks), each answer token
alone. A reused prefix legitimately changes the last bits against one whole-prompt evaluation, so
the replay makes the same cuts; its answers are checked against a plain whole-prompt evaluation
only where the schedules agree. Prefix lengths are counted here with a plain loop over two token
lists (tokenized by the reference ``Llama``)."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _e_worker_util import WorkerHandle, generate_message
from timeshare.core.config.schema import ModelConfig
from timeshare.core.residency import Residency, ResidencyOptions
from timeshare.core.wire import protocol as p
from timeshare.core.worker.engine import Engine, GenerationOutcome

N_CTX = 2048
ANSWER = 12
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He counted the steps "
    "as he went, one hundred and twelve of them, and at the top he wound the great clockwork that "
    "turned the lens. Ships passing in the night saw the beam sweep across the water every ten "
    "seconds. In winter the storms came from the north, and the spray reached the windows of the "
    "lamp room. He kept a logbook in which he wrote the weather, the ships he saw and the time the "
    "lamp was lit. One night in November, a small fishing boat lost its way in the fog"
)
OTHER = (
    "A recipe for bread: mix five hundred grams of flour with ten grams of salt, seven grams of dried "
    "yeast and three hundred and fifty millilitres of warm water. Knead the dough for ten minutes "
    "until it is smooth and elastic, then leave it covered in a warm place for an hour, until it has "
    "doubled in size. Shape it into a loaf, let it rise again for half an hour, and bake it"
)


def prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


class Replay:
    """One reference context (a plain ``Llama``) replaying a sequence's schedule step by step."""

    def __init__(self, llm: llama_cpp.Llama) -> None:
        self.llm = llm
        self.held: list[int] = []  # what the sequence's KV holds, as the rules say

    def tokens(self, prompt: str) -> list[int]:
        return [int(t) for t in self.llm.tokenize(prompt.encode(), add_bos=True, special=True)]

    def request(self, prompt: list[int], max_tokens: int) -> tuple[int, np.ndarray[Any, Any], list[int]]:
        """(evaluated, first logits, answer tokens) of a greedy request on this sequence."""
        llm = self.llm
        reuse = min(prefix_len(self.held, prompt), len(prompt) - 1)
        llm.n_tokens = reuse  # eval() drops the KV cells from n_tokens on
        llm.eval(prompt[reuse:])  # in n_batch chunks, as the worker prefills
        first = self._logits()
        logits = first
        answer: list[int] = []
        while True:
            token = int(np.argmax(logits))  # the greedy sampler: the first of the largest logits
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                break
            answer.append(token)
            if len(answer) >= max_tokens:
                break
            llm.eval([token])  # each answer token alone
            logits = self._logits()
        # ended on an end-of-generation token: every answer token was evaluated; on the token
        # limit: all but the last
        self.held = prompt + (answer if len(answer) < max_tokens else answer[:-1])
        return len(prompt) - reuse, first, answer

    def fresh(self) -> Replay:
        self.held = []
        self.llm.n_tokens = 0
        return self

    def text(self, answer: list[int]) -> str:
        return self.llm.detokenize(answer).decode("utf-8", errors="replace")

    def _logits(self) -> np.ndarray[Any, Any]:
        n_vocab = self.llm.n_vocab()
        row = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(n_vocab,)).copy()


@pytest.fixture(scope="module")
def ref(smollm2_path: Path) -> Iterator[Replay]:
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=N_CTX, verbose=False)
    yield Replay(llm)
    llm.close()


def _engine(path: Path, **settings: Any) -> Engine:
    # The model's default ``parallel`` (several sequences, kv_unified false, n_ctx per sequence):
    # the product's own configuration. Each sequence has its own KV stream of N_CTX cells, so a
    # plain one-sequence Llama of N_CTX stays an independent and exact oracle for it.
    return Engine.load(ModelConfig(id="smol", path=str(path), n_ctx=N_CTX, **settings))


def generate(engine: Engine, n_prompt: int, **fields: Any) -> tuple[GenerationOutcome, np.ndarray[Any, Any]]:
    """Run a greedy request; also the logits of its first answer token, read from the context
    once the whole prompt of ``n_prompt`` tokens is in it (before the first decode step)."""
    captured: list[np.ndarray[Any, Any]] = []
    llm = engine.llm

    def before_step() -> None:
        # The engine decodes its sequences through one multi-sequence context (continuous
        # batching), so ``llm.n_tokens`` no longer says what a sequence holds: the request's live
        # sequence does (its KV's tokens and the prompt tokens still to prefill). It is alone in
        # the batch, so the context's last output row is its last prompt token's.
        live = engine.active
        if not captured and live and not live[0].pending and len(live[0].ids) == n_prompt:
            row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            captured.append(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy())

    fields.setdefault("temperature", 0.0)
    outcome = engine.generate(generate_message("r", **fields), lambda _t: None, before_step=before_step)
    assert captured, "the context never held the whole prompt before the first decode step"
    return outcome, captured[0]


def check(
    outcome: GenerationOutcome,
    logits: np.ndarray[Any, Any],
    expected: tuple[int, np.ndarray[Any, Any], list[int]],
    ref: Replay,
    what: str,
) -> None:
    evaluated, first, answer = expected
    assert outcome.prompt_tokens_evaluated == evaluated, (what, outcome, evaluated)
    assert outcome.text == ref.text(answer), (what, outcome.text, ref.text(answer))
    assert logits.tobytes() == first.tobytes(), (what, float(np.abs(logits - first).max()))


# ---- the paths ----------------------------------------------------------------------------------


def test_a_conversation_continues_exactly(smollm2_path: Path, ref: Replay) -> None:
    e = _engine(smollm2_path)
    try:
        r = ref.fresh()
        p1 = ref.tokens(STORY)
        o1, l1 = generate(e, len(p1), prompt=STORY, max_tokens=ANSWER, conversation="c")
        x1 = r.request(p1, ANSWER)
        check(o1, l1, x1, ref, "first turn")
        assert x1[0] == len(p1)  # from an empty KV cache
        second = STORY + o1.text + " The keeper lit a flare and"
        p2 = ref.tokens(second)
        o2, l2 = generate(e, len(p2), prompt=second, max_tokens=ANSWER, conversation="c")
        x2 = r.request(p2, ANSWER)
        check(o2, l2, x2, ref, "second turn")
        assert 0 < x2[0] < len(p2) - len(p1)  # only the new words (and a retokenized edge)
    finally:
        e.close()


def test_the_keyless_longest_prefix_from_a_host_snapshot_is_exact(smollm2_path: Path, ref: Replay) -> None:
    e = _engine(smollm2_path, n_seq=3)
    try:
        p_story = ref.tokens(STORY)
        o, _ = generate(e, len(p_story), prompt=STORY, max_tokens=ANSWER)
        r = ref.fresh()
        r.request(p_story, ANSWER)
        held_story = list(r.held)
        p_other = ref.tokens(OTHER)
        generate(e, len(p_other), prompt=OTHER, max_tokens=ANSWER)  # the story goes to a host snapshot
        assert e.cached_sequences == 2
        longer = STORY + o.text + " He rowed out to"
        p_longer = ref.tokens(longer)
        assert prefix_len(p_longer, p_other) < 64  # only the story's sequence can be reused
        o2, l2 = generate(e, len(p_longer), prompt=longer, max_tokens=ANSWER)
        r = ref.fresh()  # the story's sequence again, then the longer prompt on it
        r.request(p_story, ANSWER)
        assert r.held == held_story
        check(o2, l2, r.request(p_longer, ANSWER), ref, "longest prefix")
    finally:
        e.close()


def test_the_copy_on_diverge_cut_and_the_original_both_stay_exact(smollm2_path: Path, ref: Replay) -> None:
    e = _engine(smollm2_path, n_seq=3)
    try:
        p_story = ref.tokens(STORY)
        generate(e, len(p_story), prompt=STORY, max_tokens=ANSWER)
        other = STORY[: STORY.index(" He kept")] + " Nobody in the village had ever seen him leave the tower."
        p_other = ref.tokens(other)
        k = prefix_len(p_story, p_other)
        assert k >= 64 and len(p_story) + ANSWER - 1 - k > 0.1 * (len(p_story) + ANSWER - 1)  # a copy
        o2, l2 = generate(e, len(p_other), prompt=other, max_tokens=ANSWER)
        r = ref.fresh()
        r.request(p_story, ANSWER)
        story_held = list(r.held)
        check(o2, l2, r.request(p_other, ANSWER), ref, "the diverging copy")
        assert o2.prompt_tokens_evaluated == len(p_other) - k
        # the original stayed cached whole: the story again evaluates only its last token
        o3, l3 = generate(e, len(p_story), prompt=STORY, max_tokens=ANSWER)
        r = ref.fresh()
        r.request(p_story, ANSWER)
        assert r.held == story_held
        check(o3, l3, r.request(p_story, ANSWER), ref, "the original after the copy")
        assert o3.prompt_tokens_evaluated == 1
    finally:
        e.close()


def test_a_conversation_after_a_release_and_restore_is_exact(smollm2_path: Path, ref: Replay) -> None:
    # what a switch does to the yielding worker: weights and the KV cache released (KV to host
    # memory, the context freed), then restored in place
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=N_CTX), use_mmap=False)
    res = Residency.attach(e.llm, smollm2_path, ResidencyOptions(mode="inplace"))
    try:
        r = ref.fresh()
        p1 = ref.tokens(STORY)
        o1, l1 = generate(e, len(p1), prompt=STORY, max_tokens=ANSWER, conversation="c")
        check(o1, l1, r.request(p1, ANSWER), ref, "before the switch")
        res.release(kv=True)
        res.restore()
        second = STORY + o1.text + " The keeper lit a flare and"
        p2 = ref.tokens(second)
        o2, l2 = generate(e, len(p2), prompt=second, max_tokens=ANSWER, conversation="c")
        check(o2, l2, r.request(p2, ANSWER), ref, "after the switch")
    finally:
        res.close()
        e.close()


def test_a_conversation_and_a_cached_prompt_after_a_restart_are_exact(
    smollm2_path: Path, ref: Replay, tmp_path: Path
) -> None:
    e = _engine(smollm2_path, n_seq=3)
    e.kv_dir = tmp_path
    try:
        p1 = ref.tokens(STORY)
        o1, _ = generate(e, len(p1), prompt=STORY, max_tokens=ANSWER, conversation="c")
        p_other = ref.tokens(OTHER)
        generate(e, len(p_other), prompt=OTHER, max_tokens=ANSWER)  # a keyless cached prompt
        assert e.save_kv(tmp_path) == 2
    finally:
        e.close()
    e = _engine(smollm2_path, n_seq=3)
    e.kv_dir = tmp_path
    try:
        second = STORY + o1.text + " The keeper lit a flare and"
        p2 = ref.tokens(second)
        o2, l2 = generate(e, len(p2), prompt=second, max_tokens=ANSWER, conversation="c")
        r = ref.fresh()
        r.request(p1, ANSWER)
        check(o2, l2, r.request(p2, ANSWER), ref, "the conversation after the restart")
        o3, l3 = generate(e, len(p_other), prompt=OTHER, max_tokens=ANSWER)
        r = ref.fresh()
        r.request(p_other, ANSWER)
        check(o3, l3, r.request(p_other, ANSWER), ref, "the cached prompt after the restart")
        assert o3.prompt_tokens_evaluated == 1
    finally:
        e.close()


@pytest.mark.slow
def test_a_conversation_across_real_switches_answers_as_the_replay(
    smollm2_path: Path, ref: Replay, tmp_path: Path
) -> None:
    # through the worker protocol, with a real arena: another worker takes the token (this one
    # releases its weights, the KV stays), then a sleep at weights+kv (the KV to host memory);
    # each next turn answers as the replay and evaluates what the rules say
    arena_dir = tmp_path / "arena"
    arena_dir.mkdir(mode=0o700)
    a = WorkerHandle(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=N_CTX), tmp_path / "a", arena_dir=arena_dir
    )
    b = WorkerHandle(
        ModelConfig(id="other", path=str(smollm2_path), n_ctx=N_CTX), tmp_path / "b", arena_dir=arena_dir
    )
    try:
        a.ready()
        b.ready()
        r = ref.fresh()
        text = STORY
        answer, done = a.generate("t0", prompt=text, max_tokens=ANSWER, conversation="c")
        assert isinstance(done, p.Done)
        evaluated, _, tokens = r.request(ref.tokens(text), ANSWER)
        assert (done.usage.prompt_tokens_evaluated, answer) == (evaluated, ref.text(tokens))
        for turn, (more, displace) in enumerate(
            ((" The keeper lit a flare and", "token"), (" He rowed", "sleep"))
        ):
            if displace == "token":
                _, other = b.generate(f"b{turn}", prompt="Hello", max_tokens=2)
                assert isinstance(other, p.Done) and other.switch.switched
                assert a.expect(p.Released).level == "weights"
            else:
                a.send(p.Sleep("weights+kv"))
                assert a.expect(p.Released).level == "weights+kv"
            text = text + answer + more
            answer, done = a.generate(f"t{turn + 1}", prompt=text, max_tokens=ANSWER, conversation="c")
            assert isinstance(done, p.Done) and done.switch.switched, done
            evaluated, _, tokens = r.request(ref.tokens(text), ANSWER)
            assert done.usage.prompt_tokens_evaluated == evaluated, (displace, done, evaluated)
            assert answer == ref.text(tokens), (displace, answer, ref.text(tokens))
    finally:
        a.close()
        b.close()
