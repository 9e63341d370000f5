"""User-facing configuration: one frozen dataclass, validated on construction.

A config can be given as a `Config`, a dict, or a path to a JSON or TOML file. Every key is checked;
an unknown key or a bad value raises ConfigError (a ValueError) naming the key and what it accepts.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import tomllib
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class Config:
    """How zeroshard trains a model.

    stage: ZeRO stage. 0 = plain data parallelism (gradients all-reduced, everything replicated);
        1 = fp32 master weights and optimizer states sharded; 2 = gradients sharded too;
        3 = 16-bit parameters sharded too, gathered chunk by chunk when a module needs them;
        'auto' = the planner picks 2 or 3 (and the cache size) from a profile of the model.
    precision: 'fp32', or 'bf16'/'fp16' for 16-bit compute with fp32 master weights (fp16 adds
        dynamic loss scaling that skips a step on overflow, on every rank alike).
    gradient_accumulation_steps: micro-batches per optimizer step.
    clip_grad_norm: max global L2 norm of the gradients over all shards; None disables clipping.
    chunk_size: capacity of one chunk in elements, or 'auto'. A parameter never straddles chunks,
        so the capacity is raised to the largest parameter if needed.
    cache_chunks: how many gathered chunks stage 3 may hold at once (the rCache); None = unlimited.
    prefetch: stage 3 gathers the next chunks of the recorded order ahead of their use (up to two
        with a cache_chunks, into free slots; up to five with none: runtime/cache.py).
    check_order: before every collective a module hook drives, and at each step, ranks compare what
        they are about to do, so ranks whose call order diverges, or that are a micro-batch or a step
        apart, get DivergedError instead of a hang or wrong data (ordering.py). The comparisons run
        in a thread of their own (host tensors) or as host round trips (CUDA): off the compute path.
    initial_loss_scale / loss_scale_window: fp16 dynamic loss scaling: the starting scale, and how
        many overflow-free steps before the scale doubles. Each overflow halves it.
    offload_optimizer: ZeRO-Offload (stages 1-3): every chunk's fp32 master and optimizer states
        live in host memory and the optimizer step runs on the CPU; reduced gradients are moved to
        the host during backward and updated parameters back to the device. 'disk' (ZeRO-Infinity):
        the optimizer steps on the CPU as with True, but between steps the masters and optimizer
        states live in files in offload_dir, streamed through a few host buffers chunk by chunk
        (runtime/disk_tier.py), so host memory holds a few chunks' states, not the model's.
    offload_dir: the disk tier's directory (offload_optimizer='disk', or offload='auto', which may
        then place chunks there): local to the node, on the fastest disk; each rank writes its own
        files there and removes them at exit.
    host_memory: bytes of host memory the planner may plan for (offload='auto'; default: the
        host's RAM), shared by the host's ranks. Chunks whose optimizer states do not fit it go to
        the disk tier when offload_dir is set.
    offload_params: stage 3 only: the 16-bit parameter shards also live in host memory and are
        uploaded when their chunk is gathered, so the device holds only what the rCache holds.
        'disk' (with offload_optimizer='disk'): they live in the disk tier's files instead, each
        read when its chunk is gathered (the rCache reading a few ahead along its schedule) and
        written by the step, so neither the device nor the host holds the model's parameters.
    offload: 'auto' = Elixir: profile the model, measure the machine, and let the planner choose the
        chunk size, the rCache size and, chunk by chunk, whether the optimizer states (stage 3: and the
        parameter shard) live on the device or the host (or, with offload_dir, past host_memory,
        the disk tier), for the fastest step that fits (`zeroshard.initialize` then needs
        `example_inputs`). False = only what the offload_* keys say.
    device_memory: bytes of device memory the planner may plan for (default: the device's total;
        on a machine without a GPU, its RAM). Set it to plan for a smaller device, or to leave room.
    delay_update_after: ZeRO-Offload's one-step delayed parameter update (DPU), for offload_optimizer
        without offload_params: from this optimizer step on (a count of steps; the ones before are
        exact, as the paper warms up), the CPU step of step t runs in a background thread while the
        forward and backward of step t+1 run on the device, and its result is applied at step t+1's
        step(). Each gradient is then computed on parameters one update older than in plain
        PyTorch: a different (by the paper, equally convergent) optimisation, which hides the CPU
        step. Saving a checkpoint or a state dict first applies the update in flight. None = off.
    offload_activations: tensors saved for backward (with activation checkpointing: the
        checkpoints) are kept in host memory between forward and backward (ZeRO-R's P_a+cpu).
    buffer_dtype / cast_forward_inputs / reduce_dtype: the mixed-precision policy under bf16/fp16
        (precision.py): floating buffers in the compute dtype ('compute', as model.to(dtype)) or
        kept in fp32 ('fp32'); every module with parameters casts its floating inputs to the compute
        dtype (True) or only the root's inputs are (False); gradients accumulated and reduced in the
        compute dtype ('compute') or in fp32 ('fp32': twice the gradient memory and traffic).
    nonfinite: what a NaN or inf gradient on any rank does, at every precision: 'ignore' (PyTorch's
        behaviour: the step applies it, and the parameters become NaN; fp16's loss scaling still
        skips such a step and halves the scale), 'skip' (every rank skips the step, as fp16 does,
        counted in stats()['skipped_steps']) or 'raise' (every rank raises NonFiniteError naming the
        step, having applied nothing; under fp16 once the loss scale is down to 1, since before
        that a lower scale may make the gradient finite).
    collective_timeout_s: how long a collective waits for the other ranks before every waiting rank
        raises zeroshard.CollectiveTimeoutError naming the collective and the optimizer step (a
        rank stopped, hung or far behind; one that died shows at once as a closed connection).
        Applied to the process group zeroshard makes (torchrun's environment) and to its own
        groups; a group you made keeps its own timeout, with a warning when that is longer.
    grad_norm: measure the global L2 norm of the gradients at every step, for stats()['grad_norm'],
        also without clipping (False saves one pass over the gradients when clipping is off). With
        tensor_parallel > 1 it is the whole model's: split parameters' shards summed over the
        TP group, replicated ones counted once.
    log_every: every this many optimizer steps, log stats()'s main figures (loss, learning rate,
        step time, tokens/s, grad norm, skipped steps) at INFO on the `zeroshard` logger, rank 0
        only; 0 = never.
    tensor_parallel: ranks per tensor-parallel group (tensor_parallel.py). With N > 1 the model must
        have been split with `parallelize_module` over `zeroshard.device_mesh(N)["tp"]`; ZeRO then
        runs over the mesh's data-parallel dimension (world / N ranks per group).
    partition_activations: ZeRO-R's P_a, with tensor_parallel > 1: every tensor saved for backward
        that all ranks of a TP group hold alike (with activation checkpointing: the checkpoints) is
        kept 1/N per rank and all-gathered over the TP group when backward needs it; with
        offload_activations the part waits on the host (P_a+cpu).
    leaf_modules: the modules stage 3 gathers as one unit with their whole subtree (units.py): a
        list of class names ('SwitchTransformersSparseMLP') and qualified module names
        ('encoder.block.1.layer.1.mlp'), and 'auto' for the mixture-of-experts blocks found in the
        model (a ModuleList/ModuleDict of same-shaped experts beside a router) and peft's adapters
        of a parameter (LoRA around a fused MoE's router and experts); 'auto' alone is the
        default, [] none. A mixture of experts with one module per expert needs its blocks to be
        leaves at stage 3: each rank runs only the experts its tokens were routed to, and
        gathering per expert would make ranks gather different chunks (DivergedError).
    compile: torch.compile the model's forward (runtime/compiled.py): True, or a dict of
        torch.compile's keyword arguments ({'backend': 'aot_eager'}, {'mode': 'max-autotune'}).
        Stages 0-2: the whole forward, as DDP + torch.compile compiles it, in graph segments of
        about one chunk each (each segment's gradients reduced while the backward goes on); each
        layer block's (the modules of the model's ModuleList of layers) where compile_scope says so
        or a front end wrapped the root's forward. Stage 3: each layer block's forward, its hooks
        outside the graph, as FSDP2's users compile each block they shard, gathered whole (a leaf
        unit); where the root is the one unit (a model of one chunk; with an unlimited rCache, as
        compile_scope says) the whole forward, in segments. Compiled once the chunk layout is final
        (after the first training forward, which runs eagerly). False (default): eager.
    compile_scope: what config compile compiles whole: 'auto' (default) the forward of a model of at
        most 8 layer blocks or of one chunk (stage 3: with an unlimited rCache, the root then its one
        unit), each block's beyond (a deep model compiled whole unrolls its layers: a 24-layer GPT-2
        took 87.5 s to compile against 17.0 s block by block); 'model' the whole forward at any depth
        (stage 3: needs one chunk or an unlimited rCache); 'blocks' each block's (also for one chunk).
    allow_nonfinite_weights: pretrained weights (initialize's `weights`, engine.load_weights) that
        hold NaN or inf are refused with WeightsError naming the tensors, unless this is True (a
        checkpoint that holds them on purpose).
    shard_group_size: hybrid sharding (distributed/shard_groups.py): model states are sharded over
        groups of this many consecutive data-parallel ranks and replicated across the groups
        (FSDP2's HSDP, DeepSpeed's MiCS); gradients are reduce-scattered inside a group, then each
        shard all-reduced across the groups. An integer dividing the data-parallel world, 'node'
        for the data-parallel ranks of one node (torchrun's LOCAL_WORLD_SIZE / tensor_parallel),
        or None (default) for the whole data-parallel world. Stages 1-3. With offload/stage
        'auto' the planner plans for a shard group (its memory is what one group shards); it does
        not choose G (`zeroshard plan MODEL --nodes ...` compares layouts across nodes).
    shard_optimizer_across_replicas: with shard_group_size below the data-parallel world, stages
        1-2: each rank's optimizer steps 1/R of its shard (R = world / shard_group_size), so the
        fp32 masters and optimizer states are split over all W ranks (ZeRO-1 over the replicas):
        the step reduce-scatters each gradient shard across the replica group and all-gathers the
        update back. The optimizer on the device, no delayed update, no 'auto'.
    hpz_group_size: hpZ (ZeRO++, shard_groups.py), stage 3: parameters stay sharded over the whole
        data-parallel world, and each chunk's gather leaves every rank a secondary shard (1/G of the
        chunk, G this many consecutive ranks); until the next step, gathers read those over the
        group of G and never leave it (the backward's, and later micro-batches' forwards). Costs
        the chunk's size / G per chunk in device memory. Same values as shard_group_size; not
        combined with it.
    init_seed: the base seed of a model built on the meta device (materialize.py): each tensor is
        initialised from it and its own name, so the model is the same at any world size, stage and
        chunk size.
    """

    stage: int = 2
    precision: str = "fp32"
    gradient_accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    chunk_size: int | str = "auto"
    cache_chunks: int | None = None
    prefetch: bool = True
    check_order: bool = True
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    offload_optimizer: bool | str = False
    offload_dir: str | None = None
    host_memory: int | None = None
    offload_params: bool | str = False  # True, False or 'disk'
    offload_activations: bool = False
    delay_update_after: int | None = None
    offload: bool | str = False
    buffer_dtype: str = "compute"
    cast_forward_inputs: bool = True
    reduce_dtype: str = "compute"
    device_memory: int | None = None
    init_seed: int = 0
    nonfinite: str = "ignore"
    collective_timeout_s: float = 600.0
    grad_norm: bool = True
    log_every: int = 0
    tensor_parallel: int = 1
    partition_activations: bool = False
    leaf_modules: str | tuple[str, ...] = "auto"
    compile: bool | dict = False
    compile_scope: str = "auto"
    allow_nonfinite_weights: bool = False
    shard_group_size: int | str | None = None
    hpz_group_size: int | str | None = None
    shard_optimizer_across_replicas: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype `precision` names."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are accumulated and reduced in (`reduce_dtype`)."""
        return torch.float32 if self.reduce_dtype == "fp32" else self.dtype

    @property
    def planned(self) -> bool:
        """Whether the planner decides stage, chunk size, cache and placement."""
        return self.offload == "auto" or self.stage == "auto"

    def __post_init__(self):
        def bad(key, valid):
            raise ConfigError(f"zeroshard config: {key}={getattr(self, key)!r} is invalid; valid: {valid}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if self.stage != "auto" and (not is_int(self.stage) or self.stage not in (0, 1, 2, 3)):
            bad("stage", "0, 1, 2, 3 or 'auto'")
        if self.offload not in (False, "auto"):
            bad("offload", "'auto' or false")
        if self.device_memory is not None and (not is_int(self.device_memory) or self.device_memory < 1):
            bad("device_memory", "an integer >= 1 (bytes), or None for the device's total")
        if isinstance(self.collective_timeout_s, bool) or not isinstance(self.collective_timeout_s, (int, float)) \
                or not 0 < self.collective_timeout_s < math.inf:
            bad("collective_timeout_s", "a finite number of seconds > 0")
        if not isinstance(self.grad_norm, bool):
            bad("grad_norm", "True or False")
        if not is_int(self.log_every) or self.log_every < 0:
            bad("log_every", "an integer >= 0")
        if self.nonfinite not in ("ignore", "skip", "raise"):
            bad("nonfinite", "'ignore', 'skip' or 'raise'")
        if not is_int(self.init_seed) or self.init_seed < 0:
            bad("init_seed", "an integer >= 0")
        if self.precision not in PRECISIONS:
            bad("precision", "'fp32', 'bf16' or 'fp16'")
        if not is_int(self.gradient_accumulation_steps) or self.gradient_accumulation_steps < 1:
            bad("gradient_accumulation_steps", "an integer >= 1")
        if self.clip_grad_norm is not None and (
            isinstance(self.clip_grad_norm, bool)
            or not isinstance(self.clip_grad_norm, (int, float))
            or not self.clip_grad_norm > 0
        ):
            bad("clip_grad_norm", "a number > 0, or None to disable")
        if self.chunk_size != "auto" and (not is_int(self.chunk_size) or self.chunk_size < 1):
            bad("chunk_size", "'auto' or an integer >= 1 (elements)")
        if self.cache_chunks is not None and (not is_int(self.cache_chunks) or self.cache_chunks < 1):
            bad("cache_chunks", "an integer >= 1, or None for unlimited")
        for key in ("buffer_dtype", "reduce_dtype"):
            if getattr(self, key) not in ("compute", "fp32"):
                bad(key, "'compute' (the precision's dtype) or 'fp32'")
        if self.offload_optimizer not in (True, False, "disk"):
            bad("offload_optimizer", "true, false or 'disk'")
        if self.offload_optimizer == "disk" and not (isinstance(self.offload_dir, str) and self.offload_dir):
            raise ConfigError("zeroshard config: offload_optimizer='disk' needs offload_dir, a directory on a local "
                              "disk for the tier's files (not tmpfs: that is host memory)")
        if self.offload_dir is not None and self.offload_optimizer != "disk" and not self.planned:
            raise ConfigError("zeroshard config: offload_dir is the disk tier's directory: it needs "
                              "offload_optimizer='disk' (or offload='auto')")
        if self.offload_dir is not None and not (isinstance(self.offload_dir, str) and self.offload_dir):
            bad("offload_dir", "a directory (a string)")
        if self.host_memory is not None and (not is_int(self.host_memory) or self.host_memory < 1):
            bad("host_memory", "bytes (an integer >= 1), or None for the host's RAM")
        if not (isinstance(self.offload_params, bool) or self.offload_params == "disk"):
            bad("offload_params", "true, false or 'disk'")
        if self.offload_params == "disk" and self.offload_optimizer != "disk":
            raise ConfigError("zeroshard config: offload_params='disk' keeps parameter shards in the disk tier: it "
                              "needs offload_optimizer='disk' (and offload_dir) too")
        if self.offload_params == "disk":  # its read failures are agreed within the shard group only
            other = [k for k, v in (("hpz_group_size", self.hpz_group_size), ("shard_group_size", self.shard_group_size),
                                    ("tensor_parallel", self.tensor_parallel != 1)) if v not in (None, False)]
            if other:
                raise ConfigError(f"zeroshard config: offload_params='disk' with {other[0]} is not supported yet: "
                                  "choose one")
        for key in ("prefetch", "check_order", "offload_activations",
                    "cast_forward_inputs", "allow_nonfinite_weights"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "true or false")
        if isinstance(self.initial_loss_scale, bool) or not isinstance(self.initial_loss_scale, (int, float)) \
                or not 0 < self.initial_loss_scale < math.inf:
            bad("initial_loss_scale", "a finite number > 0")
        if not is_int(self.loss_scale_window) or self.loss_scale_window < 1:
            bad("loss_scale_window", "an integer >= 1")

        if self.delay_update_after is not None:
            if not is_int(self.delay_update_after) or self.delay_update_after < 0:
                bad("delay_update_after", "an integer >= 0 (optimizer steps before updates are delayed), or None")
            if not self.offload_optimizer or self.offload_params:
                raise ConfigError("zeroshard config: delay_update_after delays the CPU optimizer step: it needs "
                                 "offload_optimizer=True and offload_params=False (with parameters on the host "
                                 "the step would write what the next forward reads)")
        if self.planned:
            if self.stage not in (2, 3, "auto"):
                raise ConfigError(f"zeroshard config: offload='auto' plans stage 2 or 3 (got stage {self.stage}); "
                                 "use stage 2, 3 or 'auto'")
            taken = [k for k in ("offload_optimizer", "offload_params") if getattr(self, k)]
            if taken:
                raise ConfigError(f"zeroshard config: with offload/stage 'auto' the planner decides placement; "
                                 f"remove {taken} (offload='auto' lets it offload)")
            if self.cache_chunks is not None:
                raise ConfigError("zeroshard config: cache_chunks is chosen by the planner with offload/stage "
                                 "'auto'; remove it (or set the stage and offload yourself)")
        if self.offload_optimizer and self.stage == 0:
            raise ConfigError("zeroshard config: offload_optimizer=True needs stage >= 1 (stage 0 keeps a "
                             "whole optimizer on every rank; stage 1 shards it, then offloads each shard)")
        if self.stage in (0, 1, 2):  # keys that only stage 3 reads: said once, not silently ignored
            if self.cache_chunks is not None:
                warnings.warn(f"zeroshard config: cache_chunks={self.cache_chunks} has no effect at stage "
                              f"{self.stage}: only stage 3 gathers chunks into a cache", stacklevel=3)
            if self.prefetch is not True:
                warnings.warn(f"zeroshard config: prefetch={self.prefetch} has no effect at stage {self.stage}: "
                              "only stage 3 gathers (and prefetches) chunks", stacklevel=3)
        if isinstance(self.leaf_modules, (list, tuple)):
            if not all(isinstance(n, str) and n for n in self.leaf_modules):
                bad("leaf_modules", "'auto', or a list of class names, qualified module names and 'auto'")
            object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
        elif self.leaf_modules != "auto":
            bad("leaf_modules", "'auto', or a list of class names, qualified module names and 'auto'")
        if isinstance(self.compile, dict):
            try:
                inspect.signature(torch.compile).bind(None, **self.compile)
            except TypeError as e:
                raise ConfigError(f"zeroshard config: compile={self.compile!r} is invalid: {e} (valid: True, False, "
                                  "or a dict of torch.compile's keyword arguments)") from None
        elif not isinstance(self.compile, bool):
            bad("compile", "True, False, or a dict of torch.compile's keyword arguments")
        if self.compile_scope not in ("auto", "model", "blocks"):
            bad("compile_scope", "'auto', 'model' or 'blocks'")
        if not is_int(self.tensor_parallel) or self.tensor_parallel < 1:
            bad("tensor_parallel", "an integer >= 1 (ranks per tensor-parallel group)")
        if not isinstance(self.partition_activations, bool):
            bad("partition_activations", "true or false")
        if self.partition_activations and self.tensor_parallel == 1:
            raise ConfigError("zeroshard config: partition_activations partitions activations over a tensor-parallel "
                             "group: it needs tensor_parallel > 1 (offload_activations alone keeps them on the host)")
        def group_size(v) -> bool:  # shard_group_size, hpz_group_size
            return v is None or v == "node" or (is_int(v) and v >= 1)
        if not group_size(self.shard_group_size):
            bad("shard_group_size", "an integer >= 1 (ranks per shard group), 'node', or None for the whole "
                                    "data-parallel world")
        if not group_size(self.hpz_group_size):
            bad("hpz_group_size", "an integer >= 1 (ranks per secondary group), 'node', or None (no hpZ)")
        if self.shard_group_size is not None:
            if self.stage == 0:
                raise ConfigError("zeroshard config: shard_group_size shards model states inside groups of ranks: "
                                  "stage 0 shards nothing (use stage 1, 2 or 3)")
        if self.shard_optimizer_across_replicas is not False:
            if not isinstance(self.shard_optimizer_across_replicas, bool):
                bad("shard_optimizer_across_replicas", "true or false")
            why = ("it splits the optimizer of hybrid sharding: set shard_group_size" if self.shard_group_size is None
                   else f"it needs stage 1 or 2 (got {self.stage})" if self.stage not in (1, 2)
                   else "the optimizer must stay on the device (not offloaded, not 'auto', no delayed update)"
                   if self.offload_optimizer or self.offload or self.delay_update_after is not None else None)
            if why:
                raise ConfigError(f"zeroshard config: shard_optimizer_across_replicas: {why}")
        if self.hpz_group_size is not None:
            if self.stage != 3:
                raise ConfigError(f"zeroshard config: hpz_group_size keeps secondary shards of stage 3's gathered "
                                  f"parameters: it needs stage 3 (got stage {self.stage})")
            if self.shard_group_size is not None:
                raise ConfigError("zeroshard config: hpz_group_size and shard_group_size are two ways to keep "
                                  "gathers inside a node (hpZ: parameters sharded over every rank, a secondary "
                                  "copy per node; HSDP: model states sharded per node): choose one")
            if self.planned:
                raise ConfigError("zeroshard config: hpz_group_size is not planned by offload/stage 'auto' yet; "
                                  "set the stage and offload yourself with it")
        if self.offload_params and self.stage != 3:
            raise ConfigError(f"zeroshard config: offload_params={self.offload_params!r} needs stage 3 (got stage "
                              f"{self.stage}): "
                             "only stage 3 keeps parameters sharded between uses")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(cfg: Config | dict | str | os.PathLike | None) -> Config:
    """Turn any accepted form of configuration into a validated `Config`."""
    if cfg is None:
        return Config()
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, (str, os.PathLike)):
        path = os.fspath(cfg)
        if not path.endswith((".toml", ".json")):
            raise ConfigError(f"zeroshard config: {path!r} must be a .json or .toml file")
        try:
            with open(path, "rb") as f:
                cfg = tomllib.load(f) if path.endswith(".toml") else json.loads(f.read())
        except OSError as e:
            raise ConfigError(f"zeroshard config: cannot read {path!r}: {e.strerror or e}") from None
        except (ValueError, tomllib.TOMLDecodeError) as e:  # JSONDecodeError, UnicodeDecodeError included
            kind = "TOML" if path.endswith(".toml") else "JSON"
            raise ConfigError(f"zeroshard config: {path!r} does not parse as {kind}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"zeroshard config must be a Config, a dict or a path, not {type(cfg).__name__}")
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"zeroshard config: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    return Config(**cfg)
