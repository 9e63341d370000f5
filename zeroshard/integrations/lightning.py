"""Lightning on zeroshard: `ZeroShardStrategy`, a Lightning Strategy that trains the LightningModule
on a zeroshard engine (stages 0-3, offload, everything zeroshard's Config holds).

    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=ZeroShardStrategy(stage=3),
                                precision="bf16-mixed", gradient_clip_val=1.0, accumulate_grad_batches=2)
    trainer.fit(module, data)

What comes from Lightning, as it does without zeroshard:
- the process group and the data: as DDPStrategy (torchrun's or Lightning's own launch, a
  DistributedSampler per rank);
- the optimizer and LR schedulers from `configure_optimizers` (one optimizer, built over the
  module's parameters: the engine adopts it with its param groups, and the schedulers built on it
  set the rate the update applies);
- manual optimization (one optimizer): training_step runs as one forward of the model
  (Engine.run_training_step) that manual_backward, opt.step(), opt.zero_grad() and clip_gradients
  inside it close and open again; a module's backward override runs between forwards too;
- `accumulate_grad_batches`: Lightning divides the loss and steps at the window's end; the engine
  keeps the window's gradients unreduced until its last micro-batch at stages 0-1 (Lightning's
  block_backward_sync is Engine.no_sync: one reduction per window) and reduce-scatters each at
  stages 2-3 (its own accumulation count stays 1);
- `gradient_clip_val` (by norm) becomes config `clip_grad_norm` (unless the module overrides
  configure_gradient_clipping, which is then called with it), applied over every shard inside the
  step; clipping by value raises ValueError (it needs whole gradients);
- `precision`: "bf16-mixed" / "bf16-true" / "16-mixed" / "16-true" become config precision
  bf16 / bf16 / fp16 / fp16 (zeroshard's mixed precision: fp32 masters, 16-bit compute copies,
  dynamic loss scaling for fp16; no autocast); Lightning's default "32-true" leaves the config's;
- a config field that contradicts the Lightning Trainer (precision, clip_grad_norm against
  gradient_clip_val, gradient_accumulation_steps against accumulate_grad_batches) raises ValueError;
- offload or stage 'auto' profiles the module's forward on its `example_input_array`;
- a module passed through `torch.compile` is compiled as config `compile` compiles (each layer
  block's forward, with torch.compile's context of the call), not its training_step and forward
  whole, whose graphs would hold the engine's hooks;
- checkpoints (`ModelCheckpoint`, `trainer.save_checkpoint`, `fit(ckpt_path=...)`): each checkpoint
  path is a directory holding a zeroshard sharded checkpoint (fp32 masters, optimizer states, RNG)
  with Lightning's own state (loops, callbacks, LR schedulers, epoch, step) as its client state;
  loading reshards across world size and stage. `save_pretrained` / `full_state_dict` on
  `strategy.engine` export the model.
The engine's figures go to every Lightning logger (tensorboard, CSV, ...) every
`log_every_n_steps` optimizer steps: `zeroshard/<key>` for each key of integrations.LOGGED, and
`zeroshard/grad_norm` (before clipping) and `zeroshard/lr`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer import call

import zeroshard
from ..config import Config, load_config
from . import LOGGED, EngineOptimizer, reconcile
from ..errors import ConfigError, EngineCallError

PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
             "16-true": "fp16"}


def _overrides(module, name: str) -> bool:
    return getattr(type(module), name) is not getattr(pl.LightningModule, name)


def _hooks(module, name: str, *args) -> None:
    """Lightning's hook `name` on the callbacks, then on the module, as Lightning's own strategies call it."""
    call._call_callback_hooks(module.trainer, name, *args)
    call._call_lightning_module_hook(module.trainer, name, *args)


def _plain(obj, where: str):
    """Lightning's checkpoint state as what a checkpoint loads without unpickling code: dict
    subclasses as dicts; anything that is not a tensor, number, string, None or container of them
    as its repr, with a warning (hyperparameters of custom types, mostly)."""
    if isinstance(obj, dict):
        return {k: _plain(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # a named tuple becomes a plain tuple
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    warnings.warn(f"zeroshard: checkpoint entry {where} ({type(obj).__name__}) is stored as its repr: a "
                  "checkpoint holds no pickled objects")
    return repr(obj)


class ZeroShardStrategy(DDPStrategy):
    """Trains the LightningModule on a zeroshard engine (module docstring). `config`: a zeroshard
    Config, dict or file; keyword arguments override its fields (`ZeroShardStrategy(stage=3)`).
    `strategy.engine` is the engine once fit/validate/test/predict has set it up."""

    strategy_name = "zeroshard"

    def __init__(self, config: Config | dict | str | None = None, **fields):
        super().__init__()
        cfg = load_config(config)
        self.zeroshard_config = dataclasses.replace(cfg, **fields)
        self.explicit = frozenset(fields) | frozenset(config if isinstance(config, dict) else ())
        self.engine = None

    # -- set-up ----------------------------------------------------------------------------------------
    def _engine_config(self, trainer: "pl.Trainer") -> Config:
        """The strategy's config with what the Lightning Trainer decides; a config field that
        contradicts it raises ValueError (reconcile)."""
        precision = PRECISION.get(str(self.precision_plugin.precision))
        if precision is None:
            raise ConfigError(f"zeroshard: Lightning precision {self.precision_plugin.precision!r} is not supported; "
                             f"use one of {sorted(PRECISION)}")
        algorithm = trainer.gradient_clip_algorithm  # None (norm), or Lightning's enum or string
        if trainer.gradient_clip_val and str(getattr(algorithm, "value", algorithm) or "norm") != "norm":
            raise ConfigError("zeroshard: gradient_clip_algorithm='value' needs whole gradients, which are sharded; "
                             "clip by norm (the default)")
        decided = {"gradient_accumulation_steps": 1}
        if precision != "fp32":  # Lightning's default "32-true" leaves the config's precision standing
            decided["precision"] = precision
        # otherwise the config's clip_grad_norm stands; an overridden configure_gradient_clipping
        # gets gradient_clip_val and clips as it decides (optimizer_step)
        module = getattr(trainer, "lightning_module", None)
        if trainer.gradient_clip_val and not (module is not None and _overrides(module, "configure_gradient_clipping")):
            decided["clip_grad_norm"] = float(trainer.gradient_clip_val)
        return reconcile(self.zeroshard_config, decided, {"precision": "precision", "clip_grad_norm": "gradient_clip_val",
                                                       "gradient_accumulation_steps": "accumulate_grad_batches"},
                      "the Lightning Trainer", explicit=self.explicit, agrees=lambda key, value:
                      key == "gradient_accumulation_steps" and value == trainer.accumulate_grad_batches)

    def setup(self, trainer: "pl.Trainer") -> None:
        if self.accelerator is None or self.model is None:  # Lightning connects both before setup
            raise EngineCallError("zeroshard: ZeroShardStrategy.setup before the Trainer connected an accelerator and "
                               "a model: pass the strategy to a lightning Trainer")
        self.accelerator.setup(trainer)
        if self.engine is None:  # the first fit/validate/test/predict makes it; later ones reuse it
            cfg = self._engine_config(trainer)
            self.setup_optimizers(trainer)  # configure_optimizers: the engine adopts the optimizer
            if len(self.optimizers) > 1:
                raise ConfigError(f"zeroshard: configure_optimizers must return one optimizer, not {len(self.optimizers)}")
            optimizer = self.optimizers[0] if self.optimizers else None
            # zeroshard's own precision: no autocast, no GradScaler from Lightning's plugin
            plugin = Precision()
            plugin.precision = self.precision_plugin.precision
            self.precision_plugin = plugin
            compiled = getattr(self.lightning_module, "_compiler_ctx", None)
            if compiled is not None:  # torch.compile(module): compiled the engine's way (module docstring)
                from lightning.pytorch.utilities.compile import to_uncompiled
                to_uncompiled(self.lightning_module)
                cfg = dataclasses.replace(cfg, compile=cfg.compile or True)
            self.engine = zeroshard.initialize(self.lightning_module, optimizer, cfg, device=self.root_device,
                                               example_inputs=self._example_inputs(cfg))
            if compiled is not None:
                self.engine.compile_with(compiled["dynamo_ctx"])
            self.optimizers = [EngineOptimizer(self.engine)] if optimizer is not None else []

    def _example_inputs(self, cfg: Config):
        """offload or stage 'auto' profiles the module's forward: on the LightningModule's own
        `example_input_array` (a tuple: positional arguments, a dict: keyword arguments, else the
        one argument, as Lightning passes it)."""
        if not cfg.planned:
            return None
        example = getattr(self.lightning_module, "example_input_array", None)
        if example is None:
            raise ConfigError("zeroshard: offload/stage 'auto' profiles the LightningModule's forward before "
                             "training: set its example_input_array (one micro-batch as forward takes it, e.g. "
                             "{'input_ids': x, 'labels': x}; only shapes and dtypes are used)")
        return example

    def model_to_device(self) -> None:
        """The engine places the model."""

    # -- a step ----------------------------------------------------------------------------------------
    def _forward(self, method: str, *args, **kwargs):
        return self._forward_redirection(self.engine, self.lightning_module, method, *args, **kwargs)

    def training_step(self, *args, **kwargs):
        module = self.lightning_module
        if not module.automatic_optimization:  # its backwards and steps run inside it (module docstring)
            return self.engine.run_training_step(module.training_step, *args, **kwargs)
        return self._forward("training_step", *args, **kwargs)

    def validation_step(self, *args, **kwargs):
        return self._forward("validation_step", *args, **kwargs)

    def test_step(self, *args, **kwargs):
        return self._forward("test_step", *args, **kwargs)

    def predict_step(self, *args, **kwargs):
        return self._forward("predict_step", *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning calls this around the micro-batches of an accumulation window but the last:
        the engine then reduces once per window (Engine.no_sync)."""
        with self.engine.no_sync():
            yield

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        """Lightning's backward chain: on_before_backward, the module's backward (an override is
        called; Lightning's own is the engine's, whose fp16 loss scaling loss.backward() lacks),
        on_after_backward. The gradients live in the engine's chunks: p.grad is None in the hooks."""
        module = self.lightning_module
        with self.engine.between_forwards("manual_backward()"):
            _hooks(module, "on_before_backward", closure_loss)
            if _overrides(module, "backward"):
                module.backward(closure_loss, *args, **kwargs)
            elif args or kwargs:  # manual_backward(loss, retain_graph=True, ...): autograd's own arguments
                if self.engine.scaler is not None:
                    raise ConfigError("zeroshard: manual_backward with autograd's arguments under fp16: the loss "
                                      "must be scaled (engine.backward takes the loss alone)")
                closure_loss.backward(*args, **kwargs)
            else:
                self.engine.backward(closure_loss)
            _hooks(module, "on_after_backward")
        return closure_loss

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """closure() (training_step and backward), on_before_optimizer_step, an overridden
        configure_gradient_clipping (its clip_gradients is torch's clip_grad_norm_, answered over
        every shard; without an override gradient_clip_val is config clip_grad_norm), the step."""
        result = closure()
        module = self.lightning_module
        _hooks(module, "on_before_optimizer_step", optimizer)
        if module.automatic_optimization and _overrides(module, "configure_gradient_clipping"):  # as Lightning
            trainer = module.trainer
            call._call_lightning_module_hook(trainer, "configure_gradient_clipping", optimizer,
                                             gradient_clip_val=trainer.gradient_clip_val,
                                             gradient_clip_algorithm=trainer.gradient_clip_algorithm)
        self.engine.step()
        self._log_stats()
        return result

    def _log_stats(self) -> None:
        trainer = self.lightning_module.trainer
        if not trainer.loggers or (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1):
            return
        stats = self.engine.stats()
        metrics = {f"zeroshard/{k}": float(stats[k]) for k in (*LOGGED, "grad_norm", "lr") if stats.get(k) is not None}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # -- checkpoints -------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load into it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer states

    def lightning_module_state_dict(self) -> dict:
        return {}  # the model's sharded state is in the engine's checkpoint

    def optimizer_state(self, optimizer) -> dict:
        return {}

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Collective: a directory at `filepath` with the engine's checkpoint and Lightning's state."""
        if storage_options is not None:
            raise TypeError("zeroshard: storage_options are not supported")
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        # ModelCheckpoint may fire inside an accumulation window (on resuming): Lightning's
        # checkpoint is then the state after the last step, without the window's gradients.
        self.engine.save_checkpoint(os.fspath(filepath), tag="state", client_state=_plain(state, "checkpoint"),
                                    omit_pending_grads=True)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Collective: load the engine's checkpoint; returns Lightning's state saved with it."""
        return self.engine.load_checkpoint(os.fspath(checkpoint_path))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Loaded with the engine's checkpoint."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Loaded with the engine's checkpoint."""

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        """Lightning's teardown without moving the module to the CPU (its parameters live in the
        engine's chunks)."""
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()
