"""The generated projector (issue 41, item 1): a small real mmproj GGUF with random weights that
the real libmtmd of llama-cpp-python 0.3.36 loads for each demo model and runs on a PNG. Its
answers mean nothing; what must hold is mechanics: two different images give different
first-token logits, the same image gives bitwise the same ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from _vision_util import DirectMtmd, png, projector_for
from timeshare.core.diagnostics.synthetic_projector import ProjectorShape, write_projector


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_libmtmd_loads_the_generated_projector_and_sees_the_image(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model: Path = request.getfixturevalue(f"{which}_path")
    proj = projector_for(model, tmp_path)
    direct = DirectMtmd(model, proj)
    try:
        assert direct.support_vision()
        prompt = "User: <image> what is this?\nAssistant:"
        red = direct.first_logits(prompt, [png((255, 0, 0))])
        blue = direct.first_logits(prompt, [png((0, 0, 255))])
        red_again = direct.first_logits(prompt, [png((255, 0, 0))])
        # another picture of the same size and colour, one stripe apart
        striped = direct.first_logits(prompt, [png((255, 0, 0), stripe=True)])
    finally:
        direct.close()
    assert (red == red_again).all()
    assert abs(red - blue).max() > 1e-3
    assert abs(red - striped).max() > 0


def test_a_projector_for_another_width_is_refused_by_libmtmd(smollm2_path: Path, tmp_path: Path) -> None:
    """The width check is libmtmd's own (n_embd of the text model): a projector made for
    Gemma-3-270M (640) does not load beside SmolLM2 (576)."""
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    proj = write_projector(tmp_path / "wrong.gguf", 640, "mlp")
    llm = llama_cpp.Llama(str(smollm2_path), n_ctx=256, verbose=False)
    try:
        p = mtmd.mtmd_context_params_default()
        p.use_gpu, p.warmup = False, False
        assert not mtmd.mtmd_init_from_file(str(proj).encode(), llm.model, p)
    finally:
        llm.close()


def test_the_token_count_follows_the_shape() -> None:
    assert ProjectorShape().n_image_tokens("mlp") == 16
    assert ProjectorShape(patch_size=8, merge=2).n_image_tokens("gemma3") == 16
    with pytest.raises(ValueError):
        write_projector(Path("/nonexistent"), 576, "gemma3", ProjectorShape(patch_size=8, merge=3))
