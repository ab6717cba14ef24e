"""Finding a model to get: a search of the Hugging Face hub for repositories with GGUF files, and
the short list of suggestions (the short-name table, shortnames.py), for "Get model…".

The search asks the hub's model listing (``/api/models?search=…&filter=gguf``, most downloaded
first) in one request (huggingface_hub's listing retries for half a minute when offline). The
listing tells no file sizes, so each hit's GGUF files and their sizes per quantisation come next
from its model info (``/api/models/{repo}?blobs=true``, huggingface_hub's ``files_metadata``:
remote.list_source, as for any source), a few hits at a time (:func:`look_up_sizes`), shown under
the hit as they come with which of them fit the GPU budget (:meth:`Sizes.describe`).
A failed search is a DownloadError in words (remote.unreachable: "no network: …" offline).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import httpx

from ..errors import DownloadError, TimeshareError
from ..util.units import human_bytes
from . import shortnames
from .remote import http_client, hub_endpoint, list_source, transport_error, url_status_error
from .sources import Choice, HubSource, gpu_fit

#: how many repositories a search lists
SEARCH_LIMIT = 25
#: how many hits' sizes are asked at once (one model-info request each)
SIZE_LOOKUPS = 4


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
class Sizes:
    """The GGUF files of a hit, per quantisation, with their sizes (from its model info), or why
    they are not known."""

    repo_id: str
    choices: tuple[Choice, ...] = ()  # smallest first (sources.group_choices)
    problem: str = ""  # the look-up failed: why, in words

    def describe(self, vram_budget: int | None = None) -> str:
        """ "Q4_K_M 4.6 GiB · Q8_0 7.9 GiB · F16 15.0 GiB"; with a GPU budget known, which fit it
        (the weights and a tenth for compute buffers: sources.gpu_fit without the KV cache, which
        the look-up of the pick adds): "weights fit the GPU: Q4_K_M 4.6 GiB, Q8_0 7.9 GiB · too
        big: F16 15.0 GiB"."""
        if self.problem:
            return f"sizes unknown: {self.problem}"
        if not self.choices:
            return "no GGUF model file"
        sized = [(c.label, c.size, human_bytes(c.size or 0, empty="size unknown")) for c in self.choices]
        if vram_budget is None:
            return " · ".join(f"{label} {size}" for label, _, size in sized)
        groups: dict[str, list[str]] = {}
        for label, size, text in sized:
            groups.setdefault(gpu_fit(size, vram_budget), []).append(f"{label} {text}")
        heads = {"fits": "weights fit the GPU", "too big": "too big", "unknown": "size unknown"}
        return " · ".join(f"{heads[k]}: {', '.join(groups[k])}" for k in heads if k in groups)


def hub_sizes(repo_id: str, *, token: str | None = None) -> Sizes:
    """The GGUF files of ``repo_id`` per quantisation with their sizes (network: its model info).
    A failure is kept in words (``problem``), not raised: one hit's sizes are not worth a dialog."""
    try:
        listing = list_source(HubSource(repo_id), token=token)
    except TimeshareError as exc:
        return Sizes(repo_id, problem=str(exc))
    return Sizes(repo_id, listing.choices)


def look_up_sizes(
    repo_ids: Iterable[str],
    each: Callable[[Sizes], None],
    *,
    cancel: threading.Event | None = None,
    workers: int = SIZE_LOOKUPS,
    token: str | None = None,
) -> None:
    """:func:`hub_sizes` of each repo, ``workers`` at a time, handed to ``each`` as they come
    (from this thread); once ``cancel`` is set no more are asked or handed on."""
    cancel = cancel or threading.Event()
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="hub-sizes") as pool:
        pending: set[Future[Sizes]] = {pool.submit(hub_sizes, r, token=token) for r in repo_ids}
        try:
            while pending and not cancel.is_set():
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    if not cancel.is_set():
                        each(future.result())
        finally:
            for future in pending:
                future.cancel()  # those not started yet; one under way ends with its request


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
