"""A logging reverse proxy for watching what a client sends to `timeshare serve` (a lab tool).

    python scripts/lab/request_log_proxy.py --upstream http://127.0.0.1:PORT --port 0 --out DIR

Every request is forwarded as it is; DIR/NNN-request.json gets its method, path, headers (the
Authorization header replaced by "<scrubbed>") and body (JSON when it parses), and
DIR/NNN-response.txt the status line and the answer as it came (a stream's events included).
The proxy's own address goes to DIR/address (``http://127.0.0.1:PORT``) once it listens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def make_app(upstream: str, out: Path) -> Starlette:
    counter = itertools.count(1)
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0))

    async def proxy(request: Request) -> StreamingResponse:
        n = next(counter)
        raw = await request.body()
        try:
            body: object = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        logged = {k: ("<scrubbed>" if k.lower() == "authorization" else v) for k, v in headers.items()}
        record = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": logged,
            "body": body,
        }
        (out / f"{n:03d}-request.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))
        upstream_request = client.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=raw
        )
        answer = await client.send(upstream_request, stream=True)
        log = (out / f"{n:03d}-response.txt").open("w")
        log.write(f"{answer.status_code}\n{dict(answer.headers)}\n\n")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    log.write(chunk.decode(errors="replace"))
                    log.flush()
                    yield chunk
            finally:
                log.close()
                await answer.aclose()

        passed = {k: v for k, v in answer.headers.items() if k.lower() not in HOP | {"content-encoding"}}
        return StreamingResponse(relay(), status_code=answer.status_code, headers=passed)

    methods = ["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", proxy, methods=methods)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    port = sock.getsockname()[1]
    (args.out / "address").write_text(f"http://127.0.0.1:{port}\n")
    config = uvicorn.Config(make_app(args.upstream, args.out), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
