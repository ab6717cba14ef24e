"""A stand-in for llama-server in `timeshare bench api` tests (no llama-server build on the CPU box):
it takes llama-server's flags, answers ``/health`` once "loaded" (a short pause) and streams
``/completion`` the way llama-server does (``data: {"content": ..., "stop": false}`` events, then a
last one with ``"stop": true`` and ``timings``); ``/v1/embeddings`` answers one unit vector per input,
all alike, of ``FAKE_LLAMA_N_EMBD`` numbers (default 8). It refuses a model file that does not exist.
``FAKE_LLAMA_LOADING_S`` (this test helper's own variable) makes its loading last that long."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="127.0.0.1")
    args, _rest = parser.parse_known_args()
    if not os.path.isfile(args.model):
        print(f"error: failed to load model '{args.model}'", file=sys.stderr)
        return 1
    # "loading"; FAKE_LLAMA_LOADING_S: a server that takes that long (a model that never loads)
    ready_at = time.monotonic() + float(os.environ.get("FAKE_LLAMA_LOADING_S", "0.3"))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

        def do_GET(self) -> None:
            loaded = time.monotonic() >= ready_at
            body = json.dumps({"status": "ok"} if loaded else {"error": "loading"}).encode()
            self.send_response(200 if self.path == "/health" and loaded else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            if self.path == "/v1/embeddings":
                self.embeddings(request)
                return
            n = int(request.get("n_predict", 8))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            t0 = time.perf_counter()
            for _ in range(n):
                time.sleep(0.002)
                self.wfile.write(b'data: {"content": " ok", "stop": false}\n\n')
                self.wfile.flush()
            rate = n / max(time.perf_counter() - t0, 1e-6)
            prompt_n = len(request.get("prompt", "")) // 5
            timings = {"prompt_n": prompt_n, "predicted_n": n, "predicted_per_second": rate}
            last = {"content": "", "stop": True, "timings": timings}
            self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())
            self.wfile.flush()

        def embeddings(self, request: dict[str, object]) -> None:
            texts = request["input"]
            assert isinstance(texts, list)
            width = int(os.environ.get("FAKE_LLAMA_N_EMBD", "8"))
            data = [
                {"object": "embedding", "index": i, "embedding": [1.0] + [0.0] * (width - 1)}
                for i in range(len(texts))
            ]
            tokens = sum(len(str(t).split()) for t in texts)
            body = json.dumps({"data": data, "usage": {"prompt_tokens": tokens}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
