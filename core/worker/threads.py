"""The CPU threads a worker's llama.cpp context computes with: ``(n_threads, n_threads_batch)``.

llama.cpp decodes a batch of one token with ``n_threads`` and a batch of more with
``n_threads_batch``. The defaults are llama-cpp-python 0.3.36's own (``Llama.__init__``: half the
CPUs for one token, all of them for a batch), passed explicitly by the engine so that what the
worker uses is written once: ``timeshare bench embed`` gives llama-server the same counts
(``-t``/``-tb``) so the two are compared on equal threads (issue 45). ``$TIMESHARE_CPU_THREADS``
sets both (an escape hatch: ggml's threads wait for each other at every operation, spinning, so
on a CPU that other programs keep busy a thread that has lost its core holds the others up; two
batch threads on two busy cores were 5-17 x slower than one: docs/PERFORMANCE.md).
core/worker/decode.py switches a step of decode tokens only to ``n_threads``
(``Decoder.set_threads``)."""

from __future__ import annotations

import os

from .. import envvars
from ..errors import ConfigError


def cpu_threads() -> tuple[int, int]:
    """``(n_threads, n_threads_batch)`` for a worker's context on this machine. Raises
    ConfigError naming ``$TIMESHARE_CPU_THREADS`` when it is set to anything but a whole number
    from 1."""
    value = envvars.CPU_THREADS.text()
    if value:
        if not value.isdecimal() or int(value) < 1:
            raise ConfigError(
                [
                    f"${envvars.CPU_THREADS.name}: {value!r} is not a thread count: give a whole number "
                    "from 1, or unset it for the defaults (half the CPUs for one token, all for a batch)"
                ]
            )
        return int(value), int(value)
    cpus = os.cpu_count() or 1
    return max(cpus // 2, 1), cpus
