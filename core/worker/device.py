"""The device a worker's weights live on, and its memory: what a VRAM budget is computed from.

GPU devices are counted as llama.cpp counts them for ``main_gpu`` (the ggml devices of type GPU,
in order: CUDA0, CUDA1...). On a build without a GPU the "device" is host memory (the in-place
residency path frees host weight buffers there), measured from ``/proc/meminfo`` (MemTotal,
MemAvailable), so the same budget logic runs on CPU-only machines. ``$TIMESHARE_HOST_MEMORY`` (a
size, "8GiB") caps that host memory: a "card" of that size on a CPU build (``--card`` of bench api,
doctor and arena-test sets it; issue 39), read here only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import envvars
from ..arena.budget import BudgetSetting, parse_budget
from ..config.parallel import auto_parallel
from ..errors import ConfigError
from ..residency import GgmlDevice, ggml_device_memory, ggml_devices
from ..util.units import parse_size


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    name: str  # "CUDA0", "Vulkan1", or "CPU" (host memory)
    gpu: bool
    total: int
    free: int


def default_parallel() -> int:
    """``parallel`` for a model whose setting is 0 (auto) on this build (config.parallel)."""
    return auto_parallel(bool(_gpus()))


def _gpus() -> list[GgmlDevice]:
    return [d for d in ggml_devices() if d.is_gpu]


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory, capped by ``$TIMESHARE_HOST_MEMORY``. Raises
    ConfigError naming the variable when its value is not a size."""
    total, available = _meminfo()
    cap = envvars.HOST_MEMORY.text()
    if not cap:
        return total, available
    try:
        size = parse_size(cap)
    except ValueError as exc:
        raise ConfigError([f"${envvars.HOST_MEMORY.name}: {exc}"]) from None
    if size <= 0:
        raise ConfigError([f"${envvars.HOST_MEMORY.name}: must be more than 0 bytes, not {cap!r}"])
    return min(total, size), min(available, size)


def _meminfo() -> tuple[int, int]:
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[key] = int(parts[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))
    except (OSError, KeyError):
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")


def device_memory(index: int) -> DeviceMemory:
    """Total and free bytes of device ``index`` now. Raises ConfigError when there is no such
    device (``models[].device`` names a GPU this machine does not have)."""
    gpus = _gpus()
    if not gpus:
        if index != 0:
            raise ConfigError(
                [f"models[].device = {index}: this build of llama.cpp sees no GPU (CPU only): use 0"]
            )
        total, free = host_memory()
        return DeviceMemory(0, "CPU", False, total, free)
    if index >= len(gpus):
        names = ", ".join(d.name for d in gpus)
        raise ConfigError([f"models[].device = {index}: this machine has {len(gpus)} GPU(s) ({names})"])
    dev = gpus[index]
    free, total = ggml_device_memory(dev.handle)
    return DeviceMemory(index, dev.name, True, total, free)


def budget_setting(configured: str | int) -> BudgetSetting:
    """The budget setting a worker uses: its spec's ``arena.vram_budget``, which the pool resolved
    (``$TIMESHARE_VRAM_BUDGET`` in place of "auto": core/config/vram_budget.py, the one reader of
    that variable). Raises ConfigError naming the bad value."""
    try:
        return parse_budget(configured)
    except ValueError as exc:
        raise ConfigError([f"arena.vram_budget: {exc}"]) from None


def llama_placement(device: int, gpu_count: int | None = None) -> dict[str, Any]:
    """The ``Llama(...)`` arguments that put a model on GPU ``device`` alone (split_mode none +
    main_gpu), so that its weights count against one device's budget. Empty on a build without a
    GPU. ``gpu_count``: for tests (the ggml devices are counted otherwise)."""
    import llama_cpp

    count = len(_gpus()) if gpu_count is None else gpu_count
    if count == 0:
        return {}
    return {"split_mode": int(llama_cpp.LLAMA_SPLIT_MODE_NONE), "main_gpu": device}
