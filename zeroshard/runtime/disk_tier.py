"""The disk tier (ZeRO-Infinity's NVMe offload, config offload_optimizer="disk"): the fp32 masters
and optimizer states of disk-tier chunks live in files, and pass through a few host frames.

Words (record, field, frame, adopted, open: docs/vocabulary.md):
- a chunk's *record* is its owned range's values in each *field*: "master" (fp32) and each
  elementwise optimizer state (exp_avg, momentum_buffer, ...: named and typed by the optimizer the
  first time it stores one). Each field is one TierFile (files/tier_files.py), one record per
  disk-tier chunk, of its owned range's length.
- a *frame* is a set of aligned host buffers, one per field, each the size of the largest record:
  the tier has FRAMES (4), whatever the model's size. A chunk is *open* while its record is
  in a frame and bound: its master (Chunk.bind_master) and, through the binder the optimizer sets,
  its optimizer states are views of the frame. Closing writes the record behind (or not, when
  only read) and unbinds it; the frame is free again once the writes are on disk.
- a chunk is *adopted* at its first open: until then its master is host memory as with
  offload_optimizer=True; the first open copies it into the frame and lets the host memory go. The
  optimizer adopts every disk-tier chunk once the chunks are built and filled (and again after a
  re-pack, and a chunk unfrozen later when it is thawed), so host memory holds every master only
  while the chunks are being built.

The optimizer's step opens chunk i while chunk i+1 (and i+2) are read ahead and chunk i-1 is
written behind, so the step waits on the disk only where the disk is slower than the CPU Adam.
Every other reader and writer of a master (checkpoints, state dicts, exports, loads) opens the
chunk for as long as it needs it (Chunk.master_values). Records are verified when read
(tier_files.py); any failure is TierFileError.

A tier holds one kind of record (`Holding`): MASTERS (the optimizer's tier: the fp32 master, and
the optimizer's states as further fields) or, with offload_params='disk' at stage 3, SHARDS (the
parameter tier: each chunk's 16-bit shard alone, opened at each gather, the rCache reading ahead
along its schedule, and opened `fresh` by the step, which overwrites it whole).
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError, InternalError, TierFileError, invariant
from ..files.tier_files import IoMeter, TierFile, aligned_buffer, reclaim_stale

MASTER = "master"
SHARD = "shard"
FRAMES = 4  # host frames: one open, two read ahead, one written behind (the planner counts them too)
_TIERS = itertools.count()  # this process's tiers: each names its files apart (two engines, one offload_dir)


@dataclass(frozen=True)
class Holding:
    """What a tier's records hold of a chunk: the field every record has (`name`, in `dtype`), its
    length in elements, where its values are before adoption, and how the chunk is pointed at
    them (a frame's view, or None: nothing)."""
    name: str
    numel: Callable[[object], int]
    values: Callable[[object], torch.Tensor]
    bind: Callable[[object, torch.Tensor | None], None]
    dtype: torch.dtype = torch.float32


MASTERS = Holding(MASTER, lambda c: c.owned_numel, lambda c: c.master, lambda c, v: c.bind_master(v))


def shards(dtype: torch.dtype) -> Holding:
    """The parameter tier's records: stage-3 shards in the compute dtype."""
    return Holding(SHARD, lambda c: c.shard_numel, lambda c: c.shard, lambda c, v: c.bind_shard(v), dtype)


class FrameState(enum.Enum):
    FREE = "free"
    READING = "reading"  # a read-ahead in flight
    OPEN = "open"  # bound to its chunk
    WRITING = "writing"  # written behind; free once the writes are done


class Frame:
    """One chunk's record in host memory: a buffer per field (grown as fields appear)."""

    def __init__(self, index: int):
        self.index = index
        self.buffers: dict[str, tuple[memoryview, torch.Tensor]] = {}  # field -> (bytes, its uint8 tensor)
        self.state = FrameState.FREE
        self.record = -1
        self.pending = []  # futures of the reads or writes in flight
        self.present: set[str] = set()  # fields holding the record's values
        self.unsaved = False  # holds values the disk does not have yet (a chunk's first open)
        self.states = True  # the optimizer's states were read and bound too (not a master-only open)

    def buffer(self, name: str, nbytes: int) -> memoryview:
        if name not in self.buffers or len(self.buffers[name][0]) < nbytes:  # new, or records grew (a re-pack)
            raw = aligned_buffer(nbytes)
            self.buffers[name] = (raw, torch.frombuffer(raw, dtype=torch.uint8))
        return self.buffers[name][0]


class DiskTier:
    """The records of the disk-tier chunks of one rank, in `directory`.

    attach(chunks) names the chunks (before the first open; again after a re-pack); the binder
    (set_binder) binds and unbinds the optimizer's states of a chunk as it is opened and closed."""

    def __init__(self, directory: str, rank: int, frames: int = FRAMES, threads: int = 2,
                 holding: Holding = MASTERS):
        if frames < 2:
            raise ConfigError("zeroshard: the disk tier needs at least 2 frames")
        self.directory = directory
        self.rank = rank
        self.holding = holding
        self.name = f"rank{rank}.{os.getpid()}-{next(_TIERS)}"
        reclaim_stale(directory)
        TierFile(directory, f"{self.name}.probe", [1], threads=1).close()  # usable? TierFileError now, not later
        self.frames = [Frame(i) for i in range(frames)]
        self.files: dict[str, TierFile] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.record_of: dict[int, int] = {}  # id(chunk) -> its record
        self.numels: list[int] = []  # elements of each record
        self.adopted: set[int] = set()  # records whose values live in the tier
        self.frame_of: dict[int, Frame] = {}  # record -> the frame it is in (reading, open or writing)
        self._bind = self._unbind = lambda c, view: None
        self.failed: Exception | None = None  # a failure that left the records inconsistent
        # seconds the caller waited for reads / for a frame (writes to finish); bytes moved
        self.read_wait_s = self.write_wait_s = 0.0
        self.read_bytes = self.written_bytes = 0
        self.meter = IoMeter()  # the disk's busy seconds, both ways, over every field's file
        # Pools shared by every field's file, `threads` requests each (bench/disk_io.py: 2): one for
        # writes, one for reads, so the next chunk's read is never queued behind the last one's writes.
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zeroshard-tier-write")
        self.read_pool = ThreadPoolExecutor(threads, thread_name_prefix="zeroshard-tier-read")

    # -- set-up ---------------------------------------------------------------------------------
    def extend(self, c) -> None:
        """A record for chunk c, just built, past the others': adopted at once, before the next
        chunk is built, host memory never holds every master (shard) while a model is packed."""
        record = len(self.numels)
        self.numels.append(self.holding.numel(c))
        self.record_of[id(c)] = record
        for name, f in self.files.items():
            f.add(self.numels[record] * self.dtypes[name].itemsize)
        self._field(self.holding.name, self.holding.dtype)  # the first record: its file

    def attach(self, chunks) -> None:
        """The disk-tier chunks, trainable or not (a frozen one is adopted if thawed). Chunks given
        records as they were built (extend) keep them: another chunk's (a re-pack's old chunks)
        are forgotten, their values having moved into the new chunks. Otherwise every record is
        dropped and the chunks numbered afresh."""
        if chunks and all(id(c) in self.record_of for c in chunks):
            self.record_of = {id(c): self.record_of[id(c)] for c in chunks}
            return
        self._drop_files()
        self.record_of = {id(c): i for i, c in enumerate(chunks)}
        self.numels = [self.holding.numel(c) for c in chunks]
        self.dtypes = {}
        self._field(self.holding.name, self.holding.dtype)

    def set_binder(self, bind, unbind) -> None:
        """bind(chunk, view) after a chunk is opened, unbind(chunk, view) before it is closed;
        view(name, dtype) is the chunk's values of a field in its frame (a new field is created)."""
        self._bind, self._unbind = bind, unbind

    def adopted_chunk(self, c) -> bool:
        """Whether chunk c's values are in the tier (else its master is host memory)."""
        return self.record_of.get(id(c), -1) in self.adopted

    def adopt(self, c) -> None:
        """Move chunk c's values (its master, or shard) into the tier now (as its first open would;
        it has no optimizer state yet)."""
        if not self.adopted_chunk(c):
            self.open(c, states=False)
            self.close(c)

    def field(self, c, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Open chunk c's values of field `name` (created if new: what a load writes)."""
        frame = self.frame_of.get(self.record_of[id(c)])
        invariant(frame is not None and frame.state is FrameState.OPEN, lambda: f"chunk {c.index}'s record is not open")
        return self._view(frame, name, dtype)

    def _field(self, name: str, dtype: torch.dtype) -> None:
        if name in self.dtypes:
            if self.dtypes[name] != dtype:
                raise TierFileError(f"zeroshard: the disk tier stores {name!r} as {self.dtypes[name]}; the optimizer "
                                    f"now gives it as {dtype}")
            return
        size = dtype.itemsize
        self.files[name] = TierFile(self.directory, f"{self.name}.{name}.tier", [n * size for n in self.numels],
                                    meter=self.meter, pool=self.pool, read_pool=self.read_pool)
        self.dtypes[name] = dtype

    def _view(self, frame: Frame, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A field of the frame's record as a 1-D tensor of its elements (created if new)."""
        self._field(name, dtype)
        n = self.numels[frame.record]
        size = dtype.itemsize
        frame.buffer(name, max(self.numels) * size)
        frame.present.add(name)
        return frame.buffers[name][1][:n * size].view(dtype)

    # -- frames ----------------------------------------------------------------------------------
    def _finish(self, frame: Frame) -> None:
        """Wait for the frame's I/O: READING -> ready to open, WRITING -> FREE. A read that failed
        frees the frame too, so no later open takes what it left for the record's values."""
        pending, frame.pending = frame.pending, []
        t0 = time.perf_counter()
        try:
            for f in pending:
                f.result()
        except BaseException:
            if frame.state is FrameState.READING:
                self._release(frame)
            raise
        finally:
            waited = time.perf_counter() - t0
            if frame.state is FrameState.WRITING:
                self.write_wait_s += waited
                self._release(frame)
            else:
                self.read_wait_s += waited

    def _release(self, frame: Frame) -> None:
        self.frame_of.pop(frame.record, None)
        frame.state, frame.record = FrameState.FREE, -1

    def _free_frame(self, block: bool) -> Frame | None:
        for s in self.frames:
            if s.state is FrameState.FREE:
                return s
        writing = [s for s in self.frames if s.state is FrameState.WRITING]
        done = [s for s in writing if all(f.done() for f in s.pending)]
        if done or (writing and block):
            s = (done or writing)[0]
            self._finish(s)
            return s
        reading = [s for s in self.frames if s.state is FrameState.READING]
        if block and reading:  # a read ahead not asked for yet gives way (read again when it is)
            s = reading[0]
            with contextlib.suppress(TierFileError):
                self._finish(s)
            self._release(s)
            return s
        if block:
            raise InternalError("zeroshard: every disk tier frame is open: too many chunks open at once")
        return None

    def _start_read(self, frame: Frame, c, states: bool = True) -> None:
        record = self.record_of[id(c)]
        frame.state, frame.record, frame.present, frame.states = FrameState.READING, record, set(), states
        self.frame_of[record] = frame
        for name, f in self.files.items():
            # a field this chunk has (a state it never had is not read); only the master for a master-only open
            if f.generations[record] and (states or name == self.holding.name):
                dtype = self.dtypes[name]
                view = self._view(frame, name, dtype)
                frame.pending.append(f.read(record, frame.buffers[name][0]))
                self.read_bytes += view.numel() * view.element_size()

    def read_ahead(self, c) -> None:
        """Start reading adopted chunk c's record into a free frame, if one is free now (never waits,
        never raises: a write found failed fails the tier, and the next open, which every rank
        agrees on, raises)."""
        record = self.record_of.get(id(c))
        if record is None or record not in self.adopted or record in self.frame_of or self.failed is not None:
            return
        try:
            frame = self._free_frame(block=False)
        except TierFileError as e:
            self.fail(e)
            return
        if frame is not None:
            self._start_read(frame, c)

    # -- open / close ----------------------------------------------------------------------------
    def fail(self, e: Exception) -> None:
        """A step failed part way: the records no longer hold one step's values; every later open
        raises (the last checkpoint is what to resume from)."""
        self.failed = self.failed or e

    def open(self, c, states: bool = True, fresh: bool = False) -> None:
        """Bind chunk c's record: its master (shard) and (the binder; not when `states` is False, for
        a reader or writer of the master alone) its optimizer states are frame views until close(c).
        `fresh`: the caller overwrites the record whole: nothing is read, the values start at zero."""
        if self.failed is not None:
            raise TierFileError(f"zeroshard: the disk tier failed in an earlier step ({self.failed}): its states are "
                                "lost; resume from the last checkpoint")
        record = self.record_of[id(c)]
        frame = self.frame_of.get(record)
        if frame is not None and frame.state is FrameState.OPEN:
            raise InternalError(f"zeroshard: chunk {c.index}'s disk tier record is open already")
        if frame is not None and frame.state is FrameState.WRITING:
            self._finish(frame)  # on disk now: read back below (verified, as any other read)
            frame = None
        h = self.holding
        if record not in self.adopted or fresh:  # its first open: from host memory into the tier
            if frame is not None:  # a read ahead, of values about to be overwritten
                with contextlib.suppress(TierFileError):
                    self._finish(frame)
            else:
                frame = self._free_frame(block=True)
            frame.state, frame.record, frame.present, frame.states = FrameState.OPEN, record, set(), states
            self.frame_of[record] = frame
            view = self._view(frame, h.name, h.dtype)
            # unsaved: written at close even if not asked to (else the values would be lost); a fresh
            # open of an adopted record is not: left unwritten (a failed step), the disk keeps the old
            frame.unsaved = record not in self.adopted
            view.copy_(h.values(c).detach()) if frame.unsaved else view.zero_()
            self.adopted.add(record)
        else:
            if frame is None:
                frame = self._free_frame(block=True)
                self._start_read(frame, c, states)
            self._finish(frame)
            frame.state = FrameState.OPEN
        # A read ahead brought the states too; a master-only open leaves them as they are on disk.
        frame.states = frame.states and states
        h.bind(c, self._view(frame, h.name, h.dtype))
        if frame.states:
            self._bind(c, lambda name, dtype: self._view(frame, name, dtype))

    def close(self, c=None, write: bool = True) -> None:
        """Unbind chunk c and write its record behind (`write`: it may have changed). close() with
        no chunk: wait for all I/O and remove the files (the job's normal end)."""
        if c is None:
            self._drop_files()
            self.pool.shutdown(wait=True)
            self.read_pool.shutdown(wait=True)
            return
        record = self.record_of[id(c)]
        frame = self.frame_of.get(record)
        invariant(frame is not None and frame.state is FrameState.OPEN, lambda: f"chunk {c.index} closed but not open")
        try:
            if frame.states:
                self._unbind(c, lambda name, dtype: self._view(frame, name, dtype))
        finally:
            self.holding.bind(c, None)
        if not (write or frame.unsaved):
            self._release(frame)
            return
        frame.state, frame.unsaved = FrameState.WRITING, False
        for name in sorted(frame.present):
            nbytes = self.numels[record] * self.dtypes[name].itemsize
            frame.pending.append(self.files[name].write(record, frame.buffers[name][0][:nbytes]))
            self.written_bytes += nbytes

    def _drop_files(self) -> None:
        """Wait for all I/O, then remove every field's file (their values are not needed again)."""
        for s in self.frames:
            with contextlib.suppress(TierFileError):
                self._finish(s)
        for f in self.files.values():
            f.close()
        self.files, self.adopted = {}, set()
        for s in self.frames:
            self._release(s)

    def flush(self) -> None:
        """Wait until every record written is on disk (TierFileError if a write failed)."""
        for s in self.frames:
            if s.state is FrameState.WRITING:
                self._finish(s)

    @contextlib.contextmanager
    def opened(self, c, write: bool, adopt: bool = False, states: bool = True, fresh: bool = False):
        """Chunk c open for the block (open's `states` and `fresh`); written back after it when
        `write`. Not adopted yet: its values are host memory, used as they are, unless `adopt` (the
        optimizer's step)."""
        record = self.record_of.get(id(c))
        if record is None or (record not in self.adopted and not adopt):
            yield
            return
        self.open(c, states, fresh)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.close(c, write=write and ok)

    def bytes_on_disk(self) -> int:
        """Bytes of the chunks' records written so far (payloads, not headers; not a re-pack's old chunks')."""
        live = set(self.record_of.values())
        return sum(sum(n for i, (n, g) in enumerate(zip(f.sizes, f.generations)) if g and i in live)
                   for f in self.files.values())

    def buffer_bytes(self) -> int:
        """Host bytes of the frames' buffers."""
        return sum(len(raw) for s in self.frames for raw, _ in s.buffers.values())

    def reset_counters(self) -> None:
        self.meter.reset()
        self.read_wait_s = self.write_wait_s = 0.0
        self.read_bytes = self.written_bytes = 0
