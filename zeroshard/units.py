"""Units: the modules whose parameters stage 3 gathers and releases together.

A unit is, by default, one module with parameters of its own: its forward gathers the chunks
holding them and releases them when it ends (hooks.Stage3Hooks). Every rank must then gather the
same chunks in the same order, which a module that runs on some ranks and not others breaks: a
mixture of experts with one module per expert runs, on each rank, only the experts its tokens were
routed to.

A *leaf* unit is a module whose whole subtree is one unit (DeepSpeed's "ZeRO-3 leaf modules", or
FSDP2's wrapping of a whole MoE block): its forward gathers the chunks of every parameter below it,
whatever its submodules do inside, so the gathers depend only on which leaves run, as they do on
every rank alike. Config `leaf_modules` names them (class names or qualified module names), and
"auto" adds the common mixture-of-experts pattern: a module with a ModuleList or ModuleDict of two or
more experts (submodules of one class with the same parameter shapes) beside a router (a 2-D
parameter, not an embedding, with one row per expert). Fused-expert MoEs (one tensor for all
experts: Mixtral, Qwen2-MoE and OLMoE in transformers) need no leaf. "auto" also makes a leaf of
each of peft's parameter adapters (`ParamWrapper`, what LoRA's "all-linear" puts around a fused MoE's
router and experts): its forward multiplies its adapters' weights outside their own forwards and
swaps the wrapped module's parameter through torch's parametrize, which an activation
checkpoint's recomputation runs again with no enclosing forward to lend the parameters.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .errors import ConfigError, UnsupportedModelError


def direct_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A module's own parameters (not its submodules'), as (attribute name, parameter)."""
    return [(n, p) for n, p in module._parameters.items() if p is not None]


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules "auto" makes leaves: each holds a ModuleList/ModuleDict of experts and the router
    that picks among them (module docstring); the outermost such modules, in module order."""
    found = []
    for m in model.modules():
        for child in m.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and _experts(child) and \
                    _has_router(m, child, len(child)):
                found.append(m)
                break
    return _outermost(found)


def parameter_adapters(model: nn.Module) -> list[nn.Module]:
    """peft's adapters of a parameter (module docstring), by class name and package: zeroshard
    does not import peft."""
    return [m for m in model.modules() if type(m).__name__ == "ParamWrapper" and type(m).__module__.startswith("peft.")]


def _experts(container: nn.Module) -> bool:
    experts = list(container.children())
    if len(experts) < 2 or len({type(e) for e in experts}) != 1:
        return False
    shapes = [[(n, tuple(p.shape)) for n, p in e.named_parameters()] for e in experts]
    return bool(shapes[0]) and all(s == shapes[0] for s in shapes)


def _has_router(block: nn.Module, container: nn.Module, n_experts: int) -> bool:
    inside = {id(m) for m in container.modules()}
    for m in block.modules():
        if id(m) in inside or isinstance(m, nn.Embedding):
            continue
        if any(p.dim() == 2 and p.shape[0] == n_experts for _, p in direct_params(m)):
            return True
    return False


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    inner = {id(d) for m in modules for d in m.modules() if d is not m}
    return [m for m in modules if id(m) not in inner]


def leaf_modules(model: nn.Module, spec) -> list[nn.Module]:
    """The leaf units config `leaf_modules` names (Config docstring): "auto", or a sequence of class
    names, qualified module names and "auto". Raises ValueError for a name that matches no module."""
    names = ("auto",) if spec == "auto" else tuple(spec or ())
    by_name = dict(model.named_modules())
    found, unmatched = [], []
    for name in names:
        if name == "auto":
            hits = expert_blocks(model) + parameter_adapters(model)
        elif name in by_name and name:
            hits = [by_name[name]]
        else:
            hits = [m for m in model.modules() if type(m).__name__ == name]
            if not hits:
                unmatched.append(name)
        found.extend(m for m in hits if all(m is not f for f in found))
    if unmatched:
        raise ConfigError(f"zeroshard config: leaf_modules names {unmatched}, which match no module of the model "
                         "(give a class name such as 'SwitchTransformersSparseMLP' or a qualified module name "
                         "such as 'encoder.block.1.layer.1.mlp')")
    return _outermost_in_order(model, found)


def _outermost_in_order(model: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(_outermost(modules), key=lambda m: order[id(m)])


def layer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's layer blocks: the children of each outermost ModuleList holding two or more
    modules, each with parameters (a transformer's layers; of several classes in a hybrid model
    such as Jamba's attention and Mamba layers, or a convolutional front end's layers), in module
    order. Config `compile` compiles each one's forward, and at stage 3 makes it a leaf unit
    (runtime/compiled.py)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) >= 2
             and all(any(True for _ in c.parameters()) for c in m)]
    return [block for lst in _outermost(lists) for block in lst]


def with_blocks(model: nn.Module, leaves: list[nn.Module]) -> list[nn.Module]:
    """`leaves` and the model's layer blocks, the outermost of them, in module order."""
    return _outermost_in_order(model, list(leaves) + [b for b in layer_blocks(model) if all(b is not m for m in leaves)])


def unit_members(model: nn.Module, leaves: list[nn.Module]) -> dict[nn.Module, list[nn.Module]]:
    """Each unit, with the modules whose own parameters it gathers (itself, or a leaf's whole
    subtree), in module order. A ParameterList or ParameterDict has no forward: its parameters are
    read by its parent's, so they join the parent's unit (peft's IA3 and embedding adapters keep
    theirs so; lent to whichever forward ran, they had none to be lent to in a recomputation). The
    root is a unit even without parameters: a parameter read in its forward outside the module that
    holds it is borrowed by it (hooks.Stage3Hooks.borrow)."""
    leaf_ids = {id(m) for m in leaves}
    units: dict[nn.Module, list[nn.Module]] = {}
    skip: set[int] = set()
    for m in model.modules():
        if id(m) in skip:
            continue
        if id(m) in leaf_ids:
            members = [d for d in m.modules() if direct_params(d)]
            skip |= {id(d) for d in m.modules()}
            units[m] = members
            continue
        held = [c for c in m.children() if isinstance(c, _CONTAINERS) and direct_params(c) and id(c) not in leaf_ids]
        skip |= {id(c) for c in held}
        if direct_params(m) or held or m is model:
            units[m] = ([m] if direct_params(m) else []) + held
    return units


_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


class BackwardHolds:
    """Stage 3's holds in backward: from a unit's pre-backward (or the end of its recomputation by
    activation checkpointing) until every trainable parameter of it has its gradient, its chunks stay
    gathered (a leaf's, and one's with no trainable parameter, until the gradient reaches its inputs,
    or the backward ends where none does: both begin with `waiting_for=None` or an empty set and end
    by `end`/`end_all`). runtime/hooks.py gathers and releases by it; the profiler predicts the same
    schedule with it."""

    def __init__(self, owners: dict):
        self.owners = owners  # a parameter's key -> the units that hold it (the caller keeps it current)
        self.pending: dict = {}  # unit -> keys whose gradient it still waits for (None: none by gradient)

    def __contains__(self, unit) -> bool:
        return unit in self.pending

    def begin(self, unit, waiting_for: set | None) -> bool:
        """Hold `unit`; False if it is held already (a module whose outputs reach the loss twice)."""
        if unit in self.pending:
            return False
        self.pending[unit] = waiting_for
        return True

    def arrived(self, key) -> list:
        """A parameter's gradient arrived: the units whose hold it ended, in the owners' order."""
        ended = []
        for unit in self.owners.get(key, ()):
            waiting = self.pending.get(unit)
            if waiting is None:  # not held, or held until its inputs' gradient / the end of backward
                continue
            waiting.discard(key)
            if not waiting:
                del self.pending[unit]
                ended.append(unit)
        return ended

    def end(self, unit) -> bool:
        """End `unit`'s hold; whether it was held."""
        return self.pending.pop(unit, _NOT_HELD) is not _NOT_HELD

    def end_all(self) -> list:
        """End every hold (the backward is over); the units, in the order their holds began."""
        units = list(self.pending)
        self.pending.clear()
        return units


_NOT_HELD = object()


def refuse_untrainable(module: nn.Module) -> None:
    """UnsupportedModelError, naming each, for what zeroshard would otherwise change without a word:
    chunks hold fp32 or 16-bit values (config precision), so a float64 parameter would train in
    fp32, a complex one would lose its imaginary part and an integer one (a quantized base's) would
    turn into floats, and a lazy module's parameter (nn.LazyLinear) has no shape to chunk until its
    first forward; a module that makes sparse gradients (an nn.Embedding or nn.EmbeddingBag built
    with sparse=True) has no flat gradient to reduce. Every rank holds the same model, so every rank
    raises."""
    kinds = {  # what is wrong -> (names, what to do)
        "uninitialized": ([], "run one forward of the model (or of each lazy module) before initialize, which "
                              "gives each its shape"),
        "float64": ([], "cast the model to fp32 first (model.float()); config precision picks fp32 or 16-bit"),
        "complex": ([], "keep each as a real parameter of shape (..., 2), read with torch.view_as_complex"),
        "integer or bool": ([], "register each as a buffer (register_buffer), or dequantize the model"),
        "sparse-gradient": ([], "build each with sparse=False"),
    }
    for name, p in module.named_parameters():
        kind = "uninitialized" if isinstance(p, nn.parameter.UninitializedParameter) else \
            "float64" if p.dtype == torch.float64 else "complex" if p.is_complex() else \
            None if p.is_floating_point() else "integer or bool"
        if kind:
            kinds[kind][0].append(f"{name!r} ({p.dtype})")
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            kinds["sparse-gradient"][0].append(f"{name!r} ({type(m).__name__}(sparse=True))")
    found = [f"{kind} {'modules' if kind.startswith('sparse') else 'parameters'} "
             f"{', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}: {fix}"
             for kind, (names, fix) in kinds.items() if names]
    if found:
        raise UnsupportedModelError("zeroshard cannot train this model as it is (its chunks hold fp32 or 16-bit "
                                    "values and flat gradients): " + "; ".join(found))


def refuse_forward_writes(module: nn.Module, stage: int, world: int) -> None:
    """UnsupportedModelError, naming each, for a module that writes into its own weight inside its
    forward where zeroshard would lose the write or apply it on one rank only: an nn.Embedding or
    nn.EmbeddingBag built with max_norm renormalizes, in place, the rows its batch looks up. Each
    rank's batch looks up other rows, so at a world size above 1 each rank's weight would take only
    its own batch's renormalized rows (DDP's replicas drift apart the same way), where plain
    PyTorch on the global batch renormalizes every row any rank looked up. At a world size of 1
    every stage keeps the write, as torch does (stage 3 keeps a write in a forward in the shard,
    runtime/param_writes.py). The same model and config on every rank: every rank raises."""
    if world == 1:
        return
    found = [f"{name!r} ({type(m).__name__}(max_norm={m.max_norm}))" for name, m in module.named_modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    if found:
        raise UnsupportedModelError(
            f"zeroshard cannot train {', '.join(found[:4])}{f' and {len(found) - 4} more' if len(found) > 4 else ''} "
            f"across {world} ranks: max_norm renormalizes the rows each rank's batch looks up, in place inside the "
            "forward, which would last on that rank only. Build it with max_norm=None and renormalize between "
            "steps instead, the same rows on every rank (under torch.no_grad(): a write between steps lasts), or "
            "train at a world size of 1")
