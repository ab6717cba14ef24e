"""Device memory handed over between worker processes (issue 40): the device side.

``device``: what a chunk device does (:class:`~.device.ChunkHandles`: create, export, import,
release; :class:`~.device.ChunkDevice`: and map at reserved addresses) and where chunks come from
(:class:`~.device.ChunkSource`, the arena's hand-over client); ``memfd``: the CPU stand-in
(memfd_create + mmap), named as such; ``vmm``: CUDA's virtual memory management through libcuda;
``vulkan``: Vulkan device memory as opaque fds (``VK_KHR_external_memory_fd``, through
core/vulkan); ``mapped``: one worker's buffers mapped from chunks (:class:`~.mapped.HandedMemory`).
Imports ``errors`` and ``core/vulkan`` only: no llama.cpp, no arena (the worker joins the two).
"""
