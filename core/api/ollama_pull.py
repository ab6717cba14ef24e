"""``POST /api/pull`` of the Ollama API: the pull code's own steps (``core.pull``: parse the name,
list the source, choose the quantisation, download with its checks, add to the config) as
Ollama's NDJSON progress lines, then the pool reloads the config and starts the model.

Names as Ollama spells hub models: ``hf.co/ORG/REPO:QUANT`` (``huggingface.co/...`` and
``ORG/REPO:QUANT`` too), or the ``http(s)://`` URL of a ``.gguf`` file. A repo with several
quantisations and none named is refused with the list (there is no one to ask). A client that
goes away cancels the download (what was downloaded is kept for the next pull to resume).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config.files import load_config
from ..errors import ConfigError, TimeshareError
from ..pull import add, download, remote, sources
from ..pull.progress import Progress
from .dialect import Host

_DONE = object()


def pull_lines(host: Host, name: str, config_path: Path) -> Iterator[dict[str, Any]]:
    """Ollama's progress objects for pulling ``name``; the last one is ``{"status": "success"}``
    or ``{"error": ...}``. The download runs on its own thread; closing the iterator cancels it."""
    out: queue.Queue[object] = queue.Queue(maxsize=256)
    cancel = threading.Event()

    def put(item: dict[str, Any]) -> None:
        while not cancel.is_set():
            try:
                out.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def progress(p: Progress) -> None:
        if p.phase == "verify":
            put({"status": "verifying sha256 digest"})
            return
        item: dict[str, Any] = {"status": f"pulling {p.filename}", "digest": p.filename, "completed": p.done}
        if p.total is not None:
            item["total"] = p.total
        put(item)

    def work() -> None:
        try:
            put({"status": "pulling manifest"})
            source = sources.parse_source(name.removeprefix("huggingface.co/"))
            listing = remote.list_source(source)
            try:
                choice = sources.choose(listing)
            except TimeshareError as exc:
                labels = ", ".join(c.label for c in listing.choices)
                put({"error": f"{exc}; name one as {listing.title}:QUANT (one of: {labels})"})
                return
            result = download.pull(listing, choice, progress=progress, cancel=cancel)
            put({"status": "writing manifest"})
            _config, model, _added = add.add_to_config(result, config_path)
            host.pool.apply_config(load_config(config_path, check_paths=False))
            put({"status": "success", "timeshare": {"id": model.id, "path": str(result.path)}})
        except (TimeshareError, ConfigError, ValueError) as exc:
            put({"error": str(exc)})
        except Exception as exc:  # a line for the client, never a dead thread
            put({"error": f"pull failed ({type(exc).__name__}: {exc})"})
        finally:
            put({"_end": True})

    thread = threading.Thread(target=work, name="timeshare-ollama-pull", daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            assert isinstance(item, dict)
            if item.get("_end"):
                return
            yield item
    finally:
        cancel.set()
