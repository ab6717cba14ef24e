"""The checks on a downloaded file: the GGUF magic and the architecture from its first bytes
(before the rest is downloaded), the sha256.

:func:`peek_architecture` reads ``general.architecture`` with the catalog's GGUF reader
(:class:`gguf.header.GgufCursor`); :func:`check_architecture` asks whether the installed llama.cpp
loads it (``llama_archs``).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from pathlib import Path

from ..errors import CancelledError, CorruptDownloadError, UnsupportedArchitectureError
from ..gguf.header import GgufCorruptError, GgufCursor, GgufTruncatedError
from ..gguf.llama_archs import ArchSupport
from ..gguf.modelfile import GGUF_MAGIC, file_start
from .progress import Meter

log = logging.getLogger(__name__)

#: bytes of a file's start read to check its magic and architecture before the rest is downloaded
PEEK_BYTES = 1 << 20
CHUNK_BYTES = 1 << 20


class Digest:
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
    cur = GgufCursor(head, len(head), endian)
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
    except GgufTruncatedError:
        return None
    except GgufCorruptError as exc:
        raise ValueError(str(exc)) from None
    return None


def check_file_start(path: Path, name: str, support: ArchSupport, first_part: bool) -> None:
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
        check_architecture(arch, name, support)


def check_architecture(arch: str, name: str, support: ArchSupport) -> None:
    if support.supports(arch):
        return
    if support.projector:
        raise UnsupportedArchitectureError(f"{name} is a {arch!r} model, not a vision projector (mmproj)")
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


def sha256_of(path: Path, meter: Meter, name: str, part: int, cancel: threading.Event | None) -> str:
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
