"""The command line a person meets first: `timeshare --help` lists the everyday verbs before the
diagnostics, and `timeshare serve` logs without library names unless asked (--verbose)."""

from __future__ import annotations

import io
import logging
import re
import sys
import uuid

import pytest
from timeshare.core.util.logsetup import setup_logging

from timeshare.cli import build_parser


def test_help_lists_the_everyday_verbs_before_the_diagnostics() -> None:
    text = build_parser().format_help()
    listed = re.findall(r"^    ([a-z-]+)", text, flags=re.MULTILINE)
    for everyday in ("chat", "run", "status", "pull", "serve"):
        for tool in ("doctor", "bench", "arena-test"):
            assert listed.index(everyday) < listed.index(tool), listed
    assert listed[:3] == ["tray", "chat", "run"]


@pytest.mark.parametrize(("verbose", "named"), [(False, False), (True, True)])
def test_serve_logs_without_library_names_unless_verbose(
    verbose: bool, named: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    token = uuid.uuid4().hex
    root = logging.getLogger()
    level = root.level
    try:
        setup_logging(verbose)  # as `timeshare serve` does
        # a message of its own: serve's rate limit on uvicorn.error (connections.install_log_limits)
        # drops a template logged within its interval, and an earlier in-process serve logs this one
        logging.getLogger("uvicorn.error").info(f"Application startup complete ({token}).")
    finally:
        setup_logging(False, log_file=None)  # the handler on the real stderr again
        for h in [h for h in root.handlers if getattr(h, "_timeshare_logsetup", False)]:
            root.removeHandler(h)
        root.setLevel(level)
    line = err.getvalue()
    assert f"Application startup complete ({token})." in line
    assert ("uvicorn.error" in line) is named, line
