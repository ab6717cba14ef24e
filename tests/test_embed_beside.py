"""Embeddings beside generating sequences (issue 45's leftover): an Embed sent to a chat model's
worker while a batch decodes runs between two of its steps, in the sequences the batch leaves
idle, instead of waiting for every answer to end; the answer being generated is the one it gives
alone, and the vectors are the ones the Embed gives alone."""

from __future__ import annotations

from pathlib import Path

import llama_cpp  # noqa: F401  (before numpy: worker rule)
import pytest
from _e_worker_util import WorkerHandle
from timeshare.core.config.schema import ModelConfig
from timeshare.core.wire import protocol as p

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9,"  # a raw prompt SmolLM2 continues for long
TEXTS = ("The quick brown fox", "jumps over the lazy dog", "Hello there")


def vectors(w: WorkerHandle, req: str) -> list[tuple[float, ...]]:
    out: list[tuple[float, ...]] = []
    while True:
        msg = w.expect((p.Embeddings, p.Done, p.Error), req=req)
        if isinstance(msg, p.Embeddings):
            out.extend(msg.data)
            continue
        assert isinstance(msg, p.Done), msg
        return out


def test_an_embed_runs_between_the_steps_of_a_batch(tmp_path: Path, smollm2_path: Path) -> None:
    w = WorkerHandle(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=512, parallel=2), tmp_path)
    try:
        w.ready()
        alone_text, done = w.generate("g0", prompt=PROMPT, max_tokens=64, temperature=0.0, cache_prompt=False)
        assert isinstance(done, p.Done) and done.usage.completion_tokens == 64
        w.send(p.Embed(req="e0", inputs=TEXTS))
        alone = vectors(w, "e0")
        # a batch is decoding (its first piece came), then the Embed arrives
        w.send(
            p.Generate(
                req="g1",
                prompt=PROMPT,
                cache_prompt=False,
                sampling=p.INTERNAL_SAMPLING.replace(max_tokens=64, temperature=0.0),
            )
        )
        w.expect(p.Token, req="g1")
        w.send(p.Embed(req="e1", inputs=TEXTS))
        finished: list[str] = []
        beside: list[tuple[float, ...]] = []
        pieces: list[str] = []
        while len(finished) < 2:
            msg = w.next()
            if isinstance(msg, p.Embeddings) and msg.req == "e1":
                beside.extend(msg.data)
            elif isinstance(msg, p.Token) and msg.req == "g1":
                pieces.append(msg.text)
            elif isinstance(msg, (p.Done, p.Error)) and msg.req in ("e1", "g1"):
                assert isinstance(msg, p.Done), msg
                finished.append(msg.req)
        # the Embed did not wait for the answer to end
        assert finished == ["e1", "g1"]
        assert len(beside) == len(TEXTS)
        for got, want in zip(beside, alone, strict=True):
            assert got == pytest.approx(want, abs=1e-6)
        # the answer is the one it gives alone (its first piece came before the Embed)
        assert alone_text.endswith("".join(pieces)) and len(pieces) > 1
        assert "Traceback" not in w.log_text()
    finally:
        w.close()
