"""The configured models, whether Timeshare runs or not: ``ls`` without a running instance,
``show M`` (the file's header: quantisation, context, template, licence, capabilities) and
``rm M [--delete-file]`` (remove it from the config; a running Timeshare drops it at once).

Nothing here imports Qt or llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from .core.config.files import cli_config_path, load_for_cli, update_config
from .core.config.schema import Config, ModelConfig
from .core.errors import ConfigError, TimeshareError
from .core.modelnames import resolve_cli_model

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
NOT_RUNNING = "not running"


def configured(args: argparse.Namespace) -> Config:
    """The config file the command names (``--config``), or the default one (or the defaults)."""
    return load_for_cli(getattr(args, "config", None), check_paths=False)


def models_json(config: Config) -> dict[str, Any]:
    """``GET /v1/models``' shape for the configured models, each in state "not running" (its
    capabilities as its file's header says: none when the file cannot be read)."""
    return {
        "object": "list",
        "data": [
            {
                "id": m.id,
                "object": "model",
                "owned_by": "timeshare",
                "capabilities": file_capabilities(m.path, m),
                "timeshare": {
                    "name": m.display_name,
                    "state": NOT_RUNNING,
                    "licence": m.licence,
                    "n_ctx": m.n_ctx,
                },
            }
            for m in config.models
        ],
    }


def capabilities(
    model: ModelConfig | None, has_template: bool, template: str, pooling: str = ""
) -> list[str]:
    """What the model answers: reranking only (``pooling`` "rank", as the GGUF's header says: a
    reranker, as /v1/models lists it), embeddings only, or completion and chat (with its
    template or the fallback format) and tools when its template takes them."""
    if pooling == "rank":
        return ["rerank"]
    if model is not None and model.embedding:
        return ["embedding"]
    found = ["completion", "chat" if has_template else "chat (fallback format)"]
    if "tools" in template:
        found.append("tools")
    if model is not None and model.mmproj:
        found.append("vision")
    return found


def file_capabilities(path: str, model: ModelConfig | None) -> list[str]:
    """:func:`capabilities` from the file's header ([] when the file cannot be read)."""
    from .core.gguf.catalog import read_chat_template, read_gguf_header
    from .core.gguf.header import GgufCorruptError, GgufTruncatedError

    try:
        entry = read_gguf_header(path)
        template = read_chat_template(path) or ""
    except (OSError, ValueError, TimeshareError, GgufCorruptError, GgufTruncatedError):
        return []
    return capabilities(model, entry.has_chat_template, template, entry.pooling)


def describe(path: str, model: ModelConfig | None, status: dict[str, Any] | None) -> dict[str, Any]:
    """What ``show`` prints, from the config, the running model's status and the file's header."""
    from .core.gguf.catalog import read_chat_template, read_gguf_header
    from .core.gguf.header import GgufCorruptError, GgufTruncatedError

    info: dict[str, Any] = {"file": path}
    if model is not None:
        info.update(id=model.id, name=model.display_name, context=model.n_ctx or "auto")
        info.update(parallel=model.parallel or "auto", kv_cache_type=model.kv_cache_type or "default")
        if model.mmproj:
            info["projector"] = model.mmproj  # it reads images (issue 41)
    if status is not None:
        info.update(state=status.get("state"), context=status.get("n_ctx") or info.get("context"))
        if status.get("parallel"):
            info["parallel"] = status["parallel"]
        if status.get("kv_cache_type"):
            info["kv_cache_type"] = status["kv_cache_type"]
        if status.get("fit"):
            info["fit"] = status["fit"]  # what the fit chose for settings left on auto, and why
        if status.get("reason"):
            info["reason"] = status["reason"]
    else:
        info["state"] = NOT_RUNNING
    try:
        entry = read_gguf_header(path)
        template = read_chat_template(path) or ""
    except (OSError, ValueError, TimeshareError, GgufCorruptError, GgufTruncatedError) as exc:
        # a missing or damaged file: say so, show the rest
        info["problem"] = f"cannot read the file: {exc}"
        return info
    info.update(
        architecture=entry.architecture,
        parameters=entry.parameters,
        quantisation=entry.quantisation,
        general_name=entry.name,
        trained_context=entry.context_length,
        licence=(model.licence if model is not None and model.licence else entry.licence),
        template=template,
        capabilities=capabilities(model, entry.has_chat_template, template, entry.pooling),
    )
    return info


def print_description(info: dict[str, Any], out: TextIO) -> None:
    rows = [
        ("Model", f"{info.get('id', '?')} ({info.get('name', '?')})"),
        ("State", info.get("state", "?") + (f": {info['reason']}" if info.get("reason") else "")),
        ("File", info["file"]),
    ]
    if "problem" in info:
        rows.append(("Problem", info["problem"]))
    else:
        arch = info["architecture"] + (f", {info['parameters']}" if info.get("parameters") else "")
        rows += [
            ("Architecture", arch),
            ("Name in file", info.get("general_name") or "-"),
            ("Quantisation", info["quantisation"]),
            (
                "Context",
                f"{info.get('context') or '?'} tokens × {info.get('parallel') or '?'} sequences "
                f"(trained: {info['trained_context'] or '?'}), KV cache {info.get('kv_cache_type') or '?'}",
            ),
            (
                "Fitted",
                info.get("fit")
                or (
                    "settings left on auto are fitted to the device when the model loads "
                    "(an auto budget: to the budget it time-shares)"
                    if info.get("state") == NOT_RUNNING
                    else "-"
                ),
            ),
            ("Licence", info.get("licence") or "-"),
            ("Capabilities", ", ".join(info["capabilities"])),
        ]
        if info.get("projector"):
            rows.append(("Projector", info["projector"]))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        out.write(f"{key.ljust(width)}  {value}\n")
    if info.get("template"):
        out.write("Template:\n")
        for line in str(info["template"]).splitlines()[:40]:
            out.write(f"  {line}\n")
        if len(str(info["template"]).splitlines()) > 40:
            out.write("  …\n")
    elif "problem" not in info:
        out.write("Template: none in the file (chat uses Timeshare's fallback format)\n")


def show(args: argparse.Namespace, status: dict[str, Any] | None, out: TextIO) -> int:
    """``timeshare show M``; ``status`` is the running instance's /timeshare/v1/status, or None."""
    try:
        config = configured(args)
    except ConfigError:
        config = None
    model = config.model(args.model) if config is not None else None
    running = next((m for m in (status or {}).get("models") or [] if m.get("id") == args.model), None)
    path = (running or {}).get("path") or (model.path if model is not None else "")
    info = describe(path, model, running)
    if model is None and running is not None:
        info.update(id=running["id"], name=running.get("name") or running["id"])
    if getattr(args, "json", False):
        out.write(json.dumps(info, indent=2) + "\n")
    else:
        print_description(info, out)
    return EXIT_OK


def _confirm(question: str, err: TextIO) -> bool:
    if not sys.stdin.isatty():
        return False
    err.write(f"{question} [y/N] ")
    err.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _file_and_blob(path: Path) -> list[Path]:
    """The file, and what it links to (a Hugging Face cache's snapshot entry links to its blob)."""
    found = [path]
    if path.is_symlink():
        target = path.resolve()
        if target.exists():
            found.append(target)
    return found


def rm(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``timeshare rm M [--delete-file [--yes]]``."""
    from .connection import ClientError, reload_instance

    config_path = cli_config_path(getattr(args, "config", None))
    try:
        config = configured(args)
        model_id = resolve_cli_model(config.models, args.model)
    except (ConfigError, ValueError) as exc:
        err.write(f"timeshare rm: {exc}\n")
        return EXIT_FAILED
    model = config.model(model_id)
    assert model is not None
    file = Path(model.path).expanduser()
    delete: list[Path] = []
    if args.delete_file:
        shared = [m.id for m in config.models if m.id != model_id and Path(m.path).expanduser() == file]
        if model.demo:
            err.write(
                f"timeshare rm: {file} is a demo model's file (its Python package holds it): not deleted\n"
            )
        elif shared:
            err.write(f"timeshare rm: {file} is also the file of {', '.join(shared)}: not deleted\n")
        elif file.exists() or file.is_symlink():
            size = file.stat().st_size if file.exists() else 0
            question = f"Delete {file} ({size / 1e9:.2f} GB)?"
            if not args.yes and not _confirm(question, err):
                err.write("timeshare rm: nothing removed (to delete without asking, add --yes)\n")
                return EXIT_USAGE
            delete = _file_and_blob(file)
    try:
        # the one writer: the file as it is now (a pull meanwhile stays), under its lock
        update_config(
            lambda current: replace(current, models=tuple(m for m in current.models if m.id != model_id)),
            config_path,
        )
    except ConfigError as exc:
        err.write(f"timeshare rm: {exc}\n")
        return EXIT_FAILED
    out.write(f"Removed {model_id} ({model.display_name}) from {config_path}\n")
    for p in delete:
        try:
            os.unlink(p)
            out.write(f"Deleted {p}\n")
        except OSError as exc:
            err.write(f"timeshare rm: could not delete {p}: {exc}\n")
    try:
        answer = reload_instance(args)
    except ClientError as exc:
        err.write(f"timeshare rm: could not tell the running Timeshare to reload: {exc}\n")
        return EXIT_OK
    if answer is not None:
        err.write("The running Timeshare reloaded its configuration and stopped the model.\n")
    return EXIT_OK


def rm_main(args: argparse.Namespace) -> int:
    return rm(args, sys.stdout, sys.stderr)
