"""The engine: applies ZeRO data parallelism to an unmodified nn.Module and conducts one training step.

Data path: model -> profile and plan (planner.py, with offload="auto") -> chunks (chunks.py:
parameters packed in order of first use, sharded) -> hooks (hooks.py: stage-3 gathers through the
rCache, cache.py; saved tensors) -> gradients into chunks, reduced as each completes (reducer.py) ->
ShardedOptimizer (optimizer.py: fp32 masters of owned ranges, on the device or the host, offload.py)
-> parameters pushed back -> checkpoint.py. The engine owns the wiring and the training phase
(TrainingPhase); each of those modules owns its own state.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import weakref

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from .runtime.cache import ChunkCache
from .runtime.chunks import Chunk, auto_chunk_size
from .distributed.collectives import Comm, default_device, init_process_group
from .config import Config
from .errors import invariant
from .runtime.arrival import ArrivalHooks
from .runtime.hooks import Stage3Hooks, weak_method
from .units import direct_params, leaf_modules
from .runtime.layout import ChunkLayout, list_parameters, resolve_state
from .runtime.materialize import InitialValues
from .runtime.module_state import (StateDictLoading, full_parameters, guard_grad_readers, guard_moves, route_zero_grad,
                           sync_generation)
from .runtime.offload import Placement, Transfer
from .distributed.ordering import STEP, waiting
from .optim.loss_scale import LossScaler
from .optim.optimizer import ShardedOptimizer, as_factory, default_optimizer
from .planning.auto_plan import plan_for, profiled_sequence
from .runtime.precision import InputCasts, cast_buffers
from .runtime.reducer import GradientReducer
from .runtime.saved_tensors import SavedTensorHooks
from .telemetry.stats import StepMeter, describe_step, model_state_bytes, step_stats
from .distributed.tensor_parallel import TensorParallel, local_grad, local_shape
from .runtime.partitioned_activations import PartitionedActivations
from .telemetry.timeline import MemoryTimeline

log = logging.getLogger("zeroshard")


class TrainingPhase(enum.Enum):
    """Where the engine is in a training step: each entry point checks it, so a call out of order
    (a step inside backward, a forward after an interrupted backward) raises."""

    IDLE = "idle"  # between calls
    FORWARD = "forward"  # inside engine(...)
    BACKWARD = "backward"  # from engine.backward (or the first gradient of loss.backward()) to its end
    STEP = "step"  # inside engine.step()
    FULL_PARAMETERS = "full parameters"  # inside `with engine.full_parameters()`


class Engine:
    """Trains `module` with ZeRO data parallelism. Build it with `zeroshard.initialize`."""

    def __init__(self, module: nn.Module, optimizer, config: Config, device: torch.device | None = None,
                 example_inputs=None, weights=None, init_fn=None):
        # Named steps, in order: each leaves the engine ready for the next (FSDP2's fully_shard
        # and torchtitan's parallelize steps read the same way).
        self.module = module
        self._join_world(config, device)
        config = self._plan(module, optimizer, config, example_inputs)
        self._set_counters()
        start = self._read_model(module, config, weights, init_fn)
        self._make_parts(optimizer, config)
        self._pack(start)
        del start  # the weights' reader and any values it held: free before the hooks go on
        self._install_hooks(module, config)
        self._follow_schedule()

    def _join_world(self, config: Config, device: torch.device | None) -> None:
        """The device, the process group, tensor parallelism and the Comms over them."""
        self.device = device or default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_process_group(self.device, config.collective_timeout_s)
        self.tp = None  # the tensor-parallel side (tensor_parallel.py); ZeRO runs over its "dp" group
        if config.tensor_parallel > 1:
            self.tp = TensorParallel(self.module, config.tensor_parallel, self.device)
        self.comm = Comm(self.device, group=self.tp.dp_group if self.tp else None)
        # Every rank, TP peers included: what one rank decides or fails at (a plan, an unreadable
        # file) reaches them all, so none goes on alone.
        self.world_comm = self.tp.world_comm if self.tp else self.comm
        self.transfer = Transfer(self.device)
        # Modules stage 3 gathers whole (units.py): mixture-of-experts blocks, or the config's
        self.leaves = leaf_modules(self.module, config.leaf_modules)

    def _plan(self, module: nn.Module, optimizer, config: Config, example_inputs) -> Config:
        """offload/stage 'auto': profile and plan; returns the config that runs."""
        self.plan = self.profile = None
        if config.planned:
            self.plan, self.profile = plan_for(module, example_inputs, as_factory(optimizer), config, self.device,
                                                self.comm, self.world_comm, leaves=self.leaves)
            # The config that runs: what the plan chose (its placement per chunk is applied below).
            config = dataclasses.replace(config, offload=False, **self.plan.config())
        self.zeroshard_config = config  # not `config`: that name falls through to the model's (HF's config)
        self.placement = Placement(optimizer_on_host=config.offload_optimizer,
                                   params_on_host=config.offload_params)
        self.dtype = config.dtype
        self.stage = config.stage
        return config

    def _set_counters(self) -> None:
        self.phase = TrainingPhase.IDLE
        self.micro_steps = 0
        self.grads_pending = False  # a backward ran whose gradients no step() has applied or dropped
        self._sync = True  # False inside no_sync()
        self.steps = 0
        self._stats = {}
        self.meter = StepMeter()
        self._step_hooks = collections.OrderedDict()  # RemovableHandle needs a weakly referable dict
        self.timeline = None  # a MemoryTimeline while record_memory() is on

    def _read_model(self, module: nn.Module, config: Config, weights, init_fn) -> InitialValues:
        """The parameters, their first values (weights, initialisers, or as built), buffers' dtype."""
        self.params, self.names = list_parameters(module)
        self.shapes = {id(p): local_shape(p) for p in self.params}  # what this rank stores of each
        start = InitialValues(module, self.params, weights, init_fn, config.init_seed,
                              config.allow_nonfinite_weights)
        if self.tp is not None:
            self.tp.sync_replicated(self.params)
        start.check(self.world_comm)  # collective: a file a rank cannot read raises on every rank
        cast_buffers(module, self.dtype, config.buffer_dtype)
        self.state_keys = resolve_state(module, self.device)
        self._casts = InputCasts(module, self.dtype) if self.dtype != torch.float32 and config.cast_forward_inputs \
            else None
        return start

    def _make_parts(self, optimizer, config: Config) -> None:
        """The layout, rCache, reducer, loss scaler and sharded optimizer (no chunk built yet)."""
        numels = [p.numel() for p in self.params]
        cap = auto_chunk_size(numels) if config.chunk_size == "auto" else config.chunk_size
        placement_of = (lambda i: self.placement) if self.plan is None else (lambda i: self.plan.placement(i, self.stage))
        self.layout = ChunkLayout(self.names, self.shapes, stage=self.stage, comm=self.comm, dtype=self.dtype,
                                  device=self.device, transfer=self.transfer, capacity=max(cap, max(numels)),
                                  placement_of=placement_of,  # the config's placement, or the plan's per chunk
                                  grad_dtype=config.grad_dtype)
        self.cache = ChunkCache(self.comm, config.cache_chunks, config.prefetch)
        self.reducer = GradientReducer(self.comm, self.stage, config.gradient_accumulation_steps)
        self.scaler = LossScaler(config.initial_loss_scale, config.loss_scale_window) if config.precision == "fp16" else None
        host = config.offload_optimizer or (self.plan is not None and any(self.plan.optimizer_on_host))
        self._delayed = config.delay_update_after is not None
        self.optim = ShardedOptimizer(optimizer or default_optimizer(host=host), self.comm, param_names=self.names,
                                      stage=self.stage, dtype=self.dtype,
                                      accumulation=config.gradient_accumulation_steps,
                                      clip_grad_norm=config.clip_grad_norm, scaler=self.scaler,
                                      delay_after=config.delay_update_after,
                                      side_comm=self.comm.side_channel() if self._delayed else None,
                                      nonfinite=config.nonfinite, measure_norm=config.grad_norm)
        if config.check_order:
            self.comm.enable_order_checks()

    def _pack(self, start: InitialValues) -> None:
        """The chunks, packed in first-use order (profiled, or as listed until the first step), and
        filled with the first values."""
        order = self.params if self.profile is None else [self.params[i] for i in self.profile.first_use]
        self.layout.build(order, start.fill, broadcast=start.broadcast)
        start.finish(self.world_comm, self.params, self.chunks, self.device)
        self.cache.set_chunks(self.chunks)
        self.optim.attach(self.chunks)

    def _install_hooks(self, module: nn.Module, config: Config) -> None:
        """Stage-3 hooks, the module's own API (zero_grad, generate, moves, load_state_dict), the
        stage 1-2 arrival hooks, gradient hooks and saved-tensor hooks."""
        self.hooks = None
        if self.stage == 3:
            if self.leaves and self.comm.rank == 0:
                log.info("stage 3 gathers these modules whole (leaf_modules): %s",
                         ", ".join(sorted({type(m).__name__ for m in self.leaves})))
            self.hooks = Stage3Hooks(module, self.cache, self.layout.chunks_of, self.names, self.shapes, self.dtype,
                                     on_borrow=self.layout.forget, leaves=self.leaves,
                                     on_leaf_backward=weak_method(self._leaf_backward_done))
            hooks = self.hooks
            self.layout.read_params_with(lambda m: hooks.params_of(m) if hooks.is_unit(m) else direct_params(m))
            self.reducer.count_at_leaf_end(p for leaf in self.leaves for _, p in self.hooks.params_of(leaf))
        route_zero_grad(module, weak_method(self.zero_grad))
        if (self.stage == 3 and self.comm.world > 1) or self.tp is not None:  # a forward is a collective
            sync_generation(module)
        guard_moves(module, lambda layout=self.layout: layout.chunks)
        guard_grad_readers(list(self.params) + ([t for ts in self.hooks.placeholders.values() for _, t in ts]
                                                if self.hooks else []))
        layout = self.layout  # the hooks below live on the module: no reference to the engine itself
        self.loading = StateDictLoading(module, self.hooks.direct_real if self.hooks else direct_params,
                                        lambda: layout.slot_of, self.hooks, weak_method(self._before_load))
        self._arrivals = ArrivalHooks(module, self.layout.chunks_of) \
            if self.stage in (1, 2) and (self.comm.world > 1 or self._delayed) else None
        if self._arrivals is not None:  # its guard must not outlive the engine on the mode stack
            weakref.finalize(self, self._arrivals.settle)
        # A dropped engine must not live on in autograd: a weak method. Parameters unfrozen later get
        # it then (_follow_requires_grad).
        self._grad_arrived_hook = weak_method(self._grad_arrived)
        self._unhooked = [p for p in self.params if not p.requires_grad]
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_arrived_hook)
        # The prefetch schedule is recorded over the first micro-batch that runs entirely on the
        # final packing (layout.py: chunks are re-packed in order of first use after the first).
        self.layout.record_first_use(module, self.leaves)
        partition = PartitionedActivations(self.tp.comm, self.transfer, config.offload_activations) \
            if config.partition_activations else None
        self.saved = SavedTensorHooks(self.device, self.transfer, self.hooks, lambda: self.chunks,
                                      config.offload_activations, partition)

    def _follow_schedule(self) -> None:
        """Record the chunk sequence over the first micro-batch, or follow the profiled one."""
        self.cache.restart_recording()
        self._micro_layout_final = False
        if self.profile is not None:  # packed in profiled first-use order; follow the profiled schedule
            self.fix_layout()
            self.cache.set_schedule(profiled_sequence(self.profile, self.module, self.layout.chunks_of))
            log.info("%s", self.plan.describe())

    def __getattr__(self, name: str):
        """What the engine lacks comes from the module (as DeepSpeed's): `engine.config`, `.generate()`."""
        if "module" not in self.__dict__ or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(self.module, name)

    @property
    def chunks(self) -> list[Chunk]:
        return self.layout.chunks

    # -- training API -----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.phase is TrainingPhase.BACKWARD:  # a plain loss.backward() raised half-way
            log.warning("the previous backward was interrupted; its reductions are abandoned")
            self._abandon_backward()
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: forward called while the engine is in {self.phase.value}")
        if torch.is_grad_enabled():
            self._follow_requires_grad()
        self.comm.at(pass_index=self.micro_steps)
        self.phase = TrainingPhase.FORWARD
        if torch.is_grad_enabled() and self.module.training:
            self.meter.forward(args, kwargs)
        try:
            with self._waits("run the forward"):
                return self._forward(*self._to_device((args, kwargs)))
        finally:
            self.phase = TrainingPhase.IDLE

    def _forward(self, args, kwargs):
        recording = self.layout.recorder is not None and self.module.training and torch.is_grad_enabled()
        self._micro_layout_final = self.layout.final
        if self.hooks is not None:
            self.hooks.close_open_forwards()
            self.cache.rewind()  # every forward (micro-batch or evaluation) replays the schedule
        tracking = self.timeline is not None and self.timeline.recording
        if torch.is_grad_enabled() and self.saved.needed(self.timeline):
            with self.saved.around_forward(self.timeline, by_reference=self._micro_layout_final):
                out = self.module(*args, **kwargs)
        else:
            out = self.module(*args, **kwargs)
        if recording:  # re-pack in order of first use, rank 0's on every rank
            self.fix_layout(self.layout.first_use_order(self.params))
        if tracking:
            self.timeline.sample("forward")
        self._settle()  # chunks this forward did not use
        return out

    forward = __call__

    def thaw(self, names=frozenset()) -> None:
        """Make trainable the frozen chunks holding a parameter that now requires a gradient, or
        one named in `names` (a checkpoint holding its optimizer state); a delayed update in flight
        lands first."""
        chunks = self.layout.unfrozen(names)
        if chunks:
            self.apply_delayed_update()
            self.layout.thaw(chunks)
            self.optim.adopt(self.chunks, chunks)

    def _follow_requires_grad(self) -> None:
        """Gradual unfreezing: a parameter set to require a gradient since initialize trains from
        this forward on, as in torch. Its chunk, if frozen, becomes trainable (Chunk.make_trainable;
        a delayed update in flight lands first) and the optimizer starts stepping it with no state;
        its gradients go into the chunk. Freezing again needs nothing: no gradient, no step."""
        new = [p for p in self._unhooked if p.requires_grad]
        if not new:
            return
        self.thaw()
        for p in new:
            p.register_post_accumulate_grad_hook(self._grad_arrived_hook)
        self._unhooked = [p for p in self._unhooked if not p.requires_grad]

    def fix_layout(self, order: list[nn.Parameter] | None = None) -> None:
        """Make the chunk layout final: re-pack the chunks in `order` if that differs, then stop
        recording first use. Re-packing needs an optimizer with no state."""
        if self.layout.final:
            return
        if order is not None and self.layout.differs(order):
            self.cache.flush()
            self.layout.repack(order)
            self.cache.set_chunks(self.chunks)
            self.optim.attach(self.chunks)
        self.layout.finalize()

    def _to_device(self, tree):
        """Inputs onto the device, floating ones in the compute dtype, through any pytree container."""
        cast = lambda x: x.to(self.dtype) if x.is_floating_point() else x  # noqa: E731
        return tree_map_only(torch.Tensor, lambda x: cast(x).to(self.device, non_blocking=True), tree)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (the mean loss of this rank's micro-batch). `loss.backward()` does the
        same except with fp16, whose loss scaling needs this method."""
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: backward() called while the engine is in {self.phase.value} (an "
                               "earlier backward was interrupted, or backward was called inside forward)")
        self.meter.loss(loss)
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        self._begin_backward()
        try:
            with self._waits("run the backward"):
                loss.backward()
        except BaseException:
            self._abandon_backward()
            raise
        if self.phase is TrainingPhase.BACKWARD:  # not ended by autograd's callback (see _grad_arrived)
            self._end_backward()

    def _waits(self, doing: str):
        """Around an entry point: a peer lost in a collective zeroshard does not issue itself (the
        model's own tensor-parallel collectives, transformers' synced generation) raises
        PeerLostError naming it too (ordering.waiting)."""
        return waiting(lambda: f"{doing} of micro-batch {self.micro_steps} at optimizer step {self.comm.step}",
                       self.comm.timeout_s)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside it accumulate gradients without reducing them (DDP's no_sync):
        at stages 0-1 each rank keeps its own sum until the first backward outside it, or the step,
        reduces them once, so an accumulation window of N micro-batches costs one reduction, not N.
        Stages 2-3 keep only their shard of the gradient, so they reduce-scatter in every backward
        inside it too. The HF Trainer (through accelerate) and Lightning call it for every
        micro-batch of a window but the last; the engine's own gradient_accumulation_steps does the
        same without it."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _begin_backward(self, by_autograd: bool = False) -> None:
        if by_autograd:  # the first gradient of a plain `loss.backward()`
            if self.scaler is not None:
                raise RuntimeError("zeroshard: with precision 'fp16' call engine.backward(loss), not "
                                   "loss.backward(): the loss must be scaled (dynamic loss scaling)")
            if self.phase is not TrainingPhase.IDLE:
                raise RuntimeError(f"zeroshard: a backward started while the engine is in {self.phase.value}")
            # Autograd runs this once the whole backward pass is done, before backward() returns.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        invariant(self.phase is TrainingPhase.IDLE, lambda: f"a backward began in {self.phase}")
        self.phase = TrainingPhase.BACKWARD
        self.comm.at(pass_index=self.micro_steps)
        self.reducer.begin(self.chunks, self.micro_steps, sync=self._sync)

    def _set_steps(self, steps: int) -> None:
        """Optimizer steps applied so far; errors name the one being worked towards (comm.step)."""
        self.steps = steps
        self.comm.at(step=steps + 1)

    def restore_counters(self, steps: int) -> None:
        """A checkpoint's step count, at an accumulation boundary (micro-batches count afresh)."""
        self._set_steps(steps)
        self.micro_steps = 0

    def _abandon_backward(self) -> None:
        """A backward raised: drop its reductions so the engine can go on. Gradients it already
        accumulated stay, as they would in torch's .grad; if other ranks finished that backward,
        this rank is now a micro-batch behind, and the next order check raises DivergedError."""
        if self.hooks is not None:
            self.hooks.end_backward()
        self.reducer.abandon(self.chunks)
        self.phase = TrainingPhase.IDLE

    def _end_backward(self) -> None:
        invariant(self.phase is TrainingPhase.BACKWARD, lambda: f"a backward ended in {self.phase}")
        if self.hooks is not None:
            self.hooks.end_backward()
        self.reducer.end(self.chunks)
        self.micro_steps += 1
        self.grads_pending = True
        self.phase = TrainingPhase.IDLE
        if self.timeline is not None:
            self.timeline.sample("backward")
        if self.cache.recording and self._micro_layout_final:
            self.cache.stop_recording()
        elif self.cache.recording:
            self.cache.restart_recording()

    def _grad_arrived(self, p: nn.Parameter) -> None:
        if self.phase is not TrainingPhase.BACKWARD:
            self._begin_backward(by_autograd=True)
        self.comm.progress()  # reductions whose order check came back start now
        chunk, slot = self.layout.slot_of[id(p)]
        self.reducer.add(chunk, slot, local_grad(p, p.grad))
        p.grad = None
        if self.timeline is not None:  # before finishing reductions: the most gradient buffers held
            self.timeline.sample("backward", slot.name)
        self.reducer.start_complete()
        if self.hooks is not None:
            self.hooks.grad_arrived(p)

    def _leaf_backward_done(self, params) -> None:
        """Stage 3: the gradient went back through a leaf unit: its parameters count as arrived,
        with a gradient or without (GradientReducer.count_at_leaf_end)."""
        if self.phase is not TrainingPhase.BACKWARD:
            return
        for p in params:
            chunk, slot = self.layout.slot_of[id(p)]
            if chunk.trainable:
                self.reducer.leaf_done(chunk, slot)
        self.reducer.start_complete()

    def step(self) -> bool:
        """At the end of a gradient accumulation window, apply the update and clear gradients.
        Returns True when an update was applied (False between boundaries, or when a non-finite
        gradient skipped it: fp16 overflow, config nonfinite='skip'; nonfinite='raise' raises
        NonFiniteError instead)."""
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: step() called while the engine is in {self.phase.value}")
        if not self.grads_pending or self.micro_steps % self.zeroshard_config.gradient_accumulation_steps:
            return False  # no backward since the last step: torch changes no parameter without a .grad
        self.comm.agree(STEP)  # a rank a micro-batch or a step apart raises here or in its peers' hooks
        self._settle()  # the last update's all-gathers write the storage this update steps
        self.phase = TrainingPhase.STEP
        try:
            with self._waits("run the optimizer step after"):
                if self.reducer.unreduced:  # the window's last backward ran under no_sync()
                    self.comm.at(pass_index=self.micro_steps)
                    self.reducer.reduce_unreduced(self.chunks)
                applied = self.optim.step()
        finally:  # nothing of a step's gradients, failed or not, carries into the next one
            self.phase = TrainingPhase.IDLE
            self.optim.zero_grads()
            self.reducer.cleared()
            self.grads_pending = False
        if self.stage == 3:
            self.cache.flush()
        if self._arrivals is not None:
            self._arrivals.arm(self.chunks)
        self._set_steps(self.steps + int(applied))
        self._stats = step_stats(self, applied, self.meter.finish(self.comm.world, self.optimizer))
        if self.timeline is not None:
            self.timeline.step_done()
        every = self.zeroshard_config.log_every
        if every and self.comm.rank == 0 and self.optim.boundaries % every == 0:
            log.info("%s", describe_step(self._stats))
        for hook in list(self._step_hooks.values()):
            hook(self, self.stats())
        return applied

    def apply_delayed_update(self) -> None:
        """With `delay_update_after`: apply the update in flight now (checkpoints and state dicts do
        this first; call it before evaluating or exporting the model by other means)."""
        self.optim.land()
        self._settle()

    def _before_load(self) -> bool:
        """model.load_state_dict is about to write parameters (module_state.py): whether its hooks
        should write the chunks (not inside full_parameters(), whose exit writes them back)."""
        if self.phase is TrainingPhase.FULL_PARAMETERS:
            return False
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: load_state_dict called while the engine is in {self.phase.value}")
        self.apply_delayed_update()
        if self.stage == 3:
            self.cache.flush()
        return True

    def _settle(self) -> None:
        """Wait for every chunk still arriving (ArrivalHooks)."""
        if self._arrivals is not None:
            self._arrivals.settle()
        self.optim.await_arrivals()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last step, as optimizer.zero_grad() does in torch
        (step() clears them itself). `model.zero_grad()` on the wrapped model calls this."""
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: zero_grad() called while the engine is in {self.phase.value}")
        if self.grads_pending or any(c.slots_with_grad for c in self.optim.chunks):
            self.optim.zero_grads()
            self.reducer.cleared()
            self.grads_pending = False

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optim.optimizer

    # -- state and numbers ---------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets the model's own state_dict keys with full fp32 parameter
        values (and buffers as they are), on the CPU."""
        from .state.checkpoint import full_state_dict
        return full_state_dict(self)

    def load_weights(self, path, strict: bool = True):
        """Collective: load pretrained weights (a Hugging Face folder: model.safetensors or a sharded
        model.safetensors.index.json; a .safetensors file; a `zeroshard export` output) into the
        masters and compute copies, each rank reading only the ranges it keeps (pretrained.py).
        Keys are matched as load_state_dict matches them (tied weights, transformers' ignorable keys
        and base-model prefix included); with `strict`, anything missing or unexpected, and always a
        shape mismatch, raises WeightsError on every rank before anything is written. Optimizer state
        is left as it is, as load_state_dict leaves it. Returns the match (`.missing`, `.unexpected`)."""
        from .state.pretrained import load_weights
        if not self._before_load():
            raise RuntimeError("zeroshard: load_weights inside full_parameters(); load after it")
        return load_weights(self, path, strict)

    def save_pretrained(self, path, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                        submodule: str = "") -> str:
        """Collective: write the model as a folder `from_pretrained` opens: its weights as
        model.safetensors, or files of at most `max_shard_size` (bytes, or '5GB') with
        model.safetensors.index.json, and the model's transformers config. Values are the fp32
        masters (`dtype` converts floating ones), tied weights written once; streamed a chunk at a
        time, file i written by rank i mod world, so no rank holds the model (pretrained.py).
        `submodule`: write only that submodule (e.g. "model", the transformers model inside a
        LightningModule), its keys without the prefix, with its config. A peft model (LoRA) writes
        its adapters in peft's own format instead, gathering only the chunks that hold them
        (PeftModel.from_pretrained opens the folder). Returns the folder."""
        from .state.pretrained import save_pretrained
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: save_pretrained called while the engine is in {self.phase.value}")
        self.apply_delayed_update()
        if self.stage == 3:
            self.cache.flush()
        return save_pretrained(self, path, max_shard_size, dtype, submodule)

    def save_checkpoint(self, root, tag: str | None = None, client_state: dict | None = None,
                        keep: int | None = None, omit_pending_grads: bool = False) -> str:
        """Collective: save everything training needs to resume, and `client_state` (rank 0's dict),
        as checkpoint `tag` (default `step<N>`) in directory `root`, atomically; saving to an
        existing tag writes a new version, which readers see whole or not at all (checkpoint.py).
        With tensor parallelism, each TP rank's local shards go to root/tp<r>-of-<N>.
        `keep`: then remove all but the newest `keep` checkpoints in root. Call it after step():
        gradients accumulated since the last step would not be in it, so it raises CheckpointError
        then, unless `omit_pending_grads` (the state as of the last step is saved and the gradients
        stay in memory, as Lightning's checkpoints mid-window do). Returns the checkpoint's path."""
        from .state.checkpoint import save
        if self.tp is not None:  # each TP rank's data-parallel group saves its local shards apart
            root = self.tp.checkpoint_root(root)
        return save(self, root, tag, client_state, keep, omit_pending_grads)

    def load_checkpoint(self, path, tag: str | None = None, load_optimizer: bool = True) -> dict:
        """Collective: load a checkpoint (a root or a checkpoint directory) into this engine, after
        checking its files, model and optimizer (CheckpointError before anything changes otherwise).
        With tensor parallelism, a checkpoint of the same TP degree (any data-parallel size, stage
        or chunk size). Returns the saved `client_state` ({} if none)."""
        from .state.checkpoint_load import load
        if self.tp is not None:
            path = self.tp.checkpoint_path(path)
        return load(self, path, tag, load_optimizer)

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = True):
        """Collective context manager: inside it every parameter of the module holds its whole fp32
        value (from the masters), at every stage, so the module's own API works as on an unwrapped
        model: `model.state_dict()`, `save_pretrained`, reading or editing weights in place. On exit,
        with `writeback`, the values are written back into the masters and the compute copies (as
        `model.load_state_dict` writes them). Holds the whole model in fp32 on every rank while open;
        no forward, backward or step inside it (FSDP's summon_full_params, DeepSpeed's
        GatheredParameters)."""
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: full_parameters() entered while the engine is in {self.phase.value}")
        with full_parameters(self, writeback):
            self.phase = TrainingPhase.FULL_PARAMETERS
            try:
                yield
            finally:
                self.phase = TrainingPhase.IDLE

    def record_memory(self, steps: int | None = 1) -> MemoryTimeline:
        """Record this rank's memory (bytes, by kind: timeline.py) over the next `steps` optimizer
        steps (None: until `.stop()`). Returns the timeline (also `engine.timeline`)."""
        if self.timeline is not None:
            self.timeline.stop()
        self.timeline = MemoryTimeline(self, steps)
        return self.timeline

    def model_state_bytes(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes of model states this rank keeps between steps, by kind and by device (stats.py)."""
        return model_state_bytes(self.chunks, self.optim)

    def stats(self) -> dict:
        """Figures of the last optimizer step, key by key in stats.py."""
        return dict(self._stats)

    def register_step_hook(self, hook) -> torch.utils.hooks.RemovableHandle:
        """`hook(engine, stats)` runs on every rank after each step() at an accumulation boundary
        (applied or skipped), with that step's stats(): for a logger (`handle.remove()` stops it)."""
        handle = torch.utils.hooks.RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = hook
        return handle
