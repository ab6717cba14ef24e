"""Get models: ``timeshare pull`` and the tray's "Get model…", from Hugging Face or any URL.

Three steps, each usable alone (the CLI and the dialog drive them the same way):

1. :func:`parse_source` reads what the user typed: ``user/repo``, ``user/repo:Q4_K_M``,
   ``user/repo/file.gguf`` (``hf.co/`` or ``https://huggingface.co/`` in front is accepted, and so
   is a hub ``/resolve/`` or ``/blob/`` URL), or the ``http(s)://`` URL of a ``.gguf`` file.
2. :func:`list_source` asks the server what is there: the hub's model info (file sizes, the LFS
   sha256 of each file, the licence on the repo card) through ``huggingface_hub``, or a HEAD for a
   URL. A repo's GGUF files become :class:`Choice` s, one per quantisation, a split model
   (``-00001-of-0000N``) being one choice of all its parts; :func:`choose` picks one.
3. :func:`pull` downloads a choice and checks it before anything uses it.

Hub files go into the Hugging Face cache, in its layout (``models--user--repo/blobs/<etag>``, a
``snapshots/<commit>/<file>`` link, ``refs/<revision>``), so other tools (``hf``, llama.cpp,
the catalog) share them; ``HF_ENDPOINT``, ``HF_HUB_CACHE``/``HF_HOME`` and the token from
``HF_TOKEN`` or ``hf auth login`` are honoured. URL files go to ``<data dir>/models/`` (or
``--dir``).

Resuming: bytes go to a partial file next to the destination (``blobs/<etag>.incomplete``, the name
the hub cache has always used, or ``<file>.part``) that outlives Ctrl-C, a dropped connection or a
cancel; the next pull sends a Range request from its end (a dropped connection is also retried on
the spot, five times). Checks, in order: the first bytes must be a GGUF whose
``general.architecture`` the installed llama.cpp loads (before the rest is downloaded); the size
must be the announced one; the sha256 must be the hub's (LFS files carry it); the whole header must
read (:func:`catalog.read_gguf_header`). A file that fails is deleted, never left to be loaded.

Nothing here imports Qt; :func:`add_to_config` writes the model into the config file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx

from . import paths
from .atomic import atomic_write_text
from .catalog import (
    CatalogEntry,
    _CorruptError,
    _Cursor,
    _TruncatedError,
    default_hf_root,
    model_config_from_entry,
    read_gguf_header,
)
from .config.files import load_config, save_config
from .config.schema import Config, ModelConfig
from .errors import (
    CancelledError,
    ChooseQuantisationError,
    ConfigError,
    CorruptDownloadError,
    DownloadError,
    ModelFileError,
    NoSpaceError,
    RemoteAccessError,
    RemoteNotFoundError,
    UnsupportedArchitectureError,
)
from .llama_archs import ArchSupport, supported_architectures
from .modelfile import GGUF_MAGIC, file_start
from .units import human_bytes

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
HF_HOSTS = frozenset({"huggingface.co", "www.huggingface.co", "hf.co"})
#: bytes of a file's start read to check its magic and architecture before the rest is downloaded
PEEK_BYTES = 1 << 20
CHUNK_BYTES = 1 << 20
#: a dropped connection is retried this many times (counting anew after any progress)
RETRIES = 5
#: seconds before the first retry; doubled each time
RETRY_DELAY_S = 1.0
#: left free on the disk beyond the file itself
SPACE_MARGIN = 64 << 20

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)
_QUANT_RE = re.compile(
    r"(?:^|[-_.])((?:UD-)?(?:I?Q[1-8](?:_[0-9A-Z]+)*|TQ[12]_0|MXFP4(?:_MOE)?|BF16|F16|F32))(?=$|[-_.])",
    re.IGNORECASE,
)
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def hub_endpoint() -> str:
    """The hub's base URL: ``HF_ENDPOINT``, read at each call (so tests can point it elsewhere)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def models_dir() -> Path:
    """Where URL downloads go without ``--dir``: ``<data dir>/models``."""
    target = paths.data_dir() / "models"
    target.mkdir(parents=True, exist_ok=True)
    return target


# ---- sources -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubSource:
    repo_id: str  # "user/repo"
    filename: str | None = None  # a file in the repo ("sub/dir/x.gguf"); None: list the repo
    quant: str | None = None  # the quantisation asked for ("Q4_K_M")
    revision: str = "main"

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "")
        return text + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True)
class UrlSource:
    url: str

    def __str__(self) -> str:
        return self.url


Source = HubSource | UrlSource


def _hub_path_source(path: str, quant: str | None, revision: str = "main") -> HubSource:
    """``user/repo[/file.gguf][:QUANT]`` (no host)."""
    tail = None
    if ":" in path:
        path, tail = path.rsplit(":", 1)
        if not tail:
            raise ValueError(f"{path}: — nothing follows the ':'; give a quantisation, e.g. {path}:Q4_K_M")
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) < 2 or not all(_REPO_PART.match(p) for p in parts[:2]):
        raise ValueError(
            f"{path!r} is not a model source: give a Hugging Face repo (user/repo, user/repo:Q4_K_M, "
            "user/repo/file.gguf) or the http(s):// URL of a .gguf file"
        )
    filename = "/".join(parts[2:]) or None
    if filename is not None and not filename.lower().endswith(".gguf"):
        raise ValueError(f"{filename!r} is not a .gguf file: name a GGUF file of the repo, or just user/repo")
    if tail and quant and tail.upper() != quant.upper():
        raise ValueError(f"two quantisations asked for ({tail} and --quant {quant}): give one")
    return HubSource("/".join(parts[:2]), filename, tail or quant, revision)


def parse_source(text: str, quant: str | None = None) -> Source:
    """What the user typed as a Source. Raises ValueError (a sentence) for what cannot be one."""
    text = text.strip()
    quant = quant.strip() if quant else None
    if not text:
        raise ValueError("no source given: a Hugging Face repo (user/repo) or the URL of a .gguf file")
    lowered = text.lower()
    if lowered.startswith(("http://", "https://")):
        parts = urlsplit(text)
        host = (parts.hostname or "").lower()
        if host in HF_HOSTS:
            segments = [unquote(s) for s in parts.path.split("/") if s]
            if len(segments) >= 5 and segments[2] in ("resolve", "blob"):
                file = "/".join(segments[4:])
                return _hub_path_source(f"{segments[0]}/{segments[1]}/{file}", quant, segments[3])
            if len(segments) == 2:
                return _hub_path_source("/".join(segments), quant)
        if not parts.path.lower().endswith(".gguf"):
            raise ValueError(f"{text} does not name a .gguf file: give the URL of the GGUF file itself")
        if quant:
            raise ValueError("--quant applies to a Hugging Face repo, not to the URL of one file")
        return UrlSource(text)
    for prefix in ("hf.co/", "huggingface.co/", "www.huggingface.co/", "hf://"):
        if lowered.startswith(prefix):
            text = text[len(prefix) :]
            break
    return _hub_path_source(text, quant)


# ---- listing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    name: str  # the path in the repo, or the URL's file name
    url: str  # the hub's resolve URL, or the URL itself
    size: int | None = None
    sha256: str | None = None  # the hub's LFS sha256, when it gives one
    validator: str | None = None  # a URL's ETag or Last-Modified (a partial file resumes only if it matches)


@dataclass(frozen=True)
class Choice:
    label: str  # the quantisation ("Q4_K_M"), else the file name
    files: tuple[RemoteFile, ...]  # one, or a split model's parts in order

    @property
    def filename(self) -> str:
        return self.files[0].name

    @property
    def size(self) -> int | None:
        sizes = [f.size for f in self.files]
        return sum(s for s in sizes if s is not None) if all(s is not None for s in sizes) else None


@dataclass(frozen=True)
class Listing:
    source: Source
    title: str  # "user/repo", or the URL
    choices: tuple[Choice, ...]
    licence: str = ""  # the repo card's licence (hub)
    revision: str = "main"
    gated: bool = False


def quant_label(filename: str) -> str:
    """The quantisation a file name carries ("Q4_K_M", "IQ4_XS", "F16", "UD-Q4_K_XL"), else ""."""
    name = filename.rsplit("/", 1)[-1]
    m = _SPLIT_RE.match(name)
    stem = m.group("stem") if m else re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    found = list(_QUANT_RE.finditer(stem))
    return found[-1].group(1).upper() if found else ""


def group_choices(files: list[RemoteFile]) -> tuple[Choice, ...]:
    """GGUF files as choices: one per file, a split model's parts (complete sets only) as one;
    vision projectors (mmproj) left out; sorted by size."""
    singles: list[tuple[RemoteFile, ...]] = []
    splits: dict[tuple[str, int], dict[int, RemoteFile]] = {}
    for f in files:
        base = f.name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or "mmproj" in base.lower():
            continue
        m = _SPLIT_RE.match(f.name)
        if m:
            splits.setdefault((m.group("stem"), int(m.group("total"))), {})[int(m.group("part"))] = f
        else:
            singles.append((f,))
    groups = list(singles)
    for (stem, total), parts in splits.items():
        if sorted(parts) == list(range(1, total + 1)):
            groups.append(tuple(parts[i] for i in range(1, total + 1)))
        else:
            log.info("skipping %s: parts %s of %d only", stem, sorted(parts), total)
    labels = [quant_label(g[0].name) for g in groups]
    choices = []
    for group, label in zip(groups, labels, strict=True):
        if not label or labels.count(label) > 1:
            m = _SPLIT_RE.match(group[0].name)
            label = m.group("stem") if m else group[0].name
            label = re.sub(r"\.gguf$", "", label, flags=re.IGNORECASE)
        choices.append(Choice(label, group))
    return tuple(sorted(choices, key=lambda c: (c.size is None, c.size or 0, c.label)))


def choose(listing: Listing, quant: str | None = None) -> Choice:
    """The choice asked for (``quant``, else the source's file or quantisation), or the only one.

    Raises RemoteNotFoundError when nothing matches and ChooseQuantisationError when several do."""
    src = listing.source
    wanted = quant or (src.quant if isinstance(src, HubSource) else None)
    choices = listing.choices
    if not choices:
        raise RemoteNotFoundError(f"{listing.title} has no GGUF model file: pick a repo that offers GGUFs")
    labels = tuple(c.label for c in choices)
    if wanted:
        key = wanted.upper().removesuffix(".GGUF")
        hits = [c for c in choices if c.label.upper() == key]
        hits = hits or [
            c for c in choices if c.filename.rsplit("/", 1)[-1].upper().removesuffix(".GGUF") == key
        ]
        if len(hits) == 1:
            return hits[0]
        raise RemoteNotFoundError(
            f"{listing.title} has no quantisation {wanted}; it has: {', '.join(labels)}"
        )
    if len(choices) == 1:
        return choices[0]
    raise ChooseQuantisationError(
        f"{listing.title} has {len(choices)} quantisations: pick one with --quant "
        f"(or {listing.title}:QUANT): {', '.join(labels)}",
        labels,
    )


def _card_licence(info: Any) -> str:
    card = getattr(info, "card_data", None)
    licence = getattr(card, "license", None) if card is not None else None
    if licence == "other":
        licence = getattr(card, "license_name", None) or licence
    if isinstance(licence, list):
        licence = ", ".join(str(x) for x in licence)
    if isinstance(licence, str) and licence:
        return licence
    for tag in getattr(info, "tags", None) or ():
        if isinstance(tag, str) and tag.startswith("license:"):
            return tag.removeprefix("license:")
    return ""


def _hub_error(exc: Exception, repo_id: str, what: str) -> DownloadError:
    """A huggingface_hub (or transport) error as a DownloadError whose sentence says what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = hub_endpoint()
    login = "log in with `hf auth login` or set HF_TOKEN to a token with read access"
    if isinstance(exc, GatedRepoError):
        return RemoteAccessError(
            f"{repo_id} is a gated repository: accept its conditions at {endpoint}/{repo_id}, then {login}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return RemoteNotFoundError(
            f"{repo_id} was not found on {endpoint}: check the name (user/repo); if it is private, {login}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return RemoteNotFoundError(f"{repo_id} has no revision {what!r} on {endpoint}")
    if isinstance(exc, EntryNotFoundError):
        return RemoteNotFoundError(f"{repo_id} has no file {what} on {endpoint}: check the file name")
    if isinstance(exc, HfHubHTTPError):
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", 0)
        if status in (401, 403):
            return RemoteAccessError(f"{endpoint} refused access to {repo_id} (HTTP {status}): {login}")
        return DownloadError(f"{endpoint} answered HTTP {status} for {repo_id} ({what}); try again later")
    if isinstance(exc, OfflineModeIsEnabled):
        return DownloadError("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it and try again")
    return DownloadError(
        f"cannot reach {endpoint} ({type(exc).__name__}: {exc}): check the network connection "
        "(and HF_ENDPOINT) and try again"
    )


def _list_hub(src: HubSource, token: str | None) -> Listing:
    from huggingface_hub import HfApi, hf_hub_url

    endpoint = hub_endpoint()
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            src.repo_id, revision=src.revision, files_metadata=True
        )
    except Exception as exc:
        raise _hub_error(exc, src.repo_id, src.revision) from exc
    files: list[RemoteFile] = []
    for sibling in info.siblings or ():
        name = sibling.rfilename
        if not name.lower().endswith(".gguf"):
            continue
        lfs = sibling.lfs
        files.append(
            RemoteFile(
                name=name,
                url=hf_hub_url(src.repo_id, name, revision=src.revision, endpoint=endpoint),
                size=lfs.size if lfs is not None else sibling.size,
                sha256=lfs.sha256 if lfs is not None else None,
            )
        )
    choices = group_choices(files)
    if src.filename is not None:
        wanted = [c for c in choices if any(f.name == src.filename for f in c.files)]
        if not wanted:
            known = ", ".join(f.name for f in files) or "none"
            raise RemoteNotFoundError(
                f"{src.repo_id} has no GGUF file {src.filename} (a vision projector cannot be pulled "
                f"on its own); its GGUF files: {known}"
            )
        choices = tuple(wanted)
    return Listing(
        source=src,
        title=src.repo_id,
        choices=choices,
        licence=_card_licence(info),
        revision=src.revision,
        gated=bool(getattr(info, "gated", False)),
    )


def _http_client() -> httpx.Client:
    return httpx.Client(
        follow_redirects=True,
        timeout=httpx.Timeout(30.0, read=60.0),
        headers={"Accept-Encoding": "identity", "User-Agent": "timeshare-pull"},
    )


def _url_status_error(status: int, url: str) -> DownloadError:
    if status == 404 or status == 410:
        return RemoteNotFoundError(f"{url} was not found (HTTP {status}): check the URL")
    if status in (401, 403):
        return RemoteAccessError(
            f"{url} refused access (HTTP {status}): the server needs a login this download cannot give; "
            "download it in a browser and add the file with Settings → Add file…"
        )
    return DownloadError(f"{url} answered HTTP {status}; try again later")


def _transport_error(exc: httpx.HTTPError, url: str) -> DownloadError:
    return DownloadError(
        f"cannot reach {url} ({type(exc).__name__}: {exc}): check the connection and try again"
    )


def _head(client: httpx.Client, url: str) -> RemoteFile:
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    try:
        response = client.head(url)
    except httpx.HTTPError as exc:  # transport errors, too many redirects, a bad URL
        raise _transport_error(exc, url) from exc
    if response.status_code in (405, 501):  # no HEAD: the GET will tell
        return RemoteFile(name, url)
    if response.status_code >= 400:
        raise _url_status_error(response.status_code, url)
    length = response.headers.get("Content-Length")
    etag = response.headers.get("ETag")
    validator = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")
    return RemoteFile(name, url, int(length) if length and length.isdigit() else None, None, validator)


def _list_url(src: UrlSource) -> Listing:
    parts = urlsplit(src.url)
    segments = parts.path.rsplit("/", 1)
    last = unquote(segments[-1])
    m = _SPLIT_RE.match(last)
    urls = [src.url]
    if m:  # a split model: all its parts, whichever part the URL names
        total = int(m.group("total"))
        urls = []
        for i in range(1, total + 1):
            name = f"{m.group('stem')}-{i:05d}-of-{total:05d}.gguf"
            path = f"{segments[0]}/{quote(name)}" if len(segments) == 2 else quote(name)
            urls.append(urlunsplit(parts._replace(path=path)))
    with _http_client() as client:
        files = [_head(client, u) for u in urls]
    label = quant_label(last) or re.sub(r"\.gguf$", "", last, flags=re.IGNORECASE)
    return Listing(src, src.url, (Choice(label, tuple(files)),))


def list_source(source: Source, *, token: str | None = None) -> Listing:
    """What the source offers (network). Raises DownloadError subclasses with a sentence."""
    if isinstance(source, HubSource):
        return _list_hub(source, token)
    return _list_url(source)


# ---- fit ------------------------------------------------------------------------------------


def gpu_fit(size: int | None, vram_budget: int | None) -> str:
    """Whether a model of ``size`` bytes fits a GPU budget, in words ("fits", "too big", "unknown").

    The weights need their size in device memory, plus the KV cache and compute buffers (a tenth
    more is counted). Without a budget (nothing measures the device memory yet) it is "unknown".
    """
    if size is None or vram_budget is None or vram_budget <= 0:
        return "unknown"
    return "fits" if size * 1.1 <= vram_budget else "too big"


# ---- progress -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    filename: str  # the file being transferred (or checked)
    part: int  # 1-based part of a split model
    parts: int
    done: int  # bytes of the choice present so far (all parts)
    total: int | None
    rate: float = 0.0  # bytes per second over the last seconds (0 while checking)
    eta_s: float | None = None
    phase: Literal["download", "verify"] = "download"

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total else None

    def describe(self) -> str:
        """One line: "x.gguf  12.0 MiB / 120.0 MiB (10%), 4.2 MiB/s, 26 s left"."""
        head = self.filename.rsplit("/", 1)[-1] + (f" [{self.part}/{self.parts}]" if self.parts > 1 else "")
        if self.phase == "verify":
            return f"{head}  checking {human_bytes(self.done, empty='0 B')}"
        amount = human_bytes(self.done, empty="0 B")
        if self.total:
            amount += f" / {human_bytes(self.total)} ({100 * self.done // self.total}%)"
        line = f"{head}  {amount}"
        if self.rate > 0:
            line += f", {human_bytes(int(self.rate))}/s"
        if self.eta_s is not None:
            line += f", {format_duration(self.eta_s)} left"
        return line


def format_duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


ProgressFn = Callable[[Progress], None]


class _Meter:
    """Turns byte counts into throttled Progress reports with a rate over the last five seconds."""

    def __init__(
        self, callback: ProgressFn | None, parts: int, total: int | None, interval: float = 0.1
    ) -> None:
        self.callback = callback
        self.parts = parts
        self.total = total
        self.interval = interval
        self.base = 0  # bytes of the parts already finished
        self.samples: deque[tuple[float, int]] = deque()
        self.last = 0.0

    def report(
        self,
        filename: str,
        part: int,
        done_in_part: int,
        *,
        phase: Literal["download", "verify"] = "download",
        force: bool = False,
    ) -> None:
        if self.callback is None:
            return
        now = time.monotonic()
        done = self.base + done_in_part
        if phase == "download":
            self.samples.append((now, done))
            while len(self.samples) > 2 and now - self.samples[0][0] > 5.0:
                self.samples.popleft()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        rate = 0.0
        eta = None
        if phase == "download" and len(self.samples) >= 2:
            (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
            if t1 > t0:
                rate = max(0.0, (d1 - d0) / (t1 - t0))
            if rate > 0 and self.total:
                eta = max(0.0, (self.total - done) / rate)
        self.callback(Progress(filename, part, self.parts, done, self.total, rate, eta, phase))

    def restart_rate(self) -> None:
        self.samples.clear()


# ---- downloading ----------------------------------------------------------------------------


class _Digest:
    """A sha256 that can start over (a server that ignored a Range sends the file from byte 0)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._h = hashlib.sha256()

    def update(self, data: bytes) -> None:
        if self.enabled:
            self._h.update(data)

    def reset(self) -> None:
        self._h = hashlib.sha256()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@dataclass(frozen=True)
class _Target:
    remote: RemoteFile
    get_url: str  # where the bytes are fetched (the hub's CDN location, or the URL)
    headers: dict[str, str]
    final: Path  # the verified file (a hub blob, or the file in the models folder)
    partial: Path
    lock: Path
    size: int | None
    sha256: str | None
    pointer: Path | None = None  # hub cache: snapshots/<commit>/<name> -> blobs/<etag>
    ref: tuple[Path, str] | None = None  # hub cache: (refs/<revision>, commit)
    sidecar: Path | None = None  # non-hub partials: what the partial was downloaded from

    @property
    def path(self) -> Path:
        """The file a user (or llama.cpp) opens."""
        return self.pointer or self.final


@dataclass(frozen=True)
class PullResult:
    path: Path  # the file to load (a split model's first part)
    files: tuple[Path, ...]
    entry: CatalogEntry  # its header, with the repo card's licence when the GGUF names none
    listing: Listing
    choice: Choice
    downloaded: int  # bytes this call transferred (0: everything was there already)
    architecture_checked: bool  # False when llama.cpp's own list was unavailable (see llama_archs)


def _hub_targets(listing: Listing, choice: Choice, dest_dir: Path | None, token: str | None) -> list[_Target]:
    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils._headers import build_hf_headers

    src = listing.source
    assert isinstance(src, HubSource)
    root = default_hf_root()
    storage = root / repo_folder_name(repo_id=src.repo_id, repo_type="model")
    targets = []
    for f in choice.files:
        try:
            meta = get_hf_file_metadata(f.url, token=token)
        except Exception as exc:
            raise _hub_error(exc, src.repo_id, f.name) from exc
        if not meta.etag or not meta.commit_hash:
            raise DownloadError(
                f"{hub_endpoint()} did not say which version of {f.name} it serves (no ETag or "
                "X-Repo-Commit header): is HF_ENDPOINT a Hugging Face hub?"
            )
        headers = build_hf_headers(token=token)
        headers["Accept-Encoding"] = "identity"
        if urlsplit(meta.location).netloc != urlsplit(f.url).netloc:
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
        size = meta.size if meta.size is not None else f.size
        sha = f.sha256 or (meta.etag if _SHA256.match(meta.etag) else None)
        if dest_dir is not None:
            final = dest_dir / f.name.rsplit("/", 1)[-1]
            targets.append(
                _Target(
                    replace(f, validator=meta.etag),
                    meta.location,
                    headers,
                    final,
                    final.with_name(final.name + ".part"),
                    _lock_for(final),
                    size,
                    sha,
                    sidecar=final.with_name(final.name + ".part.json"),
                )
            )
            continue
        blob = storage / "blobs" / meta.etag
        pointer = storage / "snapshots" / meta.commit_hash / Path(*f.name.split("/"))
        ref = (
            (storage / "refs" / src.revision, meta.commit_hash) if src.revision != meta.commit_hash else None
        )
        lock = root / ".locks" / storage.name / f"{meta.etag}.lock"
        targets.append(
            _Target(
                f,
                meta.location,
                headers,
                blob,
                blob.with_name(blob.name + ".incomplete"),
                lock,
                size,
                sha,
                pointer=pointer,
                ref=ref,
            )
        )
    return targets


def _url_targets(choice: Choice, dest_dir: Path | None) -> list[_Target]:
    folder = dest_dir if dest_dir is not None else models_dir()
    targets = []
    for f in choice.files:
        final = folder / f.name
        targets.append(
            _Target(
                f,
                f.url,
                {"Accept-Encoding": "identity"},
                final,
                final.with_name(final.name + ".part"),
                _lock_for(final),
                f.size,
                f.sha256,
                sidecar=final.with_name(final.name + ".part.json"),
            )
        )
    return targets


def _lock_for(final: Path) -> Path:
    """The lock of a download outside the hub cache: in the cache dir, not next to the model
    (a lock file is never removed: another process may be about to lock it)."""
    key = hashlib.sha1(str(final.absolute()).encode()).hexdigest()[:20]
    return paths.cache_dir() / "pull-locks" / f"{key}.lock"


def _free_bytes(folder: Path) -> int:
    """Free bytes on the disk of ``folder`` (a module function: tests replace it)."""
    return shutil.disk_usage(folder).free


def _no_space(target: _Target, need: int | None, have: int) -> NoSpaceError:
    needed = f"needs {human_bytes(need)} more, " if need else ""
    kept = (
        f"; the {human_bytes(have)} downloaded so far are kept in {target.partial} for a resume"
        if have
        else ""
    )
    return NoSpaceError(
        f"not enough disk space in {target.final.parent} for {target.remote.name}: it {needed}"
        f"{human_bytes(_free_bytes(target.final.parent), empty='0 B')} are free. Free some space "
        f"(or use --dir elsewhere) and get it again{kept}"
    )


@contextlib.contextmanager
def _locked(target: _Target) -> Iterator[None]:
    target.lock.parent.mkdir(parents=True, exist_ok=True)
    with target.lock.open("a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DownloadError(
                f"{target.remote.name} is being downloaded by another program right now "
                f"(lock {target.lock}): wait for it to finish, then try again"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def peek_architecture(head: bytes) -> str | None:
    """``general.architecture`` from a GGUF's first bytes; None when they end before it.
    Raises ValueError when they are not a GGUF's."""
    if head[:4] != GGUF_MAGIC:
        raise ValueError(file_start(head))
    if len(head) < 24:
        return None
    endian = "<"
    version = struct.unpack_from("<I", head, 4)[0]
    if version not in (2, 3) and struct.unpack_from(">I", head, 4)[0] in (2, 3):
        endian = ">"
    cur = _Cursor(head, len(head), endian)
    cur.pos = 4
    try:
        cur.take("I")
        cur.take("Q")
        kv_count = cur.take("Q")
        for _ in range(kv_count):
            key = cur.string()
            vtype = cur.take("I")
            wanted = key == "general.architecture"
            value = cur.value(vtype, wanted)
            if wanted:
                return value if isinstance(value, str) else None
    except _TruncatedError:
        return None
    except _CorruptError as exc:
        raise ValueError(str(exc)) from None
    return None


def _check_start(path: Path, name: str, support: ArchSupport, first_part: bool) -> None:
    """The magic (and, in a model's first part, the architecture) from a partial file's start."""
    with path.open("rb") as f:
        head = f.read(PEEK_BYTES)
    try:
        arch = peek_architecture(head)
    except ValueError as exc:
        raise CorruptDownloadError(
            f"{name} is not a GGUF model file ({exc}); check the source: a URL must lead to the .gguf "
            "file itself, not to a web page about it"
        ) from None
    if first_part and arch is not None:
        _check_architecture(arch, name, support)


def _check_architecture(arch: str, name: str, support: ArchSupport) -> None:
    if support.supports(arch):
        return
    if arch == "clip" or arch.startswith("mmproj"):
        raise UnsupportedArchitectureError(
            f"{name} is a vision projector (mmproj), not a language model: pick the model's own GGUF"
        )
    if not support.exact:
        log.warning(
            "%s: architecture %r is not in %s; llama.cpp may still load it", name, arch, support.source
        )
        return
    raise UnsupportedArchitectureError(
        f"{name} is a {arch!r} model, an architecture the installed llama.cpp (llama-cpp-python "
        f"{_llama_cpp_version()}) cannot load; pick a model of another architecture"
    )


def _llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "?"


def _sha256_of(path: Path, meter: _Meter, name: str, part: int, cancel: threading.Event | None) -> str:
    digest = hashlib.sha256()
    done = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES * 4):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"cancelled while checking {name}")
            digest.update(chunk)
            done += len(chunk)
            meter.report(name, part, done, phase="verify")
    return digest.hexdigest()


def _remove(*files: Path | None) -> None:
    for f in files:
        if f is not None:
            with contextlib.suppress(OSError):
                f.unlink()


def _partial_matches(target: _Target) -> bool:
    """Whether a non-hub partial file was downloaded from this URL and version (its sidecar says)."""
    if target.sidecar is None:
        return True
    try:
        record = json.loads(target.sidecar.read_text())
    except (OSError, ValueError):
        return False
    if record.get("size") != target.size or record.get("validator") != target.remote.validator:
        return False
    # a hub file is named by its ETag (the CDN's URL may change); a plain URL must be the same one
    return target.remote.validator is not None or record.get("url") == target.get_url


def _write_sidecar(target: _Target) -> None:
    if target.sidecar is not None:
        record = {"url": target.get_url, "validator": target.remote.validator, "size": target.size}
        atomic_write_text(target.sidecar, json.dumps(record) + "\n", backup=False, mode=0o644)


def _transfer(
    client: httpx.Client,
    target: _Target,
    out: BinaryIO,
    have: int,
    digest: _Digest,
    meter: _Meter,
    part: int,
    check_start: Callable[[], None] | None,
    cancel: threading.Event | None,
    chunk_size: int | None,
) -> int:
    """One GET from ``have`` on, appended to ``out``; returns the bytes now in the file. Transport
    errors propagate (the caller retries); a server that ignores the Range restarts the file."""
    headers = dict(target.headers)
    if have:
        headers["Range"] = f"bytes={have}-"
    with client.stream("GET", target.get_url, headers=headers) as response:
        if response.status_code == 416 and target.size is not None and have == target.size:
            return have
        if response.status_code >= 400:
            raise _url_status_error(
                response.status_code, target.remote.name if target.pointer else target.get_url
            )
        if have and not _resumes_at(response, have):
            log.info("%s: the server sent the file from its start again; starting over", target.remote.name)
            out.seek(0)
            out.truncate()
            have = 0
            digest.reset()
        peeked = have >= PEEK_BYTES
        for chunk in response.iter_bytes(chunk_size):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"cancelled: {target.remote.name}")
            try:
                out.write(chunk)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    out.flush()
                    raise _no_space(target, (target.size or 0) - have or None, have) from exc
                raise
            digest.update(chunk)
            have += len(chunk)
            meter.report(target.remote.name, part, have)
            if not peeked and check_start is not None and (have >= PEEK_BYTES or have == target.size):
                out.flush()
                check_start()
                peeked = True
    return have


def _resumes_at(response: httpx.Response, have: int) -> bool:
    """Whether a response to ``Range: bytes=have-`` continues the file at ``have``."""
    if response.status_code != 206:
        return False
    m = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return m is not None and int(m.group(1)) == have


def _fetch(
    client: httpx.Client,
    target: _Target,
    part: int,
    support: ArchSupport,
    meter: _Meter,
    cancel: threading.Event | None,
    chunk_size: int | None,
) -> int:
    """Make ``target.final`` hold the verified file; returns the bytes transferred."""
    name = target.remote.name
    first = part == 1
    if target.final.exists():
        size = target.final.stat().st_size
        if target.size is not None and size != target.size:
            log.warning(
                "%s: the file there has %d bytes, not %d: downloading it again", name, size, target.size
            )
            _remove(target.final)
        else:
            if (
                target.sha256 is not None
                and _sha256_of(target.final, meter, name, part, cancel) != target.sha256
            ):
                log.warning("%s: the file there does not match the hub's sha256: downloading it again", name)
                _remove(target.final)
            else:
                _check_start(target.final, name, support, first)
                meter.report(name, part, size, phase="verify", force=True)
                _link(target)
                return 0
    target.final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        if target.partial.exists() and not _partial_matches(target):
            log.info("%s: the partial download is of another version: starting over", name)
            _remove(target.partial)
        have = target.partial.stat().st_size if target.partial.exists() else 0
        if target.size is not None and have > target.size:
            _remove(target.partial)
            have = 0
        need = (target.size - have) if target.size is not None else None
        if need is not None and need + SPACE_MARGIN > _free_bytes(target.final.parent):
            raise _no_space(target, need, have)
        _write_sidecar(target)
        digest = _Digest(target.sha256 is not None)
        if have and digest.enabled:  # hash what is there, then go on from its end
            with target.partial.open("rb") as f:
                while chunk := f.read(CHUNK_BYTES * 4):
                    digest.update(chunk)
        if have >= PEEK_BYTES or (target.size is not None and have == target.size and have):
            _check_or_delete(target, support, first)
        start = have
        meter.restart_rate()
        meter.report(name, part, have, force=True)
        retries = RETRIES
        delay = RETRY_DELAY_S
        with target.partial.open("ab") as out:
            while True:
                before = have
                try:
                    have = _transfer(
                        client,
                        target,
                        out,
                        have,
                        digest,
                        meter,
                        part,
                        lambda: _check_or_delete(target, support, first, out),
                        cancel,
                        chunk_size,
                    )
                    break
                except httpx.TransportError as exc:
                    out.flush()
                    have = out.tell()
                    if have > before:
                        retries, delay = RETRIES, RETRY_DELAY_S
                    if retries <= 0:
                        raise DownloadError(
                            f"the connection kept failing while downloading {name} ({type(exc).__name__}: "
                            f"{exc}); {human_bytes(have, empty='nothing')} kept in {target.partial}: get it "
                            "again to resume"
                        ) from exc
                    log.warning("%s: %s after %d bytes; resuming in %.1f s", name, exc, have, delay)
                    retries -= 1
                    if cancel is not None and cancel.wait(delay):
                        raise CancelledError(f"cancelled: {name}") from None
                    if cancel is None:
                        time.sleep(delay)
                    delay *= 2
        meter.report(name, part, have, force=True)
        if target.size is not None and have != target.size:
            _remove(target.partial, target.sidecar)
            raise CorruptDownloadError(
                f"{name} arrived with {have} bytes, but the server announced {target.size}; the "
                "download was deleted: get it again"
            )
        _check_or_delete(target, support, first)
        if target.sha256 is not None:
            got = digest.hexdigest()
            if got != target.sha256:
                _remove(target.partial, target.sidecar)
                raise CorruptDownloadError(
                    f"{name} does not match the hub's sha256 (expected {target.sha256[:16]}…, got "
                    f"{got[:16]}…): the download was corrupted and has been deleted; get it again"
                )
        os.replace(target.partial, target.final)
        _remove(target.sidecar)
        _link(target)
        return have - start


def _check_or_delete(target: _Target, support: ArchSupport, first: bool, out: BinaryIO | None = None) -> None:
    """The start check on the partial file; a file that fails it is deleted (no resume of it)."""
    if out is not None:
        out.flush()
    try:
        _check_start(target.partial, target.remote.name, support, first)
    except (CorruptDownloadError, UnsupportedArchitectureError):
        _remove(target.partial, target.sidecar)
        raise


def _link(target: _Target) -> None:
    """Hub cache: the snapshot link to the blob and the revision's ref (as huggingface_hub makes them)."""
    if target.pointer is not None and not target.pointer.exists():
        target.pointer.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            target.pointer.unlink()  # a dangling link
        try:
            target.pointer.symlink_to(os.path.relpath(target.final, target.pointer.parent))
        except OSError:
            shutil.copy2(target.final, target.pointer)
    if target.ref is not None:
        ref_path, commit = target.ref
        try:
            current = ref_path.read_text().strip()
        except OSError:
            current = ""
        if current != commit:
            atomic_write_text(ref_path, commit, backup=False, mode=0o644)


def _discard(targets: list[_Target]) -> None:
    """Delete files that failed the final check (links first, then the blobs)."""
    for t in targets:
        _remove(t.pointer, t.final)


def pull(
    listing: Listing,
    choice: Choice,
    *,
    dest_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
    progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
    chunk_size: int | None = None,
) -> PullResult:
    """Download ``choice`` (all its parts), check it, and return where it is.

    Raises DownloadError subclasses (not found, access, space, corrupt), CancelledError when
    ``cancel`` is set (what was downloaded is kept for the next pull to resume), and
    UnsupportedArchitectureError. Never leaves a file that failed a check. ``chunk_size``: bytes
    per write (None: as they arrive, which keeps progress and Cancel prompt on a slow line).
    """
    support = supported_architectures()
    folder = Path(dest_dir).expanduser() if dest_dir is not None else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    if isinstance(listing.source, HubSource):
        targets = _hub_targets(listing, choice, folder, token)
    else:
        targets = _url_targets(choice, folder)
    total = (
        sum(t.size for t in targets if t.size is not None)
        if all(t.size is not None for t in targets)
        else None
    )
    meter = _Meter(progress, len(targets), total)
    downloaded = 0
    with _http_client() as client:
        for part, target in enumerate(targets, 1):
            try:
                downloaded += _fetch(client, target, part, support, meter, cancel, chunk_size)
            except httpx.HTTPError as exc:  # too many redirects, a bad URL (transport errors retry)
                raise _transport_error(exc, target.get_url) from exc
            meter.base += target.final.stat().st_size
    files = tuple(t.path for t in targets)
    entry = _final_check(files, targets, support)
    entry = replace(
        entry,
        source="hf" if isinstance(listing.source, HubSource) and folder is None else "file",
        origin=listing.title,
        licence=entry.licence or listing.licence,
    )
    log.info("pulled %s (%s) to %s", listing.title, choice.label, files[0])
    return PullResult(files[0], files, entry, listing, choice, downloaded, support.exact)


def _final_check(files: tuple[Path, ...], targets: list[_Target], support: ArchSupport) -> CatalogEntry:
    try:
        for f in files[1:]:
            read_gguf_header(f)
        size = sum(f.stat().st_size for f in files) if len(files) > 1 else None
        entry = read_gguf_header(files[0], "file", size=size)
    except ModelFileError as exc:
        _discard(targets)
        raise CorruptDownloadError(f"the download is not a usable GGUF and was deleted: {exc}") from exc
    try:
        _check_architecture(entry.architecture, files[0].name, support)
    except UnsupportedArchitectureError:
        _discard(targets)
        raise
    return entry


def partial_bytes(listing: Listing, choice: Choice, dest_dir: str | os.PathLike[str] | None = None) -> int:
    """Bytes of ``choice`` already downloaded (partial files; no network). For URL sources and
    ``dest_dir``; the hub cache's partials are named by the ETag, which needs the network."""
    if isinstance(listing.source, HubSource) and dest_dir is None:
        return 0
    folder = Path(dest_dir).expanduser() if dest_dir is not None else models_dir()
    total = 0
    for f in choice.files:
        p = folder / (f.name.rsplit("/", 1)[-1] + ".part")
        with contextlib.suppress(OSError):
            total += p.stat().st_size
    return total


# ---- the config ---------------------------------------------------------------------------------


def _same_file(a: str, b: Path) -> bool:
    try:
        return (
            Path(a).expanduser().resolve() == b.resolve() or Path(a).expanduser().absolute() == b.absolute()
        )
    except OSError:
        return False


def add_to_config(
    result: PullResult, config_path: str | os.PathLike[str] | None = None, *, model_id: str | None = None
) -> tuple[Config, ModelConfig, bool]:
    """Add the pulled model to the config file (created with the defaults, demo models included,
    when there is none). Returns (the config, the model, whether it was added): a model already
    configured with this file is left as it is. Raises ConfigError (an id in use, a bad file)."""
    target = Path(config_path).expanduser() if config_path is not None else paths.config_file()
    config = load_config(target, check_paths=False)
    same = next((m for m in config.models if _same_file(m.path, result.path)), None)
    if same is not None and (model_id is None or model_id == same.id):
        return config, same, False
    taken = {m.id for m in config.models}
    model = model_config_from_entry(result.entry, taken)
    if model_id is not None:
        if model_id in taken:
            raise ConfigError([f"--id: {model_id!r} is already used by another model: choose another id"])
        model = replace(model, id=model_id)
    model = replace(model, path=str(result.path))
    new = replace(config, models=(*config.models, model))
    save_config(new, target)
    return new, model, True
