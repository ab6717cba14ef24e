"""Embeddings and reranks of a released model (the lent H100's ``500 "the model's model is
released: call Residency.restore() before using it"`` on ``/v1/rerank``): an Embed makes the
weights resident before anything touches the model, as a generation does, and answers what it
answered before the release, bit for bit. On the rebuild path a release frees the model itself,
its vocabulary and the tokenizer's reference to it included (the GPU fell back to that path for
the synthetic reranker): texts were tokenized before the restore and the request failed.

Three levels: the engine with a rebuild-path residency (no process: the oracle is the same
engine's answer before the release); a real worker waiting for the token (an Embed that waits can
be cancelled, and generations queued behind it still run); a real ``timeshare serve`` with a chat
model and a generated tiny reranker (tests/_archs_util.write_reranker), released by ``sleep`` at
both levels and by a switch to the other model, on the in-place path and on the rebuild path
(``TIMESHARE_RESIDENCY_PATH=rebuild``, what the GPU did)."""

from __future__ import annotations

# isort: off
import llama_cpp  # noqa: F401  (before numpy: worker rule)
# isort: on

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _api_util import Served, start_serve, stop_serve_proc, write_config
from _archs_util import write_reranker
from _e_worker_util import GUARD_S, WorkerHandle
from timeshare.core.config.schema import ArenaConfig, ModelConfig
from timeshare.core.errors import ConfigError
from timeshare.core.observe import read_events
from timeshare.core.residency import Residency, ResidencyOptions
from timeshare.core.residency.residency import mode_wanted
from timeshare.core.wire import protocol as p
from timeshare.core.worker.engine import Engine

LONG_S = 300.0  # the hang guard of a long Embed on a busy machine (not a timing assertion)
TEXTS = ("The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "hi")
QUERY = "What is a giant panda?"
DOCUMENTS = (
    "The giant panda is a bear species endemic to China.",
    "Paris is the capital of France.",
    "Pandas eat bamboo.",
)


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    return write_reranker(tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf", smollm2_path)


# ---- the engine on the rebuild path ---------------------------------------------------------------


class Restorer:
    """The worker's ``before_step`` as far as residency goes: the weights come back first."""

    def __init__(self, res: Residency) -> None:
        self.res = res
        self.restores = 0

    def __call__(self) -> None:
        if not self.res.weights_resident:
            self.res.restore()
            self.restores += 1


def test_a_rebuilt_chat_model_embeds_after_its_release(smollm2_path: Path) -> None:
    engine = Engine.load(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2))
    res = Residency.attach(engine.llm, smollm2_path, ResidencyOptions(mode="rebuild"))
    try:
        assert res.path == "rebuild"
        before, n_before = engine.embed(TEXTS)
        token_ids = [list(engine.llm.tokenize(t.encode())) for t in TEXTS]
        ids_before, _ = engine.embed(token_ids)
        for inputs, want in ((TEXTS, before), (token_ids, ids_before)):
            res.release()  # the model, its vocabulary and the tokenizer's reference go
            restorer = Restorer(res)
            after, n_after = engine.embed(inputs, restorer)
            assert restorer.restores == 1
            assert after == want and n_after == n_before  # bit for bit
    finally:
        Restorer(res)()
        res.close()
        engine.close()


def test_a_rebuilt_reranker_scores_after_its_release(reranker_path: Path) -> None:
    engine = Engine.load(ModelConfig(id="rr", path=str(reranker_path), n_ctx=256, parallel=2))
    res = Residency.attach(engine.llm, reranker_path, ResidencyOptions(mode="rebuild"))
    try:
        assert engine.reranker and res.path == "rebuild"
        before, n_before = engine.rerank(QUERY, DOCUMENTS)
        res.release()
        restorer = Restorer(res)
        after, n_after = engine.rerank(QUERY, DOCUMENTS, restorer)
        assert restorer.restores == 1
        assert after == before and n_after == n_before
    finally:
        Restorer(res)()
        res.close()
        engine.close()


def test_the_residency_path_variable(
    smollm2_path: Path, tmp_path: Path, handles: list[WorkerHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIMESHARE_RESIDENCY_PATH: auto, inplace or rebuild (any case) override the worker's auto;
    anything else is an error naming the variable, and a worker started with it fails to load
    saying so."""
    for value, want in (("", "auto"), ("auto", "auto"), ("Rebuild", "rebuild"), (" inplace ", "inplace")):
        monkeypatch.setenv("TIMESHARE_RESIDENCY_PATH", value)
        assert mode_wanted("auto") == want
    monkeypatch.setenv("TIMESHARE_RESIDENCY_PATH", "fast")
    with pytest.raises(ConfigError, match=r"TIMESHARE_RESIDENCY_PATH='fast': give auto, inplace or rebuild"):
        mode_wanted("auto")
    w = WorkerHandle(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256), tmp_path, arena_dir=tmp_path / "a"
    )
    handles.append(w)
    err = w.expect(p.Error)
    assert err.fatal and err.code == "invalid_config" and "TIMESHARE_RESIDENCY_PATH='fast'" in err.message
    assert w.wait_exit() == 2


# ---- a worker that waits for the token ------------------------------------------------------------


def vectors_of(
    w: WorkerHandle, req: str, timeout: float = GUARD_S
) -> tuple[list[tuple[float, ...]], p.Done | p.Error]:
    """The vectors of Embed ``req`` and its Done or Error (messages already read for another
    request's collect included: request ids are not reused); ``timeout``: the hang guard."""
    out: list[tuple[float, ...]] = []
    pos = 0
    while True:
        if pos < len(w.seen):
            msg = w.seen[pos]
            pos += 1
        else:
            msg = w.expect((p.Embeddings, p.Done, p.Error), timeout=timeout, req=req)
            pos = len(w.seen)
        if getattr(msg, "req", None) != req:
            continue
        if isinstance(msg, p.Embeddings):
            out.extend(msg.data)
        elif isinstance(msg, (p.Done, p.Error)):
            return out, msg


def waiting_for(w: WorkerHandle, holder: str) -> None:
    """Until the worker says it waits for ``holder`` (the pinned holder of the token)."""
    status = w.expect(p.WorkerStatus)
    while "pinned" not in status.waiting_reason or holder not in status.waiting_reason:
        status = w.expect(p.WorkerStatus)
    assert not status.holds_token


def _ready(
    model: ModelConfig,
    tmp_path: Path,
    handles: list[WorkerHandle],
    arena: ArenaConfig | None = None,
    event_log: Path | None = None,
) -> WorkerHandle:
    """A worker of ``model`` in tmp_path/<its id>, on the arena tmp_path/arena (``arena``'s
    settings; default: no wait times out for 600 s), ready."""
    w = WorkerHandle(
        model,
        tmp_path / model.id,
        arena_dir=tmp_path / "arena",
        arena=arena if arena is not None else ArenaConfig(wait_timeout_s=600.0),
        event_log=event_log,
    )
    handles.append(w)
    w.ready()
    return w


def test_an_embed_waiting_for_the_token_is_cancelled_and_the_queue_goes_on(
    smollm2_path: Path, reranker_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    """The Embed waits for a pinned holder (no timeout for a minute and more: wait_timeout_s 600);
    its Cancel ends the wait at once, a Generate and an Embed queued behind it run once the holder
    lets go, the Embed's vectors those it gave before."""
    a = _ready(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2), tmp_path, handles)
    a.send(p.Embed(req="e0", inputs=TEXTS))
    want, done = vectors_of(a, "e0")
    assert isinstance(done, p.Done) and len(want) == len(TEXTS)
    b = _ready(ModelConfig(id="rr", path=str(reranker_path), n_ctx=256, pinned=True), tmp_path, handles)
    b.send(p.Wake())
    b.expect(p.WorkerStatus, holds_token=True)
    a.send(p.Embed(req="e1", inputs=TEXTS))
    waiting_for(a, "rr")
    a.send(p.Generate(req="g1", prompt="1, 2, 3,", sampling=p.INTERNAL_SAMPLING.replace(max_tokens=4)))
    a.send(p.Embed(req="e2", inputs=TEXTS))
    a.send(p.Cancel(req="e1"))
    got, done = vectors_of(a, "e1")
    assert got == [] and isinstance(done, p.Done) and done.finish_reason == "cancelled", done
    assert not a.status().holds_token  # it did not wait for the token to end
    b.send(p.Pin(False))  # the holder lets go: what was queued behind the cancelled Embed runs
    _, done = a.collect("g1")
    assert isinstance(done, p.Done) and done.usage.completion_tokens == 4, done
    got, done = vectors_of(a, "e2")
    assert isinstance(done, p.Done) and got == want


def takes_the_token_pinned(w: WorkerHandle) -> None:
    """``w`` pins itself and takes the token (a Wake): until a status sent after the Pin says it
    holds the token pinned. The statuses it sent before are read first (a status request's reply
    comes after them): one of an earlier holding would end the wait before the Wake had asked for
    the token at all (what made the test below hang: the Embed then ran at once, not waiting)."""
    assert not w.status(f"before-pin-{len(w.seen)}").pinned
    w.send(p.Pin(True))
    w.send(p.Wake())
    w.expect(p.WorkerStatus, holds_token=True, pinned=True)


def test_a_shutdown_ends_an_embeds_wait_for_the_token(
    smollm2_path: Path, reranker_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    """The other model takes the token back and keeps it (pinned); an Embed waits for it; a
    Shutdown ends the wait with a cancel or an error, and the worker exits cleanly."""
    a = _ready(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2), tmp_path, handles)
    b = _ready(ModelConfig(id="rr", path=str(reranker_path), n_ctx=256), tmp_path, handles)
    a.send(p.Embed(req="e0", inputs=TEXTS))
    _, done = vectors_of(a, "e0")
    assert isinstance(done, p.Done)
    assert a.status().holds_token  # it keeps the token while nobody asks for it
    takes_the_token_pinned(b)
    a.send(p.Embed(req="e3", inputs=TEXTS))
    waiting_for(a, "rr")
    a.send(p.Shutdown(save_kv=False))
    got, end = vectors_of(a, "e3")
    assert got == [] and (isinstance(end, p.Error) or end.finish_reason == "cancelled"), end
    assert a.wait_exit() == 0
    assert b.status().holds_token  # the holder was never asked to leave


def test_a_rerank_waiting_for_the_token_is_cancelled_or_ended_by_a_shutdown(
    smollm2_path: Path, reranker_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    """The same through the rerank path (an Embed with a query): the reranker waits for the pinned
    chat model; a Cancel ends the wait at once, a rerank queued behind it scores as before once the
    holder lets go, and a Shutdown ends another wait."""
    rr = _ready(ModelConfig(id="rr", path=str(reranker_path), n_ctx=256), tmp_path, handles)
    chat = _ready(ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256), tmp_path, handles)
    rr.send(p.Embed(req="r0", inputs=DOCUMENTS, query=QUERY))
    want, done = vectors_of(rr, "r0")
    assert isinstance(done, p.Done) and len(want) == len(DOCUMENTS)
    takes_the_token_pinned(chat)
    rr.send(p.Embed(req="r1", inputs=DOCUMENTS, query=QUERY))
    waiting_for(rr, "smol")
    rr.send(p.Embed(req="r2", inputs=DOCUMENTS, query=QUERY))
    rr.send(p.Cancel(req="r1"))
    got, done = vectors_of(rr, "r1")
    assert got == [] and isinstance(done, p.Done) and done.finish_reason == "cancelled", done
    chat.send(p.Pin(False))  # the holder lets go: the rerank queued behind the cancelled one runs
    got, done = vectors_of(rr, "r2")
    assert isinstance(done, p.Done) and done.switch.switched and got == want
    takes_the_token_pinned(chat)
    rr.send(p.Embed(req="r3", inputs=DOCUMENTS, query=QUERY))
    waiting_for(rr, "smol")
    rr.send(p.Shutdown(save_kv=False))
    got, end = vectors_of(rr, "r3")
    assert got == [] and (isinstance(end, p.Error) or end.finish_reason == "cancelled"), end
    assert rr.wait_exit() == 0


def test_a_rerank_waits_for_another_models_batch_and_both_answer_as_alone(
    smollm2_path: Path, reranker_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    """A rerank sent while another model's generation batch holds the GPU: the batch gives way
    after its quantum, the rerank scores, the batch takes the GPU back; no one waits for the
    other for good, and each answers what it answers alone."""
    arena = ArenaConfig(min_quantum_ms=50.0, wait_timeout_s=120.0)
    gen = _ready(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2), tmp_path, handles, arena
    )
    rr = _ready(ModelConfig(id="rr", path=str(reranker_path), n_ctx=256), tmp_path, handles, arena)
    rr.send(p.Embed(req="r0", inputs=DOCUMENTS, query=QUERY))
    want_scores, done = vectors_of(rr, "r0")
    assert isinstance(done, p.Done)
    sampling = p.INTERNAL_SAMPLING.replace(max_tokens=32, temperature=0.0)
    want_text, done = gen.generate("g0", prompt="1, 2, 3, 4,", sampling=sampling, cache_prompt=False)
    assert isinstance(done, p.Done) and done.usage.completion_tokens == 32
    gen.send(p.Generate(req="g1", prompt="1, 2, 3, 4,", sampling=sampling, cache_prompt=False))
    gen.expect(p.Token, req="g1")  # the batch runs, holding the GPU
    rr.send(p.Embed(req="r1", inputs=DOCUMENTS, query=QUERY))
    scores, done = vectors_of(rr, "r1")
    assert isinstance(done, p.Done) and done.switch.switched and scores == want_scores
    text, done = gen.collect("g1")
    assert isinstance(done, p.Done) and text == want_text


@pytest.mark.parametrize("path", ["auto", "rebuild"])
def test_a_long_embed_gives_the_gpu_way_after_the_quantum(
    path: str,
    smollm2_path: Path,
    reranker_path: Path,
    tmp_path: Path,
    handles: list[WorkerHandle],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An Embed of many inputs (one sequence: a decode each) is a batch of work like a
    generation's: when another model asks for the GPU, it gives way after the quantum (50 ms here)
    and takes it back to go on (the token's intervals: smol, rr, smol while it runs), and its
    vectors are those it gave alone. On the rebuild path the context is made again meanwhile.
    One CPU thread per worker, and a long hang guard: 60 inputs decoded one at a time by two
    threads on a machine that other jobs keep busy took over a minute (ggml's threads wait for
    each other after every operation)."""
    monkeypatch.setenv("TIMESHARE_RESIDENCY_PATH", path)
    monkeypatch.setenv("TIMESHARE_CPU_THREADS", "1")
    log = tmp_path / "intervals.jsonl"
    arena_dir = tmp_path / "arena"
    arena = ArenaConfig(min_quantum_ms=50.0, wait_timeout_s=120.0)
    a = WorkerHandle(
        ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=1),
        tmp_path / "a",
        arena_dir=arena_dir,
        arena=arena,
        event_log=log,
    )
    handles.append(a)
    assert a.ready().info.residency_path == ("rebuild" if path == "rebuild" else "inplace")
    many = tuple(f"{i}: the quick brown fox" for i in range(60))
    a.send(p.Embed(req="e0", inputs=many))
    want, done = vectors_of(a, "e0", LONG_S)
    assert isinstance(done, p.Done) and len(want) == len(many)
    b = WorkerHandle(
        ModelConfig(id="rr", path=str(reranker_path), n_ctx=256),
        tmp_path / "b",
        arena_dir=arena_dir,
        arena=arena,
        event_log=log,
    )
    handles.append(b)
    b.ready()
    a.send(p.Embed(req="e1", inputs=many))
    a.expect(p.WorkerStatus, busy=True, holds_token=True)  # at it
    b.send(p.Embed(req="r1", inputs=DOCUMENTS, query=QUERY))
    scores, done = vectors_of(b, "r1", LONG_S)
    assert isinstance(done, p.Done) and len(scores) == len(DOCUMENTS)
    got, done = vectors_of(a, "e1", LONG_S)
    assert isinstance(done, p.Done) and got == want
    a.close()
    b.close()
    holders = [r["model"] for r in sorted(read_events(log), key=lambda r: r["start"]) if r["kind"] == "token"]
    assert holders[-3:] == ["smol", "rr", "smol"], holders


def test_a_stream_of_embeds_gives_the_gpu_way_between_two(
    smollm2_path: Path, reranker_path: Path, tmp_path: Path, handles: list[WorkerHandle]
) -> None:
    """Embeds queued one behind the other, each shorter than the quantum (a minute here): when
    another model asks for the GPU, the worker gives way at the end of the Embed it is at, as at
    the end of a generation batch (between requests the quantum does not apply), and takes it
    back for the rest (the token's intervals: smol, rr, smol); every answer is the one it gives
    alone. Each Embed starts a quantum of its own, so without this the other model waited for
    the whole stream."""
    log = tmp_path / "intervals.jsonl"
    arena = ArenaConfig(min_quantum_ms=60000.0, wait_timeout_s=600.0)
    smol = ModelConfig(id="smol", path=str(smollm2_path), n_ctx=256, parallel=2)
    a = _ready(smol, tmp_path, handles, arena, log)
    b = _ready(ModelConfig(id="rr", path=str(reranker_path), n_ctx=256), tmp_path, handles, arena, log)
    b.send(p.Embed(req="r0", inputs=DOCUMENTS, query=QUERY))
    want_scores, done = vectors_of(b, "r0")
    assert isinstance(done, p.Done)
    inputs = tuple(f"{i}: the quick brown fox" for i in range(4))
    a.send(p.Embed(req="e0", inputs=inputs))
    want, done = vectors_of(a, "e0")
    assert isinstance(done, p.Done) and len(want) == len(inputs)
    stream = [f"e{i}" for i in range(1, 4)]
    for req in stream:
        a.send(p.Embed(req=req, inputs=inputs))
    a.expect(p.WorkerStatus, busy=True, holds_token=True)  # at the first of them
    b.send(p.Embed(req="r1", inputs=DOCUMENTS, query=QUERY))
    scores, done = vectors_of(b, "r1")
    assert isinstance(done, p.Done) and done.switch.switched and scores == want_scores
    for req in stream:
        got, done = vectors_of(a, req)
        assert isinstance(done, p.Done) and got == want, req
    a.close()
    b.close()
    holders = [r["model"] for r in sorted(read_events(log), key=lambda r: r["start"]) if r["kind"] == "token"]
    assert holders[-3:] == ["smol", "rr", "smol"], holders


# ---- a real `timeshare serve` ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["auto", "rebuild"])
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    reranker_path: Path,
    smollm2_path: Path,
) -> Iterator[tuple[str, Served]]:
    path = str(request.param)
    home = tmp_path_factory.mktemp(f"embed-residency-{path}")
    config = write_config(
        home / "config.toml",
        [("smol", smollm2_path), ("rr", reranker_path)],
        extra_model_lines="n_ctx = 256\nparallel = 2\nidle_sleep_s = false",
    )
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("TIMESHARE_RESIDENCY_PATH", path)
    try:
        server = start_serve(home / "home", config=config)
    finally:
        monkeypatch.undo()
    try:
        server.wait_ready(["smol", "rr"])
        yield path, server
    finally:
        stop_serve_proc(server.proc)


def embed(served: Served) -> list[list[float]]:
    r = httpx.post(f"{served.url}/v1/embeddings", json={"model": "smol", "input": list(TEXTS)}, timeout=120)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def rerank(served: Served) -> list[tuple[int, float]]:
    r = httpx.post(
        f"{served.url}/v1/rerank",
        json={"model": "rr", "query": QUERY, "documents": list(DOCUMENTS)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return [(x["index"], x["relevance_score"]) for x in r.json()["results"]]


def sleep(served: Served, model: str, level: str) -> None:
    r = httpx.post(f"{served.url}/timeshare/v1/models/{model}/sleep", json={"level": level}, timeout=60)
    assert r.status_code == 200, r.text
    state = "sleeping" if level == "weights+kv" else "released"
    served.wait_until(lambda _s: served.model_status(model)["state"] == state, f"{model} {state}", 60)


def test_a_released_model_embeds_and_reranks_as_before(served: tuple[str, Served]) -> None:
    path, server = served
    for model in ("smol", "rr"):
        want = "rebuild" if path == "rebuild" else "inplace"
        assert server.model_status(model)["residency_path"] == want, server.model_status(model)
    vectors = embed(server)  # smol restores; rr gives way (one-model budget)
    scores = rerank(server)  # a switch: smol released, rr restored
    assert len(vectors) == len(TEXTS) and len(scores) == len(DOCUMENTS)
    assert embed(server) == vectors  # a switch back
    assert rerank(server) == scores
    for level in ("weights", "weights+kv"):
        for model in ("smol", "rr"):
            sleep(server, model, level)
        assert embed(server) == vectors, level
        sleep(server, "smol", level)
        assert rerank(server) == scores, level
    assert "is released: call Residency.restore()" not in server.log_text()
