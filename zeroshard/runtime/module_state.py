"""The wrapped module's own state API under sharding: `model.load_state_dict(...)` after
`zeroshard.initialize` loads into what training reads.

Plain `load_state_dict` copies each value into the module's parameter. zeroshard keeps more copies
of a parameter than the module shows: the fp32 master of this rank's owned range (16-bit training,
or an optimizer on the host), and at stage 3 only a shard, with a placeholder in the module. A load
hook per module therefore writes each loaded value, in full fp32 precision, into every copy this
rank keeps: the master piece, the compute storage (the full chunk at stages 0-2, the shard at
stage 3); then torch's own copy into the module's parameter runs as usual (stages 0-2) or is
absorbed by the placeholder (stage 3). Every rank loads its own copy of the state dict, as with
plain torch, so no collective runs. Optimizer state is left as it is, as torch leaves it.

`full_parameters` (Engine.full_parameters) is the context for everything else of the module's API
that reads or writes parameters as whole tensors (state_dict, save_pretrained, in-place edits): every
parameter is the whole fp32 value for its duration, and what it holds at the end is written back as a
load would write it.

The module's own methods that must reach the engine (zero_grad, generate, and _apply, which every
move and cast goes through) are overridden by swapping each affected module's class for a subclass of
it made once per class (as torch's fully_shard does); what they need is kept on the instance. A
module so wrapped refuses to be pickled or copied (ModuleCopyError).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.utils.parametrize import is_parametrized

from ..errors import EngineCallError, ModuleCopyError, ModuleMovedError, ParameterReplacedError
from .chunks import ChunkState
from .hooks import Stage3Hooks
from ..units import direct_params
from ..distributed.tensor_parallel import as_dtensor, local, local_value, set_local


class StateDictLoading:
    """Installs the load hooks. `real_params(module)`: its direct parameters even while stage 3 has
    placeholders in their place; `slot_of`: id(param) -> (chunk, slot); `before_load()`: called
    before anything is written (lands a delayed update, waits for arriving chunks, drops the rCache's
    gathered copies, which the load makes stale); False: leave the load to torch (the parameters hold
    their full values: Engine.full_parameters)."""

    def __init__(self, model: nn.Module, real_params: Callable, slot_of: Callable[[], dict],
                 hooks: Stage3Hooks | None, before_load: Callable[[], None]):
        self.real_params = real_params
        self.slot_of = slot_of
        self.hooks = hooks
        self.before_load = before_load
        self._handles = []
        for m in model.modules():
            if direct_params(m):
                self._handles.append(m.register_load_state_dict_pre_hook(self._pre_load))
                if hooks is not None:
                    self._handles.append(m.register_load_state_dict_post_hook(self._post_load))

    def _pre_load(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if local_metadata.get("assign_to_params_buffers"):
            raise EngineCallError("zeroshard: load_state_dict(..., assign=True) would put new tensors in place of the "
                               "parameters zeroshard shards and trains; load without assign=True")
        if not self.before_load():
            return
        slot_of = self.slot_of()
        for name, p in self.real_params(module):
            value = state_dict.get(prefix + name)
            c, s = slot_of[id(p)]
            if torch.is_tensor(value) and isinstance(p, DTensor):  # a whole tensor or a DTensor
                value = local_value(p, value)
                if value is None:  # not this parameter's shape: torch reports it
                    continue
                # torch's own copy then meets what it copies into: the module's DTensor, or at
                # stage 3 a placeholder of the local shape (load_state_dict copied the dict first)
                state_dict[prefix + name] = value if self.hooks is not None else as_dtensor(p, value)
            if torch.is_tensor(value) and len(s.shape) == 0 and value.dim() == 1:
                value = value[0]  # torch's own rule for a 0-d parameter (an old format's 1-element tensors)
            if torch.is_tensor(value) and value.shape == s.shape:  # torch itself reports what is not
                _write(c, s, value)
        if self.hooks is not None:
            self.hooks.absorb_copies(module, True)

    def _post_load(self, module, incompatible) -> None:
        self.hooks.absorb_copies(module, False)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class _ModuleState:
    """What the overrides of a module's zeroshard class need, kept on the instance (one class serves
    every instance of the user's class, and a second engine over the module only updates this)."""
    __slots__ = ("zero_grad", "chunks", "sync_generation")

    def __init__(self):
        self.zero_grad = None  # the engine's zero_grad, a weak method (hooks.weak_method)
        self.chunks = None  # () -> the engine's chunks, whose views the parameters must stay
        self.sync_generation = False  # generate passes synced_gpus=True unless told otherwise


_STATE = "_zeroshard_module_state"
_subclasses: dict[type, type] = {}  # the user's class -> its zeroshard subclass, made once
_originals: dict[type, type] = {}  # a zeroshard subclass -> the user's class


def _takes_synced_gpus(cls: type) -> bool:
    method = getattr(cls, "generate", None)
    return callable(method) and "synced_gpus" in inspect.signature(method).parameters


@functools.cache  # one per metaclass, not per parametrized module
def _refusing_removal(meta: type) -> type:
    """`meta`, whose classes refuse the deletion of a property they inherit: torch's
    remove_parametrizations deletes the parametrized class's property of the tensor, then moves the
    parameter zeroshard holds under `parametrizations.<name>.original` back to `<name>`, where the
    chunks' names, state dicts and stage 3's entries do not follow. On a module whose class is the
    zeroshard subclass of a parametrized class (parametrized before initialize) torch's deletion
    would fail on a raw AttributeError; this says why first. With leave_parametrized=True torch set
    the parameter to the computed value before (the next forward puts it back on its chunk)."""
    class RefusingRemoval(meta):
        def __delattr__(cls, name):
            if name not in vars(cls) and isinstance(getattr(cls, name, None), property):
                raise ParameterReplacedError(
                    f"zeroshard: remove_parametrizations of {name!r} after initialize would move the parameter "
                    f"zeroshard holds (as parametrizations.{name}.original) back to {name!r}, where the chunks, "
                    "state dicts and stage 3's entries do not follow. Remove parametrizations before "
                    "zeroshard.initialize, or keep them (they train as they are)")
            super().__delattr__(name)
    return RefusingRemoval


def _make_subclass(cls: type, parametrized: bool) -> type:
    """The user's class with zero_grad, _apply (and generate, if it takes synced_gpus) overridden,
    as torch's fully_shard swaps classes: each override reads the instance's _ModuleState and, where
    it holds nothing for that method, is the user's method. `parametrized`: cls is the class torch's
    parametrize made for one module (_refusing_removal)."""

    class ZeroShardModule(cls, metaclass=_refusing_removal(type(cls)) if parametrized else type(cls)):
        # Same name, qualname, module and doc as the user's class: the HF Trainer, peft and Lightning
        # decide by type(model).__name__, save_pretrained writes it into config.json's architectures,
        # and repr() shows it. The class object is new all the same: pickle, which stores a class by
        # module and qualname, would find the user's class and fail obscurely; __reduce_ex__ says why.
        __slots__ = ()  # the instance layout of cls, so that __class__ can be assigned
        __qualname__ = cls.__qualname__
        __module__ = cls.__module__
        __doc__ = cls.__doc__

        def zero_grad(self, set_to_none: bool = True) -> None:
            state = vars(self).get(_STATE)
            if state is None or state.zero_grad is None:
                return super().zero_grad(set_to_none)
            state.zero_grad()

        def _apply(self, fn, recurse=True):
            out = super()._apply(fn, recurse)
            state = vars(self).get(_STATE)
            if state is not None and state.chunks is not None:
                check_not_moved(state.chunks())
            return out

        if _takes_synced_gpus(cls):
            @functools.wraps(cls.generate)
            def generate(self, *args, **kwargs):
                state = vars(self).get(_STATE)
                if state is not None and state.sync_generation and kwargs.get("synced_gpus") is None:
                    kwargs["synced_gpus"] = True
                return super().generate(*args, **kwargs)

        def __reduce_ex__(self, protocol):
            raise _not_copyable(self, "pickled")

        def __deepcopy__(self, memo):
            raise _not_copyable(self, "deep-copied")

        def __copy__(self):
            raise _not_copyable(self, "copied")

    ZeroShardModule.__name__ = cls.__name__
    return ZeroShardModule


def _not_copyable(module: nn.Module, how: str) -> ModuleCopyError:
    return ModuleCopyError(
        f"zeroshard: a {type(module).__name__} wrapped by zeroshard.initialize cannot be {how}: its parameters "
        "are views of the engine's chunks (at stage 3, placeholders for shards) and its hooks call the engine, "
        "so a copy would not be a model of its own. Save or copy the values instead: engine.full_state_dict() "
        "(every rank) into a model built anew, engine.save_pretrained(...) or a checkpoint")


def _state(module: nn.Module) -> _ModuleState:
    """`module`'s _ModuleState, once its class is the zeroshard subclass of the user's class (a module
    wrapped before keeps its class: its state is updated, no subclass is stacked on it)."""
    cls = type(module)
    if cls not in _originals:
        sub = _subclasses.get(cls)
        if sub is None:
            sub = _subclasses[cls] = _make_subclass(cls, is_parametrized(module))
            _originals[sub] = cls
        module.__class__ = sub
    state = vars(module).get(_STATE)
    if state is None:
        state = vars(module)[_STATE] = _ModuleState()
    return state


def route_zero_grad(model: nn.Module, zero_grad: Callable[[], None]) -> None:
    """`model.zero_grad()` on the wrapped model drops the engine's gradients (they live in its
    chunks, not in the parameters' .grad): it calls `zero_grad` (Engine.zero_grad) instead."""
    _state(model).zero_grad = zero_grad


def sync_generation(model: nn.Module, on: bool = True) -> list[str]:
    """Stage 3 (or tensor parallelism) over several ranks: every forward is a collective, so ranks
    generating sequences of different lengths (sampling, EOS, their own max_new_tokens) must run
    the same number of forwards. transformers' `generate(synced_gpus=True)` does that (a finished
    rank runs on without using the results until every rank is done); it turns it on itself under
    DeepSpeed ZeRO-3 and FSDP. Here the `generate` of every module of the model that takes
    `synced_gpus` (the model itself, or a transformers model inside a LightningModule) passes
    synced_gpus=True unless the caller gives True or False. Returns the names of the modules.
    `on=False` (an engine whose forward is no collective) turns it off where an earlier engine over the
    same module turned it on."""
    wrapped = []
    for name, m in model.named_modules():
        if _takes_synced_gpus(_originals.get(type(m), type(m))) and (on or type(m) in _originals):
            _state(m).sync_generation = on
            wrapped.append(name)
    return wrapped


def _write(c, s, value: torch.Tensor) -> None:
    """Write one parameter's whole value into the copies of it that chunk c keeps on this rank."""
    lo, hi = c.held_range()
    a, b = max(lo, s.offset) - s.offset, min(hi, s.offset + s.numel) - s.offset
    if a < b:
        c.write(s, a, b, value.detach().reshape(-1)[a:b])


@contextlib.contextmanager
def full_parameters(layout, hooks: Stage3Hooks | None, params: list[nn.Parameter], writeback: bool):
    """See Engine.full_parameters (which first lands any update in flight and empties the rCache).
    `layout`: the ChunkLayout; `hooks`: stage 3's, which put the real parameters in the entries."""
    values = layout.full_values()  # collective: fp32, from the masters (frozen: the 16-bit copies)
    for p in params:
        set_local(p, values[id(p)])
    if hooks is not None:
        hooks.show_real_parameters(True)
    try:
        yield
        if writeback:
            for c in layout.chunks:
                for s in c.slots:
                    _write(c, s, local(s.param).data)
    finally:
        if hooks is not None:
            hooks.show_real_parameters(False)
        for c in layout.chunks:
            if c.stage == 3:
                c.unbind_params()
            else:
                c.bind_params()


def check_not_moved(chunks: list) -> None:
    """Raise ModuleMovedError, with every parameter put back on its chunk, where one no longer
    views its chunk. Stages 0-2 check at every forward's start too: `param.data = ...` (HF's
    resize_token_embeddings does that, a re-initialisation may) goes through no _apply, and the
    forward would read the new tensor while the optimizer steps the chunk (a pointer comparison
    per parameter: GPT-2 small's 148 take 36 us on this CPU)."""
    moved = []
    # Outside torch function modes: arrival.py's guard would take data_ptr() for a read of the
    # chunk and wait for its arrival, every chunk's at the forward's start
    with torch._C.DisableTorchFunction():
        for c in chunks:
            if c.state is not ChunkState.GATHERED:  # stage 3, sharded or gathering: the module holds placeholders
                continue
            base, size, ptr = c.full.data_ptr(), c.full.element_size(), torch.Tensor.data_ptr
            moved += [s.name for s in c.slots if s.numel and ptr(local(s.param)) != base + s.offset * size]
    if moved:
        rebind(chunks)
        raise ModuleMovedError(
            f"zeroshard: {moved[0]} ({len(moved)} parameters) was moved, cast or given new data after "
            "zeroshard.initialize (model.to / .cuda / .half, param.data = ..., resize_token_embeddings): the "
            "engine owns where parameters live and in which dtype. Move or resize the model before initialize, "
            "choose the dtype with the config's precision, write values in place (copy_ under no_grad); the "
            "parameters are back on their chunks (buffers may have moved)")


def rebind(chunks: list) -> None:
    """Point every parameter of a gathered chunk back at its view of it (those given new data)."""
    for c in chunks:
        if c.state is ChunkState.GATHERED:
            c.bind_params()


def guard_moves(model: nn.Module, chunks: Callable[[], list]) -> None:
    """`model.to(...)`, `.cuda()`, `.half()` and the like after initialize would point parameters at
    new tensors: the forward would read those, the optimizer would step the chunks, and training
    would silently stop. Each module's `_apply` is followed by a check that its parameters still
    view their chunks; where one does not, every parameter is put back on its chunk and
    ModuleMovedError is raised (a move to where the parameters already are changes nothing and
    passes)."""
    for m in model.modules():
        if direct_params(m) or is_parametrized(m):  # the latter for _refusing_removal
            _state(m).chunks = chunks
