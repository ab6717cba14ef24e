"""What every request passes before the handlers (pure ASGI, so disconnects still reach them):
the guard (503 while shutting down, the ``Host`` and ``Origin`` checks, CORS answers) and the key
check (``Authorization: Bearer <api.key>``, or ``x-api-key: <api.key>`` as Anthropic's clients
send it). Refusals come in the dialect's error shape (``errors.dialect_of`` the path).
``create_app`` in ``handlers`` installs both."""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config.schema import ApiConfig
from ..config.validate import is_loopback
from ..errors import ModelUnavailableError
from .errors import error_response

#: answered without a key (llama-server's liveness probe)
HEALTH_PATH = "/health"


class AuthMiddleware:
    """Pure ASGI (it leaves ``receive`` untouched, so disconnects still reach the handlers)."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        header = headers.get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if not header and b"x-api-key" in headers:  # Anthropic's clients send the key this way
            header, scheme, token = headers[b"x-api-key"], b"bearer", headers[b"x-api-key"]
        if not header:
            message = (
                "This Timeshare API needs a key: send it as 'Authorization: Bearer <key>' "
                "(the key is api.key in Timeshare's config)."
            )
            await error_response(message, 401, "missing_api_key", path=scope["path"])(scope, receive, send)
            return
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            message = (
                "Incorrect API key: send the key from api.key in Timeshare's config "
                "as 'Authorization: Bearer <key>'."
            )
            await error_response(message, 401, "invalid_api_key", path=scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


#: the 503 while shutting down: the guard's to new requests, the handlers' to those waiting
SHUTTING_DOWN = "Timeshare is shutting down; send the request again once it has restarted"
#: what a preflight allows: every method a route takes (DELETE: /v1/responses/{id}, /api/delete)
_CORS_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"
_CORS_HEADERS = "authorization, content-type, x-api-key, anthropic-version"


#: a Host header (RFC 9110 7.2 / RFC 3986 3.2.2): one IP literal or name, an optional port, nothing else
_HOST_RE = re.compile(
    r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?\.?))(?::(?P<port>[0-9]{0,5}))?"
)


def host_name(host: str) -> str | None:
    """A Host header's name without its port ("[::1]:8385" → "[::1]", "Example:80" → "example");
    None when the header is not exactly one host with an optional port ("localhost:80@evil.example",
    "[::1].evil.example", white space, a path, user info)."""
    m = _HOST_RE.fullmatch(host.lower())
    if m is None or (m["port"] and int(m["port"]) > 65535):
        return None
    if m["v6"] is not None:
        try:
            return f"[{ipaddress.IPv6Address(m['v6']).compressed}]"
        except ValueError:
            return None
    return str(m["name"])


def _bind_name(host: str) -> str:
    """The name a client puts in Host for the address the API binds ("::1" → "[::1]")."""
    try:
        address = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return host.strip().lower()
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def loopback_name(name: str) -> bool:
    """A Host name that only ever means this machine (RFC 6761: *.localhost too)."""
    return is_loopback(name) or name.endswith(".localhost")


class GuardMiddleware:
    """Pure ASGI, outermost: refuses what no legitimate client of a local API sends.

    - while shutting down: 503 (JSON) to every new request;
    - ``Host``: on a loopback bind only loopback names (a web page that rebinds its own DNS name to
      127.0.0.1 sends its name), plus ``api.allowed_hosts``; on other binds, only checked when
      ``api.allowed_hosts`` is set;
    - ``Origin`` (sent by browsers, not by the CLI or SDKs): only the API's own origin or one in
      ``api.allowed_origins``; those also get CORS answers (a preflight OPTIONS → 204), any other
      a 403, so no web page can pin, stop or prompt the models.
    """

    def __init__(self, app: ASGIApp, api_config: ApiConfig, closing: Callable[[], bool]) -> None:
        self.app = app
        self.closing = closing
        self.loopback_bind = is_loopback(api_config.host)
        self.bind_host = _bind_name(api_config.host)
        hosts = {h.strip().lower() for h in api_config.allowed_hosts}
        self.any_host = "*" in hosts
        self.hosts = hosts - {"*"}
        origins = {o.strip().lower().rstrip("/") for o in api_config.allowed_origins}
        self.any_origin = "*" in origins
        self.origins = origins - {"*"}

    def host_allowed(self, host: str | None) -> bool:
        """Whether a well-formed Host (see :func:`host_name`) names this API."""
        if host is None or self.any_host:
            return True  # HTTP/1.0 without Host: no browser sends that
        name = host_name(host)
        if name is None:
            return False
        if loopback_name(name) or name in self.hosts:
            return True
        if self.loopback_bind:
            return False
        return not self.hosts or name == self.bind_host

    def origin_allowed(self, origin: str, host: str | None, scheme: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if self.any_origin or origin in self.origins:
            return True
        return host is not None and origin == f"{scheme}://{host.strip().lower()}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.closing():
            await error_response(SHUTTING_DOWN, 503, ModelUnavailableError.code, path=scope["path"])(
                scope, receive, send
            )
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if host is not None and host_name(host) is None:
            message = (
                f"The Host header {host!r} is not a host name with an optional port (such as "
                "'127.0.0.1:8385'); send the address Timeshare printed."
            )
            await error_response(message, 400, "invalid_host", path=scope["path"])(scope, receive, send)
            return
        if not self.host_allowed(host):
            where = "loopback" if self.loopback_bind else self.bind_host
            message = (
                f"The Host {host!r} does not name this Timeshare API (it listens on {where}): use the "
                "address Timeshare printed, or add the name to api.allowed_hosts in its config."
            )
            await error_response(message, 403, "host_not_allowed", path=scope["path"])(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.origin_allowed(origin, host, str(scope.get("scheme", "http"))):
            message = (
                f"Requests from web pages at {origin} are refused: a web page may use this Timeshare "
                "API only when its origin is listed in api.allowed_origins in Timeshare's config."
            )
            await error_response(message, 403, "origin_not_allowed", path=scope["path"])(scope, receive, send)
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            asked = headers.get("access-control-request-headers", "").strip()
            preflight = Response(status_code=204)
            preflight.raw_headers += [
                *cors,
                (b"access-control-allow-methods", _CORS_METHODS.encode()),
                (b"access-control-allow-headers", (asked or _CORS_HEADERS).encode("latin-1")),
                (b"access-control-max-age", b"600"),
            ]
            await preflight(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
