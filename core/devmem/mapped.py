"""One worker's buffers mapped from chunks of handed-over memory (issue 40).

Each buffer (a key the caller chooses) gets an address range reserved once, at its first
mapping, of ⌈size / chunk⌉ chunks, and kept until :meth:`HandedMemory.close`: a buffer mapped
again comes back at the same address. A mapping takes chunks from the source (the arena's
holder: any model's memory), creates what the source lacked (counted: :attr:`ChunkDevice.creates`)
and hands those to the source too, maps every chunk in place, sets access once and drops its
own handles (the mapping keeps the memory).

Keeping mappings: a release (:meth:`HandedMemory.unmap` with ``keep``) does not unmap when the
source can ask the chunks back (its reclaim channel, :attr:`ChunkSource.keeps`): the range stays
mapped and its chunks are *kept* -- lent back to the arena, still mapped here. The next mapping
of that buffer maps nothing (0 map calls: the source is told the chunks are in use again). When
another worker needs the memory, the holder asks for it back and :meth:`HandedMemory.reclaim`
(on the source's thread) unmaps those ranges first; only then does the holder give the chunks
away. A range is either in use (mapped for the model) or kept; :meth:`HandedMemory.reclaim`
touches only kept ones, under the lock a restore claims them with, so a range in use is never
unmapped behind the model's back.

Keeping contents (a restore that uploads nothing): the owner says when a mapped buffer's bytes
are complete (:meth:`HandedMemory.mark_filled`, after its upload ended). A release that keeps the
range learns the holder's generation of each chunk; the next mapping names them (``take`` with
``use`` and ``gens``) and the holder vouches for the chunks still kept by this pid at those
generations. A range whose chunks are all vouched for, which stayed mapped since its release and
was filled before it, still holds the buffer's bytes: :meth:`HandedMemory.filled` says so and the
caller need not upload it. Anything else -- a range unmapped in between (asked back, a holder
gone), the holder's answer missing, a chunk not vouched for, a buffer of another size -- is not
filled: uploaded as always. Only the buffers the caller maps here live in these ranges (the
residency maps weight buffers alone: the KV cache and compute buffers are ggml's own memory).

Without a source, or when the source fails (the holder is gone or refused), the chunks are this
process's own: created at the mapping, freed at the unmapping (as an allocation and a free).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from .device import ChunkDevice, ChunkDeviceError, ChunkSource, Given

log = logging.getLogger(__name__)

#: room left on the device for others when a worker decides it may allocate chunks itself rather
#: than have the holder ask kept chunks of other workers back: this share of the device's total
#: memory, and at least ROOM_MARGIN_MIN (the auto budget's margin, core/arena/budget.py). What the
#: caller allocates right after the mapping (``map_all(later=...)``: a deep restore's new context,
#: its KV cache and compute buffers) is not room either
ROOM_MARGIN_FRACTION = 0.05
ROOM_MARGIN_MIN = 256 << 20
#: created chunks exported and handed to the source at a time (the fds open at once)
ADOPT_BATCH = 250


@dataclass
class _Range:
    address: int
    chunks: int  # chunks the range holds
    nbytes: int  # what the buffer asked for
    ids: list[int] = field(default_factory=list)  # the source's ids of the mapped chunks (0: own)
    mapped: bool = False
    #: mapped, the model released: lent back to the holder, which may ask for it back
    kept: bool = False
    session: str = ""  # the holder's session the ids belong to
    #: the mapping holds the buffer's complete bytes (the owner said so after uploading them;
    #: a kept range keeps it only while the holder vouches for every chunk at the next mapping)
    filled: bool = False
    #: the holder's generation of each chunk (as ``ids``) when the range was kept
    gens: list[int] = field(default_factory=list)


@dataclass
class MapReport:
    """What one :meth:`HandedMemory.map_all` did."""

    chunks: int = 0
    handed: int = 0  # chunks taken from the source (someone else's memory, nothing allocated)
    created: int = 0  # chunks allocated here (the device's create)
    adopted: int = 0  # created ones the source holds too
    kept: int = 0  # chunks found still mapped (kept since the release): nothing mapped for them
    #: of those, chunks of ranges still holding their buffer's bytes (the holder vouched for
    #: every chunk, the range was filled when released): nothing to upload into them
    intact: int = 0
    mapped: int = 0  # chunks mapped by this call (the device's map calls)
    #: the bytes the take said this worker may allocate itself (None: not said: nothing to take,
    #: no source, or the device cannot tell), and the caller's allocations after the mapping
    #: that were kept out of it
    room: int | None = None
    later: int = 0
    ms: float = 0.0
    note: str = ""  # why the source was not used, when it was not


class HandedMemory:
    """The mapped ranges of one worker. The worker's loop thread maps and unmaps; the source's
    reclaim thread unmaps kept ranges (:meth:`reclaim`); a lock keeps the two apart."""

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
        self._lock = threading.Lock()
        self.source_note = ""  # why the source is not used now ("" while it is)
        #: releases keep their mappings where the source can ask for them back (False: unmap
        #: at each release, as before)
        self.keep_mappings = True
        #: with :attr:`keep_mappings`, a release keeps its mappings only where the device has room
        #: for as many bytes again without them (:meth:`_room`); else they go back at once, so
        #: that the next restore takes them with no round trip to ask them back (a full card)
        self.keep_only_with_room = False
        #: a release that gives its chunks back puts them first and unmaps them afterwards, on a
        #: thread of its own, off the release's path (the releaser has synchronised: nothing of
        #: its reads or writes them; the taker may map them meanwhile, a chunk may be mapped by two
        #: processes). Any later mapping, reservation or close waits for those unmaps first
        self.lazy_unmap = False
        self._unmapping: Future[None] | None = None
        self._unmapper: ThreadPoolExecutor | None = None
        self.lazy_unmapped_chunks = 0  # chunks unmapped after their release returned
        #: what a mapping may allocate itself before the holder asks others' kept chunks back
        #: (None: the device's free memory less a margin, :meth:`_room`)
        self.room_bytes: int | None = None
        #: a kept range the holder vouches for keeps its contents (:meth:`filled`; False: never
        #: filled after a mapping, so every restore uploads every byte, as before)
        self.reuse_contents = True
        # totals since start
        self.handed_chunks = 0
        self.created_chunks = 0
        self.put_chunks = 0
        self.kept_chunks = 0  # chunks a release kept mapped
        self.reused_chunks = 0  # chunks a mapping found kept (no map call)
        self.reclaimed_chunks = 0  # kept chunks unmapped at the holder's request
        self.unkept_chunks = 0  # chunks a release gave back for want of room (keep_only_with_room)
        self.intact_chunks = 0  # kept chunks a mapping found still holding their bytes
        self.last = MapReport()
        if source is not None:
            source.serve_reclaims(self.reclaim)

    def chunks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.chunk_bytes))

    def address(self, key: int) -> int:
        return self._ranges[key].address

    def mapped(self, key: int) -> bool:
        """The buffer is mapped for its model (in use; a kept range is not)."""
        r = self._ranges.get(key)
        return r is not None and r.mapped and not r.kept

    def kept(self, key: int) -> bool:
        """The buffer's range stays mapped while its model is released."""
        r = self._ranges.get(key)
        return r is not None and r.mapped and r.kept

    def filled(self, key: int) -> bool:
        """The buffer is mapped for its model and its range holds the buffer's complete bytes:
        filled since this mapping (:meth:`mark_filled`), or kept since a filled release and
        vouched for by the holder at this mapping (nothing to upload)."""
        with self._lock:
            r = self._ranges.get(key)
            return r is not None and r.mapped and not r.kept and r.filled

    def mark_filled(self, keys: list[int]) -> None:
        """The buffers ``keys`` (mapped for the model) hold their complete bytes now: their
        uploads ended. Only the caller writes into its ranges; it says so after each upload."""
        with self._lock:
            for k in keys:
                r = self._ranges.get(k)
                if r is not None and r.mapped and not r.kept:
                    r.filled = True

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped for the model now (kept ranges not counted)."""
        return sum(r.chunks for r in self._ranges.values() if r.mapped and not r.kept) * self.chunk_bytes

    @property
    def kept_bytes(self) -> int:
        """Bytes kept mapped while the model is released (device memory no model uses)."""
        return sum(r.chunks for r in self._ranges.values() if r.mapped and r.kept) * self.chunk_bytes

    @property
    def padding_bytes(self) -> int:
        """Bytes mapped beyond what the buffers asked for (the last chunk of each)."""
        return sum(
            r.chunks * self.chunk_bytes - r.nbytes for r in self._ranges.values() if r.mapped and not r.kept
        )

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

    def _session(self) -> str:
        return self.source.session if self.source is not None else ""

    def _room(self, later: int = 0) -> int | None:
        """Bytes this worker may allocate without the holder asking others' kept chunks back:
        the device's free memory less a margin (or :attr:`room_bytes`), less ``later``, what the
        caller allocates on the device after this mapping (None: the device cannot say)."""
        later = max(0, later)
        if self.room_bytes is not None:
            return max(0, self.room_bytes - later)
        try:
            free, total = self.device.memory()
        except ChunkDeviceError:
            return None
        return max(0, free - max(ROOM_MARGIN_MIN, int(ROOM_MARGIN_FRACTION * total)) - later)

    def map_all(self, wanted: list[tuple[int, int]], later: int = 0) -> MapReport:
        """Map the buffers ``wanted`` ((key, nbytes) each, none mapped for the model now): a
        kept range is used again as it is (no map call), the chunks the others need are taken
        from the source in one request, the rest created. ``later``: the bytes the caller will
        allocate on the device right after this mapping (a deep restore's new context): the take
        does not count them as room to create chunks in, so the holder asks others' kept chunks
        back for them instead. Returns what it did (:attr:`last`); raises ChunkDeviceError
        (``out_of_memory`` when creating failed) with nothing mapped and every chunk taken given
        back."""
        t0 = time.perf_counter()
        self.settle_unmaps()
        with self._lock:
            for key, _n in wanted:
                if self.mapped(key):
                    raise ValueError(f"buffer {key} is mapped already")
            session = self._session()
            reuse: list[_Range] = []
            maybe: list[_Range] = []  # claimed ranges that still hold their bytes if vouched for
            for key, nbytes in wanted:
                r = self._ranges.get(key)
                if r is not None and r.mapped and r.kept and r.chunks >= self.chunks_for(nbytes):
                    if r.session == session:
                        r.kept = False  # claimed: reclaim() leaves it alone from here on
                        if r.filled and r.nbytes == nbytes and len(r.gens) == len(r.ids):
                            maybe.append(r)
                        r.filled = False  # until the holder vouches for every chunk
                        r.nbytes = nbytes
                        reuse.append(r)
                        continue
                    self._unmap_range(r)  # kept under a holder that is gone: its ids mean nothing
                elif r is not None and r.mapped and r.kept:
                    self._unmap_range(r)
                    self._put(list(r.ids), keep=True)
                    r.ids = []
            ranges = [self._range(key, nbytes) for key, nbytes in wanted]
            fresh = [r for r in ranges if not r.mapped]
        need = sum(r.chunks for r in fresh)
        report = MapReport(
            chunks=sum(r.chunks for r in ranges), kept=sum(r.chunks for r in reuse), later=max(0, later)
        )
        handles: list[int] = []
        ids: list[int] = []
        created: list[int] = []  # handles of the chunks created here
        use = [i for r in reuse for i in r.ids if i]
        # the generations the release learnt (-1: none, never vouched for)
        candidates = {id(r) for r in maybe}
        gens = [g for r in reuse for g in (r.gens if id(r) in candidates else [-1] * len(r.ids))]
        given = self._take(need, report, use, gens)
        taken = given.chunks
        intact = [r for r in maybe if self.reuse_contents and all(i in given.intact for i in r.ids)]
        session = self._session()
        adopted: list[int] = []
        try:
            closed = 0  # each fd is closed once imported: never two per chunk open at once
            try:
                for chunk_id, fd in taken:
                    try:
                        handles.append(self.device.import_fd(fd))
                    finally:
                        os.close(fd)
                        closed += 1
                    ids.append(chunk_id)
            finally:
                for _i, fd in taken[closed:]:
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
                for r in fresh:
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
            with self._lock:  # the kept ranges claimed go too: nothing stays mapped
                back: list[int] = []
                for r in reuse:
                    with contextlib.suppress(ChunkDeviceError):
                        self._unmap_range(r)
                    back.extend(i for i in r.ids if i)
                    r.ids = []
            self._put([i for i, _fd in taken] + [i for i in adopted if i] + back, keep=True)
            raise
        for h in handles:  # the mappings keep the memory
            self.device.release(h)
        with self._lock:
            pos = 0
            for r in fresh:
                r.ids = ids[pos : pos + r.chunks]
                r.mapped, r.kept, r.session, r.filled, r.gens = True, False, session, False, []
                pos += r.chunks
            for r in reuse:
                r.gens = []
            for r in intact:
                r.filled = True  # still the bytes of its last fill: nothing to upload
        report.mapped = need
        report.intact = sum(r.chunks for r in intact)
        self.handed_chunks += report.handed
        self.created_chunks += report.created
        self.reused_chunks += report.kept
        self.intact_chunks += report.intact
        report.ms = (time.perf_counter() - t0) * 1000.0
        self.last = report
        return report

    def unmap(self, keys: list[int], keep: bool = True, keep_mapped: bool | None = None) -> int:
        """Release the buffers ``keys``: their ranges stay mapped, kept (``keep_mapped``, by
        default :attr:`keep_mappings`, and the source can ask them back), or are unmapped and
        their chunks put back (``keep`` False: the source closes them, e.g. this process's
        last release; never kept then, and the ranges kept before are unmapped and closed too).
        Returns the chunks released."""
        keep_mapped = self.keep_mappings if keep_mapped is None else keep_mapped
        with self._lock:
            chosen = [r for k in keys if (r := self._ranges.get(k)) is not None and r.mapped and not r.kept]
            if not keep:  # the last release: what stays kept goes back to the driver too
                kept = [r for r in self._ranges.values() if r.mapped and r.kept]
                dropped = [i for r in kept for i in r.ids if i]
                for r in kept:
                    self._unmap_range(r)
                    r.ids = []
                self._put(dropped, keep=False)
            if not chosen:
                return 0
            self.device.synchronize()  # no kernel reads a released range from here on
            session = self._session()
            keeping: list[_Range] = []
            gens: list[int] = []
            if keep and keep_mapped and self.source is not None and self.source.keeps:
                keeping = [r for r in chosen if r.session == session and r.ids and all(r.ids)]
                if keeping and self.keep_only_with_room:
                    room, chunks = self._room(), sum(r.chunks for r in keeping)
                    if room is not None and room < chunks * self.chunk_bytes:
                        self.unkept_chunks += chunks
                        keeping = []
                if keeping:
                    got = self._keep([i for r in keeping for i in r.ids])
                    if got is None:
                        keeping = []
                    else:
                        gens = got
            ids: list[int] = []
            n = 0
            pos = 0
            if len(gens) != sum(len(r.ids) for r in keeping):
                gens = []  # the holder gave none (or not one per chunk): nothing is vouched for later
            later: list[tuple[int, int]] = []  # (address, chunks) unmapped after the put (lazy_unmap)
            lazy = keep and self.lazy_unmap and self.source is not None
            for r in chosen:
                n += r.chunks
                if r in keeping:
                    r.kept = True
                    # the generations the holder gave (none: the next mapping uploads it)
                    r.gens = gens[pos : pos + len(r.ids)]
                    pos += len(r.ids)
                    self.kept_chunks += r.chunks
                    continue
                if lazy:
                    r.filled, r.gens, r.mapped, r.kept = False, [], False, False
                    later.append((r.address, r.chunks))
                else:
                    self._unmap_range(r)
                ids.extend(i for i in r.ids if i)
                r.ids = []
            self._put(ids, keep)
            if later:
                self._unmap_later(later)
            return n

    def _unmap_later(self, ranges: list[tuple[int, int]]) -> None:
        """(lazy_unmap; the caller holds the lock) unmap ``ranges`` on the unmapping thread."""
        if self._unmapper is None:
            self._unmapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="handover-unmap")
        previous = self._unmapping

        def run() -> None:
            if previous is not None:
                previous.result()
            for address, chunks in ranges:
                self._unmap_chunks(address, chunks)
                self.lazy_unmapped_chunks += chunks

        self._unmapping = self._unmapper.submit(run)

    def settle_unmaps(self) -> None:
        """Wait for the unmaps a release left to the unmapping thread (lazy_unmap); an error of
        theirs is logged (the range is reserved again at the next mapping all the same)."""
        job = self._unmapping
        if job is None:
            return
        try:
            job.result()
        except ChunkDeviceError as exc:
            log.warning("a range given back could not be unmapped: %s", exc)
        finally:
            if self._unmapping is job:
                self._unmapping = None

    def reclaim(self, ids: list[int], session: str) -> list[int]:
        """The holder (session ``session``) asks kept chunks ``ids`` back: unmap each kept
        range holding one of them; the ids unmapped (whole ranges: maybe more than asked; none
        of a range a restore uses again). Called on the source's reclaim thread."""
        wanted = set(ids)
        out: list[int] = []
        with self._lock:
            for r in self._ranges.values():
                if not (r.mapped and r.kept and r.session == session and wanted.intersection(r.ids)):
                    continue
                try:
                    self._unmap_range(r)
                except ChunkDeviceError as exc:
                    log.warning("a kept range asked back could not be unmapped: %s", exc)
                    continue
                out.extend(i for i in r.ids if i)
                self.reclaimed_chunks += r.chunks
                r.ids = []
        return out

    def close(self, keep: bool = False) -> None:
        """Unmap everything, kept ranges too (put back: ``keep`` says whether the source keeps
        it) and give the address ranges back."""
        self.settle_unmaps()
        with self._lock:
            for r in self._ranges.values():
                r.kept = False  # in use again, for the unmapping below
        self.unmap([k for k, r in self._ranges.items() if r.mapped], keep=keep, keep_mapped=False)
        self.settle_unmaps()  # (lazy_unmap: the ranges are unmapped before they are freed)
        if self._unmapper is not None:
            self._unmapper.shutdown(wait=True)
            self._unmapper = None
        for r in self._ranges.values():
            with contextlib.suppress(ChunkDeviceError):
                self.device.free_reserve(r.address, r.chunks * self.chunk_bytes)
        self._ranges.clear()

    # -- the source ----------------------------------------------------------------------------

    def _unmap_range(self, r: _Range) -> None:
        """Unmap each chunk of ``r`` (the range stays reserved); the caller holds the lock."""
        r.filled, r.gens = False, []  # whatever happens next, its bytes are not vouched for
        self._unmap_chunks(r.address, r.chunks)
        r.mapped = r.kept = False

    def _unmap_chunks(self, address: int, chunks: int) -> None:
        """Unmap the ``chunks`` chunk mappings from ``address`` (one device call each)."""
        for i in range(chunks):
            self.device.unmap(address + i * self.chunk_bytes, self.chunk_bytes)

    def _take(self, n: int, report: MapReport, use: list[int], gens: list[int]) -> Given:
        if self.source is None:
            report.note = self.source_note = self.source_note or "no hand-over holder"
            return Given([], set())
        if n <= 0 and not use:
            return Given([], set())
        report.room = self._room(report.later) if n > 0 else None
        try:
            got = self.source.take(n, report.room, use, gens if use else None)
        except Exception as exc:  # the arena's HandoverError, an OSError: own memory this time
            report.note = self.source_note = f"the hand-over holder could not be used: {exc}"
            log.warning("%s", report.note)
            return Given([], set())  # nothing vouched for: the kept ranges are uploaded again
        self.source_note = ""
        return got

    def _keep(self, ids: list[int]) -> list[int] | None:
        """Keep ``ids`` mapped: the holder's generations of them; None when refused."""
        assert self.source is not None
        try:
            return self.source.keep(ids)
        except Exception as exc:  # refused or gone: unmapped and put back as before
            log.warning("keeping %d chunk(s) mapped was refused: %s", len(ids), exc)
            return None

    def _adopt(self, handles: list[int], report: MapReport) -> list[int]:
        """Hand the chunks created here to the source: exported ``ADOPT_BATCH`` at a time (a
        large model's thousands of chunks never hold an fd each at once)."""
        if self.source is None or self.source_note:
            return [0] * len(handles)
        ids: list[int] = []
        for start in range(0, len(handles), ADOPT_BATCH):
            fds = [self.device.export(h) for h in handles[start : start + ADOPT_BATCH]]
            try:
                ids.extend(self.source.adopt(fds))
            except Exception as exc:
                report.note = self.source_note = f"the hand-over holder could not be used: {exc}"
                log.warning("%s", report.note)
                # the batches adopted before keep their ids (put back at the release); the
                # rest are this process's own
                report.adopted = len(ids)
                return ids + [0] * (len(handles) - len(ids))
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
