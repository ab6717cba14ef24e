"""Work-arounds for bugs of the installed Qt binding, each detected at run time, never assumed.

PySide6 6.12.0: ``SignalInstance.emit()`` returns ``True`` without taking a reference to it, so
every emit from Python steals one reference to ``True``. After enough emits (one per streamed
token here) CPython aborts with "bool_dealloc: deallocating True or False", at the latest when the
interpreter exits. pyproject excludes that version; if it is installed anyway, ``emit()`` below
keeps one reference per emit to balance the stolen one (a pointer per emit: 8 MB per million).
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal, SignalInstance

log = logging.getLogger(__name__)

# References that balance the ones emit() stole. They must outlive interpreter shutdown (the stolen
# references are never given back), so on an affected binding the list refers to itself and is
# moved to the garbage collector's permanent generation: nothing ever frees it.
_repaid: list[object] = []


class _Probe(QObject):
    fired = Signal()


def _refcount_of_true() -> int:
    return sys.getrefcount(True)


def emit_steals_a_reference(
    fire: Callable[[], object], refcount: Callable[[], int] = _refcount_of_true
) -> bool:
    """Whether ``fire`` (an emit) returns True without owning the reference it hands back.

    ``refcount`` reads True's reference count. Where holding a reference does not show in that
    count (True is immortal from Python 3.12), nothing can be stolen, and the answer is no.
    """
    before = refcount()
    held = [True]
    visible = refcount() > before
    del held
    if not visible:
        return False
    before = refcount()
    result = fire()
    steals = result is True and refcount() < before + 1
    if steals:
        _repaid.append(result)  # the probe's own emit stole one too
    del result
    return steals


_probe = _Probe()
EMIT_STEALS_TRUE = emit_steals_a_reference(_probe.fired.emit)
del _probe
if EMIT_STEALS_TRUE:
    _repaid.append(_repaid)
    gc.freeze()
    log.warning(
        "PySide6 %s steals a reference on every signal emit (a bug of that version): Timeshare compensates; "
        "installing another PySide6 version avoids it",
        __import__("PySide6").__version__,
    )


def emit(signal: SignalInstance, *args: object) -> None:
    """``signal.emit(*args)``, safe on bindings whose emit steals a reference to its result
    (``EMIT_STEALS_TRUE``, probed once at import)."""
    send: Callable[..., object] = signal.emit  # typed as returning None; the binding returns a bool
    result = send(*args)
    if EMIT_STEALS_TRUE and isinstance(result, bool):
        _repaid.append(result)
