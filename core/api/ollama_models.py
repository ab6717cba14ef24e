"""The Ollama API's model routes on the pool: ``GET /api/tags`` (every configured model: name,
size, digest and details read from its GGUF by the catalog's reader), ``POST /api/show``
(template, parameters, model info, capabilities), ``GET /api/ps`` (the models with a worker:
VRAM size, ``expires_at`` from the idle timer), ``POST /api/pull`` (the pull code's streamed
progress, then the model joins the config), ``DELETE /api/delete`` (removes the model from the
config; the file stays unless ``"delete_file": true``), ``POST /api/embed`` and
``/api/embeddings``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import paths
from ..config.files import update_config
from ..config.schema import Config, ModelConfig
from ..errors import TimeshareError
from ..gguf.catalog import CatalogEntry, read_chat_template
from ..state import EventKind, ModelState, ModelStatus, PoolEvent
from .dialect import Host, listing
from .embeddings import MAX_INPUTS
from .errors import BadRequestError, ClientGoneError
from .extras import switch_extras
from .ollama import IGNORED_OPTIONS, OPTIONS, decode, resolve, shown_name
from .ollama_pull import PullJob
from .requests import read_json

#: a model's expires_at when its idle release is off (Ollama shows a far future the same way)
NEVER = "2318-01-01T00:00:00Z"
_WITH_WORKER = (ModelState.RESIDENT, ModelState.RELEASED, ModelState.SLEEPING)


class NameBody(msgspec.Struct, frozen=True, kw_only=True):
    model: str = ""
    name: str = ""  # older clients send "name"
    verbose: bool = False
    delete_file: bool = False  # Timeshare's extension to /api/delete

    @property
    def which(self) -> str:
        if not (self.model or self.name):
            raise BadRequestError("'model' is required: a name from GET /api/tags.", "model")
        return self.model or self.name


class EmbedBody(NameBody, frozen=True, kw_only=True):
    input: str | list[str] | None = None
    prompt: str | None = None  # /api/embeddings
    truncate: bool = True  # ignored: an input longer than the context is an error, never cut
    options: dict[str, Any] | None = None  # ignored
    keep_alive: str | float | None = None  # ignored here


class PullBody(msgspec.Struct, frozen=True, kw_only=True):
    model: str = ""
    name: str = ""
    stream: bool = True
    insecure: bool = False


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _family(architecture: str) -> str:
    return architecture or "unknown"


def _capabilities(status: ModelStatus, config: ModelConfig | None, entry: CatalogEntry | None) -> list[str]:
    """Ollama's capabilities of a model: ``rerank`` for a reranker (rank pooling, as its worker
    reported or, before it has loaded, as its GGUF's header says: what /v1/models lists once it
    has), ``embedding`` for an embedding model, else ``completion`` and ``tools`` (and ``vision``
    with a projector, as Ollama lists a model that reads images)."""
    if status.pooling == "rank" or (entry is not None and entry.pooling == "rank"):
        return ["rerank"]
    if config is not None and config.embedding:
        return ["embedding"]
    found = ["completion", "tools"]
    if config is not None and config.mmproj:
        found.append("vision")
    return found


class LastUse:
    """When each model last finished a request (the pool's REQUEST_DONE events): the start of its
    idle timer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[str, float] = {}

    def on_event(self, event: PoolEvent) -> None:
        if event.kind is EventKind.REQUEST_DONE and event.model is not None:
            with self._lock:
                self._at[event.model] = time.time()

    def get(self, model_id: str) -> float | None:
        with self._lock:
            return self._at.get(model_id)


class ModelRoutes:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.files = host.files
        self.last_use = LastUse()
        self.started = time.time()
        host.pool.subscribe(self.last_use.on_event)

    def routes(self) -> list[Route]:
        return [
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/pull", self.pull, methods=["POST"]),
            Route("/api/delete", self.delete, methods=["DELETE"]),
            Route("/api/embed", self.embed, methods=["POST"]),
            Route("/api/embeddings", self.embed, methods=["POST"]),
        ]

    # -- what the files say --

    def _details(self, path: str) -> tuple[dict[str, Any], CatalogEntry | None]:
        try:
            entry = self.files.header(path)
        except (OSError, TimeshareError):
            return {
                "format": "gguf",
                "family": "",
                "families": None,
                "parameter_size": "",
                "quantization_level": "",
            }, None
        family = _family(entry.architecture)
        return {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family],
            "parameter_size": entry.parameters,
            "quantization_level": entry.quantisation,
        }, entry

    def _tag(self, status: ModelStatus) -> dict[str, Any]:
        details, entry = self._details(status.path)
        capabilities = _capabilities(status, self.host.pool.config.model(status.id), entry)
        try:
            st = Path(status.path).stat()
            size, modified = (entry.size if entry else st.st_size), st.st_mtime
            digest = self.files.digest(status.path)
        except OSError:
            size, modified, digest = 0, self.started, ""
        return {
            "name": shown_name(status.id),
            "model": shown_name(status.id),
            "modified_at": _iso(modified),
            "size": size,
            "digest": digest.removeprefix("sha256:"),
            "details": details,
            "capabilities": capabilities,  # as /api/show's (Ollama's tags have none: an addition)
            "timeshare": {"id": status.id, "name": status.display_name, "state": status.state.value},
        }

    async def tags(self, request: Request) -> Response:
        listed = listing(self.host.pool)
        models = await anyio.to_thread.run_sync(lambda: [self._tag(m) for m, _ in listed])
        return JSONResponse({"models": models})

    def _show(self, model_id: str, status: ModelStatus) -> dict[str, Any]:
        config = self.host.pool.config.model(model_id)
        details, entry = self._details(status.path)
        try:
            template = read_chat_template(status.path) or ""
        except (OSError, TimeshareError):
            template = ""
        if config is not None and config.chat_template:
            template = config.chat_template
        info: dict[str, Any] = {"general.architecture": details.get("family", "")}
        if entry is not None:
            arch = entry.architecture
            info.update(
                {
                    "general.name": entry.name,
                    "general.size_label": entry.parameters,
                    "general.license": entry.licence,
                    f"{arch}.context_length": entry.context_length,
                }
            )
        capabilities = _capabilities(status, config, entry)
        parameters = [f"num_ctx {status.n_ctx}"] if status.n_ctx else []
        return {
            "license": entry.licence if entry else "",
            "modelfile": f"# Timeshare model {model_id}\nFROM {status.path}\n",
            "parameters": "\n".join(parameters),
            "template": template,
            "details": details,
            "model_info": info,
            "capabilities": capabilities,
            "modified_at": _iso(Path(status.path).stat().st_mtime) if Path(status.path).exists() else "",
            "timeshare": {
                "id": model_id,
                "state": status.state.value,
                "n_ctx": status.n_ctx,
                "options": {
                    "mapped": sorted([*OPTIONS, "num_predict", "stop"]),
                    "ignored": list(IGNORED_OPTIONS),
                    "num_ctx": "ignored: the context is the model's n_ctx setting (never a reload)",
                },
            },
        }

    async def show(self, request: Request) -> Response:
        body: NameBody = decode(await read_json(request), NameBody)
        snapshot = self.host.pool.snapshot()
        model_id = resolve(body.which, snapshot)
        status = snapshot.model(model_id)
        assert status is not None
        return JSONResponse(await anyio.to_thread.run_sync(self._show, model_id, status))

    def _expires(self, status: ModelStatus, config: ModelConfig | None) -> str:
        idle = config.idle_sleep_s if config is not None else None
        if idle is None or status.pinned:
            return NEVER
        last = self.last_use.get(status.id) or self.started
        try:
            return _iso(last + idle)
        except (OverflowError, ValueError, OSError):  # past datetime's years (a config built in code)
            return NEVER

    async def ps(self, request: Request) -> Response:
        out = []
        for m, config in listing(self.host.pool):
            if m.state not in _WITH_WORKER:
                continue
            tag = await anyio.to_thread.run_sync(self._tag, m)
            host = m.backend.upper().startswith("CPU")  # a CPU build: it all is host memory
            out.append(
                {
                    "name": tag["name"],
                    "model": tag["model"],
                    "size": max(tag["size"], m.device_bytes),
                    "digest": tag["digest"],
                    "details": tag["details"],
                    "expires_at": self._expires(m, config),
                    # what its worker holds on the GPU now: weights, KV, buffers, driver context
                    "size_vram": 0 if host else m.device_bytes,
                    "context_length": m.n_ctx,
                    "timeshare": {
                        "id": m.id,
                        "state": m.state.value,
                        "holds_gpu": m.holds_gpu,
                        "pinned": m.pinned,
                        "weight_bytes": m.weight_bytes,
                        "held": m.held(),
                    },
                }
            )
        return JSONResponse({"models": out})

    # -- config changes --

    def _config_path(self) -> Path:
        return self.host.config_path or paths.config_file()

    def _delete(self, model_id: str, delete_file: bool) -> None:
        path = self._config_path()
        removed: list[ModelConfig] = []

        def change(config: Config) -> Config:
            model = config.model(model_id)
            if model is None:
                raise BadRequestError(
                    f"model {model_id!r} is not in {path} (it comes from elsewhere, such as the demo "
                    "models): remove it there.",
                    "model",
                    status=404,
                )
            removed.append(model)
            return dataclasses.replace(config, models=tuple(m for m in config.models if m.id != model_id))

        # the one writer: the file as it is now, under its lock, applied before the next change
        update_config(change, path, then=self.host.pool.apply_config)
        if delete_file:
            Path(removed[0].path).unlink(missing_ok=True)

    async def delete(self, request: Request) -> Response:
        body: NameBody = decode(await read_json(request), NameBody)
        model_id = resolve(body.which, self.host.pool.snapshot())
        await anyio.to_thread.run_sync(self._delete, model_id, body.delete_file)
        return Response(status_code=200)

    async def pull(self, request: Request) -> Response:
        body: PullBody = decode(await read_json(request), PullBody)
        name = body.model or body.name
        if not name:
            raise BadRequestError(
                "'model' is required: hf.co/ORG/REPO:QUANT or the URL of a .gguf file.", "model"
            )
        job = PullJob(self.host, name, self._config_path())
        if body.stream:

            async def lines() -> AsyncIterator[bytes]:
                async for item in _watched(request, job):
                    yield json.dumps(item).encode() + b"\n"

            return StreamingResponse(lines(), media_type="application/x-ndjson")
        last: dict[str, Any] = {}
        async for item in _watched(request, job):
            last = item
        if job.cancelled:
            return Response(status_code=499)
        if "error" in last:
            raise BadRequestError(str(last["error"]), "model")
        return JSONResponse(last)

    async def embed(self, request: Request) -> Response:
        """``/api/embed`` (``input``: a string or a list) and the older ``/api/embeddings``
        (``prompt``: one string): the pool's embeddings (unit vectors, as /v1/embeddings)."""
        legacy = request.url.path.endswith("/embeddings")
        body: EmbedBody = decode(await read_json(request), EmbedBody)
        model_id = resolve(body.which, self.host.pool.snapshot())
        raw = body.prompt if legacy else body.input
        inputs = [raw] if isinstance(raw, str) else list(raw or [])
        field = "prompt" if legacy else "input"
        if not inputs or any(not isinstance(x, str) or not x for x in inputs):
            raise BadRequestError(
                f"'{field}' is required: a non-empty string (or, for input, a list of them).", field
            )
        if len(inputs) > MAX_INPUTS:
            raise BadRequestError(f"'{field}' holds {len(inputs)} inputs; send at most {MAX_INPUTS}.", field)
        started = time.monotonic()
        try:
            gen = await self.host.call(self.host.pool.embed, model_id, tuple(inputs))
        except ValueError as exc:
            raise BadRequestError(f"{exc}.") from exc
        try:
            result = await self.host.wait_watching(request, gen, gen.result)
        except ClientGoneError:
            return Response(status_code=499)
        vectors = [[float(x) for x in v] for v in result.embeddings]
        if legacy:
            return JSONResponse({"embedding": vectors[0]})
        switch = result.switch
        return JSONResponse(
            {
                "model": shown_name(model_id),
                "embeddings": vectors,
                "total_duration": int((time.monotonic() - started) * 1e9),
                "load_duration": int(switch.restore_ms * 1e6) if switch.switched else 0,
                "prompt_eval_count": result.usage.prompt_tokens,
                "timeshare": switch_extras(switch, result.usage.prompt_tokens_evaluated),
            }
        )


#: how often a pull that sends nothing looks whether its client is still there
PULL_WATCH_S = 0.5


async def _watched(request: Request, job: PullJob) -> AsyncIterator[dict[str, Any]]:
    """The pull's progress objects while its client is there: a client that goes away (streamed
    or not), or a consumer that stops, cancels the download (its partial file is kept for a
    resume, as ``timeshare pull`` keeps it)."""
    try:
        while not job.ended:
            item = await anyio.to_thread.run_sync(job.get, PULL_WATCH_S, abandon_on_cancel=True)
            if await request.is_disconnected():
                job.cancel()
                return
            if item is not None:
                yield item
    finally:
        if not job.ended:
            job.cancel()


def routes(host: Host) -> list[Route]:
    return ModelRoutes(host).routes()
