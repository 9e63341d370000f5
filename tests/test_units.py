"""Single-process tests of the pure pieces: config validation, chunk packing, the cache's
replacement and prefetch decisions, and a world of one process without torchrun."""
import json

import pytest
import torch

import zeroshard
from zeroshard.runtime import cache as cache_module
from zeroshard.runtime.cache import ChunkCache
from zeroshard.runtime.chunks import Chunk, ChunkState
from zeroshard.runtime.packing import ALIGN, Slot, auto_chunk_size, pack
from zeroshard.distributed.collectives import Comm
from zeroshard.config import Config, load_config
from zeroshard.telemetry.stats import chunk_state_bytes


# -- config ---------------------------------------------------------------------------------------
def test_tensor_parallel_config_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="partition_activations .* needs tensor_parallel > 1"):
        load_config({"partition_activations": True})
    assert load_config({"tensor_parallel": 2, "offload": "auto"}).planned  # the planner takes TP models
    with pytest.raises(ValueError, match="tensor_parallel"):
        load_config({"tensor_parallel": 0})
    assert load_config({"tensor_parallel": 2, "partition_activations": True}).tensor_parallel == 2


def test_shard_group_size_config_refuses_what_it_cannot_do():
    for bad in (0, -2, "gpu", 2.0, True):
        with pytest.raises(zeroshard.ConfigError, match="shard_group_size"):
            load_config({"shard_group_size": bad})
    for combo, words in (({"stage": 0}, "stage 0 shards nothing"),):
        with pytest.raises(zeroshard.ConfigError, match=words):
            load_config({"shard_group_size": 2, **combo})
    assert load_config({"shard_group_size": "node", "stage": 3}).shard_group_size == "node"
    assert load_config({"shard_group_size": 2, "offload": "auto", "stage": "auto"}).planned


def test_shard_optimizer_across_replicas_refuses_what_it_cannot_do():
    for combo, words in (({}, "set shard_group_size"), ({"shard_group_size": 2, "stage": 3}, "stage 1 or 2"),
                         ({"shard_group_size": 2, "offload_optimizer": True}, "stay on the device"),
                         ({"shard_group_size": 2, "offload": "auto"}, "stay on the device")):
        with pytest.raises(zeroshard.ConfigError, match=words):
            load_config({"shard_optimizer_across_replicas": True, **combo})
    with pytest.raises(zeroshard.ConfigError, match="true or false"):
        load_config({"shard_optimizer_across_replicas": "yes", "shard_group_size": 2})
    assert load_config({"shard_optimizer_across_replicas": True, "shard_group_size": 2}).shard_optimizer_across_replicas


def test_hpz_group_size_config_refuses_what_it_cannot_do():
    for bad in (0, "gpu", 2.0):
        with pytest.raises(zeroshard.ConfigError, match="hpz_group_size"):
            load_config({"hpz_group_size": bad, "stage": 3})
    for combo, words in (({"stage": 2}, "needs stage 3"), ({"stage": 3, "shard_group_size": 2}, "choose one"),
                         ({"stage": 3, "offload": "auto"}, "not planned")):
        with pytest.raises(zeroshard.ConfigError, match=words):
            load_config({"hpz_group_size": 2, **combo})
    assert load_config({"hpz_group_size": "node", "stage": 3}).hpz_group_size == "node"


def test_shard_group_size_must_divide_the_data_parallel_world(monkeypatch):
    from zeroshard.distributed.shard_groups import resolve_group_size
    assert resolve_group_size(None, 6) == 6 and resolve_group_size(3, 6) == 3
    with pytest.raises(zeroshard.ConfigError, match="does not divide the 6 data-parallel ranks"):
        resolve_group_size(4, 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_group_size("node", 8) == 4 and resolve_group_size("node", 4, tensor_parallel=2) == 2
    with pytest.raises(zeroshard.ConfigError, match="do not split into tensor-parallel groups of 3"):
        resolve_group_size("node", 6, tensor_parallel=3)


@pytest.mark.parametrize("key,value,valid", [
    ("stage", 4, "0, 1, 2, 3 or 'auto'"), ("stage", True, "0, 1, 2, 3 or 'auto'"), ("precision", "fp8", "'bf16'"),
    ("gradient_accumulation_steps", 0, ">= 1"), ("clip_grad_norm", -1.0, "> 0"),
    ("chunk_size", "big", "'auto'"), ("cache_chunks", 0, ">= 1"), ("prefetch", 1, "true or false"),
    ("initial_loss_scale", float("inf"), "finite"), ("initial_loss_scale", float("nan"), "finite"),
    ("initial_loss_scale", 0.0, "> 0"),
])
def test_bad_config_value_names_key_and_valid_values(key, value, valid):
    with pytest.raises(ValueError) as e:
        load_config({key: value})
    assert key in str(e.value) and valid in str(e.value)


@pytest.mark.parametrize("name, text, words", [
    ("bad.json", '{"stage": 3,,}', "does not parse as JSON: Expecting property name"),
    ("bad.toml", "stage = = 3", "does not parse as TOML: Invalid value"),
    ("binary.json", b"\xff\xfe\x00", "does not parse as JSON"),
    ("missing.json", None, "cannot read"),
    ("missing.toml", None, "No such file or directory"),
])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, name, text, words):
    """Issue 30, point 6: a bare JSONDecodeError/TOMLDecodeError without the file's name, or a
    FileNotFoundError, is a ConfigError (a ValueError) naming the file and why, in one line."""
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(str(path))
    assert isinstance(e.value, zeroshard.ConfigError) and str(path) in str(e.value) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="does not parse" if text is not None else "cannot read"):
        zeroshard.initialize(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), str(path))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_only_keys_warn_below_stage3(stage):
    with pytest.warns(UserWarning, match=f"cache_chunks=2 has no effect at stage {stage}"):
        load_config({"stage": stage, "cache_chunks": 2})
    with pytest.warns(UserWarning, match=f"prefetch=False has no effect at stage {stage}"):
        load_config({"stage": stage, "prefetch": False})


def test_stage3_keys_at_stage3_do_not_warn():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"stage": 3, "cache_chunks": 2, "prefetch": False})


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_engine_attributes_fall_through_to_the_model(stage):
    """As DeepSpeed's engine: engine.config is the transformers config, engine.generate generates
    (the same tokens as a plain copy of the trained weights, at stage 3 through the gather hooks)."""
    from models import make_sgd, tiny_gpt2
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": stage, "chunk_size": 20000})
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    assert type(engine.config).__name__ == "GPT2Config" and engine.config.n_layer == 2
    assert engine.zeroshard_config.stage == stage
    plain = tiny_gpt2()
    plain.load_state_dict(engine.full_state_dict())
    engine.eval()
    plain.eval()
    with torch.no_grad():
        got = engine.generate(x[:, :4], max_new_tokens=3, do_sample=False)
        want = plain.generate(x[:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        engine.no_such_thing


def test_unknown_config_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stagee'\].*'stage'"):
        load_config({"stagee": 3})


def test_config_from_json_and_toml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"stage": 3, "precision": "bf16"}))
    (tmp_path / "c.toml").write_text('stage = 1\nclip_grad_norm = 1.0\nchunk_size = 4096\n')
    assert load_config(str(tmp_path / "c.json")) == Config(stage=3, precision="bf16")
    assert load_config(tmp_path / "c.toml") == Config(stage=1, clip_grad_norm=1.0, chunk_size=4096)
    with pytest.raises(ValueError, match="json or .toml"):
        load_config(str(tmp_path / "c.yaml"))


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


# -- a world of one process, no torchrun environment ---------------------------------------------------
def test_single_process_without_torchrun(monkeypatch):
    from models import batches, make_sgd, max_diff, reference, tiny_gpt2, train
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    data = batches(3, 1, 2)
    ref, _, _ = reference(tiny_gpt2(), data, make_sgd)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, Config(stage=3, cache_chunks=2))
    train(engine, data, 0)
    assert engine.stats()["world_size"] == 1 and engine.stats()["comm_elements"] == 0
    assert max_diff(engine.full_state_dict(), ref) <= 1e-6


def test_a_tied_output_head_lets_go_of_its_chunk_once_its_own_backward_is_done():
    """GPT-2's lm_head shares wte's weight: that gradient is whole only at the embedding's backward,
    the last, so a hold ended by it kept wte's chunk pinned through the whole backward (a 2-chunk
    rCache then had one slot for every other chunk, and could prefetch none). The hold ends where
    the gradient reaches lm_head's input, and training matches plain torch."""
    from models import batches, make_sgd, max_diff, reference, tiny_gpt2, train
    data = batches(2, 1, 2)
    ref, _, _ = reference(tiny_gpt2(n_layer=4), data, make_sgd)
    engine = zeroshard.initialize(tiny_gpt2(n_layer=4), make_sgd, Config(stage=3, cache_chunks=2, chunk_size=20000))
    pinned_at_backward_uses = []
    acquire = engine.cache.acquire

    def recording(chunk):
        if engine.hooks.in_backward:  # the layout is packed anew after the first step: look each time
            tied = next(c.index for c in engine.layout.chunks if "transformer.wte.weight" in [s.name for s in c.slots])
            pinned_at_backward_uses.append(tied in engine.cache.pins)
        acquire(chunk)
    engine.cache.acquire = recording
    train(engine, data, 0)
    assert len(engine.layout.chunks) > 2 and pinned_at_backward_uses
    assert not any(pinned_at_backward_uses[1:-1])  # after lm_head's, before the embedding's own
    assert max_diff(engine.full_state_dict(), ref) <= 1e-6


def test_bad_optimizer_argument():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="callable"):
        zeroshard.initialize(model, optimizer="adamw")
    with pytest.raises(ValueError, match="not a parameter of the model"):  # built over another model
        zeroshard.initialize(model, optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not a parameter of the model"):  # a factory that builds its own
        zeroshard.initialize(torch.nn.Linear(2, 2), optimizer=lambda ps: torch.optim.SGD([torch.nn.Parameter(
            torch.ones(2))], lr=0.1))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        zeroshard.initialize(model, optimizer=stepped)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        zeroshard.initialize(torch.nn.Linear(2, 2), optimizer=lambda ps: ps)
    engine = zeroshard.initialize(torch.nn.Linear(2, 2), optimizer=torch.optim.SGD)  # a class works
    assert isinstance(engine.optimizer, torch.optim.SGD)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_dropped_engine_is_collected(stage):
    """Its chunks, masters and optimizer states come back: nothing outside it keeps it alive (the
    gradient hooks autograd holds in C++ reach it only weakly)."""
    import gc
    import weakref

    from models import batches, make_adamw, tiny_gpt2, train
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": stage})
    engine.record_memory(1)
    train(engine, batches(2, 1, 1), 0)
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, pair, extra):
        return (self.lin(pair.x) * pair.scale).sum() + self.lin(extra["k"][0]).sum() * extra["k"][1]


@pytest.mark.parametrize("stage", [0, 3])
def test_namedtuple_and_dict_of_tuples_inputs(stage):
    """Inputs go to the device through torch's pytree: a namedtuple (it has no one-argument
    constructor) and a dict of tuples keep their types; non-tensors pass through."""
    import collections
    Pair = collections.namedtuple("Pair", "x scale")
    torch.manual_seed(0)
    ref = _TwoInputs()
    torch.manual_seed(0)
    engine = zeroshard.initialize(_TwoInputs(), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": stage})
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    loss = engine(Pair(x, 2.0), {"k": (y, 3)})
    assert torch.allclose(loss, ref(Pair(x, 2.0), {"k": (y, 3)}), atol=1e-6)
    engine.backward(loss)
    assert engine.step()


def test_step_inside_backward_raises():
    """A step called from inside backward (a gradient hook) is out of order: a named error, not a
    corrupted step."""
    engine = zeroshard.initialize(torch.nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": 2})
    out = engine(torch.randn(2, 4)).sum()
    out.register_hook(lambda g: engine.step())
    with pytest.raises(RuntimeError, match="step\\(\\) called while the engine is in backward"):
        engine.backward(out)


@pytest.mark.parametrize("stage", [0, 3])
def test_torch_clip_grad_norm_on_trained_parameters_raises(stage):
    """Issue 14, defect 9: torch.nn.utils.clip_grad_norm_(model.parameters()) between backward and
    step found no .grad (gradients live in the chunks) and silently clipped nothing at stages 0-2
    (ShardedParameterError at stage 3). It raises GradientsInChunksError, naming the config key; on
    other parameters it is torch's own."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    engine = zeroshard.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": stage})
    engine.backward(engine(torch.ones(2, 4)).sum())
    with pytest.raises(zeroshard.GradientsInChunksError, match="clip_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)) > 0
    assert engine.step()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_moving_the_wrapped_model_raises_and_changes_nothing(stage):
    """Issue 14, defect 9: model.to(...) after initialize pointed parameters at new tensors at stages
    0-2, detached from the chunks the optimizer steps (here: torch's dtype mismatch at the next
    forward; a move the inputs still matched would have trained nothing). A move or cast raises
    (ModuleMovedError; ShardedParameterError at stage 3) and leaves the parameters on their chunks;
    a move to where they already are passes. Training then matches an engine never moved."""
    from models import max_diff
    data = torch.randn(3, 2, 4)
    results = []
    for move in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        engine = zeroshard.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": stage})
        for x in data:
            if move:
                model.to(torch.float32)  # already there: nothing happens
                model.float()
                with pytest.raises((zeroshard.ModuleMovedError, zeroshard.ShardedParameterError)):
                    model.to(torch.float64)
            engine.backward(engine(x).pow(2).mean())
            assert engine.step()
        results.append(engine.full_state_dict())
    assert max_diff(results[0], results[1]) == 0.0
