"""The KV folder: where stopped workers leave their KV snapshots, and its upkeep.

``<kv root>/<model id>/`` holds one model's files (``core/worker/kv_files.py`` writes and reads
them): a conversation's as ``<model>-<sha256 of its key>.kv``, the prompt cache's as
``<model>-prompt-<rank>.kvp``, each with a JSON header that names its model and key. A KV file is
a cache: removing one costs its sequence's prompt evaluated again, never a message.

Nothing else removes them, so the folder is kept here: a deleted conversation's files go with it
(:func:`remove_conversation`), a model's folder when the model leaves the configuration
(:func:`remove_model`), and at start, before any worker runs (no file is in use then),
:func:`sweep` removes what a crash left half written, the conversations its caller says are gone,
and the folders of models no longer configured once nothing in them changed for
``STALE_MODEL_FOLDER_DAYS``: another configuration (``timeshare serve --config other.toml``) may
share the folder, and its models' files must survive a start of this one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: the first bytes of a snapshot file of the current format (a 4-byte header length follows)
KV_MAGIC = b"TSKV2\n"
STALE_MODEL_FOLDER_DAYS = 30.0  # an unconfigured model's folder untouched this long goes at a start


def kv_file(kv_dir: Path, model_id: str, conversation: str) -> Path:
    """The file of ``conversation``'s KV in a model's folder ``kv_dir``."""
    digest = hashlib.sha256(conversation.encode()).hexdigest()[:32]
    return kv_dir / f"{model_id}-{digest}.kv"


def prompt_file(kv_dir: Path, model_id: str, rank: int) -> Path:
    return kv_dir / f"{model_id}-prompt-{rank}.kvp"


def prompt_files(kv_dir: Path, model_id: str) -> dict[int, Path]:
    """This model's cached-prompt files in ``kv_dir``, by rank (0: the most recent)."""
    pattern = re.compile(re.escape(model_id) + r"-prompt-(\d+)\.kvp")
    found: dict[int, Path] = {}
    try:
        for path in kv_dir.iterdir():
            match = pattern.fullmatch(path.name)
            if match:
                found[int(match.group(1))] = path
    except OSError:
        pass
    return found


def header_of(path: Path) -> dict[str, object] | None:
    """The JSON header of a snapshot file (its model and key: ``conversation`` for a
    conversation's), or None when it is no snapshot of this format or cannot be read."""
    try:
        with path.open("rb") as f:
            head = f.read(len(KV_MAGIC) + 4)
            if len(head) < len(KV_MAGIC) + 4 or not head.startswith(KV_MAGIC):
                return None
            (hlen,) = struct.unpack_from(">I", head, len(KV_MAGIC))
            raw = f.read(hlen)
            if len(raw) != hlen:
                return None
            header = json.loads(raw)
    except (OSError, ValueError, struct.error):
        return None
    return header if isinstance(header, dict) else None


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot remove KV file %s: %s", path, exc)
        return False
    return True


def _model_folders(root: Path) -> list[Path]:
    try:
        return [d for d in root.iterdir() if d.is_dir() and not d.is_symlink()]
    except OSError:
        return []


def remove_conversation(root: Path, conversation: str) -> int:
    """Remove ``conversation``'s KV files, every model's. Returns how many went."""
    gone = sum(_unlink(kv_file(d, d.name, conversation)) for d in _model_folders(root))
    if gone:
        log.info("removed %d KV file(s) of deleted conversation %s", gone, conversation)
    return gone


def remove_model(root: Path, model_id: str) -> bool:
    """Remove a model's folder (every KV file of it). True when there was one."""
    folder = root / model_id
    if not folder.is_dir() or folder.is_symlink() or folder.parent != root:
        return False
    shutil.rmtree(folder, ignore_errors=True)
    log.info("removed the KV folder of %s (no longer configured)", model_id)
    return True


@dataclass(frozen=True)
class Swept:
    """What :func:`sweep` removed."""

    models: tuple[str, ...] = ()  # folders of models not configured
    files: tuple[Path, ...] = ()  # files in the folders of configured models


def _newest_change(folder: Path) -> float:
    """The newest modification time of ``folder`` and the files in it (0.0 when unreadable)."""
    try:
        newest = folder.stat().st_mtime
        for path in folder.iterdir():
            newest = max(newest, path.stat().st_mtime)
    except OSError:
        return 0.0
    return newest


def sweep(
    root: Path,
    models: Iterable[str],
    conversation_gone: Callable[[str], bool] | None = None,
    now: float | None = None,
) -> Swept:
    """At start, before any worker of ``root`` runs: remove the folders of models not in
    ``models`` in which nothing changed for ``STALE_MODEL_FOLDER_DAYS`` (a newer one may be
    another configuration's, sharing the folder: it stays), the files a crash left half written
    (``*.tmp``) or that are no snapshot at all, and, with ``conversation_gone``, every
    conversation file whose key it says is gone. The prompt-cache files and every other
    conversation's stay. ``now``: the clock to age folders by (default: time.time())."""
    wanted = set(models)
    clock = time.time() if now is None else now
    gone_models: list[str] = []
    files: list[Path] = []
    for folder in _model_folders(root):
        if folder.name not in wanted:
            if clock - _newest_change(folder) < STALE_MODEL_FOLDER_DAYS * 86400.0:
                continue  # maybe another configuration's model: its files are not ours to remove
            if remove_model(root, folder.name):
                gone_models.append(folder.name)
            continue
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            continue
        for path in entries:
            if not path.is_file() or path.suffix == ".kvp":
                continue
            if path.suffix == ".kv":
                header = header_of(path)
                key = header.get("conversation") if header is not None else None
                if header is not None and not (
                    isinstance(key, str) and conversation_gone is not None and conversation_gone(key)
                ):
                    continue
            elif path.suffix != ".tmp":
                continue  # not the KV folder's: left alone
            if _unlink(path):
                files.append(path)
    if gone_models or files:
        log.info(
            "KV folder: removed %d model folder(s) (%s) and %d file(s)",
            len(gone_models),
            ", ".join(gone_models) or "none",
            len(files),
        )
    return Swept(tuple(gone_models), tuple(files))
