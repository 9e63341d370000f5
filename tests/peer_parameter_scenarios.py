"""Peer scenarios on parameters (peer_scenarios.py says where they come from): unused and
conditionally used ones, ones used several times, shared or tied, and zero-element, odd-shaped or
tiny ones.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
from models import inputs, parity
from peer_common import FourLayers, adam, mlp, per_stage, seeded, sgd

SCENARIOS = {}


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


per_stage(SCENARIOS, "unused_layer", unused_layer)


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


per_stage(SCENARIOS, "unused_forward_output", unused_forward_output)


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


per_stage(SCENARIOS, "unbalanced_gradients", unbalanced_gradients)


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


per_stage(SCENARIOS, "external_parameter_read", external_parameter_read)


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


per_stage(SCENARIOS, "repeat_forward_loop", repeat_forward_loop)


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


per_stage(SCENARIOS, "multi_forward_module", multi_forward_module)


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


per_stage(SCENARIOS, "same_module_twice", same_module_twice)


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


per_stage(SCENARIOS, "tied_uneven", tied_uneven)


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


per_stage(SCENARIOS, "engine_and_module_branches", engine_and_module_branches)


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


per_stage(SCENARIOS, "frozen_multi_forward", frozen_multi_forward)


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


per_stage(SCENARIOS, "zero_element_parameters", zero_element_parameters)


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


per_stage(SCENARIOS, "odd_shapes", odd_shapes)


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


per_stage(SCENARIOS, "single_element_parameters", single_element_parameters)


def fewer_elements_than_ranks(rank, world, stage):
    """DeepSpeed tests/unit/runtime/half_precision/test_fp16.py, TestZeroEmptyPartition: Linear(1, 1),
    two one-element parameters, so at world 3 a rank owns nothing: it still takes part in every
    collective (and the clipping norm), and the model trains as in torch."""
    _, d = parity(rank, world, seeded(nn.Linear, 1, 1), lambda m, x, *_: m(x).pow(2).mean(), inputs(3, world, 4, 1),
                  sgd, {"stage": stage, "clip_grad_norm": 0.1},
                  before_step=lambda model, k: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    return {"diff": d}


per_stage(SCENARIOS, "fewer_elements_than_ranks", fewer_elements_than_ranks)
