"""The one place where the Qt side meets the pool.

Pool callbacks arrive on the pool's event thread; the bridge re-emits them as Qt signals, which Qt
queues to the GUI thread because the bridge lives there. Commands to the pool (pin, sleep, wake,
starting an answer ...) run on one background thread so that a slow worker or a busy pool thread
never freezes the GUI; their errors come back as a ``command_failed`` signal (an answer's as its
stream's ``refused``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Signal, Slot

from ..core.errors import TimeshareError
from ..core.state import USER_SLEEP_LEVEL, EventKind, ModelState, PoolEvent, PoolSnapshot, ReleaseLevel
from .answer_stream import AnswerStream, StreamListener
from .qt_compat import emit

if TYPE_CHECKING:
    from ..core.conversations.chat import ChatTurn
    from ..core.pool.supervisor import Pool

log = logging.getLogger(__name__)


class PoolBridge(QObject):
    #: the newest PoolSnapshot, on the GUI thread
    snapshot_changed = Signal(object)
    #: (title, message) worth a tray message: crashes, restarts, failed loads
    notification = Signal(str, str)
    #: (what, error message) when a command to the pool failed
    command_failed = Signal(str, str)

    # private hop from the pool thread to the GUI thread
    _received = Signal(object)

    def __init__(self, pool: Pool, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.pool = pool
        self._received.connect(self._on_event)
        self._commands = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-commands")
        # model id → (stage, fraction) of its load, from the worker's Loading messages
        self.loading: dict[str, tuple[str, float]] = {}
        self._unsubscribe: Callable[[], None] | None = pool.subscribe(self._from_pool_thread)
        # after subscribe(): a change in between still arrives as an event
        self._snapshot = pool.snapshot()

    @property
    def snapshot(self) -> PoolSnapshot:
        return self._snapshot

    def _from_pool_thread(self, event: PoolEvent) -> None:
        emit(self._received, event)

    @Slot(object)
    def _on_event(self, event: PoolEvent) -> None:
        if self._unsubscribe is None:  # detached: late events are dropped
            return
        self._snapshot = event.snapshot
        stage = event.extra.get("stage")
        if event.kind is EventKind.MESSAGE and event.model and isinstance(stage, str):
            fraction = event.extra.get("fraction")
            self.loading[event.model] = (
                stage,
                float(fraction) if isinstance(fraction, (int, float)) else 0.0,
            )
        loading = (ModelState.STARTING, ModelState.LOADING)
        for model_id in list(self.loading):
            status = event.snapshot.model(model_id)
            if status is None or status.state not in loading:
                del self.loading[model_id]  # loaded (or gone): a new load starts from its first stage
        emit(self.snapshot_changed, event.snapshot)
        note = notification_for(event)
        if note is not None:
            emit(self.notification, *note)

    # ---- commands (off the GUI thread) --------------------------------------------------------

    def run_command(self, what: str, fn: Callable[[], object]) -> None:
        def call() -> None:
            try:
                fn()
            except TimeshareError as e:
                log.warning("%s failed: %s", what, e)
                emit(self.command_failed, what, str(e))
            except Exception as e:
                log.exception("%s failed", what)
                emit(self.command_failed, what, f"{type(e).__name__}: {e}")

        self._commands.submit(call)

    def start_answer(self, stream: AnswerStream, start: Callable[[StreamListener], ChatTurn]) -> None:
        """Start an answer off the GUI thread (``start`` sends to the chat service, which waits
        for the pool): its turn is attached to ``stream`` (``stream.started``), or ``stream.refused``
        says why it could not start. The turn's own thread then feeds the stream."""

        def call() -> None:
            try:
                turn = start(StreamListener(stream))
            except Exception as e:
                if not isinstance(e, (TimeshareError, ValueError)):
                    log.exception("starting an answer failed")
                emit(stream.refused, e)
                return
            stream.attach(turn)

        self._commands.submit(call)

    def pin(self, model_id: str, pinned: bool) -> None:
        self.run_command(
            f"{'pin' if pinned else 'unpin'} {model_id}", lambda: self.pool.pin(model_id, pinned)
        )

    def sleep(self, model_id: str, level: ReleaseLevel = USER_SLEEP_LEVEL) -> None:
        self.run_command(f"sleep {model_id}", lambda: self.pool.sleep(model_id, level=level))

    def wake(self, model_id: str) -> None:
        self.run_command(f"wake {model_id}", lambda: self.pool.wake(model_id))

    def restart(self, model_id: str) -> None:
        self.run_command(f"restart {model_id}", lambda: self.pool.start_model(model_id))

    def detach(self) -> None:
        """Stop listening to the pool (before the pool stops or the bridge goes away)."""
        if self._unsubscribe is not None:
            unsubscribe, self._unsubscribe = self._unsubscribe, None
            try:
                unsubscribe()
            except Exception:
                log.exception("unsubscribing from the pool failed")
        self._commands.shutdown(wait=True, cancel_futures=True)


def notification_for(event: PoolEvent) -> tuple[str, str] | None:
    """The tray message for an event, or None when it is not worth interrupting the user."""
    status = event.snapshot.model(event.model) if event.model else None
    name = status.display_name if status else (event.model or "a model")
    if event.kind is EventKind.CRASHED:
        return (f"{name} crashed", event.message or "Its worker process died; Timeshare restarts it.")
    if event.kind is EventKind.RESTARTED:
        return (f"{name} restarted", event.message or "Its worker process was restarted.")
    if event.kind is EventKind.FAILED:
        reason = event.message or (status.reason if status else "") or "see Show log for details"
        return (f"{name} failed", reason)
    return None
