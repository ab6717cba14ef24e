"""``POST /v1/embeddings``: the request read into what the worker embeds, and OpenAI's answer.

- ``input``: a string, a list of strings, a list of token ids, or a list of token-id lists (at
  most ``MAX_INPUTS`` inputs; none may be empty).
- ``encoding_format``: ``float`` (default: lists of numbers) or ``base64`` (each vector's float32
  little-endian bytes, base64: what the official client asks for and decodes).
- ``dimensions``: refused (the model's vectors have the length they have; cutting them is not
  an embedding of that length).
- ``user``: accepted and ignored (no accounts here).

Each vector is L2-normalised (core/worker/embed.py says how each model pools).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import BadRequestError

#: inputs in one request (OpenAI's limit)
MAX_INPUTS = 2048


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_embedding_request(body: object) -> EmbeddingRequest:
    if not isinstance(body, Mapping):
        raise BadRequestError("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' is required: the id of a model from GET /v1/models.", "model")
    if body.get("dimensions") is not None:
        raise BadRequestError(
            "'dimensions' is not supported: a model's embeddings have the length it makes "
            "(see the vectors' length); leave 'dimensions' out.",
            "dimensions",
        )
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadRequestError(
            f"'encoding_format' must be 'float' or 'base64'; got {fmt!r}.", "encoding_format"
        )
    raw = body.get("input")
    inputs: list[str | tuple[int, ...]]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(_is_token(t) for t in raw):
        inputs = [tuple(int(t) for t in raw)]
    elif isinstance(raw, list) and raw:
        inputs = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                inputs.append(item)
            elif isinstance(item, list) and all(_is_token(t) for t in item):
                inputs.append(tuple(int(t) for t in item))
            else:
                raise BadRequestError(
                    f"input[{i}] must be a string or a list of token ids (whole numbers of at least 0).",
                    f"input[{i}]",
                )
    else:
        raise BadRequestError(
            "'input' is required: a string, a list of strings, a list of token ids or a list of "
            "token-id lists.",
            "input",
        )
    if len(inputs) > MAX_INPUTS:
        raise BadRequestError(
            f"'input' holds {len(inputs)} inputs; send at most {MAX_INPUTS} per request.", "input"
        )
    for i, item in enumerate(inputs):
        if not item:
            where = "input" if len(inputs) == 1 else f"input[{i}]"
            raise BadRequestError(f"{where} is empty: give some text or tokens to embed.", where)
    return EmbeddingRequest(model, tuple(inputs), fmt == "base64")


def embedding_response(
    req: EmbeddingRequest, vectors: Sequence[Sequence[float]], prompt_tokens: int
) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for i, vector in enumerate(vectors):
        value: Any
        if req.base64:
            value = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        else:
            value = [float(x) for x in vector]
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
