"""One Timeshare per user: the first instance listens on a QLocalServer; a second launch sends it
"show" (open the chat window) and exits."""

from __future__ import annotations

import getpass
import hashlib
import logging

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from ..core import paths
from .qt_compat import emit

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_MS = 500


def server_name() -> str:
    """Per user and per TIMESHARE_HOME, so tests and portable installs do not see each other."""
    where = hashlib.sha1(str(paths.runtime_dir()).encode()).hexdigest()[:10]
    return f"timeshare-{getpass.getuser()}-{where}"


class SingleInstance(QObject):
    """``claim()`` is True for the first instance; later ones deliver their message and get False."""

    message_received = Signal(str)

    def __init__(self, name: str | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name or server_name()
        self._server: QLocalServer | None = None

    def claim(self, message: str = "show") -> bool:
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if socket.waitForConnected(CONNECT_TIMEOUT_MS):
            socket.write((message + "\n").encode())
            socket.waitForBytesWritten(CONNECT_TIMEOUT_MS)
            socket.disconnectFromServer()
            log.info("another Timeshare is running (%s): sent %r", self.name, message)
            return False
        # nobody answered: a socket file left by a crashed instance would make listen() fail
        QLocalServer.removeServer(self.name)
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.name):
            log.warning("single-instance server %s: %s", self.name, server.errorString())
            return True  # run anyway; a second launch will then start a second instance
        server.newConnection.connect(self._on_connection)
        self._server = server
        return True

    def _on_connection(self) -> None:
        assert self._server is not None
        while self._server.hasPendingConnections():
            socket = self._server.nextPendingConnection()
            # a short message: wait for it here instead of keeping per-socket slots alive
            if socket.bytesAvailable() or socket.waitForReadyRead(CONNECT_TIMEOUT_MS):
                while socket.bytesAvailable() and not socket.canReadLine():
                    if not socket.waitForReadyRead(CONNECT_TIMEOUT_MS):
                        break
                self._read(socket)
            socket.abort()

    def _read(self, socket: QLocalSocket) -> None:
        while socket.canReadLine():
            line = bytes(socket.readLine().data()).decode(errors="replace").strip()
            if line:
                emit(self.message_received, line)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
