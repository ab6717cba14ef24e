"""Step 3 of getting a model: :func:`pull` downloads a choice and checks it before anything uses it.

Where: :mod:`targets` (the hub cache's layout or a folder), every remote-chosen name checked by
:mod:`names` first, every file created ``O_EXCL | O_NOFOLLOW`` and renamed into place.

Resuming: bytes go to a partial file next to the destination that outlives Ctrl-C, a dropped
connection or a cancel; the next pull sends a Range request from its end (a dropped connection is
also retried on the spot, five times). A partial is kept only when the download can resume: the
server said the size and a version (an ETag, or Last-Modified for a URL), it honours Range, and
what is on disk passes the start check so far; any other failed download deletes its partial.

Bounds: a download is never longer than its announced size (more bytes are refused), one whose
size the server does not say stops at :data:`MAX_UNKNOWN_SIZE` (``timeshare pull --max-size``
raises it), and the free space is checked before and as the file grows (every
:data:`SPACE_CHECK_BYTES`), keeping :data:`SPACE_MARGIN` free.

Checks, in order: the first bytes must be a GGUF whose ``general.architecture`` the installed
llama.cpp loads (before the rest is downloaded); the size must be the announced one; the sha256
must be the hub's (LFS files carry it); the whole header must read (:func:`catalog.read_gguf_header`).
A file that fails is deleted, never left to be loaded. A file already there is checked the same
way (size, sha256, start) and downloaded again if it fails.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import httpx

from ..errors import (
    CancelledError,
    CorruptDownloadError,
    DownloadError,
    DownloadTooLargeError,
    ModelFileError,
    NoSpaceError,
    UnsupportedArchitectureError,
)
from ..gguf.catalog import CatalogEntry, read_gguf_header
from ..gguf.llama_archs import PROJECTORS, ArchSupport, supported_architectures
from ..util.units import human_bytes
from . import (
    names,
    verify,  # verify.PEEK_BYTES is read through the module: a test sets it there
)
from .progress import Meter, ProgressFn
from .remote import http_client, transport_error, url_status_error
from .sources import Choice, HubSource, Listing, projector_choice
from .targets import (
    Target,
    hub_targets,
    link_snapshot,
    locked,
    note_url_origins,
    partial_matches,
    url_targets,
    write_sidecar,
)
from .verify import CHUNK_BYTES, Digest, check_architecture, check_file_start, sha256_of

log = logging.getLogger(__name__)

#: a dropped connection is retried this many times (counting anew after any progress)
RETRIES = 5
#: seconds before the first retry; doubled each time
RETRY_DELAY_S = 1.0
#: left free on the disk beyond the file itself
SPACE_MARGIN = 64 << 20
#: the free space is checked again after every this many bytes written
SPACE_CHECK_BYTES = 8 << 20
#: a download whose size the server does not say stops after this many bytes (a Hugging Face file
#: is at most 50 GB; larger models come split): ``pull(max_size=…)``, ``timeshare pull --max-size``
MAX_UNKNOWN_SIZE = 64 << 30


@dataclass(frozen=True)
class PullResult:
    path: Path  # the file to load (a split model's first part)
    files: tuple[Path, ...]
    entry: CatalogEntry  # its header, with the repo card's licence when the GGUF names none
    listing: Listing
    choice: Choice
    downloaded: int  # bytes this call transferred (0: everything was there already)
    architecture_checked: bool  # False when llama.cpp's own list was unavailable (see llama_archs)


def _free_bytes(folder: Path) -> int:
    """Free bytes on the disk of ``folder`` (a module function: tests replace it)."""
    return shutil.disk_usage(folder).free


@dataclass
class _Partial:
    """The partial file being written, and what the server showed of itself so far."""

    target: Target
    out: BinaryIO
    support: ArchSupport
    ranges: bool = False  # the server honours Range (a 206, or Accept-Ranges: bytes on a 200)
    spoiled: bool = False  # what is on disk cannot be the file (too long): never kept
    received: int = 0  # bytes this pull transferred (a restart from byte 0 counts them all)

    def resumable(self) -> bool:
        """Whether a failed download keeps its partial for the next pull: the server said the size
        and a version and honours Range, and what is on disk passes the start check so far."""
        t = self.target
        if self.spoiled or t.size is None or t.remote.validator is None or not self.ranges:
            return False
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed already
            self.out.flush()
        try:  # the magic only (first_part=False): the architecture was checked on the way
            check_file_start(t.partial, t.remote.name, self.support, False)
        except (OSError, CorruptDownloadError):
            return False
        return True

    def fate(self) -> str:
        """What happens to the partial, in words, for an error's sentence."""
        have = self.out.tell()
        if self.resumable():
            return (
                f"{human_bytes(have, empty='nothing')} kept in {self.target.partial}: get it again to resume"
            )
        return "what arrived was deleted (this download cannot resume): get it again"


def _no_space(target: Target, need: int | None, fate: str | None) -> NoSpaceError:
    needed = f"needs {human_bytes(need)} more, " if need else ""
    return NoSpaceError(
        f"not enough disk space in {target.final.parent} for {target.remote.name}: it {needed}"
        f"{human_bytes(_free_bytes(target.final.parent), empty='0 B')} are free. Free some space "
        f"(or use --dir elsewhere) and get it again" + (f"; {fate}" if fate else "")
    )


def _remove(*files: Path | None) -> None:
    for f in files:
        if f is not None:
            with contextlib.suppress(OSError):
                f.unlink()


def _transfer(
    client: httpx.Client,
    target: Target,
    partial: _Partial,
    have: int,
    digest: Digest,
    meter: Meter,
    part: int,
    check_start: Callable[[], None] | None,
    cancel: threading.Event | None,
    chunk_size: int | None,
    max_size: int,
) -> int:
    """One GET from ``have`` on, appended to the partial; returns the bytes now in the file.
    Transport errors propagate (the caller retries); a server that ignores the Range restarts the
    file (and the digest)."""
    out = partial.out
    headers = dict(target.headers)
    if have:
        headers["Range"] = f"bytes={have}-"
    with client.stream("GET", target.get_url, headers=headers) as response:
        if response.status_code == 416 and target.size is not None and have == target.size:
            return have
        if response.status_code >= 400:
            raise url_status_error(
                response.status_code, target.remote.name if target.pointer else target.get_url
            )
        if have and not _resumes_at(response, have):
            log.info("%s: the server sent the file from its start again; starting over", target.remote.name)
            out.seek(0)
            out.truncate()
            have = 0
            digest.reset()
            partial.ranges = False
        else:
            partial.ranges = response.status_code == 206 or (
                response.headers.get("Accept-Ranges", "").strip().lower() == "bytes"
            )
        limit = target.size if target.size is not None else max_size
        length = response.headers.get("Content-Length", "")
        if target.size is None and length.isdigit() and have + int(length) > limit:
            partial.spoiled = True  # it says now that it will be too long: not a byte written
            raise _too_large(target, limit)
        next_space_check = have + SPACE_CHECK_BYTES
        peeked = have >= verify.PEEK_BYTES
        for chunk in response.iter_bytes(chunk_size):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"cancelled: {target.remote.name}")
            if have + len(chunk) > limit:
                partial.spoiled = True
                raise _too_large(target, limit)
            try:
                out.write(chunk)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    with contextlib.suppress(OSError):
                        out.flush()
                    raise _no_space(target, (target.size or 0) - have or None, partial.fate()) from exc
                raise
            digest.update(chunk)
            have += len(chunk)
            partial.received += len(chunk)
            meter.report(target.remote.name, part, have)
            if have >= next_space_check:
                next_space_check = have + SPACE_CHECK_BYTES
                need = target.size - have if target.size is not None else 0
                if _free_bytes(target.final.parent) < need + SPACE_MARGIN:
                    out.flush()
                    raise _no_space(target, need or None, partial.fate())
            if not peeked and check_start is not None and (have >= verify.PEEK_BYTES or have == target.size):
                out.flush()
                check_start()
                peeked = True
    return have


def _too_large(target: Target, limit: int) -> DownloadTooLargeError:
    if target.size is not None:
        return DownloadTooLargeError(
            f"{target.remote.name}: the server sent more than the {limit} bytes it announced; the "
            "download was stopped and deleted: check the source, or get it again later"
        )
    return DownloadTooLargeError(
        f"{target.remote.name}: the server did not say its size and sent more than "
        f"{human_bytes(limit)} (the limit for a download of unknown size); it was stopped and "
        "deleted. If the file really is larger, raise the limit: timeshare pull --max-size SIZE"
    )


def _resumes_at(response: httpx.Response, have: int) -> bool:
    """Whether a response to ``Range: bytes=have-`` continues the file at ``have``."""
    if response.status_code != 206:
        return False
    m = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return m is not None and int(m.group(1)) == have


def _cached_ok(
    target: Target, support: ArchSupport, meter: Meter, part: int, cancel: threading.Event | None
) -> bool:
    """Whether the file already at ``target.final`` is the one announced (size, sha256, start);
    one that is not is deleted (the caller downloads it again)."""
    name = target.remote.name
    size = target.final.stat().st_size
    if target.size is not None and size != target.size:
        log.warning("%s: the file there has %d bytes, not %d: downloading it again", name, size, target.size)
    elif target.sha256 is not None and sha256_of(target.final, meter, name, part, cancel) != target.sha256:
        log.warning("%s: the file there does not match the hub's sha256: downloading it again", name)
    else:
        try:
            check_file_start(target.final, name, support, part == 1)
        except CorruptDownloadError as exc:
            log.warning("%s: the file there is not a GGUF (%s): downloading it again", name, exc)
        else:
            meter.report(name, part, size, phase="verify", force=True)
            return True
    _remove(target.final)
    return False


def _fetch(
    client: httpx.Client,
    target: Target,
    part: int,
    support: ArchSupport,
    meter: Meter,
    cancel: threading.Event | None,
    chunk_size: int | None,
    max_size: int,
) -> int:
    """Make ``target.final`` hold the verified file; returns the bytes transferred."""
    name = target.remote.name
    target.check()
    if target.final.exists() and _cached_ok(target, support, meter, part, cancel):
        link_snapshot(target)
        return 0
    target.final.parent.mkdir(parents=True, exist_ok=True)
    with locked(target):
        target.check()  # again: the folders now exist
        if os.path.lexists(target.partial) and not partial_matches(target):
            log.info("%s: the partial download is of another version: starting over", name)
            _remove(target.partial)
        have = target.partial.stat().st_size if os.path.lexists(target.partial) else 0
        if target.size is not None and have > target.size:
            _remove(target.partial)
            have = 0
        need = (target.size - have) if target.size is not None else None
        if need is not None and need + SPACE_MARGIN > _free_bytes(target.final.parent):
            raise _no_space(target, need, f"the {human_bytes(have)} there are kept" if have else None)
        fd = (
            names.open_for_append(target.partial)
            if os.path.lexists(target.partial)
            else names.create_exclusive(target.partial)
        )
        out = os.fdopen(fd, "ab")
        partial = _Partial(target, out, support, ranges=have > 0)  # a kept partial was resumable
        try:
            with out:
                done = _fill(
                    client, target, partial, have, part, support, meter, cancel, chunk_size, max_size
                )
        except BaseException:
            if not partial.resumable():
                _remove(target.partial, target.sidecar)
            raise
        link_snapshot(target)
        return done


def _fill(
    client: httpx.Client,
    target: Target,
    partial: _Partial,
    have: int,
    part: int,
    support: ArchSupport,
    meter: Meter,
    cancel: threading.Event | None,
    chunk_size: int | None,
    max_size: int,
) -> int:
    """Download into the open partial from ``have`` on, check it, rename it to ``target.final``;
    returns the bytes transferred."""
    name = target.remote.name
    first = part == 1
    out = partial.out
    write_sidecar(target)
    digest = Digest(target.sha256 is not None)
    if have and digest.enabled:  # hash what is there, then go on from its end
        with names.open_reader(target.partial) as f:
            while chunk := f.read(CHUNK_BYTES * 4):
                digest.update(chunk)
    if have >= verify.PEEK_BYTES or (target.size is not None and have == target.size and have):
        _check_or_delete(target, support, first)
    meter.restart_rate()
    meter.report(name, part, have, force=True)
    retries = RETRIES
    delay = RETRY_DELAY_S
    while True:
        before = have
        try:
            have = _transfer(
                client,
                target,
                partial,
                have,
                digest,
                meter,
                part,
                lambda: _check_or_delete(target, support, first, out),
                cancel,
                chunk_size,
                max_size,
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
                    f"{exc}); {partial.fate()}"
                ) from exc
            log.warning("%s: %s after %d bytes; resuming in %.1f s", name, exc, have, delay)
            retries -= 1
            if cancel is not None and cancel.wait(delay):
                raise CancelledError(f"cancelled: {name}") from None
            if cancel is None:
                time.sleep(delay)
            delay *= 2
    out.flush()
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
    target.check()
    os.replace(target.partial, target.final)
    _remove(target.sidecar)
    return partial.received


def _check_or_delete(target: Target, support: ArchSupport, first: bool, out: BinaryIO | None = None) -> None:
    """The start check on the partial file; a file that fails it is deleted (no resume of it)."""
    if out is not None:
        out.flush()
    try:
        check_file_start(target.partial, target.remote.name, support, first)
    except (CorruptDownloadError, UnsupportedArchitectureError):
        _remove(target.partial, target.sidecar)
        raise


def _discard(targets: list[Target]) -> None:
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
    max_size: int | None = None,
    projector: bool = False,
) -> PullResult:
    """Download ``choice`` (all its parts), check it, and return where it is. ``projector``: it
    is the repo's vision projector (``sources.projector_choice``), whose architecture must be
    ``clip``.

    Raises DownloadError subclasses (not found, access, space, corrupt), CancelledError when
    ``cancel`` is set (what was downloaded is kept for the next pull to resume), and
    UnsupportedArchitectureError. Never leaves a file that failed a check. ``chunk_size``: bytes
    per write (None: as they arrive, which keeps progress and Cancel prompt on a slow line).
    ``max_size``: the most bytes a file of unknown size may have (None: :data:`MAX_UNKNOWN_SIZE`).
    Every name the remote chose is checked before any path is built (UnsafeNameError: nothing is
    written).
    """
    folder = Path(dest_dir).expanduser() if dest_dir is not None else None
    cap = MAX_UNKNOWN_SIZE if max_size is None else max_size
    if isinstance(listing.source, HubSource):  # every remote name checked: nothing written yet
        targets = hub_targets(listing, choice, folder, token)
    else:
        targets = url_targets(choice, folder)
    # (supported_architectures caches the list it read in the cache dir)
    support = PROJECTORS if projector else supported_architectures()
    total = (
        sum(t.size for t in targets if t.size is not None)
        if all(t.size is not None for t in targets)
        else None
    )
    meter = Meter(progress, len(targets), total)
    downloaded = 0
    with http_client() as client:
        for part, target in enumerate(targets, 1):
            try:
                downloaded += _fetch(client, target, part, support, meter, cancel, chunk_size, cap)
            except httpx.HTTPError as exc:  # too many redirects, a bad URL (transport errors retry)
                raise transport_error(exc, target.get_url) from exc
            meter.base += target.final.stat().st_size
    files = tuple(t.path for t in targets)
    entry = _final_check(files, targets, support)
    if not isinstance(listing.source, HubSource):
        note_url_origins(targets)
    entry = replace(
        entry,
        source="hf" if isinstance(listing.source, HubSource) and folder is None else "file",
        origin=listing.title,
        licence=entry.licence or listing.licence,
    )
    log.info("pulled %s (%s) to %s", listing.title, choice.label, files[0])
    return PullResult(files[0], files, entry, listing, choice, downloaded, support.exact)


def pull_projector(
    listing: Listing,
    *,
    dest_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
    progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> PullResult | None:
    """The repo's vision projector (``sources.projector_choice``: the F16 one when there are
    several), downloaded and checked as the model was, beside it (None: the repo has none)."""
    choice = projector_choice(listing)
    if choice is None:
        return None
    return pull(
        listing, choice, dest_dir=dest_dir, token=token, progress=progress, cancel=cancel, projector=True
    )


def _final_check(files: tuple[Path, ...], targets: list[Target], support: ArchSupport) -> CatalogEntry:
    try:
        for f in files[1:]:
            read_gguf_header(f)
        size = sum(f.stat().st_size for f in files) if len(files) > 1 else None
        entry = read_gguf_header(files[0], "file", size=size)
    except ModelFileError as exc:
        _discard(targets)
        raise CorruptDownloadError(f"the download is not a usable GGUF and was deleted: {exc}") from exc
    try:
        check_architecture(entry.architecture, files[0].name, support)
    except UnsupportedArchitectureError:
        _discard(targets)
        raise
    return entry
