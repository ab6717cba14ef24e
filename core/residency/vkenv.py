"""Where ggml-vulkan puts device buffers, decided before any Vulkan device is initialised.

ggml-vulkan allocates every device buffer of a discrete GPU in device-local *host-visible*
memory when the device offers it (ReBAR, or a large BAR like the H200's) and then writes a
buffer with a plain ``memcpy`` through the mapping -- one CPU thread over PCIe, whatever the
source -- instead of a DMA copy (``ggml_vk_buffer_write_2d``, ggml-vulkan-buffers.cpp). A restore
is one such write per weight buffer, so it ran at CPU-copy speed (about 4.5 GB/s on the H200, where
a DMA moves 49; docs/lab/HISTORY.md), and releasing mapped memory was slower too. With
``GGML_VK_DISABLE_HOST_VISIBLE_VIDMEM`` set, device buffers are plain device-local memory, the
same VRAM, and a write from ggml-vulkan's pinned host memory is one ``vkCmdCopyBuffer`` on the
transfer queue. Integrated GPUs (UMA) are not affected: ggml-vulkan keeps host-visible memory
there, where a memcpy is the right copy. Core Vulkan only: it is a memory-type choice, no
extension.

The variable is read once per device, when ggml-vulkan initialises it (the first buffer type or
backend asked of it: model load), so :func:`prefer_device_local_memory` must run before the first
model loads; the worker and ``timeshare doctor`` / ``bench`` call it at start.
``TIMESHARE_VK_HOST_VISIBLE_VIDMEM=1`` keeps ggml-vulkan's default.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from .. import envvars

VIDMEM_VAR = envvars.VK_DISABLE_HOST_VISIBLE_VIDMEM.name
KEEP_VAR = envvars.VK_HOST_VISIBLE_VIDMEM.name


def prefer_device_local_memory(environ: MutableMapping[str, str] | None = None) -> bool:
    """Ask ggml-vulkan for plain device-local device buffers (see the module doc). Returns whether
    device buffers will be device-local only (the variable set, now or before)."""
    env = envvars.process_environ() if environ is None else environ
    if envvars.VK_HOST_VISIBLE_VIDMEM.raw(env) == "1":
        return envvars.VK_DISABLE_HOST_VISIBLE_VIDMEM.is_set(env)
    env.setdefault(VIDMEM_VAR, "1")
    return True


def device_local_only() -> bool:
    """Whether ggml-vulkan was told to keep device buffers out of host-visible memory."""
    return envvars.VK_DISABLE_HOST_VISIBLE_VIDMEM.is_set()
