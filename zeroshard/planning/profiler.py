"""The pre-runtime profiler (Elixir section 4): one training step of the model run on the meta device,
so a model of any size is profiled in seconds without memory and without its weights.

What one profile records (vocabulary used by the planner):
- trace: every module call that uses parameters, in order: 'forward' (a module's forward),
  'backward' (its backward is about to run: the moment stage 3 gathers its chunks again) and
  'recompute' (its forward re-run in backward by activation checkpointing). Each event names the
  module's direct parameters, exactly the ones stage 3 gathers for it.
- first use: parameters in order of first use in forward (unused ones last): the chunk packing order.
- checkpoint region: a run of recompute events; its parameters are needed again, together, while the
  region's forward is re-run and then its backward.
- saved bytes: peak bytes of tensors autograd saved for backward (parameters excluded).
- peak activation bytes: peak bytes of every tensor created during the step that is alive at once
  (saved tensors, checkpoints, gradients of activations and temporaries), parameters and the inputs
  excluded. Measured by following each new storage from the operator that made it until it is freed.
- flops: forward + backward (+ recompute) floating-point operations of the matmul-like operators.

The model may live anywhere (CPU, GPU, meta): the profile swaps meta copies of its parameters and buffers (in the
compute dtype) into the modules for the step, and puts the real ones back after, untouched.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from ..distributed.tensor_parallel import as_dtensor, local, local_shape
from .input_values import InputValues
from .meta_counters import AttentionAsOnDevice, AutocastOnMeta, LiveBytes, SavedBytes
from ..units import BackwardHolds, direct_params, leaf_modules, refuse_untrainable, unit_members
from ..errors import ConfigError

log = logging.getLogger("zeroshard")


@dataclass(frozen=True)
class ParamInfo:
    name: str  # first fully qualified name
    numel: int  # elements
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True)
class Event:
    phase: str  # 'forward' | 'backward' | 'recompute'
    module: str
    params: tuple[int, ...]  # indices into Profile.params, in the module's registration order


@dataclass(frozen=True)
class CheckpointRegion:
    modules: tuple[str, ...]
    params: tuple[int, ...]
    param_bytes: int  # bytes of these parameters in the compute dtype


@dataclass
class Profile:
    """One profiled training step. Byte figures are bytes; `*_numel` figures are elements."""

    params: list[ParamInfo]
    dtype: torch.dtype
    trace: list[Event]
    first_use: list[int]
    checkpoint_regions: list[CheckpointRegion]
    saved_bytes: int
    peak_activation_bytes: int
    buffer_bytes: int
    flops: int
    seconds: float
    tied_numel: int = 0  # elements of parameters registered under more than one name
    largest_module_numel: int = 0  # most elements of direct parameters of any one module
    peak_phase: str = field(default="")  # 'forward' or 'backward': where the activation peak is
    collectives: int = 0  # the model's own collectives over the step (tensor parallelism's)
    collective_bytes: int = 0  # bytes each rank moves in them (ring accounting)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def summary(self) -> str:
        gib = 2**30
        return (f"{len(self.params)} parameters, {self.numel / 1e9:.3f} B elements; trace of "
                f"{len(self.trace)} module events; {len(self.checkpoint_regions)} checkpoint regions; "
                f"saved for backward {self.saved_bytes / gib:.3f} GiB, peak activations "
                f"{self.peak_activation_bytes / gib:.3f} GiB ({self.peak_phase}); "
                f"{self.flops / 1e12:.2f} TFLOP per step"
                + (f"; {self.collectives} model collectives moving {self.collective_bytes / gib:.3f} GiB"
                   if self.collectives else "")
                + f"; profiled in {self.seconds:.2f} s")






def _split_inputs(example_inputs):
    if isinstance(example_inputs, dict):
        return (), example_inputs
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


def measure(model: nn.Module, example_inputs, *, loss_fn=None) -> dict[str, int]:
    """The same figures as `profile` measured on real tensors: run one real training step of
    `model` where it lives (inputs are moved there) and return {'saved_bytes', 'peak_activation_bytes'}
    (and, on CUDA, 'cuda_peak_bytes': torch.cuda.max_memory_allocated over the step, minus what was
    allocated before it). Gradients are taken off the parameters as they arrive, as the engine does.
    For checking the profiler; it needs the memory the step needs."""
    device = next(model.parameters()).device
    args, kwargs = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                            _split_inputs(example_inputs))
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    known = params | {b.untyped_storage()._cdata for b in model.buffers()}
    known |= {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
             for p in model.parameters() if p.requires_grad]
    saved, live = SavedBytes(params), LiveBytes(known)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), live:
            loss = (loss_fn or default_loss)(model(*args, **kwargs))
            live.phase = "backward"
            loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
    out = {"saved_bytes": saved.peak, "peak_activation_bytes": live.peak}
    if cuda:
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return out




def _meta_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A meta copy of parameter `p` in `dtype`; a DTensor's copy is a DTensor over the same mesh
    whose local shard is on the meta device, so tensor-parallel modules run as they will."""
    if isinstance(p, DTensor):
        return as_dtensor(p, torch.empty(local_shape(p), dtype=dtype, device="meta"))
    return torch.empty(p.shape, dtype=dtype, device="meta")


def _to_meta(x, dtype, values: InputValues):
    """A meta copy of input or buffer `x` (floating ones in `dtype`) that keeps its value in `values`
    where it has one (not a meta model's buffer)."""
    if isinstance(x, torch.Tensor):
        d = dtype if x.is_floating_point() else x.dtype
        meta = torch.empty(x.shape, dtype=d, device="meta")
        if x.device.type != "meta" and not isinstance(x, DTensor):
            values.give(meta, x)
        return meta
    return x


def default_loss(out) -> torch.Tensor:
    """A scalar to run backward from: `out.loss` when the model returns one (transformers models
    given labels), `out` itself when it is a scalar, else the sum of the first floating output."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    flat, _ = tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            return t.float().sum()
    raise ConfigError("zeroshard.profile: the model's output has no floating tensor that requires grad; "
                     "pass loss_fn=... to say how to get the loss")


def profile(model: nn.Module, example_inputs, *, dtype: torch.dtype | str = torch.float32,
            loss_fn=None, device: torch.device | str | None = None, leaves=None) -> Profile:
    """Profile one training step (forward + backward) of `model` on the meta device.

    example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments, as the
        model is called in training (include labels if the model computes its loss from them): their
        shapes and dtypes, floating ones cast to `dtype` as the engine does, and what the model reads
        of their values (input_values.py: a label check, a branch on the attention mask).
    dtype: the compute dtype (torch.float32/bfloat16/float16 or 'fp32'/'bf16'/'fp16').
    loss_fn: maps the model's output to the scalar loss (default: see `default_loss`).
    device: the device that will train ('cuda' or 'cpu'; default: CUDA when present): operators
        that choose their kernel by device (attention) choose as they will there.
    leaves: the modules stage 3 gathers with their whole subtree (units.py; default: the
        mixture-of-experts blocks config leaf_modules 'auto' finds): the trace names them, not
        their submodules.
    """
    refuse_untrainable(model)  # a plan for a model initialize would refuse helps no one
    if isinstance(dtype, str):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    t0 = time.perf_counter()
    args, kwargs = _split_inputs(example_inputs)
    values = InputValues()  # what the model reads of its inputs and buffers: see input_values.py
    args, kwargs = tree_map(lambda x: _to_meta(x, dtype, values), (args, kwargs))

    # Meta copies of parameters (in the compute dtype) and buffers, swapped into the modules' entries
    # for the whole step (backward re-runs checkpointed forwards); tied parameters share one copy.
    infos, index, meta_of = [], {}, {}
    for name, p in model.named_parameters():
        d = dtype if p.is_floating_point() else p.dtype
        meta_of[id(p)] = nn.Parameter(_meta_like(p, d), requires_grad=p.requires_grad)
        index[id(meta_of[id(p)])] = len(infos)
        shape = local_shape(p)  # what this rank stores: a tensor-parallel parameter's local shard
        infos.append(ParamInfo(name, math.prod(shape), tuple(shape), p.requires_grad))
    swaps, buffer_bytes, tied_numel = [], 0, 0
    for m in model.modules():
        for entries, is_param in ((m._parameters, True), (m._buffers, False)):
            for n, t in entries.items():
                if t is None:
                    continue
                if is_param:
                    tied_numel += local(t).numel()
                    new = meta_of[id(t)]
                else:
                    buffer_bytes += t.numel() * t.element_size()
                    new = _to_meta(t, t.dtype, values)
                swaps.append((entries, n, t, new))
    tied_numel -= sum(i.numel for i in infos)
    known = {local(new).untyped_storage()._cdata for *_, new in swaps}
    known |= {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}

    trace: list[Event] = []
    first_seen: dict[int, None] = {}
    owners: dict[int, list[str]] = {}  # parameter index -> modules holding it in backward
    held = BackwardHolds(owners)  # as stage 3 holds (runtime/hooks.py), by module name
    ends: set[int] = set()  # trace positions where a unit's backward began (checkpoint regions end there)
    state = {"backward": False}
    units = unit_members(model, leaf_modules(model, "auto") if leaves is None else list(leaves))
    direct = {m: mname for mname, m in model.named_modules() if units.get(m)}  # units with parameters
    unit_index = {m: tuple(dict.fromkeys(index[id(meta_of[id(p)])] for member in units[m]
                                         for _, p in direct_params(member))) for m in direct}
    largest = max((sum(infos[i].numel for i in ps) for ps in unit_index.values()), default=0)

    def module_params(m) -> tuple[int, ...]:
        return unit_index[m]

    def pre_forward(m, _args):
        ps = module_params(m)
        trace.append(Event("recompute" if state["backward"] else "forward", direct[m], ps))
        if not state["backward"]:
            for i in ps:
                first_seen.setdefault(i, None)

    def pre_backward(mname, ps, event=True):
        state["backward"] = True
        if event:  # a unit's backward begins here, held or not: no recomputation runs across it
            ends.add(len(trace))
        if not held.begin(mname, {i for i in ps if infos[i].requires_grad}):
            return
        for i in ps:
            owners.setdefault(i, [])
            if mname not in owners[i]:
                owners[i].append(mname)
        if event:  # not a hold begun as its recomputation ended (its chunks in hand: runtime/hooks.py)
            trace.append(Event("backward", mname, ps))

    def post_forward(m, _args, out):
        if torch.is_grad_enabled() and state["backward"]:  # a recomputation, held from here (hooks.py)
            pre_backward(direct[m], module_params(m), event=False)
        if torch.is_grad_enabled():
            ts = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if ts:
                register_multi_grad_hook(ts, lambda g, n=direct[m], ps=module_params(m): pre_backward(n, ps),
                                         mode="any")

    def grad_arrived(p):
        i = index[id(p)]
        p.grad = None  # the engine moves gradients into chunks: they do not stay on the parameter
        held.arrived(i)

    handles = []
    for m in direct:
        handles.append(m.register_forward_pre_hook(pre_forward))
        handles.append(m.register_forward_hook(post_forward))
    for p in meta_of.values():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(grad_arrived))

    saved = SavedBytes(known)

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    live = LiveBytes(known, values)
    was_training = model.training
    model.train()
    for entries, n, _, new in swaps:
        entries[n] = new
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), live, \
                AttentionAsOnDevice(torch.device(device)), AutocastOnMeta(torch.device(device)):
            out = model(*args, **kwargs)
            loss = (loss_fn or default_loss)(out)
            del out
            live.phase = "backward"
            state["backward"] = True
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        for entries, n, old, _ in swaps:
            entries[n] = old
        model.train(was_training)

    first_use = list(first_seen) + [i for i in range(len(infos)) if i not in first_seen]
    regions = []
    run: list[Event] = []
    for k, ev in enumerate(trace + [Event("end", "", ())]):
        if ev.phase == "recompute" and not (run and k in ends):
            run.append(ev)
            continue
        if run:
            ps = tuple(dict.fromkeys(i for e in run for i in e.params))
            regions.append(CheckpointRegion(tuple(e.module for e in run), ps,
                                            sum(infos[i].numel for i in ps) * dtype.itemsize))
            run = [ev] if ev.phase == "recompute" else []
    return Profile(params=infos, dtype=dtype, trace=trace, first_use=first_use, checkpoint_regions=regions,
                   saved_bytes=saved.peak, peak_activation_bytes=live.peak, buffer_bytes=buffer_bytes,
                   flops=int(live.flops), seconds=time.perf_counter() - t0, tied_numel=tied_numel,
                   largest_module_numel=largest, peak_phase=live.peak_phase, collectives=live.collectives,
                   collective_bytes=int(live.collective_bytes))
