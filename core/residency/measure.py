"""How a residency measures the memory a release frees: the device's own report of its free
memory, or the process's resident set where the device is the CPU or does not report its usage."""

from __future__ import annotations

import logging
import os

from . import _ggml

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryMeasure:
    """The measure of one model's device (``gpu``; None on a CPU-only build), decided once the
    weights are seen resident. The Residency (the loop thread) is its only caller."""

    def __init__(self, gpu: _ggml.Device | None) -> None:
        self._gpu = gpu
        self._measure: str | None = None  # decided at the first release
        #: why the measure is not the device's own report, when it is not
        self.note = ""

    def measure(self, backend: str, weights_resident: bool, weight_bytes: int) -> str:
        """``"device"`` or ``"rss"`` (see Residency.memory_measure)."""
        if self._measure is not None:
            return self._measure
        measure = self._choose(backend, weights_resident, weight_bytes)
        if weights_resident:  # only then does free == total say the device cannot tell
            self._measure = measure
        return measure

    def _choose(self, backend: str, weights_resident: bool, weight_bytes: int) -> str:
        if self._gpu is None or backend == "CPU":
            return "rss"
        free, total = _ggml.device_memory(self._gpu.handle)
        if free >= total and weights_resident and weight_bytes > 0:
            # e.g. Vulkan without VK_EXT_memory_budget (Mesa's lavapipe): ggml reports the heap
            # size as free whatever is allocated, so a release would always measure 0 bytes
            self.note = (
                f"{self._gpu.name} reports {free} bytes free of {total} with the weights loaded (its "
                "driver does not report memory usage, e.g. no VK_EXT_memory_budget): measured as process "
                "RSS instead, which is the device memory where the device is the CPU (lavapipe)"
            )
            log.info("%s", self.note)
            return "rss"
        return "device"

    def device_memory(self) -> tuple[str, int, int] | None:
        """(device name, free bytes, total bytes) as ``ggml_backend_dev_memory`` reports them;
        None on a CPU-only build."""
        if self._gpu is None:
            return None
        free, total = _ggml.device_memory(self._gpu.handle)
        return self._gpu.name, free, total

    def free(self, measure: str) -> int:
        """Free bytes of the device as ``measure`` counts them (RSS, negated, for ``"rss"``)."""
        if measure == "device" and self._gpu is not None:
            return _ggml.device_memory(self._gpu.handle)[0]
        return -rss_bytes()
