"""Behaviour scenarios ported from the peers' test suites (issue 14): each docstring names the peer
file and test the idea comes from (DeepSpeed: deepspeedai/DeepSpeed tests/unit/...; FSDP2:
pytorch/pytorch test/distributed/_composable/fsdp/...). The ideas carry over, the code is our own:
every scenario trains through the engine and compares with plain single-process PyTorch on the
global batch, or checks the documented outcome.

`run(rank, world, out_path)` runs them all in one process group (tests/test_peer.py).
"""
from __future__ import annotations

import collections
import tempfile
import typing

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
from models import inputs, max_diff, parity
from scenarios import _gather, run_all

SCENARIOS = {}
STAGES = range(4)


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def adam(ps):
    return torch.optim.Adam(ps, lr=1e-3)


def per_stage(name, fn, stages=STAGES):
    for stage in stages:
        SCENARIOS[f"{name}_stage{stage}"] = lambda rank, world, stage=stage: fn(rank, world, stage)


def seeded(cls, *args):
    def build():
        torch.manual_seed(0)
        return cls(*args)
    return build


# -- unused, conditionally used parameters ------------------------------------------------------------
class WithUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def unused_layer(rank, world, stage):
    """DeepSpeed tests/unit/runtime/half_precision/test_fp16.py, TestAdamFP32EmptyGrad: a layer the
    forward never calls, Adam with gradient clipping 1.0: the unused layer is never stepped (its
    values stay bit for bit), the others train as in torch (clipped by the norm of real gradients)."""
    data = inputs(4, world, 4, 8)
    build = seeded(WithUnusedLayer)

    def clipped(model, k):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    engine, d = parity(rank, world, build, lambda m, x, *_: m(x).pow(2).mean() * 50, data, adam,
                       {"stage": stage, "chunk_size": 64, "clip_grad_norm": 1.0}, before_step=clipped)
    sd, init = engine.full_state_dict(), build().state_dict()
    return {"diff": d, "unused_kept": all(torch.equal(sd[k], init[k]) for k in sd if k.startswith("unused."))}


per_stage("unused_layer", unused_layer)


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), self.b(x)


def unused_forward_output(rank, world, stage):
    """FSDP2 test_fully_shard_autograd.py, TestFullyShardAutograd.test_unused_forward_output: the loss
    uses both outputs for 3 steps, then only the first: the second layer, which has Adam state by
    then, gets no gradient and is not stepped again."""
    data = inputs(6, world, 4, 8)

    def loss(m, x, k, *_):
        a, b = m(x)
        return a.pow(2).mean() + (b.pow(2).mean() if k < 3 else 0)
    _, d = parity(rank, world, seeded(TwoOutputs), loss, data, adam, {"stage": stage, "chunk_size": 64})
    return {"diff": d}


per_stage("unused_forward_output", unused_forward_output)


class FourLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def unbalanced_gradients(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero.py, TestZeroUnbalancedGradients: with gradient
    accumulation 2, even-indexed parameters are trainable in the first micro-batch and odd-indexed ones
    in the second (requires_grad flipped before each forward): each parameter's gradient is what its
    trainable micro-batch gave."""
    params_of = {}  # id(model) -> its parameters, taken before initialize (stage 3 puts placeholders in)

    def build():
        torch.manual_seed(0)
        m = FourLayers()
        params_of[id(m)] = list(m.parameters())
        return m

    def loss(m, x, k, r, micro):
        for i, p in enumerate(params_of[id(m.module if isinstance(m, zeroshard.Engine) else m)]):
            p.requires_grad_(i % 2 == micro)
        return m(x).pow(2).mean()
    data = inputs(3, 2 * world, 4, 6).view(3, 2, world, 4, 6)
    _, d = parity(rank, world, build, loss, data, sgd, {"stage": stage, "chunk_size": 64}, accumulation=2)
    return {"diff": d}


per_stage("unbalanced_gradients", unbalanced_gradients)


# -- parameters used several times, shared, tied ----------------------------------------------------------
class ReadsChildWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear2(torch.tanh(self.linear1(x)))
        return F.linear(h, self.linear1.weight)  # linear1's weight again, outside linear1's forward


def external_parameter_read(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero_context.py, TestSerialContext.test_ext_param_getattr:
    the parent reads a child's weight directly after the child ran; at stage 3 (one-chunk rCache) the
    weight is gathered for that read too, and its gradient sums both uses."""
    cfg = {"stage": stage, "chunk_size": 64, **({"cache_chunks": 1} if stage == 3 else {})}
    _, d = parity(rank, world, seeded(ReadsChildWeight), lambda m, x, *_: m(x).pow(2).mean(), inputs(3, world, 4, 8),
                  sgd, cfg)
    return {"diff": d}


per_stage("external_parameter_read", external_parameter_read)


class RepeatLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        for _ in range(3):
            x = x + torch.tanh(self.linear(x))
        return self.head(x)


def repeat_forward_loop(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero.py, TestZero3RepeatForwardLoop: one layer applied
    three times (ALBERT-like), gradient accumulation 2, cross-entropy: every use counts, and stage 3
    has the parameter for each backward use."""
    g = torch.Generator().manual_seed(3)
    data = inputs(3, 2 * world, 4, 4).view(3, 2, world, 4, 4)
    labels = torch.randint(0, 3, (4,), generator=g)
    _, d = parity(rank, world, seeded(RepeatLoop), lambda m, x, *_: F.cross_entropy(m(x), labels), data, sgd,
                  {"stage": stage, "chunk_size": 32, **({"cache_chunks": 1} if stage == 3 else {})}, accumulation=2)
    return {"diff": d}


per_stage("repeat_forward_loop", repeat_forward_loop)


class MultiForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def multi_forward_module(rank, world, stage):
    """FSDP2 test_fully_shard_training.py, TestFullyShard1DTrainingCore.test_multi_forward_module: a
    module called twice on the same input: its gradient sums both calls, reduced once."""
    _, d = parity(rank, world, seeded(MultiForward), lambda m, x, *_: m(x).pow(2).mean(), inputs(4, world, 3, 4),
                  sgd, {"stage": stage, "chunk_size": 32})
    return {"diff": d}


per_stage("multi_forward_module", multi_forward_module)


def mlp():
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6))


def same_module_twice(rank, world, stage):
    """FSDP2 test_fully_shard_init.py,
    TestFullyShardParamModuleInfos.test_get_param_module_infos_duplicates: nn.Sequential(mlp, mlp),
    one module registered twice: its parameters are stored and stepped once, and full_state_dict has
    both paths' keys with equal values."""
    def build():
        torch.manual_seed(0)
        block = mlp()
        return nn.Sequential(block, block)
    engine, d = parity(rank, world, build, lambda m, x, *_: m(x).pow(2).mean(), inputs(3, world, 4, 6), sgd,
                       {"stage": stage, "chunk_size": 64})
    sd = engine.full_state_dict()
    return {"diff": d, "chunked_params": sum(len(c.slots) for c in engine.chunks),
            "both_paths_equal": torch.equal(sd["0.0.weight"], sd["1.0.weight"])}


per_stage("same_module_twice", same_module_twice)


class TiedUneven(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.tok = nn.Embedding(vocab, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, vocab, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.tok(ids))))


def tied_uneven(rank, world, stage):
    """FSDP2 test_fully_shard_training.py, TestFullyShardSharedParams.test_train_shared_params_uneven_shard:
    input and output embeddings tied, vocabulary 4*world+1 rows (the last shard padded): it trains as
    in torch, every row of the tied weight changes (AdamW), and both names hold one value."""
    vocab = 4 * world + 1
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, vocab, (4, world, 3, 5), generator=g)
    build = seeded(TiedUneven, vocab)

    def loss(m, x, *_):
        return F.cross_entropy(m(x).reshape(-1, vocab), x.reshape(-1))
    engine, d = parity(rank, world, build, loss, data, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                       {"stage": stage, "chunk_size": 64})
    sd, init = engine.full_state_dict(), build().state_dict()
    return {"diff": d, "all_rows_changed": bool((sd["tok.weight"] != init["tok.weight"]).any(dim=1).all()),
            "tied_equal": torch.equal(sd["tok.weight"], sd["out.weight"])}


per_stage("tied_uneven", tied_uneven)


class EngineAndModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x)


def engine_and_module_branches(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero_shared_loss_gradient.py,
    TestZero2SharedLossGradient: one loss from engine(x) + engine.module(x / 2), with gradient
    accumulation: gradients through the bare module count too, neither dropped nor doubled."""
    data = inputs(3, 2 * world, 4, 6).view(3, 2, world, 4, 6)

    def loss(m, x, *_):
        module = m.module if isinstance(m, zeroshard.Engine) else m
        return (m(x) + module(x / 2)).pow(2).mean()
    _, d = parity(rank, world, seeded(EngineAndModule), loss, data, sgd, {"stage": stage}, accumulation=2)
    return {"diff": d}


per_stage("engine_and_module_branches", engine_and_module_branches)


class FrozenReused(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.trainable, self.frozen = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        x = self.first(x)
        for _ in range(3):
            x = self.frozen(torch.relu(self.trainable(x)))
            with torch.no_grad():
                x.add_(torch.relu(self.trainable(x)))
        return x


def frozen_multi_forward(rank, world, stage):
    """FSDP2 test_fully_shard_frozen.py, TestFullyShardFrozen.test_multi_forward_mixed_requires_grad: a
    frozen and a trainable layer each called three times, partly under no_grad, in one forward: the
    frozen layer stays as it was, the trainable one's gradient comes from its grad-enabled calls."""
    build = seeded(FrozenReused)
    engine, d = parity(rank, world, build, lambda m, x, *_: m(x).pow(2).mean(), inputs(3, world, 4, 6), adam,
                       {"stage": stage, "chunk_size": 64})
    sd, init = engine.full_state_dict(), build().state_dict()
    return {"diff": d, "frozen_kept": all(torch.equal(sd[k], init[k]) for k in sd if k.startswith("frozen."))}


per_stage("frozen_multi_forward", frozen_multi_forward)


# -- zero-element parameters, odd shapes and sizes -------------------------------------------------------
class WithEmpty(nn.Module):
    def __init__(self, layout):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.layout = layout
        if layout == "empty_linear":
            self.empty = nn.Linear(8, 0)
        elif layout == "mixed":
            self.extra = nn.Parameter(torch.zeros(0, 8))
        else:  # submodules whose only parameters are empty
            self.blocks = nn.ModuleList(nn.Linear(8, 0, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.dense(x)
        if self.layout == "empty_linear":
            h = h + self.empty(h).sum()
        elif self.layout == "mixed":
            h = h + (self.extra @ h.T).sum()
        else:
            for b in self.blocks:
                h = h + b(h).sum()
        return h


def zero_element_parameters(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero_empty_param.py, TestZeroElementParam: parameters
    with no elements in three layouts (a Linear(8, 0), a (0, 8) parameter beside a sized one, modules
    whose only parameters are empty): they keep their shapes, and training runs as in torch."""
    out = {}
    for layout in ("empty_linear", "mixed", "only_empty"):
        engine, d = parity(rank, world, seeded(WithEmpty, layout), lambda m, x, *_: m(x).pow(2).mean(),
                           inputs(3, world, 4, 8), sgd, {"stage": stage, "chunk_size": 64})
        shapes = {k: list(v.shape) for k, v in engine.full_state_dict().items()}
        out[layout] = {"diff": d, "shapes_kept": shapes == {k: list(v.shape) for k, v in
                                                            seeded(WithEmpty, layout)().state_dict().items()}}
    return out


per_stage("zero_element_parameters", zero_element_parameters)


class Odd(nn.Module):
    def __init__(self, a, b, c):
        super().__init__()
        self.l1, self.l2 = nn.Linear(a, b), nn.Linear(b, c)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def odd_shapes(rank, world, stage):
    """FSDP2 test_fully_shard_training.py, TestFullyShard1DTrainingCore.test_train_parity_single_group_shard_dim0:
    linear shapes (16, 15, 8), (7, 15, 3), (16, 17, 8), none dividing by the world size, with chunks
    smaller than a parameter (each then gets its own, padded over the ranks): Adam parity."""
    out = []
    for a, b, c in ((16, 15, 8), (7, 15, 3), (16, 17, 8)):
        _, d = parity(rank, world, seeded(Odd, a, b, c), lambda m, x, *_: m(x).pow(2).mean(), inputs(3, world, 2, a),
                      adam, {"stage": stage, "chunk_size": 13})
        out.append(d)
    return {"diff": max(out)}


per_stage("odd_shapes", odd_shapes)


class Narrow(nn.Module):
    def __init__(self, h=6, freeze_first=False):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(h, 1), nn.Linear(1, 1), nn.Linear(1, h)
        if freeze_first:
            self.l1.requires_grad_(False)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def single_element_parameters(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero_tensor_fragment.py, TestTensorFragmentGet.test_zero_fragments:
    Linear(h, 1) -> Linear(1, 1) -> Linear(1, h), optionally the first frozen: one-element parameters
    leave some ranks' pieces empty; Adam parity, and no optimizer state for the frozen layer."""
    out = {}
    for freeze in (False, True):
        engine, d = parity(rank, world, seeded(Narrow, 6, freeze), lambda m, x, *_: m(x).pow(2).mean(),
                           inputs(3, world, 4, 6), adam, {"stage": stage, "chunk_size": 16})
        frozen = {id(p) for p in engine.module.l1.parameters()} if stage < 3 else set()
        out[str(freeze)] = {"diff": d, "frozen_state": any(id(p) in frozen for p in engine.optimizer.state)}
    return out


per_stage("single_element_parameters", single_element_parameters)


def fewer_elements_than_ranks(rank, world, stage):
    """DeepSpeed tests/unit/runtime/half_precision/test_fp16.py, TestZeroEmptyPartition: Linear(1, 1),
    two one-element parameters, so at world 3 a rank owns nothing: it still takes part in every
    collective (and the clipping norm), and the model trains as in torch."""
    _, d = parity(rank, world, seeded(nn.Linear, 1, 1), lambda m, x, *_: m(x).pow(2).mean(), inputs(3, world, 4, 1),
                  sgd, {"stage": stage, "clip_grad_norm": 0.1},
                  before_step=lambda model, k: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    return {"diff": d}


per_stage("fewer_elements_than_ranks", fewer_elements_than_ranks)


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


per_stage("accumulation_three_micro_batches", accumulation_three_micro_batches)


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


per_stage("two_forwards_one_backward", two_forwards_one_backward)


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


per_stage("frozen_middle_layer", frozen_middle_layer)


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


per_stage("bitfit", bitfit)


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


per_stage("no_grad_forward_between_steps", no_grad_forward_between_steps)


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
            "ranks_agree_on_weights": all(e == mine for e in _gather(mine, world))}


def _weights(engine):
    return {k: v.tolist() for k, v in engine.full_state_dict().items() if not k.startswith("bn.running")
            and "num_batches" not in k}


per_stage("train_eval_switching", train_eval_switching)


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


per_stage("reload_then_no_grad_forward", reload_then_no_grad_forward)


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


per_stage("clip_values", clip_values)


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


per_stage("zero_gradients_with_clipping", zero_gradients_with_clipping)


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


per_stage("adagrad_param_groups", adagrad_param_groups)


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
    root = _gather(tempfile.mkdtemp() if rank == 0 else None, world)[0]
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


per_stage("sgd_groups_through_a_checkpoint", sgd_groups_through_a_checkpoint)


# -- forward return types, containers, module structure ------------------------------------------------------
Point = collections.namedtuple("Point", ["hidden", "y"])


class Typed(typing.NamedTuple):
    hidden: torch.Tensor
    y: torch.Tensor


class Returns(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        y = self.b(h)
        return {"dict": lambda: {"hidden": h, "y": y}, "namedtuple": lambda: Point(h, y),
                "typed": lambda: Typed(h, y), "tuple": lambda: (h, y), "list": lambda: [h, y]}[self.kind]()


def output_containers(rank, world, stage):
    """DeepSpeed tests/unit/runtime/zero/test_zero.py, TestZero3ParamPartitioningBase.test_model_class: a
    forward returning a dict, collections.namedtuple, typing.NamedTuple, tuple or list of activations:
    the engine returns the same container type, and training through any entry matches torch."""
    out = {}
    for kind in ("dict", "namedtuple", "typed", "tuple", "list"):
        def loss(m, x, *_, kind=kind):
            got = m(x)
            if isinstance(m, zeroshard.Engine):
                seen.append(type(got).__name__)
            return (got["y"] if kind == "dict" else got[1]).pow(2).mean()
        seen = []
        _, d = parity(rank, world, seeded(Returns, kind), loss, inputs(2, world, 4, 6), sgd,
                      {"stage": stage, "chunk_size": 64})
        out[kind] = {"diff": d, "type": seen[0]}
    return out


per_stage("output_containers", output_containers)


class Packs(nn.Module):
    """Passes its activation to the next block packed in a dict or a namedtuple."""

    def __init__(self):
        super().__init__()
        self.first, self.second = mlp(), mlp()

    def forward(self, batch):
        packed = Point(self.first(batch["x"]), torch.ones(1))
        return self.second(packed.hidden * packed.y)


def container_inputs(rank, world, stage):
    """FSDP2 test_fully_shard_autograd.py, TestFullyShardAutograd.test_nontensor_activations: a dict
    input, activations passed on in a namedtuple; at stage 3 with a one-chunk rCache: inputs are not
    changed, training matches torch."""
    data = inputs(3, world, 4, 6)
    kept = []

    def loss(m, x, *_):
        batch = {"x": x}
        out = m(batch).pow(2).mean()
        kept.append(batch["x"] is x)
        return out
    cfg = {"stage": stage, "chunk_size": 128, **({"cache_chunks": 1} if stage == 3 else {})}
    _, d = parity(rank, world, seeded(Packs), loss, data, sgd, cfg)
    return {"diff": d, "inputs_kept": all(kept)}


per_stage("container_inputs", container_inputs)


class C(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin_c = nn.Linear(5, 5)

    def forward(self, x):
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = C()
        self.lin_b = nn.Linear(5, 5)
        self.subtrahend = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return self.lin_b(self.c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = B()
        self.addend = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return self.b(x) + self.addend


def bare_parameters_at_every_level(rank, world, stage):
    """FSDP2 test_fully_shard_ignore_params.py, TestFullyShardIgnoreParams.test_ddp_A_fsdp_B_ddp_C:
    bare nn.Parameters at several nesting levels beside Linear layers (the root's own and a middle
    module's): all train as in torch (Adam), names as the plain module's."""
    engine, d = parity(rank, world, seeded(A), lambda m, x, *_: m(x).sum(), inputs(3, world, 4, 5), adam,
                       {"stage": stage, "chunk_size": 16})
    return {"diff": d, "names": sorted(engine.full_state_dict()) == sorted(seeded(A)().state_dict())}


per_stage("bare_parameters_at_every_level", bare_parameters_at_every_level)


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)
