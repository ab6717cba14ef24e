"""The cheap check of a model file that every room does before anything expensive.

It reads a few bytes, never numpy or llama.cpp, so config validation, the pool, the engine, the
catalog, the benchmarks and the app's "Locate file…" call it anywhere: :func:`read_gguf_start` is
the ONE "is this a readable GGUF file?" check and its sentences are the one wording of it
(:func:`gguf_problem` and :func:`check_model_file` are its two other shapes). The deeper checks
build on it: the header (``gguf.header.check_fixed_header``: version, truncated header) and the
tensor data (``residency.check_gguf``: truncated file), done when the worker loads the file.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ..errors import ModelFileError

GGUF_MAGIC = b"GGUF"

#: what a file is when it starts with these bytes instead (a download that went wrong, mostly)
_KNOWN_STARTS = (
    (b"<!do", "it looks like a web page: the download went wrong"),
    (b"<htm", "it looks like a web page: the download went wrong"),
    (b"{", "it looks like a JSON file"),
    (b"PK\x03\x04", "it looks like a zip archive: unpack it first"),
    (b"\x1f\x8b", "it looks like a gzip archive: unpack it first"),
    (b"version https://git-lfs", "it is a Git LFS pointer: the model itself was not downloaded"),
)


#: a split model's part: ``<stem>-00001-of-00003.gguf`` (llama.cpp's gguf-split names), any case
SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)


def file_start(head: bytes) -> str:
    """How a file that should be a GGUF starts, for people: "it starts with 'hell', not 'GGUF'",
    "it is empty", "it starts with the bytes 50 4b 03 04, not 'GGUF'; it looks like a zip archive:
    unpack it first" — never a Python bytes literal."""
    if not head:
        return "it is empty"
    start = head[:4]
    text = start.decode("ascii", errors="replace")
    if text.isprintable() and "\ufffd" not in text:
        shown = f"'{text}'"
    else:
        shown = "the bytes " + " ".join(f"{b:02x}" for b in start)
    what = next((words for prefix, words in _KNOWN_STARTS if head.lower().startswith(prefix.lower())), "")
    return f"it starts with {shown}, not 'GGUF'" + (f"; {what}" if what else "")


#: errors that say the system is short of something for now, not that the file is bad
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOBUFS})

_TRANSIENT_WORDS = {
    errno.EMFILE: "too many open files in this process",
    errno.ENFILE: "too many open files on this system",
    errno.ENOMEM: "out of memory",
    errno.EAGAIN: "out of processes or memory for now",
    errno.ENOBUFS: "out of buffer space",
}


def is_transient(exc: BaseException) -> bool:
    """Whether an OSError is a passing shortage (open files, memory) worth retrying."""
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def transient_text(exc: OSError) -> str:
    """A transient OSError as what it is: "too many open files in this process (EMFILE)"."""
    code = exc.errno if exc.errno is not None else 0
    name = errno.errorcode.get(code, str(code))
    return f"{_TRANSIENT_WORDS.get(code, exc.strerror or str(exc))} ({name})"


def read_gguf_start(
    path: str | os.PathLike[str],
    size: int = 32,
    *,
    model_id: str | None = None,
    raise_transient: bool = False,
) -> bytes:
    """The first ``size`` bytes of ``path`` once they prove it a readable GGUF file; otherwise
    ModelFileError with the one sentence that says what is wrong and what to do.

    ``model_id`` names the model whose file it is in the sentence. A passing shortage (too many
    open files, out of memory) is not the file's fault: it is worded as what it is, or raised as
    the OSError with ``raise_transient`` (the caller retries)."""
    p = Path(path).expanduser()
    whose = f" (of model {model_id!r})" if model_id else ""
    if not p.exists():
        raise ModelFileError(
            f"model file {p}{whose} does not exist: check the path, which must name a .gguf file"
        )
    if p.is_dir():
        raise ModelFileError(
            f"model path {p}{whose} is a folder, not a file: point it at the .gguf file inside it"
        )
    if not p.is_file():
        raise ModelFileError(f"model path {p}{whose} is not a file: point it at a .gguf file")
    try:
        with p.open("rb") as f:
            head = f.read(max(size, 32))
    except OSError as exc:
        if is_transient(exc):
            if raise_transient:
                raise
            raise ModelFileError(
                f"model file {p}{whose} cannot be opened now: {transient_text(exc)}; try again shortly"
            ) from exc
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ModelFileError(
                f"model file {p}{whose} cannot be read ({exc.strerror}): check its permissions"
            ) from exc
        raise ModelFileError(f"model file {p}{whose} cannot be read ({exc.strerror or exc})") from exc
    if head[:4] != GGUF_MAGIC:
        raise ModelFileError(
            f"model file {p}{whose} is not a GGUF file ({file_start(head)}): choose a .gguf model file"
        )
    return head[:size]


def gguf_problem(path: str, *, model_id: str | None = None, raise_transient: bool = False) -> str:
    """Why ``path`` cannot be a GGUF model (:func:`read_gguf_start`'s sentence); "" when it can."""
    try:
        read_gguf_start(path, model_id=model_id, raise_transient=raise_transient)
    except ModelFileError as exc:
        return str(exc)
    return ""


def check_model_file(path: str | os.PathLike[str]) -> None:
    """Fail early and clearly (ModelFileError) on a model file that is missing or not a GGUF."""
    read_gguf_start(path)
