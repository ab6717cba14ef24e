"""Release and restore of a loaded model's device weights (in-place and rebuild paths)."""

from __future__ import annotations

from ._ggml import Device as GgmlDevice
from ._ggml import device_description as ggml_device_description
from ._ggml import device_id as ggml_device_id
from ._ggml import device_memory as ggml_device_memory
from ._ggml import devices as ggml_devices
from .gguf_check import GgufInfo, check_gguf
from .hostmem import fix_malloc_mmap_threshold
from .options import ResidencyOptions
from .paths import WeightPart
from .probe import ProbeResult
from .projector import ProjectorWatch
from .reports import ReleaseReport, RestoreReport
from .residency import Residency
from .vkenv import prefer_device_local_memory

__all__ = [
    "GgmlDevice",
    "GgufInfo",
    "ProbeResult",
    "ProjectorWatch",
    "ReleaseReport",
    "Residency",
    "ResidencyOptions",
    "RestoreReport",
    "WeightPart",
    "check_gguf",
    "fix_malloc_mmap_threshold",
    "ggml_device_description",
    "ggml_device_id",
    "ggml_device_memory",
    "ggml_devices",
    "prefer_device_local_memory",
]
