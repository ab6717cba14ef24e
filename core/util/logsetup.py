"""Logging set-up for every Timeshare process: the tray app, ``timeshare serve`` and the workers."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

#: ``<time> <LEVEL> <logger>: <message>``; a worker adds ``[<model id>]`` after the level.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: ``timeshare serve`` on a terminal: no logger names (``INFO uvicorn.error:`` says nothing to
#: people); ``--verbose`` shows them (:data:`LOG_FORMAT`)
PLAIN_FORMAT = "%(asctime)s %(levelname)s: %(message)s"
#: what the tray app shows on its console next to its log file
CONSOLE_FORMAT = "timeshare: %(levelname)s %(name)s: %(message)s"
LOG_FILE_MAX_BYTES = 2_000_000
LOG_FILE_BACKUPS = 3

_MARK = "_timeshare_logsetup"


def setup_logging(verbose: bool, *, tag: str | None = None, log_file: Path | None = None) -> None:
    """Configure the root logger: DEBUG when ``verbose``, else INFO.

    Without ``log_file`` every record goes to stderr: in :data:`PLAIN_FORMAT` (``timeshare serve``;
    :data:`LOG_FORMAT`, with the logger's name, when ``verbose``), or, for a worker (whose stderr is
    its log file, and which passes its model id as ``tag``), in :data:`LOG_FORMAT`. With ``log_file`` (the
    tray app) records go to that file, rotated, and stderr shows only warnings (everything when
    ``verbose``) in :data:`CONSOLE_FORMAT`. A later call replaces what an earlier one installed.
    """
    level = logging.DEBUG if verbose else logging.INFO
    line = LOG_FORMAT if tag is None else LOG_FORMAT.replace("%(name)s", f"[{tag}] %(name)s", 1)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
        old.close()
    handlers: list[logging.Handler] = []
    if log_file is None:
        plain = tag is None and not verbose
        handlers.append(_handler(logging.StreamHandler(sys.stderr), PLAIN_FORMAT if plain else line))
    else:
        handlers.append(
            _handler(
                logging.handlers.RotatingFileHandler(
                    log_file, maxBytes=LOG_FILE_MAX_BYTES, backupCount=LOG_FILE_BACKUPS, encoding="utf-8"
                ),
                line,
            )
        )
        console = _handler(logging.StreamHandler(sys.stderr), CONSOLE_FORMAT)
        console.setLevel(level if verbose else logging.WARNING)
        handlers.append(console)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def _handler(handler: logging.Handler, fmt: str) -> logging.Handler:
    handler.setFormatter(logging.Formatter(fmt))
    setattr(handler, _MARK, True)
    return handler
