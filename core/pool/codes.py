"""A worker's ``Error`` code as the typed error a caller catches (the classes of core/errors.py)."""

from __future__ import annotations

from .. import errors
from ..errors import ConfigError, TimeshareError


def _by_code() -> dict[str, type[TimeshareError]]:
    """Each code to the class that defines it (a subclass that only inherits its code, such as
    UnsafeArenaError, is not the one chosen)."""
    table: dict[str, type[TimeshareError]] = {}
    for value in vars(errors).values():
        if (
            isinstance(value, type)
            and issubclass(value, TimeshareError)
            and value is not TimeshareError
            and "code" in vars(value)
        ):
            table.setdefault(value.code, value)
    return table


ERRORS_BY_CODE: dict[str, type[TimeshareError]] = _by_code()


def error_for(code: str, message: str) -> TimeshareError:
    """The typed error for a worker's ``Error`` code; an unknown code: the base class, with the code."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is ConfigError:
        return ConfigError([message])
    if cls is not None:
        return cls(message)
    err = TimeshareError(message)
    err.code = code
    return err
