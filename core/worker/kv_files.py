"""The worker's KV snapshots (one sequence's KV state with its token ids) and their files.

A stopped worker writes every cached sequence to its ``kv_dir`` (``Engine.save_kv``): a
conversation as ``<model>-<sha256 of the key>.kv``, a cached prompt of the prompt cache as
``<model>-prompt-<rank>.kvp`` (rank 0: the most recent). A file holds a magic line, a JSON header
(model, key, token count, the sliding window's lowest position, the last prompt's length, the
identity of the model file and context size it was made with, the length of the state and a CRC-32
of the token ids and the state), the token ids and the state bytes. A file is read once and
deleted; one made for another model file or context size, from an older format, or damaged
(truncated, garbage, a flipped bit: llama.cpp would take a damaged state's KV values as they are)
is refused with the reason in the log, and its sequence is evaluated again.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..kv_folder import KV_MAGIC
from ..kv_folder import kv_file as kv_file  # the folder's layout, named where the files are written
from ..kv_folder import prompt_file as prompt_file
from ..kv_folder import prompt_files as prompt_files
from ..util import crc

log = logging.getLogger(__name__)

_KV_MAGIC = KV_MAGIC
_OLD_MAGICS = (b"TSKV1\n",)


#: a KV state's bytes: see :func:`state_buffer`
StateBuffer = bytearray | mmap.mmap


def state_buffer(n: int) -> StateBuffer:
    """``n`` writable bytes for a KV state, in zero pages that the kernel fills as they are first
    written (an anonymous mapping), for llama.cpp or ``preadv`` to write into -- both release the
    GIL. ``bytearray(n)`` zero-fills its memory itself with the GIL held: for a 7,500-token chat on
    an 8B model (1 GB) that took 0.3-2.3 s during which every other thread of the worker stood
    still, the arena's request for the GPU among them (a restarted worker's read-ahead of its KV
    file made its wait for the GPU half a second longer on the H200)."""
    return mmap.mmap(-1, n) if n > 0 else bytearray()


def truncated(buf: StateBuffer, n: int) -> StateBuffer:
    """``buf`` cut to its first ``n`` bytes (in place where it can be)."""
    if n >= len(buf):
        return buf
    if n <= 0:
        return bytearray()
    if isinstance(buf, mmap.mmap):
        buf.resize(n)
    else:
        del buf[n:]
    return buf


@dataclass(frozen=True)
class KVSnapshot:
    """A sequence's context state in host memory, with the token ids its KV holds."""

    n_tokens: int
    input_ids: tuple[int, ...]
    state: StateBuffer  # what llama_state_seq_get_data wrote (read in place by llama_state_seq_set_data)
    pos_min: int = 0  # the lowest position the KV still holds (above 0: a sliding window dropped some)
    prompt_len: int = 0  # the prompt of the last request on it (the tokens after it were generated)


def identity(model_path: str, n_ctx: int) -> dict[str, object]:
    """What a snapshot file must have been made with: the model file (path, size, mtime), n_ctx
    (per sequence) and the state's kind (one sequence's: files of whole-context states, written
    before the context held several sequences, are ignored)."""
    st = os.stat(model_path)
    return {
        "path": os.path.abspath(model_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "n_ctx": n_ctx,
        "state": "sequence",
    }


def write(
    target: Path, model_id: str, key: dict[str, object], snap: KVSnapshot, ident: dict[str, object]
) -> None:
    """Write ``snap`` to ``target`` (atomically: a temporary file renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    ids = struct.pack(f"<{snap.n_tokens}i", *snap.input_ids)
    header = json.dumps(
        {
            "model": model_id,
            **key,
            "n_tokens": snap.n_tokens,
            "pos_min": snap.pos_min,
            "prompt_len": snap.prompt_len,
            "file": ident,
            "state_bytes": len(snap.state),
            "crc32": crc.crc32(snap.state, zlib.crc32(ids)),
        }
    ).encode()
    tmp = target.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(_KV_MAGIC + struct.pack(">I", len(header)) + header)
        f.write(ids)
        f.write(snap.state)
    os.replace(tmp, target)


def read(path: Path, key: dict[str, object], ident: dict[str, object]) -> KVSnapshot | None:
    """A snapshot written by ``write`` for ``key`` and ``ident``, or None: the file is then refused
    (removed, with the reason in the log). The file is deleted once read.

    The state (most of the file: about 1 GB for a 7,500-token chat on an 8B model) is read straight
    into the snapshot's own buffer in chunks on several threads, each chunk's CRC taken as it
    arrives (core/util/crc.py), so it is read once and copied never."""
    return _finish(path, _read_file(path, key, ident), ident)


class ReadAhead:
    """One conversation's file read on a thread of its own, before its model file's identity is
    known (a restarted worker reads the KV of the request that started it while the model loads);
    :meth:`result` is what :func:`read` would have returned."""

    def __init__(self, path: Path, key: dict[str, object]) -> None:
        self.path = path
        self._got: tuple[dict[str, object], KVSnapshot] | str = "not read"
        self._thread = threading.Thread(target=self._run, args=(key,), name="kv-read-ahead", daemon=True)
        self._thread.start()

    def _run(self, key: dict[str, object]) -> None:
        self._got = _read_file(self.path, key, None)

    def result(self, ident: dict[str, object]) -> KVSnapshot | None:
        self._thread.join()
        return _finish(self.path, self._got, ident)


def _finish(
    path: Path, got: tuple[dict[str, object], KVSnapshot] | str, ident: dict[str, object]
) -> KVSnapshot | None:
    if not isinstance(got, str) and got[0].get("file") != ident:
        got = "saved for another model file or context size"
    if isinstance(got, str):
        log.warning("ignoring saved KV %s: %s; its sequence is evaluated again", path, got)
        path.unlink(missing_ok=True)
        return None
    path.unlink(missing_ok=True)
    return got[1]


def _read_file(
    path: Path, key: dict[str, object], ident: dict[str, object] | None
) -> tuple[dict[str, object], KVSnapshot] | str:
    """The header and snapshot of ``path``, or why it is refused (``ident`` None: not checked)."""
    try:
        with path.open("rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            head = _read_exactly(f, min(size, len(_KV_MAGIC) + 4))
            if head.startswith(_OLD_MAGICS):
                raise ValueError("written by an older Timeshare in another format")
            if not head.startswith(_KV_MAGIC):
                raise ValueError("not a Timeshare KV snapshot (bad magic)" if head else "the file is empty")
            off = len(_KV_MAGIC)
            (hlen,) = struct.unpack_from(">I", head, off)
            off += 4
            if off + hlen > size:
                raise ValueError(f"truncated: the header needs {hlen} bytes, the file holds {size - off}")
            header = json.loads(_read_exactly(f, hlen))
            off += hlen
            if not isinstance(header, dict):
                raise ValueError("damaged header")
            if any(header.get(k) != v for k, v in key.items()) or (
                ident is not None and header.get("file") != ident
            ):
                raise ValueError("saved for another model file or context size")
            n = int(header["n_tokens"])
            state_bytes = int(header["state_bytes"])
            if n < 0 or state_bytes < 0 or off + 4 * n + state_bytes != size:
                raise ValueError(
                    f"truncated or damaged: {4 * n + state_bytes} bytes of token ids and state expected, "
                    f"{size - off} found"
                )
            ids_bytes = _read_exactly(f, 4 * n)
            state = state_buffer(state_bytes)
            got = _read_state(f.fileno(), off + 4 * n, state, zlib.crc32(ids_bytes))
        if got != int(header["crc32"]):
            raise ValueError("damaged: the checksum of the token ids and state does not match")
        snap = KVSnapshot(
            n,
            struct.unpack(f"<{n}i", ids_bytes),
            state,
            int(header.get("pos_min", 0)),
            int(header.get("prompt_len", 0)),
        )
    except (OSError, EOFError, ValueError, KeyError, TypeError, struct.error) as exc:
        return str(exc) or type(exc).__name__
    return header, snap


def _read_exactly(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError(f"the file ends {n - len(data)} bytes early")
    return data


def _read_state(fd: int, offset: int, state: StateBuffer, start_crc: int) -> int:
    """Fill ``state`` from ``fd`` at ``offset`` (chunks read and checksummed on several threads);
    returns the CRC-32 of what was read, continuing ``start_crc``."""
    view = memoryview(state)

    def chunk(a: int, b: int) -> int:
        done = a
        while done < b:
            got = os.preadv(fd, [view[done:b]], offset + done)
            if got <= 0:
                raise EOFError(f"the file ends at byte {offset + done}")
            done += got
        return zlib.crc32(view[a:b])

    try:
        return crc.crc32_chunks(len(state), chunk, start_crc)
    finally:
        view.release()
