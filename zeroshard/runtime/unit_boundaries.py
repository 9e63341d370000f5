"""Where a stage-3 unit's forward ends and its backward ends, as hooks.py finds them: the tensors its
forward returned (its backward begins when a gradient reaches one of them), and a mark on a leaf
unit's inputs whose backward runs once the gradient has gone back through the whole unit.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten


class AfterUnitBackward(torch.autograd.Function):
    """Identity on a leaf unit's inputs: its backward runs once the gradient has gone back through
    the whole unit (autograd runs a unit's nodes, and the accumulation of its parameters'
    gradients, before the node that made its inputs), on every rank at the same point whatever
    experts ran, which is when the unit's hold ends (FSDP2 ends a module's backward the same way)."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


def unit_outputs(out, real: dict[int, nn.Parameter]):
    """The tensors a unit's forward returned, found through pytree containers and, one level down,
    the attributes of plain objects; and `out` with every parameter of `real` (id -> parameter) in
    it replaced by a view of it (an object's attribute is replaced in place: it cannot be rebuilt),
    or None when it returned none."""
    flat, spec = tree_flatten(out)
    tensors, found = [], False
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor):
            if id(t) in real:
                flat[i] = t = t.view_as(t)
                found = True
            tensors.append(t)
        elif hasattr(t, "__dict__") and not isinstance(t, (type, nn.Module)):
            for k, v in list(vars(t).items()):
                if isinstance(v, torch.Tensor):
                    if id(v) in real:
                        v = v.view_as(v)
                        setattr(t, k, v)
                        found = True
                    tensors.append(v)
    return tensors, (tree_unflatten(flat, spec) if found else None)
