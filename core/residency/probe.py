"""What this build of llama-cpp-python allows for residency, before any model is loaded."""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp

from . import _ggml

#: ggml device names (CUDA0, Vulkan0, ...) of the backends the in-place path was checked on
INPLACE_BACKENDS = ("CUDA", "Vulkan")


@dataclass(frozen=True)
class ProbeResult:
    """What this build of llama-cpp-python allows, before any model is loaded."""

    version: str
    version_ok: bool
    backend: str  # the first GPU's name, or "CPU"
    gpu: bool
    layout_ok: bool
    inplace_possible: bool
    reason: str  # why not ("" when possible)
    #: what the engine must pass as ``Llama(use_mmap=...)`` for the in-place path: False on a
    #: CPU-only build (host weight buffers play the device), True on a GPU build
    use_mmap_for_inplace: bool


def probe() -> ProbeResult:
    """The pinned version, the ggml struct layouts and the first GPU's backend, checked."""
    version = str(getattr(llama_cpp, "__version__", "?"))
    gpu = _ggml.first_gpu()
    version_ok = version == _ggml.PINNED_VERSION
    layout_ok = True
    reason = ""
    try:
        _ggml.probe_tensor_layout()
    except _ggml.LayoutMismatchError as exc:
        layout_ok = False
        reason = str(exc)
    if not version_ok:
        reason = (
            f"llama-cpp-python {version} is not the pinned {_ggml.PINNED_VERSION}: "
            "its ggml struct layouts are unchecked"
        )
    if gpu is not None and not gpu.name.startswith(INPLACE_BACKENDS):
        reason = reason or f"backend {gpu.name} is not checked for in-place release"
    return ProbeResult(
        version=version,
        version_ok=version_ok,
        backend=gpu.name if gpu else "CPU",
        gpu=gpu is not None,
        layout_ok=layout_ok,
        inplace_possible=not reason,
        reason=reason,
        use_mmap_for_inplace=gpu is not None,
    )
