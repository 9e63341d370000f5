"""Single-process tests of the pure pieces: chunk packing, and the cache's replacement and prefetch
decisions."""
import pytest
import torch

from zeroshard.runtime import cache as cache_module
from zeroshard.runtime.cache import ChunkCache
from zeroshard.runtime.chunks import Chunk, ChunkState
from zeroshard.runtime.packing import ALIGN, Slot, auto_chunk_size, pack
from zeroshard.distributed.collectives import Comm
from zeroshard.telemetry.stats import chunk_state_bytes


# -- packing ----------------------------------------------------------------------------------------
def test_pack_keeps_order_and_never_straddles():
    sizes = [10, 20, 5, 40, 1, 100, 3]
    chunks = pack(sizes, chunk_size=48)
    assert [i for c in chunks for i, _ in c] == list(range(len(sizes)))  # order of first use kept
    for c in chunks:
        offsets = [off for _, off in c]
        assert offsets[0] == 0 and all(o % ALIGN == 0 for o in offsets)
        ends = [off + sizes[i] for i, off in c]
        assert all(e <= o for e, o in zip(ends, offsets[1:]))  # no overlap
        assert ends[-1] <= 48 or len(c) == 1  # only a parameter larger than chunk_size overflows, alone
    assert [(5, 0)] in chunks  # the 100-element parameter sits alone


def test_auto_chunk_size_holds_largest_param():
    assert auto_chunk_size([10, 1000, 20]) >= 1000
    assert auto_chunk_size([1 << 20] * 64) == 1 << 23  # an eighth of the model
    assert auto_chunk_size([1 << 10] * 64) == 1 << 22  # a small model: one chunk of the efficient size
    assert auto_chunk_size([1 << 24] * 64) == 1 << 26  # at most 64M elements


def _chunk(stage, rank, world, numels=(5, 7, 3), dtype=torch.float32):
    params = [torch.nn.Parameter(torch.arange(n, dtype=torch.float32) + 10 * i) for i, n in enumerate(numels)]
    (placed,) = pack(list(numels), chunk_size=1000)
    slots = [Slot(params[i], f"p{i}", off, params[i].numel(), params[i].shape) for i, off in placed]
    return Chunk(0, slots, stage=stage, rank=rank, world=world, dtype=dtype, device=torch.device("cpu"),
                 trainable=True, fill=lambda s, lo, hi: s.param.detach()[lo:hi]), params


@pytest.mark.parametrize("world", [1, 2, 3])
def test_chunk_shards_cover_padded_chunk(world):
    """Shards of all ranks tile the padded chunk exactly; padding is zero and under world*ALIGN."""
    pieces = []
    for rank in range(world):
        c, params = _chunk(stage=3, rank=rank, world=world)
        assert c.state is ChunkState.SHARDED and c.padded_numel % world == 0
        assert c.padded_numel - c.numel < world * ALIGN
        pieces.append(c.shard)
    full = torch.cat(pieces)
    for i, s in enumerate(c.slots):  # the parameters' own storage is freed at stage 3: compare with what it held
        assert torch.equal(full[s.offset:s.offset + s.numel], torch.arange(s.numel, dtype=torch.float32) + 10 * i)
        assert params[i].numel() == 0
    assert full[c.numel:].abs().sum() == 0


def test_chunk_stage12_params_are_views_and_fp32_master_aliases_storage():
    c, params = _chunk(stage=2, rank=1, world=2)
    assert params[1].data_ptr() == c.full[c.slots[1].offset:].data_ptr()
    lo, _ = c.owned_range
    assert c.master.data_ptr() == c.full[lo:].data_ptr()  # fp32: no separate master copy
    c16, _ = _chunk(stage=2, rank=0, world=2, dtype=torch.bfloat16)
    assert c16.master.dtype == torch.float32 and ("master", False, c16.shard_numel * 4) in chunk_state_bytes(c16)


# -- cache ----------------------------------------------------------------------------------------
class _FakeChunk:
    def __init__(self, i, shard_in_memory=True):
        self.index, self.state, self.gathers, self.full_bytes = i, ChunkState.SHARDED, 0, 100
        self.shard_in_memory = shard_in_memory

    def start_gather(self, comm):
        self.state, self.gathers = ChunkState.GATHERING, self.gathers + 1

    def finish_gather(self):
        self.state = ChunkState.GATHERED

    def release(self, stale=False):
        self.state = ChunkState.SHARDED

    def forget_secondary(self):
        pass


def _use(cache, chunks, seq):
    for i in seq:
        cache.acquire(chunks[i])
        cache.release(chunks[i])


def test_cache_belady_keeps_chunk_needed_soonest():
    """Sequence 0 1 2 0 | 2 1 0 with two slots: after recording, Belady keeps chunk 0 (used again
    soon) where LRU would evict it; every gather is counted."""
    seq = [0, 1, 2, 0, 2, 1, 0]
    comm = Comm(torch.device("cpu"))
    chunks = {i: _FakeChunk(i) for i in range(3)}
    cache = ChunkCache(comm, cache_chunks=2, prefetch=False)
    cache.set_chunks(list(chunks.values()))
    cache.recording = True
    _use(cache, chunks, seq)  # LRU while recording
    lru = sum(c.gathers for c in chunks.values())
    cache.flush()
    cache.recording = False
    for c in chunks.values():
        c.gathers = 0
    _use(cache, chunks, seq)
    belady = sum(c.gathers for c in chunks.values())
    assert (lru, belady) == (6, 4)


def test_cache_prefetches_next_recorded_chunk_and_never_evicts_pinned():
    comm = Comm(torch.device("cpu"))
    chunks = {i: _FakeChunk(i) for i in range(3)}
    cache = ChunkCache(comm, cache_chunks=2, prefetch=True)
    cache.set_chunks(list(chunks.values()))
    cache.recording = True
    _use(cache, chunks, [0, 1, 2])
    cache.flush()
    cache.recording = False
    cache.acquire(chunks[0])
    assert chunks[1].state is ChunkState.GATHERING  # prefetched while 0 is in use
    cache.acquire(chunks[1])  # 0 and 1 pinned, cache full: no prefetch of 2, no eviction
    assert chunks[2].state is ChunkState.SHARDED and chunks[0].state is ChunkState.GATHERED
    cache.acquire(chunks[2])  # must gather anyway: over cache_chunks, counted
    assert cache.overflows == 1


def test_cache_with_no_cache_chunks_gathers_further_ahead_from_memory_only():
    """No cache_chunks: UNLIMITED_AHEAD chunks past the next one gather at once, except one whose
    shard must be read first (host, disk tier), which waits until it is the one past the next;
    with a cache_chunks, however large, a prefetch stays one past the next."""
    ahead = cache_module.UNLIMITED_AHEAD
    n = ahead + 4
    slow = ahead + 2  # a chunk whose shard is read from the host

    def primed(cache_chunks):
        chunks = {i: _FakeChunk(i, shard_in_memory=i != slow) for i in range(n)}
        cache = ChunkCache(Comm(torch.device("cpu")), cache_chunks=cache_chunks, prefetch=True)
        cache.set_chunks(list(chunks.values()))
        cache.set_schedule(list(range(n)))
        return cache, chunks

    def gathering(chunks):
        return [i for i, c in chunks.items() if c.state is not ChunkState.SHARDED]

    cache, chunks = primed(None)
    cache.rewind()
    assert gathering(chunks) == list(range(ahead + 1))  # the next one and UNLIMITED_AHEAD more
    cache.acquire(chunks[0])
    assert gathering(chunks) == list(range(ahead + 2))
    cache.acquire(chunks[1])  # the slow one is UNLIMITED_AHEAD past the next: not yet
    assert gathering(chunks) == list(range(ahead + 2))
    for i in range(2, slow - 2):
        cache.acquire(chunks[i])
    assert gathering(chunks) == list(range(slow))
    cache.acquire(chunks[slow - 2])  # now it is the one past the next, and those behind it follow
    assert gathering(chunks) == list(range(n))
    assert all(c.gathers == 1 for c in chunks.values())

    cache, chunks = primed(n)
    cache.rewind()
    assert gathering(chunks) == [0, 1]
    cache.acquire(chunks[0])
    assert gathering(chunks) == [0, 1, 2]


def test_progress_issues_what_is_back_in_order_and_issue_handed_over_waits_for_the_rest():
    """A poll (each chunk use) issues, oldest first, the collectives whose comparisons are back,
    prefetched gathers included, and waits for none: a use that waited for the last prefetch's
    comparison held each module until the other ranks caught up. issue_handed_over, at points
    every rank reaches alike, issues everything, waiting for the comparisons."""
    from zeroshard.distributed.ordering import Sequencer

    class Comparison:
        def __init__(self):
            self.back = False

        def is_completed(self):
            return self.back

    class Check:  # OrderCheck's start/finish, the comparisons' answers set by hand
        def __init__(self):
            self.comparisons, self.waited = [], []

        def start(self, tag):
            self.comparisons.append(Comparison())
            return None, self.comparisons[-1], 0

        def finish(self, tag, buf, work, deferred):
            if not work.back:
                self.waited.append(tag)
            work.back = True

    check, issued = Check(), []
    seq = Sequencer(check, inline=False)
    for tag in (1, 2, 3):  # reduce, prefetched gather, reduce
        seq.submit(tag, lambda tag=tag: issued.append(tag))
    seq.progress()
    assert issued == []  # no comparison back yet
    check.comparisons[0].back = check.comparisons[2].back = True
    seq.progress()
    assert issued == [1] and check.waited == []  # 3 goes out after 2, whose answer is not back
    check.comparisons[1].back = True
    seq.progress()
    assert issued == [1, 2, 3] and check.waited == []
    for tag in (4, 5):
        seq.submit(tag, lambda tag=tag: issued.append(tag))
    seq.issue_handed_over()
    assert issued == [1, 2, 3, 4, 5] and check.waited == [4, 5]
