"""How people name models: the API's resolver (id or display name, any case, no prefixes), the
CLI's (also a unique prefix; an ambiguous one lists the candidates) and a pull's names."""

from __future__ import annotations

import pytest
from timeshare.core.config.schema import ModelConfig
from timeshare.core.modelnames import (
    AmbiguousModelError,
    UnknownModelNameError,
    pulled_names,
    repo_label,
    resolve_api_model,
    resolve_cli_model,
)

MODELS = (
    ModelConfig(id="smollm2-135m-instruct", path="a.gguf", name="SmolLM2 135M Instruct"),
    ModelConfig(id="smollm2-135m-instruct-q8_0", path="b.gguf", name="SmolLM2-135M-Instruct Q8_0"),
    ModelConfig(id="gemma3-270m", path="c.gguf", name="Gemma 3 270M"),
    ModelConfig(id="plain", path="d.gguf"),  # no name: the id is the display name
)


def test_the_api_takes_the_id_or_the_display_name_in_any_case_and_no_prefix() -> None:
    assert resolve_api_model(MODELS, "gemma3-270m") == "gemma3-270m"
    assert resolve_api_model(MODELS, "GEMMA3-270M") == "gemma3-270m"
    assert resolve_api_model(MODELS, "gemma 3 270m") == "gemma3-270m"
    assert resolve_api_model(MODELS, "smollm2-135m-instruct q8_0") == "smollm2-135m-instruct-q8_0"
    assert resolve_api_model(MODELS, "Plain") == "plain"
    for unknown in ("gemma", "smollm2", "", "gemma3-270m "):
        assert resolve_api_model(MODELS, unknown) is None, unknown


def test_the_cli_also_takes_a_unique_prefix_and_lists_the_candidates_of_an_ambiguous_one() -> None:
    assert resolve_cli_model(MODELS, "gem") == "gemma3-270m"
    assert resolve_cli_model(MODELS, "Gemma 3") == "gemma3-270m"  # a display name's prefix
    # an exact id wins over being a prefix of another id
    assert resolve_cli_model(MODELS, "SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    with pytest.raises(AmbiguousModelError) as info:
        resolve_cli_model(MODELS, "smol")
    assert info.value.candidates == ("smollm2-135m-instruct", "smollm2-135m-instruct-q8_0")
    assert "smollm2-135m-instruct (SmolLM2 135M Instruct)" in str(info.value)
    with pytest.raises(UnknownModelNameError, match="the models are: smollm2-135m-instruct, "):
        resolve_cli_model(MODELS, "llama")


def test_a_pull_is_named_by_what_was_pulled_and_unique() -> None:
    assert repo_label("bartowski/SmolLM2-135M-Instruct-GGUF") == "SmolLM2-135M-Instruct"
    assert repo_label("unsloth/gemma-3-270m-it-GGUF") == "gemma-3-270m-it"
    assert repo_label("user/model") == "model"
    assert pulled_names("Gemma 3 270M Q4_0", ()) == ("gemma-3-270m-q4_0", "Gemma 3 270M Q4_0")
    # a name or id already used (in any case) gets a number
    first = ModelConfig(id="gemma-3-270m-q4_0", path="x", name="Gemma 3 270M Q4_0")
    model_id, name = pulled_names("gemma 3 270M q4_0", (first,))
    assert model_id == "gemma-3-270m-q4_0-2" and name == "gemma 3 270M q4_0 (2)"
    # given ones are kept as they are
    assert pulled_names("x", (first,), model_id="mine", name="Mine") == ("mine", "Mine")
