"""Step 2 of getting a model: ask the server what a source offers (network).

A repo's model info (file sizes, the LFS sha256 of each file, the licence on the repo card) comes
through ``huggingface_hub``; a URL gets a HEAD (all the parts of a split model). The HTTP client and
the sentences for the errors of a hub or a URL are shared with the download. ``remote_metadata``
reads a file's GGUF metadata with a bounded Range request (the "Get model…" dialog's KV estimate).
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx

from .. import envvars
from ..errors import DownloadError, RemoteAccessError, RemoteNotFoundError
from ..gguf.header import GgufCorruptError, GgufTruncatedError, parse_metadata
from ..gguf.modelfile import SPLIT_RE
from ..util.units import human_bytes
from . import names
from .sources import (
    Choice,
    HubSource,
    Listing,
    RemoteFile,
    Source,
    UrlSource,
    group_choices,
    is_projector_name,
    quant_label,
)

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = envvars.HF_ENDPOINT.default


def hub_endpoint() -> str:
    """The hub's base URL: ``HF_ENDPOINT``, read at each call (so tests can point it elsewhere)."""
    return (envvars.HF_ENDPOINT.raw() or DEFAULT_ENDPOINT).rstrip("/")


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


def hub_error(exc: Exception, repo_id: str, what: str) -> DownloadError:
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
    return unreachable(exc, endpoint)


#: what a failed connection's message says when the name could not be looked up (no network, or
#: no DNS): glibc's and Python's words for it
_NO_LOOKUP = ("Name or service not known", "Temporary failure in name resolution", "nodename nor servname")


def unreachable(exc: BaseException, url: str) -> DownloadError:
    """A connection that failed, in words: "no network" when the host's name could not be looked
    up or the network is unreachable, else that the server did not answer; the exception itself
    goes to the log, not to the sentence."""
    host = urlsplit(url).netloc or url
    log.info("cannot reach %s: %s: %s", url, type(exc).__name__, exc)
    said = str(exc)
    if any(words in said for words in _NO_LOOKUP) or "Network is unreachable" in said:
        return DownloadError(
            f"no network: {host} cannot be reached from this computer; check the internet connection "
            "and try again"
        )
    if isinstance(exc, httpx.TimeoutException):
        return DownloadError(f"{host} did not answer in time; check the internet connection and try again")
    return DownloadError(f"could not connect to {host}; check the internet connection and try again later")


def _list_hub(src: HubSource, token: str | None) -> Listing:
    from huggingface_hub import HfApi, hf_hub_url

    endpoint = hub_endpoint()
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            src.repo_id, revision=src.revision, files_metadata=True
        )
    except Exception as exc:
        raise hub_error(exc, src.repo_id, src.revision) from exc
    files: list[RemoteFile] = []
    for sibling in info.siblings or ():
        name = sibling.rfilename
        if not isinstance(name, str) or not name.lower().endswith(".gguf"):
            continue
        names.relative_path(name, f"{endpoint} (listing {src.repo_id})")
        lfs = sibling.lfs
        sha = lfs.sha256 if lfs is not None else None
        if sha is not None:
            names.sha256(sha, f"{endpoint} (for {name})")
        files.append(
            RemoteFile(
                name=name,
                url=hf_hub_url(src.repo_id, name, revision=src.revision, endpoint=endpoint),
                size=lfs.size if lfs is not None else sibling.size,
                sha256=sha,
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
        projectors=tuple(f for f in files if is_projector_name(f.name)),
    )


def http_client() -> httpx.Client:
    return httpx.Client(
        follow_redirects=True,
        timeout=httpx.Timeout(30.0, read=60.0),
        headers={"Accept-Encoding": "identity", "User-Agent": "timeshare-pull"},
    )


def url_status_error(status: int, url: str) -> DownloadError:
    if status == 404 or status == 410:
        return RemoteNotFoundError(f"{url} was not found (HTTP {status}): check the URL")
    if status in (401, 403):
        return RemoteAccessError(
            f"{url} refused access (HTTP {status}): the server needs a login this download cannot give; "
            "download it in a browser and add the file with Settings → Add file…"
        )
    return DownloadError(f"{url} answered HTTP {status}; try again later")


def transport_error(exc: httpx.HTTPError, url: str) -> DownloadError:
    return unreachable(exc, url)


def url_file_name(url: str) -> str:
    """A URL's file name: its last path segment, percent-decoded, checked to be one safe file name
    (``..%2F..%2Fx.gguf`` is refused: UnsafeNameError)."""
    return names.component(unquote(urlsplit(url).path.rsplit("/", 1)[-1]), url, "the URL's file name")


def _head(client: httpx.Client, url: str) -> RemoteFile:
    name = url_file_name(url)
    try:
        response = client.head(url)
    except httpx.HTTPError as exc:  # transport errors, too many redirects, a bad URL
        raise transport_error(exc, url) from exc
    if response.status_code in (405, 501):  # no HEAD: the GET will tell
        return RemoteFile(name, url)
    if response.status_code >= 400:
        raise url_status_error(response.status_code, url)
    length = response.headers.get("Content-Length")
    etag = response.headers.get("ETag")
    validator = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")
    return RemoteFile(name, url, int(length) if length and length.isdigit() else None, None, validator)


def _list_url(src: UrlSource) -> Listing:
    parts = urlsplit(src.url)
    segments = parts.path.rsplit("/", 1)
    last = url_file_name(src.url)
    m = SPLIT_RE.match(last)
    urls = [src.url]
    if m:  # a split model: all its parts, whichever part the URL names
        total = int(m.group("total"))
        urls = []
        for i in range(1, total + 1):
            name = f"{m.group('stem')}-{i:05d}-of-{total:05d}.gguf"
            path = f"{segments[0]}/{quote(name)}" if len(segments) == 2 else quote(name)
            urls.append(urlunsplit(parts._replace(path=path)))
    with http_client() as client:
        files = [_head(client, u) for u in urls]
    label = quant_label(last) or re.sub(r"\.gguf$", "", last, flags=re.IGNORECASE)
    return Listing(src, src.url, (Choice(label, tuple(files)),))


def list_source(source: Source, *, token: str | None = None) -> Listing:
    """What the source offers (network). Raises DownloadError subclasses with a sentence."""
    if isinstance(source, HubSource):
        return _list_hub(source, token)
    return _list_url(source)


#: the most bytes ``remote_metadata`` reads of a file (a 262k-token vocabulary's metadata is ~6 MB)
METADATA_LIMIT = 32 * 1024 * 1024
_METADATA_FIRST = 1024 * 1024


def remote_metadata(
    file: RemoteFile, *, hub: bool, token: str | None = None, limit: int = METADATA_LIMIT
) -> dict[str, Any] | str:
    """The GGUF metadata (``header.parse_metadata``'s values) of a remote file, read from its first
    bytes with a Range request (at most ``limit`` bytes, also from a server that ignores Range), or
    why it could not be read: a sentence (network, HTTP status, not a GGUF, metadata longer than the
    limit). ``hub``: the file is on the hub, so the hub's token goes with the request (only to the
    hub: httpx drops it on a redirect to the CDN)."""
    headers = {"Range": f"bytes=0-{limit - 1}"}
    if hub:
        from huggingface_hub import constants, get_token

        login = token or (None if constants.HF_HUB_DISABLE_IMPLICIT_TOKEN else get_token())
        if login:
            headers["authorization"] = f"Bearer {login}"
    buf = bytearray()
    want = _METADATA_FIRST
    try:
        with http_client() as client, client.stream("GET", file.url, headers=headers) as response:
            if response.status_code >= 400:
                return f"the server answered HTTP {response.status_code}"
            for chunk in response.iter_bytes():
                buf += chunk
                if len(buf) < min(want, limit):
                    continue
                if not buf.startswith(b"GGUF"):
                    return "the file does not start like a GGUF"
                try:
                    return parse_metadata(bytes(buf), min(len(buf), limit))[4]
                except GgufTruncatedError:
                    if len(buf) >= limit:
                        return f"its metadata is longer than {human_bytes(limit)}"
                    want = min(want * 4, limit)
    except httpx.HTTPError as exc:
        return f"it could not be read ({type(exc).__name__})"
    except GgufCorruptError as exc:
        return f"its header is damaged ({exc})"
    if not buf.startswith(b"GGUF"):
        return "the file does not start like a GGUF"
    try:
        return parse_metadata(bytes(buf), len(buf))[4]
    except GgufTruncatedError:
        return "the file ends inside its metadata"
    except GgufCorruptError as exc:
        return f"its header is damaged ({exc})"
