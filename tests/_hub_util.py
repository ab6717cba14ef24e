"""A local HTTP server that plays the Hugging Face hub (and a plain file server), and tiny GGUFs.

It answers what ``huggingface_hub`` calls and what ``core.pull`` fetches:

- ``GET /api/models?search=…&filter=gguf&sort=downloads&limit=N``: the repos whose id holds the
  search words and that have a .gguf file, most downloaded first (``downloads``, ``likes``,
  ``gguf.total`` and ``gguf.architecture``, ``gated``);
- ``GET /api/models/{repo}[/revision/{rev}]?blobs=true``: model info with ``siblings`` (size, LFS
  sha256), ``cardData.license``, ``gated``; 404 ``X-Error-Code: RepoNotFound`` for an unknown repo;
- ``HEAD /{repo}/resolve/{rev}/{file}``: 302 to the "CDN" (``http://localhost:PORT/cdn/...``, another
  host than 127.0.0.1, as the real CDN is) with ``X-Repo-Commit``, ``X-Linked-Etag`` (the sha256)
  and ``X-Linked-Size``; 401 ``X-Error-Code: GatedRepo`` for a gated repo without the right token;
  404 ``EntryNotFound`` for a missing file;
  (a repo with ``lfs=False`` serves its files from the resolve URL itself, with the git blob's
  SHA-1 as the ETag, as the hub does for small files);
- ``GET|HEAD /cdn/{sha256}`` and ``/files/{name}``: the bytes, with ``Range`` (206), and faults on
  demand: drop the connection after N bytes, serve other bytes than announced, go slowly, ignore
  Range (a 200 from byte 0, no ``Accept-Ranges``), send no size and an endless body, or answer with
  hostile ETag / X-Repo-Commit headers.

Every request is recorded (method, path, Range, Authorization) for the tests to look at.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

GOOD_TOKEN = "hf_good_token"


def make_gguf(
    path: Path,
    *,
    arch: str = "llama",
    name: str = "Tiny",
    licence: str | None = None,
    floats: int = 4096,
    file_type: int | None = 15,  # LlamaFileType.MOSTLY_Q4_K_M
    uint32s: dict[str, int] | None = None,  # more metadata ("llama.block_count": 30, ...)
) -> bytes:
    """Write a small, valid GGUF (one f32 tensor of ``floats`` values) and return its bytes."""
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    if licence:
        writer.add_license(licence)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_context_length(256)
    for key, value in (uint32s or {}).items():
        writer.add_uint32(key, value)
    writer.add_tensor("weights", np.arange(floats, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what the hub sends as the ETag of a file not in LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


#: the most an endless body sends before the fake server gives up on the client
ENDLESS_LIMIT = 512 << 20


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    licence: str | None = None
    lfs: bool = True  # False: small files, served by the hub itself with the git SHA-1 as ETag
    downloads: int = 0  # what the search sorts by
    parameters: int | None = None  # the search's ``gguf.total``


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    auth: str | None


@dataclass
class Faults:
    drop_after: dict[str, int] = field(default_factory=dict)  # key -> bytes sent before dropping (once)
    serve_instead: dict[str, bytes] = field(default_factory=dict)  # key -> other bytes than announced
    announce_size: dict[str, int] = field(default_factory=dict)  # key -> size the hub claims
    delay_per_chunk: float = 0.0
    ignore_range: bool = False  # answer a Range request with a 200 from byte 0 (no Accept-Ranges)
    endless: set[str] = field(default_factory=set)  # keys sent without a size, the bytes then zeros forever
    linked_etag: str | None = None  # the X-Linked-Etag (or ETag) the hub sends instead of the real one
    repo_commit: str | None = None  # the X-Repo-Commit the hub sends instead of the repo's commit
    no_accept_ranges: bool = False  # honour Range but never say so on a 200
    no_head: set[str] = field(default_factory=set)  # keys whose HEAD is answered 405 (the GET tells)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up (a cancelled download) is no news here


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.files: dict[str, bytes] = {}  # /files/{name}
        self.requests: list[Seen] = []
        self.faults = Faults()
        self.endless_sent = 0  # bytes the last endless body sent
        self.endless_done = threading.Event()  # set when the client hung up on it
        self.hung_up: list[str] = []  # keys of the bodies a client stopped taking (it hung up)
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, "GET")

            def do_HEAD(self) -> None:
                hub._handle(self, "HEAD")

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def seen(self, method: str | None = None, contains: str = "") -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method) and contains in r.path]

    # ---- answering ----

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(h.path).path)
        with self._lock:
            self.requests.append(Seen(method, h.path, h.headers.get("Range"), h.headers.get("Authorization")))
        if path == "/api/models" and method == "GET":
            return self._search(h)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m and method == "GET":
            return self._model_info(h, m.group(1))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(h, method, m.group(1), m.group(3))
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
        if m:
            data = next(
                (d for r in self.repos.values() for d in r.files.values() if sha256(d) == m.group(1)), None
            )
            if data is None:
                return self._plain(h, 404, "no such blob")
            return self._bytes(h, method, m.group(1), data)
        m = re.fullmatch(r"/files/(.+)", path)
        if m:
            name = m.group(1)
            if name.startswith("private/"):
                return self._plain(h, 401, "login required")
            if name not in self.files:
                return self._plain(h, 404, "not found")
            return self._bytes(h, method, name, self.files[name], etag=f'"{sha256(self.files[name])[:20]}"')
        return self._plain(h, 404, "unknown path")

    def _plain(
        self, h: BaseHTTPRequestHandler, status: int, text: str, headers: dict[str, str] | None = None
    ) -> None:
        body = text.encode()
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _search(self, h: BaseHTTPRequestHandler) -> None:
        query = parse_qs(urlsplit(h.path).query)
        words = " ".join(query.get("search", [""])).casefold().split()
        limit = int(query.get("limit", ["1000"])[0])
        hits = [
            (repo_id, repo)
            for repo_id, repo in self.repos.items()
            if all(w in repo_id.casefold() for w in words)
            and (query.get("filter") != ["gguf"] or any(n.endswith(".gguf") for n in repo.files))
        ]
        hits.sort(key=lambda hit: -hit[1].downloads)
        found = [
            {
                "id": repo_id,
                "modelId": repo_id,
                "downloads": repo.downloads,
                "likes": repo.downloads // 100,
                "gated": "manual" if repo.gated else False,
                "gguf": {"total": repo.parameters, "architecture": "llama"} if repo.parameters else None,
            }
            for repo_id, repo in hits[:limit]
        ]
        body = json.dumps(found).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _model_info(self, h: BaseHTTPRequestHandler, repo_id: str) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._plain(h, 404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
        siblings = []
        for name, data in repo.files.items():
            size = self.faults.announce_size.get(name, len(data))
            sibling: dict[str, object] = {"rfilename": name, "size": size, "blobId": git_sha1(data)}
            if repo.lfs:
                sibling["lfs"] = {"sha256": sha256(data), "size": size, "pointerSize": 134}
            siblings.append(sibling)
        info: dict[str, object] = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": repo.commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "tags": ["gguf"] + ([f"license:{repo.licence}"] if repo.licence else []),
            "siblings": siblings,
        }
        if repo.licence:
            info["cardData"] = {"license": repo.licence}
        body = json.dumps(info).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(self, h: BaseHTTPRequestHandler, method: str, repo_id: str, name: str) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._plain(h, 404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
        if repo.gated and h.headers.get("Authorization") != f"Bearer {GOOD_TOKEN}":
            return self._plain(
                h,
                401,
                "Access to this model is restricted",
                {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted"},
            )
        data = repo.files.get(name)
        if data is None:
            return self._plain(
                h, 404, "Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit}
            )
        digest = sha256(data)
        size = self.faults.announce_size.get(name, len(data))
        commit = self.faults.repo_commit if self.faults.repo_commit is not None else repo.commit
        if not repo.lfs:  # a small file: the hub serves it itself, named by the git blob's SHA-1
            etag = self.faults.linked_etag or f'"{git_sha1(data)}"'
            return self._bytes(h, method, name, data, etag=etag, extra={"X-Repo-Commit": commit})
        headers = {
            "Location": f"{self.cdn}/cdn/{digest}",
            "X-Repo-Commit": commit,
            "X-Linked-Etag": self.faults.linked_etag or f'"{digest}"',
            "X-Linked-Size": str(size),
            "ETag": f'"{git_sha1(data)}"',
        }
        h.send_response(302)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _bytes(
        self,
        h: BaseHTTPRequestHandler,
        method: str,
        key: str,
        data: bytes,
        etag: str | None = None,
        extra: dict[str, str] | None = None,
    ) -> None:
        for name, other in self.faults.serve_instead.items():
            if key in (name, sha256(self._original(name) or b"")):
                data = other
        if key in self.faults.endless:
            return self._endless(h, method, data)
        if method == "HEAD" and key in self.faults.no_head:
            return self._plain(h, 405, "no HEAD here")
        start = 0
        rng = h.headers.get("Range")
        status = 200
        if rng and not self.faults.ignore_range:
            m = re.fullmatch(r"bytes=(\d+)-", rng.strip())
            if m:
                start = int(m.group(1))
                if start >= len(data):
                    h.send_response(416)
                    h.send_header("Content-Range", f"bytes */{len(data)}")
                    h.send_header("Content-Length", "0")
                    h.end_headers()
                    return
                status = 206
        body = data[start:]
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        if not self.faults.ignore_range and not (self.faults.no_accept_ranges and status == 200):
            h.send_header("Accept-Ranges", "bytes")
        if etag:
            h.send_header("ETag", etag)
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if method == "HEAD":
            return
        drop = None
        with self._lock:
            for k in (key, *[n for n in self.faults.drop_after if sha256(self._original(n) or b"") == key]):
                if k in self.faults.drop_after:
                    drop = self.faults.drop_after.pop(k)
                    break
        sent = 0
        step = 8192
        try:
            while sent < len(body):
                if drop is not None and start + sent >= drop:
                    h.wfile.flush()
                    h.connection.shutdown(socket.SHUT_RDWR)
                    h.close_connection = True
                    return
                end = min(len(body), sent + step)
                if drop is not None:
                    end = min(end, drop - start) if drop > start + sent else end
                h.wfile.write(body[sent:end])
                sent = end
                if self.faults.delay_per_chunk:
                    h.wfile.flush()
                    time.sleep(self.faults.delay_per_chunk)
        except (BrokenPipeError, ConnectionResetError):
            with self._lock:
                self.hung_up.append(key)
            h.close_connection = True

    def _endless(self, h: BaseHTTPRequestHandler, method: str, data: bytes) -> None:
        """No Content-Length, no Range: ``data``, then zeros until the client hangs up (or
        ENDLESS_LIMIT bytes, so that a client that never stops cannot keep this thread forever)."""
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        if method == "HEAD":
            return
        zeros = bytes(65536)
        sent = 0
        try:
            h.wfile.write(data)
            sent = len(data)
            while sent < ENDLESS_LIMIT:
                h.wfile.write(zeros)
                sent += len(zeros)
                with self._lock:
                    self.endless_sent = sent
        except (BrokenPipeError, ConnectionResetError):
            pass
        with self._lock:
            self.endless_sent = sent
        self.endless_done.set()

    def _original(self, name: str) -> bytes | None:
        for repo in self.repos.values():
            if name in repo.files:
                return repo.files[name]
        return self.files.get(name)
