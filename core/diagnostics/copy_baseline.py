"""The copy a restore is measured against on a Vulkan build: ``diagnostics.vkcopy``'s fenced plain
Vulkan copy on the model's own device, found from its ggml device (PCI bus id, else its Vulkan
device name and its rank among devices of that name). doctor and bench residency share it."""

from __future__ import annotations

import logging
from typing import Any

from ..residency.residency import Residency
from ..residency.vkenv import device_local_only
from ..vulkan.api import GIB, VulkanUnavailableError
from .vkcopy import baseline_for_ggml_device

log = logging.getLogger(__name__)


def vulkan_baseline(res: Residency, nbytes: int = GIB, reps: int = 5) -> dict[str, Any] | None:
    """The baseline's report for ``res``'s device when it is a Vulkan device (None otherwise); a
    device the loader cannot reach gives ``{"error": ...}`` instead of failing the check."""
    dev = res.device
    if dev is None or not dev.name.startswith("Vulkan"):
        return None
    try:
        base = baseline_for_ggml_device(dev, nbytes, reps)
    except VulkanUnavailableError as exc:
        log.warning("no Vulkan copy baseline: %s", exc)
        return {"error": str(exc)}
    out = base.report()
    out["ggml_device"] = dev.name
    out["device_buffers"] = (
        "device-local only (GGML_VK_DISABLE_HOST_VISIBLE_VIDMEM)"
        if device_local_only()
        else "ggml-vulkan's default"
    )
    return out
