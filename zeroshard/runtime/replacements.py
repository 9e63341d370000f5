"""Parameters replaced in a wrapped model after initialize.

zeroshard's chunks hold the parameters the model had at initialize; the engine trains those.
A new parameter assigned afterwards (`module.weight = nn.Parameter(...)`), or a module holding one
(a new head, `resize_token_embeddings`, peft's `get_peft_model`), would be read by the forward and
trained by nothing: the optimizer steps the chunks, and at stages 0-2 the new tensor's gradient
would not even be reduced across ranks. torch's global registration hooks see every such
assignment into any module; for one of a watched model's modules that brings parameters zeroshard
does not hold, ParameterReplacedError is raised before the assignment lands, on the line that made
it. Assigning a parameter where the module held it already (tie_weights() over weights tied at
initialize), a submodule holding held parameters (moving it), None, or a module without parameters
passes; the module then joins the watch. A held parameter, or a module of held ones, assigned where
that leaves a parameter the model held nowhere in it (`q.weight = p.weight`, `model.b = model.a`: a
tie of two the model held apart) is refused too: the forward would train the tie, but the replaced
parameter would stay in the chunks, the state dicts and checkpoints as it was. Pointing a name at
another parameter the model still holds elsewhere (a forward choosing among several) passes;
full_state_dict gives the name what it holds then. Stage 3's placeholders count as the parameters
they stand for.

A parametrization registered after initialize (torch.nn.utils.parametrize) moves a held parameter
to `<module>.parametrizations.<name>.original` and computes the name's value from it at each read:
the chunks' names, the state dict's keys and stage 3's entries stay where they were (a
full_state_dict whose keys the parametrized model refuses; at stage 3 the next forward after
`full_parameters()` read the stale entry). It is refused as the ParametrizationList takes the
parameter, before torch changes the module; but inside a forward of one of the model's modules,
where one that parametrizes for the call and removes it after is the model's own business (peft's
LoRA of a fused MoE's parameters, ParamWrapper, does so at every forward).

A held parameter registered in its own module under another name (torch.nn.utils.prune,
spectral_norm and weight_norm move `weight` to `weight_orig` or `weight_g`/`weight_v` and compute
`weight` from it at each forward; their remove_* move it back) would leave the chunks' names, the
state dict's keys and stage 3's entries on the old name: a full_state_dict the edited model refuses,
and at stages 0-2 the forward read a `weight` computed once from the chunk. It is refused too; a
held parameter, or a buffer it had, that the edit already deleted from the module is put back first,
and parameters the edit gave new data (prune.remove masks `weight_orig` in place of its chunk view)
view their chunks again, so the module is as it was.

Each model is watched from the end of initialize until a later initialize over it begins (which
may itself assign parameters: a model built on the meta device gets real ones) or its engine is
dropped (the engine keeps the watch).
"""
from __future__ import annotations

import gc
import sys
import weakref

import torch
import torch.nn as nn
from torch.nn.utils.parametrize import ParametrizationList, register_parametrization
from torch.nn.modules.module import (register_module_buffer_registration_hook, register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from ..errors import EngineCallError, ParameterReplacedError
from .placeholder import ShardedPlaceholder, real_parameter


class _Watch:
    """One model's watch: the ids of the parameters its engine holds, its modules' names, and where
    each module held which of them (the real parameter and stage 3's placeholder of it alike)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], set_to_itself, rebind):
        self.params = list(params)  # keeps the ids meaning these objects
        self.held = {id(p) for p in self.params}
        self.set_to_itself, self.rebind = set_to_itself, rebind
        self.root = weakref.ref(model)
        self.names = weakref.WeakKeyDictionary({m: n for n, m in model.named_modules()})
        self.homes: weakref.WeakKeyDictionary[nn.Module, dict[str, list]] = weakref.WeakKeyDictionary()
        # each module's buffers as last registered (kept, so an edit's deletion can be undone)
        self.buffers: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()
        for m in model.modules():
            self.add_homes(m)

    def known(self, p) -> bool:
        return p is None or isinstance(p, ShardedPlaceholder) or id(p) in self.held

    def add_homes(self, module: nn.Module) -> None:
        for name, p in module._parameters.items():
            self.add_home(module, name, p)
        self.buffers.setdefault(module, {}).update({n: b for n, b in module._buffers.items() if b is not None})

    def add_home(self, module: nn.Module, name: str, p) -> None:
        refs = self.homes.setdefault(module, {}).setdefault(name, [])
        for t in (p, getattr(p, "_zs_param", None)):
            if t is not None and not any(r() is t for r in refs):
                refs.append(weakref.ref(t))

    def renamed(self, module: nn.Module, name: str, param) -> str | None:
        """The other name `module` held `param` under, where it is registered under `name` now."""
        homes = self.homes.get(module, {})
        if param is None or any(r() is param for r in homes.get(name, ())):
            return None
        return next((n for n, refs in homes.items() if any(r() is param for r in refs)), None)

    def orphans(self, where: str, old: list, new: list) -> list[str]:
        """The names of the held parameters among `old`, which `where` (a parameter's or a module's
        name in the model) holds now, that the model would hold nowhere once `new` took its place."""
        kept = {id(real_parameter(t)) for t in new}
        replaced = [t for t in old if t is not None and self.known(t) and id(real_parameter(t)) not in kept]
        root = self.root()
        if replaced and root is not None:  # the walk only where a held parameter is replaced by another
            kept.update(id(real_parameter(t)) for n, t in root.named_parameters(remove_duplicate=False)
                        if n != where and not n.startswith(where + "."))
        return [held_name(t) for t in replaced if id(real_parameter(t)) not in kept]

    def put_back(self, module: nn.Module) -> None:
        """Re-register the held parameters and the buffers an edit refused on `module` deleted from
        it already, and point parameters it gave new data (prune.remove) back at their chunks."""
        def gone(name):
            return not (name in module._parameters or name in module._buffers or name in module._modules
                        or name in vars(module))
        for name, refs in self.homes.get(module, {}).items():
            held = [t for t in (r() for r in refs) if t is not None]
            p = next((t for t in held if isinstance(t, ShardedPlaceholder)), held[0] if held else None)
            if gone(name) and p is not None:
                module._parameters[name] = p
        for name, b in self.buffers.get(module, {}).items():
            if gone(name):
                module._buffers[name] = b
        self.rebind()  # the parameters of every gathered chunk: which one the edit gave new data is not known


# Weakly: a watch lives while its engine keeps it (a model whose engine is gone trains as plain torch)
_watches: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
_every_watch: weakref.WeakSet[_Watch] = weakref.WeakSet()


def _watch_of(module: nn.Module) -> _Watch | None:
    ref = _watches.get(module)
    return None if ref is None else ref()


_installed = False


def watch(model: nn.Module, params: list[nn.Parameter], set_to_itself=lambda param: None,
          rebind=lambda: None) -> _Watch:
    """Refuse parameters other than `params` (the engine's; at stage 3 the module shows placeholders
    of them between forwards) assigned into `model` from now on (module docstring).
    `set_to_itself(param)`: a parametrization inside a forward set a held parameter to itself (its
    version counter moved, its values did not: no write to keep). `rebind()`: point the parameters
    back at their chunks (an edit refused had given one new data)."""
    global _installed
    if not _installed:
        register_module_parameter_registration_hook(_on_parameter)
        register_module_module_registration_hook(_on_module)
        register_module_buffer_registration_hook(_on_buffer)
        _installed = True
    w = _Watch(model, params, set_to_itself, rebind)
    _every_watch.add(w)
    for m in model.modules():
        _watches[m] = weakref.ref(w)
    return w


def refuse_rewrap(model: nn.Module) -> None:
    """initialize over a model an engine still wraps, or one an engine wrapped at stage 3, raises
    EngineCallError before anything changes. The first engine's hooks would go on acting on the
    parameters the second repacks (stages 0-2: the next forward raised ModuleMovedError), and stage
    3's placeholders are shards of the first engine's chunks, which a new engine cannot read (it
    raised ModuleMovedError as it packed them)."""
    sharded = any(isinstance(p, ShardedPlaceholder) for p in model.parameters())

    def wrapped():
        return any(_watch_of(m) is not None for m in model.modules())
    if wrapped():
        gc.collect()  # an engine dropped, but in a reference cycle
    if wrapped():
        raise EngineCallError(
            "zeroshard: initialize over a model another engine still wraps (running `engine = zeroshard.initialize("
            "model, ...)` again holds the first engine until it returns, as does a Trainer or Lightning strategy "
            "that made it, or a saved exception's traceback): both engines would act on its parameters. "
            + ("Its parameters are that engine's stage-3 shards: take `engine.full_state_dict()` (or save_checkpoint) "
               "into a new model and initialize that" if sharded else
               "Drop the first engine (`del engine`) before initializing again") + "; the model is unchanged")
    if sharded:
        raise EngineCallError(
            "zeroshard: initialize over a model an earlier engine wrapped at stage 3: its parameters are that "
            "engine's shards, which a new engine cannot read. Build a new model from the first engine's "
            "`full_state_dict()` (or a checkpoint) and initialize that")


def unwatch(model: nn.Module) -> None:
    """Stop watching `model` (a new initialize over it begins)."""
    for m in model.modules():
        _watches.pop(m, None)


def held_name(t) -> str | None:
    """Where a watched model holds `t` (a parameter its engine holds, or stage 3's placeholder of
    one), else None."""
    if isinstance(t, ShardedPlaceholder):
        return t._zs_name
    for w in _every_watch:
        if id(t) in w.held:
            return next((_where(w, m, n) for m, homes in w.homes.items() for n, refs in homes.items()
                         if any(r() is t for r in refs)), "a parameter")
    return None


def _where(w: _Watch, module: nn.Module, name: str) -> str:
    prefix = w.names.get(module, "")
    return f"{prefix}.{name}" if prefix else name


def _refuse(where: str, what: str) -> ParameterReplacedError:
    return ParameterReplacedError(
        f"zeroshard: {where} = {what} after initialize: zeroshard's chunks hold the parameters the model had "
        "then, and train those; the new ones would be read by the forward and trained by nothing. Make such "
        "changes (resize_token_embeddings, a new head, get_peft_model) before zeroshard.initialize")


def _on_parameter(module: nn.Module, name: str, param):
    w = _watch_of(module)
    if w is None and isinstance(module, ParametrizationList):
        _refuse_parametrization(param)
    if w is None:
        return
    if not w.known(param):
        w.put_back(module)
        raise _refuse(_where(w, module, name), f"a new parameter of shape {tuple(param.shape)}")
    old = w.renamed(module, name, param)
    if old is not None:
        w.put_back(module)
        raise ParameterReplacedError(
            f"zeroshard: {_where(w, module, old)} registered again as {_where(w, module, name)} after initialize "
            "(torch.nn.utils.prune, spectral_norm, weight_norm or their remove_* move a parameter to another name "
            "and compute the old one from it at each forward): zeroshard's chunks, state dicts and stage 3's "
            "entries keep the name it had at initialize. Apply them before zeroshard.initialize; the module's "
            "parameters are as they were")
    where = _where(w, module, name)
    lost = w.orphans(where, [module._parameters.get(name)], [param])
    if lost:
        raise _orphaning(where, held_name(param), lost)
    w.add_home(module, name, param)


def _orphaning(where: str, what: str, lost: list[str]) -> ParameterReplacedError:
    return ParameterReplacedError(
        f"zeroshard: {where} = {what} after initialize leaves {', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''} "
        "out of the model (a tie of two parameters, or modules, the model held apart then): the forward would "
        "train the tie, but zeroshard's chunks, state dicts and checkpoints would keep the parameter replaced, "
        "as it was. Tie them before zeroshard.initialize")


def _on_buffer(module: nn.Module, name: str, buffer):
    w = _watch_of(module)
    if w is not None and buffer is not None:
        w.buffers.setdefault(module, {})[name] = buffer


def _on_module(module: nn.Module, name: str, child):
    w = _watch_of(module)
    if w is None or child is None:
        return
    new = [n for n, p in child.named_parameters(remove_duplicate=False) if not w.known(p)]
    if new:
        raise _refuse(_where(w, module, name), f"a {type(child).__name__} holding parameters zeroshard does not "
                                               f"hold ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''})")
    prefix = _where(w, module, name)
    replaced = module._modules.get(name)
    lost = w.orphans(prefix, list(replaced.parameters()), list(child.parameters())) if replaced is not None else []
    if lost:
        raise _orphaning(prefix, w.names.get(child, f"a {type(child).__name__}"), lost)
    for n, m in child.named_modules():
        _watches[m] = weakref.ref(w)
        w.names.setdefault(m, f"{prefix}.{n}" if n else prefix)
        w.add_homes(m)


def _refuse_parametrization(param) -> None:
    """A ParametrizationList (not yet in any model) takes `param`: refused where a watched model
    holds it, outside the forwards of its modules (module docstring)."""
    running = _modules_running()
    target = _parametrizing()  # a parametrization of several tensors (weight_norm) takes new ones
    for w in list(_every_watch):
        if any(m in w.names for m in running):
            if id(param) in w.held:  # torch set it to itself first (parametrize's _maybe_set)
                w.set_to_itself(param)
            continue
        for m, prefix in list(w.names.items()):
            name = target[1] if target is not None and target[0] is m and target[1] in m._parameters else \
                next((n for n, p in m._parameters.items() if p is param), None)
            if name is not None:
                where = f"{prefix}.{name}" if prefix else name
                raise ParameterReplacedError(
                    f"zeroshard: a parametrization registered on {where} after initialize: it would move the "
                    "parameter zeroshard holds under another name (the chunks, state dicts and stage 3's entries "
                    "keep the old one). Register parametrizations before zeroshard.initialize")


def _parametrizing() -> tuple[nn.Module, str] | None:
    """The module and tensor name of the register_parametrization call on this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is register_parametrization.__code__:
            return frame.f_locals.get("module"), frame.f_locals.get("tensor_name")
        frame = frame.f_back
    return None


def _modules_running() -> list[nn.Module]:
    """The modules whose __call__ is on this thread's stack (read only when a parametrization is
    registered, so the walk costs nothing on the training path)."""
    calls = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
    out, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code in calls and isinstance(frame.f_locals.get("self"), nn.Module):
            out.append(frame.f_locals["self"])
        frame = frame.f_back
    return out
