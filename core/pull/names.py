"""Names that come from a remote, and the paths built from them: checked before anything is written.

A hub (``HF_ENDPOINT`` may point anywhere) or a URL chooses the ETag that names a blob, the commit
that names a snapshot folder, the file names of a repo and the last segment of a URL. Each is
checked against a strict pattern before a path is built from it (:func:`etag`, :func:`commit`,
:func:`relative_path`, :func:`component`); a name that fails is an :class:`UnsafeNameError`
naming the value (quoted, shortened) and nothing is written. Every path is then checked after
resolution to stay inside its folder (:func:`inside`: realpath + commonpath), so a symlink planted
in the cache cannot lead a write elsewhere; files are created with ``O_NOFOLLOW | O_EXCL``
(:func:`create_exclusive`) and renamed into place, and an existing partial file is reopened only
if it is a plain file with one link (:func:`open_for_append`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from ..errors import UnsafeNameError

_ETAG = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")  # a git SHA-1 (a small file) or a SHA-256 (LFS)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: how much of a hostile value an error quotes
QUOTE_CHARS = 60


def quoted(value: object) -> str:
    """``value`` quoted for a sentence (``repr``), shortened to :data:`QUOTE_CHARS` characters."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 1] + "…"


def _refuse(what: str, value: object, rule: str, origin: str) -> UnsafeNameError:
    return UnsafeNameError(
        f"{origin} sent {what} {quoted(value)}, which is not {rule}: nothing was written. "
        "Check the source (and HF_ENDPOINT, if set): a server that sends such names cannot be trusted"
    )


def etag(value: object, origin: str) -> str:
    """A hub ETag that names a blob: 40 or 64 lowercase hex digits."""
    if not isinstance(value, str) or not _ETAG.fullmatch(value):
        raise _refuse("the ETag", value, "a git SHA-1 or SHA-256 (40 or 64 hex digits)", origin)
    return value


def commit(value: object, origin: str) -> str:
    """A hub commit that names a snapshot folder: 40 lowercase hex digits."""
    if not isinstance(value, str) or not _COMMIT.fullmatch(value):
        raise _refuse("the commit", value, "a git commit hash (40 hex digits)", origin)
    return value


def sha256(value: object, origin: str) -> str:
    """A hub's LFS sha256 (compared, never a path; checked so a bad one fails before the download)."""
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise _refuse("the sha256", value, "64 hex digits", origin)
    return value


def _bad_component(part: str) -> bool:
    return part in ("", ".", "..") or "\\" in part or _CONTROL.search(part) is not None


def relative_path(value: object, origin: str, what: str = "the file name") -> str:
    """A relative POSIX path (a repo's file, a revision): no empty, ``.`` or ``..`` component, no
    backslash, no NUL or other control character, no leading ``/``."""
    rule = "a relative path without empty, '.' or '..' parts, backslashes or control characters"
    if not isinstance(value, str) or value.startswith("/") or any(map(_bad_component, value.split("/"))):
        raise _refuse(what, value, rule, origin)
    return value


def component(value: object, origin: str, what: str = "the file name") -> str:
    """One path component (a URL's file name after percent-decoding): no ``/`` either."""
    if not isinstance(value, str) or "/" in value or _bad_component(value):
        raise _refuse(what, value, "one file name (no '/', '\\', '.', '..' or control characters)", origin)
    return value


def inside(root: Path, path: Path) -> Path:
    """``path`` if, resolved (symlinks followed), it stays inside ``root`` (resolved too); else an
    UnsafeNameError. A path that does not exist yet resolves as far as it exists."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise UnsafeNameError(
            f"{path} leads outside {root} (to {real}): a link there points elsewhere; nothing was "
            "written. Remove the link (or the folder it is in) and get the model again"
        )
    return path


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _linked(path: Path) -> UnsafeNameError:
    return UnsafeNameError(
        f"{path} is already there as a link or another program's file: nothing was written. "
        "Remove it and get the model again"
    )


def create_exclusive(path: Path, mode: int = 0o644) -> int:
    """A new file opened for writing (``O_CREAT | O_EXCL | O_NOFOLLOW``): never an existing file,
    never through a link. Returns the descriptor."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    except FileExistsError:
        raise _linked(path) from None


def open_for_append(path: Path) -> int:
    """An existing partial file reopened to append (``O_NOFOLLOW``, no ``O_CREAT``), only if it is a
    plain file with one link (a hard link to a file elsewhere would otherwise grow that file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _linked(path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise _linked(path)
    return fd


def plain_or_absent(path: Path) -> None:
    """Nothing at ``path``, or a plain file with one link (not a symlink, not a hard link to a
    file elsewhere); else an UnsafeNameError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        raise _linked(path)


def open_reader(path: Path) -> BinaryIO:
    """A partial file opened to read, not through a link (``O_NOFOLLOW``)."""
    return os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC), "rb")
