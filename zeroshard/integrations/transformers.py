"""The Hugging Face Trainer on zeroshard: `ZeroShardTrainer` is a `transformers.Trainer` whose model
and optimizer run on a zeroshard engine.

    trainer = ZeroShardTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                               zeroshard_config={"stage": 3})
    trainer.train()

What comes from TrainingArguments, as the Trainer does it without zeroshard:
- the optimizer: the Trainer's own (`optim`, `learning_rate`, `weight_decay` with its no-decay
  groups, or `optimizers=(opt, None)`), built over the model's parameters and adopted by the engine,
  which steps this rank's fp32 master pieces with those groups; the LR scheduler
  (`lr_scheduler_type`, warmup) is built on that optimizer, so the rate it sets is the one applied;
- `gradient_accumulation_steps`: the Trainer divides each micro-batch's loss and calls the step
  at the window's end (a short last window included); it runs every micro-batch of a window but
  the last under accelerate's no_sync, which is Engine.no_sync: at stages 0-1 the window's
  gradients are reduced once, at stages 2-3 reduce-scattered per micro-batch; the engine's own
  accumulation count stays 1;
- `max_grad_norm` becomes config `clip_grad_norm` (clipping over every shard, inside the step); the
  logged `grad_norm` is the engine's global norm before clipping;
- `bf16` / `fp16` become config `precision` (zeroshard's mixed precision: fp32 masters, 16-bit
  compute copies, dynamic loss scaling for fp16; no autocast); `ddp_timeout` becomes
  `collective_timeout_s` unless the config sets it;
- `torch_compile` (with `torch_compile_backend`, `torch_compile_mode`) becomes config `compile`
  (runtime/compiled.py: the whole forward in graph segments of a chunk or so, or each layer
  block's, as compile_scope and the rCache say; the hooks outside the graphs), not a
  torch.compile of the engine, whose hooks a graph cannot hold;
- checkpoints (`save_steps`, `save_strategy`): each `checkpoint-N` folder holds the model as
  `save_pretrained` writes it (from_pretrained opens it), and `zeroshard/`, a zeroshard sharded
  checkpoint (fp32 masters, optimizer states, RNG); `resume_from_checkpoint` loads that, at any
  world size or stage, with the scheduler's state and the Trainer's;
- `save_model` writes a folder from_pretrained opens (engine.save_pretrained: streamed, no rank
  holds the model), with the tokenizer and training arguments;
- `evaluate` / `predict` run the engine's forward (stage 3 gathers as in training).
Logged with the Trainer's figures (its loggers: tensorboard, wandb, ...): `zeroshard/<key>` for
each key of integrations.LOGGED (step time, tokens/s, samples/s, skipped steps, model-state and
cache bytes, fp16 loss scale), from engine.stats().
"""
from __future__ import annotations

import dataclasses
import os

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

import zeroshard
from ..config import Config
from . import LOGGED, EngineOptimizer, reconcile

ENGINE_DIR = "zeroshard"  # inside a checkpoint-N folder: the engine's sharded checkpoint


def engine_config(config: Config | dict | str | None, args: transformers.TrainingArguments) -> Config:
    """The engine's config: `config` with what TrainingArguments decide (see the module docstring).
    A config key that contradicts the arguments raises ValueError: set it through them."""
    decided = {"clip_grad_norm": float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None,
               "gradient_accumulation_steps": 1}
    if args.bf16 or args.fp16:  # otherwise the config's precision stands
        decided["precision"] = "bf16" if args.bf16 else "fp16"
    if args.torch_compile:  # otherwise the config's compile stands
        decided["compile"] = {k: v for k, v in (("backend", args.torch_compile_backend),
                                                ("mode", args.torch_compile_mode)) if v is not None}
    cfg = reconcile(config, decided, {"precision": "bf16/fp16", "clip_grad_norm": "max_grad_norm",
                                   "gradient_accumulation_steps": "gradient_accumulation_steps",
                                   "compile": "torch_compile"}, "TrainingArguments",
                 agrees=lambda key, value: key == "gradient_accumulation_steps" and value == args.gradient_accumulation_steps
                 or key == "compile" and value is not False)
    if not (isinstance(config, dict) and "collective_timeout_s" in config) and \
            cfg.collective_timeout_s == Config().collective_timeout_s:  # unless the config sets it
        cfg = dataclasses.replace(cfg, collective_timeout_s=float(args.ddp_timeout))
    return cfg


class ZeroShardTrainer(transformers.Trainer):
    """A Trainer that trains on a zeroshard engine (module docstring). `zeroshard_config`: a
    zeroshard Config, dict or file (stage, offload, chunk size, ...); `zeroshard_weights`: pretrained
    weights to start from, read straight into the shards (zeroshard.initialize's `weights`), e.g.
    for a model built on the meta device. The engine is made at the first train/evaluate/predict."""

    def __init__(self, *args, zeroshard_config: Config | dict | str | None = None, zeroshard_weights=None, **kwargs):
        self.zeroshard_config = zeroshard_config
        self.zeroshard_weights = zeroshard_weights
        self.engine = None
        super().__init__(*args, **kwargs)

    # -- the engine --------------------------------------------------------------------------------
    def _move_model_to_device(self, model, device):
        """The engine places the model (a model on the meta device cannot move before it)."""

    def zeroshard_engine(self):
        """The engine, made on first use over the Trainer's model and optimizer."""
        if self.engine is None:
            optimizer = self.create_optimizer()  # the Trainer's: its groups, lr, weight decay, optim
            cfg = engine_config(self.zeroshard_config, self.args)
            embedding = {id(p) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)
                         for p in m.parameters(recurse=False)}
            self._non_embedding_params = sum(p.numel() for p in self.model.parameters() if id(p) not in embedding)
            self.engine = zeroshard.initialize(self.model, optimizer, cfg, device=self.args.device,
                                               weights=self.zeroshard_weights,
                                               example_inputs=self._example_inputs() if cfg.planned else None)
            self.optimizer = EngineOptimizer(self.engine)
            accelerate_optimizers = getattr(self.accelerator, "_optimizers", None)
            if isinstance(accelerate_optimizers, list):  # so a skipped step does not step the scheduler
                accelerate_optimizers.append(self.optimizer)
            self.model_wrapped = self.engine
        return self.engine

    def _example_inputs(self):
        """One micro-batch as the model is called, for offload or stage 'auto' to profile (only its
        shapes and dtypes are used): the training set's first per_device_train_batch_size examples
        through the Trainer's collator, in order, the RNG left as it was (a collator may mask at
        random). None without a dataset: initialize then says what it needs."""
        dataset = self.train_dataset if self.train_dataset is not None else self.eval_dataset
        if dataset is None or isinstance(dataset, dict):
            return None
        collator = self.data_collator
        if transformers.utils.is_datasets_available():
            import datasets
            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
                return self._first_batch(dataset, collator)
        return self._first_batch(dataset, self._get_collator_with_removed_columns(collator, description="training"))

    def _first_batch(self, dataset, collator):
        loader = torch.utils.data.DataLoader(dataset, batch_size=self.args.per_device_train_batch_size,
                                             collate_fn=collator)
        with torch.random.fork_rng(devices=[]):
            return next(iter(loader), None)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.zeroshard_engine()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        engine = self.zeroshard_engine()
        if self._created_lr_scheduler:  # a second train() builds its schedule again, as the Trainer does
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_scheduler(num_training_steps=max_steps, optimizer=engine.optimizer)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    # -- a step --------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:  # the Trainer's rule: normalised over the window by the model or compute_loss_func
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self.engine.backward(loss)
        return loss.detach()

    def _clip_grad_norm(self, model):
        return None  # the engine clips inside its step, over every shard

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known after the step: _maybe_log_save_evaluate takes the engine's

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        if self.engine is not None:
            grad_norm = self.engine.stats().get("grad_norm")
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.engine is not None and "loss" in logs:  # a training log line
            stats = self.engine.stats()
            logs = {**logs, **{f"zeroshard/{k}": stats[k] for k in LOGGED if stats.get(k) is not None}}
        super().log(logs, *args, **kwargs)

    def floating_point_ops(self, inputs) -> int:
        """As the Trainer counts (6 x tokens x non-embedding parameters), from the sizes the model had
        before its parameters moved into chunks."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if self.engine is None or main not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[main].numel() * self._non_embedding_params

    # -- saving and resuming --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: a folder from_pretrained opens (engine.save_pretrained), with the tokenizer
        (or processor) and the training arguments."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR), tag="state")
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save_scaler(self, output_dir: str) -> None:
        """fp16 loss scaling is the engine's: in its checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_DIR)):
            return  # the engine's checkpoint is loaded whole in _prepare_for_training
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, ENGINE_DIR)
        if not os.path.isdir(state):
            raise zeroshard.CheckpointError(f"zeroshard: {checkpoint} has no {ENGINE_DIR}/ checkpoint of the engine "
                                            "(saved without zeroshard, or with save_only_model)")
        self.engine.load_checkpoint(state)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_scaler(self, checkpoint) -> None:
        """In the engine's checkpoint."""

    def _load_best_model(self) -> None:
        path = os.path.join(self.state.best_model_checkpoint, ENGINE_DIR)
        if self.engine is None or not os.path.isdir(path):
            return super()._load_best_model()
        self.engine.load_checkpoint(path, load_optimizer=False)
