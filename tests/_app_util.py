"""The real tray app over a test's pool (tests/test_app_*.py): one way to start and close it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def running_app(qtbot: Any, pool: Any, tmp_path: Path, max_tokens: int | None = None) -> Iterator[Any]:
    """A started TimeshareApp on ``pool`` with its conversations in tmp_path (``max_tokens``: the
    chat window's answer limit, None: its default); detached, hidden and its store closed after."""
    from timeshare.app.application import TimeshareApp
    from timeshare.core.conversations.chat import ChatService
    from timeshare.core.conversations.store import Store

    store = Store(tmp_path / "conversations.sqlite3")
    ta = TimeshareApp(
        pool.config,
        pool,
        store,
        ChatService(pool, store),
        config_path=tmp_path / "config.toml",
        tray_available=True,  # without a tray, closing the window would ask (a modal dialog)
    )
    ta.start(background=False)
    qtbot.addWidget(ta.window)
    if max_tokens is not None:
        ta.window.max_tokens = max_tokens
    try:
        yield ta
    finally:
        ta.window.detach()
        ta.bridge.detach()
        ta.window.hide()
        if ta.tray is not None:
            ta.tray.hide()
        store.close()
