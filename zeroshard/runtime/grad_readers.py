"""torch.nn.utils' functions that read parameters' .grad, given tensors zeroshard trains.

The gradients live in the chunks, not in .grad (which is None between backward and step), so
torch's own clip_grad_norm_, clip_grads_with_norm_ and clip_grad_value_ would find no gradient
and clip nothing, silently. Each is replaced, once per process, by a function that looks the
tensors it is given up among the live engines' (`GradReaders`, one per engine: its parameters,
stage 3's placeholders, and this rank's master pieces, which the user's optimizer lists):

- clip_grad_norm_ over what one engine trains is that engine's (Engine.clip_grad_norm: the global
  L2 norm over every shard, the step's own clipping), as a plain loop calls it between backward and
  optimizer.step();
- clip_grads_with_norm_ and clip_grad_value_, and clip_grad_norm_ where the engine cannot answer
  it, raise GradientsInChunksError naming what to use instead;
- tensors no engine trains are torch's own, untouched.

A name bound before the first engine (`from torch.nn.utils import clip_grad_norm_`) still calls
torch's own clip_grad_norm_, which would find no .grad and clip nothing: the helper it clips with,
looked up in its module at each call (`_clip_grads_with_norm_`), raises GradientsInChunksError for
an engine's tensors instead.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Callable

import torch

from ..errors import GradientsInChunksError

_INSTEAD = {  # what to use instead of each reader where the engine cannot answer it
    "clip_grad_norm_": "Set the config's clip_grad_norm instead (the same global L2 norm, over every shard); "
                       "engine.stats()['grad_norm'] reports it",
    "clip_grads_with_norm_": "Set the config's clip_grad_norm instead (the same global L2 norm, over every shard)",
    "clip_grad_value_": "Clipping by value needs whole gradients, which are sharded: clip by norm with the "
                        "config's clip_grad_norm",
}

_engines: weakref.WeakSet = weakref.WeakSet()  # the live engines' GradReaders


class GradReaders:
    """What torch's gradient readers are to do with one engine's tensors: `owned(tensors)` gives the
    ids of those the engine trains (parameters, placeholders, master pieces); `clip(tensors,
    max_norm, norm_type, error_if_nonfinite)` answers clip_grad_norm_. Kept by the engine: the
    replaced functions forget it when the engine goes."""

    def __init__(self, owned: Callable[[list], set], clip: Callable):
        self.owned, self.clip = owned, clip


def guard_grad_readers(owned: Callable[[list], set], clip: Callable) -> GradReaders:
    """Register an engine's tensors with torch.nn.utils' gradient readers (replaced on first use);
    returns the registration, which lasts while the caller keeps it."""
    readers = GradReaders(owned, clip)
    _engines.add(readers)
    for name in _INSTEAD:
        original = getattr(torch.nn.utils, name, None)
        if original is None or getattr(original, "_zeroshard_guard", False):
            continue
        replaced = _routed(original, name)
        setattr(torch.nn.utils, name, replaced)
        if getattr(torch.nn.utils.clip_grad, name, None) is original:
            setattr(torch.nn.utils.clip_grad, name, replaced)
    helper = getattr(torch.nn.utils.clip_grad, "_clip_grads_with_norm_", None)
    if helper is not None and not getattr(helper, "_zeroshard_guard", False):
        torch.nn.utils.clip_grad._clip_grads_with_norm_ = _refusing_bound_earlier(helper)
    return readers


def _refusing_bound_earlier(helper):
    @functools.wraps(helper)
    def clip_with_norm(parameters, *args, **kwargs):
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(r.owned(given) for r in list(_engines)):
            raise GradientsInChunksError(
                "zeroshard: torch's own clip_grad_norm_ ran on parameters that zeroshard trains, through a name "
                "bound before zeroshard.initialize (from torch.nn.utils import clip_grad_norm_): it finds no .grad "
                "(the gradients live in zeroshard's chunks) and would clip nothing. Call "
                "torch.nn.utils.clip_grad_norm_(...), which is the engine's")
        return helper(given, *args, **kwargs)
    clip_with_norm._zeroshard_guard = True
    return clip_with_norm


def _routed(original, name: str):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def reader(parameters, *args, **kwargs):
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = {id(r): r for r in list(_engines) if r.owned(given)}
        if not owners:
            return original(given, *args, **kwargs)
        if name == "clip_grad_norm_" and len(owners) == 1:
            call = signature.bind(given, *args, **kwargs)
            call.apply_defaults()
            a = call.arguments
            return next(iter(owners.values())).clip(given, a["max_norm"], a["norm_type"], a["error_if_nonfinite"])
        raise GradientsInChunksError(
            f"zeroshard: torch.nn.utils.{name} was given parameters that zeroshard trains"
            f"{' (of more than one engine)' if len(owners) > 1 else ''}: their gradients live in zeroshard's chunks "
            f"(sharded, reduced at the step), so torch would see none and clip nothing. {_INSTEAD[name]}")
    reader._zeroshard_guard = True
    return reader
