"""The cheap check of a model file that every room does before anything expensive.

It reads four bytes, never numpy or llama.cpp, so the pool, the engine and the benchmarks can
call it anywhere. The full check (header, truncated tensor data) is ``residency.check_gguf``,
done by the worker when it loads the file; the config layer words its own field-path messages.
"""

from __future__ import annotations

import errno
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


def gguf_problem(path: str, *, raise_transient: bool = False) -> str:
    """Why ``path`` cannot be a GGUF model, as a sentence that says what to do; "" when it can.

    A passing shortage (too many open files, out of memory) is not the file's fault: it is worded
    as what it is, or raised as the OSError with ``raise_transient`` (the caller retries)."""
    p = Path(path).expanduser()
    if not p.exists():
        return f"model file {p} does not exist: check the path, which must name a .gguf file"
    if not p.is_file():
        return f"model path {p} is not a file: point it at a .gguf file"
    try:
        with p.open("rb") as f:
            magic = f.read(32)
    except OSError as exc:
        if is_transient(exc):
            if raise_transient:
                raise
            return f"model file {p} cannot be opened now: {transient_text(exc)}; try again shortly"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return f"model file {p} cannot be read ({exc.strerror}): check its permissions"
        return f"model file {p} cannot be read ({exc.strerror or exc})"
    if magic[:4] != GGUF_MAGIC:
        return f"model file {p} is not a GGUF file ({file_start(magic)}): choose a .gguf model file"
    return ""


def check_model_file(path: str) -> None:
    """Fail early and clearly on a model file that is missing or not a GGUF at all."""
    problem = gguf_problem(path)
    if problem:
        raise ModelFileError(problem)
