"""The ballast process of ``--card SIZE`` (issue 39, item 5): it holds all but SIZE of a GPU's free
memory with plain device allocations, so that what runs next sees a card of SIZE.

``python -m timeshare.core.diagnostics.ballast --leave BYTES [--device N]`` prints one JSON line on
stdout, then holds the memory until its stdin closes (the parent ended, or let it go):

- ``{"ok": true, "api": "cudart"|"cuda"|"vulkan", "total", "free_before", "held", "free_after"}``;
- ``{"ok": false, "gpu": false, "reason"}``: no CUDA library or device here (the CPU path);
- ``{"ok": false, "gpu": true, "reason"}``: a card larger than the GPU or than its free memory,
  or an allocation that failed.

The CUDA runtime (``libcudart``, the one llama.cpp's CUDA build ships or links) through ctypes, or
the driver API (``libcuda.so.1``, always installed with the driver) where no runtime is found.
Without CUDA, on a Vulkan build of llama.cpp (the small AMD and Intel cards): plain device-local
Vulkan allocations (:class:`VulkanGpu`, core/vulkan), on the ``device``-th Vulkan GPU (CPU
devices such as Mesa's lavapipe are not GPUs). Other processes see them through
``VK_EXT_memory_budget`` (NVIDIA, RADV, ANV: what ggml-vulkan reads as free memory); a device
without the extension says nothing of other processes, so there the card is not seen.
Its own process: the allocations and the CUDA or Vulkan device die with it, whatever the parent does.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import sys
from collections.abc import Callable
from ctypes import byref, c_int, c_size_t, c_void_p
from typing import Any, Protocol

from ..vulkan.api import DEVICE_TYPES, EXT_MEMORY_BUDGET, VulkanUnavailableError, instance
from ..vulkan.devices import Device, device_type, heap_free, physical_devices, queue_families

#: allocated in pieces of at most this (one huge cudaMalloc may not find a contiguous range)
CHUNK = 1 << 30
#: the last piece is left out below this
MIN_PIECE = 2 << 20


def _runtime_candidates() -> list[str]:
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.insert(0, found)
    try:
        import llama_cpp  # its CUDA build ships or links the runtime

        lib_dir = os.path.join(os.path.dirname(os.path.abspath(llama_cpp.__file__)), "lib")
        names += sorted(glob.glob(os.path.join(lib_dir, "libcudart.so*")))
    except Exception:  # a diagnostic: the other names may do
        pass
    for path in sys.path:
        names += sorted(glob.glob(os.path.join(path, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    return names


class Gpu(Protocol):
    """What :func:`hold` asks of a GPU (tests give one that exists without a GPU)."""

    api: str
    #: the largest single allocation the device allows
    max_piece: int

    def memory(self) -> tuple[int, int]: ...

    def allocate(self, nbytes: int) -> bool: ...


class CudaGpu:
    """The few calls the ballast needs, over the runtime or the driver API."""

    def __init__(self, device: int) -> None:
        self.api = ""
        self.max_piece = CHUNK
        self._lib: Any = None
        self._pieces: list[c_void_p] = []
        try:
            self._runtime(device)
        except LookupError as runtime:  # e.g. a runtime newer than the driver: ask the driver
            try:
                self._driver(device)
            except LookupError as driver:
                raise LookupError(f"{runtime}; {driver}") from None

    def _runtime(self, device: int) -> None:
        for name in _runtime_candidates():
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise LookupError("no CUDA runtime (libcudart) here")
        count = c_int(0)
        status = lib.cudaGetDeviceCount(byref(count))
        if status != 0 or count.value == 0:
            raise LookupError(f"the CUDA runtime sees no GPU (status {status})")
        if device >= count.value:
            raise ValueError(f"GPU {device} does not exist: this machine has {count.value}")
        self._lib, self.api = lib, "cudart"
        self._check(lib.cudaSetDevice(c_int(device)), "cudaSetDevice")

    def _driver(self, device: int) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            raise LookupError("no CUDA driver (libcuda.so.1) here") from None
        status = lib.cuInit(0)
        count = c_int(0)
        if status != 0 or lib.cuDeviceGetCount(byref(count)) != 0 or count.value == 0:
            raise LookupError(f"the CUDA driver sees no GPU (status {status})")
        if device >= count.value:
            raise ValueError(f"GPU {device} does not exist: this machine has {count.value}")
        self._lib, self.api = lib, "cuda"
        dev, ctx = c_int(0), c_void_p()
        self._check(lib.cuDeviceGet(byref(dev), c_int(device)), "cuDeviceGet")
        self._check(lib.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed (CUDA error {status})")

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device now."""
        free, total = c_size_t(0), c_size_t(0)
        if self.api == "cudart":
            self._check(self._lib.cudaMemGetInfo(byref(free), byref(total)), "cudaMemGetInfo")
        else:
            self._check(self._lib.cuMemGetInfo_v2(byref(free), byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def allocate(self, nbytes: int) -> bool:
        ptr = c_void_p()
        if self.api == "cudart":
            ok = int(self._lib.cudaMalloc(byref(ptr), c_size_t(nbytes))) == 0
        else:
            ok = int(self._lib.cuMemAlloc_v2(byref(ptr), c_size_t(nbytes))) == 0
        if ok:
            self._pieces.append(ptr)  # held until the process ends
        return ok


class VulkanGpu:
    """The ballast's calls over Vulkan: device-local allocations made the way ggml-vulkan makes a
    device buffer, on the ``device``-th Vulkan GPU (``allow_cpu``: CPU devices count too; tests)."""

    api = "vulkan"

    def __init__(self, device: int, allow_cpu: bool = False) -> None:
        try:
            vk, inst = instance(b"timeshare-ballast")
            devs = physical_devices(vk, inst)
        except VulkanUnavailableError as exc:
            raise LookupError(f"no Vulkan: {exc}") from None
        gpus = [d for d in devs if allow_cpu or DEVICE_TYPES.get(d.kind) != "cpu"]  # lavapipe: no card
        if not gpus:
            listed = ", ".join(d.name for d in devs) or "none"
            raise LookupError(f"no Vulkan GPU here (the loader lists: {listed})")
        if device >= len(gpus):
            raise ValueError(f"GPU {device} does not exist: Vulkan lists {len(gpus)}")
        d = self._phys = gpus[device]
        try:
            self._mtype = device_type(d)
            exts = (EXT_MEMORY_BUDGET,) if EXT_MEMORY_BUDGET in d.extensions else ()
            self._dev = Device(vk, d, [queue_families(d)[0][0]], exts)
        except VulkanUnavailableError as exc:
            raise RuntimeError(f"{d.name}: {exc}") from None
        self._vk, self._inst = vk, inst
        self.name = d.name
        self.max_piece = d.max_alloc or CHUNK
        self._own = 0
        self._pieces: list[tuple[int, int]] = []

    def memory(self) -> tuple[int, int]:
        return heap_free(self._vk, self._phys, self._mtype, self._own)

    def allocate(self, nbytes: int) -> bool:
        try:
            self._pieces.append(self._dev.bound(nbytes, self._mtype))  # held until close or exit
        except VulkanUnavailableError:
            return False
        self._own += nbytes
        return True

    def close(self) -> None:
        """Free the pieces, the device and the instance (the ballast process just exits)."""
        for pair in self._pieces:
            self._dev.unbind(pair)
        self._pieces, self._own = [], 0
        self._dev.close()
        self._vk.vkDestroyInstance(self._inst, None)


def _vulkan_build() -> bool:
    """Whether the llama.cpp this Python loads is a Vulkan build (its ggml-vulkan library is
    there), without loading it."""
    try:
        import llama_cpp
    except Exception:  # a diagnostic: no llama.cpp, no Vulkan build
        return False
    lib_dir = os.path.join(os.path.dirname(os.path.abspath(llama_cpp.__file__)), "lib")
    return bool(glob.glob(os.path.join(lib_dir, "libggml-vulkan.so*")))


def open_any_gpu(device: int) -> Gpu:
    """CUDA where there is CUDA; else Vulkan on a Vulkan build; LookupError (the reasons) when
    neither: the card is then a host-memory cap (diagnostics/card.py)."""
    try:
        return CudaGpu(device)
    except LookupError as cuda:
        if not _vulkan_build():
            raise
        try:
            return VulkanGpu(device)
        except LookupError as vulkan:
            raise LookupError(f"{cuda}; {vulkan}") from None


def hold(leave: int, device: int, open_gpu: Callable[[int], Gpu] = open_any_gpu) -> dict[str, Any]:
    """Allocate all but ``leave`` bytes of the free memory of GPU ``device``; the report line."""
    try:
        gpu = open_gpu(device)
    except LookupError as exc:
        return {"ok": False, "gpu": False, "reason": str(exc)}
    except (ValueError, RuntimeError) as exc:
        return {"ok": False, "gpu": True, "reason": str(exc)}
    free, total = gpu.memory()  # after this process's own CUDA context
    gib = 2**30
    if leave > total:
        return {
            "ok": False,
            "gpu": True,
            "reason": f"a card of {leave / gib:.1f} GiB is larger than GPU {device} "
            f"({total / gib:.1f} GiB): give a smaller --card",
            "total": total,
        }
    if leave > free:
        return {
            "ok": False,
            "gpu": True,
            "reason": f"GPU {device} has only {free / gib:.1f} GiB free of {total / gib:.1f} GiB, less than "
            f"the card of {leave / gib:.1f} GiB: give a smaller --card, or stop what else uses it",
            "total": total,
        }
    want = free - leave
    held = 0
    largest = min(CHUNK, gpu.max_piece)
    while want - held >= MIN_PIECE:
        piece = min(largest, want - held)
        if not gpu.allocate(piece):
            if piece <= MIN_PIECE:
                break
            # the last gigabyte may not be contiguous: halve until it fits
            half = piece // 2
            while half >= MIN_PIECE and not gpu.allocate(half):
                half //= 2
            if half < MIN_PIECE:
                break
            held += half
            continue
        held += piece
    after, _ = gpu.memory()
    return {
        "ok": True,
        "api": gpu.api,
        "total": total,
        "free_before": free,
        "held": held,
        "free_after": after,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ballast")
    parser.add_argument("--leave", type=int, required=True)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    report = hold(int(args.leave), int(args.device))
    print(json.dumps(report), flush=True)
    if not report.get("ok"):
        return 1
    sys.stdin.read()  # until the parent closes it (or ends): then the memory goes with us
    return 0


if __name__ == "__main__":
    sys.exit(main())
