"""Reranking (issue 42, item 2): a generated tiny reranker (tests/_archs_util.write_reranker: bert
layout, random weights, pooling rank, a classifier head) loads as a model, scores query and
document pairs packed several to a decode, and ``/v1/rerank`` answers as llama-server does. The
oracle is llama-cpp-python itself: a fresh ``Llama(embedding=True, pooling_type=RANK)`` that
scores each pair alone (the pair's tokens built here, as llama-server's format_prompt_rerank
builds them)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp  # before numpy (worker rule)
import pytest
from _api_util import Served, serve_env, start_serve, stop_serve_proc, write_config
from _archs_util import write_reranker
from timeshare.core.config.schema import ModelConfig
from timeshare.core.errors import InvalidInputError, InvalidSamplingError
from timeshare.core.gguf.catalog import model_config_from_entry, read_gguf_header, read_pooling
from timeshare.core.wire.protocol import Generate
from timeshare.core.worker.engine import Engine

QUERY = "What is a giant panda?"
DOCUMENTS = [
    "The giant panda is a bear species endemic to China.",
    "Paris is the capital of France.",
    "A machine is a physical system that uses power.",
    "Pandas eat bamboo.",
    "hi",
    "Learning is the process of acquiring new understanding, knowledge and skills.",
]
TEMPLATE = "<|im_start|>query: {query}\ndocument: {document}<|im_end|>"
#: the worker's packed scores against the oracle's one pair at a time (float32 sums)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("rerankers")
    return {
        "plain": write_reranker(d / "tiny-reranker.gguf", smollm2_path),
        "template": write_reranker(d / "tiny-reranker-template.gguf", smollm2_path, rerank_template=TEMPLATE),
    }


def pair_tokens(llm: Any, query: str, document: str, template: str | None) -> list[int]:
    """The oracle's own formatting (llama-server's format_prompt_rerank, written out here)."""
    if template is not None:
        text = template.replace("{query}", query).replace("{document}", document)
        return list(llm.tokenize(text.encode(), add_bos=False, special=True))
    vocab = llm._model.vocab
    q = llm.tokenize(query.encode(), add_bos=False, special=False)
    d = llm.tokenize(document.encode(), add_bos=False, special=False)
    bos, eos, sep = (
        int(f(vocab))
        for f in (llama_cpp.llama_vocab_bos, llama_cpp.llama_vocab_eos, llama_cpp.llama_vocab_sep)
    )
    assert llama_cpp.llama_vocab_get_add_bos(vocab) and llama_cpp.llama_vocab_get_add_eos(vocab)
    assert llama_cpp.llama_vocab_get_add_sep(vocab)
    return [bos, *q, eos, sep, *d, eos]


def oracle_scores(path: Path, query: str, documents: list[str], template: str | None) -> list[float]:
    llm = llama_cpp.Llama(
        str(path), n_ctx=256, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, verbose=False
    )
    try:
        ctx = llm.ctx
        assert llama_cpp.llama_pooling_type(ctx) == llama_cpp.LLAMA_POOLING_TYPE_RANK
        scores = []
        for document in documents:
            tokens = pair_tokens(llm, query, document, template)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
            try:
                for i, token in enumerate(tokens):
                    batch.token[i] = token
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1
                batch.n_tokens = len(tokens)
                assert llama_cpp.llama_decode(ctx, batch) == 0
                scores.append(float(llama_cpp.llama_get_embeddings_seq(ctx, 0)[0]))
            finally:
                llama_cpp.llama_batch_free(batch)
        return scores
    finally:
        llm.close()


@pytest.mark.parametrize("kind", ["plain", "template"])
def test_scores_equal_the_model_scoring_each_pair_alone(kind: str, rerankers: dict[str, Path]) -> None:
    path = rerankers[kind]
    want = oracle_scores(path, QUERY, DOCUMENTS, TEMPLATE if kind == "template" else None)
    assert len(set(want)) == len(want)  # the documents score differently: the order means something
    # the entry does not say embedding = true: the GGUF's rank pooling makes it a reranker
    engine = Engine.load(ModelConfig(id="rr", path=str(path), n_ctx=256, parallel=4))
    try:
        assert engine.reranker and engine.pooling == "rank" and engine.model.embedding
        steps: list[int] = []
        scores, tokens = engine.rerank(QUERY, DOCUMENTS, lambda: steps.append(1))
        assert [len(s) for s in scores] == [1] * len(DOCUMENTS)
        got = [s[0] for s in scores]
        assert got == pytest.approx(want, abs=TOLERANCE)
        assert sorted(range(len(got)), key=lambda i: -got[i]) == sorted(
            range(len(want)), key=lambda i: -want[i]
        )
        # 6 pairs in 4 sequences: packed, fewer decodes than pairs (before_step runs once more first)
        assert len(steps) - 1 < len(DOCUMENTS)
        assert tokens > len(DOCUMENTS) * 4
        # one document alone scores as in the batch
        alone = [engine.rerank(QUERY, [d])[0][0][0] for d in DOCUMENTS]
        assert alone == pytest.approx(got, abs=TOLERANCE)
    finally:
        engine.close()


def test_a_reranker_answers_rerank_only(rerankers: dict[str, Path]) -> None:
    engine = Engine.load(ModelConfig(id="rr", path=str(rerankers["plain"]), n_ctx=256))
    try:
        with pytest.raises(InvalidInputError, match="is a reranker"):
            engine.embed(["hello"])
        with pytest.raises(InvalidSamplingError, match="is a reranker"):
            engine.prepare(Generate(req="r1", prompt="hello"))
        with pytest.raises(InvalidInputError, match=r"documents\[1\] must be a string"):
            engine.rerank(QUERY, ["a", (1, 2)])
    finally:
        engine.close()


def test_a_chat_model_is_not_a_reranker(smollm2_path: Path) -> None:
    engine = Engine.load(ModelConfig(id="smol", name="SmolLM2", path=str(smollm2_path), n_ctx=256))
    try:
        assert not engine.reranker and engine.pooling == ""
        with pytest.raises(InvalidInputError, match="SmolLM2 is not a reranker"):
            engine.rerank(QUERY, DOCUMENTS)
    finally:
        engine.close()


def test_the_catalog_and_pull_see_a_reranker(rerankers: dict[str, Path], smollm2_path: Path) -> None:
    entry = read_gguf_header(rerankers["plain"])
    assert entry.pooling == "rank"
    assert model_config_from_entry(entry).embedding  # timeshare pull adds it as a reranker
    assert read_pooling(rerankers["template"]) == "rank"
    assert read_pooling(smollm2_path) == ""
    assert not model_config_from_entry(read_gguf_header(smollm2_path)).embedding


def test_ls_and_show_without_a_running_instance_say_rerank(
    tmp_path: Path, rerankers: dict[str, Path], smollm2_path: Path
) -> None:
    """The offline ``ls`` (``--json`` and the table) and ``show`` read the file's header: a
    reranker's capabilities are ``rerank``, as /v1/models lists it once loaded, also as ``timeshare
    pull`` adds one (``embedding = true``); a chat model's are unchanged."""
    config = tmp_path / "c.toml"
    config.write_text(
        f'[[models]]\nid = "rr"\npath = "{rerankers["plain"]}"\n\n'
        f'[[models]]\nid = "rr-pulled"\npath = "{rerankers["template"]}"\nembedding = true\n\n'
        f'[[models]]\nid = "smol"\npath = "{smollm2_path}"\n'
    )
    env = serve_env(tmp_path / "home")  # nothing runs there

    def cli(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "timeshare", "--config", str(config), *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0 and "not running" in done.stderr, done.stderr
        return done.stdout

    listed = {m["id"]: m["capabilities"] for m in json.loads(cli("ls", "--json"))["data"]}
    assert listed["rr"] == listed["rr-pulled"] == ["rerank"]
    assert "completion" in listed["smol"] and "rerank" not in listed["smol"]
    table = {line.split()[0]: line.split()[-1] for line in cli("ls").splitlines()[1:]}
    assert table["rr"] == table["rr-pulled"] == "rerank" and "completion" in table["smol"]
    assert "Capabilities  rerank\n" in cli("show", "rr")
    assert "Capabilities  rerank\n" in cli("show", "rr-pulled")
    assert "Capabilities  completion, chat" in cli("show", "smol")


def test_v1_models_lists_a_reranker_before_its_worker_has_loaded(
    rerankers: dict[str, Path], smollm2_path: Path
) -> None:
    """Before any worker has loaded (the pool's first snapshot: every model "starting"), the API
    reads the GGUF header as the Ollama routes do: the reranker is listed as one by /v1/models and
    /v1/models/{id} (not as a chat model), the chat model as before, and /api/tags agrees."""
    from timeshare.core.api.server import ApiServer
    from timeshare.core.config.schema import ApiConfig, Config
    from timeshare.core.pool.supervisor import Pool

    pool = Pool(
        Config(
            models=(
                ModelConfig(id="rr", path=str(rerankers["plain"])),
                ModelConfig(id="smol", path=str(smollm2_path)),
            )
        )
    )  # not started: no worker runs, none has reported its pooling
    server = ApiServer(pool, ApiConfig(port=0))
    url = server.start()
    try:
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert models["rr"]["timeshare"]["state"] == "starting"
        assert models["rr"]["capabilities"] == ["rerank"]
        assert "chat" in models["smol"]["capabilities"] and "rerank" not in models["smol"]["capabilities"]
        assert httpx.get(f"{url}/v1/models/rr", timeout=30).json()["capabilities"] == ["rerank"]
        tags = {m["timeshare"]["id"]: m for m in httpx.get(f"{url}/api/tags", timeout=30).json()["models"]}
        assert tags["rr"]["capabilities"] == ["rerank"]
    finally:
        server.stop()


# ---- /v1/rerank through a real `timeshare serve` --------------------------------------------------


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, rerankers: dict[str, Path], smollm2_path: Path
) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("rerank-home")
    config = write_config(
        home / "config.toml",
        [("tiny-reranker", rerankers["plain"]), ("smol", smollm2_path)],
        extra_model_lines="n_ctx = 256",
    )
    server = start_serve(home / "home", config=config)
    try:
        server.wait_ready(["tiny-reranker"])
        yield server
    finally:
        stop_serve_proc(server.proc)


def post(served: Served, body: object, path: str = "/v1/rerank") -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=120)


def test_rerank_answers_as_llama_server(served: Served, rerankers: dict[str, Path]) -> None:
    want = oracle_scores(rerankers["plain"], QUERY, DOCUMENTS, None)
    order = sorted(range(len(want)), key=lambda i: -want[i])
    r = post(served, {"model": "tiny-reranker", "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "list" and answer["model"] == "tiny-reranker"
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > len(DOCUMENTS) * 4
    results = answer["results"]
    assert [x["index"] for x in results] == order
    assert [x["relevance_score"] for x in results] == pytest.approx([want[i] for i in order], abs=TOLERANCE)
    assert all(set(x) == {"index", "relevance_score"} for x in results)
    # top_n and the documents
    r = post(
        served,
        {
            "model": "tiny-reranker",
            "query": QUERY,
            "documents": DOCUMENTS,
            "top_n": 2,
            "return_documents": True,
        },
    )
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == order[:2]
    assert [x["document"] for x in top] == [{"text": DOCUMENTS[i]} for i in order[:2]]
    # llama-server's other routes; Jina's {"text"} documents; top_n past the end is all of them
    for path in ("/rerank", "/v1/reranking", "/reranking"):
        r = post(
            served,
            {
                "model": "tiny-reranker",
                "query": QUERY,
                "documents": [{"text": d} for d in DOCUMENTS],
                "top_n": 99,
            },
            path,
        )
        assert r.status_code == 200, (path, r.text)
        assert [x["index"] for x in r.json()["results"]] == order
    # TEI's shape: texts in, a bare list of {index, score, text} out
    r = post(
        served, {"model": "tiny-reranker", "query": QUERY, "texts": DOCUMENTS, "return_text": True}, "/rerank"
    )
    assert r.status_code == 200, r.text
    tei = r.json()
    assert [x["index"] for x in tei] == order
    assert [x["text"] for x in tei] == [DOCUMENTS[i] for i in order]
    assert [x["score"] for x in tei] == pytest.approx([want[i] for i in order], abs=TOLERANCE)
    # listed as a reranker once loaded, by the OpenAI and the Ollama routes alike
    models = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
    assert next(m for m in models if m["id"] == "tiny-reranker")["capabilities"] == ["rerank"]
    tags = {m["timeshare"]["id"]: m for m in httpx.get(f"{served.url}/api/tags", timeout=30).json()["models"]}
    assert tags["tiny-reranker"]["capabilities"] == ["rerank"]
    assert "completion" in tags["smol"]["capabilities"] and "rerank" not in tags["smol"]["capabilities"]
    shown = httpx.post(f"{served.url}/api/show", json={"model": "tiny-reranker"}, timeout=30)
    assert shown.status_code == 200, shown.text
    assert shown.json()["capabilities"] == ["rerank"]
    shown = httpx.post(f"{served.url}/api/show", json={"model": "smol"}, timeout=30).json()
    assert "completion" in shown["capabilities"] and "rerank" not in shown["capabilities"]
    # time-shared with the chat model: it answers, then the reranker scores as before
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": "smol", "prompt": "1, 2, 3,", "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    r = post(served, {"model": "tiny-reranker", "query": QUERY, "documents": DOCUMENTS})
    assert [x["index"] for x in r.json()["results"]] == order
    assert [x["relevance_score"] for x in r.json()["results"]] == pytest.approx(
        [want[i] for i in order], abs=TOLERANCE
    )


BAD = [
    ({"query": QUERY, "documents": ["a"]}, "model", "'model' is required"),
    ({"model": "tiny-reranker", "documents": ["a"]}, "query", "'query' is required"),
    ({"model": "tiny-reranker", "query": "", "documents": ["a"]}, "query", "'query' is empty"),
    ({"model": "tiny-reranker", "query": "  \n", "documents": ["a"]}, "query", "'query' is empty"),
    ({"model": "tiny-reranker", "query": 3, "documents": ["a"]}, "query", "'query' is required"),
    ({"model": "tiny-reranker", "query": QUERY}, "documents", "'documents' is required"),
    ({"model": "tiny-reranker", "query": QUERY, "documents": []}, "documents", "'documents' is empty"),
    ({"model": "tiny-reranker", "query": QUERY, "documents": "a"}, "documents", "a list of strings"),
    ({"model": "tiny-reranker", "query": QUERY, "documents": ["a"] * 100_000}, "documents", "at most 2048"),
    ({"model": "tiny-reranker", "query": QUERY, "documents": ["a", 7]}, "documents[1]", "must be a string"),
    (
        {"model": "tiny-reranker", "query": QUERY, "documents": ["a", None]},
        "documents[1]",
        "must be a string",
    ),
    (
        {"model": "tiny-reranker", "query": QUERY, "documents": [{"title": "a"}]},
        "documents[0]",
        "must be a string",
    ),
    ({"model": "tiny-reranker", "query": QUERY, "documents": ["a"], "top_n": 0}, "top_n", "at least 1"),
    ({"model": "tiny-reranker", "query": QUERY, "documents": ["a"], "top_n": -2}, "top_n", "at least 1"),
    ({"model": "tiny-reranker", "query": QUERY, "documents": ["a"], "top_n": "3"}, "top_n", "at least 1"),
    ({"model": "tiny-reranker", "query": QUERY, "documents": ["a"], "top_n": True}, "top_n", "at least 1"),
    (
        {"model": "tiny-reranker", "query": QUERY, "documents": ["a"], "return_documents": "yes"},
        "return_documents",
        "true or false",
    ),
    ({"model": "smol", "query": QUERY, "documents": ["a"]}, "model", "'smol' is not a reranker"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD)
def test_bad_rerank_requests_are_400s_naming_the_field(
    served: Served, body: dict[str, object], param: str, words: str
) -> None:
    r = post(served, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_an_unknown_model_is_a_404_and_the_reranker_keeps_serving(served: Served) -> None:
    r = post(served, {"model": "nope", "query": QUERY, "documents": ["a"]})
    assert r.status_code == 404, r.text
    r = post(served, {"model": "tiny-reranker", "query": QUERY, "documents": DOCUMENTS[:2]})
    assert r.status_code == 200 and len(r.json()["results"]) == 2
    # the reranker embeds nothing and completes nothing: a 400 that says so
    r = httpx.post(f"{served.url}/v1/embeddings", json={"model": "tiny-reranker", "input": "a"}, timeout=60)
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]["message"], r.text
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": "tiny-reranker", "prompt": "a", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]["message"], r.text
