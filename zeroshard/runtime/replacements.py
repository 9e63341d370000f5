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

Each model is watched from the end of initialize until a later initialize over it begins (which
may itself assign parameters: a model built on the meta device gets real ones).
"""
from __future__ import annotations

import weakref

import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook

from ..errors import ParameterReplacedError
from .placeholder import ShardedPlaceholder


class _Watch:
    """One model's watch: the ids of the parameters its engine holds, and its modules' names."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter]):
        self.params = list(params)  # keeps the ids meaning these objects
        self.held = {id(p) for p in self.params}
        self.names = weakref.WeakKeyDictionary({m: n for n, m in model.named_modules()})

    def known(self, p) -> bool:
        return p is None or isinstance(p, ShardedPlaceholder) or id(p) in self.held


_watches: weakref.WeakKeyDictionary[nn.Module, _Watch] = weakref.WeakKeyDictionary()
_installed = False


def watch(model: nn.Module, params: list[nn.Parameter]) -> None:
    """Refuse parameters other than `params` (the engine's; at stage 3 the module shows placeholders
    of them between forwards) assigned into `model` from now on (module docstring)."""
    global _installed
    if not _installed:
        register_module_parameter_registration_hook(_on_parameter)
        register_module_module_registration_hook(_on_module)
        _installed = True
    w = _Watch(model, params)
    for m in model.modules():
        _watches[m] = w


def unwatch(model: nn.Module) -> None:
    """Stop watching `model` (a new initialize over it begins)."""
    for m in model.modules():
        _watches.pop(m, None)


def _where(w: _Watch, module: nn.Module, name: str) -> str:
    prefix = w.names.get(module, "")
    return f"{prefix}.{name}" if prefix else name


def _refuse(where: str, what: str) -> ParameterReplacedError:
    return ParameterReplacedError(
        f"zeroshard: {where} = {what} after initialize: zeroshard's chunks hold the parameters the model had "
        "then, and train those; the new ones would be read by the forward and trained by nothing. Make such "
        "changes (resize_token_embeddings, a new head, get_peft_model) before zeroshard.initialize")


def _on_parameter(module: nn.Module, name: str, param):
    w = _watches.get(module)
    if w is not None and not w.known(param):
        raise _refuse(_where(w, module, name), f"a new parameter of shape {tuple(param.shape)}")


def _on_module(module: nn.Module, name: str, child):
    w = _watches.get(module)
    if w is None or child is None:
        return
    new = [n for n, p in child.named_parameters(remove_duplicate=False) if not w.known(p)]
    if new:
        raise _refuse(_where(w, module, name), f"a {type(child).__name__} holding parameters zeroshard does not "
                                               f"hold ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''})")
    prefix = _where(w, module, name)
    for n, m in child.named_modules():
        _watches[m] = w
        w.names.setdefault(m, f"{prefix}.{n}" if n else prefix)
