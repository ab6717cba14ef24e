"""Release and restore of a loaded model's device weights (in-place and rebuild paths)."""

from __future__ import annotations

from .gguf_check import GgufInfo, check_gguf
from .hostmem import fix_malloc_mmap_threshold
from .residency import (
    ProbeResult,
    ReleaseReport,
    Residency,
    ResidencyOptions,
    RestoreReport,
)
from .vkenv import prefer_device_local_memory

__all__ = [
    "GgufInfo",
    "ProbeResult",
    "ReleaseReport",
    "Residency",
    "ResidencyOptions",
    "RestoreReport",
    "check_gguf",
    "fix_malloc_mmap_threshold",
    "prefer_device_local_memory",
]
