"""What a worker holds on its device besides the weights (issue 39, item 4): the KV cache, the
compute buffers and, on a GPU, the driver context; and while it is parked at each level:

- resident or released (``weights``): all three stay (a release frees only the weights);
- sleeping (``weights+kv``): the context is freed, KV and compute buffers with it; the driver
  context stays (the process lives);
- deep on contention (``weights+kv``, in place): the KV cache and the compute buffers are released
  in place, the context object kept; the same as sleeping on the device (the compute buffers stay
  only where they cannot be released in place: ``Residency.buffers_note``);
- stopped: nothing (the process is gone).

On a CPU-only build the same parts are host memory, and are reported as such. The compute buffers
are measured from ggml's scheduler (public ggml API, reached through
``llama_context::get_sched()``, an exported C++ accessor of the pinned llama-cpp-python build),
split into device and host bytes.

The KV cache's bytes come from the GGUF's shape (core/gguf/kvcache.py, checked against llama.cpp's
own buffers in tests/test_kvcache.py); the weights' from the residency. A build whose library
lacks the accessor reports no compute bytes (0, with the reason logged once).
"""

from __future__ import annotations

import ctypes
import logging
from ctypes import c_void_p
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..arena.budget import GPU_CONTEXT_ALLOWANCE
from ..residency.computebuf import scheduler_bytes

if TYPE_CHECKING:
    from .engine import Engine
    from .fitting import Fitted

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComputeBytes:
    device: int = 0  # compute buffers of the GPU backends
    host: int = 0  # compute buffers in host memory (the CPU backend, a GPU build's pinned staging)


def compute_bytes(ctx: Any) -> ComputeBytes:
    """The compute buffers of llama_context ``ctx`` (a pointer), per kind of memory
    (residency/computebuf.scheduler_bytes)."""
    return ComputeBytes(*scheduler_bytes(int(ctypes.cast(ctx, c_void_p).value or 0)))


@dataclass(frozen=True)
class Held:
    """Bytes a worker holds now besides its weights, on its device (host memory on a CPU build)."""

    kv: int = 0
    buffers: int = 0
    context: int = 0  # the driver context on a GPU (an allowance, not measured: ≈ 0.6 GB on CUDA)

    @property
    def total(self) -> int:
        return self.kv + self.buffers + self.context


@dataclass(frozen=True)
class Footprint:
    """A loaded model's context, measured once after its load (its sizes do not change: a deep
    wake makes the same context again)."""

    kv_total: int = 0  # the KV cache of every layer, wherever it is
    kv: int = 0  # the part on the model's device (the offloaded layers'; all on a CPU build)
    buffers: int = 0  # compute buffers on the device (host memory on a CPU build)
    context: int = 0  # GPU_CONTEXT_ALLOWANCE on a GPU build, 0 on a CPU one

    @classmethod
    def measure(cls, engine: Engine, fitted: Fitted) -> Footprint:
        model, shape, gpu = fitted.model, fitted.kv_shape, fitted.plan.gpu
        parallel, kv_type = engine.parallel, model.kv_type()
        kv_total = kv = 0
        if shape is not None:
            kv_total = shape.bytes(model.n_ctx, parallel, kv_type)
            on_device = None if not gpu or model.n_gpu_layers < 0 else model.n_gpu_layers
            kv = shape.bytes(model.n_ctx, parallel, kv_type, layers=on_device)
        try:
            compute = compute_bytes(engine.llm.ctx)
        except Exception:  # a figure for the status only
            log.exception("measuring the compute buffers failed")
            compute = ComputeBytes()
        return cls(
            kv_total=kv_total,
            kv=kv,
            buffers=compute.device if gpu else compute.host,
            context=GPU_CONTEXT_ALLOWANCE if gpu else 0,
        )

    def now(self, kv_resident: bool, context_kept: bool = False, buffers_kept: bool = False) -> Held:
        """What is held while the context lives (``kv_resident``), or after it was freed; or
        after a deep release in place (``context_kept``: the KV cache released, the context kept;
        its compute buffers released in place too unless ``buffers_kept``; issue 39)."""
        if kv_resident:
            return Held(self.kv, self.buffers, self.context)
        if context_kept and buffers_kept:
            return Held(buffers=self.buffers, context=self.context)
        return Held(context=self.context)
