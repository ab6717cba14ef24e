"""One worker's buffers mapped from chunks of handed-over memory (issue 40).

Each buffer (a key the caller chooses) gets an address range reserved once, at its first
mapping, of ⌈size / chunk⌉ chunks, and kept until :meth:`HandedMemory.close`: a buffer mapped
again comes back at the same address. A mapping takes chunks from the source (the arena's
holder: any model's memory), creates what the source lacked (counted: :attr:`ChunkDevice.creates`)
and hands those to the source too, maps every chunk in place, sets access once and drops its
own handles (the mapping keeps the memory). Unmapping unmaps each chunk and puts them back.

Without a source, or when the source fails (the holder is gone or refused), the chunks are this
process's own: created at the mapping, freed at the unmapping (as an allocation and a free).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

from .device import ChunkDevice, ChunkDeviceError, ChunkSource

log = logging.getLogger(__name__)


@dataclass
class _Range:
    address: int
    chunks: int  # chunks the range holds
    nbytes: int  # what the buffer asked for
    ids: list[int] = field(default_factory=list)  # the source's ids of the mapped chunks (0: own)
    mapped: bool = False


@dataclass
class MapReport:
    """What one :meth:`HandedMemory.map_all` did."""

    chunks: int = 0
    handed: int = 0  # chunks taken from the source (someone else's memory, nothing allocated)
    created: int = 0  # chunks allocated here (the device's create)
    adopted: int = 0  # created ones the source holds too
    ms: float = 0.0
    note: str = ""  # why the source was not used, when it was not


class HandedMemory:
    """The mapped ranges of one worker. Not thread-safe: the worker's loop thread calls it."""

    def __init__(self, device: ChunkDevice, source: ChunkSource | None, chunk_bytes: int) -> None:
        if chunk_bytes <= 0 or chunk_bytes % device.granularity:
            raise ValueError(
                f"a chunk of {chunk_bytes} bytes is not a multiple of the device's granularity "
                f"({device.granularity})"
            )
        self.device = device
        self.source = source
        self.chunk_bytes = chunk_bytes
        self._ranges: dict[int, _Range] = {}
        self.source_note = ""  # why the source is not used now ("" while it is)
        # totals since start
        self.handed_chunks = 0
        self.created_chunks = 0
        self.put_chunks = 0
        self.last = MapReport()

    def chunks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.chunk_bytes))

    def address(self, key: int) -> int:
        return self._ranges[key].address

    def mapped(self, key: int) -> bool:
        r = self._ranges.get(key)
        return r is not None and r.mapped

    @property
    def mapped_bytes(self) -> int:
        return sum(r.chunks for r in self._ranges.values() if r.mapped) * self.chunk_bytes

    @property
    def padding_bytes(self) -> int:
        """Bytes mapped beyond what the buffers asked for (the last chunk of each)."""
        return sum(r.chunks * self.chunk_bytes - r.nbytes for r in self._ranges.values() if r.mapped)

    def _range(self, key: int, nbytes: int) -> _Range:
        r = self._ranges.get(key)
        n = self.chunks_for(nbytes)
        if r is not None and r.chunks < n:  # grew (never, for weights): a new, larger range
            if r.mapped:
                raise ValueError(f"buffer {key} is mapped")
            self.device.free_reserve(r.address, r.chunks * self.chunk_bytes)
            del self._ranges[key]
            r = None
        if r is None:
            r = _Range(self.device.reserve(n * self.chunk_bytes), n, nbytes)
            self._ranges[key] = r
        r.nbytes = nbytes
        return r

    def map_all(self, wanted: list[tuple[int, int]]) -> MapReport:
        """Map the buffers ``wanted`` ((key, nbytes) each, none mapped now): the chunks they need
        are taken from the source in one request, the rest created. Returns what it did
        (:attr:`last`); raises ChunkDeviceError (``out_of_memory`` when creating failed) with
        nothing mapped and every chunk taken given back."""
        t0 = time.perf_counter()
        ranges = [self._range(key, nbytes) for key, nbytes in wanted]
        for key, _n in wanted:
            if self._ranges[key].mapped:
                raise ValueError(f"buffer {key} is mapped already")
        need = sum(r.chunks for r in ranges)
        report = MapReport(chunks=need)
        handles: list[int] = []
        ids: list[int] = []
        created: list[int] = []  # handles of the chunks created here
        taken = self._take(need, report)
        adopted: list[int] = []
        try:
            try:
                for chunk_id, fd in taken:
                    handles.append(self.device.import_fd(fd))
                    ids.append(chunk_id)
            finally:
                for _i, fd in taken:
                    os.close(fd)
            report.handed = len(handles)
            while len(handles) < need:
                h = self.device.create(self.chunk_bytes)
                handles.append(h)
                created.append(h)
                ids.append(0)
            report.created = len(created)
            if created:
                adopted = self._adopt(created, report)
                ids[len(ids) - len(created) :] = adopted
            pos = 0
            placed: list[int] = []  # addresses mapped so far
            try:
                for r in ranges:
                    for i in range(r.chunks):
                        at = r.address + i * self.chunk_bytes
                        self.device.map(at, self.chunk_bytes, handles[pos])
                        placed.append(at)
                        pos += 1
                    self.device.set_access(r.address, r.chunks * self.chunk_bytes)
            except BaseException:
                for at in placed:
                    with contextlib.suppress(ChunkDeviceError):
                        self.device.unmap(at, self.chunk_bytes)
                raise
        except BaseException:
            for h in handles:
                with contextlib.suppress(ChunkDeviceError, OSError):
                    self.device.release(h)
            self._put([i for i, _fd in taken] + [i for i in adopted if i], keep=True)
            raise
        for h in handles:  # the mappings keep the memory
            self.device.release(h)
        pos = 0
        for r in ranges:
            r.ids = ids[pos : pos + r.chunks]
            r.mapped = True
            pos += r.chunks
        self.handed_chunks += report.handed
        self.created_chunks += report.created
        report.ms = (time.perf_counter() - t0) * 1000.0
        self.last = report
        return report

    def unmap(self, keys: list[int], keep: bool = True) -> int:
        """Unmap the buffers ``keys`` and put their chunks back (``keep`` False: the source closes
        them, e.g. this process's last release). Returns the chunks unmapped."""
        ids: list[int] = []
        n = 0
        if any(self.mapped(k) for k in keys):
            self.device.synchronize()
        for key in keys:
            r = self._ranges.get(key)
            if r is None or not r.mapped:
                continue
            self._unmap_chunks(r)
            ids.extend(i for i in r.ids if i)
            n += r.chunks
            r.ids = []
            r.mapped = False
        self._put(ids, keep)
        return n

    def close(self, keep: bool = False) -> None:
        """Unmap everything (put back: ``keep`` says whether the source keeps it) and give the
        address ranges back."""
        self.unmap([k for k, r in self._ranges.items() if r.mapped], keep=keep)
        for r in self._ranges.values():
            with contextlib.suppress(ChunkDeviceError):
                self.device.free_reserve(r.address, r.chunks * self.chunk_bytes)
        self._ranges.clear()

    # -- the source ----------------------------------------------------------------------------

    def _unmap_chunks(self, r: _Range) -> None:
        for i in range(r.chunks):
            self.device.unmap(r.address + i * self.chunk_bytes, self.chunk_bytes)

    def _take(self, n: int, report: MapReport) -> list[tuple[int, int]]:
        if self.source is None:
            report.note = self.source_note = self.source_note or "no hand-over holder"
            return []
        try:
            got = self.source.take(n)
        except Exception as exc:  # the arena's HandoverError, an OSError: own memory this time
            report.note = self.source_note = f"the hand-over holder could not be used: {exc}"
            log.warning("%s", report.note)
            return []
        self.source_note = ""
        return got

    def _adopt(self, handles: list[int], report: MapReport) -> list[int]:
        if self.source is None or self.source_note:
            return [0] * len(handles)
        fds = [self.device.export(h) for h in handles]
        try:
            ids = self.source.adopt(fds)
        except Exception as exc:
            report.note = self.source_note = f"the hand-over holder could not be used: {exc}"
            log.warning("%s", report.note)
            return [0] * len(handles)
        finally:
            for fd in fds:
                os.close(fd)
        report.adopted = len(ids)
        return ids

    def _put(self, ids: list[int], keep: bool) -> None:
        if not ids or self.source is None:
            return
        try:
            self.source.put(ids, keep)
            self.put_chunks += len(ids)
        except Exception as exc:
            # the holder is gone (its fds closed: the unmapping freed the memory) or refused
            self.source_note = f"the hand-over holder could not be used: {exc}"
            log.warning("putting %d chunk(s) back failed: %s", len(ids), exc)
