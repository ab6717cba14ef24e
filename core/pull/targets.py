"""Where a download's files live: the Hugging Face cache's layout, or a folder.

Hub files go into the Hugging Face cache (``models--user--repo/blobs/<etag>``, a
``snapshots/<commit>/<file>`` link, ``refs/<revision>``), so other tools (``hf``, llama.cpp, the
catalog) share them; URL files go to ``<data dir>/models/`` (or ``--dir``). A :class:`Target`
names a file's final path, its partial file (``blobs/<etag>.incomplete``, or ``<file>.part`` with a
``.part.json`` sidecar saying what it was downloaded from) and its lock (``filelock``, on the path
``huggingface_hub`` locks too, so ``hf download`` and ``timeshare pull`` of one blob exclude each
other). Every name the remote chose (the ETag, the commit, the file name) is checked by
:mod:`names` before a path is built from it, and every path is checked to stay inside its folder
(:meth:`Target.check`) before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from .. import paths
from ..errors import DownloadError
from ..gguf.catalog import default_hf_root
from ..util.atomic import atomic_write_text
from . import names
from .remote import hub_endpoint, hub_error
from .sources import Choice, HubSource, Listing, RemoteFile


def models_dir() -> Path:
    """Where URL downloads go without ``--dir``: ``<data dir>/models``."""
    return paths.data_dir() / "models"  # made when the first file is written


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
    root: Path | None = None  # the folder every file above must stay inside (resolved)
    lock_root: Path | None = None  # the folder the lock must stay inside

    @property
    def path(self) -> Path:
        """The file a user (or llama.cpp) opens."""
        return self.pointer or self.final

    def check(self) -> None:
        """Each path, resolved, stays inside its root (a link planted in the cache or the folder
        cannot lead a write elsewhere), and a partial file there is a plain one (not a link);
        raises UnsafeNameError."""
        if self.root is not None:
            for p in (
                self.final,
                self.partial,
                self.pointer,
                self.sidecar,
                self.ref[0] if self.ref else None,
            ):
                if p is not None:
                    names.inside(self.root, p)
        names.plain_or_absent(self.partial)
        if self.lock_root is not None:
            names.inside(self.lock_root, self.lock)


def repo_folder(repo_id: str) -> str:
    """The hub cache's folder of a model repo: ``models--user--repo`` (huggingface_hub's layout)."""
    return "models--" + repo_id.replace("/", "--")


def hub_targets(listing: Listing, choice: Choice, dest_dir: Path | None, token: str | None) -> list[Target]:
    """The targets of a hub choice (a HEAD per file: its ETag, commit, size and CDN location).

    Raises UnsafeNameError, before anything is written, when the hub names a file, a blob (ETag),
    a snapshot (commit) or a revision with something that is not a safe path component."""
    from huggingface_hub import constants, get_hf_file_metadata, get_token

    src = listing.source
    assert isinstance(src, HubSource)
    endpoint = hub_endpoint()
    root = default_hf_root()
    storage = root / repo_folder(src.repo_id)
    revision = names.relative_path(src.revision, "the source", "the revision")
    targets = []
    for f in choice.files:
        name = names.relative_path(f.name, endpoint)
        try:
            meta = get_hf_file_metadata(f.url, token=token)
        except Exception as exc:
            raise hub_error(exc, src.repo_id, f.name) from exc
        if not meta.etag or not meta.commit_hash:
            raise DownloadError(
                f"{endpoint} did not say which version of {f.name} it serves (no ETag or "
                "X-Repo-Commit header): is HF_ENDPOINT a Hugging Face hub?"
            )
        etag = names.etag(meta.etag, f"{endpoint} (for {name})")
        commit = names.commit(meta.commit_hash, f"{endpoint} (for {name})")
        if meta.size is not None and meta.size < 0:
            raise DownloadError(
                f"{endpoint} announced a size of {meta.size} bytes for {name}: try again later"
            )
        headers = {"Accept-Encoding": "identity"}
        # the token huggingface_hub would send: HF_TOKEN, else `hf auth login`'s
        login = token or (None if constants.HF_HUB_DISABLE_IMPLICIT_TOKEN else get_token())
        if login and urlsplit(meta.location).netloc == urlsplit(f.url).netloc:
            headers["authorization"] = f"Bearer {login}"  # a signed CDN URL: the token stays with the hub
        size = meta.size if meta.size is not None else f.size
        sha = f.sha256 or (etag if len(etag) == 64 else None)
        remote = replace(f, validator=etag)
        if dest_dir is not None:
            final = dest_dir / name.rsplit("/", 1)[-1]
            target = Target(
                remote,
                meta.location,
                headers,
                final,
                final.with_name(final.name + ".part"),
                _lock_for(final),
                size,
                sha,
                sidecar=final.with_name(final.name + ".part.json"),
                root=dest_dir,
                lock_root=_locks_dir(),
            )
        else:
            blob = storage / "blobs" / etag
            ref = (storage / "refs" / revision, commit) if revision != commit else None
            target = Target(
                remote,
                meta.location,
                headers,
                blob,
                blob.with_name(blob.name + ".incomplete"),
                root / ".locks" / storage.name / f"{etag}.lock",
                size,
                sha,
                pointer=storage / "snapshots" / commit / Path(*name.split("/")),
                ref=ref,
                root=storage,
                lock_root=root / ".locks",
            )
        target.check()
        targets.append(target)
    return targets


def _origins_file() -> Path:
    """Which URL each file a URL pull wrote came from (data dir; the folders hold only models)."""
    return paths.data_dir() / "pulled-urls.json"


def _origins() -> dict[str, str]:
    try:
        record = json.loads(_origins_file().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in record.items()} if isinstance(record, dict) else {}


def note_url_origins(targets: list[Target]) -> None:
    """Remember the URL of each file just pulled (so another URL's file of that name gets its own)."""
    record = _origins()
    record.update({str(t.final.absolute()): t.get_url for t in targets})
    atomic_write_text(_origins_file(), json.dumps(record, indent=1) + "\n", backup=False, mode=0o644)


def _free_name(folder: Path, name: str, url: str, origins: dict[str, str]) -> Path:
    """``folder/name``, unless a file of that name came from another URL: then ``stem-2.gguf``, …
    (a file there whose origin is not recorded is taken to be this URL's, as before)."""
    stem, dot, ext = name.rpartition(".") if "." in name else (name, "", "")
    candidate, n = folder / name, 2
    while candidate.exists() and origins.get(str(candidate.absolute()), url) != url:
        candidate = folder / f"{stem}-{n}{dot}{ext}"
        n += 1
    return candidate


def url_targets(choice: Choice, dest_dir: Path | None) -> list[Target]:
    folder = dest_dir if dest_dir is not None else models_dir()
    targets = []
    # a split model's parts keep their names (llama.cpp finds the parts by them)
    origins = _origins() if len(choice.files) == 1 else {}
    for f in choice.files:
        final = _free_name(folder, names.component(f.name, f.url), f.url, origins)
        target = Target(
            f,
            f.url,
            {"Accept-Encoding": "identity"},
            final,
            final.with_name(final.name + ".part"),
            _lock_for(final),
            f.size,
            f.sha256,
            sidecar=final.with_name(final.name + ".part.json"),
            root=folder,
            lock_root=_locks_dir(),
        )
        target.check()
        targets.append(target)
    return targets


def _locks_dir() -> Path:
    return paths.cache_dir() / "pull-locks"


def _lock_for(final: Path) -> Path:
    """The lock of a download outside the hub cache: in the cache dir, not next to the model
    (a lock file is never removed: another process may be about to lock it)."""
    key = hashlib.sha1(str(final.absolute()).encode()).hexdigest()[:20]
    return _locks_dir() / f"{key}.lock"


@contextlib.contextmanager
def locked(target: Target) -> Iterator[None]:
    """Hold the target's lock (``filelock``: it opens the lock file with ``O_NOFOLLOW``)."""
    from filelock import FileLock, Timeout

    target.lock.parent.mkdir(parents=True, exist_ok=True)
    target.check()
    lock = FileLock(target.lock, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise DownloadError(
            f"{target.remote.name} is being downloaded by another program right now "
            f"(lock {target.lock}): wait for it to finish, then try again"
        ) from None
    try:
        yield
    finally:
        lock.release()


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
    target.check()
    if target.pointer is not None and not target.pointer.exists():
        target.pointer.parent.mkdir(parents=True, exist_ok=True)
        target.check()
        with contextlib.suppress(FileNotFoundError):
            target.pointer.unlink()  # a dangling link
        try:
            target.pointer.symlink_to(os.path.relpath(target.final, target.pointer.parent))
        except OSError:
            _copy_into_place(target.final, target.pointer)
    if target.ref is not None:
        ref_path, commit = target.ref
        try:
            current = ref_path.read_text().strip()
        except OSError:
            current = ""
        if current != commit:
            atomic_write_text(ref_path, commit, backup=False, mode=0o644)


def _copy_into_place(source: Path, dest: Path) -> None:
    """A copy where links cannot be made: a new file (O_EXCL, O_NOFOLLOW), renamed into place."""
    temp = dest.with_name(f".{dest.name}.{os.getpid()}.copy")
    fd = names.create_exclusive(temp)
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as inp:
            while chunk := inp.read(1 << 22):
                out.write(chunk)
        os.replace(temp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
