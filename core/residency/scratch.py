"""A device buffer outside any model: one I8 tensor in a buffer of its own, written through the
call a restore uploads with (``ggml_backend_tensor_set``). What the raw-copy measurements of
core/diagnostics/rawcopy.py copy into; nothing in the product uses it."""

from __future__ import annotations

from ..errors import OutOfDeviceMemoryError, ResidencyError
from . import _ggml


class ScratchTensor:
    """``nbytes`` of device memory of buffer type ``buft`` as one I8 tensor; :meth:`free` it."""

    def __init__(self, buft: int, nbytes: int) -> None:
        self.ctx = int(_ggml.ggml_init(_ggml.GgmlInitParams(1 << 16, None, True)) or 0)
        if not self.ctx:
            raise ResidencyError("ggml_init failed")
        self.tensor = int(_ggml.ggml_new_tensor_1d(self.ctx, _ggml.GGML_TYPE_I8, nbytes))
        self.buf = int(_ggml.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft) or 0)
        if not self.buf:
            _ggml.ggml_free(self.ctx)
            raise OutOfDeviceMemoryError(
                f"cannot allocate {nbytes / 1e9:.2f} GB for the raw copy measurement"
            )

    def set(self, host: int, offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` from host address ``host`` to ``offset`` in the tensor."""
        _ggml.tensor_set(self.tensor, host, offset, nbytes)

    def clear(self) -> None:
        """Clear the buffer on the device (every page touched from the device's side)."""
        _ggml.buffer_clear(self.buf, 0)  # synchronous on CUDA (a memset, then a sync)

    def free(self) -> None:
        if self.buf:
            _ggml.buffer_free(self.buf)
            self.buf = 0
        if self.ctx:
            _ggml.ggml_free(self.ctx)
            self.ctx = 0


def first_device_buffer_type() -> int | None:
    """The own buffer type of the first GPU, else of the CPU device (host memory plays the device
    on a CPU build); None when ggml lists neither."""
    gpu = _ggml.first_gpu()
    if gpu is not None:
        return int(_ggml.dev_buffer_type(gpu.handle))
    cpu = next((d for d in _ggml.devices() if not d.is_gpu), None)
    return int(_ggml.dev_buffer_type(cpu.handle)) if cpu is not None else None


def device_buffer_type(buft: int) -> int:
    """The own buffer type of the device behind ``buft`` (an "extra" type like CPU_REPACK would
    repack the bytes), or ``buft`` itself when it has no device."""
    dev = _ggml.buft_get_device(buft)
    return int(_ggml.dev_buffer_type(dev)) if dev else buft
