"""Checks that a file is a whole GGUF model before anything loads or restores from it."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..errors import ModelFileError
from ..gguf.modelfile import check_model_file
from . import _ggml


@dataclass(frozen=True)
class GgufInfo:
    path: str
    file_bytes: int
    data_offset: int
    n_tensors: int
    tensor_bytes: int  # bytes the tensor data needs (end of the last tensor - data offset)


def check_gguf(path: str | os.PathLike[str]) -> GgufInfo:
    """Raise ModelFileError (a sentence saying what to do) unless ``path`` is a readable GGUF file
    whose tensor data is all there."""
    p = os.fspath(path)
    check_model_file(p)  # the one "is this a readable GGUF file?" check and its wording
    size = os.path.getsize(p)
    st = os.stat(p)
    # the header walk is cached per file identity: a worker load checks the same file up to
    # twice (Engine.load, Residency.attach); a file whose size, inode or mtime changed is read again
    return _check_tensors(p, size, st.st_dev, st.st_ino, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _check_tensors(p: str, size: int, dev: int, ino: int, mtime_ns: int) -> GgufInfo:
    """The GGUF header and tensor-extent part of :func:`check_gguf`; ``dev``, ``ino`` and
    ``mtime_ns`` are only the cache key. Failures raise, so they are not cached."""
    meta = _ggml.gguf_open_meta(p)
    if meta is None:
        raise ModelFileError(f"{p} is a damaged GGUF file (its header cannot be read): re-download it")
    try:
        data_off = int(_ggml.gguf_get_data_offset(meta))
        n = int(_ggml.gguf_get_n_tensors(meta))
        end = data_off
        for i in range(n):
            end = max(
                end,
                data_off
                + int(_ggml.gguf_get_tensor_offset(meta, i))
                + int(_ggml.gguf_get_tensor_size(meta, i)),
            )
    finally:
        _ggml.gguf_free(meta)
    if end > size:
        raise ModelFileError(
            f"{p} is truncated: its tensors need {end / 1e6:.1f} MB but the file has {size / 1e6:.1f} MB; "
            "re-download it"
        )
    return GgufInfo(p, size, data_off, n, end - data_off)
