"""Host->device copies done by the GPU's SMs, beside the copy engine (CUDA only; issue 28, item 3).
A lab tool: ``copy_penalty_probe.py`` beside it loads it on its own (no package import).

Measured on the H200 (``scripts/lab/copy_penalty_probe.py``): after any ``cudaFree`` of N bytes,
in any process, the NVIDIA driver clears the freed memory on a copy engine for a while (~15-20 ms
for 4.22 GB), and every host->device copy engine transfer in that window runs slower: a 4.22 GB
copy takes 86 ms instead of 76 ms, into fresh or old memory alike, with a memset first or on two
streams. A switch always copies right after the other model freed its weights, so it always pays.
A copy done by a kernel that reads the pinned host memory over the bus (zero-copy) does not use a
copy engine: 82.2 ms for the same bytes, free or no free. The idea was to run it beside the copy
engine (each part's first ``share`` of bytes by the kernel, the rest by ggml's own copy) so that
the two fill the bus while the engine is slowed.

**Measured, it does not pay** (H200, one run, docs/lab/HISTORY.md "fifth session"): the two
share the bus rather than add up, so a one-model switched turn took 98.5 ms with share 0, 99.0
with 0.25 and 101.0 with 0.5; a synchronous restore 86.7 vs 88.5 ms (0.5); the F16 8B's restore
and first decode 300.9 vs 314.9 ms (0.5); bitwise in every case. The restore lane that used it
(``TIMESHARE_UPLOAD_SM_SHARE``, off by default) left the product in the architecture pass
(issue 37); this module stays for the probe.

:class:`KernelCopier` launches that kernel (PTX in this file, JIT-compiled by the driver: no CUDA
toolkit needed) on its own stream through the CUDA driver API (``libcuda.so.1``); it is only
made for CUDA device buffers and pinned host memory.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from ctypes import byref, c_int, c_uint, c_uint64, c_void_p

log = logging.getLogger(__name__)

#: a copy smaller than this goes through ggml alone (a kernel launch is not worth it)
MIN_SPLIT_BYTES = 4 << 20
_ALIGN = 4096
#: the grid: 4 blocks of 256 threads per SM (on the H200, 528 x 256 up to 4,224 x 128 blocks all
#: copied 4.22 GB in 82.1-82.6 ms: the bus, not the grid, sets the pace)
_BLOCKS_PER_SM = 4
_THREADS = 256

#: ``dst[i] = src[i]`` over n 16-byte words, grid-stride, four loads in flight per thread
#: (nvcc -ptx -arch=compute_75 of a 9-line kernel, the version lowered to 6.0 and the target to
#: sm_52: it uses no instruction newer than those).
_PTX = rb"""
.version 6.0
.target sm_52
.address_size 64

.visible .entry timeshare_copy16(
	.param .u64 timeshare_copy16_param_0,
	.param .u64 timeshare_copy16_param_1,
	.param .u64 timeshare_copy16_param_2
)
{
	.reg .pred 	%p<5>;
	.reg .b32 	%r<45>;
	.reg .b64 	%rd<46>;

	ld.param.u64 	%rd19, [timeshare_copy16_param_0];
	ld.param.u64 	%rd20, [timeshare_copy16_param_1];
	ld.param.u64 	%rd18, [timeshare_copy16_param_2];
	cvta.to.global.u64 	%rd1, %rd20;
	cvta.to.global.u64 	%rd2, %rd19;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	cvt.u64.u32 	%rd3, %r2;
	mul.wide.u32 	%rd21, %r1, %r2;
	mov.u32 	%r3, %tid.x;
	cvt.u64.u32 	%rd22, %r3;
	add.s64 	%rd44, %rd21, %rd22;
	mov.u32 	%r4, %nctaid.x;
	cvt.u64.u32 	%rd5, %r4;
	mul.wide.u32 	%rd6, %r4, %r2;
	mul.lo.s64 	%rd7, %rd6, 3;
	add.s64 	%rd23, %rd44, %rd7;
	setp.ge.u64 	%p1, %rd23, %rd18;
	@%p1 bra 	$L__BB0_3;

	mul.lo.s64 	%rd24, %rd5, %rd3;
	shl.b64 	%rd8, %rd24, 4;
	shl.b64 	%rd25, %rd44, 4;
	add.s64 	%rd43, %rd1, %rd25;
	neg.s64 	%rd10, %rd24;
	shl.b64 	%rd33, %rd10, 4;

$L__BB0_2:
	shl.b64 	%rd26, %rd44, 4;
	add.s64 	%rd27, %rd2, %rd26;
	shl.b64 	%rd28, %rd6, 2;
	shl.b64 	%rd29, %rd6, 4;
	add.s64 	%rd30, %rd27, %rd29;
	ld.global.nc.v4.u32 	{%r5, %r6, %r7, %r8}, [%rd30];
	add.s64 	%rd31, %rd30, %rd8;
	ld.global.nc.v4.u32 	{%r13, %r14, %r15, %r16}, [%rd31];
	add.s64 	%rd32, %rd31, %rd8;
	ld.global.nc.v4.u32 	{%r21, %r22, %r23, %r24}, [%rd32];
	add.s64 	%rd34, %rd30, %rd33;
	ld.global.nc.v4.u32 	{%r29, %r30, %r31, %r32}, [%rd34];
	st.global.v4.u32 	[%rd43], {%r29, %r30, %r31, %r32};
	add.s64 	%rd35, %rd43, %rd8;
	st.global.v4.u32 	[%rd35], {%r5, %r6, %r7, %r8};
	add.s64 	%rd36, %rd35, %rd8;
	st.global.v4.u32 	[%rd36], {%r13, %r14, %r15, %r16};
	add.s64 	%rd37, %rd36, %rd8;
	add.s64 	%rd43, %rd37, %rd8;
	st.global.v4.u32 	[%rd37], {%r21, %r22, %r23, %r24};
	add.s64 	%rd44, %rd28, %rd44;
	add.s64 	%rd38, %rd44, %rd7;
	setp.lt.u64 	%p2, %rd38, %rd18;
	@%p2 bra 	$L__BB0_2;

$L__BB0_3:
	setp.ge.u64 	%p3, %rd44, %rd18;
	@%p3 bra 	$L__BB0_5;

$L__BB0_4:
	shl.b64 	%rd39, %rd44, 4;
	add.s64 	%rd40, %rd2, %rd39;
	add.s64 	%rd41, %rd1, %rd39;
	ld.global.nc.v4.u32 	{%r37, %r38, %r39, %r40}, [%rd40];
	st.global.v4.u32 	[%rd41], {%r37, %r38, %r39, %r40};
	add.s64 	%rd44, %rd44, %rd6;
	setp.lt.u64 	%p4, %rd44, %rd18;
	@%p4 bra 	$L__BB0_4;

$L__BB0_5:
	ret;

}
"""

_CUDA_BUFT = re.compile(r"^CUDA(\d+)$")
_CU_STREAM_NON_BLOCKING = 1
_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


def split_point(n: int, share: float) -> int:
    """Bytes of an ``n``-byte copy the kernel takes: ``share`` of it rounded down to 4 KiB, or 0
    when the copy is smaller than MIN_SPLIT_BYTES."""
    if n < MIN_SPLIT_BYTES or share <= 0.0:
        return 0
    return int(n * share) // _ALIGN * _ALIGN


def cuda_device_of(buft_name: str) -> int | None:
    """The CUDA ordinal of a ggml CUDA device buffer type ("CUDA0" -> 0); None for anything else."""
    m = _CUDA_BUFT.match(buft_name)
    return int(m.group(1)) if m else None


class KernelCopyError(RuntimeError):
    """A driver call of the kernel lane failed (the message names it and its CUresult)."""


class KernelCopier:
    """The copy kernel on device ``ordinal``, launched on a stream of its own; ``copy`` queues a
    copy and returns, ``wait`` blocks until every queued copy is done. Used from one thread at a
    time (the upload thread); the context is made current on each thread that uses it."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self._cu = ctypes.CDLL("libcuda.so.1")
        self._check(self._cu.cuInit(0), "cuInit")
        dev = c_int()
        self._check(self._cu.cuDeviceGet(byref(dev), ordinal), "cuDeviceGet")
        self._ctx = c_void_p()
        self._check(self._cu.cuDevicePrimaryCtxRetain(byref(self._ctx), dev), "cuDevicePrimaryCtxRetain")
        self._dev = dev
        self._bound: set[int] = set()
        self._bind()
        sms = c_int()
        self._check(
            self._cu.cuDeviceGetAttribute(byref(sms), _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
            "cuDeviceGetAttribute",
        )
        self.blocks = max(1, sms.value) * _BLOCKS_PER_SM
        self._mod = c_void_p()
        self._check(self._cu.cuModuleLoadData(byref(self._mod), _PTX), "cuModuleLoadData (PTX JIT)")
        self._fn = c_void_p()
        self._check(
            self._cu.cuModuleGetFunction(byref(self._fn), self._mod, b"timeshare_copy16"),
            "cuModuleGetFunction",
        )
        self._stream = c_void_p()
        self._check(
            self._cu.cuStreamCreate(byref(self._stream), c_uint(_CU_STREAM_NON_BLOCKING)), "cuStreamCreate"
        )
        self._dev_ptr: dict[int, int] = {}

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise KernelCopyError(f"{what} failed (CUresult {rc})")

    def _bind(self) -> None:
        tid = threading.get_ident()
        if tid not in self._bound:
            self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._bound.add(tid)

    def device_pointer(self, host_base: int) -> int:
        """The device address of pinned host memory allocated at ``host_base`` (cached)."""
        got = self._dev_ptr.get(host_base)
        if got is None:
            self._bind()
            p = c_uint64()
            self._check(
                self._cu.cuMemHostGetDevicePointer_v2(byref(p), c_void_p(host_base), 0),
                "cuMemHostGetDevicePointer",
            )
            got = self._dev_ptr[host_base] = int(p.value)
        return got

    def copy(self, dst: int, src_dev: int, n: int) -> None:
        """Queue ``n`` bytes (a multiple of 16; both addresses 16-byte aligned) from ``src_dev``
        (a device address of pinned host memory) to the device address ``dst``."""
        if n % 16 or dst % 16 or src_dev % 16:
            raise ValueError("the copy kernel moves whole aligned 16-byte words")
        self._bind()
        a_s, a_d, a_n = c_uint64(src_dev), c_uint64(dst), c_uint64(n // 16)
        params = (c_void_p * 3)(
            ctypes.cast(byref(a_s), c_void_p),
            ctypes.cast(byref(a_d), c_void_p),
            ctypes.cast(byref(a_n), c_void_p),
        )
        self._check(
            self._cu.cuLaunchKernel(
                self._fn, self.blocks, 1, 1, _THREADS, 1, 1, 0, self._stream, params, None
            ),
            "cuLaunchKernel",
        )

    def wait(self) -> None:
        self._bind()
        self._check(self._cu.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
