"""Image files named in a prompt, as ``ollama run`` takes them (issue 41): ``timeshare run MODEL
"what is this? ./cat.png"`` sends cat.png with the text "what is this?".

A word of the prompt (or a quoted string, or a path with escaped spaces) that ends in an image
extension and names a file that exists is taken out of the text and sent as an image (OpenAI's
``image_url`` part with a data URL, before the text, as Ollama puts a message's images first); a
path that does not exist stays text. The server checks the image (core/api/images.py).
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

#: an image file's extension -> its MIME type
MIME = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".gif": "image/gif",
    ".bmp": "image/bmp",
}
_EXT = "|".join(e.lstrip(".") for e in MIME)
# a quoted path, or a run of non-space characters (a backslash escapes a space), ending in an
# image extension
_QUOTED = rf"""(?P<quote>["'])(?P<quoted>[^"']+\.(?:{_EXT}))(?P=quote)"""
_BARE = rf"""(?P<bare>(?:\\ |[^\s"'])+\.(?:{_EXT}))(?=\s|$)"""
_PATH = re.compile(f"{_QUOTED}|{_BARE}", re.IGNORECASE)


def split_images(text: str, base: Path | None = None) -> tuple[str, list[Path]]:
    """The prompt without the image files it names, and those files in order (``base``: where
    relative paths start; the current folder by default)."""
    images: list[Path] = []
    kept: list[str] = []
    last = 0
    for m in _PATH.finditer(text):
        raw = m["quoted"] or m["bare"].replace("\\ ", " ")
        path = Path(raw).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        images.append(path)
    kept.append(text[last:])
    cleaned = re.sub(r"[ \t]{2,}", " ", "".join(kept)).strip() if images else text
    return cleaned, images


def content_with_images(text: str, images: list[Path]) -> str | list[dict[str, Any]]:
    """A user message's content: the text alone, or the images (data URLs) and then the text."""
    if not images:
        return text
    parts: list[dict[str, Any]] = []
    for path in images:
        mime = MIME.get(path.suffix.lower(), "application/octet-stream")
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}})
    parts.append({"type": "text", "text": text})
    return parts
