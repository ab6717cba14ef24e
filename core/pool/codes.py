"""A worker's ``Error`` code as the typed error a caller catches (the classes of core/errors.py)."""

from __future__ import annotations

from .. import errors
from ..errors import ConfigError, TimeshareError


def error_for(code: str, message: str) -> TimeshareError:
    """The typed error (core/errors.py) for a worker's ``Error`` code; unknown codes: the base class."""
    if code == ConfigError.code:
        return ConfigError([message])
    for value in vars(errors).values():
        if (
            isinstance(value, type)
            and issubclass(value, TimeshareError)
            and value.__module__ == errors.__name__
            and value.code == code
            and value is not ConfigError
        ):
            return value(message)
    err = TimeshareError(message)
    err.code = code
    return err
