"""Hostile input and failures that must not take Timeshare down (the reliability issue, API side).

- the pool without workers: a request that cannot be framed fails alone, passing shortages of open
  files at spawn are retried and reported as what they are;
- the API in-process over an empty pool: Host/Origin checks and CORS, stalled and idle connections,
  the connection cap, malformed HTTP, bounded JSON, rate-limited accept errors;
- one real `timeshare serve` (SmolLM2 plus two broken models): per-model failure at start, 400s for
  what cannot be encoded or is too big, the start verb (API and CLI) after the restart budget is
  spent, and, last, SIGTERM with queued requests (JSON 503s).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _api_util import SMOL, Served, run_cli, serving
from _proc_util import wait_until
from timeshare.core.api import connections
from timeshare.core.api.requests import MAX_JSON_DEPTH, MAX_MESSAGES, parse_json
from timeshare.core.api.server import ApiServer
from timeshare.core.config.schema import ApiConfig, Config, ModelConfig
from timeshare.core.errors import ProtocolError
from timeshare.core.pool import filecheck
from timeshare.core.pool import supervisor as pool_handlers
from timeshare.core.pool.generation import Generation, make_request
from timeshare.core.pool.record import SPAWN_RETRIES, WorkerRecord
from timeshare.core.pool.supervisor import Pool
from timeshare.core.sampling import FIELDS as SAMPLING_FIELDS
from timeshare.core.sampling import Sampling
from timeshare.core.state import ModelState, ModelStatus
from timeshare.core.wire import protocol

WAIT = 240.0


# ---- the pool, without workers ---------------------------------------------------------------------


def _gen(req: str, prompt: str) -> Generation:
    return Generation("m", protocol.Generate(req=req, prompt=prompt), lambda g: None)


class _Conn:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        protocol.encode(msg)  # raises ProtocolError for what cannot be framed, as the real one
        self.sent.append(msg)


def test_a_request_that_cannot_be_framed_fails_alone_and_the_next_one_goes() -> None:
    # before: it went back to the head of the queue to wait for a worker exit that never came
    w = WorkerRecord(config=ModelConfig(id="m", path="/m.gguf"), log_path=Path("/nonexistent"), pinned=False)
    conn = _Conn()
    w.conn = conn  # type: ignore[assignment]
    bad, good = _gen("r1", "hi \ud800"), _gen("r2", "hello")
    w.queue.extend([bad, good])
    w.send_queued()
    assert bad.done and not w.queue and list(w.inflight.values()) == [good] and conn.sent == [good.request]
    with pytest.raises(ProtocolError, match="cannot be sent to m"):
        bad.result(timeout=1)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"prompt": "a\ud800b"}, "not valid Unicode|cannot be encoded"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt": "x", "stop": ("\udfff",)}, "not valid Unicode|cannot be encoded"),
        ({"prompt": "x", "conversation": "c\ud800"}, "not valid Unicode|cannot be encoded"),
        ({"messages": ({"role": "user", "content": "\ud83d"},)}, "not valid Unicode|cannot be encoded"),
    ],
)
def test_the_pool_refuses_what_cannot_reach_a_worker(fields: dict[str, object], words: str) -> None:
    base: dict[str, object] = {"prompt": None, "messages": None, "conversation": None}
    sampling = {"max_tokens": 4, **{k: v for k, v in fields.items() if k in SAMPLING_FIELDS}}
    rest = {k: v for k, v in fields.items() if k not in SAMPLING_FIELDS}
    with pytest.raises(ValueError, match=words):
        make_request("r", "m", **{**base, **rest}, sampling=Sampling(**sampling))  # type: ignore[arg-type]


def _m(pool: Pool) -> ModelStatus:
    status = pool.snapshot().model("m")
    return status if status is not None else ModelStatus(id="m", name="m", path="", state=ModelState.STARTING)


def _fake_worker_argv() -> list[str]:
    # never says Hello: STARTING with a pid is proof enough that the spawn went through
    return [sys.executable, "-c", "import time; time.sleep(600)"]


def test_too_many_open_files_at_spawn_is_retried_then_reported_as_what_it_is(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_spawn = pool_handlers.spawn_worker
    fail = {"left": 10**6}

    def spawn(*args: object, **kwargs: object) -> object:
        if fail["left"] > 0:
            fail["left"] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real_spawn(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pool_handlers, "spawn_worker", spawn)
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path)),))
    pool = Pool(config, arena_dir=tmp_path / "arena", restart_backoff_s=0.01, worker_argv=_fake_worker_argv())
    seen: list[str] = []
    pool.subscribe(lambda e: seen.extend(m.reason for m in e.snapshot.models if m.reason))
    pool.start()
    try:
        wait_until(lambda: _m(pool).state is ModelState.FAILED, WAIT, "the retries to end")
        status = _m(pool)
        assert "too many open files in this process (EMFILE)" in status.reason, status.reason
        assert "ulimit -n" in status.reason and "permission" not in status.reason
        assert status.failure_code == ""  # not the file's fault: no "Locate file…"
        # it said so while retrying (the events reach subscribers on the pool's event thread, maybe
        # after the snapshot already shows FAILED)
        wait_until(lambda: any("trying again in" in r for r in seen), WAIT, "a 'trying again in' reason")
        assert fail["left"] == 10**6 - 1 - SPAWN_RETRIES
        fail["left"] = 2  # the shortage passes during the next start's retries
        pool.start_model("m")
        wait_until(lambda: _m(pool).pid is not None, WAIT, "the worker to be spawned")
        assert _m(pool).state is ModelState.STARTING
    finally:
        pool.stop()


def test_a_model_file_that_cannot_be_opened_for_lack_of_descriptors_is_retried(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: "cannot be read (Too many open files): check its permissions", and FAILED for good
    real = filecheck.gguf_problem
    left = {"n": 2}

    def problem(path: str, **kwargs: bool) -> str:
        if left["n"] > 0:
            left["n"] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, **kwargs)

    monkeypatch.setattr(filecheck, "gguf_problem", problem)
    config = Config(models=(ModelConfig(id="m", path=str(smollm2_path)),))
    pool = Pool(config, arena_dir=tmp_path / "arena", restart_backoff_s=0.01, worker_argv=_fake_worker_argv())
    pool.start()
    try:
        wait_until(lambda: _m(pool).pid is not None, WAIT, "the worker to be spawned")
        assert left["n"] == 0
    finally:
        pool.stop()


_LEASE_HOLDER = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, lambda *_: print("break", flush=True))  # someone opens the file
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("held", flush=True)
sys.stdin.readline()
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
print("released", flush=True)
sys.stdin.readline()
"""


def test_the_pool_thread_answers_while_a_model_file_check_blocks(tmp_path: Path) -> None:
    """A model file whose open() blocks (here: another process holds a write lease on it, so the
    kernel holds every open back until that process lets go, as a slow or hung filesystem would)
    is checked off the pool thread: the pool keeps answering meanwhile, and the check's result
    still arrives (the file is no GGUF: the model FAILS saying so)."""
    slow = tmp_path / "slow.gguf"
    slow.write_bytes(b"this is not a model, it only opens slowly\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", _LEASE_HOLDER, str(slow)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    pool = None
    try:
        assert holder.stdout.readline().strip() == "held"
        config = Config(
            models=(
                ModelConfig(id="slow", path=str(slow)),
                ModelConfig(id="other", path=str(tmp_path / "missing.gguf")),
            )
        )
        pool = Pool(config, arena_dir=tmp_path / "arena", worker_argv=_fake_worker_argv())
        pool.start()
        assert holder.stdout.readline().strip() == "break"  # the check is blocked in open() now
        answered = threading.Event()

        def stop_other() -> None:
            assert pool is not None
            pool.stop_model("other")  # a call the pool thread must answer
            answered.set()

        threading.Thread(target=stop_other, daemon=True).start()
        # (the kernel breaks a lease by itself after fs.lease-break-time, 45 s by default)
        assert answered.wait(30.0), "the pool thread did not answer while a model file check blocked"
        assert holder.poll() is None  # the lease is still held: the check is still waiting
        snap = pool.snapshot()
        other, waiting = snap.model("other"), snap.model("slow")
        assert other is not None and other.state is ModelState.STOPPED
        assert waiting is not None and waiting.state is not ModelState.FAILED
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        wait_until(
            lambda: (m := pool.snapshot().model("slow")) is not None and m.state is ModelState.FAILED,
            WAIT,
            "the slow model's check to arrive",
        )
        failed = pool.snapshot().model("slow")
        assert failed is not None and "not a GGUF file" in failed.reason, failed
    finally:
        if pool is not None:
            pool.stop()
        holder.kill()
        holder.communicate()  # waits, and closes the pipes


# ---- the API in-process, over an empty pool ----------------------------------------------------------


@pytest.fixture(scope="module")
def empty_pool() -> Iterator[Pool]:
    pool = Pool(Config())
    pool.start()
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def api(empty_pool: Pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    server = ApiServer(
        empty_pool,
        ApiConfig(port=0, allowed_origins=("http://localhost:3000",), allowed_hosts=("timeshare.lan",)),
        address_file=tmp_path_factory.mktemp("api") / "api.json",
        head_timeout_s=1.0,
        max_connections=16,
    )
    server.start()
    yield server
    server.stop()


def _get(api: ApiServer, path: str = "/v1/models", method: str = "GET", **kw: object) -> httpx.Response:
    return httpx.request(method, f"{api.url}{path}", timeout=30, **kw)  # type: ignore[arg-type]


def _raw(api: ApiServer, data: bytes, timeout: float = 30.0) -> bytes:
    assert api.port is not None
    with socket.create_connection(("127.0.0.1", api.port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def _json_body(raw: bytes) -> dict[str, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), raw[:300]
    result: dict[str, object] = json.loads(body)
    return result


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("127.0.0.1:8385", 200),
        ("localhost", 200),
        ("[::1]:8385", 200),
        ("app.localhost:1", 200),
        ("timeshare.lan:8385", 200),  # api.allowed_hosts
        ("evil.example:8385", 403),  # a DNS-rebinding page names its own host
        ("127.0.0.1.evil.example", 403),
        ("[::1].evil.example", 400),  # issue 38: not one host with an optional port
        ("localhost:8385@evil.example", 400),
        ("localhost@evil.example", 400),
        ("127.0.0.1:8385/x", 400),
        ("localhost:99999", 400),
        ("[::1", 400),
        ("[0:0:0:0:0:0:0:1]:8385", 200),
    ],
)
def test_a_loopback_api_accepts_only_loopback_host_names(api: ApiServer, host: str, status: int) -> None:
    r = _get(api, headers={"Host": host})
    assert r.status_code == status
    if status == 403:
        error = r.json()["error"]
        assert error["code"] == "host_not_allowed" and "api.allowed_hosts" in error["message"]
    if status == 400:
        error = r.json()["error"]
        assert error["code"] == "invalid_host" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("host", ["localhost:8385@evil.example", "[::1].evil.example"])
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/api/chat"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/api/tags"),
        ("GET", "/timeshare/v1/status"),
    ],
)
def test_a_host_with_anything_after_the_name_is_refused_on_every_route(
    api: ApiServer, host: str, method: str, path: str
) -> None:
    # issue 38: both spellings reached /api/chat and /v1/messages (200) as a loopback name
    r = _get(api, path, method=method, headers={"Host": host}, json={"model": "x"})
    assert r.status_code == 400, r.text
    assert host in r.text  # each dialect's error shape names the header


def test_the_status_names_every_path_each_dialect_serves(api: ApiServer) -> None:
    # issue 38: served.paths left out /v1/embeddings and /v1/messages/count_tokens
    served = _get(api, "/timeshare/v1/status").json()["served"]
    listed = {name: set(where["paths"].split(", ")) for name, where in served.items()}
    assert {"/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/models"} <= listed["openai"]
    assert listed["anthropic"] == {"/v1/messages", "/v1/messages/count_tokens"}
    assert {"/api/chat", "/api/pull", "/api/embed", "/api/ps"} <= listed["ollama"]
    assert api.app is not None
    routes = {str(getattr(r, "path", "")) for r in api.app.routes}
    public = {p for p in routes if not p.startswith("/timeshare/") and p != "/health"}
    assert set().union(*listed.values()) == public


def test_a_cross_site_page_cannot_command_the_models(api: ApiServer) -> None:
    # the finding: a text/plain POST (no preflight) from any web page pinned and stopped models
    r = _get(
        api,
        "/timeshare/v1/models/x/pin",
        method="POST",
        headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
        content=b"{}",
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = _get(api, "/v1/chat/completions", method="OPTIONS", headers=preflight)
    assert r.status_code == 403
    # no Origin (the CLI, SDKs): passes; the API's own origin too
    assert _get(api).status_code == 200
    assert _get(api, headers={"Origin": api.url}).status_code == 200


def test_an_allowed_origin_gets_cors_answers(api: ApiServer) -> None:
    headers = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = _get(api, "/v1/chat/completions", method="OPTIONS", headers=headers)
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    r = _get(api, headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "Origin" in r.headers["vary"]


def test_a_preflight_allows_delete_and_the_delete_carries_cors(api: ApiServer) -> None:
    """A web page may DELETE a stored response (``DELETE /v1/responses/{id}``; Ollama's
    ``DELETE /api/delete`` too): its preflight lists DELETE among the allowed methods, and the
    answer (here the 404 of an id that is not stored) carries the CORS headers, so the page can
    read it."""
    headers = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "DELETE",
        "Access-Control-Request-Headers": "authorization",
    }
    for path in ("/v1/responses/resp_nothing", "/api/delete"):
        r = _get(api, path, method="OPTIONS", headers=headers)
        assert r.status_code == 204, (path, r.text)
        allowed = [m.strip() for m in r.headers["access-control-allow-methods"].split(",")]
        assert "DELETE" in allowed and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = _get(api, "/v1/responses/resp_nothing", method="DELETE", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_malformed_http_gets_a_json_400(api: ApiServer) -> None:
    for garbage in (b"GARBAGE\x00 / HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"):
        raw = _raw(api, garbage)
        assert raw.startswith(b"HTTP/1.1 400 ")
        assert _json_body(raw)["error"]["code"] == "invalid_http"  # type: ignore[index]


def test_a_stalled_request_head_times_out_and_an_idle_connection_closes(api: ApiServer) -> None:
    raw = _raw(api, b"GET /v1/models HTTP/1.1\r\nHost: loc")  # and then nothing (head_timeout_s = 1)
    assert raw.startswith(b"HTTP/1.1 408 ") and _json_body(raw)["error"]["code"] == "request_timeout"  # type: ignore[index]
    assert _raw(api, b"") == b""  # connected, sent nothing: closed without a word


def test_connections_beyond_the_limit_close_the_idle_ones_instead_of_locking_clients_out(
    api: ApiServer,
) -> None:
    assert api.port is not None
    idle = [
        socket.create_connection(("127.0.0.1", api.port), timeout=30) for _ in range(3 * api.max_connections)
    ]
    try:
        for _ in range(3):  # real clients still get through while the idle ones are held open
            assert _get(api).status_code == 200
    finally:
        for s in idle:
            s.close()


def test_the_connection_limit_follows_the_open_files_limit() -> None:
    assert connections.connection_limit(1024) == 512
    assert connections.connection_limit(20) == 16
    assert connections.connection_limit(10**7) == 4096
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connections.connection_limit() <= max(16, soft // 2)


def test_accept_errors_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger=connections.log.name):
            for _ in range(500):  # what a descriptor shortage makes asyncio report, every second
                context = {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                }
                connections._loop_exception_handler(loop, context)
        lines = [r for r in caplog.records if "cannot accept new connections" in r.getMessage()]
        assert len(lines) == 1 and "ulimit -n" in lines[0].getMessage()
    finally:
        loop.close()


def test_json_that_nests_too_deep_or_holds_too_many_values_is_a_400() -> None:
    from timeshare.core.api.errors import BadRequestError

    for body in (
        b"[" * 100_000,
        b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
        b"[" + b"0," * 300_000 + b"0]",
    ):
        with pytest.raises(BadRequestError) as excinfo:
            parse_json(body)
        assert excinfo.value.status == 400 and excinfo.value.code == "invalid_json"
    assert isinstance(parse_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH), list)  # deep enough


# ---- one real `timeshare serve` ------------------------------------------------------------------


ORIGIN_OK = "http://localhost:3000"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("reliability-home")
    not_gguf = home / "not-gguf.gguf"
    not_gguf.write_bytes(b"<html>404</html>")
    config = home / "config.toml"
    config.write_text(
        f'[api]\nallowed_origins = ["{ORIGIN_OK}"]\n\n'
        f'[[models]]\nid = "{SMOL}"\npath = "{smollm2_path}"\nidle_sleep_s = false\n\n'
        f'[[models]]\nid = "ghost"\npath = "{home / "ghost.gguf"}"\n\n'
        f'[[models]]\nid = "html"\npath = "{not_gguf}"\n'
    )
    with serving(home, config=config) as server:
        server.wait_until(lambda s: _state(s, SMOL) in ("resident", "released"), "SmolLM2 to load", WAIT)
        yield server


def _state(status: dict[str, object], model: str) -> str:
    return str(next(m["state"] for m in status["models"] if m["id"] == model))  # type: ignore[attr-defined]


def _post(served: Served, path: str, body: object = None, **kw: object) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=120, **kw)  # type: ignore[arg-type]


def _post_raw(served: Served, path: str, raw: bytes) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{served.url}{path}", content=raw, headers=headers, timeout=120)


def test_a_missing_or_broken_model_file_fails_that_model_only(served: Served) -> None:
    status = served.status()
    models = {m["id"]: m for m in status["models"]}  # type: ignore[union-attr,index]
    ghost, html = models["ghost"], models["html"]
    assert ghost["state"] == "failed" and "ghost.gguf does not exist" in ghost["reason"]
    assert ghost["failure_code"] == "model_file"
    assert html["state"] == "failed" and "not a GGUF file" in html["reason"]
    r = _post(served, "/v1/completions", {"model": "ghost", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "model_unavailable" and "ghost is not available" in error["message"]
    assert "ghost.gguf does not exist" in error["message"] and "timeshare start ghost" in error["message"]
    r = _post(served, "/v1/completions", {"model": SMOL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200  # the others serve


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (rb'{"model": "M", "messages": [{"role": "user", "content": "hi \ud800"}]}', "messages[0].content"),
        (rb'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]}', "stop[0]"),
        (
            rb'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "conversation": "c\ud800"}',
            "conversation",
        ),
    ],
)
def test_a_string_that_is_not_unicode_is_a_400_naming_the_field(
    served: Served, raw: bytes, param: str
) -> None:
    # before: it failed on the pool->worker pipe and wedged the model for every other client
    r = _post_raw(served, "/v1/chat/completions", raw.replace(b'"M"', f'"{SMOL}"'.encode()))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_string" and "surrogate" in error["message"]
    ok = _post(
        served,
        "/v1/chat/completions",
        {"model": SMOL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert ok.status_code == 200  # the model was not wedged


def test_oversized_and_empty_inputs_are_400s(served: Served) -> None:
    deep = b'{"model": "x", "prompt": "a", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = _post_raw(served, "/v1/completions", deep)
    assert r.status_code == 400 and "levels deep" in r.json()["error"]["message"]
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    r = _post(served, "/v1/chat/completions", {"model": SMOL, "messages": many})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(served, "/v1/completions", {"model": SMOL, "prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # was llama.cpp's assert: a 500
    # many messages within the limit: refused as too long quickly (prompt built in pieces)
    chat = [{"role": "user", "content": "hi"}] * MAX_MESSAGES
    r = _post(served, "/v1/chat/completions", {"model": SMOL, "messages": chat, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_host_and_origin_are_checked_on_the_served_api(served: Served) -> None:
    assert (
        _post(
            served, f"/timeshare/v1/models/{SMOL}/pin", headers={"Origin": "https://evil.example"}
        ).status_code
        == 403
    )
    assert served.model_status(SMOL)["pinned"] is False
    r = httpx.get(f"{served.url}/v1/models", headers={"Host": "rebound.example"}, timeout=30)
    assert r.status_code == 403
    r = httpx.options(
        f"{served.url}/v1/models",
        headers={"Origin": ORIGIN_OK, "Access-Control-Request-Method": "GET"},
        timeout=30,
    )
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == ORIGIN_OK


def test_a_failed_model_comes_back_with_the_start_verb(served: Served, smollm2_path: Path) -> None:
    # the file appears (the drive was mounted, the download finished): `timeshare start` loads it
    (served.home / "ghost.gguf").symlink_to(smollm2_path)
    done = run_cli(served.home, "start", "ghost", "--wait", str(WAIT))
    assert done.returncode == 0, done.stderr
    assert "ghost: started" in done.stdout
    assert _state(served.status(), "ghost") in ("resident", "released")
    # a model that stays broken says why, with exit status 1
    done = run_cli(served.home, "start", "html")
    assert done.returncode == 1 and "not a GGUF file" in done.stderr


def test_the_restart_budget_spent_then_start_resets_it(served: Served, smollm2_path: Path) -> None:
    # kill -9 four times within the restart window: FAILED; wake is a 503 saying how to start it;
    # stopping a failed model stops it; the start verb brings it back with a fresh budget
    ghost = served.home / "ghost.gguf"
    if not ghost.exists():
        ghost.symlink_to(smollm2_path)
        assert _post(served, "/timeshare/v1/models/ghost/start").status_code == 200
    killed: set[int] = set()

    def new_worker_or_failed(status: dict[str, object]) -> bool:
        pid = _model(status, "ghost").get("pid")
        return (isinstance(pid, int) and pid not in killed) or _state(status, "ghost") == "failed"

    for _ in range(4):
        served.wait_until(new_worker_or_failed, "a new ghost worker", WAIT)
        pid = _model(served.status(), "ghost").get("pid")
        if not isinstance(pid, int):
            break
        killed.add(pid)
        os.kill(pid, signal.SIGKILL)
    served.wait_until(lambda s: _state(s, "ghost") == "failed", "the restart budget to be spent", WAIT)
    assert "crashed 4 times" in str(_model(served.status(), "ghost")["reason"])
    r = _post(served, "/timeshare/v1/models/ghost/wake")
    assert r.status_code == 503 and "/timeshare/v1/models/ghost/start" in r.json()["error"]["message"]
    r = _post(served, "/timeshare/v1/models/ghost/sleep", {"level": "stop"})
    assert r.status_code == 200 and r.json()["model"]["state"] == "stopped"
    r = _post(served, "/timeshare/v1/models/ghost/start")
    assert r.status_code == 200 and r.json()["model"]["state"] in (
        "starting",
        "loading",
        "released",
        "resident",
    )
    served.wait_until(lambda s: _state(s, "ghost") in ("resident", "released"), "ghost to come back", WAIT)


def _model(status: dict[str, object], model: str) -> dict[str, object]:
    return next(m for m in status["models"] if m["id"] == model)  # type: ignore[attr-defined,no-any-return]


def test_sigterm_answers_queued_requests_with_json_503(served: Served) -> None:
    """Runs last against the shared server: it stops it."""
    body = {"model": SMOL, "prompt": "1, 2, 3, 4,", "max_tokens": 1500, "temperature": 0}
    results: list[httpx.Response | BaseException] = []

    def send() -> None:
        try:
            results.append(httpx.post(f"{served.url}/v1/completions", json=body, timeout=WAIT))
        except BaseException as exc:  # a connection cut off is a failure too: recorded
            results.append(exc)

    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(send)
        served.wait_until(lambda s: int(_model(s, SMOL)["queued"]) >= 2, "requests to queue", WAIT)  # type: ignore[call-overload]
        served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(WAIT) == 0
    assert len(results) == 4
    for r in results:
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_unavailable" and "shutting down" in error["message"]
