"""The API's connections: uvicorn's h11 protocol with the limits a local server needs against
broken or hostile clients, and logging that such clients cannot flood.

- A connection must deliver each request head within ``head_timeout_s`` (a fresh connection, the
  next request on a kept-alive one, a head that trickles in byte by byte); otherwise it is closed
  (with a 408 when part of a head had arrived). Idle kept-alive connections close after
  ``KEEP_ALIVE_S`` (uvicorn's own timer); a body that stalls is ``requests.BODY_TIMEOUT_S``.
- At most ``max_connections`` are open, derived from the open-files limit (``RLIMIT_NOFILE``) so
  that the pool's workers and files keep descriptors: a new connection beyond it closes the one
  that has waited longest without a request in progress, or, when every one is busy, gets a 503.
- A request head over ``MAX_HEAD_BYTES`` is a 400 and a request target over ``MAX_TARGET_BYTES`` a
  414, counted here as the bytes arrive (h11's own bound applies only to a head still incomplete,
  so a whole head read in one chunk could be twice as long). A response sent before the request's
  body was read (a 408, a 413) closes the connection at once: it cannot carry another request.
- Malformed HTTP gets a JSON 400 in the API's error shape (uvicorn's own is plain text).
- Accept errors (EMFILE and co.) and uvicorn's warnings are logged at most once per message every
  ``LOG_INTERVAL_S``, with the count of those left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import re
import resource
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 15.0
KEEP_ALIVE_S = 5.0
#: bytes of a request head (request line and headers, up to the blank line); more is a 400
MAX_HEAD_BYTES = 64 * 1024
#: bytes of the request target (path and query); more is a 414
MAX_TARGET_BYTES = 8 * 1024
LOG_INTERVAL_S = 10.0
#: the kernel's send buffer of each connection: a client that stops reading a stream blocks the
#: server's writes after about this much (then the stream's write timeout applies) instead of
#: after the megabytes loopback autotuning allows
SEND_BUFFER_BYTES = 256 * 1024
_MIN_CONNECTIONS = 16
_MAX_CONNECTIONS = 4096


def connection_limit(open_files: int | None = None) -> int:
    """How many connections the API keeps open at most: half the open-files limit (the rest is for
    the pool's workers, logs and databases), within [16, 4096]."""
    if open_files is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_files = _MAX_CONNECTIONS * 2 if soft == resource.RLIM_INFINITY or soft <= 0 else soft
    return max(_MIN_CONNECTIONS, min(_MAX_CONNECTIONS, open_files // 2))


def raw_error(status: int, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with the API's JSON error body, for when no request was parsed."""
    body = json.dumps(error_body(message, status, code)).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


# ---- rate-limited logging -------------------------------------------------------------------------


class RateLimiter:
    """Lets one event per key through every ``interval`` seconds and counts the others."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def allow(self, key: str) -> tuple[bool, int]:
        """(whether to log now, how many were left out since the last one logged)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False, 0
            if len(self._last) > 256:  # keys are message templates: a handful in practice
                self._last.clear()
            self._last[key] = now
            return True, self._dropped.pop(key, 0)


class RateLimitFilter(logging.Filter):
    """At most one record per message template every interval; the next says how many it hid."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        super().__init__()
        self.limiter = RateLimiter(interval)

    def filter(self, record: logging.LogRecord) -> bool:
        template = record.msg if isinstance(record.msg, str) else repr(record.msg)
        ok, dropped = self.limiter.allow(f"{record.name}:{template}")
        if ok and dropped:
            record.msg = f"{template} [{dropped} more like this in the last {self.limiter.interval:g} s]"
        return ok


_accept_errors = RateLimiter()


def install_log_limits() -> None:
    """Rate-limit the per-connection warnings (uvicorn's "Invalid HTTP request received.", ours)."""
    for logger in (logging.getLogger("uvicorn.error"), log):
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter())


def _loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    message = str(context.get("message", ""))
    if isinstance(exc, OSError) and "accept" in message:
        # asyncio pauses accepting for a second and says so each time: once per interval is enough
        ok, dropped = _accept_errors.allow(message)
        if ok:
            more = f" [{dropped} more like this in the last {LOG_INTERVAL_S:g} s]" if dropped else ""
            log.error(
                "API: cannot accept new connections: %s (%s); the API retries every second. Too many "
                "connections or files are open: close some, or raise the open-files limit (ulimit -n)%s",
                message,
                exc,
                more,
            )
        return
    loop.default_exception_handler(context)


class GuardedServer(uvicorn.Server):
    """uvicorn's server with the rate-limited handling of accept errors in its event loop."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(_loop_exception_handler)
        await super().serve(sockets)


# ---- the request-head meter -----------------------------------------------------------------------

_BLANK_LINE = re.compile(rb"\n\r?\n")
#: a request line longer than this cannot hold a target within MAX_TARGET_BYTES (method, version)
_MAX_LINE_BYTES = MAX_TARGET_BYTES + 64


class HeadMeter:
    """Counts one request head as its bytes arrive: :meth:`feed` says "target" (414) once the
    request target is over ``MAX_TARGET_BYTES``, "head" (400) once the head is over
    ``MAX_HEAD_BYTES`` without its blank line, else "" (fine so far, or the head is complete).
    Linear in the bytes fed, however they are split."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.size = 0  # bytes of this head seen so far
        self.complete = False
        self._line = b""  # the request line so far (bounded by _MAX_LINE_BYTES)
        self._line_done = False
        self._tail = b""  # the last bytes fed, so a blank line split across chunks is found

    def feed(self, data: bytes) -> str:
        if self.complete or not data:
            return ""
        if not self._line_done:
            if not self._line:
                data = data.lstrip(b"\r\n")  # h11 skips empty lines before a request line
                if not data:
                    return ""
            end = data.find(b"\n")
            self._line += data if end < 0 else data[: end + 1]
            if end >= 0:
                self._line_done = True
                if self._target_size() > MAX_TARGET_BYTES:
                    return "target"
            elif len(self._line) > _MAX_LINE_BYTES:
                return "target"
        window = self._tail + data
        found = _BLANK_LINE.search(window)
        if found is not None:
            self.complete = True
            self.size += found.end() - len(self._tail)
        else:
            self.size += len(data)
            self._tail = window[-2:]
        return "head" if self.size > MAX_HEAD_BYTES else ""

    def _target_size(self) -> int:
        parts = self._line.strip().split(b" ")
        return len(parts[1]) if len(parts) >= 2 else 0


# ---- the protocol ----------------------------------------------------------------------------------


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout, a connection cap and JSON errors.
    ``protocol_class`` makes the subclass with a server's settings."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    max_connections: int = 512

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head = HeadMeter()
        self._waiting_since = self.loop.time()

    @classmethod
    def protocol_class(cls, *, head_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
        return type(
            "GuardedH11Protocol",
            (cls,),
            {"head_timeout_s": head_timeout_s, "max_connections": max_connections},
        )

    # -- the connection cap --

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if len(self.connections) > self.max_connections and not self._close_longest_waiting():
            log.warning("API: %d connections are open (the limit): refusing a new one", len(self.connections))
            transport.write(
                raw_error(
                    503,
                    "too_many_connections",
                    f"Timeshare's API has {self.max_connections} connections open, each with a request "
                    "in progress; try again shortly.",
                )
            )
            transport.close()
            return
        self._arm_head_timer()

    def waiting_for_head(self) -> bool:
        """No request in progress: the connection waits for the next request head."""
        return self.cycle is None or self.cycle.response_complete

    def _close_longest_waiting(self) -> bool:
        """Make room: close the connection that has waited longest without a request."""
        idle = [
            c
            for c in self.connections
            if c is not self
            and isinstance(c, GuardedH11Protocol)
            and c.waiting_for_head()
            and not c.transport.is_closing()
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c._waiting_since)
        log.warning(
            "API: %d connections are open (the limit): closing one that sent no request",
            len(self.connections),
        )
        victim.transport.close()
        return True

    # -- the request-head timeout --

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._waiting_since = self.loop.time()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self.waiting_for_head():
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection ends
            self.transport.write(
                raw_error(
                    408,
                    "request_timeout",
                    f"The request did not arrive within {self.head_timeout_s:g} s; send it again.",
                )
            )
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        metered = self.waiting_for_head() and self.conn.their_state is h11.IDLE
        if metered and not self._head_within_limits(data):
            return
        super().data_received(data)
        if not self.waiting_for_head():
            self._cancel_head_timer()  # a request is in progress: the handlers time its body

    def on_response_complete(self) -> None:
        if self.conn.their_state is not h11.DONE:
            # the request's body was not read (a 408 for a stalled body, a 413): the connection
            # cannot carry another request, so it closes now rather than at the keep-alive timeout
            self.transport.close()
        self._head.reset()
        pipelined = self.conn.trailing_data[0]
        if pipelined and not self.transport.is_closing() and not self._head_within_limits(pipelined):
            return
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next head must come in time too (uvicorn's keep-alive
            # timer stops at the first byte of it)

    # -- the head and target limits --

    def _head_within_limits(self, data: bytes) -> bool:
        """Meter the bytes of a request head; answer and close when one is over a limit."""
        verdict = self._head.feed(data)
        if not verdict:
            return True
        self._cancel_head_timer()
        if verdict == "target":
            answer = raw_error(
                414,
                "uri_too_long",
                f"The request target (path and query) is longer than {MAX_TARGET_BYTES // 1024} KiB; "
                "send a shorter URL (parameters go in the JSON body).",
            )
        else:
            answer = raw_error(
                400,
                "invalid_http",
                f"The request head (request line and headers) is over {MAX_HEAD_BYTES // 1024} KiB; "
                "send fewer or shorter headers.",
            )
        log.warning("API: refused a request head over the %s limit", verdict)
        self.transport.write(answer)
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    # -- malformed HTTP --

    def send_400_response(self, msg: str) -> None:
        self._cancel_head_timer()
        self.transport.write(
            raw_error(
                400,
                "invalid_http",
                "The request is not valid HTTP/1.1 (a malformed request line or header, or a head "
                f"over {MAX_HEAD_BYTES // 1024} KiB); send a well-formed request.",
            )
        )
        self.transport.close()
