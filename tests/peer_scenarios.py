"""Behaviour scenarios ported from the peers' test suites (issue 14): each docstring names the peer
file and test the idea comes from (DeepSpeed: deepspeedai/DeepSpeed tests/unit/...; FSDP2:
pytorch/pytorch test/distributed/_composable/fsdp/...). The ideas carry over, the code is our own:
every scenario trains through the engine and compares with plain single-process PyTorch on the
global batch, or checks the documented outcome.

This module holds the registry, SCENARIOS: peer_parameter_scenarios' and peer_training_scenarios'
scenarios, then its own, on what a forward takes and returns and on parameters at every level of the
module tree; peer_common holds what they share.

`run(rank, world, out_path)` runs them all in one process group (tests/test_peer.py).
"""
from __future__ import annotations

import collections
import typing

import torch
import torch.nn as nn

import zeroshard
import peer_parameter_scenarios
import peer_training_scenarios
from models import inputs, parity
from peer_common import adam, mlp, per_stage, seeded, sgd
from scenarios import run_all

SCENARIOS = {**peer_parameter_scenarios.SCENARIOS, **peer_training_scenarios.SCENARIOS}


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


per_stage(SCENARIOS, "output_containers", output_containers)


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


per_stage(SCENARIOS, "container_inputs", container_inputs)


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


per_stage(SCENARIOS, "bare_parameters_at_every_level", bare_parameters_at_every_level)


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)
