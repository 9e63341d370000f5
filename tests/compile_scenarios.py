"""Scenarios of tests/test_compile.py: config `compile` (runtime/compiled.py) trains what plain
PyTorch trains on the global batch at every stage, worlds 1-3, with no graph break or recompile of
zeroshard's making.

The backend is "aot_eager": dynamo captures the graphs and AOTAutograd splits forward from backward
(where the saved-tensor hooks and the parameters' gradient hooks meet the compiled code) and runs
the same aten operations eagerly, so the results are eager's to the bit; inductor's fused kernels
round differently, which the one inductor scenario bounds (world 1; CI's cores pay ~20 s to build
its kernels, once).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

import zeroshard

from distributed import WorldResults, record
from models import batches, inputs, make_adamw, make_sgd, parity, tiny_gpt2

SCENARIOS = {}
EAGERLIKE = {"backend": "aot_eager"}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Layers(nn.Module):
    """An embedding, three blocks in a ModuleList (what stage 3 compiles one by one), a head."""

    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x, checkpoint: bool = False):
        h = self.embed(x)
        for block in self.layers:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if checkpoint else block(h)
        return self.head(h)


class Flat(nn.Module):
    """No ModuleList of layers: compiled whole, except at stage 3 in more than one chunk (refused)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x, checkpoint: bool = False):
        return self.b(torch.tanh(self.a(x)))


def dynamo_counts() -> dict:
    """Graph breaks and graphs dynamo compiled since the last reset (torch._dynamo.utils.counters)."""
    from torch._dynamo.utils import counters
    return {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            # dynamo counts a frame it gave up on at its recompile limit as an "unimplemented" break
            "recompile_limit_hits": sum(n for k, n in counters["unimplemented"].items()
                                        if "recompile limit" in str(k).lower())}


def fresh_dynamo() -> None:
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()


def segments_in_backward(output: torch.Tensor) -> int:
    """The compiled graphs (AOTAutograd's backward nodes) in the autograd graph behind `output`: a
    forward compiled whole in graph segments has one per segment (runtime/graph_segments.py)."""
    seen, todo = set(), [output.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
    return sum(type(fn).__name__ == "CompiledFunctionBackward" for fn in seen)


def compiled_parity(rank, world, stage, make_opt=make_sgd, extra=None, checkpoint=False, options=EAGERLIKE,
                    build=Layers):
    """The compiled engine against plain eager PyTorch on the global batch (models.parity), with
    dynamo's counts over the compiled run and the compiled graphs behind the engine's last loss."""
    cfg = {"stage": stage, "chunk_size": 300, **(extra or {})}
    data = inputs(4, world, 4, 8)
    segments = []

    def loss(m, x, *_):
        out = m(x, checkpoint=checkpoint).pow(2).mean()
        if isinstance(m, zeroshard.Engine):  # not the plain reference
            segments.append(segments_in_backward(out))
        return out
    fresh_dynamo()
    engine, diff = parity(rank, world, build, loss, data, make_opt, {**cfg, "compile": options})
    return {"diff": diff, **dynamo_counts(), "compiled": [type(m).__name__ for m in engine.compiled],
            "chunks": len(engine.chunks), "trainable_chunks": sum(c.trainable for c in engine.chunks),
            "segments": segments[-1]}


BLOCKS = {"compile_scope": "blocks"}
for _stage in range(4):  # compiled whole by default (runtime/compiled.py's Notes: compile scope, one unit)
    SCENARIOS[f"sgd_stage{_stage}"] = functools.partial(compiled_parity, stage=_stage)
    SCENARIOS[f"blocks_sgd_stage{_stage}"] = functools.partial(compiled_parity, stage=_stage, extra=BLOCKS)
# Stage 3 with a limited rCache: a unit per block, each block's forward compiled
SCENARIOS["cached_sgd_stage3"] = functools.partial(compiled_parity, stage=3, extra={"cache_chunks": 4})
SCENARIOS["blocks_checkpointing_stage1"] = functools.partial(compiled_parity, stage=1, checkpoint=True, extra=BLOCKS)
SCENARIOS["adamw_stage2"] = functools.partial(compiled_parity, stage=2, make_opt=make_adamw)
SCENARIOS["model_scope_one_chunk_stage3"] = functools.partial(
    compiled_parity, stage=3, extra={"compile_scope": "model", "chunk_size": 10**6})
SCENARIOS["model_scope_stage3"] = functools.partial(  # ConfigError: several chunks, a limited rCache
    compiled_parity, stage=3, extra={"compile_scope": "model", "cache_chunks": 4})
SCENARIOS["blocks_scope_one_chunk_stage3"] = functools.partial(
    compiled_parity, stage=3, extra={"compile_scope": "blocks", "chunk_size": 10**6})
SCENARIOS["adamw_offload_stage3"] = functools.partial(
    compiled_parity, stage=3, make_opt=make_adamw,
    extra={"offload_optimizer": True, "offload_params": True, "cache_chunks": 1})
SCENARIOS["adamw_offload_stage2"] = functools.partial(
    compiled_parity, stage=2, make_opt=make_adamw, extra={"offload_optimizer": True})
SCENARIOS["checkpointing_stage3"] = functools.partial(compiled_parity, stage=3, checkpoint=True)
SCENARIOS["cached_checkpointing_stage3"] = functools.partial(compiled_parity, stage=3, checkpoint=True,
                                                             extra={"cache_chunks": 4})
SCENARIOS["checkpointing_stage1"] = functools.partial(compiled_parity, stage=1, checkpoint=True)
SCENARIOS["no_blocks_stage2"] = functools.partial(compiled_parity, stage=2, build=Flat)
# One chunk (compiled.py's Note: one chunk): the whole forward, blocks and all, is one graph.
for _stage in range(3):
    SCENARIOS[f"one_chunk_stage{_stage}"] = functools.partial(compiled_parity, stage=_stage, extra={"chunk_size": 10**6})
SCENARIOS["one_chunk_checkpointing_stage2"] = functools.partial(
    compiled_parity, stage=2, checkpoint=True, make_opt=make_adamw,
    extra={"chunk_size": 10**6, "offload_optimizer": True})
# Stage 3: the root is the one unit, its forward compiled whole
SCENARIOS["one_chunk_stage3"] = functools.partial(compiled_parity, stage=3, extra={"chunk_size": 10**6})
SCENARIOS["one_chunk_checkpointing_stage3"] = functools.partial(
    compiled_parity, stage=3, checkpoint=True, make_opt=make_adamw,
    extra={"chunk_size": 10**6, "offload_optimizer": True, "offload_params": True, "cache_chunks": 1})
SCENARIOS["one_chunk_no_blocks_stage3"] = functools.partial(
    compiled_parity, stage=3, build=Flat, extra={"chunk_size": 10**6})


class ListLinear(nn.Module):
    """A linear layer whose parameters sit in a ParameterList its forward reads (no parameter of
    its own: stage 3 gathers them as its own all the same, units.unit_members)."""

    def __init__(self, width: int):
        super().__init__()
        torch.manual_seed(1)
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(8, width) / 3), nn.Parameter(torch.zeros(width))])

    def forward(self, x):
        return x @ self.ws[0] + self.ws[1]


class EmbeddedOutside(Layers):
    """Layers whose caller may embed the inputs itself, before calling it (as peft's prompt tuning
    and multimodal code call a model's input embedding outside its forward); the embedding reads a
    ParameterList."""

    def __init__(self):
        super().__init__()
        self.embed = ListLinear(16)

    def forward(self, x=None, checkpoint: bool = False, embeds=None):
        h = self.embed(x) if embeds is None else embeds
        for block in self.layers:
            h = block(h)
        return self.head(h)


def embedding_outside(rank, world):
    """Stage 3, one chunk, compiled whole: the embedding, called outside the root's forward, runs as
    a call of the root (hooks.Stage3Hooks._pre_forward_outside): the model trains as plain PyTorch
    does, with no graph break."""
    def loss(model, x, *_):
        root = model.module if isinstance(model, zeroshard.Engine) else model
        return model(embeds=root.embed(x)).pow(2).mean()
    fresh_dynamo()
    engine, diff = parity(rank, world, EmbeddedOutside, loss, inputs(4, world, 4, 8), make_adamw,
                          {"stage": 3, "chunk_size": 10**6, "compile": EAGERLIKE})
    counts = dynamo_counts()
    # Elements communicated in a step with the embedding's gradient, and in one without it (whose
    # graph is a second one: its input needs no gradient)
    x = inputs(1, world, 4, 8)[0, rank]
    engine.backward(loss(engine, x))
    engine.step()
    outside = engine.stats()["comm_elements"]
    engine.backward(engine(embeds=engine.module.embed(x).detach()).pow(2).mean())
    engine.step()
    return {"diff": diff, **counts, "compiled": [type(m).__name__ for m in engine.compiled],
            "chunks": len(engine.chunks), "comm_outside": outside, "comm_inside": engine.stats()["comm_elements"]}


SCENARIOS["one_chunk_embedding_outside_stage3"] = embedding_outside


def forward_of_its_own():
    """Layers whose root forward is an attribute of the instance, as a front end wraps it
    (accelerate's autocast, Lightning's redirection to training_step)."""
    model = Layers()
    model.forward = functools.partial(Layers.forward, model)
    return model


SCENARIOS["one_chunk_wrapped_forward_stage1"] = functools.partial(
    compiled_parity, stage=1, extra={"chunk_size": 10**6}, build=forward_of_its_own)
SCENARIOS["one_chunk_wrapped_forward_stage3"] = functools.partial(
    compiled_parity, stage=3, extra={"chunk_size": 10**6}, build=forward_of_its_own)


def arrivals_per_block(rank, world, stage=1):
    """Compiled stages 1-2, block by block: the chunks still arriving (an update's all-gather not yet
    waited for) as each block's forward begins, per step: a block waits for its own chunks only, in
    its hook outside its graph, so later blocks' chunks are still arriving at the first block."""
    seen = []

    def loss(model, x, k, *_):
        if isinstance(model, zeroshard.Engine):  # not the plain reference
            if k == 0:
                for block in model.module.layers:  # before the engine's own block hooks (made at compile)
                    block.register_forward_pre_hook(
                        lambda *_: seen[-1].append(sum(c.arriving is not None for c in model.chunks)))
            seen.append([])
        return model(x).pow(2).mean()
    fresh_dynamo()
    engine, diff = parity(rank, world, Layers, loss, inputs(4, world, 4, 8), make_sgd,
                          {"stage": stage, "chunk_size": 300, "compile": EAGERLIKE, **BLOCKS})
    return {"diff": diff, **dynamo_counts(), "arriving": seen, "chunks": len(engine.chunks)}


def deep_decoder_without_use_cache(rank, world, stage, use_cache=None):
    """A Hugging Face GPT-2 of 10 layers (more than dynamo's recompile limit of 8) called as users
    call it in training, without use_cache (compiled.py's Note: KV cache), or naming `use_cache`:
    the compiled engine against plain eager PyTorch, and dynamo's counts; then greedy generation
    by the engine's model and by a plain one holding its weights, and dynamo's counts after it."""
    named = {} if use_cache is None else {"use_cache": use_cache}
    loss = lambda m, x, *_: m(input_ids=x, labels=x, **named).loss  # noqa: E731
    fresh_dynamo()
    data = batches(2, world, 1)[:, 0]
    engine, diff = parity(rank, world, functools.partial(tiny_gpt2, n_layer=10), loss, data,
                          make_sgd, {"stage": stage, "chunk_size": 20000, "compile": EAGERLIKE})
    out = {"diff": diff, **dynamo_counts(), "compiled": len(engine.compiled), "chunks": len(engine.chunks)}
    plain = tiny_gpt2(n_layer=10)
    plain.load_state_dict(engine.full_state_dict())
    plain.eval()
    engine.eval()
    with torch.no_grad():  # generate passes the blocks a KV cache (compiled.py's Note: generation)
        prompt = data[0, rank, :, :8]
        want = plain.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
        got = engine.module.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
    return {**out, "same_tokens": bool(torch.equal(want, got)),
            "after_generate": dynamo_counts()}


for _stage in (2, 3):
    SCENARIOS[f"deep_decoder_stage{_stage}"] = functools.partial(deep_decoder_without_use_cache, stage=_stage)
SCENARIOS["deep_decoder_use_cache_named_stage2"] = functools.partial(deep_decoder_without_use_cache, stage=2,
                                                                     use_cache=True)
SCENARIOS["arrivals_per_block_stage1"] = arrivals_per_block


def reductions_during_backward(rank, world, stage=2):
    """A forward compiled whole in graph segments: when the first chunk's first gradient (the
    embedding's, the backward's last) is computed, the later chunks' gradients have arrived and
    their reductions started (their GradState), as in eager mode, where one graph would hand over
    every gradient at the backward's end. Per step, the count of chunks past ACCUMULATING."""
    started = []

    def loss(model, x, k, *_):
        if isinstance(model, zeroshard.Engine) and k == 0:
            first = model.module.embed.weight
            first.register_hook(lambda g: started.append(
                sum(c.grad_state.value != "accumulating" for c in model.chunks if c is not model.chunks[0])))
        return model(x).pow(2).mean()
    fresh_dynamo()
    engine, diff = parity(rank, world, Layers, loss, inputs(4, world, 4, 8), make_sgd,
                          {"stage": stage, "chunk_size": 300, "compile": EAGERLIKE})
    return {"diff": diff, **dynamo_counts(), "started": started, "chunks": len(engine.chunks),
            "compiled": [type(m).__name__ for m in engine.compiled]}


SCENARIOS["reductions_during_backward_stage2"] = reductions_during_backward
SCENARIOS["no_blocks_stage3"] = functools.partial(  # ConfigError: two chunks, a limited rCache
    compiled_parity, stage=3, build=Flat, extra={"chunk_size": 64, "cache_chunks": 1})
SCENARIOS["no_blocks_unlimited_cache_stage3"] = functools.partial(  # the root its one unit, compiled whole
    compiled_parity, stage=3, build=Flat, extra={"chunk_size": 64})


def run(rank, world, out_path):
    record(rank, out_path, [(name, functools.partial(fn, rank, world)) for name, fn in SCENARIOS.items()])


def run_inductor(rank, world, out_path):
    record(rank, out_path, {"stage3": functools.partial(compiled_parity, rank, world, 3, options=True),
                            "stage2": functools.partial(compiled_parity, rank, world, 2, options=True)})


COMPILE = WorldResults(run, "compile")
INDUCTOR = WorldResults(run_inductor, "compile_inductor", worlds=(1,))  # one build of the kernels (docstring)
