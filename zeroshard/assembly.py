"""The engine's construction, as named steps (as FSDP2's fully_shard and torchtitan's parallelize
steps read): join the world, plan, read the model, make the parts, pack the chunks. Each step takes
what it needs and returns what it made; `Engine.__init__` (engine.py) runs them in order and keeps
the results. The hooks call back into the engine through `EngineCalls`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from .config import Config
from .errors import ConfigError, TierFileError
from .distributed.collectives import Comm, default_device, init_process_group
from .distributed.shard_groups import ShardGroups, resolve_group_size
from .distributed.tensor_parallel import TensorParallel, local_shape
from .optim.grad_agreement import TensorParallelNorm
from .optim.loss_scale import LossScaler
from .optim.optimizer import ShardedOptimizer
from .optim.param_groups import as_factory, default_optimizer
from .planning.auto_plan import plan_for
from .runtime.arrival import ArrivalHooks
from .runtime.cache import ChunkCache
from .runtime.compiled import root_is_one_unit
from .runtime.disk_tier import MASTERS, DiskTier, Holding, shards
from .runtime.packing import auto_chunk_size, pack_groups
from .runtime.hooks import Stage3Hooks
from .runtime.layout import ChunkLayout, list_parameters, resolve_state
from .runtime.materialize import InitialValues
from .runtime.placeholder import catch_gradients
from .runtime.grad_readers import GradReaders, guard_grad_readers
from .runtime.module_state import StateDictLoading, guard_moves, rebind, route_zero_grad, sync_generation
from .runtime.replacements import refuse_rewrap, unwatch, watch
from .runtime.offload import Placement, Transfer
from .runtime.partitioned_activations import PartitionedActivations
from .runtime.precision import InputCasts, cast_buffers
from .runtime.reducer import GradientReducer
from .runtime.saved_tensors import SavedTensorHooks
from .units import direct_params, leaf_modules, with_blocks

log = logging.getLogger("zeroshard")


@dataclass(frozen=True)
class World:
    """Where the engine runs and whom it talks to."""
    device: torch.device
    tp: TensorParallel | None  # the tensor-parallel side; ZeRO runs over its "dp" group
    comm: Comm  # the data-parallel group: the step's divisor, flags and norm, checkpoints
    shards: ShardGroups  # the chunks' collectives: inside the shard group, across the groups
    # Every rank, TP peers included: what one rank decides or fails at (a plan, an unreadable file)
    # reaches them all, so none goes on alone.
    world_comm: Comm
    transfer: Transfer
    leaves: list[nn.Module]  # modules stage 3 gathers whole (units.py)


def join_world(module: nn.Module, config: Config, device: torch.device | None) -> World:
    """The device, the process group, tensor parallelism and the Comms over them."""
    refuse_rewrap(module)  # before anything changes
    unwatch(module)  # a dropped engine's watch: this one may replace parameters (TP, materialize)
    device = device or default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(device, config.collective_timeout_s)
    tp = TensorParallel(module, config.tensor_parallel, device) if config.tensor_parallel > 1 else None
    comm = Comm(device, group=tp.dp_group if tp else None)
    size = resolve_group_size(config.shard_group_size, comm.world, config.tensor_parallel)
    secondary = None if config.hpz_group_size is None else \
        resolve_group_size(config.hpz_group_size, comm.world, config.tensor_parallel, "hpz_group_size")
    shards = ShardGroups(comm, size, config.tensor_parallel, secondary_size=secondary,
                         split_optimizer=config.shard_optimizer_across_replicas)
    leaves = leaf_modules(module, config.leaf_modules)
    if config.compile and config.stage in (3, "auto"):  # stage 3 compiles each block, gathered whole
        leaves = with_blocks(module, leaves)
    return World(device, tp, comm, shards, tp.world_comm if tp else comm, Transfer(device), leaves)


@dataclass(frozen=True)
class Planned:
    config: Config  # the config that runs: with 'auto', what the plan chose
    plan: object | None  # planner.Plan with 'auto'
    profile: object | None  # profiler.Profile with 'auto'
    offload_dir: str | None = None  # the disk tier's directory (the plan's, when it places chunks there)


def plan(module: nn.Module, optimizer, config: Config, example_inputs, world: World) -> Planned:
    """offload/stage 'auto': profile and plan (its placement per chunk is applied by make_parts)."""
    if not config.planned:
        return Planned(config, None, None, config.offload_dir)
    # Hybrid sharding: model states are split over the shard group, so that is the world planned for.
    chosen, profile = plan_for(module, example_inputs, as_factory(optimizer), config, world.device,
                               world.shards.inside, world.world_comm, leaves=world.leaves)
    # The config that runs has no offload_dir of its own: the plan's placement says which chunks use it.
    return Planned(dataclasses.replace(config, offload=False, offload_dir=None, **chosen.config()), chosen, profile,
                   config.offload_dir)


@dataclass(frozen=True)
class Model:
    """What the engine reads of the model before packing it."""
    params: list[nn.Parameter]
    names: dict[int, str]  # id(param) -> its name
    shapes: dict[int, torch.Size]  # id(param) -> what this rank stores of it
    state_keys: list[tuple[str, object]]  # the module's own state_dict keys (layout.resolve_state)
    casts: InputCasts | None


def read_model(module: nn.Module, config: Config, world: World, weights, init_fn) -> tuple[Model, InitialValues]:
    """The parameters, their first values (weights, initialisers, or as built: returned apart, so the
    engine can drop them and the reader once packed), buffers' dtype."""
    params, names = list_parameters(module)
    shapes = {id(p): local_shape(p) for p in params}
    start = InitialValues(module, params, weights, init_fn, config.init_seed, config.allow_nonfinite_weights)
    if world.tp is not None:
        world.tp.sync_replicated(params)
    start.check(world.world_comm)  # collective: a file a rank cannot read raises on every rank
    cast_buffers(module, config.dtype, config.buffer_dtype)
    state_keys = resolve_state(module, world.device)
    casts = InputCasts(module, config.dtype) if config.dtype != torch.float32 and config.cast_forward_inputs \
        else None
    return Model(params, names, shapes, state_keys, casts), start


@dataclass(frozen=True)
class Parts:
    """The engine's parts, made before any chunk exists."""
    layout: ChunkLayout
    cache: ChunkCache
    reducer: GradientReducer
    scaler: LossScaler | None
    optim: ShardedOptimizer


def chunk_capacity(config: Config, numels: list[int]) -> int:
    """Elements per chunk for parameters of `numels` elements: config chunk_size (or its default),
    raised to the largest parameter."""
    cap = auto_chunk_size(numels) if config.chunk_size == "auto" else config.chunk_size
    return max(cap, max(numels))


def compile_units(module: nn.Module, config: Config, world: World, planned: Planned) -> World:
    """Stage 3 with config compile: `world` with the leaf units whose forwards are compiled. A model
    that packs into one chunk, or (an unlimited rCache) has few enough blocks, is one unit, the root
    (runtime/compiled.py's Notes: one chunk, one unit): chunks counted here, before any is built, as
    the layout will pack them (its parameters in module order, trainable apart from frozen). Otherwise
    its layer blocks and leaf_modules (join_world); with none, it raises ConfigError."""
    if not config.compile or config.stage != 3:
        return world
    params, _ = list_parameters(module)
    cap = chunk_capacity(config, [p.numel() for p in params])  # as make_parts sizes them
    chunks = len(pack_groups([local_shape(p).numel() for p in params], [p.requires_grad for p in params], cap))
    whole = planned.profile is None and root_is_one_unit(module, chunks, config.compile_scope, config.cache_chunks)
    # On every rank alike: tensor-parallel ranks' local shapes may pack into different counts
    if all(world.world_comm.all_gather_objects(whole)):
        return dataclasses.replace(world, leaves=[module])
    if config.compile_scope == "model":
        raise ConfigError("zeroshard config: compile_scope 'model' at stage 3 needs a model of one chunk, or an "
                          "unlimited rCache (no cache_chunks), and a forward of its class's (each unit's gathers "
                          "run in its hooks, outside any graph): 'auto' compiles each layer block")
    if not world.leaves:  # the root's graph would hold every hook
        raise ConfigError("zeroshard config: compile at stage 3 compiles each layer block (the modules of a "
                          "ModuleList of two or more layers) or, a model of one chunk whose forward is its "
                          "class's, the whole forward; this model is neither: name the modules to compile, "
                          "each gathered whole, with leaf_modules")
    return world


def make_parts(optimizer, config: Config, planned: Planned, world: World, model: Model) -> Parts:
    """The layout, rCache, reducer, loss scaler and sharded optimizer (no chunk built yet)."""
    numels = [p.numel() for p in model.params]
    cap = chunk_capacity(config, numels)
    placement = Placement(optimizer_on_host=bool(config.offload_optimizer), params_on_host=bool(config.offload_params),
                          optimizer_on_disk=config.offload_optimizer == "disk",
                          params_on_disk=config.offload_params == "disk")
    chosen = planned.plan
    placement_of = (lambda i: placement) if chosen is None else (lambda i: chosen.placement(i, config.stage))
    shard_tier = _disk_tier(planned.offload_dir, world, shards(config.dtype)) if placement.params_on_disk else None
    layout = ChunkLayout(model.names, model.shapes, stage=config.stage, comm=world.shards, dtype=config.dtype,
                         device=world.device, transfer=world.transfer, chunk_size=cap,
                         placement_of=placement_of,  # the config's placement, or the plan's per chunk
                         grad_dtype=config.grad_dtype, shard_tier=shard_tier)
    cache = ChunkCache(world.shards, config.cache_chunks, config.prefetch,
                       read_ahead=shard_tier.read_ahead if shard_tier is not None else None)
    reducer = GradientReducer(world.shards, config.stage, config.gradient_accumulation_steps)
    scaler = LossScaler(config.initial_loss_scale, config.loss_scale_window) if config.precision == "fp16" else None
    host = bool(config.offload_optimizer) or (chosen is not None and any(chosen.optimizer_on_host))
    on_disk = config.offload_optimizer == "disk" or (chosen is not None and any(chosen.optimizer_on_disk))
    tier = _disk_tier(planned.offload_dir, world) if on_disk else None
    delayed = config.delay_update_after is not None
    optim = ShardedOptimizer(optimizer or default_optimizer(host=host), world.comm, param_names=model.names,
                             stage=config.stage, dtype=config.dtype, accumulation=config.gradient_accumulation_steps,
                             clip_grad_norm=config.clip_grad_norm, scaler=scaler,
                             delay_after=config.delay_update_after,
                             side_comm=world.comm.side_channel() if delayed else None,
                             nonfinite=config.nonfinite, measure_norm=config.grad_norm, shards=world.shards, tier=tier,
                             gather_next=cache.after_update if config.stage == 3 else None,
                             tp_norm=None if world.tp is None else TensorParallelNorm(
                                 world.tp.comm, world.tp.rank, world.tp.comm.side_channel() if delayed else None))
    layout.when_built(optim.take_built)
    if config.check_order:
        world.shards.enable_order_checks()
    return Parts(layout, cache, reducer, scaler, optim)


def _disk_tier(directory: str, world: World, holding: Holding = MASTERS) -> DiskTier:
    """A disk tier (of masters, or of parameter shards), its directory tried on every rank: one
    rank's unusable directory raises TierFileError on all of them. Its files are named by the rank
    among every rank (TP peers included), so ranks sharing a node's disk never share one."""
    tier, error = None, None
    try:
        tier = DiskTier(directory, world.world_comm.rank, holding=holding)
    except TierFileError as e:
        error = e
    errors = world.world_comm.all_gather_objects(None if error is None else str(error))
    if error is not None:
        raise error
    bad = next(((r, m) for r, m in enumerate(errors) if m), None)
    if bad:
        raise TierFileError(f"zeroshard: rank {bad[0]} cannot use its disk tier: {bad[1]}")
    return tier


def pack(parts: Parts, model: Model, start: InitialValues, planned: Planned, world: World) -> None:
    """Pack the parameters into chunks (in profiled first-use order with 'auto', else as listed),
    give them their first values, and hand the chunks to the rCache and the optimizer."""
    profile = planned.profile
    order = model.params if profile is None else [model.params[i] for i in profile.first_use]
    parts.layout.build(order, start.fill, broadcast=start.broadcast)
    start.finish(world.world_comm, model.params, parts.layout.chunks, world.device)
    parts.layout.adopt_shards()
    parts.cache.set_chunks(parts.layout.chunks)
    parts.optim.attach(parts.layout.chunks)


@dataclass(frozen=True)
class EngineCalls:
    """The engine's methods the hooks call (weak methods: a dropped engine does not live on in them)."""
    zero_grad: Callable[[], None]  # model.zero_grad()
    leaf_backward_done: Callable  # stage 3: the gradient went back through a leaf unit
    before_load: Callable[[], bool]  # model.load_state_dict is about to write parameters
    grad_arrived: Callable  # a parameter's gradient was accumulated: (param) from its .grad, or (param, grad)
    owned: Callable  # of a list of tensors, the ids of those the engine trains (runtime/grad_readers.py)
    clip_grad_norm: Callable  # torch.nn.utils.clip_grad_norm_ given what the engine trains
    params_written: Callable  # stage 3: (params) written in place, their chunks gathered


@dataclass(frozen=True)
class Installed:
    hooks: Stage3Hooks | None
    loading: StateDictLoading
    arrivals: ArrivalHooks | None
    saved: SavedTensorHooks
    unhooked: list[nn.Parameter]  # parameters frozen now, with no gradient hook yet
    grad_readers: GradReaders  # torch.nn.utils' gradient readers know the engine's tensors while it keeps this
    watch: object  # runtime/replacements.py: the model is watched while the engine keeps this


def install_hooks(module: nn.Module, config: Config, world: World, model: Model, parts: Parts,
                  on: EngineCalls) -> Installed:
    """Stage-3 hooks, the module's own API (zero_grad, generate, moves, load_state_dict), the
    stage 1-2 arrival hooks, gradient hooks and saved-tensor hooks."""
    stage, layout, comm = config.stage, parts.layout, world.comm
    hooks = None
    if stage == 3:
        if world.leaves and comm.rank == 0:
            log.info("stage 3 gathers these modules whole (leaf_modules): %s",
                     ", ".join(sorted({type(m).__name__ for m in world.leaves})))
        hooks = Stage3Hooks(module, parts.cache, layout.chunks_of, model.names, model.shapes, config.dtype,
                            on_borrow=layout.forget, leaves=world.leaves, on_leaf_backward=on.leaf_backward_done,
                            on_write=on.params_written)
        layout.read_params_with(lambda m: hooks.params_of(m) if hooks.is_unit(m) else direct_params(m))
        parts.reducer.count_at_leaf_end(hooks.params_counted_at_leaf_end())
        # placeholder.py's Note: gradients past the placeholder
        catch_gradients([t for entries in hooks.placeholders.values() for _, t in entries], on.grad_arrived)
    route_zero_grad(module, on.zero_grad)
    # a forward is a collective
    sync_generation(module, on=(stage == 3 and world.shards.world > 1) or world.tp is not None)
    guard_moves(module, lambda: layout.chunks)
    writes = hooks.writes if hooks is not None else parts.optim.user_writes
    watched = watch(module, model.params, set_to_itself=writes.seen,  # a parametrization's bump is no write
                    rebind=lambda: rebind(layout.chunks))
    grad_readers = guard_grad_readers(on.owned, on.clip_grad_norm)
    loading = StateDictLoading(module, hooks.direct_real if hooks else direct_params, lambda: layout.slot_of, hooks,
                               on.before_load)
    delayed = config.delay_update_after is not None
    arrivals = ArrivalHooks(module, layout.chunks_of) \
        if stage in (1, 2) and (world.shards.world > 1 or delayed) else None
    for p in model.params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(on.grad_arrived)
    # The prefetch schedule is recorded over the first micro-batch that runs entirely on the
    # final packing (layout.py: chunks are re-packed in order of first use after the first).
    layout.record_first_use(module, world.leaves)
    partition = PartitionedActivations(world.tp.comm, world.transfer, config.offload_activations) \
        if config.partition_activations else None
    saved = SavedTensorHooks(world.device, world.transfer, hooks, lambda: layout.chunks, config.offload_activations,
                             partition)
    return Installed(hooks, loading, arrivals, saved, [p for p in model.params if not p.requires_grad], grad_readers,
                     watched)
