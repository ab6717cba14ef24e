"""The API's documented limits are the real ones (issue 26): the request head and target limits
(counted however the bytes arrive), the stalled-body timeout (the connection closes with its 408),
and docs/API.md states the same numbers as the code."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeshare.core.api import connections, errors, requests, server
from timeshare.core.api.server import ApiServer
from timeshare.core.config.schema import ApiConfig, Config
from timeshare.core.pool.supervisor import Pool

DOCS = Path(__file__).resolve().parents[1] / "docs" / "API.md"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    pool = Pool(Config())
    pool.start()
    mp = pytest.MonkeyPatch()
    # keep-alive and head timeouts far beyond the test's socket timeouts: a connection that closes,
    # closes for a reason
    mp.setattr(server, "KEEP_ALIVE_S", 600.0)
    api = ApiServer(
        pool,
        ApiConfig(port=0),
        address_file=tmp_path_factory.mktemp("api") / "api.json",
        head_timeout_s=600.0,
    )
    api.start()
    yield api
    api.stop()
    pool.stop()
    mp.undo()


def _exchange(api: ApiServer, *pieces: bytes, timeout: float = 30.0) -> bytes:
    """Send the pieces one by one, then read until the server closes the connection."""
    assert api.port is not None
    with socket.create_connection(("127.0.0.1", api.port), timeout=timeout) as s:
        for piece in pieces:
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _error(raw: bytes) -> dict[str, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), raw[:300]
    error: dict[str, object] = json.loads(body)["error"]
    return error


def _get(target: bytes, headers: bytes = b"") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + headers + b"\r\n"


def test_a_head_just_under_the_limit_is_served_and_one_over_it_is_a_400_however_it_arrives(
    api: ApiServer,
) -> None:
    limit = connections.MAX_HEAD_BYTES
    small = _get(b"/v1/models", b"X-Pad: " + b"a" * (limit - 200) + b"\r\n")
    assert len(small) <= limit
    assert _status(_exchange(api, small)) == 200
    for size in (limit + 10, 2 * limit - 100, 4 * limit):  # h11 alone let ~2x through in one chunk
        big = _get(b"/v1/models", b"X-Pad: " + b"a" * size + b"\r\n")
        for pieces in ([big], [big[:1000], big[1000:]], [big[: len(big) - 3], big[-3:]]):
            raw = _exchange(api, *pieces)
            assert _status(raw) == 400, raw[:200]
            error = _error(raw)
            assert error["code"] == "invalid_http" and "64 KiB" in str(error["message"])


def test_a_blank_line_split_across_reads_ends_the_head(api: ApiServer) -> None:
    head = _get(b"/v1/models")
    pieces = [head[:-3], head[-3:-1], head[-1:]]  # \r\n\r\n arrives in three reads
    assert _status(_exchange(api, *pieces)) == 200


def test_a_request_target_over_the_limit_is_a_short_414(api: ApiServer) -> None:
    limit = connections.MAX_TARGET_BYTES
    ok = b"/v1/models?q=" + b"x" * (limit - 20)
    assert _status(_exchange(api, _get(ok))) == 200
    for target in (b"/v1/models?q=" + b"x" * limit, b"/" + b"a" * 100_000):
        request = _get(target)
        for pieces in ([request], [request[:50], request[50:]]):
            raw = _exchange(api, *pieces)
            assert _status(raw) == 414, raw[:200]
            assert len(raw) < 1024  # not the target echoed back in a 404
            assert _error(raw)["code"] == "uri_too_long"
            assert _error(raw)["type"] == "invalid_request_error"  # the client's fault (issue 38)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 408, 409, 413, 414, 415, 422, 429, 431])
def test_every_4xx_has_a_client_error_type(status: int) -> None:
    assert errors.error_body("m", status, "c")["error"]["type"] != "server_error"
    assert errors.dialect_body("anthropic", "m", status, "c")["error"]["type"] != "api_error"
    assert errors.error_body("m", 500, "c")["error"]["type"] == "server_error"


def test_a_stalled_body_gets_its_408_and_the_connection_closes_with_it(
    api: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(requests, "BODY_TIMEOUT_S", 0.5)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    # the server would keep an idle connection for 600 s; the socket gives up after 30
    raw = _exchange(api, head + b'{"model": ', timeout=30.0)
    assert _status(raw) == 408 and _error(raw)["code"] == "request_timeout"


def test_the_documented_limits_are_the_codes_own() -> None:
    text = " ".join(DOCS.read_text().split())
    m = re.search(r"a request head \(request line and headers, at most (\d+) KiB, else 400", text)
    assert m and int(m.group(1)) * 1024 == connections.MAX_HEAD_BYTES
    m = re.search(r"a request target \(path and query\) over (\d+) KiB is 414 `uri_too_long`", text)
    assert m and int(m.group(1)) * 1024 == connections.MAX_TARGET_BYTES
    m = re.search(r"\) must arrive within (\d+) s of the connection opening", text)
    assert m and float(m.group(1)) == connections.HEAD_TIMEOUT_S
    m = re.search(r"an idle kept-alive connection closes after (\d+) s", text)
    assert m and float(m.group(1)) == connections.KEEP_ALIVE_S
    m = re.search(r"a body must arrive within (\d+) s \(408", text)
    assert m and float(m.group(1)) == requests.BODY_TIMEOUT_S
    assert "| 414 | `uri_too_long` |" in DOCS.read_text()


def test_a_stream_whose_send_waits_past_the_write_timeout_ends_and_runs_its_cleanup() -> None:
    # the mechanism the API's streams rely on, with a reader that never takes anything
    import anyio
    from timeshare.core.api.handlers import StreamResponse

    cleaned: list[str] = []
    sent: list[dict[str, object]] = []

    async def events():  # type: ignore[no-untyped-def]
        try:
            for i in range(10**6):
                yield {"data": str(i)}
        finally:
            cleaned.append("generation cancelled")  # what the API's events() does: gen.cancel()

    async def send(message: dict[str, object]) -> None:
        sent.append(message)
        if message.get("type") == "http.response.body":
            await anyio.sleep_forever()  # the client's buffers are full

    async def receive() -> dict[str, object]:
        await anyio.sleep_forever()
        return {}

    async def main() -> None:
        response = StreamResponse(events(), ping=0, send_timeout=0.2)
        scope = {"type": "http", "method": "GET", "headers": []}
        with anyio.fail_after(30):  # returns (after 0.2 s), instead of waiting for ever
            await response(scope, receive, send)  # type: ignore[arg-type]

    anyio.run(main)
    assert cleaned == ["generation cancelled"]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_the_documented_stream_write_timeout_is_the_codes_own() -> None:
    from timeshare.core.api import handlers

    text = " ".join(DOCS.read_text().split())
    m = re.search(r"a streaming client that accepts no event for (\d+) s", text)
    assert m and float(m.group(1)) == handlers.SSE_WRITE_TIMEOUT_S
