"""The in-place path's host shadow: the GGUF file bytes of every released weight tensor, in host
memory, from which a restore uploads them (step 3 of residency/inplace.py).

``set_tensor`` repacks the bytes where the buffer type wants it; the shadow is pinned where asked,
filled with parallel reads and spot-checked against the loaded weights: at attach, or
(``defer_shadow``) later by :meth:`Shadow.fill`, in slices: pinning and reading a model's
weights takes seconds on an 8B model, which a request waiting for a just-started worker need not
wait for, nor another model whose turn makes this one release before its shadow is built (the
release then spot-checks the slices left against the file, :meth:`Shadow.check_pending`, and
they are read from the file afterwards).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ModelFileChangedError, ModelFileError
from ..util.fileid import FileId
from . import _ggml
from .hostmem import HostMemory, ReadRange, parallel_read
from .plan import WeightBuffer, WeightTensor, plain_copy
from .unsupported import InPlaceUnsupportedError

log = logging.getLogger(__name__)

_VERIFY_BYTES = 4096


@dataclass
class _Build:
    """A host shadow under construction: its memory (segments allocated one slice at a time) and
    what each slice must do once allocated (zero the gaps, read the tensors, spot-check them)."""

    mem: HostMemory
    ranges: list[ReadRange]  # the file's bytes of every tensor, by shadow offset
    gaps: list[tuple[int, int]]  # (offset, length) of the alignment gaps and padding (zeros)
    tensors: list[tuple[WeightBuffer, WeightTensor]]  # the tensors to spot-check
    sliced: bool  # one segment per slice (deferred), or every segment in one slice
    #: a release came before the build was done: the tensors of the slices left were checked
    #: against the file then (the weights they would be compared with are gone now), and the file
    #: must still be this one when each of them is read
    from_file: FileId | None = None
    slices: int = 0  # slices built
    alloc_s: float = 0.0
    read_s: float = 0.0
    verify_s: float = 0.0


class Shadow:
    """Owns the host shadow of one model's released weight buffers: its layout (each tensor's
    ``shadow_offset``, each buffer's ``mirror`` / ``shadow_base`` / ``whole``), its memory, its
    build in slices and the spot checks against the loaded weights and the file. Not
    thread-safe: the in-place path's caller is its only caller (uploads read its memory)."""

    def __init__(
        self,
        path: str,
        file_id: FileId,
        buffers: list[WeightBuffer],
        layout: _ggml.TensorLayout,
        gpu: _ggml.Device | None,
        *,
        want_pinned: bool,
        verify: bool,
        coalesce: bool,
        slice_bytes: int | None,
    ) -> None:
        """``file_id``: the file the weights were loaded from (just before): what a shadow built
        after a release must still read. ``slice_bytes``: a deferred shadow is built in slices
        of at most this many bytes (None: at once)."""
        self.path = path
        self._file_id = file_id
        self._buffers = buffers
        self._layout = layout
        self._gpu = gpu
        self._want_pinned = want_pinned
        self._verify = verify
        self._coalesce = coalesce
        self._slice_bytes = slice_bytes
        self._mem: HostMemory | None = None
        self._build: _Build | None = None
        self._whole_ctx = 0
        self._slices = (0, 0)
        #: milliseconds of the shadow's steps (alloc, read, verify; pin), for attach_steps
        self.steps: dict[str, float] = {}
        self.note = ""
        self.verified_tensors = 0
        #: tensors of repacking buffers checked by repacking their file bytes (_verify_repacked)
        self.verified_repacked = 0
        self.fill_s = 0.0

    @property
    def pending(self) -> bool:
        """The host shadow is deferred and not filled yet (see :meth:`fill`)."""
        return self._mem is None

    @property
    def from_file(self) -> bool:
        """A release came while the shadow was pending: its slices left are read from the file
        alone (:meth:`check_pending`)."""
        return self._build is not None and self._build.from_file is not None

    @property
    def memory(self) -> HostMemory:
        """The host shadow, filled now (all of its slices) if it was deferred: a restore cannot
        wait for seconds of pinning, so the slices left go to pageable memory (pinned later by
        :meth:`pin`)."""
        mem = self.fill(pin=False)
        assert mem is not None  # no stop: built to the end
        return mem

    @property
    def slices(self) -> tuple[int, int]:
        """(built, total) slices of the host shadow: (0, 0) before its build started."""
        if self._build is not None:
            return self._build.slices, self._build.mem.n_segments
        if self._mem is not None:
            return self._slices
        return 0, 0

    def fill(self, stop: Callable[[], bool] | None = None, pin: bool = True) -> HostMemory | None:
        """Allocate the host shadow, fill it from the file and spot-check it against the loaded
        weights (which must be resident: nothing is released before the shadow exists); once. A
        deferred shadow is built in slices (``shadow_slice_bytes`` each: allocation, read, spot
        check); ``stop`` is asked after each slice, and True leaves the rest for a later call
        (returns None then; the shadow stays pending). ``pin`` False (a release that cannot wait
        for the pinning, seconds on an 8B model): the slices left go to pageable memory, pinned
        later by :meth:`pin`. A file that no longer holds the loaded weights raises
        ModelFileError and leaves no shadow (a later call starts again). After a release
        (:meth:`check_pending`) the slices left are read from the file alone, which must
        still be the one checked then (ModelFileError otherwise, the shadow still pending)."""
        if self._mem is not None:
            return self._mem
        build = self._build
        try:
            if build is None:
                self.verified_tensors = self.verified_repacked = 0
                build = self._build = self._plan(self._want_pinned)
            while not build.mem.complete:
                self._build_slice(build, pin)
                if not build.mem.complete and stop is not None and stop():
                    return None
        except ModelFileError:
            if build is not None and build.from_file is not None:
                raise  # the weights are released: what was built stays (the file may come back)
            self._build = None
            if build is not None:
                build.mem.close()
            raise
        except BaseException:
            self._build = None
            if build is not None:
                build.mem.close()
            raise
        self._build = None
        mem = build.mem
        self._mem = mem
        self._slices = (build.slices, build.mem.n_segments)
        self.steps["shadow_alloc_ms"] = build.alloc_s * 1000.0
        self.steps["shadow_read_ms"] = build.read_s * 1000.0
        self.steps["verify_ms"] = build.verify_s * 1000.0
        self.fill_s = build.read_s
        self.note = mem.note
        log.info(
            "host shadow: %.1f MB, read in %.3f s (%.2f GB/s), %d allocation(s) in %d slice(s), pinned=%s",
            mem.size / 1e6,
            build.read_s,
            mem.size / 1e9 / max(build.read_s, 1e-9),
            len(mem.segments),
            build.slices,
            mem.pinned,
        )
        return mem

    @property
    def to_pin(self) -> int:
        """Segments of a complete shadow that a release made pageable, still to be pinned."""
        return self._mem.to_pin if self._mem is not None else 0

    def pin(self, stop: Callable[[], bool] | None = None) -> bool:
        """Pin the segments a release made pageable, one per step (allocation and copy; the
        shadow stays complete throughout, so nothing ever waits for this); ``stop`` is asked
        after each. True when none is left. No upload may read the shadow meanwhile (pinning
        replaces the segments they read from)."""
        mem = self._mem
        if mem is None:
            return True
        t0 = time.perf_counter()
        while mem.pin_next():
            if mem.to_pin and stop is not None and stop():
                break
        self.steps["shadow_pin_ms"] = (
            self.steps.get("shadow_pin_ms", 0.0) + (time.perf_counter() - t0) * 1000.0
        )
        self.note = mem.note
        return mem.to_pin == 0

    def _plan(self, want_pinned: bool) -> _Build:
        """Lay the shadow out (each tensor's place in it and in the file) and plan its host
        memory's segments, allocating none yet: per buffer (a mirrored buffer uploads in one copy
        per segment), or, for a deferred shadow, per slice of at most ``_slice_bytes`` cut at
        tensor boundaries."""
        meta = _ggml.gguf_open_meta(self.path)
        if meta is None:
            raise ModelFileError(f"{self.path} is not a readable GGUF file: re-download it")
        try:
            data_off = int(_ggml.gguf_get_data_offset(meta))
            file_size = os.path.getsize(self.path)
            ranges: list[ReadRange] = []
            parts: list[int] = []  # the shadow of each buffer: no upload or read straddles two
            units: list[int] = []  # each tensor's span: no read or spot check straddles two
            offset = 0
            for b in self._buffers:
                b.mirror = self._coalesce and plain_copy(b.buft_name)
                b.shadow_base = offset
                for t in b.tensors:
                    tid = int(_ggml.gguf_find_tensor(meta, t.name.encode()))
                    if tid < 0:
                        raise InPlaceUnsupportedError(
                            f"tensor {t.name} of the loaded model is not in {self.path}"
                        )
                    size = int(_ggml.gguf_get_tensor_size(meta, tid))
                    if size != t.nbytes:
                        raise InPlaceUnsupportedError(
                            f"tensor {t.name} has {t.nbytes} bytes in the model but {size} in the file "
                            "(converted at load time)"
                        )
                    src = data_off + int(_ggml.gguf_get_tensor_offset(meta, tid))
                    if src + size > file_size:
                        raise ModelFileError(
                            f"{self.path} is truncated: tensor {t.name} ends at byte {src + size} but "
                            f"the file has {file_size} bytes; re-download it"
                        )
                    if b.mirror:
                        t.shadow_offset = b.shadow_base + t.offset
                    else:
                        t.shadow_offset = offset
                        offset += size
                        units.append(size)
                    ranges.append(ReadRange(src, t.shadow_offset, size))
                if b.mirror:
                    offset = b.shadow_base + b.size
                    cuts = sorted({0, *(t.offset for t in b.tensors if 0 < t.offset < b.size)})
                    units.extend(hi - lo for lo, hi in zip(cuts, [*cuts[1:], b.size], strict=True))
                parts.append(offset - b.shadow_base)
        finally:
            _ggml.gguf_free(meta)
        gaps: list[tuple[int, int]] = []
        for b in self._buffers:  # alignment gaps and padding of a mirrored buffer upload as zeros
            if b.mirror:
                pos = 0
                for t in sorted(b.tensors, key=lambda x: x.offset):
                    if t.offset > pos:
                        gaps.append((b.shadow_base + pos, t.offset - pos))
                    pos = max(pos, t.offset + t.nbytes)
                if b.size > pos:
                    gaps.append((b.shadow_base + pos, b.size - pos))
        sliced = self._slice_bytes is not None
        mem = HostMemory(
            offset,
            want_pinned,
            units if sliced else parts,
            self._gpu,
            max_segment=self._slice_bytes,
            lazy=True,
        )
        try:
            if not self._whole_ctx:
                self._make_whole_tensors()
        except BaseException:
            mem.close()
            raise
        verify: list[tuple[WeightBuffer, WeightTensor]] = []
        if self._verify:
            for b in self._buffers:
                if not b.buft_name.endswith("_REPACK"):
                    verify.extend((b, t) for t in b.tensors)
                elif b.tensors:  # repacking its file bytes costs a scratch copy: its first and last
                    by_offset = sorted(b.tensors, key=lambda x: x.offset)
                    verify.extend((b, t) for t in {id(x): x for x in (by_offset[0], by_offset[-1])}.values())
        return _Build(mem, sorted(ranges, key=lambda r: r.mem_offset), gaps, verify, sliced)

    def check_pending(self) -> int:
        """Before a release that comes while the host shadow is still to be built (deferred, maybe
        half built): spot-check the tensors of the slices not built yet against the file -- the
        first and last bytes of each, read from the file and from the loaded weights -- so that
        they can be read from the file alone later (idle, or by the next restore), rather than
        before this release (seconds of reading and pinning an 8B model that the model asking for
        the GPU would wait for). Returns the tensors checked (0: no shadow pending). Raises
        ModelFileError when the file no longer holds the loaded weights (nothing changed: the
        release must not go on)."""
        if self._mem is not None:
            return 0
        build = self._build
        if build is None:
            self.verified_tensors = self.verified_repacked = 0
            build = self._build = self._plan(self._want_pinned)
        if build.from_file is not None:
            return 0
        try:
            file_id = FileId.of(self.path)
        except OSError as exc:
            raise ModelFileError(f"{self.path} is gone ({exc.strerror}): restart the model") from exc
        lo = build.mem.allocated_end
        # (a repacking buffer cannot read its tensors back as file bytes: its spot check needs
        # the shadow, see _verify_repacked)
        left = [
            (b, t) for b, t in build.tensors if t.shadow_offset >= lo and not b.buft_name.endswith("_REPACK")
        ]
        src = {r.mem_offset: r.file_offset for r in build.ranges}
        t0 = time.perf_counter()
        if file_id != self._file_id:
            raise self._changed(left[0][1].name if left else "?")
        scratch = (ctypes.c_char * _VERIFY_BYTES)()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise ModelFileError(f"cannot read the weights of {self.path}: {exc}") from exc
        try:
            for _b, t in left:
                n = min(_VERIFY_BYTES, t.nbytes)
                for off in {0, t.nbytes - n}:
                    _ggml.tensor_get(t.ptr, scratch, off, n)
                    if ctypes.string_at(scratch, n) != os.pread(fd, n, src[t.shadow_offset] + off):
                        raise self._changed(t.name)
        except OSError as exc:
            raise ModelFileError(f"cannot read the weights of {self.path}: {exc}") from exc
        finally:
            os.close(fd)
        build.verify_s += time.perf_counter() - t0
        self.verified_tensors += len(left)
        build.tensors = [(b, t) for b, t in build.tensors if t.shadow_offset < lo]
        build.from_file = file_id
        return len(left)

    def _changed(self, name: str) -> ModelFileError:
        return ModelFileError(
            f"{self.path} no longer holds the weights the model was loaded from "
            f"(tensor {name} differs): the file was replaced or modified after loading; "
            "restart the model"
        )

    def _build_slice(self, build: _Build, pin: bool = True) -> None:
        """Allocate the next slice's segment (all of them, unsliced), zero its gaps, read its
        tensors from the file and spot-check them against the loaded weights (after a release:
        check that the file is still the one they were checked against then)."""
        mem = build.mem
        if build.from_file is not None:
            try:
                same = FileId.of(self.path) == build.from_file
            except OSError:
                same = False
            if not same:
                raise ModelFileChangedError(
                    f"{self.path} was replaced or modified after the model was loaded, and its "
                    "released weights were to be read from it: restart the model"
                )
        t0 = time.perf_counter()
        spans: list[tuple[int, int]] = []
        while (got := mem.allocate_next(pin)) is not None:
            spans.append(got)
            if build.sliced:
                break
        lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
        t1 = time.perf_counter()
        build.alloc_s += t1 - t0
        for off, n in build.gaps:
            if lo <= off < hi:
                ctypes.memset(mem.address(off, n), 0, n)
        mine = [r for r in build.ranges if lo <= r.mem_offset < hi]
        try:
            parallel_read(self.path, mem, sorted(mine, key=lambda r: r.file_offset))
        except (OSError, EOFError) as exc:
            raise ModelFileError(f"cannot read the weights of {self.path}: {exc}") from exc
        t2 = time.perf_counter()
        build.read_s += t2 - t1
        self.verified_tensors += self._verify_tensors(
            mem, [(b, t) for b, t in build.tensors if lo <= t.shadow_offset < hi]
        )
        build.verify_s += time.perf_counter() - t2
        build.slices += 1

    def _make_whole_tensors(self) -> None:
        mirrored = [b for b in self._buffers if b.mirror]
        if not mirrored:
            return
        ctx = _ggml.ggml_init(_ggml.GgmlInitParams(len(mirrored) * 1024 + 4096, None, True))
        if not ctx:
            raise InPlaceUnsupportedError("ggml_init failed")
        self._whole_ctx = int(ctx)
        for b in mirrored:
            b.whole = int(_ggml.ggml_new_tensor_1d(ctx, _ggml.GGML_TYPE_I8, b.size))

    def _verify_tensors(self, mem: HostMemory, tensors: list[tuple[WeightBuffer, WeightTensor]]) -> int:
        """Compare the first and last bytes of each of ``tensors`` (readable ones: repacked
        layouts cannot be read back as file bytes) with the shadow: the file on disk must still
        be the one the model was loaded from."""
        checked = 0
        scratch = (ctypes.c_char * _VERIFY_BYTES)()
        for b, t in tensors:
            if b.buft_name.endswith("_REPACK"):  # counted apart: only a few of them are checked
                self._verify_repacked(b, t, mem)
                self.verified_repacked += 1
                continue
            n = min(_VERIFY_BYTES, t.nbytes)
            for off in {0, t.nbytes - n}:
                _ggml.tensor_get(t.ptr, scratch, off, n)
                if ctypes.string_at(scratch, n) != ctypes.string_at(mem.address(t.shadow_offset + off, n), n):
                    raise self._changed(t.name)
            checked += 1
        return checked

    def _verify_repacked(self, b: WeightBuffer, t: WeightTensor, mem: HostMemory) -> None:
        """A tensor of a repacking buffer (CPU_REPACK: its bytes are not the file's, and the
        buffer cannot read them back): repack its file bytes from the shadow into a scratch tensor
        of the same type, shape and buffer type, and compare the first and last bytes of both
        (host memory, read directly)."""
        lay = self._layout
        ne = (ctypes.c_int64 * 4)(
            *(ctypes.c_int64.from_address(t.ptr + lay.ne + 8 * i).value for i in range(4))
        )
        gtype = ctypes.c_int32.from_address(t.ptr).value  # ggml_tensor.type: the first field
        ctx = _ggml.ggml_init(_ggml.GgmlInitParams(int(_ggml.ggml_tensor_overhead()) * 2 + 256, None, True))
        if not ctx:
            raise InPlaceUnsupportedError("ggml_init failed")
        buf = 0
        try:
            copy = _ggml.ggml_new_tensor(ctx, gtype, 4, ne)
            buf = int(_ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, b.buft) or 0)
            if not copy or not buf or int(_ggml.ggml_nbytes(copy)) != t.nbytes:
                raise InPlaceUnsupportedError(
                    f"cannot make a {b.buft_name} scratch copy of {t.name} to check it"
                )
            _ggml.tensor_set(copy, mem.address(t.shadow_offset, t.nbytes), 0, t.nbytes)
            mine, loaded = _ggml.read_ptr(copy + lay.data), _ggml.read_ptr(t.ptr + lay.data)
            n = min(_VERIFY_BYTES, t.nbytes)
            for off in {0, t.nbytes - n}:
                if ctypes.string_at(mine + off, n) != ctypes.string_at(loaded + off, n):
                    raise self._changed(t.name)
        finally:
            if buf:
                _ggml.buffer_free(buf)
            _ggml.ggml_free(ctx)

    def close(self) -> None:
        if self._mem is not None:
            self._mem.close()
            self._mem = None
        if self._build is not None:
            self._build.mem.close()
            self._build = None
        if self._whole_ctx:
            _ggml.ggml_free(self._whole_ctx)
            self._whole_ctx = 0
