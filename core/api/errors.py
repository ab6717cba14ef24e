"""API errors: the JSON body of each dialect (OpenAI's by default; the Anthropic and Ollama routes
answer in their own shapes, chosen by the request path) and the HTTP status of each Timeshare
error."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from ..errors import (
    ChatTemplateError,
    InvalidGrammarError,
    InvalidInputError,
    InvalidSamplingError,
    ModelUnavailableError,
    PromptTooLongError,
    QueueFullError,
    TimeshareError,
    TokenTimeoutError,
    UnknownModelError,
    VramBudgetError,
)

# ---- errors ------------------------------------------------------------------------------------


class BadRequestError(Exception):
    """A request the API refuses before it reaches the pool (HTTP 400 unless ``status`` says)."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "invalid_request", status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class ClientGoneError(Exception):
    """The client disconnected while its request waited; its generation was cancelled."""


_STATUS_BY_CODE = {
    UnknownModelError.code: 404,
    PromptTooLongError.code: 400,
    InvalidGrammarError.code: 400,
    InvalidSamplingError.code: 400,
    InvalidInputError.code: 400,
    ChatTemplateError.code: 400,
    QueueFullError.code: 429,
    ModelUnavailableError.code: 503,
    TokenTimeoutError.code: 503,
    VramBudgetError.code: 503,
}
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status: every 4xx is a client's error, 5xx the server's."""
    return _TYPE_BY_STATUS.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


def error_body(message: str, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code,
        }
    }


#: Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def dialect_of(path: str) -> str:
    """Which dialect's error shape a request path gets: "anthropic" (/v1/messages...), "ollama"
    (/api/..., and / where Ollama clients probe), else "openai"."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path == "/" or path == "/api" or path.startswith("/api/"):
        return "ollama"
    return "openai"


def dialect_body(
    dialect: str, message: str, status: int, code: str | None, param: str | None = None
) -> dict[str, Any]:
    """The error body in ``dialect``'s shape: Anthropic's ``{"type": "error", "error": {"type",
    "message"}}``, Ollama's ``{"error": message}``, else OpenAI's (``error_body``)."""
    if dialect == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if dialect == "ollama":
        return {"error": message}
    return error_body(message, status, code, param)


def error_response(
    message: str, status: int, code: str | None, param: str | None = None, *, path: str = ""
) -> JSONResponse:
    """The error answer; ``path`` (the request's) picks the dialect's shape (``dialect_of``)."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = dialect_body(dialect_of(path), message, status, code, param)
    return JSONResponse(body, status_code=status, headers=headers)


def timeshare_error_status(exc: TimeshareError) -> int:
    return _STATUS_BY_CODE.get(exc.code, 500)


def timeshare_error_response(
    exc: TimeshareError, param: str | None = None, *, path: str = ""
) -> JSONResponse:
    if param is None and isinstance(exc, UnknownModelError):
        param = "model"
    if param is None and isinstance(exc, InvalidInputError):
        param = "input"
    return error_response(str(exc), timeshare_error_status(exc), exc.code, param, path=path)
