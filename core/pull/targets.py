"""Where a download's files live: the Hugging Face cache's layout, or a folder.

Hub files go into the Hugging Face cache (``models--user--repo/blobs/<etag>``, a
``snapshots/<commit>/<file>`` link, ``refs/<revision>``), so other tools (``hf``, llama.cpp, the
catalog) share them; URL files go to ``<data dir>/models/`` (or ``--dir``). A :class:`Target`
names a file's final path, its partial file (``blobs/<etag>.incomplete``, or ``<file>.part`` with a
``.part.json`` sidecar saying what it was downloaded from) and its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from .. import paths
from ..atomic import atomic_write_text
from ..catalog import default_hf_root
from ..errors import DownloadError
from .remote import hub_endpoint, hub_error
from .sources import Choice, HubSource, Listing, RemoteFile

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def models_dir() -> Path:
    """Where URL downloads go without ``--dir``: ``<data dir>/models``."""
    target = paths.data_dir() / "models"
    target.mkdir(parents=True, exist_ok=True)
    return target


@dataclass(frozen=True)
class Target:
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


def hub_targets(listing: Listing, choice: Choice, dest_dir: Path | None, token: str | None) -> list[Target]:
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
            raise hub_error(exc, src.repo_id, f.name) from exc
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
                Target(
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
            Target(
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


def url_targets(choice: Choice, dest_dir: Path | None) -> list[Target]:
    folder = dest_dir if dest_dir is not None else models_dir()
    targets = []
    for f in choice.files:
        final = folder / f.name
        targets.append(
            Target(
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


@contextlib.contextmanager
def locked(target: Target) -> Iterator[None]:
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


def partial_matches(target: Target) -> bool:
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


def write_sidecar(target: Target) -> None:
    if target.sidecar is not None:
        record = {"url": target.get_url, "validator": target.remote.validator, "size": target.size}
        atomic_write_text(target.sidecar, json.dumps(record) + "\n", backup=False, mode=0o644)


def link_snapshot(target: Target) -> None:
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
