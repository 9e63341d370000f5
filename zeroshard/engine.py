"""The engine: applies ZeRO data parallelism to an unmodified nn.Module and drives one training step.

Data path: model -> chunks (parameters packed in order of first use, sharded) -> hooks (stage 3
gathers/releases; gradients flow into chunks and are reduced as soon as a chunk is complete) ->
ShardedOptimizer (fp32 masters of owned ranges) -> parameters pushed back.

Gradient reduction timing (see [Note: reduce]):
- stages 0-1 keep the full gradient for the whole step and reduce only in the backward pass of the
  micro-batch that ends the step (all-reduce at 0, reduce-scatter at 1), as each chunk completes;
- stages 2-3 reduce-scatter every micro-batch, as each chunk completes, and keep only their shard.
A chunk is complete when every trainable parameter in it has its gradient. Whatever is not complete
when backward returns (parameters that got no gradient) is reduced then, in chunk order, so every
rank issues the same collectives in the same order.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import weakref

import torch
import torch.nn as nn

from .cache import ChunkCache
from .chunks import Chunk, ChunkState, Slot, auto_chunk_size, pack
from .collectives import REDUCE, Comm, init_process_group, order_tag
from .config import Config
from .hooks import ArrivalHooks, ChunkView, FirstUseRecorder, Stage3Hooks, direct_params
from .offload import ActivationOffload, Pending, Placement, Transfer
from .optimizer import PROBE_NUMEL, LossScaler, ShardedOptimizer, default_optimizer, probe_state
from .timeline import MemoryTimeline

log = logging.getLogger("zeroshard")

MAX_REDUCING = 2  # stages 2-3: chunk reductions in flight during backward, each holding a full-chunk gradient
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Saved:
    """A tensor saved for backward while zeroshard's saved-tensor hooks are on. `inner` is detached:
    a saved output holding its own graph would make a cycle the garbage collector keeps when no
    backward comes. `version` lets unpacking raise as autograd does on a later in-place change
    (None: an offloaded copy, which the change cannot reach)."""
    __slots__ = ("inner", "version", "__weakref__")

    def __init__(self, inner, version: int | None):
        self.inner, self.version = inner, version


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
            self.plan, self.profile = plan_for(module, example_inputs, make_opt, config, self.device, self.comm)
            # The config that runs: what the plan chose (its placement per chunk is applied below).
            config = dataclasses.replace(config, offload=False, **self.plan.config())
        self.config = config
        self.placement = Placement(optimizer_on_host=config.offload_optimizer,
                                   params_on_host=config.offload_params)
        self.module = module
        self.dtype = DTYPES[config.precision]
        self.stage = config.stage
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
        # Keys of the model's own state_dict, resolved now, before stage 3 swaps parameter slots.
        self._state_keys = [(k, v) for k, v in module.state_dict(keep_vars=True).items()]
        for b_name, b in module.named_buffers():
            module.get_submodule(b_name.rpartition(".")[0])._buffers[b_name.rpartition(".")[2]] = b.to(self.device)

        numels = [p.numel() for p in self.params]
        cap = auto_chunk_size(numels) if config.chunk_size == "auto" else config.chunk_size
        self.chunk_capacity = max(cap, max(numels))
        self.cache = ChunkCache(self.comm, config.cache_chunks, config.prefetch, config.check_order)
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
        self.chunks: list[Chunk] = []
        order = self.params if self.profile is None else [self.params[i] for i in self.profile.first_use]
        self._build_chunks(order, [p.detach() for p in order], broadcast=True)
        self.optim.attach(self.chunks)

        self.hooks = None
        if self.stage == 3:
            self.hooks = Stage3Hooks(module, self.cache, self._chunks_of, self.names, self.shapes, self.dtype)
        self._arrivals = ArrivalHooks(module, self._chunks_of) if delayed and self.stage in (1, 2) else None
        # Through a weak reference: autograd keeps the hook in C++, where the garbage collector cannot
        # see the cycle parameter -> hook -> engine -> module -> parameter, so a dropped engine would stay.
        grad_arrived = _weak_method(self._grad_arrived)
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(grad_arrived)
        # First-use order: recorded in the first training forward; chunks are re-packed if it
        # differs from module order. The prefetch schedule is recorded over the first micro-batch
        # that runs entirely on the final packing.
        self._recorder = FirstUseRecorder(module)
        self._act_offload = ActivationOffload(self.transfer, self._is_chunk_storage) \
            if config.offload_activations else None
        self._reducing = collections.deque()  # stages 2-3: chunks whose reduction is in flight
        self._layout_final = False
        self.cache.recording = True
        self._micro_layout_final = False
        if self.profile is not None:  # packed in profiled first-use order; follow the profiled schedule
            self._recorder.remove()
            self._recorder = None
            self._layout_final = True
            self.cache.set_schedule(self._profiled_sequence())
            log.info("zeroshard: %s", self.plan.describe())

    # -- chunks ---------------------------------------------------------------------------------
    def _build_chunks(self, order: list[nn.Parameter], values: list[torch.Tensor], broadcast: bool) -> None:
        """Pack `order` into chunks (trainable and frozen parameters apart: frozen ones have no
        gradients and no optimizer state) with the given full values."""
        chunks, self._slot_of, self._module_chunks = [], {}, {}
        value_of = {id(p): v for p, v in zip(order, values)}
        for trainable in (True, False):
            group = [p for p in order if p.requires_grad == trainable]
            for placed in pack([self.shapes[id(p)].numel() for p in group], self.chunk_capacity):
                slots = [Slot(group[i], self.names[id(group[i])], off, self.shapes[id(group[i])].numel(),
                              self.shapes[id(group[i])]) for i, off in placed]
                vals = [value_of[id(s.param)] for s in slots]
                c = Chunk(len(chunks), slots, stage=self.stage, rank=self.comm.rank, world=self.comm.world,
                          dtype=self.dtype, device=self.device, trainable=trainable, values=vals,
                          comm=self.comm if broadcast else None, placement=self._placement_of(len(chunks)),
                          transfer=self.transfer)
                chunks.append(c)
                for s in slots:
                    self._slot_of[id(s.param)] = (c, s)
        self.chunks = chunks
        self.cache.set_chunks(chunks)

    def _placement_of(self, index: int) -> Placement:
        """The config's placement, or the plan's for this chunk (a chunk the plan did not foresee,
        after a re-pack, keeps everything on the device)."""
        if self.plan is None:
            return self.placement
        on_host = index < len(self.plan.optimizer_on_host) and self.plan.optimizer_on_host[index]
        return Placement(optimizer_on_host=on_host, params_on_host=on_host and self.stage == 3)

    def _profiled_sequence(self) -> list[int]:
        """The profile's trace as the chunk indices stage 3 will acquire."""
        modules = dict(self.module.named_modules())
        seq = []
        for ev in self.profile.trace:
            m = modules.get(ev.module)
            if m is not None:
                seq.extend(c.index for c in self._chunks_of(m))
        return seq

    def _chunks_of(self, module: nn.Module) -> list[Chunk]:
        got = self._module_chunks.get(module)
        if got is None:
            got = []
            for _, p in direct_params_real(self, module):
                c = self._slot_of[id(p)][0]
                if c not in got:
                    got.append(c)
            self._module_chunks[module] = got
        return got

    def _repack(self, order: list[nn.Parameter]) -> None:
        """Re-pack chunks in first-use order (once, before the first backward)."""
        log.info("zeroshard: re-packing %d chunks in order of first use", len(self.chunks))
        full = self._full_values()
        self.cache.flush()
        for c in self.chunks:
            if c.state is not ChunkState.SHARDED and self.stage == 3:
                c.release()
        self._build_chunks(order, [full[id(p)] for p in order], broadcast=False)
        self.optim.attach(self.chunks)

    @torch.no_grad()
    def _full_values(self) -> dict[int, torch.Tensor]:
        """Full fp32 value of every parameter (a collective; not counted as step traffic)."""
        out = {}
        self.comm.counting = False
        try:
            for c in self.chunks:
                if c.master is not None:
                    src, lo, hi = c.master.detach(), *c.owned_range
                else:
                    src, (lo, hi) = c.shard, c.owned_range
                src = src.to(self.device)  # an offloaded shard: the collective runs on the device
                if (lo, hi) == (0, c.padded_numel):
                    full = src.float()
                else:
                    full = torch.empty(c.padded_numel, dtype=src.dtype, device=self.device)
                    self.comm.all_gather(full, src)
                    full = full.float()
                for s in c.slots:
                    out[id(s.param)] = full[s.offset:s.offset + s.numel].view(s.shape)
        finally:
            self.comm.counting = True
        return out

    # -- training API -----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        args, kwargs = self._to_device((args, kwargs))
        recording = self._recorder is not None and self.module.training and torch.is_grad_enabled()
        self._micro_layout_final = self._layout_final
        if self.hooks is not None:
            self.hooks.close_open_forwards()
            self.cache.cursor = 0  # every forward (micro-batch or evaluation) replays the schedule
        tracking = self.timeline is not None and self.timeline.recording
        if torch.is_grad_enabled() and (self.hooks is not None or self._act_offload is not None or tracking):
            with torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved):
                out = self.module(*args, **kwargs)
        else:
            out = self.module(*args, **kwargs)
        if recording:
            self._finish_recording()
        if tracking:
            self.timeline.sample("forward")
        return out

    forward = __call__

    def _finish_recording(self) -> None:
        used = self._recorder.order
        self._recorder.remove()
        self._recorder = None
        seen = {id(p) for p in used}
        order = used + [p for p in self.params if id(p) not in seen]
        current = [s.param for c in self.chunks for s in c.slots]
        want = [p for t in (True, False) for p in order if p.requires_grad == t]
        if [id(p) for p in want] != [id(p) for p in current]:
            self._repack(order)
        self._layout_final = True

    # -- tensors saved for backward: stage-3 chunk views by reference, activations to the host --
    def _pack_saved(self, t: torch.Tensor):
        # Not in the forward that may re-pack chunks (the first): references would name old chunks.
        if self.hooks is not None and self._micro_layout_final:
            ref = self.hooks.pack_chunk_view(t)
            if ref is not None:
                return ref
        packed = self._act_offload.pack(t) if self._act_offload is not None else t
        tracking = self.timeline is not None and self.timeline.recording
        if isinstance(packed, Pending):
            return self.timeline.track(Saved(packed, None), packed.tensor, on_host=True) if tracking else packed
        saved = Saved(t.detach(), t._version)
        if tracking and not self._is_chunk_storage(t):
            on_host = t.device.type == "cpu" and self.device.type != "cpu"
            self.timeline.track(saved, t, on_host)
        return saved

    def _unpack_saved(self, packed):
        if isinstance(packed, Saved):
            if packed.version is not None and packed.inner._version != packed.version:
                raise RuntimeError(
                    "zeroshard: a tensor saved for backward was modified by an inplace operation after it "
                    f"was saved (version {packed.inner._version}, saved at {packed.version}; shape "
                    f"{tuple(packed.inner.shape)}): autograd would compute a wrong gradient")
            packed = packed.inner
        if isinstance(packed, ChunkView):
            return self.hooks.unpack_chunk_view(packed)
        if isinstance(packed, Pending):
            return self._act_offload.unpack(packed)
        return packed

    def _is_chunk_storage(self, t: torch.Tensor) -> bool:
        """Whether `t` is (a view of) model state: a chunk's storage."""
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less subclass: not a chunk
            return False
        return any(x is not None and x.untyped_storage().data_ptr() == ptr
                   for c in self.chunks for x in (c.full, c.shard, c.master))

    def _to_device(self, tree):
        def move(x):
            if isinstance(x, torch.Tensor):
                if x.is_floating_point() and x.dtype != self.dtype:
                    x = x.to(self.dtype)
                return x.to(self.device, non_blocking=True)
            if isinstance(x, (list, tuple)):
                return type(x)(move(v) for v in x)
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x
        return move(tree)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (the mean loss of this rank's micro-batch)."""
        self._boundary = (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0
        self._reduce_now = self.stage >= 2 or self._boundary
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        try:
            loss.backward()
        finally:
            if self.hooks is not None:
                self.hooks.end_backward()
        self._flush_reductions()
        self.micro_steps += 1
        self.grads_pending = True
        if self.timeline is not None:
            self.timeline.sample("backward")
        if self.cache.recording and self._micro_layout_final:
            self.cache.recording = False
        elif self.cache.recording:
            self.cache.restart_recording()

    def _grad_arrived(self, p: nn.Parameter) -> None:
        chunk, slot = self._slot_of[id(p)]
        if chunk.reduced:
            chunk.stash_reduced()
        chunk.accumulate_grad(slot, p.grad)
        p.grad = None
        chunk.grads_seen += 1
        if self.timeline is not None:  # before finishing reductions: the most gradient buffers held
            self.timeline.sample("backward", slot.name)
        if self._reduce_now and not chunk.reduced and chunk.grads_seen == chunk.expected_grads:
            self._start_reduce(chunk)
            if self.stage >= 2:
                self._reducing.append(chunk)
                self._finish_completed_reductions()
        if self.hooks is not None:
            self.hooks.grad_arrived(p)

    def _start_reduce(self, chunk: Chunk) -> None:
        if self.config.check_order:
            self.comm.check_order(order_tag(REDUCE, chunk.index))
        chunk.start_reduce(self.comm)

    def _finish_completed_reductions(self) -> None:
        """Stages 2-3, during backward: finish the reductions that are done, oldest first, so their
        full gradient buffers are freed (and, with the optimizer offloaded, their reduced gradient
        starts its copy to the host) while backward goes on. At most MAX_REDUCING stay in flight:
        past that the oldest is waited for, so gradient buffers stay a constant size (ZeRO-R) even
        where a backend's work never reports completion before wait() (gloo's reduce-scatter)."""
        while self._reducing:
            c = self._reducing[0]
            done = c.reduce_work is None or c.reduce_work.is_completed()
            if not done and len(self._reducing) <= MAX_REDUCING:
                return
            self._reducing.popleft()
            c.finish_reduce()

    def _flush_reductions(self) -> None:
        self._reducing.clear()
        for c in self.chunks:
            if not c.trainable:
                continue
            # Reduce what is not reduced yet: chunks some parameter of which got no gradient, and
            # gradients that arrived after their chunk's reduction had finished.
            if self._reduce_now and not c.reduced and (not c.reduce_done or c.grad_full is not None):
                self._start_reduce(c)
        for c in self.chunks:
            if c.trainable:
                c.finish_reduce()
                c.grads_seen = 0
                c.reduce_done = False

    def step(self) -> bool:
        """At the end of a gradient accumulation window, apply the update and clear gradients.
        Returns True when an update was applied (False between boundaries or on fp16 overflow)."""
        if self.micro_steps == 0 or self.micro_steps % self.config.gradient_accumulation_steps:
            return False
        applied = self.optim.step()
        self.comm.verify_order()
        self.grads_pending = False
        for c in self.chunks:
            if c.trainable:
                c.zero_grad()
        if self.stage == 3:
            self.cache.flush()
        self.steps += int(applied)
        self._record_stats(applied)
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
        full = self._full_values()
        out = {}
        for key, obj in self._state_keys:
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
        """Bytes of model states this rank keeps between steps, by kind ('params', 'grads',
        'optimizer': fp32 masters and the optimizer's states) and by where ('device', 'host')."""
        opt_bytes = self.optim.state_bytes()
        by_kind = {"params": 0, "grads": 0, "optimizer": sum(opt_bytes.values())}
        by_device = {"device": opt_bytes[False], "host": opt_bytes[True]}
        for c in self.chunks:
            for kind, on_host, n in c.state_bytes():
                by_kind["optimizer" if kind == "master" else kind] += n
                by_device["host" if on_host else "device"] += n
        return by_kind, by_device

    def _record_stats(self, applied: bool) -> None:
        by_kind, by_device = self.model_state_bytes()
        self._stats = {
            "step": self.steps,
            "applied": applied,
            "comm_elements": self.comm.elements,
            "control_collectives": self.comm.control_collectives,
            "model_state_bytes": sum(by_kind.values()),
            "model_state_bytes_by_kind": by_kind,
            "model_state_bytes_by_device": by_device,
            "transfer_bytes": {"h2d": self.transfer.h2d_bytes, "d2h": self.transfer.d2h_bytes},
            "num_params": sum(s.numel() for s in self.shapes.values()),
            "num_chunks": len(self.chunks),
            "padded_elements": sum(c.padded_numel for c in self.chunks),
            "cache_peak_chunks": self.cache.peak,
            "cache_peak_bytes": self.cache.peak_bytes,
            "cache_overflows": self.cache.overflows,
            "schedule_departures": self.cache.departures,
            # Device bytes the planner predicts (Plan.device_model_bytes): model states + rCache.
            "device_model_bytes": by_device["device"] + self.cache.peak_bytes,
            "loss_scale": self.scaler.scale if self.scaler else None,
            "grad_norm": self.optim.last_grad_norm,
            "world_size": self.comm.world,
        }
        self.comm.reset_counters()
        self.transfer.reset_counters()
        self.cache.peak = 0
        self.cache.peak_bytes = 0

    def stats(self) -> dict:
        """Figures of the last optimizer step: `comm_elements` (payload elements this rank moved,
        counted as the ZeRO paper does), `model_state_bytes` and `model_state_bytes_by_kind`
        (bytes of parameters, gradients and optimizer states this rank holds; transient buffers
        and the stage-3 cache excluded), `model_state_bytes_by_device` (the same bytes split into
        'device' and 'host' memory), `transfer_bytes` ('h2d' and 'd2h' bytes copied between host and
        device since the previous step), and more."""
        return dict(self._stats)


def plan_for(module: nn.Module, example_inputs, make_opt, config: Config, device: torch.device, comm):
    """Profile, measure and plan on rank 0; every rank gets rank 0's plan, so all build the same
    chunks even if their measurements would differ."""
    from .hardware import probe
    from .planner import Planner, Target
    from .profiler import profile

    dtype = DTYPES[config.precision]
    mine = None
    if comm.rank == 0:
        prof = profile(module, example_inputs, dtype=dtype, device=device)
        hw = probe(device, dtype).with_(device_memory=config.device_memory)
        target = Target(hw, world=comm.world, accumulation=config.gradient_accumulation_steps,
                        optimizer_state_bytes=optimizer_state_bytes(make_opt))
        planner = Planner(prof, target, chunk_size=None if config.chunk_size == "auto" else config.chunk_size)
        stage = config.stage if config.stage != "auto" else "auto"
        best = planner.plan(stage=stage, offload=config.offload == "auto")
        mine = (best, prof, None if best.fits else planner.why_nothing_fits(best))
    best, prof, why = comm.broadcast_object(mine)
    if why is not None:
        raise RuntimeError(f"zeroshard: {why}")
    return best, prof


def optimizer_state_bytes(make_opt) -> int:
    """Bytes of optimizer state per parameter element (AdamW: 8, SGD with momentum: 4)."""
    if make_opt is None:
        return 8
    state = probe_state(make_opt)
    n = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return max(0, n // PROBE_NUMEL)


def direct_params_real(engine: Engine, module: nn.Module):
    """A module's direct parameters, the real ones even while stage 3 has placeholders in place."""
    if engine.hooks is not None and module in engine.hooks.real:
        return engine.hooks.real[module]
    return direct_params(module)

