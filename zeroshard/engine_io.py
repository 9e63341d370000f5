"""The engine's state in and out, and its figures: checkpoints saved and loaded, pretrained weights in
and out, every parameter whole for a while, the memory timeline, stats and step hooks. `EngineIO` is
the base of `Engine` (engine.py), which conducts the training step; the work is done by state/ and
telemetry/, each given the engine to read.
"""
from __future__ import annotations

import contextlib
import enum

import torch

from .distributed.tensor_parallel import local
from .optim.delayed_update import UpdateState, write_lost
from .runtime.module_state import full_parameters
from .state.view import TrainingState
from .telemetry.stats import model_state_bytes
from .telemetry.timeline import MemoryTimeline
from .errors import EngineCallError


class TrainingPhase(enum.Enum):
    """Where the engine is in a training step: each entry point checks it, so a call out of order
    (a step inside backward, a forward after an interrupted backward) raises."""

    IDLE = "idle"  # between calls
    FORWARD = "forward"  # inside engine(...)
    BACKWARD = "backward"  # from engine.backward (or the first gradient of loss.backward()) to its end
    STEP = "step"  # inside engine.step()
    FULL_PARAMETERS = "full parameters"  # inside `with engine.full_parameters()`


class EngineIO:
    """Engine methods that move state in or out; they run only between training calls (IDLE)."""

    def _expect_idle(self, call: str) -> None:
        if self.phase is not TrainingPhase.IDLE:
            raise EngineCallError(f"zeroshard: {call} called while the engine is in {self.phase.value}")

    def _state_view(self) -> TrainingState:
        """What state/ reads of this engine for one save, load or export (state/view.py)."""
        return TrainingState(self.module, self.params, self.names, self.shapes, self.state_keys, self.device,
                             self.zeroshard_config, self.comm, self.shards, self.world_comm, self.tp, self.layout,
                             self.optim, self.scaler, self.cache, self.steps, self.micro_steps, self.grads_pending,
                             self.apply_delayed_update, self.thaw, self.fix_layout, self.restore_counters)

    def _quiesce(self) -> None:
        """Before the chunks are read or written whole: the update in flight lands, every chunk
        arrives, and stage 3's rCache holds no gathered copy that could go stale."""
        self.apply_delayed_update()
        if self.stage == 3:
            self.cache.flush()

    def apply_delayed_update(self) -> None:
        """With `delay_update_after`: apply the update in flight now (checkpoints and state dicts do
        this first; call it before evaluating or exporting the model by other means)."""
        if self.hooks is not None:  # before it lands: a write lent since is raised, not written over it
            self.hooks.settle_lent()
        try:
            self.optim.land()
        finally:  # one that raised (a write it landed over) has started its all-gathers too
            self._settle()

    def _before_optimizer_load(self) -> None:
        """The user's optimizer.load_state_dict is about to load a state (optim/state_dicts.py): the
        update in flight lands first, and the chunk layout stays as it is (a re-pack at the first
        forward would leave the loaded state with the old pieces)."""
        self._expect_idle("optimizer.load_state_dict")
        self.apply_delayed_update()
        self.fix_layout()

    def _before_load(self) -> bool:
        """model.load_state_dict is about to write parameters (module_state.py): whether its hooks
        should write the chunks (not inside full_parameters(), whose exit writes them back)."""
        if self.phase is TrainingPhase.FULL_PARAMETERS:
            return False
        self._expect_idle("load_state_dict")
        self._quiesce()
        return True

    def _params_written(self, params) -> None:
        """Stage 3: `params` were written in place and their chunks are still gathered (runtime/
        param_writes.py): their values go into this rank's shards and masters. Not while a delayed
        update is in flight, which will land over them."""
        if self.optim.update is UpdateState.IN_FLIGHT:  # on every rank alike: each made the same writes
            raise write_lost([self.names[id(p)] for p in params])
        for p in params:
            (c, s), value = self.layout.slot_of[id(p)], local(p)
            if c.holds_other_values(s, value):  # else nothing to keep in this rank's shard
                c.keep_written(s, value)

    def _settle(self) -> None:
        """Wait for every chunk still arriving (ArrivalHooks); at stage 3, keep what was written
        through a view of a parameter (Stage3Hooks.settle_lent)."""
        if self.hooks is not None:
            self.hooks.settle_lent()
        if self._arrivals is not None:
            self._arrivals.settle()
        self.optim.await_arrivals()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer, over this rank's master pieces (its state dict, an LR scheduler)."""
        return self.optim.optimizer

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Collective: every rank gets the model's own state_dict keys with full fp32 parameter
        values (and buffers as they are), on the CPU, gathered a chunk at a time. `rank0_only`: only
        rank 0 keeps them (the others get {}), as FSDP's rank0_only and DCP's cpu_offload: one
        copy of the model in host memory, not one per rank."""
        from .state.checkpoint import full_state_dict
        return full_state_dict(self._state_view(), rank0_only)

    def full_optimizer_state_dict(self, rank0_only: bool = False) -> dict:
        """Collective: every rank gets the optimizer's state in torch's own format, as a plain torch
        optimizer over the model's parameters (the user's param groups, in order) holds it, each
        state whole and on the CPU: plain torch loads it, and so does `optimizer.load_state_dict` on
        an engine of any stage and world size. Save it from rank 0 beside full_state_dict()
        (state/full_optimizer.py). `rank0_only`: only rank 0 keeps it (the others get {})."""
        self._expect_idle("full_optimizer_state_dict()")
        from .state.full_optimizer import full_optimizer_state_dict
        return full_optimizer_state_dict(self._state_view(), rank0_only)

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
            raise EngineCallError("zeroshard: load_weights inside full_parameters(); load after it")
        return load_weights(self._state_view(), path, strict)

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
        self._expect_idle("save_pretrained")
        self._quiesce()
        return save_pretrained(self._state_view(), path, max_shard_size, dtype, submodule)

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
        return save(self._state_view(), root, tag, client_state, keep, omit_pending_grads)

    def load_checkpoint(self, path, tag: str | None = None, load_optimizer: bool = True) -> dict:
        """Collective: load a checkpoint (a root or a checkpoint directory) into this engine, after
        checking its files, model and optimizer (CheckpointError before anything changes otherwise).
        With tensor parallelism, a checkpoint of the same TP degree (any data-parallel size, stage
        or chunk size). Returns the saved `client_state` ({} if none)."""
        from .state.checkpoint_load import load
        if self.tp is not None:
            path = self.tp.checkpoint_path(path)
        return load(self._state_view(), path, tag, load_optimizer)

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = True):
        """Collective context manager: inside it every parameter of the module holds its whole fp32
        value (from the masters), at every stage, so the module's own API works as on an unwrapped
        model: `model.state_dict()`, `save_pretrained`, reading or editing weights in place. On exit,
        with `writeback`, the values are written back into the masters and the compute copies (as
        `model.load_state_dict` writes them). Holds the whole model in fp32 on every rank while open;
        the model's forward under torch.no_grad() runs on those values, but no training forward,
        backward or step inside it (FSDP's summon_full_params, DeepSpeed's GatheredParameters)."""
        self._expect_idle("full_parameters()")
        self._quiesce()
        with full_parameters(self.layout, self.hooks, self.params, writeback), \
                (self._casts.off() if self._casts is not None else contextlib.nullcontext()):
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
        layout = self.layout
        self.timeline = MemoryTimeline(self.module, lambda: layout.chunks, self.optim, self.cache, self.device,
                                       self.comm.rank, self.steps, steps, kept=self.reducer.buffers)
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
