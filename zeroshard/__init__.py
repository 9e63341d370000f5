"""zeroshard: ZeRO data parallelism (stages 0-3) for any unmodified torch.nn.Module.

    engine = zeroshard.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                  config={"stage": 3, "precision": "bf16"})
    for batch in data:
        loss = engine(batch).loss
        engine.backward(loss)
        engine.step()

The package, floor by floor (lowest first). A module imports only from its own floor or lower ones,
function-local imports included; tests/test_layering.py reads this list and checks it. The words the
code uses are defined once, in docs/vocabulary.md.

Floors:
1. errors, units, config, numerics: every public error (one base, ZeroShardError), the model's units,
   the config, reductions over large tensors (finite checks, sums of squares).
2. distributed: the only floor that calls torch.distributed (Comm, order checks, DTensor helpers).
3. files: safetensors weights, checkpoint folders and their atomic commits, DCP adapters.
4. runtime: chunks, rCache, hooks, reduction, transfers, saved tensors, precision, module state.
5. optim: the sharded step on fp32 masters, loss scaling, param groups, the CPU Adam.
6. planning: profiler, machine, planner, the paper's estimates.
7. state: checkpoints saved and loaded, pretrained weights in and out, export.
8. telemetry: per-step statistics and the memory timeline.
9. engine, assembly, engine_io, engine_forward: `Engine`, built by assembly's named steps, its state
   methods in engine_io, its forward's bracket in engine_forward.
10. __init__, integrations, cli, demo: the front ends.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

import torch

from .config import Config, load_config
from .optim.cpu_adam import CPUAdamW
from .engine import Engine
from .errors import (CheckpointError, CollectiveTimeoutError, ConfigError, DivergedError, EngineCallError,
                     FrozenParameterError, GradientsInChunksError, ModuleCopyError, ModuleMovedError, NonFiniteError,
                     ParameterReplacedError, PeerLostError, PeerLostInCheckpointError, PlanError,
                     ShardedParameterError, TierFileError, UninitializedTensorError, UnsupportedModelError,
                     WeightsError, ZeroShardError)
from .planning.profiler import Profile, profile
from .distributed.tensor_parallel import device_mesh

# Module paths the README named before the package had floors. Each imports as the module it moved
# to (the same object, so isinstance and monkeypatching agree); nothing is loaded until it is asked for.
MOVED = {"collectives": "distributed.collectives", "cpu_adam": "optim.cpu_adam", "estimate": "planning.estimate",
         "export": "state.export", "hardware": "planning.hardware", "planner": "planning.planner",
         "profiler": "planning.profiler", "timeline": "telemetry.timeline"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        short = fullname.removeprefix(__name__ + ".")
        if short != fullname and short in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # The import system returns whatever sys.modules holds for the name after exec_module.
        sys.modules[module.__name__] = importlib.import_module(
            f"{__name__}.{MOVED[module.__name__.removeprefix(__name__ + '.')]}")


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())

__all__ = ["Config", "CPUAdamW", "Engine", "initialize", "device_mesh", "profile", "Profile",
           "CheckpointError", "CollectiveTimeoutError", "DivergedError", "EngineCallError", "FrozenParameterError",
           "GradientsInChunksError", "ModuleCopyError", "ModuleMovedError", "ShardedParameterError", "NonFiniteError",
           "ParameterReplacedError", "PeerLostError", "PeerLostInCheckpointError", "TierFileError", "UninitializedTensorError",
           "UnsupportedModelError", "WeightsError", "ConfigError", "PlanError", "ZeroShardError"]


def initialize(model: torch.nn.Module, optimizer=None, config: Config | dict | str | os.PathLike | None = None,
               *, device: torch.device | str | None = None, example_inputs=None, weights=None,
               init_fn=None) -> Engine:
    """Wrap `model` for ZeRO data-parallel training.

    optimizer: a torch.optim.Optimizer built over the model's parameters, with any param groups (as
        `AdamW(grouped_parameters, lr=...)` in a fine-tuning script; fresh: no state yet), which then
        steps this rank's fp32 master pieces of them (an LR scheduler built on it keeps working); or
        a callable taking the list of this rank's master pieces (fp32 tensors, one per parameter
        with elements on this rank) and returning a torch.optim.Optimizer; None gives
        AdamW(lr=1e-3) (zeroshard.CPUAdamW with offload_optimizer). Only elementwise optimizers
        (SGD, Adam, AdamW, ...) train exactly as in torch at stages 1-3, where a piece may be part
        of a parameter.
    config: a `Config`, a dict of its fields, or a path to a .json/.toml file with them.
    device: where compute runs; default cuda:LOCAL_RANK when CUDA is available, else the CPU.
    example_inputs: with offload/stage 'auto', one micro-batch as the model is called in training (a
        tensor, a tuple of arguments or a dict of keyword arguments: their shapes and dtypes, and the
        values the model reads from them, as a label check; planning/input_values.py):
        the model is profiled on the meta device, the machine measured (cached), and the plan applied.
    weights: pretrained weights to start from (a Hugging Face folder with model.safetensors or a
        sharded model.safetensors.index.json, a .safetensors file, or a `zeroshard export` output):
        each rank reads only what it keeps, straight into its shards (pretrained.py). Tensors not in
        the file keep the model's values (initialised, for a model on the meta device), with a
        warning; a shape mismatch raises WeightsError.
    init_fn: for a model built on the meta device, `init_fn(module)` initialises a module's own
        tensors instead of its reset_parameters() / transformers' _init_weights (materialize.py).
    The model may be built on the meta device (`with torch.device("meta"): model = ...`): each rank
    then materialises only what it keeps, one parameter at a time, so no rank ever holds the whole
    model; config `init_seed` seeds it. A model built normally works too; at stage 3 its own
    parameter storage is freed as soon as the chunks hold it.
    The process group comes from torchrun's environment (gloo on CPU, NCCL on CUDA); without it the
    world is this one process.
    """
    if optimizer is not None and not callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("zeroshard.initialize: optimizer must be a torch.optim.Optimizer over the model's "
                         "parameters, a callable taking a list of tensors (e.g. lambda ps: "
                         "torch.optim.AdamW(ps, lr=1e-3)), or None")
    cfg = load_config(config)
    return Engine(model, optimizer, cfg, torch.device(device) if device is not None else None,
                  example_inputs=example_inputs, weights=weights, init_fn=init_fn)
