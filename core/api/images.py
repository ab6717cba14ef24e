"""Images a client sends (issue 41), checked before anything else sees them: every dialect's image
(OpenAI's ``image_url`` parts, Anthropic's ``image`` blocks, Ollama's ``images``) comes through
:func:`image_from_base64`, :func:`image_from_url` or :func:`checked`, and leaves as the client's
bytes, proved to be one whole image of an accepted format and size, or as a 400 naming the part.

The checks, in order (Pillow: the format's header is read before any pixel is decoded):

- the format is PNG, JPEG, WebP, GIF (its first frame) or BMP; SVG and anything else is refused,
  and a data URL's or block's declared MIME type must be the format the bytes are;
- the size from the header: at most ``MAX_SIDE`` pixels a side and ``MAX_IMAGE_PIXELS`` in all
  (a 20,000 × 20,000 PNG of a few KB is refused before it is decompressed: Pillow's own
  decompression-bomb guard is under these limits);
- the whole image decodes (a truncated or damaged file is refused here, not in the worker).

The worker decodes the bytes again, and libmtmd resizes the pixels as its projector needs (the
preprocessing llama-server uses); the API does not resize. The bytes are sent on, not the pixels:
they are what the request body held (at most 8 MiB), while the pixels could be many times that.
An http(s) URL is fetched only when ``api.fetch_image_urls`` is on, at most ``MAX_FETCH_BYTES``
within ``FETCH_TIMEOUT_S``.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from ..wire.protocol import MAX_IMAGE_PIXELS, MAX_IMAGES, ImagePart
from .errors import BadRequestError

#: the longest side an image may have, in pixels
MAX_SIDE = 16384
#: an image fetched from a URL: at most this many bytes, within this many seconds
MAX_FETCH_BYTES = 8 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0

#: Pillow's format name -> the MIME types that name it
FORMATS: dict[str, tuple[str, ...]] = {
    "PNG": ("image/png",),
    "JPEG": ("image/jpeg", "image/jpg"),
    "WEBP": ("image/webp",),
    "GIF": ("image/gif",),
    "BMP": ("image/bmp", "image/x-ms-bmp"),
}
_ACCEPTED = "PNG, JPEG, WebP, GIF or BMP"
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)$", re.S | re.I)

#: fetches an http(s) URL's bytes for ``where`` (None: fetching is off)
Fetcher = Callable[[str, str], bytes]


@dataclass
class ImageBudget:
    """Counts one request's images: more than MAX_IMAGES is refused, naming the part."""

    count: int = 0

    def take(self, where: str) -> None:
        self.count += 1
        if self.count > MAX_IMAGES:
            raise BadRequestError(
                f"{where}: this request holds more than {MAX_IMAGES} images; send at most {MAX_IMAGES} "
                "per request",
                where,
            )


def checked(data: bytes, where: str, mime: str | None = None) -> bytes:
    """``data`` when it is one whole image of an accepted format and size (``mime``: the type the
    client declared for it, which must be its format's); else BadRequestError naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadRequestError(f"{where}: the image is empty", where)
    if mime is not None:
        mime = mime.strip().lower()
        if mime == "image/svg+xml":
            raise BadRequestError(f"{where}: SVG images are not supported; send {_ACCEPTED}", where)
        if not any(mime in names for names in FORMATS.values()):
            what = "not an image type" if not mime.startswith("image/") else "an image type not supported"
            raise BadRequestError(f"{where}: {mime or 'no MIME type'} is {what}; send {_ACCEPTED}", where)
    try:
        with warnings.catch_warnings():
            # our limits are below Pillow's: its warning is not the answer, the check below is
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise BadRequestError(
            f"{where}: the image is larger than {MAX_IMAGE_PIXELS:,} pixels; send a smaller one", where
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        start = data.lstrip()[:5].lower()
        if start.startswith((b"<svg", b"<?xml")):
            raise BadRequestError(f"{where}: SVG images are not supported; send {_ACCEPTED}", where) from None
        raise BadRequestError(f"{where}: this is not an image ({_ACCEPTED} are accepted)", where) from None
    with im:
        fmt = im.format or ""
        if fmt not in FORMATS:
            what = fmt or "this"
            raise BadRequestError(f"{where}: {what} images are not supported; send {_ACCEPTED}", where)
        if mime is not None and mime not in FORMATS[fmt]:
            raise BadRequestError(f"{where}: the data says {mime} but holds a {fmt} image", where)
        width, height = im.size
        if width < 1 or height < 1:
            raise BadRequestError(f"{where}: the image has no pixels", where)
        if width > MAX_SIDE or height > MAX_SIDE or width * height > MAX_IMAGE_PIXELS:
            raise BadRequestError(
                f"{where}: the image is {width}x{height} pixels; send one of at most {MAX_SIDE} a side "
                f"and {MAX_IMAGE_PIXELS:,} pixels in all",
                where,
            )
        try:
            im.load()
        except (OSError, ValueError, SyntaxError) as exc:
            problem = f"{where}: the {fmt} image is damaged or truncated ({exc})"
            raise BadRequestError(problem, where) from None
    return data


def image_from_base64(text: object, where: str, mime: str | None) -> bytes:
    """Base64 image data (Anthropic's and Ollama's), checked (see :func:`checked`)."""
    if not isinstance(text, str) or not text:
        raise BadRequestError(f"{where}: must be the image's bytes in base64 (a non-empty string)", where)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError(f"{where}: is not valid base64", where) from None
    return checked(data, where, mime)


def image_from_url(url: object, where: str, fetch: Fetcher | None) -> bytes:
    """OpenAI's ``image_url.url``: a ``data:image/...;base64,`` URL, or an http(s) URL fetched by
    ``fetch`` (None: refused, saying which setting allows it)."""
    if not isinstance(url, str) or not url:
        raise BadRequestError(f"{where}: must be a data: URL or an http(s) URL (a non-empty string)", where)
    if url[:5].lower() == "data:":
        m = _DATA_URL.match(url)
        if m is None:
            raise BadRequestError(f"{where}: is not a valid data: URL (data:image/png;base64,...)", where)
        params = [p.strip().lower() for p in m["params"].split(";") if p.strip()]
        if "base64" not in params:
            problem = f"{where}: a data: URL's image must be base64 (data:image/png;base64,...)"
            raise BadRequestError(problem, where)
        return image_from_base64(m["data"], where, m["mime"])
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise BadRequestError(f"{where}: {scheme}: URLs are not supported; send a data: URL", where)
    if fetch is None:
        raise BadRequestError(
            f"{where}: http(s) image URLs are not fetched (api.fetch_image_urls is off); send the image "
            "inline as a data: URL, or turn the setting on",
            where,
        )
    return checked(fetch(url, where), where)


def fetch_url(url: str, where: str) -> bytes:
    """An http(s) URL's bytes, at most MAX_FETCH_BYTES within FETCH_TIMEOUT_S (api.fetch_image_urls
    on); BadRequestError naming ``where`` otherwise."""
    import httpx

    try:
        with (
            httpx.Client(timeout=FETCH_TIMEOUT_S, follow_redirects=True, max_redirects=3) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise BadRequestError(f"{where}: fetching the image gave HTTP {response.status_code}", where)
            length = response.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > MAX_FETCH_BYTES:
                raise BadRequestError(f"{where}: the image is over {MAX_FETCH_BYTES // 2**20} MiB", where)
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_FETCH_BYTES:
                    raise BadRequestError(f"{where}: the image is over {MAX_FETCH_BYTES // 2**20} MiB", where)
            return bytes(data)
    except httpx.TimeoutException:
        raise BadRequestError(f"{where}: fetching the image took over {FETCH_TIMEOUT_S:g} s", where) from None
    except httpx.HTTPError as exc:
        raise BadRequestError(f"{where}: the image could not be fetched ({exc})", where) from None


def placed(text_parts: list[tuple[str, bytes | None]]) -> tuple[str, tuple[ImagePart, ...]]:
    """Content parts in order (text, or an image's bytes) as one text and its images, each placed
    where it was among the text."""
    text: list[str] = []
    images: list[ImagePart] = []
    length = 0
    for piece, image in text_parts:
        if image is not None:
            images.append(ImagePart(image, length))
        else:
            text.append(piece)
            length += len(piece)
    return "".join(text), tuple(images)
