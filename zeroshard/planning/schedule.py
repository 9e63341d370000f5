"""The chunks one chunk size gives (packed as the engine packs them), the chunk sequence stage 3
gathers over a step, and the gathers a cache of `cache_chunks` chunks needs on it by Belady's rule:
what the planner (planner.py) searches over.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ..runtime.packing import pack_groups, padded_numel
from .profiler import Profile


@dataclass(frozen=True)
class Layout:
    """Chunks of one chunk size (elements), as the engine packs them."""

    chunk_size: int
    padded: tuple[int, ...]  # padded elements per chunk
    trainable: tuple[bool, ...]
    chunk_of: dict  # parameter index -> chunk index
    numel: int  # parameter elements

    @property
    def waste(self) -> float:
        total = sum(self.padded)
        return (total - self.numel) / total if total else 0.0


def layout(profile: Profile, chunk_size: int, world: int) -> Layout:
    cap = max(chunk_size, max(p.numel for p in profile.params))
    order = list(profile.first_use)
    numels = [profile.params[i].numel for i in order]
    padded, trainable, chunk_of = [], [], {}
    for group, placed in pack_groups(numels, [profile.params[i].requires_grad for i in order], cap):
        last, last_off = placed[-1]
        for i, _ in placed:
            chunk_of[order[i]] = len(padded)
        padded.append(padded_numel(last_off + numels[last], world))
        trainable.append(group)
    return Layout(cap, tuple(padded), tuple(trainable), chunk_of, profile.numel)


def chunk_sequence(profile: Profile, lay: Layout) -> list[int]:
    """The chunks gathered over one step, in order, consecutive repeats collapsed (as the cache
    records its schedule)."""
    seq: list[int] = []
    for ev in profile.trace:
        for c in dict.fromkeys(lay.chunk_of[i] for i in ev.params):
            if not seq or seq[-1] != c:
                seq.append(c)
    return seq


def belady_loads(seq: list[int], cache_chunks: int, sizes=None) -> tuple[list[int], int]:
    """Loads per chunk when `seq` runs through a cache of `cache_chunks` chunks that starts empty and
    evicts the chunk whose next use is farthest away; and the most elements cached at once (given
    each chunk's `sizes`, elements)."""
    n = len(seq)
    nxt = [math.inf] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(seq[i], math.inf)
        last[seq[i]] = i
    loads: dict[int, int] = {}
    cached: dict[int, float] = {}  # chunk -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, chunk); stale entries skipped
    held = peak = 0
    for i, c in enumerate(seq):
        if c not in cached:
            loads[c] = loads.get(c, 0) + 1
            if len(cached) >= cache_chunks:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if cached.get(victim) == -neg:
                        del cached[victim]
                        held -= sizes[victim] if sizes else 0
                        break
            held += sizes[c] if sizes else 0
            peak = max(peak, held)
        cached[c] = nxt[i]
        heapq.heappush(heap, (-nxt[i], c))
    # Every chunk has an entry, also chunks after the last one the sequence uses.
    n_chunks = len(sizes) if sizes else (max(seq) + 1 if seq else 0)
    return [loads.get(c, 0) for c in range(n_chunks)], peak


def min_cache_chunks(profile: Profile, lay: Layout) -> int:
    """The smallest rCache (in chunks) stage 3 can run with: every chunk of one module, or of one checkpoint
    region, at once, plus one to prefetch into."""
    per_event = max((len({lay.chunk_of[i] for i in ev.params}) for ev in profile.trace), default=1)
    per_region = max((len({lay.chunk_of[i] for i in r.params}) for r in profile.checkpoint_regions), default=1)
    return max(per_event, per_region) + 1
