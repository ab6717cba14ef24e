"""The HTTP server: bind checks, :class:`ApiServer` (it records its address, see address.py), and
``timeshare serve``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import logging
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

import uvicorn
from starlette.applications import Starlette

from .. import paths
from ..arena.dirs import pid_alive
from ..config.files import cli_config_path, load_for_cli
from ..config.schema import ApiConfig
from ..config.validate import is_loopback, needs_key, split_listen
from ..config.watch import ConfigWatcher
from ..diskspace import check_room, disk_full_error, is_disk_full
from ..errors import ApiBindError, ArenaError, ConfigError, DiskFullError, InstanceRunningError
from ..instance import InstanceLock
from ..pool.supervisor import Pool
from ..state import ModelState, PoolSnapshot
from ..util.logsetup import setup_logging
from .address import ApiAddress
from .connections import (
    HEAD_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_HEAD_BYTES,
    GuardedH11Protocol,
    GuardedServer,
    connection_limit,
    install_log_limits,
)
from .errors import BadRequestError, dialect_of
from .handlers import HEALTH_HEADER, ConfigReloader, create_app, reload_config
from .rerank import RERANK_PATHS
from .response_store import ResponseStore

log = logging.getLogger(__name__)


# ---- the server ----------------------------------------------------------------------------------


def check_bind_allowed(api_config: ApiConfig) -> None:
    """Refuse a non-loopback bind without a key (anyone on the network could use the models)."""
    if needs_key(api_config.host, api_config.key):
        raise ConfigError(
            [
                f"api.host: {api_config.host!r} is not a loopback address, and no api.key is set. "
                "Set api.key (clients then send 'Authorization: Bearer <key>') before serving on other "
                "interfaces, or bind to 127.0.0.1."
            ]
        )


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ApiBindError(
            f"Cannot resolve the API host {host!r} ({exc}); check api.host or --host."
        ) from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            holder = _timeshare_on(host, port)
            if holder:
                raise ApiBindError(
                    f"Cannot listen on {host}:{port}: {holder} already serves there. Use it "
                    "(`timeshare status`), stop it, or pick another port with --port or api.port."
                ) from exc
        raise ApiBindError(
            f"Cannot listen on {host}:{port} ({exc.strerror or exc}); pick another port with --port or "
            "api.port, or stop the program that uses it."
        ) from exc
    sock.set_inheritable(False)
    return sock


def _timeshare_on(host: str, port: int) -> str:
    """Who holds ``host:port`` when it is another Timeshare: "Timeshare (pid N, http://...)" when
    this runtime dir's address file names a live process on that port, "another Timeshare (...)"
    when the port answers Timeshare's /health; "" otherwise."""
    try:
        address = ApiAddress.read()
    except (OSError, ValueError):
        address = None
    if address is not None and address.pid is not None and pid_alive(address.pid):
        with contextlib.suppress(ValueError):
            if urlsplit(address.url).port == port:
                return f"Timeshare (pid {address.pid}, {address.url})"
    url = _url("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host in ("::", "[::]") else host, port)
    try:  # urllib, not httpx: nothing to log
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as answer:
            served_by = answer.headers.get(HEALTH_HEADER)
    except (OSError, ValueError):
        return ""
    if served_by == "timeshare":
        return f"another Timeshare (one with another runtime dir or TIMESHARE_HOME, at {url})"
    return ""


def _url(host: str, port: int) -> str:
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    return f"http://{shown}:{port}"


class ApiServer:
    """uvicorn on a background thread (for the tray app and ``timeshare serve``).

    ``start()`` binds (port 0 picks a free port; see ``port`` / ``url``), serves, and records the
    address in ``paths.api_address_file()``; ``stop()`` answers what still waits with 503, shuts
    down and removes the record. Connections are guarded (see connections.py): a request head must
    arrive within ``head_timeout_s``, at most ``max_connections`` are open (default: from the
    open-files limit).
    """

    def __init__(
        self,
        pool: Pool,
        api_config: ApiConfig,
        *,
        address_file: Path | None = None,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        max_connections: int | None = None,
        config_path: Path | None = None,
        reload: ConfigReloader | None = None,
    ) -> None:
        self.pool = pool
        # POST /timeshare/v1/reload: ``reload``, else re-read ``config_path`` (default: the user's)
        self.reload: ConfigReloader = reload or functools.partial(reload_config, pool, config_path)
        self.api_config = api_config
        self.config_path = config_path
        self.address_file = address_file
        self.head_timeout_s = head_timeout_s
        self.max_connections = max_connections if max_connections is not None else connection_limit()
        self.app: Starlette | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._crash: BaseException | None = None
        self.port: int | None = None
        self.url: str | None = None
        self._address: ApiAddress | None = None
        # api.ollama_listen: the second listener's URL, or why it was refused
        self._ollama_sock: socket.socket | None = None
        self.ollama_url: str | None = None
        self.ollama_refused: str = ""

    def conversation_gone(self, conversation: str) -> bool:
        """A KV conversation the Responses API kept for a chain of which no stored response is
        left (False before :meth:`start` and for any other conversation)."""
        store = getattr(self.app.state, "responses", None) if self.app is not None else None
        return isinstance(store, ResponseStore) and store.gone(conversation)

    def start(self, timeout: float = 15.0) -> str:
        check_bind_allowed(self.api_config)
        self._sock = _bind(self.api_config.host, self.api_config.port)
        self.port = int(self._sock.getsockname()[1])
        self.url = _url(self.api_config.host, self.port)
        self.app = create_app(self.pool, self.api_config, reload=self.reload, config_path=self.config_path)
        self._bind_ollama()
        self.app.state.served.update(
            served_dialects(self.url, self.ollama_url, self.ollama_refused, dialect_paths(self.app))
        )
        install_log_limits()
        config = uvicorn.Config(
            self.app,
            http=GuardedH11Protocol.protocol_class(
                head_timeout_s=self.head_timeout_s, max_connections=self.max_connections
            ),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=3,
            timeout_keep_alive=int(KEEP_ALIVE_S),
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            # a backstop: the protocol keeps connections (so requests) within max_connections
            limit_concurrency=self.max_connections + 16,
        )
        self._server = GuardedServer(config)
        self._thread = threading.Thread(target=self._run, name="timeshare-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ApiBindError(
                    f"The API server did not start on {self.url} ({self._crash or 'timed out'})."
                )
            time.sleep(0.02)
        self._address = ApiAddress.this_process(self.url, bool(self.api_config.key))
        try:
            self._address.write(self.address_file)
        except OSError as exc:
            self._address = None
            self.stop()
            if is_disk_full(exc):
                where = self.address_file or paths.api_address_file()
                raise disk_full_error(exc, "the API address file", where) from exc
            raise
        log.info("API listening on %s%s", self.url, " (key required)" if self.api_config.key else "")
        return self.url

    def _bind_ollama(self) -> None:
        """``api.ollama_listen``: a second socket for Ollama-only clients. A taken port (a real
        Ollama, most likely) is refused with a sentence in the log and the status; the API serves on."""
        if not self.api_config.ollama_listen:
            return
        host, port = split_listen(self.api_config.ollama_listen)
        try:
            self._ollama_sock = _bind(host, port)
        except ApiBindError as exc:
            self.ollama_refused = (
                f"The Ollama listener (api.ollama_listen = {self.api_config.ollama_listen!r}) is off: "
                f"{host}:{port} is taken ({exc}). Stop the program there (a real Ollama?), or set "
                f"another address in Settings → API; the Ollama API is still served on {self.url}."
            )
            log.warning("%s", self.ollama_refused)
            return
        self.ollama_url = _url(host, int(self._ollama_sock.getsockname()[1]))
        log.info("Ollama API also listening on %s", self.ollama_url)

    def _run(self) -> None:
        assert self._server is not None and self._sock is not None
        try:
            sockets = [self._sock] + ([self._ollama_sock] if self._ollama_sock is not None else [])
            self._server.run(sockets=sockets)
        except BaseException as exc:  # uvicorn exits with SystemExit on startup failures
            self._crash = exc
            log.error("API server stopped: %r", exc)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self.app is not None:
            # requests that wait (queued or generating) get a JSON 503 and streams an error event,
            # before uvicorn's graceful shutdown would cut them off with a bare 500
            self.app.state.begin_shutdown()
        if self._address is not None:
            self._address.remove(self.address_file)
            self._address = None
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ollama_sock is not None:
            self._ollama_sock.close()
            self._ollama_sock = None
        if self.app is not None:
            self.app.state.unsubscribe()
            self.app = None


def dialect_paths(app: Starlette) -> dict[str, list[str]]:
    """Each dialect's paths, read from the app's routes (``errors.dialect_of`` each path; the
    /v1 paths that are not Anthropic's are OpenAI's), so that the status cannot drift from them.
    Timeshare's own routes (/timeshare/..., /health) are left out."""
    out: dict[str, list[str]] = {"openai": [], "anthropic": [], "ollama": []}
    for route in app.routes:
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            continue
        dialect = dialect_of(path)
        # llama-server's /rerank and /reranking are the OpenAI-style API's too
        if dialect != "openai" or path.startswith("/v1/") or path in RERANK_PATHS:
            out[dialect].append(path)
    return out


def served_dialects(
    url: str, ollama_url: str | None, ollama_refused: str = "", paths: dict[str, list[str]] | None = None
) -> dict[str, object]:
    """Which dialects are served where (the status's ``served``); ``paths``: ``dialect_paths``."""
    shown = {name: ", ".join(found) for name, found in (paths or {}).items()}
    ollama: dict[str, object] = {
        "urls": [url] + ([ollama_url] if ollama_url else []),
        "paths": shown.get("ollama", ""),
    }
    if ollama_refused:
        ollama["refused"] = ollama_refused
    return {
        "openai": {"urls": [url], "paths": shown.get("openai", "")},
        "anthropic": {"urls": [url], "paths": shown.get("anthropic", "")},
        "ollama": ollama,
    }


# ---- `timeshare serve` -------------------------------------------------------------------------


def serve_main(args: argparse.Namespace) -> int:
    """``timeshare serve``: the pool and the API in the foreground until SIGINT/SIGTERM."""
    setup_logging(bool(getattr(args, "verbose", False)))
    try:
        # model files are not checked here: a missing or broken one makes that model FAILED (with
        # its reason) while the others serve
        config = load_for_cli(getattr(args, "config", None), check_paths=False)
        host = getattr(args, "host", None)
        port = getattr(args, "port", None)
        api_config = dataclasses.replace(
            config.api,
            host=host if host is not None else config.api.host,
            port=port if port is not None else config.api.port,
        )
        if not 0 <= api_config.port <= 65535:
            raise ConfigError([f"--port: {api_config.port} is not a port number (0..65535)"])
        check_bind_allowed(api_config)
        # a full disk is one sentence before anything is written, not a traceback from the first
        # write (the lock, the address file); a write that still fails says the same below
        check_room(
            {"runtime dir": paths.runtime_dir(), "data dir": paths.data_dir(), "log dir": paths.log_dir()}
        )
        # one Timeshare per runtime dir: a second one would overwrite the first's address file
        instance = InstanceLock.acquire("serve")
    except (ConfigError, DiskFullError, InstanceRunningError, OSError) as exc:
        return _refused(exc)
    if not config.models:
        notice = str(getattr(config, "notice", "") or "")
        print(
            "timeshare serve: no models are configured. "
            f"{notice or f'Add [[models]] to {paths.config_file()}.'} "
            "Serving an empty pool.",
            file=sys.stderr,
        )

    from ..pool.supervisor import Pool

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    pool = Pool(config)
    config_path = cli_config_path(getattr(args, "config", None))
    server = ApiServer(pool, api_config, config_path=config_path)
    # a config file edited by hand is applied as `timeshare reload` would (an invalid one: logged)
    watcher = ConfigWatcher(config_path, server.reload)
    try:
        url = server.start()  # bind first: a port in use fails before any worker is spawned
        pool.start(conversation_gone=server.conversation_gone)  # KV files of forgotten chains go
        watcher.start()
        print(
            f"Timeshare API on {url}/v1 — models: {', '.join(m.id for m in config.models) or 'none'}",
            flush=True,
        )
        readiness = _Readiness([m.id for m in config.models], url)
        readiness.check(pool.snapshot())
        while not stop.wait(0.5):
            if not server.running:
                print(
                    "timeshare serve: the API server stopped unexpectedly; see the log above.",
                    file=sys.stderr,
                )
                return 1
            readiness.check(pool.snapshot())
        log.info("stopping")
        return 0
    except (ArenaError, ConfigError, ApiBindError, DiskFullError, OSError) as exc:
        return _refused(exc)
    finally:
        watcher.stop()
        server.stop()
        pool.stop()
        instance.release()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _refused(exc: Exception) -> int:
    """Say in one line why serve cannot run, and return its exit status: 1 when another instance
    runs, 2 for the configuration, the arena, the address or a full disk. Any other OSError is a
    bug: re-raised, with its traceback."""
    if isinstance(exc, OSError):
        if not is_disk_full(exc):
            raise exc
        exc = _disk_full(exc)
    print(f"timeshare serve: {exc}", file=sys.stderr)
    return 1 if isinstance(exc, InstanceRunningError) else 2


def _disk_full(exc: OSError) -> DiskFullError:
    """A write that failed for lack of space as the sentence that names the file."""
    where = exc.filename if exc.filename is not None else "a file"
    return disk_full_error(exc, "a file Timeshare needs", str(where))


class _Readiness:
    """Logs each model once it has loaded (or failed) for the first time, and prints one
    "ready: N models at URL" line on stderr once every configured model got there."""

    def __init__(self, model_ids: list[str], url: str) -> None:
        self.pending = list(model_ids)
        self.url = url
        self.ready: list[str] = []
        self.failed: list[str] = []
        self.announced = False

    def check(self, snapshot: PoolSnapshot) -> None:
        if self.announced:
            return
        states = {m.id: m for m in snapshot.models}
        for model_id in list(self.pending):
            status = states.get(model_id)
            if status is None or status.state in (ModelState.STARTING, ModelState.LOADING):
                continue
            self.pending.remove(model_id)
            if status.state is ModelState.FAILED:
                self.failed.append(model_id)
                log.warning("model %s failed: %s", model_id, status.reason or "see its log")
            elif status.state is ModelState.STOPPED:
                log.info("model %s is stopped", model_id)
            else:
                self.ready.append(model_id)
                where = f", {status.backend}" if status.backend else ""
                log.info("model %s ready (%s%s)", model_id, status.state.value, where)
        if not self.pending:
            self.announced = True
            n = len(self.ready)
            line = f"ready: {n} model{'' if n == 1 else 's'} at {self.url}"
            if self.failed:
                line += f" ({len(self.failed)} failed: {', '.join(self.failed)})"
            print(line, file=sys.stderr, flush=True)


__all__: Sequence[str] = (
    "ApiBindError",
    "ApiServer",
    "BadRequestError",
    "check_bind_allowed",
    "create_app",
    "is_loopback",
    "serve_main",
)
