"""Contract scenarios on gradients (contract_scenarios.py): gradients a step takes besides its loss's
backward (torch.autograd.grad of the input or of the parameters, a retained graph, gradient
penalties, backward(inputs=...)) and the user's own autocast.
"""
from __future__ import annotations

import torch

import zeroshard
from distributed import error_on_every_rank
from models import make_sgd, max_diff

SCENARIOS = {}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _adversarial(model, backward, x, y):
    """FGSM: the input's gradient (torch.autograd.grad: no .grad written), then training on x moved
    along its sign."""
    x = x.clone().requires_grad_(True)
    gx, = torch.autograd.grad(_mse(model, x, y), x)
    backward(_mse(model, (x + 0.1 * gx.sign()).detach(), y))


def _retained(model, backward, x, y):
    """Two backwards through one graph: the first keeps it (retain_graph=True)."""
    loss = _mse(model, x, y)
    loss.backward(retain_graph=True)
    backward(0.5 * loss)


def _penalised(model, backward, x, y):
    """A gradient penalty (WGAN-GP): the input's gradient with create_graph=True, its squared norm
    in the loss, so backward runs through a backward."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    gx, = torch.autograd.grad(out.sum(), x, create_graph=True)
    backward(torch.nn.functional.mse_loss(out, y) + gx.pow(2).sum(1).mean())


def _r1(model, backward, x, y):
    """An R1 penalty (StyleGAN) in a backward of its own after the loss's: the input's gradient with
    create_graph=True, its squared norm backpropagated alone, which gives the LayerNorm's bias an
    undefined gradient (the penalty does not depend on it; torch leaves its .grad as it was)."""
    backward(_mse(model, x, y))
    x = x.clone().requires_grad_(True)
    gx, = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    backward(gx.pow(2).sum(1).mean())


def _some_inputs(model, backward, x, y):
    """backward(inputs=...) of a part of the parameters (the first Linear's weight and the last
    Linear's): the rest get no gradient this step, as in torch (stage 3 raised ValueError on the
    placeholders given)."""
    m = getattr(model, "module", model)
    _mse(model, x, y).backward(inputs=[m[0].weight, *m[2].parameters()])


GRADIENT_CALLS = {"adversarial": _adversarial, "retained": _retained, "penalised": _penalised, "r1": _r1,
                  "some_inputs": _some_inputs}


def _normed_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def gradient_calls(rank, world, kind, stage, extra=None):
    """Gradients a step takes besides its loss's backward, as ordinary PyTorch code takes them
    (GRADIENT_CALLS): the engine trains what plain PyTorch trains on the global batch. Each rank's
    rows are a quarter of the batch's; a row's input gradient is its own (an MLP mixes no rows),
    so the global batch's losses give each row what the rank's gave it, up to the loss's scale,
    which the sign (FGSM) removes and the penalty's mean over rows keeps equal."""
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(3, world, 4, 8, generator=g), torch.randn(3, world, 4, 4, generator=g)
    make = _normed_mlp if kind == "r1" else _mlp
    ref = make()
    ref_opt = make_sgd(ref.parameters())
    for x, y in zip(xs, ys):
        GRADIENT_CALLS[kind](ref, lambda loss: loss.backward(), x.reshape(-1, 8), y.reshape(-1, 4))
        ref_opt.step()
        ref_opt.zero_grad()
    engine = zeroshard.initialize(make(), make_sgd, {"stage": stage, "chunk_size": 200, **(extra or {})})
    for x, y in zip(xs, ys):
        GRADIENT_CALLS[kind](engine, engine.backward, x[rank], y[rank])
        engine.step()
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict()), "chunks": len(engine.chunks)}


def parameter_gradients(rank, world, stage):
    """torch.autograd.grad of a loss w.r.t. the parameters themselves: each rank gets its own
    batch's gradients, as plain PyTorch (and DDP, which reduces only what reaches .grad) gives them,
    no .grad changes, and the engine trains on after it; at stage 3 too (the parameters are
    gathered for the call: read outside every forward)."""
    g = torch.Generator().manual_seed(8)
    xs, ys = torch.randn(2, world, 4, 8, generator=g), torch.randn(2, world, 4, 4, generator=g)
    engine = zeroshard.initialize(_mlp(), make_sgd, {"stage": stage, "chunk_size": 200})
    got = {}

    def take():
        got["grads"] = torch.autograd.grad(_mse(engine, xs[0, rank], ys[0, rank]), list(engine.parameters()))
    raised = error_on_every_rank(take)
    out = {"raised": raised, "grads_left_alone": all(p.grad is None for p in engine.parameters())}
    if "grads" in got:
        plain = _mlp()
        mine = torch.autograd.grad(_mse(plain, xs[0, rank], ys[0, rank]), list(plain.parameters()))
        out["grads_diff"] = max(float((a - b).abs().max()) for a, b in zip(got["grads"], mine))
    ref = _mlp()
    ref_opt = make_sgd(ref.parameters())
    for x, y in zip(xs, ys):
        _mse(ref, x.reshape(-1, 8), y.reshape(-1, 4)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(_mse(engine, x[rank], y[rank]))
        engine.step()
    out["diff"] = max_diff(engine.full_state_dict(), ref.state_dict())
    return out


def user_autocast(rank, world, stage, extra=None):
    """The user's own torch.autocast (bf16) around the forward of an fp32 engine, as AMP code writes
    it. Under autocast each rank's weight gradient is a bf16 matmul's output, rounded before the
    ranks' sum, so the reference is plain PyTorch summing the ranks' batches' gradients one batch
    at a time (what DDP computes): equal within fp32 SGD tolerance; the global batch's gradient,
    rounded once, differs by the 16-bit tolerance's order."""
    g = torch.Generator().manual_seed(9)
    xs, ys = torch.randn(3, world, 4, 8, generator=g), torch.randn(3, world, 4, 4, generator=g)

    def loss(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return torch.nn.functional.mse_loss(out.float(), y)
    refs = {}
    for split in (True, False):
        ref = _mlp()
        ref_opt = make_sgd(ref.parameters())
        for x, y in zip(xs, ys):
            for part_x, part_y in (zip(x, y) if split else [(x.reshape(-1, 8), y.reshape(-1, 4))]):
                loss(ref, part_x, part_y).backward()
            if split:  # the mean over ranks, taken after the sum as the engine takes it (1/3 rounds)
                for p in ref.parameters():
                    p.grad /= world
            ref_opt.step()
            ref_opt.zero_grad()
        refs[split] = ref.state_dict()
    engine = zeroshard.initialize(_mlp(), make_sgd, {"stage": stage, "chunk_size": 200, **(extra or {})})
    for x, y in zip(xs, ys):
        engine.backward(loss(engine, x[rank], y[rank]))
        engine.step()
    got = engine.full_state_dict()
    return {"diff_per_rank_batches": max_diff(got, refs[True]), "diff_global_batch": max_diff(got, refs[False]),
            "dtype": str(next(engine.parameters()).dtype)}


for _stage in range(4):
    SCENARIOS[f"user_autocast_stage{_stage}"] = lambda rank, world, stage=_stage: user_autocast(rank, world, stage)
SCENARIOS["user_autocast_stage3_cache1"] = lambda rank, world: user_autocast(rank, world, 3, {"cache_chunks": 1})
for _kind in GRADIENT_CALLS:
    for _stage in range(4):
        SCENARIOS[f"gradient_calls_{_kind}_stage{_stage}"] = (
            lambda rank, world, kind=_kind, stage=_stage: gradient_calls(rank, world, kind, stage))
    SCENARIOS[f"gradient_calls_{_kind}_stage3_cache1"] = (
        lambda rank, world, kind=_kind: gradient_calls(rank, world, kind, 3, {"cache_chunks": 1}))
for _stage in range(4):
    SCENARIOS[f"parameter_gradients_stage{_stage}"] = lambda rank, world, stage=_stage: parameter_gradients(
        rank, world, stage)
