"""The connection to a running Timeshare: where its API is, with which key, and a small HTTP client.

The CLI's verbs (``client.py``), ``rm`` (``manage.py``) and ``pull`` use it; it imports neither, so
the offline verbs and the online ones do not import each other. Nothing here imports Qt or llama.cpp.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .core import envvars, paths
from .core.api.address import ApiAddress
from .core.arena.dirs import pid_alive
from .core.errors import UntrustedAddressError
from .core.instance import running_instance

EXIT_OK = 0
EXIT_FAILED = 1  # not running, or the server refused the request
EXIT_USAGE = 2


class ClientError(Exception):
    """A message for the user; ``main`` prints it on stderr and exits with ``status``."""

    def __init__(self, message: str, status: int = EXIT_FAILED, *, not_running: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.not_running = not_running  # no instance runs (``ls`` then lists the configured models)


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8385
    key: str | None
    source: str  # where the URL came from, for messages


def _not_running(path: Path, detail: str = "") -> ClientError:
    why = f"{path} is stale: {detail}" if detail else f"no address in {path}"
    return ClientError(
        f"Timeshare is not running ({why}); start it with `timeshare` or `timeshare serve`.", not_running=True
    )


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
    key = envvars.API_KEY.raw() or None
    url = getattr(args, "url", None)
    if url:
        return Endpoint(url.rstrip("/"), key, "--url")
    path = paths.api_address_file()
    try:
        # only an address file that is the user's own: the key may go to the address it names
        address = ApiAddress.read(path, trusted_only=True)
    except UntrustedAddressError as exc:
        raise ClientError(str(exc)) from None
    except FileNotFoundError:
        running = running_instance()
        if running is not None:  # the tray with api.enabled = false, or one still starting
            raise ClientError(
                f"Timeshare is running ({running.who()}) but records no API address in {path}: "
                "its API is off (api.enabled = false) or not started yet."
            ) from None
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
            f"answer ({exc}); start it with `timeshare` or `timeshare serve`.",
            not_running=True,
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


def reload_instance(args: argparse.Namespace) -> dict[str, Any] | None:
    """Ask the running Timeshare to re-read its config file and apply it (``POST
    /timeshare/v1/reload``; ``timeshare pull`` calls it). Returns its answer (``config``, ``models``),
    or None when no instance runs. ClientError when one runs but cannot be asked."""
    if not getattr(args, "url", None):
        try:
            address = ApiAddress.read(paths.api_address_file(), trusted_only=True)
        except (FileNotFoundError, ValueError):
            return None
        except UntrustedAddressError as exc:
            raise ClientError(str(exc)) from None
        if not _pid_alive(address.pid):
            return None
    with Api(find_endpoint(args)) as api:
        answer = api.request("POST", "/timeshare/v1/reload")
    return answer if isinstance(answer, dict) else {}
