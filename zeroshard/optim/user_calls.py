"""The user's own `optimizer.step()` and `optimizer.zero_grad()`, as a plain PyTorch loop calls them
(`loss.backward(); optimizer.step(); optimizer.zero_grad()`), reach the engine: the gradients live in
the chunks, not in the parameters' .grad, so torch's own methods would step nothing (the pieces
have no gradient until the engine's step binds it) and clear nothing.

The optimizer's `step` and `zero_grad` become bound methods of the instance (as torch's LR
schedulers wrap `step`, and can wrap this one in turn) that call Engine.step and Engine.zero_grad,
except while the engine's own step runs, which steps the pieces through the optimizer's own step.

torch's GradScaler unscales the parameters' .grad before `optimizer.step()`, so it would find none
(and raise its own AssertionError) or leave the gradients scaled. The optimizer is marked as one
that handles scaling itself, as torch's fused optimizers are: GradScaler then hands it the scale
(`grad_scale`) in the call, and the step raises GradientsInChunksError naming what to use instead.
"""
from __future__ import annotations

import types

from ..errors import GradientsInChunksError


def route_optimizer_calls(opt, step, zero_grad, stepping) -> None:
    """Make `opt.step()` call `step()` (Engine.step) and `opt.zero_grad(set_to_none)` call
    `zero_grad(set_to_none)` (Engine.zero_grad), except while `stepping()`: then they are what
    they were (whatever wrapped them before included)."""
    own_step, own_zero_grad = opt.step, opt.zero_grad

    def routed_step(self, closure=None):
        if stepping():
            return own_step() if closure is None else own_step(closure)
        if getattr(self, "grad_scale", None) is not None:
            del self.grad_scale, self.found_inf  # GradScaler's, which it removes only after a step
            raise GradientsInChunksError(
                "zeroshard: torch.amp.GradScaler unscales the parameters' .grad, but the gradients live in "
                "zeroshard's chunks: use config precision='fp16' with engine.backward(loss) (its own dynamic loss "
                "scaling), or precision='bf16', which needs none")
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

    opt._step_supports_amp_scaling = True  # GradScaler's protocol (above)
    opt.step = types.MethodType(routed_step, opt)
    opt.zero_grad = types.MethodType(routed_zero_grad, opt)
