"""The replicated-chunk cache (rCache): which stage-3 chunks are gathered at a given moment.

A chunk in use by a running module (forward) or a module whose backward is pending is *pinned* and
never evicted. When a new chunk must be gathered and the cache is full, an unpinned chunk is
released: the one whose next use in the recorded sequence is farthest away (Belady's rule), or the
least recently used one while the sequence is still being recorded. If every cached chunk is pinned
the cache grows past its cache_chunks rather than deadlock, and `overflows` counts it.

Prefetch: the sequence of chunk uses (forward then backward) comes from the profiler when the
planner runs (offload/stage 'auto'), else it is recorded over the first training step. Steps follow
that sequence with a cursor, and each use starts the all-gather of the next chunk in the sequence
when a slot is free, so communication overlaps the current module's compute.

Note: prefetch depth. With a cache_chunks every slot is spoken for, so a prefetch goes one chunk
past the next at most, and only into a free slot. With none, chunks stay gathered until the step
anyway, so gathering further ahead costs no memory at the forward's end, and each use finds its
chunk long arrived: with UNLIMITED_AHEAD 4 against 1, gpt2-small-cpu's stage-3 forward went 0.43
-> 0.41 s in four interleaved runs of five (2 ranks, 2 cores; the fifth read 0.45 both ways). Not
further: each gather handed over is a comparison first, and hundreds handed over at a forward's
start would hold its first compute back.
Chunks whose shards are read from the host or the disk tier stay one ahead (their start waits on
that read).

Note: gathers at the step's end. After an update every rank agreed to apply, the chunks the next
forward starts with (those rewind would prefetch, whose shards are in device memory) are gathered
at once, with no order comparison, as stages 1-2 gather an update (ordering.py): a comparison at
the forward's start was a round trip, plus the ranks' drift, before its first compute (2 ranks on 2
cores, interleaved A/B, stage 3 vs DDP: gpt2-tiny, one chunk, 1.115 -> 1.070x, with a 2-chunk
rCache 1.104 -> 1.085x; gpt2-small-cpu 1.069 -> 1.041x and 1.098 -> 1.082x). A rank whose update
raised after that agreement issues the same gathers, then marks its next comparison
(optim/publish.py). Each rank recorded its own schedule, so the chunks are rank 0's choice, sent
once per schedule (_first_chunks). The engine issues them once the step's figures are taken (stats, the memory
timeline's sample), so they count towards the forward they serve (traffic, peak) and what a step
holds at its end stays the shards.

Departures (dynamic control flow): a use that is not the expected one moves the cursor to that
chunk's next occurrence in the sequence. A chunk the rest of the sequence never names puts the cache
off schedule: it evicts the least recently used chunk and stops prefetching until a use matches the
sequence again. Departures are counted and logged once; they never stop training.

Note: forwards without autograd. A forward under no_grad or inference_mode (an evaluation between
steps, Lightning's validation loop) is no part of a training step's sequence: recorded, it put a
whole forward at the head of the schedule, and every later training step departed from it. A
backward runs with autograd's grad mode off, yet is part of the step: a use there (a custom
Function's backward reading a parameter outside every forward) is recorded (`in_step`); skipped,
it was not in the schedule and every later step departed from it 4 times. A use outside the step
within a training pass (a custom Function's forward in the loss reads a parameter under no_grad)
is not followed either; in a pass without autograd (an evaluation) uses follow the schedule where
they match it, for its prefetches, and are no departure where they do not.
"""
from __future__ import annotations

import bisect
import logging
from collections import OrderedDict

import torch

from .chunks import Chunk, ChunkState
from ..errors import invariant

log = logging.getLogger("zeroshard")
READ_AHEAD = 3  # shards read ahead past the chunk prefetched (the parameter tier has 4 frames)
UNLIMITED_AHEAD = 4  # chunks gathering beyond the next one, with no cache_chunks (Note: prefetch depth)


def in_step() -> bool:
    """Whether a chunk use now belongs to a training step's sequence (Note: forwards without
    autograd): under autograd, or inside a backward."""
    return torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1


class ChunkCache:
    def __init__(self, comm, cache_chunks: int | None, prefetch: bool, read_ahead=None):
        self.comm = comm
        # offload_params='disk': read_ahead(chunk) starts reading a shard from the parameter tier
        # (disk_tier.py), called for the chunks past the one prefetched, as far as frames are free
        self.read_ahead = read_ahead
        self.cache_chunks = cache_chunks
        self.prefetch_enabled = prefetch
        self.cached: OrderedDict[int, Chunk] = OrderedDict()  # gathered or gathering, LRU first
        self.pins: dict[int, int] = {}
        self.recording = False
        self.schedule: list[int] = []
        self._positions: dict[int, list[int]] = {}  # chunk index -> its positions in the schedule
        self.chunks_by_index: dict[int, Chunk] = {}
        self.cursor = 0
        self._pass_in_step = True  # the pass since the last rewind is a training step's (rewind)
        self.overflows = 0
        self.peak = 0  # most chunks cached at once since the last reset
        self.peak_bytes = 0  # most bytes of gathered chunks held at once since the last reset
        self._bytes = 0
        self.source = "recorded"  # or "profiled": where the schedule came from
        self.departures = 0  # uses that were not the one the schedule expected
        self.off_schedule = False
        self._head: list[int] | None = None  # the chunks gathered at a step's end, the same on every rank

    def reset_peak(self) -> None:
        """Start counting the peak (chunks and bytes held at once) afresh."""
        self.peak = 0
        self.peak_bytes = 0

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the chunks gathered (or gathering) now."""
        return self._bytes

    def set_chunks(self, chunks: list[Chunk]) -> None:
        self.chunks_by_index = {c.index: c for c in chunks}
        self._head = None

    def set_schedule(self, sequence: list[int]) -> None:
        """Follow this sequence of chunk uses (from the profile) instead of recording one."""
        self.schedule = []
        self._positions = {}
        for i in sequence:
            if not self.schedule or self.schedule[-1] != i:
                self.schedule.append(i)
                self._positions.setdefault(i, []).append(len(self.schedule) - 1)
        self.recording = False
        self.source = "profiled"
        self._head = None

    def restart_recording(self) -> None:
        """Record the sequence of chunk uses afresh (the layout may still change)."""
        self.schedule.clear()
        self._positions.clear()
        self.recording = True
        self._head = None

    def stop_recording(self) -> None:
        """The sequence recorded is the schedule from now on."""
        self.recording = False
        self._head = None

    def rewind(self, prefetch: bool = True) -> None:
        """A forward begins: follow the schedule from its start, whose first chunks start
        gathering now (together: the second's gather then runs beside the first's), or, without
        `prefetch`, at the forward's first chunk use."""
        self.cursor = 0
        self._pass_in_step = in_step()
        if prefetch:
            self._maybe_prefetch()

    # -- use -----------------------------------------------------------------------------------
    def acquire(self, chunk: Chunk, recorded: bool = True) -> None:
        """Make `chunk` GATHERED and pin it. `recorded`: False for a use in a forward without
        autograd, which a recording skips (Note: forwards without autograd)."""
        self._note_use(chunk.index, recorded)
        if chunk.index in self.cached and chunk.state is ChunkState.SHARDED:  # its gather failed elsewhere
            self.cached.pop(chunk.index)  # (hooks.unpack_chunk_view): gathered anew (raising again)
            self._bytes -= chunk.full_bytes
        if chunk.index not in self.cached:
            self._gather(chunk)
        self.cached.move_to_end(chunk.index)
        if chunk.state is ChunkState.GATHERING:
            try:
                chunk.finish_gather()
            except BaseException:  # not gathered (a shard the parameter tier could not read): not cached
                if chunk.state is ChunkState.SHARDED:
                    self.cached.pop(chunk.index)
                    self._bytes -= chunk.full_bytes
                raise
        self.pins[chunk.index] = self.pins.get(chunk.index, 0) + 1
        # A prefetch handed to the order check is issued once its comparison is back and someone
        # looks: every use looks, or a prefetch would start only when waited for (gpt2-small-cpu's
        # forward waited 50 ms for its chunks' gathers then, 13.5 ms now). It does not wait for
        # one (ordering.py's Note: prefetches handed over). After the pin: a peer lost here
        # leaves the chunk pinned, as its release expects.
        self.comm.progress()
        self._maybe_prefetch()

    def pin(self, chunk: Chunk) -> None:
        """Pin a chunk held now (gathered and pinned) once more, not counted as a use: a hold that
        begins while the chunk is in hand (hooks.py, after a recomputation)."""
        invariant(self.pins.get(chunk.index, 0) > 0, lambda: f"rCache pin of chunk {chunk.index}, not in use")
        self.pins[chunk.index] += 1

    def release(self, chunk: Chunk) -> None:
        """Unpin; the chunk stays cached until evicted or flushed. With a cache_chunks of one use per
        chunk (the minimum), a fully unpinned cache over cache_chunks frees at once."""
        n = self.pins[chunk.index] - 1
        if n:
            self.pins[chunk.index] = n
        else:
            del self.pins[chunk.index]
        self._shrink()

    def flush(self) -> None:
        """Release every cached chunk: after an optimizer step the gathered copies, and hpZ's
        secondary shards, are stale (whoever flushes is about to change the parameters, or has)."""
        invariant(not self.pins, lambda: f"rCache flush with pinned chunks {sorted(self.pins)}")
        for c in list(self.cached.values()):
            c.release(stale=True)
        for c in self.chunks_by_index.values():
            c.forget_secondary()
        self.cached.clear()
        self._bytes = 0

    def after_update(self) -> None:
        """flush, then gather_after_step: for a rank whose update raised after every rank agreed
        to apply it, which issues the gathers the others issue (optim/publish.py)."""
        self.flush()
        self.gather_after_step()

    def gather_after_step(self) -> None:
        """An update every rank agreed to apply is in the shards, and the stale chunks were
        flushed: start gathering those the next forward's start would prefetch (rewind), with no
        order comparison (Note: gathers at the step's end)."""
        if not self.prefetch_enabled or self.recording or not self.schedule:
            return
        if self._head is None:
            self._head = self.comm.broadcast_object(self._first_chunks())
        for i in self._head:
            if i not in self.cached:
                self.chunks_by_index[i].start_gather(self.comm, compare=False)
                self._add(self.chunks_by_index[i])

    def _first_chunks(self) -> list[int]:
        """What rewind's prefetch would start gathering into an empty cache, those whose shard is in
        device memory (a tier's or a host copy is read first). Each rank recorded its own schedule
        (a data-dependent forward may have used others first), so rank 0's list is every rank's:
        gathers no comparison checks must pair."""
        ahead = self._ahead()
        room = self.cache_chunks if self.cache_chunks is not None else len(self.chunks_by_index)
        head = []
        for i in dict.fromkeys(self.schedule[:1 + ahead]):
            if len(head) == room or not self.chunks_by_index[i].shard_in_memory:
                break
            head.append(i)
        return head

    # -- internals ------------------------------------------------------------------------------
    def _gather(self, chunk: Chunk) -> None:
        """Gather on demand: make room if possible, else go over cache_chunks (counted)."""
        if not self._make_room(1):
            self.overflows += 1
        self._start_gather(chunk)

    def _start_gather(self, chunk: Chunk) -> None:
        chunk.start_gather(self.comm)
        self._add(chunk)

    def _add(self, chunk: Chunk) -> None:
        self.cached[chunk.index] = chunk
        self._bytes += chunk.full_bytes
        self.peak = max(self.peak, len(self.cached))
        self.peak_bytes = max(self.peak_bytes, self._bytes)

    def _evict(self, index: int) -> None:
        c = self.cached.pop(index)
        self._bytes -= c.full_bytes
        c.release()

    def _evictable(self):
        """Unpinned cached chunks, best victim first."""
        free = [i for i in self.cached if i not in self.pins]
        if self.recording or not self.schedule or self.off_schedule:
            return free  # LRU order
        return sorted(free, key=self._next_use, reverse=True)

    def _next_use(self, index: int) -> float:
        pos = self._positions.get(index, ())
        k = bisect.bisect_left(pos, self.cursor)
        return pos[k] if k < len(pos) else float("inf")

    def _make_room(self, n: int) -> bool:
        if self.cache_chunks is None:
            return True
        for i in self._evictable():
            if len(self.cached) + n <= self.cache_chunks:
                break
            self._evict(i)
        return len(self.cached) + n <= self.cache_chunks

    def _free_slot(self) -> bool:
        return self.cache_chunks is None or len(self.cached) < self.cache_chunks

    def _shrink(self) -> None:
        if self.cache_chunks is not None:
            for i in self._evictable():
                if len(self.cached) <= self.cache_chunks:
                    break
                self._evict(i)

    def _note_use(self, index: int, recorded: bool) -> None:
        if self.recording:
            if not recorded:
                return
            if not self.schedule or self.schedule[-1] != index:
                self.schedule.append(index)
                self._positions.setdefault(index, []).append(len(self.schedule) - 1)
            return
        if not recorded and self._pass_in_step:  # outside the step within a step's pass: not followed
            return
        sched = self.schedule
        if self.cursor and sched[self.cursor - 1] == index:
            return  # another use of the current chunk (the schedule stores runs once)
        if self.cursor < len(sched) and sched[self.cursor] == index:
            self.cursor += 1
            self.off_schedule = False
            return
        if recorded:  # one no part of the step (Note: forwards without autograd) is no departure either
            self._depart(index)

    def _depart(self, index: int) -> None:
        """A use the schedule did not expect: resume after this chunk's next occurrence, if any;
        else go off schedule (LRU, no prefetch) until a use matches again."""
        expected = self.schedule[self.cursor] if self.cursor < len(self.schedule) else None
        self.departures += 1
        if self.departures == 1:
            log.warning("chunk uses depart from the %s order (chunk %d used where chunk %s was "
                        "expected, position %d of %d): dynamic control flow? Training goes on; where the "
                        "order cannot be followed the cache evicts the least recently used chunk and does "
                        "not prefetch. Logged once; stats()['schedule_departures'] counts them.",
                        self.source, index, expected, self.cursor, len(self.schedule))
        pos = self._positions.get(index, ())
        k = bisect.bisect_left(pos, self.cursor)
        if k < len(pos):
            self.cursor = pos[k] + 1
            self.off_schedule = False
        else:
            self.off_schedule = True

    def _ahead(self) -> int:
        """Chunks a prefetch gathers beyond the next one in the schedule (Note: prefetch depth)."""
        return 1 if self.cache_chunks is not None else UNLIMITED_AHEAD

    def _maybe_prefetch(self) -> None:
        if not self.prefetch_enabled or self.recording or self.off_schedule:
            return
        sched = self.schedule
        j = self.cursor
        if j < len(sched) and sched[j] not in self.cached and self._make_room(1):  # never over cache_chunks
            self._start_gather(self.chunks_by_index[sched[j]])
        # One more ahead where a slot is free without evicting anything: a chunk used only briefly
        # (an embedding's) leaves no time to gather the next one behind it. With no cache_chunks
        # (nothing is evicted before the step; every chunk is gathered by the forward's end anyway)
        # up to UNLIMITED_AHEAD more whose shards are in memory (Note: prefetch depth).
        ahead = self._ahead()
        for k in range(j + 1, min(len(sched), j + 1 + ahead)):
            chunk = self.chunks_by_index[sched[k]]
            if sched[k] in self.cached:
                continue
            if not self._free_slot() or k > j + 1 and not chunk.shard_in_memory:
                break
            self._start_gather(chunk)
        if self.read_ahead is not None:
            for i in sched[j + 1:j + 1 + READ_AHEAD]:
                if i not in self.cached:
                    self.read_ahead(self.chunks_by_index[i])
