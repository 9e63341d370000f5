"""What the contract scenario modules share (contract_scenarios.py): their optimizers, the GPT-2 loss,
and per_optimizer_and_stage, which registers a scenario once per optimizer and ZeRO stage.
"""
from __future__ import annotations

from models import make_adamw, make_sgd

OPTIMIZERS = {"sgd": make_sgd, "adamw": make_adamw}


def loss_of(m, x):
    return m(input_ids=x, labels=x).loss


def per_optimizer_and_stage(registry, name, fn):
    for opt in OPTIMIZERS:
        for stage in range(4):
            registry[f"{name}_{opt}_stage{stage}"] = (lambda rank, world, opt=opt, stage=stage:
                                                     fn(rank, world, OPTIMIZERS[opt], stage))
