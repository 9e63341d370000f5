"""zeroshard where users already train: `integrations.transformers` (the Hugging Face Trainer) and
`integrations.lightning` (a Lightning Strategy). Each imports its framework only when imported
itself: neither framework is a dependency of zeroshard (extras `transformers`, `lightning`).
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import Config, load_config
from ..errors import CheckpointError, ConfigError, EngineCallError

# engine.stats() keys both integrations log as `zeroshard/<key>` (stats.py documents each)
LOGGED = ("step_time_s", "tokens_per_s", "samples_per_s", "skipped_steps", "model_state_bytes", "cache_peak_bytes",
          "loss_scale")


def reconcile(config, decided: dict, setting_of: dict, framework: str, agrees=lambda key, value: False,
           explicit: frozenset = frozenset()) -> Config:
    """The engine's config: `config` (any form load_config takes) with the keys the framework
    `decided`. A key the config sets (a key of a dict config, one in `explicit`, or any field away
    from its default) to another value than the framework's raises ValueError naming the
    framework's setting (`setting_of[key]`), unless `agrees(key, value)`: the framework's setting
    governs it, and two silently different answers would not do."""
    cfg, defaults = load_config(config), Config()
    given = set(explicit) | (set(config) if isinstance(config, dict) else set())
    for key, value in decided.items():
        mine = getattr(cfg, key)
        if (key in given or mine != getattr(defaults, key)) and mine != value and not agrees(key, mine):
            raise ConfigError(f"zeroshard config {key}={mine!r} contradicts {framework}'s {setting_of[key]} (which "
                             f"gives {value!r}); set it through {framework}")
    return dataclasses.replace(cfg, **decided)


class EngineOptimizer:
    """What a Trainer holds as its optimizer: `step()` is the engine's step (reduced gradients,
    clipping, the update, the parameters published), `zero_grad()` the engine's. `param_groups` is
    the engine optimizer's own list, so a change to a group's lr reaches the update."""

    def __init__(self, engine):
        self.engine = engine
        self.step_was_skipped = False  # accelerate asks its optimizers this before stepping the scheduler

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.state

    def step(self, closure=None):
        if closure is not None:
            raise EngineCallError("zeroshard: the engine's step takes no closure (its gradients come from backward)")
        self.step_was_skipped = not self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def state_dict(self):
        raise CheckpointError("zeroshard: the optimizer state is sharded; it is saved with the engine's checkpoint "
                           "(engine.save_checkpoint), which the integrations' checkpoints use")

    def load_state_dict(self, state_dict):
        raise CheckpointError("zeroshard: the optimizer state is sharded; load it with the engine's checkpoint "
                           "(engine.load_checkpoint)")
