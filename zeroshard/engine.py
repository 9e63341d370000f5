"""The engine: applies ZeRO data parallelism to an unmodified nn.Module and conducts one training step.

Data path: model -> profile and plan (planner.py, with offload="auto") -> chunks (chunks.py:
parameters packed in order of first use, sharded) -> hooks (hooks.py: stage-3 gathers through the
rCache, cache.py; saved tensors) -> gradients into chunks, reduced as each completes (reducer.py) ->
ShardedOptimizer (optimizer.py: fp32 masters of owned ranges, on the device or the host, offload.py)
-> parameters pushed back -> checkpoint.py. The engine owns the wiring and the training phase
(TrainingPhase); each of those modules owns its own state.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
import weakref

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from .cache import ChunkCache
from .chunks import Chunk, auto_chunk_size
from .collectives import Comm, init_process_group
from .config import Config
from .hooks import ArrivalHooks, Stage3Hooks, direct_params
from .layout import ChunkLayout
from .offload import Placement, Transfer
from .optimizer import LossScaler, ShardedOptimizer, default_optimizer
from .planner import plan_for, profiled_sequence
from .reducer import GradientReducer
from .saved_tensors import SavedTensorHooks
from .stats import model_state_bytes, step_stats
from .timeline import MemoryTimeline

log = logging.getLogger("zeroshard")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingPhase(enum.Enum):
    """Where the engine is in a training step: each entry point checks it, so a call out of order
    (a step inside backward, a forward after an interrupted backward) raises instead of corrupting
    gradients."""

    IDLE = "idle"  # between calls
    FORWARD = "forward"  # inside engine(...)
    BACKWARD = "backward"  # from engine.backward (or the first gradient of loss.backward()) to its end
    STEP = "step"  # inside engine.step()


def _weak_method(method):
    """A function that calls `method` while its object lives, without keeping the object alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        m = ref()
        if m is not None:
            m(*args)
    return call


def default_device() -> torch.device:
    """cuda:LOCAL_RANK with CUDA (ranks beyond the GPU count wrap around and share), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


class Engine:
    """Trains `module` with ZeRO data parallelism. Build it with `zeroshard.initialize`."""

    def __init__(self, module: nn.Module, make_opt, config: Config, device: torch.device | None = None,
                 example_inputs=None):
        self.device = device or default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_process_group(self.device)
        self.comm = Comm(self.device)
        self.transfer = Transfer(self.device)
        self.plan = self.profile = None
        if config.planned:
            if example_inputs is None:
                raise ValueError("zeroshard: offload/stage 'auto' profiles the model before training: pass "
                                 "example_inputs=... to zeroshard.initialize (one micro-batch as the model is "
                                 "called, e.g. {'input_ids': x, 'labels': x}; only shapes and dtypes are used)")
            self.plan, self.profile = plan_for(module, example_inputs, make_opt, config, DTYPES[config.precision],
                                               self.device, self.comm)
            # The config that runs: what the plan chose (its placement per chunk is applied below).
            config = dataclasses.replace(config, offload=False, **self.plan.config())
        self.config = config
        self.placement = Placement(optimizer_on_host=config.offload_optimizer,
                                   params_on_host=config.offload_params)
        self.module = module
        self.dtype = DTYPES[config.precision]
        self.stage = config.stage
        self.phase = TrainingPhase.IDLE
        self.micro_steps = 0
        self.grads_pending = False  # a backward ran whose gradients no step() has applied or dropped
        self.steps = 0
        self._stats = {}
        self.timeline = None  # a MemoryTimeline while record_memory() is on

        # Parameters, deduplicated (tied weights are one parameter), with their first name.
        self.params: list[nn.Parameter] = []
        self.names: dict[int, str] = {}
        for name, p in module.named_parameters():
            self.names[id(p)] = name
            self.params.append(p)
        if not self.params:
            raise ValueError("zeroshard: the model has no parameters")
        self.shapes = {id(p): p.shape for p in self.params}
        # Keys of the model's own state_dict with their objects, resolved now, before stage 3 swaps
        # parameter slots (checkpoints and full_state_dict name things by them).
        self.state_keys = [(k, v) for k, v in module.state_dict(keep_vars=True).items()]
        for b_name, b in module.named_buffers():
            module.get_submodule(b_name.rpartition(".")[0])._buffers[b_name.rpartition(".")[2]] = b.to(self.device)

        numels = [p.numel() for p in self.params]
        cap = auto_chunk_size(numels) if config.chunk_size == "auto" else config.chunk_size
        self.layout = ChunkLayout(self.names, self.shapes, stage=self.stage, comm=self.comm, dtype=self.dtype,
                                  device=self.device, transfer=self.transfer, capacity=max(cap, max(numels)),
                                  placement_of=self._placement_of)
        self.cache = ChunkCache(self.comm, config.cache_chunks, config.prefetch, config.check_order)
        self.reducer = GradientReducer(self.comm, self.stage, config.check_order)
        self.scaler = LossScaler(config.initial_loss_scale, config.loss_scale_window) \
            if config.precision == "fp16" else None
        if make_opt is None:
            host = config.offload_optimizer or (self.plan is not None and any(self.plan.optimizer_on_host))
            make_opt = default_optimizer(host=host)
        delayed = config.delay_update_after is not None
        self.optim = ShardedOptimizer(make_opt, self.comm, stage=self.stage, dtype=self.dtype,
                                      accumulation=config.gradient_accumulation_steps,
                                      clip_grad_norm=config.clip_grad_norm, scaler=self.scaler,
                                      delay_after=config.delay_update_after,
                                      side_comm=self.comm.side_channel() if delayed else None)
        order = self.params if self.profile is None else [self.params[i] for i in self.profile.first_use]
        self.layout.build(order, [p.detach() for p in order], broadcast=True)
        self.cache.set_chunks(self.chunks)
        self.optim.attach(self.chunks)

        self.hooks = None
        if self.stage == 3:
            self.hooks = Stage3Hooks(module, self.cache, self.layout.chunks_of, self.names, self.shapes, self.dtype)
            real = self.hooks.real
            self.layout.real_params = lambda m: real[m] if m in real else direct_params(m)
        self._arrivals = ArrivalHooks(module, self.layout.chunks_of) if delayed and self.stage in (1, 2) else None
        # Through a weak reference: autograd keeps the hook in C++, where the garbage collector cannot
        # see the cycle parameter -> hook -> engine -> module -> parameter, so a dropped engine would stay.
        grad_arrived = _weak_method(self._grad_arrived)
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(grad_arrived)
        # The prefetch schedule is recorded over the first micro-batch that runs entirely on the
        # final packing (layout.py: chunks are re-packed in order of first use after the first).
        self.layout.record_first_use(module)
        self.saved = SavedTensorHooks(self.device, self.transfer, self.hooks, lambda: self.chunks,
                                      config.offload_activations)
        self.cache.recording = True
        self._micro_layout_final = False
        if self.profile is not None:  # packed in profiled first-use order; follow the profiled schedule
            self.fix_layout()
            self.cache.set_schedule(profiled_sequence(self.profile, self.module, self.layout.chunks_of))
            log.info("zeroshard: %s", self.plan.describe())

    # -- chunks ---------------------------------------------------------------------------------
    @property
    def chunks(self) -> list[Chunk]:
        return self.layout.chunks

    def _placement_of(self, index: int) -> Placement:
        """The config's placement, or the plan's for this chunk (a chunk the plan did not foresee,
        after a re-pack, keeps everything on the device)."""
        if self.plan is None:
            return self.placement
        on_host = index < len(self.plan.optimizer_on_host) and self.plan.optimizer_on_host[index]
        return Placement(optimizer_on_host=on_host, params_on_host=on_host and self.stage == 3)

    # -- training API -----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.phase is TrainingPhase.BACKWARD:  # a plain loss.backward() raised half-way
            log.warning("zeroshard: the previous backward was interrupted; its reductions are abandoned")
            self._abandon_backward()
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: forward called while the engine is in {self.phase.value}")
        self.comm.pass_index = self.micro_steps
        self.phase = TrainingPhase.FORWARD
        try:
            return self._forward(args, kwargs)
        finally:
            self.phase = TrainingPhase.IDLE

    def _forward(self, args, kwargs):
        args, kwargs = self._to_device((args, kwargs))
        recording = self.layout.recorder is not None and self.module.training and torch.is_grad_enabled()
        self._micro_layout_final = self.layout.final
        if self.hooks is not None:
            self.hooks.close_open_forwards()
            self.cache.cursor = 0  # every forward (micro-batch or evaluation) replays the schedule
        tracking = self.timeline is not None and self.timeline.recording
        if torch.is_grad_enabled() and self.saved.needed(self.timeline):
            with self.saved.around_forward(self.timeline, by_reference=self._micro_layout_final):
                out = self.module(*args, **kwargs)
        else:
            out = self.module(*args, **kwargs)
        if recording:
            self._finish_recording()
        if tracking:
            self.timeline.sample("forward")
        self.optim.await_arrivals()  # a delayed update's uploads into chunks this forward did not run
        return out

    forward = __call__

    def _finish_recording(self) -> None:
        used = self.layout.recorder.order
        seen = {id(p) for p in used}
        self.fix_layout(used + [p for p in self.params if id(p) not in seen])

    def fix_layout(self, order: list[nn.Parameter] | None = None) -> None:
        """Make the chunk layout final now: re-pack the chunks in `order` (parameters in order of
        first use) if that differs from the current packing, then stop recording first use.
        Re-packing needs an optimizer with one group and no state (RuntimeError otherwise). No-op
        once the layout is final (`engine.layout.final`)."""
        if self.layout.final:
            return
        if order is not None and self.layout.differs(order):
            log.info("zeroshard: re-packing %d chunks in order of first use", len(self.chunks))
            full = self.layout.full_values()
            self.cache.flush()
            self.layout.release_gathered()
            self.layout.build(order, [full[id(p)] for p in order], broadcast=False)
            self.cache.set_chunks(self.chunks)
            self.optim.attach(self.chunks)
        self.layout.finalize()

    def _to_device(self, tree):
        """Inputs onto the device, floating ones in the compute dtype, through any container torch's
        pytree knows (tuples, namedtuples, lists, dicts, ...)."""
        def move(x):
            if x.is_floating_point() and x.dtype != self.dtype:
                x = x.to(self.dtype)
            return x.to(self.device, non_blocking=True)
        return tree_map_only(torch.Tensor, move, tree)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (the mean loss of this rank's micro-batch). `loss.backward()` does the
        same except with fp16, whose loss scaling needs this method."""
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: backward() called while the engine is in {self.phase.value} (an "
                               "earlier backward was interrupted, or backward was called inside forward)")
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        self._begin_backward()
        try:
            loss.backward()
        except BaseException:
            self._abandon_backward()
            raise
        if self.phase is TrainingPhase.BACKWARD:  # not ended by autograd's callback (see _grad_arrived)
            self._end_backward()

    def _begin_backward(self, by_autograd: bool = False) -> None:
        if by_autograd:  # the first gradient of a plain `loss.backward()`
            if self.scaler is not None:
                raise RuntimeError("zeroshard: with precision 'fp16' call engine.backward(loss), not "
                                   "loss.backward(): the loss must be scaled (dynamic loss scaling)")
            if self.phase is not TrainingPhase.IDLE:
                raise RuntimeError(f"zeroshard: a backward started while the engine is in {self.phase.value}")
            # Autograd runs this once the whole backward pass is done, before backward() returns.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        assert self.phase is TrainingPhase.IDLE, self.phase
        self.phase = TrainingPhase.BACKWARD
        self.comm.pass_index = self.micro_steps
        self.reducer.begin(ends_window=(self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0)

    def _abandon_backward(self) -> None:
        """A backward raised: drop its reductions so the engine can go on. Gradients it already
        accumulated stay, as they would in torch's .grad; if other ranks finished that backward,
        this rank is now a micro-batch behind, and the next order check raises DivergedError."""
        if self.hooks is not None:
            self.hooks.end_backward()
        self.reducer.abandon(self.chunks)
        self.phase = TrainingPhase.IDLE

    def _end_backward(self) -> None:
        assert self.phase is TrainingPhase.BACKWARD, self.phase
        if self.hooks is not None:
            self.hooks.end_backward()
        self.reducer.end(self.chunks)
        self.micro_steps += 1
        self.grads_pending = True
        self.phase = TrainingPhase.IDLE
        if self.timeline is not None:
            self.timeline.sample("backward")
        if self.cache.recording and self._micro_layout_final:
            self.cache.recording = False
        elif self.cache.recording:
            self.cache.restart_recording()

    def _grad_arrived(self, p: nn.Parameter) -> None:
        if self.phase is not TrainingPhase.BACKWARD:
            self._begin_backward(by_autograd=True)
        chunk, slot = self.layout.slot_of[id(p)]
        self.reducer.add(chunk, slot, p.grad)
        p.grad = None
        if self.timeline is not None:  # before finishing reductions: the most gradient buffers held
            self.timeline.sample("backward", slot.name)
        self.reducer.reduce_if_complete(chunk)
        if self.hooks is not None:
            self.hooks.grad_arrived(p)

    def step(self) -> bool:
        """At the end of a gradient accumulation window, apply the update and clear gradients.
        Returns True when an update was applied (False between boundaries or on fp16 overflow)."""
        if self.phase is not TrainingPhase.IDLE:
            raise RuntimeError(f"zeroshard: step() called while the engine is in {self.phase.value}")
        if self.micro_steps == 0 or self.micro_steps % self.config.gradient_accumulation_steps:
            return False
        self.phase = TrainingPhase.STEP
        try:
            applied = self.optim.step()
        except BaseException:  # nothing of a failed step's gradients carries into the next step
            self._zero_grads()
            raise
        finally:
            self.phase = TrainingPhase.IDLE
        self.comm.verify_order()
        self._zero_grads()
        if self.stage == 3:
            self.cache.flush()
        self.steps += int(applied)
        self._stats = step_stats(self, applied)
        if self.timeline is not None:
            self.timeline.step_done()
        return applied

    def apply_delayed_update(self) -> None:
        """With `delay_update_after`: wait for the update in flight and apply it, so the parameters
        are the optimizer's latest (the next step then starts a new delay). Saving a checkpoint or a
        state dict does this first; call it before evaluating or exporting the model by other means
        if the last update must be in. A no-op otherwise."""
        self.optim.land()
        self.optim.await_arrivals()

    def zero_grad(self) -> None:
        """Gradients are cleared by step(); kept for familiarity."""

    def _zero_grads(self) -> None:
        self.grads_pending = False
        for c in self.chunks:
            if c.trainable:
                c.zero_grad()

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
        self.apply_delayed_update()
        full = self.layout.full_values()
        out = {}
        for key, obj in self.state_keys:
            if id(obj) in full:
                out[key] = full[id(obj)].detach().cpu().clone()
            else:
                out[key] = self.module.get_buffer(key).detach().cpu().clone()
        return out

    def save_checkpoint(self, root, tag: str | None = None, client_state: dict | None = None) -> str:
        """Collective: save model, optimizer states, loss scale, step counters, RNG states, the config
        and `client_state` (rank 0's; any picklable dict, e.g. the data position) as checkpoint `tag` (default
        `step<N>`) in directory `root`, every rank writing its own shards; then point root/latest at
        it. Atomic: a crash leaves `latest` naming the previous checkpoint, complete. Call it after
        step(), not between the micro-batches of an accumulation window. Returns the checkpoint's
        directory. Any world size, stage, chunk size or offload setting can load it
        (`load_checkpoint`); `zeroshard export` turns it into one safetensors file."""
        from .checkpoint import save
        self.apply_delayed_update()
        return save(self, root, tag, client_state)

    def load_checkpoint(self, path, tag: str | None = None, load_optimizer: bool = True) -> dict:
        """Collective: load a checkpoint into this engine: `path` is a root (its `latest`, or `tag`)
        or a checkpoint directory. Checks every file's size and checksum and that the checkpoint is of
        this model before changing anything (CheckpointError naming the damaged files or the
        mismatched parameters otherwise), and that its optimizer state is this optimizer's.
        load_optimizer=False loads the model (and buffers, counters, RNG) and starts the optimizer
        afresh: its state is cleared. Returns the saved `client_state` ({} if none)."""
        from .checkpoint import load
        self.apply_delayed_update()
        return load(self, path, tag, load_optimizer)

    def record_memory(self, steps: int | None = 1) -> MemoryTimeline:
        """Record this rank's memory (model states on device and host, rCache, gradient buffers,
        activations; bytes) over the next `steps` optimizer steps (None: until `.stop()`), sampled
        after each module's forward, each gradient's arrival and each phase. Returns the timeline,
        also at `engine.timeline`; `.plot(path)` saves a PNG, `.samples` holds the figures."""
        if self.timeline is not None:
            self.timeline.stop()
        self.timeline = MemoryTimeline(self, steps)
        return self.timeline

    def model_state_bytes(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes of model states this rank keeps between steps, by kind and by device (stats.py)."""
        return model_state_bytes(self.chunks, self.optim)

    def stats(self) -> dict:
        """Figures of the last optimizer step, key by key in stats.py: communication volume, model
        state bytes (by kind and by device), host-device transfers, rCache peaks, loss scale, norm."""
        return dict(self._stats)
