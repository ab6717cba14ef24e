"""The projector's weights go and come back with the model's (issue 41, item 5), in process on
the CPU build (the model loaded without mmap, as a CPU worker that releases does; the clip
context's weight buffer is host memory the in-place path frees there): found in the clip
context's warm-up encode, released with the model's weights (its buffer freed), restored in place
from a host shadow read from the projector's GGUF, bitwise: the image's first-token logprobs and
the answer are the same before and after release/restore cycles, the image encoded again by the
restored projector each time."""

from __future__ import annotations

# isort: off
import llama_cpp  # noqa: F401  (before anything that imports numpy)
# isort: on

from pathlib import Path

import pytest
from _vision_util import alone, ask, png, projector_for
from timeshare.core.config.schema import ModelConfig
from timeshare.core.residency import Residency, ResidencyOptions
from timeshare.core.worker.engine import Engine

RED = png((255, 0, 0))


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_the_projector_is_released_and_restored_with_the_weights_bitwise(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path: Path = request.getfixturevalue(f"{which}_path")
    proj = projector_for(path, tmp_path)
    engine = Engine.load(ModelConfig(id="v", path=str(path), n_ctx=512, mmproj=str(proj)), use_mmap=False)
    res = Residency.attach(engine.llm, str(path), ResidencyOptions(mode="inplace", host_shadow="pageable"))
    try:
        assert engine.vision is not None
        model_bytes = res.weight_bytes
        assert res.attach_projector(engine.vision.watch, proj), res.projector_note
        engine.vision.ready = res.projector_ready  # as the worker's tenancy wires it
        assert res.projector_bytes > 0 and res.weight_bytes == model_bytes + res.projector_bytes
        # the projector's buffer holds every tensor of its file (the plan's completeness check)
        assert res.projector_bytes >= engine.vision.weight_bytes
        before = alone(engine, messages=(ask(RED),), max_tokens=8)
        for _cycle in range(3):
            report = res.release()
            assert res.resident_bytes == 0 and report.released_bytes == res.weight_bytes
            restored = res.restore()
            assert restored.bytes == res.weight_bytes and res.resident_bytes == res.weight_bytes
            engine.vision.forget_encoded()  # the restored projector encodes the image again
            encodes = engine.vision.encodes
            after = alone(engine, messages=(ask(RED),), max_tokens=8)
            assert engine.vision.encodes == encodes + 1
            assert after.logprobs == before.logprobs and after.text == before.text
    finally:
        res.close()
        engine.close()


def test_doctor_checks_a_generated_projector_with_the_weights(smollm2_path: Path) -> None:
    """``timeshare doctor --mmproj generated``: the projector's bytes go with the weights and the
    same image's embeddings after each restore are bitwise the ones before."""
    from timeshare.core.diagnostics.doctor import run_doctor

    report = run_doctor(str(smollm2_path), 2, mmproj="generated")
    proj = report["projector"]
    assert proj["released_with_weights"] and proj["device_bytes"] > 0
    assert proj["bitwise_identical"] and proj["bitwise_identical_cycles"] == 2
    assert report["bitwise_identical"] and report["weight_bytes"] >= proj["device_bytes"]


def test_on_the_rebuild_path_the_projector_follows_the_reloaded_model(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """The rebuild path frees the model and loads it again: the projector's context, which holds
    the model, is made again (vision.Vision.ensure), stays where it is (nothing to move with a
    model that is not released in place) and the image answers the same."""
    proj = projector_for(smollm2_path, tmp_path)
    engine = Engine.load(
        ModelConfig(id="v", path=str(smollm2_path), n_ctx=512, mmproj=str(proj)), use_mmap=False
    )
    res = Residency.attach(engine.llm, str(smollm2_path), ResidencyOptions(mode="rebuild"))
    try:
        assert engine.vision is not None
        assert not res.attach_projector(engine.vision.watch, proj) and "rebuild" in res.projector_note
        before = alone(engine, messages=(ask(RED),), max_tokens=8)
        res.release()
        res.restore()
        engine.vision.forget_encoded()
        after = alone(engine, messages=(ask(RED),), max_tokens=8)
        assert after.text == before.text and after.logprobs == before.logprobs
    finally:
        res.close()
        engine.close()
