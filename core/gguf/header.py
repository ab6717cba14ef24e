"""The GGUF header reader: metadata and tensor table, arrays skipped (the catalog reads whole files
with it, ``pull.verify`` a download's first bytes); the weights are never read.

A small reader that skips arrays instead of building them: the gguf package's GGUFReader
materialises every vocabulary string as a numpy array, which took 13 s for SmolLM2 (49k tokens)
and 56 s for Gemma-3 (262k tokens) on the dev machine — too slow for a folder scan. The gguf
package still supplies the type tables (imported when a header is parsed: numpy, app process only).
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelFileError
from .modelfile import gguf_problem, read_gguf_start

_FIXED_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata KV count

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_WANTED_STRINGS = ("general.architecture", "general.name", "general.license", "general.size_label")


class GgufTruncatedError(Exception):
    """The bytes end before the GGUF header does (a partial file's start, a truncated file)."""


class GgufCorruptError(Exception):
    """The GGUF header cannot be right (an unknown value or tensor type, a bad alignment...)."""


@dataclass(frozen=True)
class Header:
    version: int
    tensor_count: int
    kv_count: int
    values: dict[str, Any]  # scalars and wanted strings; arrays as ("array", length)
    data_end: int  # where the last tensor's data ends
    type_bytes: dict[int, int]  # ggml type -> bytes of tensor data of that type


class GgufCursor:
    """Reads a GGUF header's fields from ``buf`` (bytes or a mmap) up to ``size``: raises
    GgufTruncatedError where they end, GgufCorruptError for an unknown value type. Used by the
    catalog on whole files and by ``pull.verify`` on a download's first bytes."""

    def __init__(self, buf: Any, size: int, endian: str) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0
        self.e = endian

    def take(self, fmt: str) -> Any:
        st = struct.Struct(self.e + fmt)
        if self.pos + st.size > self.size:
            raise GgufTruncatedError
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GgufTruncatedError
        self.pos += n

    def string(self, keep: bool = True) -> str:
        n = self.take("Q")
        if self.pos + n > self.size:
            raise GgufTruncatedError
        start = self.pos
        self.pos += n
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace") if keep else ""

    def _skip_strings(self, count: int) -> None:
        # the hot loop (a vocabulary has 50k-260k strings): no method calls per string
        length = struct.Struct(self.e + "Q").unpack_from
        buf, pos, size = self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                raise GgufTruncatedError
            pos += 8 + length(buf, pos)[0]
        if pos > size:
            raise GgufTruncatedError
        self.pos = pos

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(keep)
        if vtype == _ARRAY:
            sub = self.take("I")
            count = self.take("Q")
            if sub in _SCALARS:
                self.skip(struct.calcsize(_SCALARS[sub]) * count)
            elif sub == _STRING:
                self._skip_strings(count)
            elif sub == _ARRAY:
                for _ in range(count):
                    self.value(_ARRAY, False)
            else:
                raise GgufCorruptError(f"unknown array element type {sub} at byte {self.pos}")
            return ("array", count)
        raise GgufCorruptError(f"unknown metadata value type {vtype} at byte {self.pos}")


def parse_metadata(buf: Any, size: int) -> tuple[GgufCursor, int, int, int, dict[str, Any]]:
    """The fixed header and the metadata of ``buf`` (its first ``size`` bytes): (cursor at the
    tensor table, version, tensor count, metadata count, values). Raises GgufTruncatedError when
    the metadata goes on past ``size`` (the first bytes of a remote file: read more)."""
    if size < _FIXED_HEADER.size:
        raise GgufTruncatedError
    endian = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version not in (2, 3) and struct.unpack_from(">I", buf, 4)[0] in (2, 3):
        endian = ">"  # a big-endian GGUF
    cur = GgufCursor(buf, size, endian)
    cur.pos = 4
    version = cur.take("I")
    tensor_count = cur.take("Q")
    kv_count = cur.take("Q")
    values: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        vtype = cur.take("I")
        keep = key in _WANTED_STRINGS or key == "tokenizer.chat_template"
        values[key] = cur.value(vtype, keep)
    return cur, version, tensor_count, kv_count, values


def parse_header(buf: Any, size: int) -> Header:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur, version, tensor_count, kv_count, values = parse_metadata(buf, size)
    arch = values.get("general.architecture")
    alignment = values.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GgufCorruptError(f"general.alignment is {alignment!r}, not a power of two")
    extents: list[tuple[int, int, int]] = []  # (offset, bytes, type)
    for _ in range(tensor_count):
        cur.string(keep=False)
        n_dims = cur.take("I")
        if n_dims > 4:
            raise GgufCorruptError(f"a tensor has {n_dims} dimensions (at most 4)")
        n_elems = 1
        for _ in range(n_dims):
            n_elems *= cur.take("Q")
        ggml_type = cur.take("I")
        offset = cur.take("Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise GgufCorruptError(f"tensor type {ggml_type} is unknown (a newer quantisation?)") from None
        extents.append((offset, n_elems * type_size // block, ggml_type))
    data_start = -(-cur.pos // alignment) * alignment
    type_bytes: Counter[int] = Counter()
    for _, nbytes, ggml_type in extents:
        type_bytes[ggml_type] += nbytes
    data_end = max((data_start + off + nb for off, nb, _ in extents), default=data_start)
    if isinstance(arch, str):
        ctx = values.get(f"{arch}.context_length")
        values["_context_length"] = ctx
    return Header(version, tensor_count, kv_count, values, data_end, dict(type_bytes))


def check_fixed_header(path: Path) -> tuple[int, int]:
    """Clear errors for a missing, non-GGUF or unsupported file; returns (file size, tensor count)."""
    head = read_gguf_start(path, _FIXED_HEADER.size)  # the one GGUF file check and its wording
    try:
        size = path.stat().st_size
    except OSError as exc:  # gone or unreadable since: say it the same way
        raise ModelFileError(gguf_problem(str(path)) or f"{path} cannot be read ({exc.strerror})") from exc
    if len(head) < _FIXED_HEADER.size:
        raise ModelFileError(
            f"{path.name} is truncated: the file ends at byte {size}, inside the GGUF header — re-download it"
        )
    _, version, tensor_count, _ = _FIXED_HEADER.unpack(head)
    if version not in (2, 3) and struct.unpack(">I", head[4:8])[0] in (2, 3):
        version = struct.unpack(">I", head[4:8])[0]
        tensor_count = struct.unpack(">Q", head[8:16])[0]
    if version not in (2, 3):
        raise ModelFileError(
            f"{path.name} is GGUF version {version}, which this Timeshare cannot read (versions 2 and 3 can)"
        )
    return size, tensor_count


def quantisation(header: Header) -> str:
    from gguf import GGMLQuantizationType, LlamaFileType

    file_type = header.values.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        try:
            ft = LlamaFileType(file_type)
        except ValueError:
            ft = None
        if ft is not None and ft != LlamaFileType.GUESSED:
            return ft.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    # no file type recorded: name the type holding most weight bytes
    if not header.type_bytes:
        return ""
    dominant = max(header.type_bytes.items(), key=lambda kv: kv[1])[0]
    return GGMLQuantizationType(dominant).name
