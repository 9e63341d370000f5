"""torch.compile under zeroshard (config `compile`, `compile_scope`): which code a graph holds, and why.

At stages 0-2 the root's whole forward is compiled, as DDP + torch.compile compiles it (the
embedding, the head and the loss in the graph), cut into graph segments of about a chunk each where
the model has several trainable chunks (graph_segments.py); a model of more than WHOLE_BLOCKS layer
blocks has each block's forward compiled instead (Note: compile scope), and so has one whose root's
forward a front end replaced. At stage 3 each layer block's forward is compiled (units.layer_blocks:
the modules of the model's ModuleList of layers; also any leaf_modules), unless the root is the one
unit, its forward compiled whole as at stages 0-2 (a model of one chunk, Note: one chunk; with an
unlimited rCache, up to WHOLE_BLOCKS blocks, Note: one unit); a model without such blocks has its
whole forward compiled at stages 0-2. The forward function itself, not the module's call: a
module's hooks stay outside its graph, as FSDP2's users compile each block they shard.
- Stage 3 makes each block a leaf unit at initialize: its chunks are gathered and released by its
  own hooks, eagerly, around its compiled forward, and no hook runs inside it, so the graph holds
  the model's code alone. The graph's saved tensors pass through the saved-tensor hooks, so a
  weight saved for backward is still kept by reference to its chunk (saved_tensors.py) and the
  block's chunks are released between its forward and its backward. Where the root is the one
  leaf unit, its forward is compiled whole (Notes: one chunk, one unit); a model of several chunks
  with no blocks and no leaf_modules, and a limited rCache, is refused (assembly.compile_units).
- Stages 1-2: the arrival hooks (arrival.py) would wait inside a block's graph for its chunks, which
  a graph cannot do without a break. Each compiled block therefore waits in its own hook, outside
  its graph, for the chunks of every parameter in it, and its graph runs with the arrival guard
  off the mode stack (ArrivalHooks.wait_per_block): later blocks' chunks still arrive while earlier
  blocks compute. A forward compiled whole waits for every chunk before it starts.
- A gradient reaches its chunk through autograd's hooks on the parameter, outside any graph.
- Where the blocks are compiled one by one, the code outside them (embeddings, the head, the loss)
  runs eagerly, and a front end may patch the root module's forward (Lightning redirects it to
  training_step) without undoing a compile.
Compiling waits for the first training forward to end: it records the order of first use and
re-packs the chunks (the recording's hooks would otherwise be traced into the graphs).

Note: compile scope. Compiled whole, a model's layers are unrolled into one graph, so its compile
time grows with its depth; compiled block by block, the blocks share one graph, compiled once for
all, while the code outside them runs eagerly. A GPT-2 of 24 layers (n_embd 256, inductor, one CPU
thread, caches off) compiled in 87.5 s whole against 17.0 s block by block; gpt2-small-cpu (6
layers, seven chunks; 2 ranks on 2 cores, 120 interleaved steps) stepped in 0.995 / 0.960 / 0.960
of DDP + compile's time at stages 0 / 1 / 2 compiled whole in segments, against 1.015 / 0.981 /
0.980 block by block (its eager cross-entropy over 8192 tokens' logits, and the page faults of
their fresh gradients, were most of the difference in `perf`'s samples). Config compile_scope
'auto' (the default) compiles whole at stages 0-2 up to WHOLE_BLOCKS blocks (some 30 s of compile
here), where the eager remainder is a larger share of a step and the compile still short, block by
block beyond (where a model is one chunk: whole, Note: one chunk); 'model' compiles whole at any
depth, 'blocks' block by block always (at stage 3 a model of one chunk too). At stage 3 the scope
chooses whether the root is the one unit (Note: one unit): 'model' there needs a model of one chunk
or an unlimited rCache (assembly.compile_units), as the units' gathers run in their hooks, outside
any graph.

Note: one chunk. At stages 0-2 a block boundary is worth a graph boundary only for what happens
there between chunks: a chunk's gradients are reduced as soon as its last block's backward is done,
while earlier blocks' backward runs, and (stages 1-2) a block's updated chunk is waited for at that
block while later blocks' chunks still arrive. When the parameters are one chunk, its reduction
waits for the whole backward and its arrival is waited for before the first block either way, so
the whole forward is compiled, as DDP + torch.compile compiles a model of one bucket (a small
model: its graph compiles fast; a deep one whose trainable parameters alone are one chunk, as
LoRA's, keeps one graph per block, shared by all, not one that grows with its depth):
the embedding, the head and the loss join the graph (gpt2-tiny, one 13 MB chunk, 2 ranks on 2
cores: compiled stage 0 stepped in 1.022 -> 0.995x DDP + compile's time, stage 1 1.043 -> 1.028x,
stage 2 1.054 -> 1.044x, one interleaved run). Not where the root's forward is an attribute of its
own instead of its class's (a front end redirecting it per call, as Lightning's to training_step,
or wrapping it, as accelerate's autocast): a compile of it would be undone or compile the wrapper.
Stage 3 likewise: with one chunk, every unit's hooks gather and release that same chunk, so the
root is made the one unit (at initialize, before packing, from the chunk count the packing will
give), its hooks run once around the whole forward, and the graph holds the embedding, the head
and the loss too (gpt2-tiny, 2 ranks on 2 cores, one interleaved run of 60 steps: compiled stage 3
stepped in 1.054x DDP + compile's time with its four blocks compiled, 1.007x compiled whole).
Not under offload or stage 'auto': the plan's prefetch schedule names the modules it profiled.
Where a front end replaces the root's forward after initialize, its layer blocks are compiled
inside that one unit instead (compile_targets); every module of the root has hooks for calls from
outside its forward (hooks.Stage3Hooks), which return at once inside a graph.

Note: one unit. At stage 3 with an unlimited rCache (no cache_chunks) nothing gathered is released
before the step, so units gathered one by one buy only the gathers' overlap with the forward's
compute, at the price of the blocks compiled one by one and the code between them eager. There the
root is made the one unit too, as for one chunk, at most WHOLE_BLOCKS blocks deep under
compile_scope 'auto': its hooks gather every chunk before the forward (the memory the forward's end
holds anyway) and its forward is compiled whole in graph segments, as at stages 0-2, so each
segment's gradients are reduce-scattered while the backward goes on (gpt2-small-cpu, seven chunks,
2 ranks on 2 cores, 120 interleaved steps: 1.017 -> 0.988 of DDP + compile's time, the backward
581 -> 551 ms). A limited rCache keeps a unit per block: there the gathers' order is the memory bound.

Note: KV cache. A Hugging Face decoder called without `use_cache` builds a KV cache (its
config.use_cache, true unless set) in training too, where nothing reads it. Each layer's attention
passes its own layer_idx to the cache, which dynamo guards as a constant, so the forward compiled
once for every layer block is compiled again for each layer until the recompile limit (8) leaves
the later layers eager (a 12-layer Llama, stage 2, blocks over several chunks: 8 graphs and a
limit hit; 1 graph with use_cache=False). torch.compile of a whole model unrolls its layers into
one graph and never meets this; compiling block by block does. So with config compile a call that
names neither use_cache nor a cache (`cache`, `past_key_values` before transformers 5) runs with
use_cache=False (calls_without_kv_cache), as transformers' Trainer sets config.use_cache from its
use_cache argument (False by default). generate names use_cache (Note: generation).

Note: generation. generate passes each layer block the model's KV cache, whose layer index dynamo
again takes as a constant: the compiled block would be compiled anew for each layer and step shape
until the recompile limit left it eager (a 10-layer GPT-2's first generate: 1.8 s of aot_eager
compiles and a limit hit; with inductor, a kernel build each). A call carrying a transformers
`Cache` therefore runs the module's own forward (compile_model), as generation without compile.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Callable

import torch
import torch.nn as nn

from ..units import layer_blocks
from .graph_segments import compile_in_segments


WHOLE_BLOCKS = 8  # compile_scope 'auto': the most layer blocks compiled whole at stages 0-2 (Note: compile scope)


class TorchCompiler:
    """torch.compile with config `compile`'s keyword arguments: called with a function, its compiled
    form; in_segments(elements) gives the same compiler cutting each graph into graph segments of
    about `elements` trainable elements (graph_segments.py), or this one where it cannot."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs

    def __call__(self, fn: Callable) -> Callable:
        return torch.compile(fn, **self.kwargs)

    def in_segments(self, elements: int) -> Callable:
        return compile_in_segments(self.kwargs, elements) or self


def torch_compiler(setting) -> TorchCompiler | None:
    """The compiler config `compile` names: torch.compile with its keyword arguments (True: none),
    or None when off."""
    if setting is False:
        return None
    return TorchCompiler({} if setting is True else dict(setting))


def compiles_whole(module: nn.Module, chunks: int, scope: str = "auto") -> bool:
    """Whether a model of `chunks` chunks has its root's forward compiled for that count alone: one
    chunk, a root whose forward is its class's, and compile_scope not 'blocks' (Note: one chunk)."""
    return chunks <= 1 and scope != "blocks" and "forward" not in vars(module)


def root_is_one_unit(module: nn.Module, chunks: int, scope: str, cache_chunks: int | None) -> bool:
    """Stage 3: whether the root is the one unit, its forward compiled whole: a model of one chunk
    (compiles_whole), or, with an unlimited rCache (`cache_chunks` None) and a root whose forward is
    its class's, compile_scope 'model', or 'auto' and at most WHOLE_BLOCKS layer blocks (Note: one unit)."""
    return compiles_whole(module, chunks, scope) or cache_chunks is None and _scope_compiles_whole(module, scope)


def _scope_compiles_whole(module: nn.Module, scope: str) -> bool:
    """Whether compile_scope compiles the root's forward whole for the model's depth (Note: compile
    scope): 'model', or 'auto' and at most WHOLE_BLOCKS layer blocks, where the forward is its class's."""
    shallow = scope == "model" or scope == "auto" and len(layer_blocks(module)) <= WHOLE_BLOCKS
    return shallow and "forward" not in vars(module)


def compile_forwards(module: nn.Module, stage: int, leaves: list[nn.Module], chunks: list, compiler: Callable,
                     scope: str) -> list[nn.Module]:
    """Compile the forwards of compile_targets with `compiler`; a root compiled whole over several
    trainable chunks in graph segments of the largest one's padded elements, where the compiler is
    config `compile`'s (one given to engine.compile_with compiles one graph). Returns the modules
    compiled."""
    targets = compile_targets(module, stage, leaves, len(chunks), scope)
    trainable = [c.padded_numel for c in chunks if c.trainable]
    if targets == [module] and len(trainable) > 1 and isinstance(compiler, TorchCompiler):
        compiler = compiler.in_segments(max(trainable))
    return compile_model(targets, compiler)


def compile_targets(module: nn.Module, stage: int, leaves: list[nn.Module], chunks: int,
                    scope: str = "auto") -> list[nn.Module]:
    """The modules whose forwards are compiled, the root named when it is compiled whole.
    Stages 0-2: the root where the model has no layer blocks, or (its forward its class's) where
    compile_scope says so (Note: compile scope) or it is `chunks` <= 1 chunk (compiles_whole); its
    layer blocks otherwise. Stage 3: its leaf units, chosen at initialize
    (assembly.compile_units); where the root is the one leaf but a front end has replaced its
    forward since (Lightning redirects it to training_step for each call: a compile of it would be
    undone at the call's end), or `scope` is 'blocks' (the forward compiling is a module's called
    directly: the root's would not run), the root's layer blocks instead, which have no hooks inside
    it (none when it has no blocks: nothing is compiled)."""
    if stage == 3:
        if list(leaves) == [module] and ("forward" in vars(module) or scope == "blocks"):
            return layer_blocks(module)
        return list(leaves)
    blocks = layer_blocks(module)
    whole = not blocks or compiles_whole(module, chunks, scope) or _scope_compiles_whole(module, scope)
    return [module] if whole else blocks


CACHE_ARGUMENTS = ("cache", "past_key_values")  # a Hugging Face forward's KV cache, by its name since and before v5


def calls_without_kv_cache(module: nn.Module) -> list:
    """Forward pre-hooks on `module` and each module in it whose forward takes `use_cache` and whose
    config has one (a Hugging Face model; another module's use_cache may mean something else): a
    call naming neither use_cache nor a cache (CACHE_ARGUMENTS) gets use_cache=False (Note: KV
    cache), said once per module where its config.use_cache was on. Returns the handles."""
    handles = []
    for m in module.modules():
        if not hasattr(getattr(m, "config", None), "use_cache"):
            continue
        try:
            names = list(inspect.signature(m.forward).parameters)
        except (TypeError, ValueError):  # a forward without a signature to read
            continue
        if "use_cache" in names:  # a call passing it, or the cache, by position names it too
            named_within = min(names.index(k) for k in ("use_cache", *CACHE_ARGUMENTS) if k in names)
            handles.append(m.register_forward_pre_hook(
                functools.partial(_without_kv_cache, named_within, [False]), with_kwargs=True))
    return handles


def _without_kv_cache(named_within: int, said: list, module: nn.Module, args, kwargs):
    if "use_cache" in kwargs or any(kwargs.get(k) is not None for k in CACHE_ARGUMENTS) or len(args) > named_within:
        return None
    if not said[0] and getattr(getattr(module, "config", None), "use_cache", False):
        said[0] = True
        logging.getLogger("zeroshard").warning(
            "zeroshard: compile: %s is called with use_cache=False (the call named neither use_cache nor "
            "a cache): a KV cache would compile each layer block anew for its layer "
            "(runtime/compiled.py's Note: KV cache); name use_cache to choose", type(module).__name__)
    return args, {**kwargs, "use_cache": False}


def compile_model(targets: list[nn.Module], compiler: Callable) -> list[nn.Module]:
    """Replace each target's forward by `compiler(forward)`, which a call carrying a KV cache
    bypasses (Note: generation). Returns the targets."""
    for m in targets:
        m.forward = _eager_with_kv_cache(m.forward, compiler(m.forward))
    return list(targets)


def compiled_form(forward: Callable) -> Callable | None:
    """The compiled function behind a forward compile_model installed, or None for any other."""
    return getattr(forward, "zeroshard_compiled", None)


def _eager_with_kv_cache(eager: Callable, compiled: Callable) -> Callable:
    @functools.wraps(eager)
    def forward(*args, **kwargs):
        cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)  # loaded with any model using one
        if cache is not None and any(isinstance(v, cache) for v in (*args, *kwargs.values())):
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)
    forward.zeroshard_compiled = compiled  # a name no forward of a model has (compiled_form)
    return forward
