"""The CPU threads a worker's llama.cpp context computes with: ``(n_threads, n_threads_batch)``.

llama.cpp decodes a batch of one token with ``n_threads`` and a batch of more with
``n_threads_batch``. These are llama-cpp-python 0.3.36's own defaults (``Llama.__init__``: half the
CPUs for one token, all of them for a batch), passed explicitly by the engine so that what the
worker uses is written once: ``timeshare bench embed`` gives llama-server the same counts
(``-t``/``-tb``) so the two are compared on equal threads (issue 45). core/worker/decode.py
switches a step of decode tokens only to ``n_threads`` (``Decoder.set_threads``)."""

from __future__ import annotations

import os


def cpu_threads() -> tuple[int, int]:
    """``(n_threads, n_threads_batch)`` for a worker's context on this machine."""
    cpus = os.cpu_count() or 1
    return max(cpus // 2, 1), cpus
