"""The image checks every dialect shares (core/api/images.py, issue 41), without a model: an
http(s) image URL fetched only when allowed, and then bounded (a local HTTP server plays the web);
the data URL and base64 rules; the sentence names the part."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from _vision_util import png
from timeshare.core.api import images, responses
from timeshare.core.api.errors import BadRequestError
from timeshare.core.wire.protocol import ImagePart

RED = png((255, 0, 0))


@pytest.fixture
def web() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/red.png":
                body = RED
            elif self.path == "/huge.png":
                self.send_response(200)
                self.send_header("Content-Length", str(images.MAX_FETCH_BYTES + 1))
                self.end_headers()
                return
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_http_image_is_fetched_only_when_allowed_and_then_bounded(web: str) -> None:
    where = "messages[0].content[0].image_url.url"
    with pytest.raises(BadRequestError, match=r"api.fetch_image_urls is off"):
        images.image_from_url(f"{web}/red.png", where, None)
    assert images.image_from_url(f"{web}/red.png", where, images.fetch_url) == RED
    with pytest.raises(BadRequestError, match="HTTP 404"):
        images.image_from_url(f"{web}/missing.png", where, images.fetch_url)
    with pytest.raises(BadRequestError, match="over 8 MiB") as big:
        images.image_from_url(f"{web}/huge.png", where, images.fetch_url)
    assert big.value.param == where  # type: ignore[attr-defined]
    with pytest.raises(BadRequestError, match=r"file: URLs are not supported"):
        images.image_from_url("file:///etc/passwd", where, images.fetch_url)


def test_a_responses_input_image_url_is_fetched_only_when_allowed(web: str) -> None:
    """/v1/responses' input_image takes an http(s) URL as chat completions do: fetched when
    api.fetch_image_urls is on (the handler passes ``fetch_url``), refused naming the part when off."""
    body = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": f"{web}/red.png"}]}],
    }
    fetched = responses.parse(body, (), images.fetch_url)
    assert fetched.turn_input[0].images == (ImagePart(RED, 0),)
    with pytest.raises(BadRequestError, match=r"api.fetch_image_urls is off") as off:
        responses.parse(body)
    assert off.value.param == "input[0].content[0].image_url"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64," + base64.b64encode(RED).decode(), ""),
        ("DATA:image/PNG;base64," + base64.b64encode(RED).decode(), ""),
        ("data:image/png;base64,%%%", "not valid base64"),
        ("data:image/png," + base64.b64encode(RED).decode(), "must be base64"),
        ("data:;base64," + base64.b64encode(RED).decode(), "no MIME type is not an image type"),
        ("data:image/webp;base64," + base64.b64encode(RED).decode(), "says image/webp but holds a PNG"),
        ("data:image/tiff;base64," + base64.b64encode(RED).decode(), "an image type not supported"),
        ("data:image/png", "not a valid data: URL"),
        ("", "must be a data: URL"),
    ],
)
def test_data_urls(url: str, words: str) -> None:
    if not words:
        assert images.image_from_url(url, "x", None) == RED
        return
    with pytest.raises(BadRequestError, match=words):
        images.image_from_url(url, "x", None)


def test_too_many_images_are_counted_across_the_request() -> None:
    budget = images.ImageBudget()
    for _ in range(16):
        budget.take("messages[0].content[0]")
    with pytest.raises(BadRequestError, match="more than 16 images"):
        budget.take("messages[3].content[1]")


def test_parts_become_one_text_and_images_in_their_places() -> None:
    text, placed = images.placed([("look: ", None), ("", b"A"), ("and ", None), ("", b"B"), ("?", None)])
    assert text == "look: and ?"
    assert [(i.data, i.at) for i in placed] == [(b"A", 6), (b"B", 10)]
