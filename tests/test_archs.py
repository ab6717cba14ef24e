"""The architecture matrix (issue 38, items 4-5): tiny generated models of the families people
run (tests/_archs_util.py: dense, sliding-window, MoE, gpt-oss, recurrent, hybrid, encoder), each
loaded, checked by ``timeshare doctor`` and switched under the one-model budget with answers equal
to those before the switch; the prompt-cache reuse of a keyless second turn is measured (and
written to the test's output: docs/ARCHITECTURES.md has the table)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import llama_cpp  # before numpy (worker rule)
import pytest
from _archs_util import KINDS, write_model
from _e_worker_util import WorkerHandle
from timeshare.core.config.schema import ArenaConfig, ModelConfig
from timeshare.core.diagnostics.doctor import run_doctor
from timeshare.core.diagnostics.residency_check import (
    EMBEDDINGS,
    REWIND,
    SAVED_STATE,
    GreedyReplay,
    load_for_check,
)
from timeshare.core.sampling import Sampling
from timeshare.core.wire import protocol as p

ARCHS = list(KINDS)
#: how each architecture's doctor check replays (a sliding window of 8 tokens is shorter than
#: the check's prompt: its cells before the window are gone, so it replays from a saved state)
CHECK = {
    "llama": REWIND,
    "qwen3moe": REWIND,
    "gemma3": SAVED_STATE,
    "gpt-oss": SAVED_STATE,
    "mamba2": SAVED_STATE,
    "lfm2": SAVED_STATE,
    "granitehybrid": SAVED_STATE,
    "qwen3next": SAVED_STATE,
    "qwen35": SAVED_STATE,
    "bert": EMBEDDINGS,
}
#: how the KV level (a deep release, issue 39) goes: in place (the context kept, its KV cells and
#: compute buffers released and back with the weights), else the context is freed and made again,
#: for the reason the report gives (never a crash)
KV_LEVEL = {
    "llama": "",
    "qwen3moe": "",
    "gemma3": "sliding-window",
    "gpt-oss": "sliding-window",
    "mamba2": "recurrent or hybrid",
    "lfm2": "recurrent or hybrid",
    "granitehybrid": "recurrent or hybrid",
    "qwen3next": "recurrent or hybrid",
    "qwen35": "recurrent or hybrid",
    "bert": "no KV cache",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("archs")
    return {a: write_model(a, d / f"{a}.gguf", smollm2_path) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_doctor_checks_every_architecture(arch: str, models: dict[str, Path]) -> None:
    # before: recurrent and hybrid models raised "llama_decode returned -1" (the check rewound a
    # state that cannot rewind), encoders "Memory is not initialized"
    report = run_doctor(str(models[arch]), 2)
    assert report["check"] == CHECK[arch]
    assert report["path"] == "inplace", report["reason"]
    assert report["bitwise_identical"] and report["kv_level_bitwise_identical"], report
    assert report["released_fraction"] > 0.9
    kv_level, why = report["kv_level"], KV_LEVEL[arch]
    assert kv_level["in_place"] == (why == ""), kv_level
    assert why in kv_level["note"] and (why == "") == (kv_level["note"] == ""), kv_level
    assert kv_level["compute_buffers_released"]
    # bert's classifier head (cls.*) is used only by rank pooling: the warm-up graph does not show
    # it, and before, that sent the model to the rebuild path ("not covered by the tensors ...")
    listed = ["cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"] if arch == "bert" else []
    assert sorted(report["weights_from_tensor_list"]) == sorted(listed)


@pytest.mark.parametrize("arch", ["mamba2", "granitehybrid"])
def test_the_saved_state_check_sees_a_lost_state(arch: str, models: dict[str, Path]) -> None:
    """The check can fail: a state that did not survive (here: cleared) is not the same run."""
    loaded = load_for_check(str(models[arch]), 1, n_ctx=256)
    llm = loaded.llm
    try:
        replay = GreedyReplay(llm)
        assert replay.kind == SAVED_STATE
        reference = replay.run()
        assert replay.run() == reference
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        assert replay.run() != reference
        assert replay.run() == reference  # put back after each run
    finally:
        llm.close()


# ---- switched under the one-model budget ------------------------------------------------------


@pytest.fixture(scope="module")
def arena_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("archs-arena") / "arena"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture(scope="module")
def partner(
    models: dict[str, Path], arena_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerHandle]:
    """The other model of the one-model budget: asking it something takes the device."""
    w = WorkerHandle(
        ModelConfig(id="partner", path=str(models["llama"]), n_ctx=256),
        tmp_path_factory.mktemp("partner"),
        arena_dir=arena_dir,
        arena=ArenaConfig(min_quantum_ms=0.0),
    )
    w.ready()
    yield w
    w.close()


GREEDY = Sampling(max_tokens=8, temperature=0.0)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8 + "Once upon a time"  # past the prompt
# cache's similarity rule (a reuse of at least 64 tokens: core/worker/engine.py)


def take_device(partner: WorkerHandle, req: str) -> None:
    _, done = partner.generate(req, prompt="Hello", sampling=Sampling(max_tokens=1, temperature=0.0))
    assert isinstance(done, p.Done)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "bert"])
def test_switched_answers_equal_and_prompt_cache_reuse(
    arch: str,
    models: dict[str, Path],
    arena_dir: Path,
    partner: WorkerHandle,
    tmp_path: Path,
    handles: list[WorkerHandle],
) -> None:
    w = WorkerHandle(
        ModelConfig(id=arch, path=str(models[arch]), n_ctx=512),
        tmp_path,
        arena_dir=arena_dir,
        arena=ArenaConfig(min_quantum_ms=0.0),
    )
    handles.append(w)
    w.ready()
    ref, done = w.generate("ref", prompt=PROMPT, sampling=GREEDY)
    assert isinstance(done, p.Done)
    take_device(partner, f"{arch}-p1")
    text, done = w.generate("again", prompt=PROMPT, sampling=GREEDY)
    assert isinstance(done, p.Done) and done.switch.switched
    assert text == ref
    # a keyless client's next turn: the last prompt, the answer and more
    take_device(partner, f"{arch}-p2")
    turn2 = PROMPT + text + " and then"
    text2, done2 = w.generate("turn2", prompt=turn2, sampling=GREEDY)
    assert isinstance(done2, p.Done) and done2.switch.switched
    u = done2.usage
    print(f"\nARCH {arch} turn2 prompt_tokens={u.prompt_tokens} evaluated={u.prompt_tokens_evaluated}")
    # a KV cache keeps the common prefix; a recurrent state goes back to its checkpoint at the end
    # of the last prompt (before: mamba2, lfm2, qwen3next and qwen35 evaluated the whole prompt)
    assert u.prompt_tokens_evaluated < u.prompt_tokens - 100
    fresh, done3 = w.generate("fresh", prompt=turn2, sampling=GREEDY, cache_prompt=False)
    assert isinstance(done3, p.Done) and done3.usage.prompt_tokens_evaluated == u.prompt_tokens
    assert text2 == fresh  # the reused state answers as a prompt evaluated from scratch


@pytest.mark.slow
def test_an_encoder_embeds_the_same_after_a_switch(
    models: dict[str, Path],
    arena_dir: Path,
    partner: WorkerHandle,
    tmp_path: Path,
    handles: list[WorkerHandle],
) -> None:
    w = WorkerHandle(
        ModelConfig(id="bert", path=str(models["bert"]), n_ctx=256, embedding=True),
        tmp_path,
        arena_dir=arena_dir,
        arena=ArenaConfig(min_quantum_ms=0.0),
    )
    handles.append(w)
    w.ready()

    def embed(req: str) -> tuple[tuple[float, ...], ...]:
        w.send(p.Embed(req=req, inputs=(PROMPT, "Hello there")))
        got: p.Embeddings = w.expect(p.Embeddings, req=req)
        w.expect(p.Done, req=req)
        return got.data

    ref = embed("ref")
    take_device(partner, "bert-p1")
    assert embed("again") == ref


# ---- repacked buffers are spot-checked against the file too ------------------------------------


@pytest.mark.parametrize("name", ["output.weight", "blk.1.ffn_up.weight"])
def test_a_changed_file_is_seen_in_a_repacked_buffer(name: str, small_q4_path: Path, tmp_path: Path) -> None:
    """Q4_0 weights go to the CPU backend's repacking buffer (CPU_REPACK), whose bytes are not
    the file's: the spot check repacks the file's bytes of its first and last tensor and compares
    (before: never checked, so a file changed after loading went unseen there)."""
    import gguf
    from _residency_util import load
    from timeshare.core.errors import ModelFileError
    from timeshare.core.residency import Residency, ResidencyOptions

    path = Path(shutil.copy(small_q4_path, tmp_path / "q4.gguf"))
    llm = load(path)
    try:
        res = Residency.attach(llm, str(path), ResidencyOptions(mode="inplace"))
        buffers = {b.buft_name for b in res.inplace_view.buffers} if res.inplace_view else set()
        assert (
            res._inplace is not None and res._inplace.host_shadow.verified_repacked == 2
        )  # its first and last
        res.close()
        assert "CPU_REPACK" in buffers
        offset = next(int(t.data_offset) for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
        with path.open("r+b") as f:  # one byte of a block's quants (not its scale)
            f.seek(offset + 4)
            byte = f.read(1)[0]
            f.seek(offset + 4)
            f.write(bytes([byte ^ 0xFF]))
        with pytest.raises(ModelFileError, match=name.replace(".", r"\.")):
            Residency.attach(llm, str(path), ResidencyOptions(mode="inplace"))
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mamba2", "lfm2"])
def test_the_worker_reports_how_its_kv_level_goes(
    arch: str, models: dict[str, Path], arena_dir: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    """Issue 39, item 3: a sliding-window, recurrent or hybrid model's deep release frees its
    context (the KV buffers are not the plain cache's): its Ready says so, in words; a plain one's
    is in place (no note). After a sleep (the context freed) it answers as before."""
    w = WorkerHandle(
        ModelConfig(id=f"kv-{arch}", path=str(models[arch]), n_ctx=256),
        tmp_path,
        arena_dir=arena_dir,
        arena=ArenaConfig(min_quantum_ms=0.0),
    )
    handles.append(w)
    info = w.ready().info
    assert KV_LEVEL[arch] in info.deep_note and (KV_LEVEL[arch] == "") == (info.deep_note == ""), info
    ref, done = w.generate("ref", prompt=PROMPT, sampling=GREEDY)
    assert isinstance(done, p.Done)
    w.send(p.Sleep(level="weights+kv"))
    text, done = w.generate("again", prompt=PROMPT, sampling=GREEDY)
    assert isinstance(done, p.Done) and text == ref
