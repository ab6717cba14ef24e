"""The worker's generation loop (core/worker/decode.py) on the real demo models: greedy answers equal
llama-cpp-python's ``create_completion`` bit for bit, sampling honours temperature/top_p/top_k/seed,
stop strings split across tokens, UTF-8 split across tokens, cancellation mid-answer, flash_attn."""

from __future__ import annotations

# isort: off
import llama_cpp  # before anything that imports numpy
# isort: on

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _e_worker_util import generate_message
from _llama_oracle import plain_completions
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import CancelledError
from timeshare.core.wire.protocol import ChatMessage
from timeshare.core.worker.engine import Engine, GenerationOutcome
from timeshare.core.worker.textstream import TextStream

PROMPTS = (
    "The three primary colours are",
    "def fibonacci(n):\n",
    "Translate to French: good morning, my friend. ->",
    "Les capitales européennes les plus connues sont",
    "日本の首都は",
)
MAX_TOKENS = 32
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 20}


def _models(smollm2_path: Path, gemma3_path: Path) -> list[tuple[str, Path]]:
    return [("smol", smollm2_path), ("gemma", gemma3_path)]


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Iterator[Engine]:
    e = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=2048))
    yield e
    e.close()


def run(engine: Engine, before_step: Any = None, **fields: Any) -> GenerationOutcome:
    fields.setdefault("cache_prompt", False)
    pieces: list[str] = []
    kwargs = {"before_step": before_step} if before_step is not None else {}
    outcome = engine.generate(generate_message("d", **fields), pieces.append, **kwargs)
    assert "".join(pieces) == outcome.text  # what was streamed is the answer
    return outcome


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_greedy_equals_create_completion_bit_for_bit(
    which: str, smollm2_path: Path, gemma3_path: Path
) -> None:
    path = dict(_models(smollm2_path, gemma3_path))[which]
    refs = plain_completions(path, PROMPTS, MAX_TOKENS, temperature=0)
    engine = Engine.load(ModelConfig(id=which, path=str(path), n_ctx=2048))
    try:
        for prompt, ref in zip(PROMPTS, refs, strict=True):
            out = run(engine, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            assert out.text == ref, (which, prompt)
            assert out.finish_reason in ("stop", "length")
            assert out.prompt_tokens_evaluated == out.prompt_tokens
        # and again with the prompt cache on, after other traffic (short prompts start clean)
        run(engine, messages=(ChatMessage("user", "Hi"),), max_tokens=5, conversation="c")
        out = run(engine, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, cache_prompt=True)
        assert out.text == refs[0]
    finally:
        engine.close()


def test_seeded_sampling_equals_create_completion_and_honours_the_seed(
    smol: Engine, smollm2_path: Path
) -> None:
    prompt = PROMPTS[0]
    ref = plain_completions(smollm2_path, (prompt,), MAX_TOKENS, seed=7, **SAMPLED)[0]
    first = run(smol, prompt=prompt, max_tokens=MAX_TOKENS, seed=7, **SAMPLED)
    assert first.text == ref  # the same chain as llama-cpp-python's, the same seed
    assert run(smol, prompt=prompt, max_tokens=MAX_TOKENS, seed=7, **SAMPLED).text == first.text
    others = {run(smol, prompt=prompt, max_tokens=MAX_TOKENS, seed=s, **SAMPLED).text for s in (1, 2, 3)}
    assert others - {first.text}, "other seeds gave the same text"
    greedy = run(smol, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    # top_k 1 keeps only the most likely token: greedy, whatever the temperature and seed
    for seed in (1, 2):
        top1 = run(smol, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.5, top_k=1, seed=seed)
        assert top1.text == greedy.text
    # a tiny top_p keeps the most likely token too (min_keep 1)
    assert run(smol, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1e-6, seed=4).text == (
        greedy.text
    )


def test_a_stop_string_split_across_tokens(smol: Engine) -> None:
    prompt = PROMPTS[0]
    greedy = run(smol, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    llm = smol.llm
    n_prompt = greedy.prompt_tokens
    sampled = list(smol.kv_tokens()[n_prompt:])  # all but the last token
    pieces = [llm.detokenize([t]).decode() for t in sampled]
    # a stop string made of the end of one token and the start of the next (and of a third)
    for i in range(2, len(pieces) - 2):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 2 and len(b) >= 2:
            stop = a[-2:] + b + pieces[i + 2][:1]
            at = greedy.text.find(stop)
            if at == len("".join(pieces[:i])) + len(a) - 2:
                break
    else:
        pytest.fail(f"no token pair to split a stop string over in {pieces}")
    out = run(smol, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stop=("never there", stop))
    assert out.text == greedy.text[:at]
    assert (out.finish_reason, out.stop) == ("stop", stop)
    # the tokens sampled before the stop completed were counted (the one that completed it too)
    assert out.completion_tokens == i + 3


def _fake_stream(pieces: dict[int, bytes], stop: tuple[str, ...]) -> TextStream:
    llm = SimpleNamespace(_model=SimpleNamespace(vocab=None), token_bos=lambda: -1)
    return TextStream(llm, stop, dict(pieces))


def test_text_stream_utf8_and_stops_across_tokens() -> None:
    # "日" is e6 97 a5: split over two tokens it comes out whole, once
    s = _fake_stream({1: b"\xe6\x97", 2: b"\xa5 ok", 3: b"\xf0\x9f"}, ())
    assert s.push(1) == "" and s.incomplete and s.push(2) == "日 ok" and not s.incomplete
    assert s.push(3) == "" and s.incomplete
    assert s.flush() == "" and s.text == "日 ok"  # an incomplete character at the end is dropped
    # a stop string held back piece by piece, then released when it does not complete
    s = _fake_stream({1: b"Hi\nUs", 2: b"ual", 3: b"\nUse", 4: b"r: x"}, ("\nUser:",))
    assert s.push(1) == "Hi" and s.push(2) == "\nUsual" and s.push(3) == "" and s.push(4) == ""
    assert (s.text, s.stop) == ("Hi\nUsual", "\nUser:")
    # the earliest stop wins; at the same place, the first in the list
    s = _fake_stream({1: b"a ", 2: b"b c"}, ("c", "b c", "b"))
    assert s.push(1) == "a " and s.push(2) == "" and (s.text, s.stop) == ("a ", "b c")
    # a multi-byte stop string split inside a character
    s = _fake_stream({1: b"x \xe6", 2: b"\x97\xa5y"}, ("日",))
    assert s.push(1) == "x " and s.push(2) == "" and s.stop == "日"


def test_cancel_mid_answer_keeps_the_bookkeeping(smol: Engine) -> None:
    prompt = "Count: one, two, three,"
    steps = 0

    def step() -> None:
        nonlocal steps
        steps += 1
        if steps > 8:
            raise CancelledError("stop")

    full = run(smol, prompt=prompt, max_tokens=40, temperature=0.0)
    cut = run(smol, step, prompt=prompt, max_tokens=40, temperature=0.0)
    assert cut.finish_reason == "cancelled"
    assert 0 < cut.completion_tokens < full.completion_tokens and full.text.startswith(cut.text)
    # the KV holds the prompt and every sampled token but the last
    held = smol.kv_tokens()
    assert len(held) == cut.prompt_tokens + cut.completion_tokens - 1
    assert list(held[: cut.prompt_tokens]) == smol.prompts.completion_tokens(prompt)
    # a conversation continued after a cancel evaluates only the new tokens
    conv = run(smol, prompt=prompt, max_tokens=6, conversation="k", cache_prompt=None)
    more = run(smol, prompt=prompt + conv.text + " and", max_tokens=4, conversation="k", cache_prompt=None)
    assert more.prompt_tokens_evaluated < more.prompt_tokens
    assert run(smol, prompt=prompt, max_tokens=40, temperature=0.0).text == full.text


def test_flash_attn_is_a_model_setting(smollm2_path: Path, tmp_path: Path) -> None:
    from timeshare.core.config.files import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[[models]]\nid = "s"\npath = "{smollm2_path}"\nflash_attn = true\n')
    model = load_config(cfg).models[0]
    assert model.flash_attn is True and ModelConfig(id="x", path="p").flash_attn is False
    engine = Engine.load(ModelConfig(id="s", path=str(smollm2_path), n_ctx=512, flash_attn=True))
    try:
        assert engine.llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        assert run(engine, prompt=PROMPTS[0], max_tokens=4, temperature=0.0).completion_tokens > 0
    finally:
        engine.close()


def test_special_tokens_render_as_llama_server_renders_them(gemma3_path: Path) -> None:
    """Answers carry a token's text as llama-server's does (common_token_to_piece with special
    false unless --special): control tokens (``<end_of_turn>``, ``<pad>``) as nothing, user-defined
    ones as their text -- Gemma-3's ``<start_of_image>``, which its base model writes in chats, is
    streamed by llama-server too. The oracle is the vocabulary's own token attributes."""
    from llama_cpp import _internals
    from timeshare.core.worker.textstream import token_piece

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = _internals.LlamaModel(path_model=str(gemma3_path), params=params, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model.model)
        cache: dict[int, bytes] = {}
        kinds = {"control": 0, "user-defined": 0}
        for tok in range(int(llama_cpp.llama_vocab_n_tokens(vocab))):
            attr = int(llama_cpp.llama_vocab_get_attr(vocab, tok))
            if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
                assert token_piece(vocab, tok, cache) == b"", model.token_get_text(tok)
                kinds["control"] += 1
            elif attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED:
                assert token_piece(vocab, tok, cache) == model.token_get_text(tok).encode(), tok
                kinds["user-defined"] += 1
        assert kinds["control"] > 0 and kinds["user-defined"] > 0, kinds
        image = model.tokenize(b"<start_of_image>", add_bos=False, special=True)
        assert len(image) == 1 and token_piece(vocab, image[0], cache) == b"<start_of_image>"
        turn_end = model.tokenize(b"<end_of_turn>", add_bos=False, special=True)
        assert len(turn_end) == 1 and token_piece(vocab, turn_end[0], cache) == b""
    finally:
        model.close()
