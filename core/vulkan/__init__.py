"""Plain Vulkan through ctypes on the loader, independent of ggml: ``api`` (the C API's constants,
structures and entry points), ``devices`` (physical devices, a logical device with buffers and
copies). Shared by diagnostics/vkcopy.py (the copy baseline) and devmem/vulkan.py (device memory
handed over between processes). Imports nothing of Timeshare's."""
