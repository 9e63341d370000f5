"""The engine: applies ZeRO data parallelism to an unmodified nn.Module and conducts one training step.

Data path: model -> profile and plan (planning/, with offload="auto") -> chunks (runtime/chunks.py:
parameters packed in order of first use, sharded) -> hooks (runtime/hooks.py: stage-3 gathers through
the rCache; saved tensors) -> gradients into chunks, reduced as each completes (runtime/reducer.py) ->
ShardedOptimizer (optim/: fp32 masters of owned ranges, on the device, the host or the disk tier) -> parameters pushed
back -> state/ (checkpoints). assembly.py builds the parts in named steps; engine_io.py holds the
methods that move state in and out. The engine owns the wiring and the training phase (TrainingPhase);
each part owns its own state.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import weakref

import torch
import torch.nn as nn

from .assembly import EngineCalls, compile_units, install_hooks, join_world, make_parts, pack, plan, read_model
from .engine_forward import EngineForward, runs_between_forwards
from .engine_io import EngineIO, TrainingPhase
from .config import Config
from .distributed.ordering import STEP, waiting
from .distributed.tensor_parallel import local_grad
from .errors import EngineCallError, GradientsInChunksError, invariant
from .optim.user_calls import refuse_clip_call, refuse_grads_set_by_hand, route_optimizer_calls
from .planning.auto_plan import profiled_sequence
from .runtime.chunks import Chunk
from .runtime.compiled import calls_without_kv_cache, torch_compiler
from .runtime.weak_calls import weak_method
from .telemetry.stats import StepMeter, describe_step, step_stats
from .units import refuse_forward_writes, refuse_untrainable

log = logging.getLogger("zeroshard")


class Engine(EngineForward, EngineIO):
    """Trains `module` with ZeRO data parallelism. Build it with `zeroshard.initialize`."""

    def __init__(self, module: nn.Module, optimizer, config: Config, device: torch.device | None = None,
                 example_inputs=None, weights=None, init_fn=None):
        # Named steps, in order (assembly.py): each takes what it needs and returns what it made.
        self.module = module
        refuse_untrainable(module)
        world = join_world(module, config, device)
        self.device, self.tp, self.comm, self.world_comm = world.device, world.tp, world.comm, world.world_comm
        self.shards, self.transfer = world.shards, world.transfer
        planned = plan(module, optimizer, config, example_inputs, world)
        config, self.plan, self.profile = planned.config, planned.plan, planned.profile
        refuse_forward_writes(module, config.stage, world.comm.world)  # the stage, once 'auto' chose it
        world = compile_units(module, config, world, planned)
        self.leaves = world.leaves
        self.zeroshard_config = config  # not `config`: that name falls through to the model's (HF's config)
        self.dtype, self.stage = config.dtype, config.stage
        self._set_counters()
        model, start = read_model(module, config, world, weights, init_fn)
        self.params, self.names, self.shapes, self.state_keys = model.params, model.names, model.shapes, model.state_keys
        self._casts = model.casts
        parts = make_parts(optimizer, config, planned, world, model)
        self.layout, self.cache, self.reducer, self.scaler, self.optim = \
            parts.layout, parts.cache, parts.reducer, parts.scaler, parts.optim
        pack(parts, model, start, planned, world)
        self.optim.on_state_load(weak_method(self._before_optimizer_load))
        # a plain loop's optimizer.step() / zero_grad() are the engine's (optim/user_calls.py)
        route_optimizer_calls(self.optimizer, weak_method(self.step), weak_method(self.zero_grad),
                              weak_method(self._stepping))
        del start  # the weights' reader and any values it held: free before the hooks go on
        # The hooks live on the module and in autograd: they call the engine through weak methods,
        # so a dropped engine does not live on in them.
        on = EngineCalls(*map(weak_method, (self.zero_grad, self._leaf_backward_done, self._before_load,
                                            self._grad_arrived, self._owned, self._clip_grad_norm,
                                            self._params_written)))
        installed = install_hooks(module, config, world, model, parts, on)
        self.hooks, self.loading, self._arrivals, self.saved, self._grad_readers, self._watch = (
            installed.hooks, installed.loading, installed.arrivals, installed.saved, installed.grad_readers, installed.watch)
        self._grad_arrived_hook = on.grad_arrived
        self._unhooked = installed.unhooked  # frozen parameters: hooked when unfrozen (_follow_requires_grad)
        # The forward's bracket (engine_forward.py), opened first: a unit's own pre-hook must see
        # the chunks as thawed; closed after the units' hooks, even where the forward raised.
        module.register_forward_pre_hook(weak_method(self._forward_begins), prepend=True, with_kwargs=True)
        module.register_forward_hook(weak_method(self._forward_ends), with_kwargs=True, always_call=True)
        self._hook_direct_calls(module)
        if self._arrivals is not None:  # its guard must not outlive the engine on the mode stack
            weakref.finalize(self, self._arrivals.settle)
        if self.optim.tier is not None:  # the tier's files go with the engine, or at a normal exit
            weakref.finalize(self, self.optim.tier.close)
        if self.layout.shard_tier is not None:
            weakref.finalize(self, self.layout.shard_tier.close)
        self._compiler = torch_compiler(config.compile)
        self.compiled = None  # the modules whose forward is compiled, once it is (runtime/compiled.py)
        if self._compiler is not None:
            calls_without_kv_cache(module)
        self._follow_schedule()

    def _set_counters(self) -> None:
        self.phase = TrainingPhase.IDLE
        self.micro_steps = 0
        self.grads_pending = False  # a backward ran whose gradients no step() has applied or dropped
        self._sync = True  # False inside no_sync()
        self._open = None  # the forward open now (engine_forward.OpenForward)
        self._root_called = False  # the root's forward ran (config compile compiles it whole only then)
        self._warned_callers_hooks = False
        # the pass under way (engine_forward.py's Note: forwards of one pass): None, or whether its
        # first forward recording gradients ran in train mode; and whether any forward recorded
        # gradients since the last backward or step
        self._end_pass()
        self.steps = 0
        self._stats = {}
        self.meter = StepMeter()
        self._step_hooks = collections.OrderedDict()  # RemovableHandle needs a weakly referable dict
        self.timeline = None  # a MemoryTimeline while record_memory() is on

    def _follow_schedule(self) -> None:
        """Record the chunk sequence over the first micro-batch, or follow the profiled one."""
        self.cache.restart_recording()
        self._micro_layout_final = False  # the layout was final as this pass's first forward began
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
    @runs_between_forwards
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (the mean loss of this rank's micro-batch). `loss.backward()` does the
        same except with fp16, whose loss scaling needs this method."""
        self._close_stale_forward()
        if self.phase is not TrainingPhase.IDLE:
            raise EngineCallError(f"zeroshard: backward() called while the engine is in {self.phase.value} (an "
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
        if self.optim.clip_pending:
            raise GradientsInChunksError(
                "zeroshard: a backward after torch.nn.utils.clip_grad_norm_ and before the step: the clipping "
                "applies at the step, to the gradients it measured; call it after the window's last backward")
        if by_autograd:  # the first gradient of a plain `loss.backward()`
            if self.scaler is not None:
                raise EngineCallError("zeroshard: with precision 'fp16' call engine.backward(loss), not "
                                   "loss.backward(): the loss must be scaled (dynamic loss scaling)")
            if self._open is not None and self._open.step_function:
                # its forward would reopen inside autograd's callback, whose thread state (the
                # saved-tensor hooks) autograd restores after it
                raise EngineCallError("zeroshard: loss.backward() inside a training step function (Lightning's "
                                      "manual optimization): call self.manual_backward(loss), or the backward "
                                      "inside engine.between_forwards()")
            self._close_stale_forward()  # a module called directly that raised (engine_forward.py)
            if self.phase is not TrainingPhase.IDLE:
                raise EngineCallError(f"zeroshard: a backward started while the engine is in {self.phase.value}")
            # Autograd runs this once the whole backward pass is done, before backward() returns.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        invariant(self.phase is TrainingPhase.IDLE, lambda: f"a backward began in {self.phase}")
        self.phase = TrainingPhase.BACKWARD
        self.shards.at(pass_index=self.micro_steps)
        self.reducer.begin(self.chunks, self.micro_steps, sync=self._sync, scale=self.optim.arrival_scale)

    def _set_steps(self, steps: int) -> None:
        """Optimizer steps applied so far; errors name the one being worked towards (comm.step)."""
        self.steps = steps
        self.shards.at(step=steps + 1)

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
        self._end_pass()

    def _end_backward(self) -> None:
        invariant(self.phase is TrainingPhase.BACKWARD, lambda: f"a backward ended in {self.phase}")
        if self.hooks is not None:
            self.hooks.end_backward()
        self.reducer.end(self.chunks)
        self.micro_steps += 1
        self.grads_pending = True
        self.phase = TrainingPhase.IDLE
        self._end_pass()
        if self.timeline is not None:
            self.timeline.sample("backward")
        if self.cache.recording and self._micro_layout_final:
            self.cache.stop_recording()
        elif self.cache.recording:
            self.cache.restart_recording()

    def _grad_arrived(self, p: nn.Parameter, grad: torch.Tensor | None = None) -> None:  # grad: else p.grad
        if self.phase is not TrainingPhase.BACKWARD:
            try:
                self._begin_backward(by_autograd=True)
            except BaseException:
                p.grad = None  # left there, the next backward would add it to its own
                raise
        self.shards.progress()  # reductions whose order check came back start now
        chunk, slot = self.layout.slot_of[id(p)]
        self.reducer.add(chunk, slot, local_grad(p, p.grad if grad is None else grad))  # None: reducer.add
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

    @runs_between_forwards
    def step(self) -> bool:
        """At the end of a gradient accumulation window, apply the update and clear gradients.
        Returns True when an update was applied (False between boundaries, or when a non-finite
        gradient skipped it: fp16 overflow, config nonfinite='skip'; nonfinite='raise' raises
        NonFiniteError instead)."""
        self._expect_idle("step()")
        if not self.grads_pending:  # no backward since the last step: torch changes no parameter without a .grad
            return refuse_grads_set_by_hand(self.params, self.names, self._unhooked)
        if self.micro_steps % self.zeroshard_config.gradient_accumulation_steps:
            return False
        # A rank a micro-batch or a step apart raises at the step's first collective (stage 0 without
        # clipping has none: at the next one), or in its peers' hooks (ordering.py)
        self.comm.announce(STEP, alone=self.optim.issues_no_collective)
        self._settle()  # the last update's all-gathers write the storage this update steps
        self.phase = TrainingPhase.STEP
        failed = True
        try:
            with self._waits("run the optimizer step after"):
                self._reduce_unreduced()
                applied = self.optim.step()
            failed = False
        finally:  # nothing of a step's gradients, failed or not, carries into the next one
            self.phase = TrainingPhase.IDLE
            self._end_pass()
            self.optim.zero_grads()
            self.reducer.cleared()
            self.grads_pending = False
            # A step that failed part way may have changed shards: gather them anew. One that raised
            # after every rank agreed to apply it renewed the rCache already (optim/publish.py).
            if self.stage == 3 and not (failed and self.optim.update_agreed):
                self.cache.flush()
            if self._arrivals is not None:  # a failed update's all-gathers go out too (publish.py)
                self._arrivals.arm(self.chunks)
        self._set_steps(self.steps + int(applied))
        self._stats = step_stats(self.meter.finish(self.comm.world, self.optimizer), step=self.steps, applied=applied,
                                 chunks=self.chunks, optim=self.optim, cache=self.cache, comm=self.comm,
                                 shards=self.shards, transfer=self.transfer, saved=self.saved, scaler=self.scaler, tp=self.tp)
        if self.timeline is not None:
            self.timeline.step_done(self.steps)
        # the next forward's first chunks, once the step's figures are taken (cache.py's Note:
        # gathers at the step's end)
        if self.stage == 3 and self.optim.update_agreed:
            self.cache.gather_after_step()
        every = self.zeroshard_config.log_every
        if every and self.comm.rank == 0 and self.optim.boundaries % every == 0:
            log.info("%s", describe_step(self._stats))
        for hook in list(self._step_hooks.values()):
            hook(self, self.stats())
        return applied

    def _reduce_unreduced(self) -> None:
        if self.reducer.unreduced:  # the window's last backward ran under no_sync()
            self.shards.at(pass_index=self.micro_steps)
            self.reducer.reduce_unreduced(self.chunks)

    def _owned(self, given: list) -> set[int]:
        """Ids of the tensors of `given` it trains: parameters, placeholders, this rank's pieces."""
        known = set(self.layout.slot_of) | {id(pc.param) for c in self.optim.chunks for pc in c.pieces}
        return {id(t) for t in given if id(t) in known or id(getattr(t, "_zs_param", None)) in known}

    @runs_between_forwards
    def _clip_grad_norm(self, given: list, max_norm: float, norm_type, error_if_nonfinite: bool) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over what this engine trains (runtime/grad_readers.py), in a
        plain loop between the window's last backward and its step: the global L2 norm of the
        gradients, the same on every rank (collective; 0 with no gradient, as torch's), and the
        step clips to `max_norm` (optim/window_gradients.py)."""
        self._expect_idle("torch.nn.utils.clip_grad_norm_()")
        refuse_clip_call(given, self._owned(given), [p for p in self.params if p.requires_grad],
                         [pc.param for c in self.optim.chunks for pc in c.pieces], norm_type,
                         delayed=self.optim.delay_after is not None,
                         mid_window=self.grads_pending and bool(self.micro_steps % self.optim.accumulation))
        if not self.grads_pending:
            return torch.zeros((), device=self.device)
        with self._waits("clip the gradients after"):
            self._reduce_unreduced()
            return torch.tensor(self.optim.clip_at_step(float(max_norm), bool(error_if_nonfinite)), device=self.device)

    def _stepping(self) -> bool:
        return self.phase is TrainingPhase.STEP

    @runs_between_forwards
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last step, as optimizer.zero_grad() does in torch
        (step() clears them itself). `model.zero_grad()` on the wrapped model calls this."""
        self._expect_idle("zero_grad()")
        if self.grads_pending or any(c.slots_with_grad for c in self.optim.chunks):
            self.optim.zero_grads()
            self.reducer.cleared()
            self.grads_pending = False

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)
