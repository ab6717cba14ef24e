"""Images evaluated in the engine's own decode loop (issue 41, item 3), in-process on both demo
models with a generated projector (random weights: tests/_vision_util.py): an image's tokens in
the batch, its KV kept and matched by the image's content hash, beside text requests. The answers
mean nothing; the mechanics are checked: two different images give different first-token
logprobs, the same image the same ones bit for bit (alone or batched beside a text request,
after its KV went to disk and back), the first token is what libmtmd called directly picks, and a
second turn about the same image evaluates only the new text."""

from __future__ import annotations

# isort: off
import llama_cpp  # noqa: F401  (before anything that imports numpy)
# isort: on

from collections.abc import Iterator
from pathlib import Path

import pytest
from _e_worker_util import generate_message
from _vision_util import QUESTION, DirectMtmd, Run, alone, ask, png, projector_for
from timeshare.core.chatformat.history import render
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import InvalidInputError
from timeshare.core.wire.protocol import ChatMessage, ImagePart
from timeshare.core.worker.engine import Engine
from timeshare.core.worker.prompts import fallback_prompt
from timeshare.core.worker.vision import ImageSpan, close_spans, placeholder_ids, snap_to_image_start

RED, BLUE = png((255, 0, 0)), png((0, 0, 255))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    path: Path = request.getfixturevalue(f"{request.param}_path")
    return path, projector_for(path, tmp_path_factory.mktemp("proj"))


@pytest.fixture(scope="module")
def engine(model: tuple[Path, Path]) -> Iterator[Engine]:
    path, proj = model
    e = Engine.load(ModelConfig(id="vis", path=str(path), n_ctx=1024, n_seq=4, parallel=2, mmproj=str(proj)))
    yield e
    e.close()


def test_two_images_differ_and_the_same_image_repeats_bit_for_bit(engine: Engine) -> None:
    red = alone(engine, messages=(ask(RED),))
    blue = alone(engine, messages=(ask(BLUE),))
    red_again = alone(engine, messages=(ask(RED),))
    assert red.first == red_again.first and red.text == red_again.text
    assert red.first != blue.first  # (the logprobs of the first token, its top 5 with theirs)
    # the image is in the prompt: 16 image positions of placeholder ids, never a vocabulary id
    spans = list(red.prepared.media.values())
    assert [s.n_tokens for s in spans] == [16]
    held = red.prepared.tokens[spans[0].start : spans[0].end]
    assert held == placeholder_ids(spans[0].digest, 16) and all(t < 0 for t in held)


def test_the_first_token_is_what_libmtmd_called_directly_picks(
    engine: Engine, model: tuple[Path, Path]
) -> None:
    """The oracle: the same prompt text (the template rendered with libmtmd's default marker)
    evaluated by a plain Llama and libmtmd's own helper, nothing of Timeshare in between."""
    history = [{"role": "user", "content": "<image>" + QUESTION}]
    if engine.template is not None:
        text, add_special = render(engine.template, history, []), False
    else:
        text, add_special = fallback_prompt([ChatMessage("user", history[0]["content"])]), True
    direct = DirectMtmd(*model, n_ctx=1024)
    try:
        for image in (RED, BLUE):
            logits = direct.first_logits(text, [image], add_special=add_special)
            expected = direct.llm.detokenize([int(logits.argmax())])
            run = alone(engine, messages=(ask(image),))
            assert run.first.piece == expected
    finally:
        direct.close()


def test_alone_or_batched_beside_a_text_request_bit_for_bit(
    engine: Engine, request: pytest.FixtureRequest
) -> None:
    if "gemma3" in request.node.callspec.id:
        # not the image's doing: on this CPU build, Gemma-3-270M's text prompts of some lengths
        # already differ batched from alone (a 5-token prompt beside a 6-token one: the first
        # token's logprob by 0.03; greedy tokens the same), on main too (reported with issue 41)
        request.applymarker(
            pytest.mark.xfail(reason="Gemma-3 batch logprobs differ for text too", strict=True)
        )
    solo = alone(engine, messages=(ask(RED),), max_tokens=12)
    text_solo = alone(engine, prompt="The three primary colours are", max_tokens=12)
    # both join the same step: the image is evaluated in a decode of its own, the text prompt and
    # then both answers decode together
    image_run = Run(engine, "img", messages=(ask(RED),), max_tokens=12)
    text_run = Run(engine, "txt", prompt="The three primary colours are", max_tokens=12)
    sizes = set()
    while engine.active:
        sizes.add(len(engine.active))
        engine.step()
    assert 2 in sizes
    assert image_run.logprobs == solo.logprobs and image_run.text == solo.text
    assert text_run.logprobs == text_solo.logprobs and text_run.text == text_solo.text


def test_a_second_turn_about_the_same_image_evaluates_only_the_new_text(engine: Engine) -> None:
    first = alone(engine, messages=(ask(BLUE),), conversation="about-blue", cache_prompt=None)
    held = len(engine.kv_tokens())
    encodes = engine.vision.encodes if engine.vision else 0
    turn = (ask(BLUE), ChatMessage("assistant", first.text), ChatMessage("user", "And its colour?"))
    second = alone(engine, messages=turn, conversation="about-blue", cache_prompt=None)
    out = engine.outcome(second.live)
    assert out.prompt_tokens > held
    # the image and the first turn come from the KV cache (its tokens are the prefix); only the
    # answer's re-tokenized end and the new turn are evaluated, and the image is not encoded again
    assert out.prompt_tokens_evaluated <= out.prompt_tokens - held + 2
    assert out.prompt_tokens_evaluated < out.prompt_tokens - 16
    assert engine.vision is not None and engine.vision.encodes == encodes


def test_an_image_conversation_continues_the_same_from_its_kv_on_disk(
    engine: Engine, model: tuple[Path, Path], tmp_path: Path
) -> None:
    first = alone(engine, messages=(ask(RED),), conversation="disk", cache_prompt=None)
    turn = (ask(RED), ChatMessage("assistant", first.text), ChatMessage("user", "Say more."))
    assert engine.save_kv(tmp_path) >= 1
    here = alone(engine, messages=turn, conversation="disk", cache_prompt=None)
    path, proj = model
    other = Engine.load(
        ModelConfig(id="vis", path=str(path), n_ctx=1024, n_seq=4, parallel=2, mmproj=str(proj))
    )
    try:
        assert other.load_kv(tmp_path, "disk")
        there = alone(other, messages=turn, conversation="disk", cache_prompt=None)
        assert there.logprobs == here.logprobs and there.text == here.text
        assert (
            other.outcome(there.live).prompt_tokens_evaluated
            == engine.outcome(here.live).prompt_tokens_evaluated
        )
        assert other.vision is not None and other.vision.encodes == 0  # the image came back in the KV
    finally:
        other.close()


def test_a_completion_prompt_takes_images_where_they_are_placed(engine: Engine) -> None:
    run = alone(engine, prompt="Look: this picture shows", images=(ImagePart(RED, 6),))
    start = next(iter(run.prepared.media))
    text_before = engine.prompts.completion_tokens("Look: ")
    assert run.prepared.tokens[: len(text_before)] == text_before[: len(text_before)]
    assert start >= len(text_before) - 1
    # an image last: refused where the projector puts no token after it (the first answer token
    # needs a text token's logits); Gemma 3's <end_of_image> is one
    last = generate_message("r", prompt="Look:", images=(ImagePart(RED, 5),))
    if engine.vision is not None and "gemma" in engine.model.path.lower():
        prepared = engine.prepare(last)
        assert prepared.tokens[-1] >= 0
        close_spans(prepared.media)
    else:
        with pytest.raises(InvalidInputError, match="ends with an image"):
            engine.prepare(last)


def test_an_image_for_a_text_only_model_is_refused_naming_it(smollm2_path: Path) -> None:
    e = Engine.load(ModelConfig(id="smol", name="Smol", path=str(smollm2_path), n_ctx=512))
    try:
        with pytest.raises(InvalidInputError, match="Smol does not read images"):
            e.prepare(generate_message("r", messages=(ask(RED),)))
    finally:
        e.close()


def test_an_unreadable_image_is_refused_and_the_engine_goes_on(engine: Engine) -> None:
    with pytest.raises(InvalidInputError, match="cannot be read as an image"):
        engine.prepare(generate_message("r", messages=(ask(RED[:60]),)))
    assert alone(engine, messages=(ask(RED),)).text


def test_a_cut_never_falls_inside_an_image() -> None:
    spans = {3: ImageSpan(3, 16, b"x" * 32, None)}
    assert snap_to_image_start(10, spans) == 3
    assert snap_to_image_start(3, spans) == 3
    assert snap_to_image_start(19, spans) == 19
    assert snap_to_image_start(2, spans) == 2
    # two images' placeholders differ from their first position
    assert placeholder_ids(b"a" * 32, 4)[0] != placeholder_ids(b"b" * 32, 4)[0]
