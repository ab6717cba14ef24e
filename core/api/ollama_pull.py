"""``POST /api/pull`` of the Ollama API: the pull code's own steps (``core.pull``: parse the name,
list the source, choose the quantisation, download with its checks, add to the config) as
Ollama's NDJSON progress lines, then the pool reloads the config and starts the model.

Names as Ollama spells hub models: ``hf.co/ORG/REPO:QUANT`` (``huggingface.co/...`` and
``ORG/REPO:QUANT`` too), or the ``http(s)://`` URL of a ``.gguf`` file. A repo with several
quantisations and none named is refused with the list (there is no one to ask). A client that
goes away cancels the download (what was downloaded is kept for the next pull to resume).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from pathlib import Path
from typing import Any

from ..errors import ConfigError, TimeshareError
from ..pull import add, download, remote, sources
from ..pull.progress import Progress
from .dialect import Host


class PullJob:
    """Pulling ``name`` on its own thread as Ollama's progress objects: :meth:`get` them; the
    last one is ``{"status": "success"}`` or ``{"error": ...}``. :meth:`cancel` stops the
    download (what was downloaded is kept for the next pull to resume)."""

    def __init__(self, host: Host, name: str, config_path: Path) -> None:
        self.host = host
        self.name = name
        self.config_path = config_path
        self._out: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=256)
        self._cancel = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._work, name="timeshare-ollama-pull", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def get(self, timeout: float) -> dict[str, Any] | None:
        """The next progress object; None when none came within ``timeout`` s (or after the
        last one): the caller looks whether its client is still there, then asks again."""
        if self._ended:
            return None
        try:
            item = self._out.get(timeout=timeout)
        except queue.Empty:
            return None
        if item.get("_end"):
            self._ended = True
            return None
        return item

    @property
    def ended(self) -> bool:
        """The last object was taken."""
        return self._ended

    def _put(self, item: dict[str, Any]) -> None:
        while not self._cancel.is_set():
            try:
                self._out.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        if item.get("_end"):  # the end always gets through (nobody may be reading)
            with contextlib.suppress(queue.Full):
                self._out.put_nowait(item)

    def _progress(self, p: Progress) -> None:
        if p.phase == "verify":
            self._put({"status": "verifying sha256 digest"})
            return
        item: dict[str, Any] = {"status": f"pulling {p.filename}", "digest": p.filename, "completed": p.done}
        if p.total is not None:
            item["total"] = p.total
        self._put(item)

    def _work(self) -> None:
        put = self._put
        try:
            put({"status": "pulling manifest"})
            source = sources.parse_source(self.name.removeprefix("huggingface.co/"))
            listing = remote.list_source(source)
            try:
                choice = sources.choose(listing)
            except TimeshareError as exc:
                labels = ", ".join(c.label for c in listing.choices)
                put({"error": f"{exc}; name one as {listing.title}:QUANT (one of: {labels})"})
                return
            result = download.pull(listing, choice, progress=self._progress, cancel=self._cancel)
            # the repo's vision projector, beside the model (issue 41)
            projector = download.pull_projector(listing, progress=self._progress, cancel=self._cancel)
            put({"status": "writing manifest"})
            # the one writer: the file as it is now, under its lock, applied before the next change
            _config, model, _added = add.add_to_config(
                result,
                self.config_path,
                then=self.host.pool.apply_config,
                mmproj=projector.path if projector is not None else None,
            )
            put({"status": "success", "timeshare": {"id": model.id, "path": str(result.path)}})
        except (TimeshareError, ConfigError, ValueError) as exc:
            put({"error": str(exc)})
        except Exception as exc:  # a line for the client, never a dead thread
            put({"error": f"pull failed ({type(exc).__name__}: {exc})"})
        finally:
            put({"_end": True})
