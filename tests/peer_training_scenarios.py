"""Peer scenarios on the training loop (peer_scenarios.py says where they come from): accumulation
and several forwards per step, frozen layers and evaluation between steps, clipping and zero
gradients, optimizers and param groups.
"""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
from distributed import every_rank, shared_temp_dir
from models import inputs, max_diff, parity
from peer_common import FourLayers, adam, mlp, per_stage, seeded, sgd

SCENARIOS = {}


# -- accumulation, several forwards and backwards -------------------------------------------------------
class Elementwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(3, 5)) for _ in range(3))

    def forward(self, x):
        for w in self.w:
            x = torch.tanh(x * w)
        return x


def accumulation_three_micro_batches(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero.py, TestZero3ParamPartitioningBase.test_zero_grad, and
    FSDP2 test_fully_shard_grad_acc.py, TestFullyShardGradientAccumulation: three backward passes
    before one step (15-element weights: padded shards at world 2): the step applies the mean of the
    three global micro-batches' gradients."""
    data = inputs(2, 3 * world, 2, 3, 5).view(2, 3, world, 2, 3, 5)
    _, d = parity(rank, world, seeded(Elementwise), lambda m, x, *_: m(x).pow(2).mean(), data, sgd,
                  {"stage": stage, "chunk_size": 16}, accumulation=3)
    return {"diff": d}


per_stage(SCENARIOS, "accumulation_three_micro_batches", accumulation_three_micro_batches)


def two_forwards_one_backward(rank, world, stage):
    """FSDP2 test_fully_shard_training.py,
    TestFullyShard1DTrainingCompose.test_double_forward_with_nested_fsdp_and_checkpoint (without the
    checkpointing): two forwards, then one backward of ((o1.sum() - o2.sum()) ** 2) (DPO-style); at
    stage 3 with a one-chunk rCache, the first forward's parameters are right for its backward."""
    data = inputs(3, world, 2, 4, 6)

    def loss(m, x, *_):
        return (m(x[0]).sum() - m(x[1]).sum()).pow(2) / 100
    cfg = {"stage": stage, "chunk_size": 64, **({"cache_chunks": 1} if stage == 3 else {})}
    _, d = parity(rank, world, seeded(FourLayers), loss, data, sgd, cfg)
    return {"diff": d}


per_stage(SCENARIOS, "two_forwards_one_backward", two_forwards_one_backward)


# -- frozen layers, evaluation between steps ------------------------------------------------------------------
class FrozenMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.l2.requires_grad_(False)

    def forward(self, x, y):
        out = self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))
        return out, F.cross_entropy(out, y)


def frozen_middle_layer(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero.py, TestZeroFrozenWeights: a frozen layer between two
    trainable ones, the forward returning (output, loss): gradients flow through the frozen layer,
    which keeps its values, and engine.backward(out[1]) trains as in torch (Adam)."""
    build = seeded(FrozenMiddle)
    y = torch.tensor([0, 1, 2, 1])
    engine, d = parity(rank, world, build, lambda m, x, *_: m(x, y)[1], inputs(3, world, 4, 6), adam,
                       {"stage": stage, "chunk_size": 64})
    sd, init = engine.full_state_dict(), build().state_dict()
    return {"diff": d, "frozen_kept": all(torch.equal(sd[k], init[k]) for k in sd if k.startswith("l2."))}


per_stage(SCENARIOS, "frozen_middle_layer", frozen_middle_layer)


class ThreeMLPs(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(mlp() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def bitfit(rank, world, stage):
    """FSDP2 test_fully_shard_frozen.py, TestFullyShardFrozen.test_train_mixed_requires_grad_per_group:
    only biases trainable (BitFit), the weights frozen before initialize, or after it, before the
    first forward (they then get no gradient and are not stepped, as in torch). Adam parity either way."""
    out = {}
    for when in ("before", "after"):
        built, weights = [], {}

        def build(when=when):
            torch.manual_seed(0)
            m = ThreeMLPs()
            weights[id(m)] = [p for n, p in m.named_parameters() if not n.endswith("bias")]
            built.append(m)
            if when == "before" or len(built) == 1:  # the reference (built first) is frozen from the start
                for p in weights[id(m)]:
                    p.requires_grad_(False)
            return m

        def loss(m, x, k, *_):
            if isinstance(m, zeroshard.Engine) and k == 0:
                for p in weights[id(m.module)]:
                    p.requires_grad_(False)
            return m(x).pow(2).mean()
        _, d = parity(rank, world, build, loss, inputs(3, world, 4, 6), adam, {"stage": stage, "chunk_size": 128})
        out[when] = d
    return out


per_stage(SCENARIOS, "bitfit", bitfit)


def no_grad_forward_between_steps(rank, world, stage):
    """FSDP2 test_fully_shard_frozen.py, TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups:
    a no_grad forward with no backward between training steps changes nothing (no step, no
    accumulation counted), at stage 3 with a one-chunk rCache too."""
    data = inputs(3, world, 4, 6)
    extra = inputs(3, world, 4, 6, seed=9)

    def loss(m, x, k, r, *_):
        if isinstance(m, zeroshard.Engine):
            with torch.no_grad():
                m(extra[k, r])
            m.step()  # nothing to apply: returns False
        return m(x).pow(2).mean()
    cfg = {"stage": stage, "chunk_size": 64, **({"cache_chunks": 1} if stage == 3 else {})}
    engine, d = parity(rank, world, seeded(FourLayers), loss, data, sgd, cfg)
    return {"diff": d, "steps": engine.steps}


per_stage(SCENARIOS, "no_grad_forward_between_steps", no_grad_forward_between_steps)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


def train_eval_switching(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero.py, TestZero3SwitchModes: train, switch to eval and
    run a no_grad forward, back to train, step after step, with a BatchNorm, at stage 3 with a
    one-chunk rCache too: eval outputs equal torch's at world 1 (at larger worlds each rank's
    BatchNorm statistics are its own rows', as under DDP without SyncBatchNorm, so the ranks are
    checked to agree on the weights instead)."""
    data = inputs(3, world, 8, 6)
    probe = inputs(1, 1, 4, 6, seed=11)[0, 0]
    engine = zeroshard.initialize(seeded(WithBatchNorm)(), sgd, {"stage": stage, "chunk_size": 64,
                                                                  **({"cache_chunks": 1} if stage == 3 else {})})
    ref = seeded(WithBatchNorm)()
    opt = sgd(list(ref.parameters()))
    diffs, finite = [], True
    for step in data:
        engine.train()
        engine.backward(engine(step[rank]).pow(2).mean())
        engine.step()
        engine.eval()
        with torch.no_grad():
            got = engine(probe)
        finite &= bool(torch.isfinite(got).all())
        if world == 1:
            ref.train()
            ref(step[0]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ref.eval()
            with torch.no_grad():
                diffs.append((got - ref(probe)).abs().max().item())
    mine = _weights(engine)
    return {"eval_diff": max(diffs) if diffs else None, "finite": finite,
            "ranks_agree_on_weights": all(e == mine for e in every_rank(mine))}


def _weights(engine):
    return {k: v.tolist() for k, v in engine.full_state_dict().items() if not k.startswith("bn.running")
            and "num_batches" not in k}


per_stage(SCENARIOS, "train_eval_switching", train_eval_switching)


def reload_then_no_grad_forward(rank, world, stage):
    """FSDP2 test_fully_shard_unsharded_views.py,
    TestFullyShardUnshardedViews.test_views_survive_reshard_and_weight_loading: a frozen Linear, state
    dicts filled with 1, 2, 3 loaded into the wrapped model one after another: each next no_grad
    forward sees the new values (no stale gathered copy), at stage 3 with and without a bounded
    rCache."""
    lin = nn.Linear(8, 4)
    lin.requires_grad_(False)
    cfg = {"stage": stage, **({"cache_chunks": 1} if stage == 3 else {})}
    engine = zeroshard.initialize(lin, None, cfg)
    outs = []
    x = torch.ones(1, 8)
    for v in (1.0, 2.0, 3.0):
        with torch.no_grad():
            engine(x)
        lin.load_state_dict({"weight": torch.full((4, 8), v), "bias": torch.full((4,), v)})
        with torch.no_grad():
            outs.append(engine(x)[0, 0].item())
    return {"outs": outs}


per_stage(SCENARIOS, "reload_then_no_grad_forward", reload_then_no_grad_forward)


# -- clipping, zero gradients ----------------------------------------------------------------------------
def clip_values(rank, world, stage):
    """FSDP2 test_fully_shard_clip_grad_norm_.py, TestClipGradNormWorldSize2.test_clip_grad_norm_1d:
    clipping at 1.0, 1e-3 (clips hard) and 1e3 (no effect): parity with torch's clip_grad_norm_ then
    the step, and the norm the engine reports is torch's total norm before clipping."""
    out = {}
    for clip in (1.0, 1e-3, 1e3):
        norms = []

        def clipped(model, k, clip=clip):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        engine, d = parity(rank, world, seeded(FourLayers), lambda m, x, *_: m(x).pow(2).sum(), inputs(2, world, 4, 6),
                           sgd, {"stage": stage, "chunk_size": 64, "clip_grad_norm": clip}, before_step=clipped)
        out[str(clip)] = {"diff": d, "norm_diff": abs(engine.stats()["grad_norm"] - norms[-1]) / norms[-1]}
    return out


per_stage(SCENARIOS, "clip_values", clip_values)


def zero_gradients_with_clipping(rank, world, stage):
    """DeepSpeed tests/unit/runtime/half_precision/test_bf16_grad_norm_guard.py,
    TestBF16GradNormGuard.test_an_all_zero_gradient_step_is_not_an_error: a loss times 0 with clipping
    on: all-zero gradients, norm 0, no NaN; AdamW moves parameters by weight decay only, as torch."""
    def loss(m, x, *_):
        return m(x).pow(2).mean() * 0
    engine, d = parity(rank, world, seeded(FourLayers), loss, inputs(2, world, 4, 6),
                       lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                       {"stage": stage, "chunk_size": 64, "clip_grad_norm": 1.0},
                       before_step=lambda model, k: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    return {"diff": d, "norm": engine.stats()["grad_norm"]}


per_stage(SCENARIOS, "zero_gradients_with_clipping", zero_gradients_with_clipping)


# -- optimizers and param groups -----------------------------------------------------------------------------
def adagrad_param_groups(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero_adagrad.py, TestZeroAdagradParamGroups: Adagrad with a
    weight group and a bias group of their own lr, eps and initial accumulator, and a custom 'name'
    key: the groups keep every key, and parameters match torch's Adagrad."""
    def opt_of(model):
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        return torch.optim.Adagrad([
            {"params": weights, "lr": 0.03, "eps": 1e-8, "initial_accumulator_value": 0.1, "name": "w"},
            {"params": biases, "lr": 0.12, "eps": 1e-5, "initial_accumulator_value": 0.2, "name": "b"}])
    data = inputs(3, world, 4, 6)
    ref = seeded(FourLayers)()
    ropt = opt_of(ref)
    for step in data:
        (sum(ref(step[r]).pow(2).mean() for r in range(world)) / world).backward()
        ropt.step()
        ropt.zero_grad()
    model = seeded(FourLayers)()
    engine = zeroshard.initialize(model, opt_of(model), {"stage": stage, "chunk_size": 64})
    for step in data:
        engine.backward(engine(step[rank]).pow(2).mean())
        engine.step()
    keys = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict()),
            "groups_kept": keys == [{k: v for k, v in g.items() if k != "params"} for g in ropt.param_groups]}


per_stage(SCENARIOS, "adagrad_param_groups", adagrad_param_groups)


def sgd_groups_through_a_checkpoint(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero.py, TestZeroToFP32.test_2_param_groups (and
    tests/unit/checkpoint/test_zero_optimizer.py, TestZeROCheckpoint.test_load_optimizer_state): SGD
    with momentum in two weight-decay groups, the first layer frozen but listed in its group: a
    checkpoint resumed into a new engine (other chunk size) continues exactly as the run that was not
    interrupted, and the groups' hyperparameters come back."""
    def opt_of(model):
        return torch.optim.SGD([
            {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.01},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}],
            lr=0.05, momentum=0.9)

    def build():
        torch.manual_seed(0)
        m = FourLayers()
        m.layers[0].requires_grad_(False)
        return m
    data = inputs(4, world, 4, 6)

    def train(engine, steps):
        for step in steps:
            engine.backward(engine(step[rank]).pow(2).mean())
            engine.step()
    m = build()
    whole = zeroshard.initialize(m, opt_of(m), {"stage": stage, "chunk_size": 64})
    train(whole, data)
    root = shared_temp_dir()
    m = build()
    first = zeroshard.initialize(m, opt_of(m), {"stage": stage, "chunk_size": 64})
    train(first, data[:2])
    first.save_checkpoint(root)
    m = build()
    resumed = zeroshard.initialize(m, opt_of(m), {"stage": stage, "chunk_size": 48})
    resumed.load_checkpoint(root)
    train(resumed, data[2:])
    return {"diff": max_diff(resumed.full_state_dict(), whole.full_state_dict()),
            "weight_decay": [g["weight_decay"] for g in resumed.optimizer.param_groups]}


per_stage(SCENARIOS, "sgd_groups_through_a_checkpoint", sgd_groups_through_a_checkpoint)
