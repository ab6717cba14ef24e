"""API errors: OpenAI-shaped JSON bodies and the HTTP status of each Timeshare error."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from ..errors import (
    ChatTemplateError,
    InvalidGrammarError,
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


def error_body(message: str, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPE_BY_STATUS.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(message: str, status: int, code: str | None, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(message, status, code, param), status_code=status, headers=headers)


def timeshare_error_status(exc: TimeshareError) -> int:
    return _STATUS_BY_CODE.get(exc.code, 500)


def timeshare_error_response(exc: TimeshareError, param: str | None = None) -> JSONResponse:
    if param is None and isinstance(exc, UnknownModelError):
        param = "model"
    return error_response(str(exc), timeshare_error_status(exc), exc.code, param)
