"""Finding a model to get: a search of the Hugging Face hub for repositories with GGUF files, and
the short list of suggestions (the short-name table, shortnames.py), for "Get model…".

The search asks the hub's model listing (``/api/models?search=…&filter=gguf``, most downloaded
first) in one request (huggingface_hub's listing retries for half a minute when offline); a hit's
quantisations, sizes and GPU fit come from looking it up (remote.list_source), as for any source.
A failed search is a DownloadError in words (remote.unreachable: "no network: …" offline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from ..errors import DownloadError
from . import shortnames
from .remote import http_client, hub_endpoint, transport_error, url_status_error

#: how many repositories a search lists
SEARCH_LIMIT = 25


@dataclass(frozen=True)
class Found:
    """A repository the search found."""

    repo_id: str  # "user/repo": what the dialog looks up
    downloads: int = 0
    likes: int = 0
    parameters: int | None = None  # the model's parameter count, when the hub read it from a GGUF
    architecture: str = ""  # "llama", "qwen3"… (from the GGUF), when the hub knows it
    gated: bool = False

    def describe(self) -> str:
        """ "1.2 B parameters · llama · 52,113 downloads" (what is known)."""
        parts = []
        if self.parameters:
            parts.append(parameters_text(self.parameters))
        if self.architecture:
            parts.append(self.architecture)
        parts.append(f"{self.downloads:,} downloads")
        if self.gated:
            parts.append("gated")
        return " · ".join(parts)


@dataclass(frozen=True)
class Suggestion:
    """A model of the short-name table, as the dialog offers it."""

    name: str  # "qwen3:8b": what ``timeshare pull`` takes too
    repo_id: str
    quant: str

    @property
    def source(self) -> str:
        return self.name


def parameters_text(n: int) -> str:
    """ "135 M parameters", "1.2 B parameters"."""
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f} B parameters"
    return f"{max(1, round(n / 1e6))} M parameters"


def suggestions() -> list[Suggestion]:
    """The curated list: every entry of the short-name table, in its order."""
    return [Suggestion(name, s.repo_id, s.quant) for name, s in shortnames.SHORT_NAMES.items()]


def _found(item: Any) -> Found | None:
    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        return None
    gguf = item.get("gguf")
    gguf = gguf if isinstance(gguf, dict) else {}
    total = gguf.get("total")
    architecture = gguf.get("architecture")
    downloads = item.get("downloads")
    likes = item.get("likes")
    return Found(
        repo_id=item["id"],
        downloads=downloads if isinstance(downloads, int) else 0,
        likes=likes if isinstance(likes, int) else 0,
        parameters=total if isinstance(total, int) and total > 0 else None,
        architecture=architecture if isinstance(architecture, str) else "",
        gated=bool(item.get("gated", False)),
    )


def search_hub(query: str, *, limit: int = SEARCH_LIMIT, token: str | None = None) -> list[Found]:
    """Repositories with GGUF files whose name holds ``query``, most downloaded first (network:
    one request, no retries, so that offline says so at once).

    Raises ValueError for an empty query and DownloadError (in words) when the hub cannot answer."""
    query = " ".join(query.split())
    if not query:
        raise ValueError("type what to search for: a model's name, e.g. qwen or llama")
    url = f"{hub_endpoint()}/api/models"
    params: list[tuple[str, str | int | float | bool | None]] = [
        ("search", query),
        ("filter", "gguf"),
        ("sort", "downloads"),
        ("limit", limit),
        *(("expand", field) for field in ("downloads", "likes", "gguf", "gated")),
    ]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with http_client() as client:
            response = client.get(url, params=params, headers=headers)
    except httpx.HTTPError as exc:
        raise transport_error(exc, url) from exc
    if response.status_code != 200:
        raise url_status_error(response.status_code, url)
    try:
        items = response.json()
    except ValueError as exc:
        raise DownloadError(f"{url} did not answer with a model list; try again later") from exc
    found = [_found(item) for item in items] if isinstance(items, list) else []
    return [f for f in found if f is not None]
