"""Parameters replaced in a wrapped model after initialize.

zeroshard's chunks hold the parameters the model had at initialize; the engine trains those.
A new parameter assigned afterwards (`module.weight = nn.Parameter(...)`), or a module holding one
(a new head, `resize_token_embeddings`, peft's `get_peft_model`), would be read by the forward and
trained by nothing: the optimizer steps the chunks, and at stages 0-2 the new tensor's gradient
would not even be reduced across ranks. torch's global registration hooks see every such
assignment into any module; for one of a watched model's modules that brings parameters zeroshard
does not hold, ParameterReplacedError is raised before the assignment lands, on the line that made
it. Assigning the parameters it already holds (tying weights, moving a submodule), a placeholder of
stage 3, None, or a module without parameters passes; the module then joins the watch.

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
held parameter the edit already deleted from the module is put back first, so the module is as it
was, save what the edit deleted besides (spectral_norm's removal drops its buffers before that).

Each model is watched from the end of initialize until a later initialize over it begins (which
may itself assign parameters: a model built on the meta device gets real ones) or its engine is
dropped (the engine keeps the watch).
"""
from __future__ import annotations

import sys
import weakref

import torch.nn as nn
from torch.nn.utils.parametrize import ParametrizationList, register_parametrization
from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook

from ..errors import ParameterReplacedError
from .placeholder import ShardedPlaceholder


class _Watch:
    """One model's watch: the ids of the parameters its engine holds, its modules' names, and where
    each module held which of them (the real parameter and stage 3's placeholder of it alike)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], set_to_itself):
        self.params = list(params)  # keeps the ids meaning these objects
        self.held = {id(p) for p in self.params}
        self.set_to_itself = set_to_itself
        self.names = weakref.WeakKeyDictionary({m: n for n, m in model.named_modules()})
        self.homes: weakref.WeakKeyDictionary[nn.Module, dict[str, list]] = weakref.WeakKeyDictionary()
        for m in model.modules():
            self.add_homes(m)

    def known(self, p) -> bool:
        return p is None or isinstance(p, ShardedPlaceholder) or id(p) in self.held

    def add_homes(self, module: nn.Module) -> None:
        for name, p in module._parameters.items():
            self.add_home(module, name, p)

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

    def put_back(self, module: nn.Module) -> None:
        """Re-register the held parameters an edit refused on `module` deleted from it already."""
        for name, refs in self.homes.get(module, {}).items():
            if name in module._parameters or name in module._buffers or name in module._modules or name in vars(module):
                continue
            held = [t for t in (r() for r in refs) if t is not None]
            p = next((t for t in held if isinstance(t, ShardedPlaceholder)), held[0] if held else None)
            if p is not None:
                module._parameters[name] = p


# Weakly: a watch lives while its engine keeps it (a model whose engine is gone trains as plain torch)
_watches: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
_every_watch: weakref.WeakSet[_Watch] = weakref.WeakSet()


def _watch_of(module: nn.Module) -> _Watch | None:
    ref = _watches.get(module)
    return None if ref is None else ref()


_installed = False


def watch(model: nn.Module, params: list[nn.Parameter], set_to_itself=lambda param: None) -> _Watch:
    """Refuse parameters other than `params` (the engine's; at stage 3 the module shows placeholders
    of them between forwards) assigned into `model` from now on (module docstring).
    `set_to_itself(param)`: a parametrization inside a forward set a held parameter to itself (its
    version counter moved, its values did not: no write to keep)."""
    global _installed
    if not _installed:
        register_module_parameter_registration_hook(_on_parameter)
        register_module_module_registration_hook(_on_module)
        _installed = True
    w = _Watch(model, params, set_to_itself)
    _every_watch.add(w)
    for m in model.modules():
        _watches[m] = weakref.ref(w)
    return w


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
    w.add_home(module, name, param)


def _on_module(module: nn.Module, name: str, child):
    w = _watch_of(module)
    if w is None or child is None:
        return
    new = [n for n, p in child.named_parameters(remove_duplicate=False) if not w.known(p)]
    if new:
        raise _refuse(_where(w, module, name), f"a {type(child).__name__} holding parameters zeroshard does not "
                                               f"hold ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''})")
    prefix = _where(w, module, name)
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
