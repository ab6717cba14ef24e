"""The CLI commands that talk to a running Timeshare through its local API.

`timeshare status|models|pin|unpin|sleep|wake|chat` find the API in the address file the running
instance wrote (core/api/address.py); ``--url`` overrides it. When the API needs a key,
the key comes from ``$TIMESHARE_API_KEY`` or from api.key in the config (``--config``).

Nothing here imports Qt or llama.cpp: these commands start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from .core import paths
from .core.api.address import ApiAddress
from .core.arena.dirs import pid_alive
from .core.units import human_bytes

EXIT_OK = 0
EXIT_FAILED = 1  # not running, or the server refused the request
EXIT_USAGE = 2


class ClientError(Exception):
    """A message for the user; ``main`` prints it on stderr and exits with ``status``."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8385
    key: str | None
    source: str  # where the URL came from, for messages


def _not_running(path: Path, detail: str = "") -> ClientError:
    why = f"{path} is stale: {detail}" if detail else f"no address in {path}"
    return ClientError(f"Timeshare is not running ({why}); start it with `timeshare` or `timeshare serve`.")


def _pid_alive(pid: int | None) -> bool:
    if pid is None or pid <= 0:
        return True  # unknown: let the connection attempt decide
    return pid_alive(pid)


def _config_key(args: argparse.Namespace) -> str | None:
    from .core.config.files import load_for_cli
    from .core.errors import ConfigError

    config_path = getattr(args, "config", None)
    if not config_path and not paths.config_file().exists():
        return None  # the defaults hold no key: no need to build them (that may hash a demo model)
    try:
        config = load_for_cli(config_path, check_paths=False)
    except ConfigError as exc:
        raise ClientError(f"Cannot read the API key from the configuration: {exc}") from exc
    return config.api.key


def find_endpoint(args: argparse.Namespace) -> Endpoint:
    key = os.environ.get("TIMESHARE_API_KEY") or None
    url = getattr(args, "url", None)
    if url:
        return Endpoint(url.rstrip("/"), key, "--url")
    path = paths.api_address_file()
    try:
        address = ApiAddress.read(path)
    except FileNotFoundError:
        raise _not_running(path) from None
    except ValueError as exc:
        raise _not_running(path, str(exc)) from exc
    if not _pid_alive(address.pid):
        raise _not_running(path, f"the process {address.pid} that wrote it has exited")
    if key is None and address.key_required:
        key = _config_key(args)
        if not key:
            raise ClientError(
                f"The running Timeshare at {address.url} needs an API key: set TIMESHARE_API_KEY, "
                "or pass the configuration that holds api.key with --config."
            )
    return Endpoint(address.url.rstrip("/"), key, str(path))


class Api:
    """A small httpx wrapper that turns transport and API errors into ClientError sentences."""

    def __init__(self, endpoint: Endpoint, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {endpoint.key}"} if endpoint.key else {}
        self.endpoint = endpoint
        self.http = httpx.Client(base_url=endpoint.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def _unreachable(self, exc: httpx.TransportError) -> ClientError:
        if self.endpoint.source == "--url":
            return ClientError(f"Cannot reach Timeshare at {self.endpoint.url} ({exc}); check --url.")
        return ClientError(
            f"Timeshare is not running: {self.endpoint.source} names {self.endpoint.url}, which does not "
            f"answer ({exc}); start it with `timeshare` or `timeshare serve`."
        )

    @staticmethod
    def _error_of(response: httpx.Response) -> ClientError:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text.strip()[:300] or response.reason_phrase
        return ClientError(f"{message} (HTTP {response.status_code})")

    def request(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self.http.request(method, url, json=body)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code >= 400:
            raise self._error_of(response)
        return response.json()

    def stream_events(self, url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST and yield the JSON objects of the server-sent events until ``[DONE]``."""
        try:
            with self.http.stream("POST", url, json=body, timeout=httpx.Timeout(30.0, read=None)) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._error_of(response)
                data: list[str] = []
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        data.append(line[5:].removeprefix(" "))
                    elif line == "" and data:
                        payload = "\n".join(data)
                        data = []
                        if payload == "[DONE]":
                            return
                        event = json.loads(payload)
                        if isinstance(event, dict) and "error" in event:
                            raise ClientError(f"{event['error'].get('message', event['error'])}")
                        yield event
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc


# ---- commands ----------------------------------------------------------------------------------


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")


def print_status(status: dict[str, Any], out: TextIO) -> None:
    holder = status.get("holder")
    out.write(f"GPU holder: {holder or 'none'}{'  (switching)' if status.get('switching') else ''}\n")
    models = status.get("models") or []
    if not models:
        out.write("No models are configured.\n")
        return
    stats = (status.get("switch_stats") or {}).get("per_model", {})
    rows = [["MODEL", "STATE", "BUSY", "PINNED", "QUEUED", "WEIGHTS", "SWITCHES", "LAST RESTORE", "NOTE"]]
    for m in models:
        tally = stats.get(m["id"], {})
        last = m.get("last_switch") or {}
        restore = f"{last['restore_ms']:.0f} ms" if last.get("switched") else "-"
        note = m.get("reason") or ""
        if m.get("residency_path") == "rebuild" and m.get("residency_reason"):
            note = (note + "; " if note else "") + f"rebuild path: {m['residency_reason']}"
        rows.append(
            [
                m["id"] + (" *" if m["id"] == holder else ""),
                m.get("state", "?"),
                "yes" if m.get("busy") else "no",
                "yes" if m.get("pinned") else "no",
                str(m.get("queued", 0)),
                human_bytes(int(m.get("weight_bytes") or 0), empty="-", largest="GiB"),
                str(tally.get("switches", 0)),
                restore,
                note,
            ]
        )
    _table(rows, out)


def print_models(models: dict[str, Any], out: TextIO) -> None:
    data = models.get("data") or []
    if not data:
        out.write("No models are configured.\n")
        return
    rows = [["ID", "NAME", "STATE", "CHAT FORMAT", "LICENCE"]]
    for m in data:
        extra = m.get("timeshare") or {}
        rows.append(
            [
                m["id"],
                extra.get("name", ""),
                extra.get("state", ""),
                extra.get("chat_format") or "-",
                extra.get("licence", ""),
            ]
        )
    _table(rows, out)


_GET_COMMANDS: dict[str, tuple[str, Callable[[dict[str, Any], TextIO], None]]] = {
    "status": ("/timeshare/v1/status", print_status),
    "models": ("/v1/models", print_models),
}
_VERB_DONE = {"pin": "pinned", "unpin": "unpinned", "sleep": "put to sleep", "wake": "woken"}


def run_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    command = args.command
    endpoint = find_endpoint(args)
    with Api(endpoint) as api:
        if command in _GET_COMMANDS:
            path, show = _GET_COMMANDS[command]
            data = api.request("GET", path)
            if args.json:
                out.write(json.dumps(data, indent=2) + "\n")
            else:
                show(data, out)
            return EXIT_OK
        if command in _VERB_DONE:  # the command is the endpoint's last path segment
            reply = api.request("POST", f"/timeshare/v1/models/{args.model}/{command}")
            state = (reply.get("model") or {}).get("state", "?")
            out.write(f"{args.model}: {_VERB_DONE[command]} (state: {state})\n")
            return EXIT_OK
        if command == "chat":
            return _chat(api, args, out, err)
    raise ClientError(f"unknown command {command!r}", EXIT_USAGE)


def _chat(api: Api, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.max_tokens < 1:
        raise ClientError("--max-tokens must be at least 1.", EXIT_USAGE)
    if not 0 <= getattr(args, "temperature", 0.2) <= 2:
        raise ClientError("--temperature must be from 0 to 2.", EXIT_USAGE)
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": getattr(args, "temperature", 0.2),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    extras: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    for event in api.stream_events("/v1/chat/completions", body):
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                out.write(text)
                out.flush()
        extras = event.get("timeshare") or extras
        usage = event.get("usage") or usage
    out.write("\n")
    out.flush()
    if getattr(args, "verbose", False):
        switched = "switched GPU" if extras.get("switched") else "no GPU switch"
        err.write(
            f"[{args.model}: {usage.get('prompt_tokens', '?')} prompt + "
            f"{usage.get('completion_tokens', '?')} completion tokens; {switched}, "
            f"restore {extras.get('restore_ms', 0):.0f} ms, "
            f"first token {extras.get('first_token_ms', 0):.0f} ms]\n"
        )
    return EXIT_OK


def main(args: argparse.Namespace) -> int:
    try:
        return run_command(args, sys.stdout, sys.stderr)
    except ClientError as exc:
        sys.stdout.flush()
        print(f"timeshare {args.command}: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        # closing the stream makes the server cancel the generation
        print("", file=sys.stderr)
        return 130
