"""What the peer scenario modules share (peer_scenarios.py): their optimizers, a seeded model builder,
the small models several of them train, and per_stage, which registers a scenario once per ZeRO stage.
"""
from __future__ import annotations

import torch
import torch.nn as nn

STAGES = range(4)


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def adam(ps):
    return torch.optim.Adam(ps, lr=1e-3)


def per_stage(registry, name, fn, stages=STAGES):
    for stage in stages:
        registry[f"{name}_stage{stage}"] = lambda rank, world, stage=stage: fn(rank, world, stage)


def seeded(cls, *args):
    def build():
        torch.manual_seed(0)
        return cls(*args)
    return build


class FourLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def mlp():
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6))
