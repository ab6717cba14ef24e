"""An eval callback installed on a live llama_context for one decode (the upload gate of an
overlapped restore, issue 28), and the probe that finds where it goes.

llama.cpp takes a context's eval callback only at creation (``llama_context_params.cb_eval``,
copied into the context's ``cparams``; llama.h has no setter). The scheduler gets it from there
whenever the context builds a graph (``process_ubatch``:
``ggml_backend_sched_set_eval_callback(sched, cparams.cb_eval, ...)``), keeps whatever it has
while a graph of the same shape is reused, and a reserve makes a new scheduler (which the next
build then hands ``cparams``' callback). So :func:`install` writes the callback into both and
:func:`clear` clears both:

- ``cparams``: the exported C++ accessor ``llama_context::get_cparams()`` gives its address; the
  offset of ``cb_eval`` inside it is found by :func:`find_layout` on a context made with a known
  callback and user-data pointer (the adjacent pair must be found exactly once);
- the scheduler: ``llama_context::get_sched()``, set through the public
  ``ggml_backend_sched_set_eval_callback``.

:func:`verify` checks on that throwaway context that an installed hook is called on a reused
graph, on a rebuilt one and after a reserve, and that nothing is called after :func:`clear`.
Without a callback ggml computes each split in one call (no per-node cost at all), which is why
the hook is installed only for the first decode after an overlapped restore.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp

from . import _ggml

#: bytes of llama_cparams scanned for the (cb_eval, cb_eval_user_data) pair
_SCAN_BYTES = 512


class HookUnavailableError(Exception):
    """The eval hook cannot be used with this build (the message says why)."""


@dataclass(frozen=True)
class HookLayout:
    """Offset of ``cb_eval`` in ``struct llama_cparams`` (``cb_eval_user_data`` follows it)."""

    cb_eval: int


def missing_symbols() -> str:
    """Why the hook cannot work with these libraries ("" when it can)."""
    names = {
        "llama_context::get_cparams": _ggml.ctx_get_cparams,
        "llama_context::get_sched": _ggml.ctx_get_sched,
        "llama_context::sched_reserve": _ggml.ctx_sched_reserve,
    }
    missing = [k for k, v in names.items() if v is None]
    return f"libllama does not export {', '.join(missing)}" if missing else ""


def find_layout(ctx: int, cb: int, user: int) -> HookLayout:
    """Find ``cb_eval`` in the cparams of ``ctx``, a context created with ``cb_eval = cb`` and
    ``cb_eval_user_data = user`` (both distinct non-null pointers)."""
    reason = missing_symbols()
    if reason:
        raise HookUnavailableError(reason)
    cp = _cparams(ctx)
    if not cp:
        raise HookUnavailableError("llama_context::get_cparams returned null")
    words = (ctypes.c_uint64 * (_SCAN_BYTES // 8)).from_address(cp)
    hits = [8 * i for i in range(len(words) - 1) if words[i] == cb and words[i + 1] == user]
    if len(hits) != 1:
        raise HookUnavailableError(
            f"the context's cb_eval/cb_eval_user_data pair was found {len(hits)} times in its cparams "
            f"(offsets {hits}), not once"
        )
    return HookLayout(hits[0])


def _cparams(ctx: int) -> int:
    get = _ggml.ctx_get_cparams
    assert get is not None  # missing_symbols() was checked
    return int(get(ctx) or 0)


def _set(ctx: int, layout: HookLayout, cb: int, user: int) -> None:
    cp = _cparams(ctx)
    _ggml.write_ptr(cp + layout.cb_eval, cb)
    _ggml.write_ptr(cp + layout.cb_eval + 8, user)
    get_sched = _ggml.ctx_get_sched
    assert get_sched is not None
    sched = get_sched(ctx)
    if sched:
        _ggml.sched_set_eval_callback(sched, cb or None, user or None)


def install(ctx: int, layout: HookLayout, cb: int, user: int = 0) -> None:
    """Make every graph computed in ``ctx`` from now call ``cb`` (a ggml_backend_sched_eval_callback
    function pointer, kept alive by the caller) until :func:`clear`."""
    _set(ctx, layout, cb, user)


def clear(ctx: int, layout: HookLayout) -> None:
    """No eval callback any more (the scheduler read anew: a reserve may have replaced it)."""
    _set(ctx, layout, 0, 0)


def reserve_now(ctx: int) -> None:
    """Do the scheduler's pending reserve now (``llama_context::sched_reserve``; a no-op when none
    is pending) rather than inside the next decode: a reserve frees the old compute buffers, which
    on CUDA waits for the whole device -- uploads in flight included."""
    reserve = _ggml.ctx_sched_reserve
    if reserve is not None:
        reserve(ctx)


def verify(
    ctx: int, layout: HookLayout, decode: Callable[[int], None], reset_graphs: Callable[[], None]
) -> None:
    """Check the hook on ``ctx`` (a throwaway context that just decoded one token): installed, it
    is called on a reused graph (one token again), a rebuilt one (two tokens) and after a reserve
    (``reset_graphs``, then one token); after clear(), never -- on a reused graph, a rebuilt one
    or after a reserve. ``decode(n)`` decodes n more tokens. Raises HookUnavailableError."""
    calls: list[int] = []
    marker = ctypes.c_char(b"u")
    user = ctypes.addressof(marker)

    def counted(_t: int | None, _ask: bool, ud: int | None) -> bool:
        calls.append(int(ud or 0))
        return True

    cb_obj = llama_cpp.ggml_backend_sched_eval_callback(counted)
    cb = int(ctypes.cast(cb_obj, ctypes.c_void_p).value or 0)

    def one() -> None:
        decode(1)

    def two() -> None:
        decode(2)

    def reserved() -> None:
        reset_graphs()
        decode(1)

    cases: list[tuple[str, Callable[[], None]]] = [
        ("a reused graph", one),
        ("a rebuilt graph", two),
        ("after a reserve", reserved),
    ]
    install(ctx, layout, cb, user)
    for what, run in cases:
        calls.clear()
        run()
        if not calls or any(u != user for u in calls):
            clear(ctx, layout)
            raise HookUnavailableError(f"an installed eval hook was not called (or not as set) on {what}")
    clear(ctx, layout)
    # cleared after a one-token decode: one token reuses that graph, two rebuild, then a reserve
    for what, run in cases:
        calls.clear()
        run()
        if calls:
            raise HookUnavailableError(f"a cleared eval hook was still called on {what}")
    del cb_obj
