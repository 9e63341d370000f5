"""The replicated-chunk cache (rCache): which stage-3 chunks are gathered at a given moment.

A chunk in use by a running module (forward) or a module whose backward is pending is *pinned* and
never evicted. When a new chunk must be gathered and the cache is full, an unpinned chunk is
released: the one whose next use in the recorded sequence is farthest away (Belady's rule), or the
least recently used one while the sequence is still being recorded. If every cached chunk is pinned
the cache grows past its capacity rather than deadlock, and `overflows` counts it.

Prefetch: the first training step records the sequence of chunk uses (forward then backward). Later
steps follow that sequence with a cursor, and each use starts the all-gather of the next chunk in
the sequence when a slot is free, so communication overlaps the current module's compute. A use that
departs from the recording re-synchronises the cursor; it never fails.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict

from .chunks import Chunk, ChunkState
from .collectives import GATHER, order_tag


class ChunkCache:
    def __init__(self, comm, capacity: int | None, prefetch: bool, check_order: bool):
        self.comm = comm
        self.capacity = capacity
        self.prefetch_enabled = prefetch
        self.check_order = check_order
        self.cached: OrderedDict[int, Chunk] = OrderedDict()  # gathered or gathering, LRU first
        self.pins: dict[int, int] = {}
        self.recording = False
        self.schedule: list[int] = []
        self._positions: dict[int, list[int]] = {}  # chunk index -> its positions in the schedule
        self.chunks_by_index: dict[int, Chunk] = {}
        self.cursor = 0
        self.overflows = 0
        self.peak = 0  # most chunks cached at once since the last reset

    def set_chunks(self, chunks: list[Chunk]) -> None:
        self.chunks_by_index = {c.index: c for c in chunks}

    def restart_recording(self) -> None:
        self.schedule.clear()
        self._positions.clear()
        self.recording = True

    # -- use -----------------------------------------------------------------------------------
    def acquire(self, chunk: Chunk) -> None:
        """Make `chunk` GATHERED and pin it."""
        self._note_use(chunk.index)
        if chunk.index not in self.cached:
            self._gather(chunk)
        self.cached.move_to_end(chunk.index)
        if chunk.state is ChunkState.GATHERING:
            chunk.finish_gather()
        self.pins[chunk.index] = self.pins.get(chunk.index, 0) + 1
        self._maybe_prefetch()

    def release(self, chunk: Chunk) -> None:
        """Unpin; the chunk stays cached until evicted or flushed. With a capacity of one use per
        chunk (the minimum), a fully unpinned cache over capacity frees at once."""
        n = self.pins[chunk.index] - 1
        if n:
            self.pins[chunk.index] = n
        else:
            del self.pins[chunk.index]
        self._shrink()

    def flush(self) -> None:
        """Release every cached chunk: after an optimizer step the gathered copies are stale."""
        assert not self.pins, f"flush with pinned chunks {sorted(self.pins)}"
        for c in list(self.cached.values()):
            c.release()
        self.cached.clear()

    # -- internals ------------------------------------------------------------------------------
    def _gather(self, chunk: Chunk) -> None:
        """Gather on demand: make room if possible, else go over capacity (counted)."""
        if not self._make_room(1):
            self.overflows += 1
        self._start_gather(chunk)

    def _start_gather(self, chunk: Chunk) -> None:
        if self.check_order:
            self.comm.check_order(order_tag(GATHER, chunk.index))
        chunk.start_gather(self.comm)
        self.cached[chunk.index] = chunk
        self.peak = max(self.peak, len(self.cached))

    def _evictable(self):
        """Unpinned cached chunks, best victim first."""
        free = [i for i in self.cached if i not in self.pins]
        if self.recording or not self.schedule:
            return free  # LRU order
        return sorted(free, key=self._next_use, reverse=True)

    def _next_use(self, index: int) -> float:
        pos = self._positions.get(index, ())
        k = bisect.bisect_left(pos, self.cursor)
        return pos[k] if k < len(pos) else float("inf")

    def _make_room(self, n: int) -> bool:
        if self.capacity is None:
            return True
        for i in self._evictable():
            if len(self.cached) + n <= self.capacity:
                break
            self.cached.pop(i).release()
        return len(self.cached) + n <= self.capacity

    def _shrink(self) -> None:
        if self.capacity is not None:
            for i in self._evictable():
                if len(self.cached) <= self.capacity:
                    break
                self.cached.pop(i).release()

    def _note_use(self, index: int) -> None:
        if self.recording:
            if not self.schedule or self.schedule[-1] != index:
                self.schedule.append(index)
                self._positions.setdefault(index, []).append(len(self.schedule) - 1)
            return
        sched = self.schedule
        if self.cursor and sched[self.cursor - 1] == index:
            return  # another use of the current chunk (the schedule stores runs once)
        if self.cursor < len(sched) and sched[self.cursor] == index:
            self.cursor += 1
            return
        # Off the recorded sequence: resume after the next occurrence of this chunk, if any.
        for j in range(self.cursor, len(sched)):
            if sched[j] == index:
                self.cursor = j + 1
                return

    def _maybe_prefetch(self) -> None:
        if not self.prefetch_enabled or self.recording:
            return
        sched = self.schedule
        j = self.cursor
        if j >= len(sched) or sched[j] in self.cached:
            return
        if self._make_room(1):  # a prefetch never goes over capacity
            self._start_gather(self.chunks_by_index[sched[j]])
