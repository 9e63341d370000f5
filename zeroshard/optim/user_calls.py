"""The user's own `optimizer.step()` and `optimizer.zero_grad()`, as a plain PyTorch loop calls them
(`loss.backward(); optimizer.step(); optimizer.zero_grad()`), reach the engine: the gradients live in
the chunks, not in the parameters' .grad, so torch's own methods would step nothing (the pieces
have no gradient until the engine's step binds it) and clear nothing.

The optimizer's `step` and `zero_grad` become bound methods of the instance (as torch's LR
schedulers wrap `step`, and can wrap this one in turn) that call Engine.step and Engine.zero_grad,
except while the engine's own step runs, which steps the pieces through the optimizer's own step.
"""
from __future__ import annotations

import types


def route_optimizer_calls(opt, step, zero_grad, stepping) -> None:
    """Make `opt.step()` call `step()` (Engine.step) and `opt.zero_grad(set_to_none)` call
    `zero_grad(set_to_none)` (Engine.zero_grad), except while `stepping()`: then they are what
    they were (whatever wrapped them before included)."""
    own_step, own_zero_grad = opt.step, opt.zero_grad

    def routed_step(self, closure=None):
        if stepping():
            return own_step() if closure is None else own_step(closure)
        if closure is not None:
            raise ValueError("zeroshard: optimizer.step(closure) re-evaluates the loss inside the step, which the "
                             "engine's step cannot (its gradients come from the backward before it)")
        step()
        return None

    def routed_zero_grad(self, set_to_none: bool = True):
        if stepping():
            return own_zero_grad(set_to_none)
        zero_grad(set_to_none)
        return None

    opt.step = types.MethodType(routed_step, opt)
    opt.zero_grad = types.MethodType(routed_zero_grad, opt)
