"""The upload gate of an overlapped restore (issue 28): per-part readiness, and the eval callback
that makes a decode wait for a layer part's upload before the first node that reads its weights.

The restore allocates every released part and points the tensors into it, then uploads the parts
in layer order on another thread, each setting its :class:`threading.Event` when its copy is
complete. The gate is installed as the context's eval callback (residency/evalhook.py) for the
first decode after it; ggml then asks it about every node before computing (ask=True) and
computes the nodes up to the first one it answered True for in one range, synchronises, and
tells it (ask=False).

- **Correctness never depends on names:** asked about a node, the gate looks at its sources
  (following ``view_src`` to the viewed tensor); a weight of a part whose upload is not complete
  makes it wait right there, before the range that holds the node is computed.
- **Overlap:** the gate also answers True at the layer output ``l_out-<i>`` of the layer before
  a part that is still uploading (llama.cpp names graph nodes ``<name>-<layer>``), so the layers
  before it compute while it uploads. ``l_out`` has more than one user, so no ggml backend fuses
  it with a later node: ending a range there computes exactly the kernels of the whole graph.
- Once every part is in (``left == 0``), it answers False at once: ggml computes the rest of the
  split as one range.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field

import llama_cpp

from . import _ggml


@dataclass
class GateStats:
    """What the gate saw during the decodes it was installed for."""

    calls: int = 0  # callback calls (ask and tell)
    waits: int = 0  # times a node waited for its part's upload
    wait_s: float = 0.0  # seconds spent waiting
    ranges: int = 0  # ranges ended early (at a part boundary) for overlap
    #: bytes of the parts not yet uploaded when ggml first asked (-1: never asked)
    pending_bytes_at_start: int = -1
    waited_parts: list[int] = field(default_factory=list)
    #: perf_counter() of the first ask, and of the end of the last wait (0.0: none)
    first_ask_t: float = 0.0
    last_wait_end_t: float = 0.0


class PartGate:
    """Readiness of the parts of one overlapped restore and the callback that waits on it.

    ``parts``: (index, first layer, bytes, weight tensor pointers) of each part being uploaded,
    in upload order. The upload thread calls :meth:`set_ready`; the decoding thread runs the
    callback."""

    def __init__(self, layout: _ggml.TensorLayout, parts: list[tuple[int, int, int, list[int]]]) -> None:
        self._lay = layout
        self._events = {idx: threading.Event() for idx, _first, _n, _ws in parts}
        self._bytes = {idx: n for idx, _first, n, _ws in parts}
        self._part_of: dict[int, int] = {}
        for idx, _first, _n, weights in parts:
            for w in weights:
                self._part_of[w] = idx
        #: node name at which a range ends while the part after it uploads -> that part
        self._boundary: dict[bytes, int] = {
            b"l_out-%d" % (first - 1): idx for idx, first, _n, _ws in parts if first > 0
        }
        self.left = len(parts)
        self.stats = GateStats()
        self.error: BaseException | None = None
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)
        self.pointer = int(ctypes.cast(self.callback, ctypes.c_void_p).value or 0)

    # -- the upload side ---------------------------------------------------------------------

    def set_ready(self, idx: int) -> None:
        ev = self._events[idx]
        if not ev.is_set():
            self.left -= 1  # one writer (the upload thread); readers only compare with 0
            ev.set()

    def wait_all(self) -> None:
        for ev in self._events.values():
            ev.wait()

    @property
    def pending_bytes(self) -> int:
        return sum(n for idx, n in self._bytes.items() if not self._events[idx].is_set())

    # -- the decoding side -------------------------------------------------------------------

    def _part(self, t: int) -> int:
        """The part being uploaded whose weight ``t`` is (or views); -1 for any other tensor.
        Nothing is cached: a rebuilt graph may put another tensor at the same address."""
        got = self._part_of.get(t)
        if got is not None:
            return got
        root = _ggml.view_root(t, self._lay)
        return self._part_of.get(root, -1) if root != t else -1

    def _wait(self, idx: int) -> None:
        ev = self._events[idx]
        if ev.is_set():
            return
        t0 = time.perf_counter()
        ev.wait()
        st = self.stats
        st.last_wait_end_t = time.perf_counter()
        st.wait_s += st.last_wait_end_t - t0
        st.waits += 1
        st.waited_parts.append(idx)

    def _eval(self, tensor: int | None, ask: bool, _user: int | None) -> bool:
        st = self.stats
        st.calls += 1
        if not ask:
            return True  # go on: the next node's ask waits for what it needs
        if self.left == 0 or not tensor:
            return False
        try:
            if st.pending_bytes_at_start < 0:
                st.first_ask_t = time.perf_counter()
                st.pending_bytes_at_start = self.pending_bytes
            srcs = (ctypes.c_void_p * _ggml.GGML_MAX_SRC).from_address(tensor + self._lay.src)
            for s in srcs:
                if s:
                    idx = self._part(s)
                    if idx >= 0:
                        self._wait(idx)
            if self.left and self._boundary:
                nxt = self._boundary.get(ctypes.string_at(tensor + self._lay.name))
                if nxt is not None and not self._events[nxt].is_set():
                    st.ranges += 1
                    return True  # compute up to this layer's output while the next part uploads
            return False
        except BaseException as exc:  # never compute on weights that may not be there
            self.error = exc
            self.wait_all()
            return False
