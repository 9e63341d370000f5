"""What the state floor reads of an engine, and the few calls it makes back into it: a frozen record
the engine builds for each save, load or export (`Engine._state_view`), so checkpoint.py,
checkpoint_load.py and pretrained.py name what they depend on instead of taking the whole engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..config import Config


@dataclass(frozen=True)
class TrainingState:
    module: nn.Module
    params: list[nn.Parameter]  # deduplicated, in the model's order
    names: dict[int, str]  # id(param) -> its first name
    shapes: dict[int, torch.Size]  # id(param) -> what this rank stores of it
    state_keys: list[tuple[str, object]]  # the module's own state_dict keys with their objects
    device: torch.device
    config: Config  # the config that runs (with 'auto': what the plan chose)
    comm: object  # distributed.collectives.Comm over the data-parallel group
    shards: object  # distributed.shard_groups.ShardGroups: the chunks' collectives
    world_comm: object  # Comm over every rank, TP peers included
    tp: object | None  # distributed.tensor_parallel.TensorParallel
    layout: object  # runtime.layout.ChunkLayout
    optim: object  # optim.optimizer.ShardedOptimizer
    scaler: object | None  # optim.loss_scale.LossScaler with fp16
    cache: object  # runtime.cache.ChunkCache
    # The engine's counters when the view was made.
    steps: int  # optimizer steps applied
    micro_steps: int  # micro-batches since the last boundary
    grads_pending: bool  # a backward ran whose gradients no step() has applied or dropped
    # Calls into the engine: they change its state through its own methods.
    apply_delayed_update: Callable[[], None]
    thaw: Callable[..., None]  # Engine.thaw(names)
    fix_layout: Callable[..., None]  # Engine.fix_layout(order)
    restore_counters: Callable[[int], None]  # Engine.restore_counters(steps)

    @property
    def chunks(self) -> list:
        return self.layout.chunks

    @property
    def stage(self) -> int:
        return self.config.stage
