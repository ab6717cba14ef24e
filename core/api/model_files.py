"""What the configured models' GGUF files say, for the API's listings: their headers and sha256,
cached while a file is unchanged, and a model's pooling before its worker has loaded."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from ..errors import TimeshareError
from ..gguf.catalog import CatalogEntry, read_gguf_header
from ..state import ModelStatus


class Files:
    """What the GGUF files say (header and sha256), cached while a file is unchanged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._headers: dict[tuple[str, int, int], CatalogEntry] = {}
        self._digests: dict[tuple[str, int, int], str] = {}

    @staticmethod
    def _key(path: str) -> tuple[str, int, int]:
        st = Path(path).stat()
        return (path, st.st_mtime_ns, st.st_size)

    def header(self, path: str) -> CatalogEntry:
        key = self._key(path)
        with self._lock:
            known = self._headers.get(key)
        if known is None:
            known = read_gguf_header(path)
            with self._lock:
                self._headers[key] = known
        return known

    def digest(self, path: str) -> str:
        """``sha256:<hex>`` of the file: a Hugging Face cache blob is named by it already."""
        resolved = Path(path).resolve()
        if resolved.parent.name == "blobs" and len(resolved.name) == 64:
            return f"sha256:{resolved.name}"
        key = self._key(path)
        with self._lock:
            known = self._digests.get(key)
        if known is None:
            h = hashlib.sha256()
            with resolved.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            known = f"sha256:{h.hexdigest()}"
            with self._lock:
                self._digests[key] = known
        return known

    def pooling(self, status: ModelStatus) -> str:
        """A model's pooling ("rank": a reranker): as its worker reported once it has loaded
        (its chat format is known then), before that as its GGUF's header says ("" when the
        file cannot be read: its worker will say what is wrong with it)."""
        if status.chat_format or status.pooling:
            return status.pooling
        try:
            return self.header(status.path).pooling
        except (OSError, TimeshareError):
            return ""
