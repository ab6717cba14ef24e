"""``POST /v1/rerank`` (and ``/rerank``, ``/v1/reranking``, ``/reranking``: llama-server's routes):
the request read into what a reranker scores, and llama-server's answer (issue 42).

- ``model``: a reranker (a GGUF that pools by rank: bge-reranker, jina-reranker, Qwen3-Reranker);
  any other model answers 400 naming it.
- ``query``: a non-empty string.
- ``documents``: 1 to ``MAX_DOCUMENTS`` strings (Jina's and Cohere's ``{"text": ...}`` objects are
  read as their text); TEI's ``texts`` in its place asks for TEI's answer (below).
- ``top_n``: the most results to return (a whole number of at least 1; default: all).
- ``return_documents``: each result also carries ``document: {"text": ...}`` (Jina, Cohere);
  TEI's ``return_text`` (with ``texts``) carries ``text``.
- Accepted and ignored: ``rank_fields``, ``max_chunks_per_doc``, ``user``, ``raw_scores``.

The answer is llama-server's: ``{"model", "object": "list", "usage": {"prompt_tokens",
"total_tokens"}, "results": [{"index", "relevance_score"}]}``, the results sorted by
``relevance_score`` (the model's own score, llama.cpp's rank pooling: no sigmoid), highest
first, ``index`` the document's place in the request. With ``texts``: TEI's bare list of
``{"index", "score"}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BadRequestError

#: llama-server's routes for it
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")
#: documents in one request (as many as /v1/embeddings takes inputs)
MAX_DOCUMENTS = 2048


@dataclass(frozen=True)
class RerankRequest:
    model: str
    query: str
    documents: tuple[str, ...]
    top_n: int  # the most results (len(documents) when not given)
    return_documents: bool
    tei: bool  # TEI's shape (``texts`` in, a bare list out)


def _document(item: object, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping) and isinstance(item.get("text"), str):
        return str(item["text"])
    raise BadRequestError(
        f"{where} must be a string (or an object with a 'text' string); got {type(item).__name__}.", where
    )


def parse_rerank_request(body: object) -> RerankRequest:
    if not isinstance(body, Mapping):
        raise BadRequestError("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' is required: the id of a reranker from GET /v1/models.", "model")
    query = body.get("query")
    if not isinstance(query, str):
        raise BadRequestError("'query' is required: the text to rank the documents against.", "query")
    if not query.strip():
        raise BadRequestError("'query' is empty: give the text to rank the documents against.", "query")
    tei = "documents" not in body and "texts" in body
    field = "texts" if tei else "documents"
    raw = body.get(field)
    if not isinstance(raw, list):
        raise BadRequestError(f"'{field}' is required: a list of strings to rank.", field)
    if not raw:
        raise BadRequestError(f"'{field}' is empty: give at least one document to rank.", field)
    if len(raw) > MAX_DOCUMENTS:
        raise BadRequestError(
            f"'{field}' holds {len(raw)} documents; send at most {MAX_DOCUMENTS} per request "
            "(split them: scores of separate requests compare, each pair is scored alone).",
            field,
        )
    documents = tuple(_document(item, f"{field}[{i}]") for i, item in enumerate(raw))
    top_n = body.get("top_n")
    if top_n is None:
        top_n = len(documents)
    elif not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise BadRequestError(
            f"'top_n' must be a whole number of at least 1 (the results to return); got {top_n!r}.", "top_n"
        )
    flag = "return_text" if tei else "return_documents"
    wanted = body.get(flag, False)
    if wanted is None:
        wanted = False
    if not isinstance(wanted, bool):
        raise BadRequestError(f"'{flag}' must be true or false.", flag)
    return RerankRequest(model, query, documents, min(int(top_n), len(documents)), wanted, tei)


def rerank_response(req: RerankRequest, scores: Sequence[Sequence[float]], prompt_tokens: int) -> Any:
    """The answer (see the module docstring): ``scores`` are each document's (its first number
    is the relevance score), in the request's order."""
    label = "score" if req.tei else "relevance_score"
    order = sorted(range(len(req.documents)), key=lambda i: -float(scores[i][0]))
    results: list[dict[str, Any]] = []
    for i in order[: req.top_n]:
        item: dict[str, Any] = {"index": i, label: float(scores[i][0])}
        if req.return_documents:
            if req.tei:
                item["text"] = req.documents[i]
            else:
                item["document"] = {"text": req.documents[i]}
        results.append(item)
    if req.tei:
        return results
    return {
        "model": req.model,
        "object": "list",
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results,
    }
