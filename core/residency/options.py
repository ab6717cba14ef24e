"""How a model's residency is to be handled: the options ``Residency.attach`` takes, which the
in-place path reads too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["auto", "inplace", "rebuild"]

#: a deferred shadow is built in slices of at most this many bytes (each: its own host allocation,
#: read and spot check), between which a waiting request stops the build (ResidencyOptions)
SHADOW_SLICE_BYTES = 256 << 20


@dataclass(frozen=True)
class ResidencyOptions:
    mode: Mode = "auto"
    host_shadow: Literal["pinned", "pageable"] = "pinned"
    #: compare the shadow with the loaded weights at attach (first/last 4 KiB of each tensor)
    verify_shadow: bool = True
    #: upload each plain-copy buffer (CPU, CUDAn) in one copy from a shadow that mirrors its
    #: layout, instead of tensor by tensor (one synchronisation per tensor on CUDA)
    coalesce_upload: bool = True
    #: allocate and free the weight buffers on several threads at once (None: on Vulkan only,
    #: where each allocation and free costs time in proportion to its size; CUDA stays serial)
    parallel_buffers: bool | None = None
    #: layer parts of the in-place path (issue 28): 1 = the model's own weight buffers, released
    #: and restored whole; N > 1 = each buffer's weights held as up to N runs of consecutive
    #: layers (made at attach), so ``release(keep_bytes=...)`` can free only the last layers
    parts: int = 1
    #: the in-place path allocates and fills the host shadow later (fill_shadow, before or after
    #: the first release; the next restore fills what is left), not at attach: a worker started
    #: for a waiting request answers it first
    defer_shadow: bool = False
    #: a deferred shadow is built in slices of at most this many bytes (each its own host
    #: allocation, read and spot check): ``fill_shadow(stop)`` stops between two, so a request
    #: that arrives meanwhile waits for one slice; a release checks the slices left against the
    #: file (first and last bytes of each tensor) and leaves them to be read from it later
    shadow_slice_bytes: int = SHADOW_SLICE_BYTES
    #: overlapped restore (issue 28): with layer parts, ``restore()`` returns once the released
    #: parts are allocated and the first decode after it computes each part's layers as soon as
    #: that part has arrived (uploads in layer order on another thread, an eval-callback gate for
    #: that one decode: see residency/gate.py). None (auto): on for a GPU build where the
    #: attach-time probe passes (CUDA; never Vulkan), off on the CPU build, where the copy and the
    #: compute share the same cores (measured slower there: docs/lab/HISTORY.md); True: on wherever
    #: the probe passes (the CPU tests); False: off. ``TIMESHARE_OVERLAP_RESTORE`` = 0 / 1 overrides
    overlap_restore: bool | None = None
    #: with ``parts`` > 1: move the weights into the parts at the first release (which is then
    #: whole: the model's own buffers are freed, every part released; the next restore allocates
    #: them) instead of at attach (a device copy, and a shadow made at attach). For a one-model
    #: budget, where every release is whole and the parts serve overlapped restores only
    split_at_release: bool = False
    #: device memory handed over between workers (issue 40): restores map chunks of memory
    #: another worker released (CUDA VMM with POSIX-fd handles; on a CPU build the memfd stand-in,
    #: named as such) instead of allocating, releases unmap and hand them to the arena's holder.
    #: Off by default until the GPU run proves it; where it cannot be used the buffers are
    #: allocated and freed as before and ``Residency.handover_note`` says why
    handover: bool = False
