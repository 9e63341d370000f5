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

`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` between backward and step is the
engine's (runtime/grad_readers.py routes it, optim/window_gradients.py measures and clips);
`refuse_clip_call` says where it cannot be.
"""
from __future__ import annotations

import types

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import EngineCallError, GradientsInChunksError
from ..runtime.replacements import held_name


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
            raise EngineCallError("zeroshard: optimizer.step(closure) re-evaluates the loss inside the step, which the "
                             "engine's step cannot (its gradients come from the backward before it)")
        step()
        return None

    def routed_zero_grad(self, set_to_none: bool = True):
        if stepping():
            return own_zero_grad(set_to_none)
        zero_grad(set_to_none)
        return None

    opt._step_supports_amp_scaling = True  # GradScaler's protocol (above)
    opt._zs_routed = True  # _refuse_foreign_step's to skip
    _refuse_foreign_steps()
    opt.step = types.MethodType(routed_step, opt)
    opt.zero_grad = types.MethodType(routed_zero_grad, opt)


_foreign_hook = None


def _refuse_foreign_steps() -> None:
    """Once per process: every torch optimizer's step runs _refuse_foreign_step first."""
    global _foreign_hook
    if _foreign_hook is None:
        _foreign_hook = register_optimizer_step_pre_hook(_refuse_foreign_step)


def _refuse_foreign_step(opt, args, kwargs) -> None:
    """EngineCallError from the step of an optimizer no engine was given that lists parameters an
    engine holds (a GAN's second optimizer over its generator): their gradients live in the chunks,
    never in .grad, so torch's step would skip them and they would train on nothing, silently.
    The same loop runs on every rank, so every rank raises, before anything is stepped."""
    if getattr(opt, "_zs_routed", False):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            name = held_name(p) if p.requires_grad else None  # a frozen one: torch's step skips it too
            if name is not None:
                raise EngineCallError(
                    f"zeroshard: {type(opt).__name__}.step() over {name}, which zeroshard trains, but this optimizer "
                    "was not given to zeroshard.initialize: the gradients live in zeroshard's chunks, never in .grad, "
                    "so the step would skip it. One engine steps one optimizer: give it every parameter, in param "
                    "groups (each with its own lr), or wrap each network (a GAN's generator and discriminator) in "
                    "an engine of its own")


def refuse_grads_set_by_hand(params: list, names: dict[int, str], unhooked: list) -> bool:
    """EngineCallError for a step with no backward since the last one where one of `params` (the
    real parameters: stage 3's placeholders hand a .grad set on them to theirs; `names`: id ->
    name) holds a .grad: one assigned by hand (`p.grad = g` from torch.autograd.grad), which torch's
    step would apply, where zeroshard's takes gradients from backward into its chunks only and would
    change nothing, silently; or one of `unhooked` (frozen at initialize, its gradient hook not yet
    placed) unfrozen and given a gradient by a backward through a submodule called by itself, which
    the engine does not see. The same loop runs on every rank, so every rank raises. Else False:
    the step applies nothing, as torch's changes no parameter without a .grad."""
    named = [names[id(p)] for p in params if p.grad is not None]
    if not named:
        return False
    late = [names[id(p)] for p in unhooked if p.requires_grad and p.grad is not None]
    for p in params:  # a later backward would add its gradients to them
        p.grad = None
    raise EngineCallError(
        f"zeroshard: {late[0]} ({len(late)} parameters) was frozen at initialize and unfrozen since, and a "
        "backward through a submodule called by itself gave it a gradient the engine did not see: the engine "
        "follows unfreezing when the wrapped model (or the engine) is called. Call the model itself after "
        "unfreezing (those .grad are cleared)" if late else
        f"zeroshard: {named[0]} ({len(named)} parameters) has a .grad set by hand and no backward came before "
        "this step: zeroshard takes gradients from backward (loss.backward(), engine.backward(loss)) into its "
        "chunks, never from .grad (those set are cleared). Compute the loss whose gradient you want and call "
        "backward on it")


def refuse_clip_call(given: list, owned: set[int], trained: list, pieces: list, norm_type, *, delayed: bool,
                     mid_window: bool) -> None:
    """Raise GradientsInChunksError where the engine cannot answer torch.nn.utils.clip_grad_norm_
    over `given` as torch would: a norm other than L2; tensors `given` must cover every parameter
    the engine trains (`trained`, or as placeholders), or every master piece of this rank
    (`pieces`, which the user's optimizer lists), since the norm of part of them needs whole
    gradients; none may be another tensor (`owned`: the ids of those it trains) holding a gradient (a rank's own, not reduced). The
    verdict follows from what every rank holds alike (the model, the call), so every rank raises.
    Nor can it with a delayed update (the step runs in the background), or inside the config's
    gradient_accumulation_steps window (`mid_window`: torch would clip the part summed so far)."""
    def refuse(why: str):
        raise GradientsInChunksError(
            f"zeroshard: torch.nn.utils.clip_grad_norm_ was given parameters that zeroshard trains, but {why}. "
            "Set the config's clip_grad_norm instead (the same global L2 norm, over every shard)")
    if delayed:
        refuse("the config's delay_update_after steps in the background")
    if mid_window:
        refuse("the call comes inside the config's gradient_accumulation_steps window, before its last backward")
    if float(norm_type) != 2.0:
        refuse(f"norm_type={norm_type}: only the L2 norm (2.0) is measured over the shards")
    ids = {id(t) for t in given} | {id(t._zs_param) for t in given if getattr(t, "_zs_param", None) is not None}
    if not (all(id(p) in ids for p in trained) or all(id(p) in ids for p in pieces)):
        refuse("not every parameter it trains (the norm of a part of them needs whole gradients): pass "
               "model.parameters()")
    if any(t.grad is not None and id(t) not in owned for t in given):
        refuse("also tensors with a gradient that it does not train (their gradients are this rank's own)")
