"""The tray application: wires the pool, the bridge, the tray, the chat window, settings and the API.

``run(args)`` is what ``timeshare`` (``timeshare tray``) runs. ``TimeshareApp`` holds the pieces
and can be built around any started pool, so the tests drive it with real workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox, QSystemTrayIcon, QWidget

from ..core import paths
from ..core.config import files as config_files
from ..core.config.schema import ApiConfig, Config
from ..core.config.watch import ConfigWatcher
from ..core.errors import ConfigError, InstanceRunningError, TimeshareError
from ..core.gguf.modelfile import gguf_problem
from ..core.instance import InstanceLock
from ..core.state import USER_SLEEP_LEVEL
from ..core.util.atomic import atomic_write_text
from ..core.util.logsetup import setup_logging
from . import autostart, icons, restart_plan, strings
from .bridge import PoolBridge
from .chat_window import ChatWindow
from .menu_model import Action, Command
from .qt_compat import emit
from .settings import SettingsDialog
from .settings_form import problems_text
from .single_instance import SingleInstance
from .tray import Tray

if TYPE_CHECKING:
    from ..core.conversations.chat import ChatService
    from ..core.conversations.store import Store
    from ..core.pool.supervisor import Pool
    from .get_model import GetModelDialog

log = logging.getLogger(__name__)

TRAY_WAIT_S = 10  # at login the desktop's tray may appear a few seconds after Timeshare starts
FIRST_PAINT_WAIT_MS = 3000  # work deferred until the window painted waits at most this long
LOG_FILE = "timeshare.log"


def log_file() -> Path:
    return paths.log_dir() / LOG_FILE


def _ui_state_file() -> Path:
    return paths.data_dir() / "ui-state.json"


def load_ui_state() -> dict[str, object]:
    try:
        data = json.loads(_ui_state_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_ui_state(state: dict[str, object]) -> None:
    atomic_write_text(_ui_state_file(), json.dumps(state), backup=False, mode=0o644)


class ApiServerLike(Protocol):
    """What the app needs of ``core.api.server.ApiServer`` (imported only when the API starts)."""

    def start(self) -> str: ...
    def stop(self) -> None: ...


ApiServerFactory = Callable[["Pool", ApiConfig], ApiServerLike]


class TimeshareApp(QObject):
    """Everything the user sees, around one started pool. ``shutdown()`` stops what it started."""

    quit_requested = Signal()
    # POST /timeshare/v1/reload (on the API's thread) hands the re-read config to the GUI thread
    _config_reloaded = Signal(object)
    # the config file was edited by hand into something invalid (from the watcher's thread)
    _config_invalid = Signal(str)

    def __init__(
        self,
        config: Config,
        pool: Pool,
        store: Store,
        chat: ChatService,
        *,
        config_path: Path | None = None,
        tray_available: bool | None = None,
        api_server_factory: ApiServerFactory | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.config_path = config_path
        self.pool = pool
        self.store = store
        self.chat = chat
        self.bridge = PoolBridge(pool, self)
        self.tray_available = (
            QSystemTrayIcon.isSystemTrayAvailable() if tray_available is None else tray_available
        )
        self.tray: Tray | None = None
        self.window = ChatWindow(
            self.bridge, store, chat, prewake_enabled=lambda: self.config.general.prewake_on_typing
        )
        self.window.closed.connect(self._on_window_closed)
        self.window.action_requested.connect(self.handle)
        self.settings_dialog: SettingsDialog | None = None
        self._api_factory = api_server_factory
        self.get_model_dialog: GetModelDialog | None = None
        self._config_reloaded.connect(self.apply_config)
        self._config_invalid.connect(self._on_config_invalid)
        self.config_watcher: ConfigWatcher | None = None
        self.api: ApiServerLike | None = None
        self._tray_wait_left = TRAY_WAIT_S
        self._shut_down = False
        #: what the last save of the settings said (which models restart and why)
        self.last_saved_message = ""
        self._quitting = False
        #: "Keep Timeshare running?" while it waits for an answer (closing the window without a tray)
        self.keep_running_box: QMessageBox | None = None

    # ---- start -------------------------------------------------------------------------------

    def start(self, background: bool = False) -> None:
        if self.tray_available:
            self._show_tray()
            if not background:
                self.window.show_and_raise()
        elif background:
            # autostart: give the desktop's tray a few seconds to appear before falling back
            self._wait_for_tray()
        else:
            log.info("no system tray: opening the chat window instead")
            self.window.show_and_raise()
        if self.window.isVisible() and self.config.api.enabled:
            # the API's first start imports its server (a second or more): after the window has
            # painted, so nobody looks at an empty window meanwhile
            _after_first_paint(self.window, self.start_api)
        else:
            self.start_api()
        if self.config.notice:
            self.notify("Timeshare", self.config.notice)
        # a config file edited by hand is applied as `timeshare reload` would
        self.config_watcher = ConfigWatcher(
            self.config_path or paths.config_file(),
            self._reload_from_api,
            lambda exc: emit(self._config_invalid, str(exc)),
        ).start()

    def _on_config_invalid(self, problem: str) -> None:
        self.notify(strings.CONFIG_INVALID_TITLE, strings.config_invalid(problem), error=True)

    def _show_tray(self) -> None:
        if self.tray is None:
            self.tray = Tray(self.bridge, lambda: self.config.general.start_at_login, self)
            self.tray.action_triggered.connect(self.handle)
            self.tray.clicked.connect(self.window.show_and_raise)
        self.tray.show()

    def _wait_for_tray(self) -> None:
        if QSystemTrayIcon.isSystemTrayAvailable():
            self.tray_available = True
            self._show_tray()
        elif self._tray_wait_left > 0:
            self._tray_wait_left -= 1
            QTimer.singleShot(1000, self._wait_for_tray)
        else:
            log.info("no system tray after %d s: opening the chat window", TRAY_WAIT_S)
            self.window.show_and_raise()

    def start_api(self) -> None:
        if not self.config.api.enabled or self._shut_down or self.api is not None:
            return
        factory = self._api_factory
        if factory is None:
            from ..core.api.server import ApiServer

            factory = functools.partial(ApiServer, reload=self._reload_from_api)
        try:
            server = factory(self.pool, self.config.api)
            url = server.start()
        except TimeshareError as e:
            log.warning("API not started: %s", e)
            self.notify("The API did not start", str(e), error=True)
            return
        except OSError as e:
            log.warning("API not started: %s", e)
            self.notify("The API did not start", f"{e}: change the port in Settings → API", error=True)
            return
        self.api = server
        log.info("API at %s (OpenAI, Anthropic and Ollama dialects)", url)
        refused = getattr(server, "ollama_refused", "")  # api.ollama_listen's port was taken
        if refused:
            self.notify("The Ollama listener is off", refused, error=True)

    def stop_api(self) -> None:
        if self.api is not None:
            server, self.api = self.api, None
            try:
                server.stop()
            except Exception:
                log.exception("stopping the API failed")

    # ---- actions -----------------------------------------------------------------------------

    def handle(self, action: Action) -> None:
        model = action.model or ""
        if action.command is Command.PIN:
            self.bridge.pin(model, True)
        elif action.command is Command.UNPIN:
            self.bridge.pin(model, False)
        elif action.command is Command.SLEEP:
            self.bridge.sleep(model, USER_SLEEP_LEVEL)
        elif action.command is Command.WAKE:
            self.bridge.wake(model)
        elif action.command is Command.RESTART:
            self.bridge.restart(model)
        elif action.command is Command.LOCATE_FILE:
            self.locate_model_file(model)
        elif action.command is Command.REMOVE_MODEL:
            self.remove_model(model)
        elif action.command is Command.CHAT:
            self.window.open_for_model(model)
        elif action.command is Command.OPEN_CHAT:
            self.window.show_and_raise()
        elif action.command is Command.ADD_MODEL:
            dialog = self.open_settings()
            dialog.tabs.setCurrentIndex(0)
            QTimer.singleShot(0, dialog.add_from_catalog)
        elif action.command is Command.GET_MODEL:
            self.open_get_model()
        elif action.command is Command.SETTINGS:
            self.open_settings()
        elif action.command is Command.START_AT_LOGIN:
            self.set_start_at_login(not self.config.general.start_at_login)
        elif action.command is Command.SHOW_LOG:
            self.show_log()
        elif action.command is Command.QUIT:
            self.quit()

    def open_settings(self) -> SettingsDialog:
        if self.settings_dialog is None or not self.settings_dialog.isVisible():
            if self.settings_dialog is not None:
                # a closed dialog is only hidden: delete it, or it stays alive and keeps
                # refreshing on every pool event
                self.settings_dialog.deleteLater()
            self.settings_dialog = SettingsDialog(self.config, self.bridge, self.config_path)
            self.settings_dialog.saved.connect(self.apply_config)
        self.settings_dialog.show()
        if QGuiApplication.platformName() not in ("offscreen", "minimal"):  # no window manager there
            self.settings_dialog.raise_()
            self.settings_dialog.activateWindow()
        return self.settings_dialog

    def open_get_model(self, source: str = "") -> GetModelDialog:
        """The "Get model…" dialog; a model it gets is added to the config file and applied."""
        from .get_model import GetModelDialog

        dialog = self.get_model_dialog
        if dialog is None or not dialog.isVisible():
            if dialog is not None:
                dialog.deleteLater()
            dialog = GetModelDialog(lambda: self.bridge.snapshot, self.config_path, source=source)
            dialog.config_saved.connect(self.apply_config)
            self.get_model_dialog = dialog
        dialog.show()
        if QGuiApplication.platformName() not in ("offscreen", "minimal"):  # no window manager there
            dialog.raise_()
            dialog.activateWindow()
        return dialog

    def _reload_from_api(self) -> tuple[Path, Config]:
        """``POST /timeshare/v1/reload``, on the API's thread: re-read the config file; the GUI
        thread adopts it (pool, start at login, API) as it does settings saved in Settings."""
        path = self.config_path or paths.config_file()
        config = config_files.load_config(path, check_paths=False)
        emit(self._config_reloaded, config)
        return path, config

    def apply_config(self, new: Config) -> None:
        """Adopt settings that were saved: pool, start at login, API."""
        old, self.config = self.config, new
        dialog = self.settings_dialog
        if dialog is not None and dialog.isVisible():
            dialog.adopt_saved_elsewhere(old, new)  # or saving the open draft drops these models
        if new.models != old.models or new.arena != old.arena:
            self.bridge.run_command("apply the new settings", lambda: self.pool.apply_config(new))
        if new != old:  # which models restart, and why (or that nothing does)
            self.last_saved_message = restart_plan.saved_message(old, new)
            self.notify(strings.SETTINGS_SAVED, self.last_saved_message)
        if new.general.start_at_login != autostart.is_enabled():
            self._write_autostart(new.general.start_at_login)
        if new.api != old.api:
            self.stop_api()
            self.start_api()

    def locate_model_file(self, model_id: str) -> None:
        """A model whose file is missing or unusable: pick the file, then save and apply (the
        model starts again with it)."""
        model = self.config.model(model_id)
        if model is None:
            return
        old = Path(model.path).expanduser() if model.path else Path.home()
        start = old.parent if old.parent.is_dir() else Path.home()
        chosen, _ = QFileDialog.getOpenFileName(
            None,
            f"Locate the model file of {model.display_name}",
            str(start),
            "GGUF models (*.gguf);;All files (*)",
        )
        if not chosen:
            return
        problem = gguf_problem(chosen)
        if problem:
            self.notify(f"{model.display_name}: not a usable model file", problem, error=True)
            return
        located = dataclasses.replace(model, path=chosen, demo="")  # the file chosen, not the demo

        def locate(current: Config) -> Config:
            models = tuple(located if m.id == model_id else m for m in current.models)
            return dataclasses.replace(current, models=models)

        self._save_and_apply(locate)

    def remove_model(self, model_id: str) -> None:
        """Remove a model from the configuration (its file stays), after asking."""
        model = self.config.model(model_id)
        if model is None:
            return
        answer = QMessageBox.question(
            None,
            "Remove model",
            f"Remove {model.display_name} from Timeshare? Its file is not deleted; you can add it "
            "again in Settings.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )
        if answer != QMessageBox.StandardButton.Yes:
            return
        self._save_and_apply(
            lambda current: dataclasses.replace(
                current, models=tuple(m for m in current.models if m.id != model_id)
            )
        )

    def _save_and_apply(self, change: Callable[[Config], Config]) -> None:
        """``change`` the config file as it is now (the one writer, ``files.update_config``: a
        model the API pulled meanwhile stays), then adopt what was saved."""
        try:
            new = config_files.update_config(change, self.config_path)
        except (ConfigError, OSError) as e:
            self.notify("Could not save the configuration", str(e), error=True)
            return
        self.apply_config(new)

    def set_start_at_login(self, enabled: bool) -> None:
        def start_at_login(current: Config) -> Config:
            return dataclasses.replace(
                current, general=dataclasses.replace(current.general, start_at_login=enabled)
            )

        try:
            new = config_files.update_config(start_at_login, self.config_path)
        except (ConfigError, OSError) as e:
            self.notify("Could not save the setting", str(e), error=True)
            return
        self.config = new
        self._write_autostart(enabled)

    def _write_autostart(self, enabled: bool) -> None:
        try:
            plan = autostart.set_enabled(enabled, config=self.config_path)
            log.info("start at login %s (%s)", "on" if enabled else "off", autostart.describe(plan))
        except OSError as e:
            self.notify("Could not change start at login", str(e), error=True)

    def show_log(self) -> None:
        target = log_file()
        target.touch(exist_ok=True)
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(target))):
            self.notify("Log file", str(target))

    def notify(self, title: str, message: str, error: bool = False) -> None:
        if self.tray is not None:
            self.tray.notify(title, message, error=error)
        else:
            self.window.statusBar().showMessage(f"{title}: {message}", 20000)

    # ---- closing -----------------------------------------------------------------------------

    def _on_window_closed(self) -> None:
        # quitting closes every window too: that close is not a question to the user
        if self.tray is not None or self._shut_down or self._quitting:
            return  # the tray keeps Timeshare reachable
        keep = load_ui_state().get("keep_running_without_tray")
        if keep is None:
            self._ask_keep_running()
        elif not keep:
            self.quit()

    def _ask_keep_running(self) -> None:
        """Ask once whether to keep running without a window; the question is not modal (the
        event loop goes on: the models and the API keep serving, and a test can answer it through
        ``keep_running_box``). The answer is remembered; closing the question keeps running."""
        if self.keep_running_box is not None:
            self.keep_running_box.show()
            return
        box = QMessageBox(
            QMessageBox.Icon.Question,
            strings.KEEP_RUNNING_TITLE,
            strings.KEEP_RUNNING,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
        )
        box.setDefaultButton(QMessageBox.StandardButton.Yes)
        box.setWindowModality(Qt.WindowModality.NonModal)
        box.buttonClicked.connect(lambda button: self._keep_running_answered(box.standardButton(button)))
        self.keep_running_box = box
        box.show()

    def _keep_running_answered(self, answer: QMessageBox.StandardButton) -> None:
        self.keep_running_box = None
        keep = answer != QMessageBox.StandardButton.No
        state = load_ui_state()
        state["keep_running_without_tray"] = keep
        save_ui_state(state)
        if not keep:
            self.quit()

    def quit(self) -> None:
        self._quitting = True
        emit(self.quit_requested)
        app = QApplication.instance()
        if app is not None:
            app.quit()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the API, detach from the pool and stop every worker (no orphans)."""
        if self._shut_down:
            return
        self._shut_down = True
        log.info("shutting down")
        if self.config_watcher is not None:
            self.config_watcher.stop()
        self.stop_api()
        self.window.detach()
        self.bridge.detach()
        if self.tray is not None:
            self.tray.hide()
        self.window.hide()
        try:
            self.pool.stop(timeout=timeout)
        except Exception:
            log.exception("stopping the pool failed")


class _FirstPaint(QObject):
    """Calls ``then`` once, on the event loop's next turn after ``widget`` first painted (or
    after ``FIRST_PAINT_WAIT_MS`` if it never does, on a platform that paints nothing)."""

    def __init__(self, widget: QWidget, then: Callable[[], None]) -> None:
        super().__init__(widget)
        self._widget = widget
        self._then: Callable[[], None] | None = then
        widget.installEventFilter(self)
        QTimer.singleShot(FIRST_PAINT_WAIT_MS, self._fire)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() is QEvent.Type.Paint and self._then is not None:
            QTimer.singleShot(0, self._fire)  # the painted window reaches the screen first
        return False

    def _fire(self) -> None:
        then, self._then = self._then, None
        if then is not None:
            self._widget.removeEventFilter(self)
            then()


def _after_first_paint(widget: QWidget, then: Callable[[], None]) -> None:
    _FirstPaint(widget, then)


def fatal_box(title: str, text: str, details: str = "") -> QMessageBox:
    """A dialog that says what went wrong in a sentence; paths, pids and the program's own words
    go under Show Details."""
    box = QMessageBox(QMessageBox.Icon.Critical, title, text)
    if details:
        box.setDetailedText(details)
    return box


def _fatal(title: str, text: str, details: str = "") -> int:
    print(f"timeshare: {text}" + (f"\n{details}" if details else ""), file=sys.stderr)
    if QGuiApplication.platformName() not in ("offscreen", "minimal"):  # nobody could close it there
        fatal_box(title, text, details).exec()
    return 2


def run(args: argparse.Namespace) -> int:
    setup_logging(bool(getattr(args, "verbose", False)), log_file=log_file())
    qapp = QApplication.instance() or QApplication(sys.argv[:1])
    assert isinstance(qapp, QApplication)
    qapp.setApplicationName("Timeshare")
    qapp.setDesktopFileName(autostart.APP_ID)
    qapp.setWindowIcon(icons.app_icon())
    qapp.setQuitOnLastWindowClosed(False)

    single = SingleInstance()
    if not single.claim("show"):
        print("Timeshare is already running: asked it to open its chat window.")
        return 0
    try:  # one Timeshare per runtime dir, the tray or `timeshare serve` (core/instance.py)
        instance = InstanceLock.acquire("tray")
    except InstanceRunningError as e:
        single.close()
        return _fatal("Timeshare is already running", strings.ALREADY_RUNNING, str(e))

    config_path = config_files.cli_config_path(getattr(args, "config", None))
    try:
        # model files are not checked here: a missing or broken one shows as failed in the tray
        # (with Locate file… and Remove) while the others serve
        config = config_files.load_for_cli(getattr(args, "config", None), check_paths=False)
    except ConfigError as e:
        return _fatal(
            "Timeshare: configuration error",
            strings.SETTINGS_FILE_BROKEN,
            f"{config_path} has problems:\n{problems_text(e.problems)}",
        )

    from ..core.conversations.chat import ChatService
    from ..core.conversations.store import Store
    from ..core.pool.supervisor import Pool

    try:
        store = Store()
    except TimeshareError as e:
        return _fatal("Timeshare: conversations", strings.CONVERSATIONS_UNREADABLE, str(e))
    pool = Pool(config)
    try:
        pool.start(conversation_gone=store.gone)  # KV files of deleted conversations go
    except TimeshareError as e:
        store.close()
        return _fatal("Timeshare could not start", strings.plain_reason(str(e)), str(e))
    app = TimeshareApp(config, pool, store, ChatService(pool, store), config_path=config_path)
    single.message_received.connect(lambda _msg: app.window.show_and_raise())

    # SIGTERM (logout, `kill`) and Ctrl+C quit through Qt, so the workers are stopped cleanly
    previous = {s: signal.signal(s, lambda *_: app.quit()) for s in (signal.SIGINT, signal.SIGTERM)}
    wakeup = QTimer()
    wakeup.start(200)  # lets the Python signal handlers run while Qt's loop waits
    wakeup.timeout.connect(lambda: None)
    try:
        app.start(background=bool(getattr(args, "background", False)))
        rc = qapp.exec()
    finally:
        wakeup.stop()
        app.shutdown()
        single.close()
        store.close()
        instance.release()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("Timeshare exited (%d)", rc)
    return rc
