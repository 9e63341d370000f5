"""offload="auto" / stage="auto" at initialize: rank 0 profiles the model, measures the machine
and asks the planner (planner.py) for the fastest configuration that fits; every rank takes that
plan. And the profiled trace as the chunk sequence the rCache follows.
"""
from __future__ import annotations

import torch

from .planner import Plan, Planner, Target
from .profiler import Profile
from ..errors import ConfigError, PlanError


def plan_for(module, example_inputs, make_opt, config, device, comm, every=None, leaves=()) -> tuple[Plan, Profile]:
    """The engine's planning (offload/stage "auto"): profile, measure and plan on rank 0; every rank
    gets rank 0's plan, so all build the same chunks even if their measurements would differ.
    `comm`: the ranks ZeRO shards over; `every`: the ranks that take the plan of its rank 0 (default
    `comm`; with tensor parallelism the whole world, so every TP rank runs the same plan).
    With tensor parallelism the profile is rank 0's part of the split model (its local shards, its
    flops, its activations, its TP collectives); P_a is not modelled (activations are not divided
    by it: an overestimate). `leaves`: the modules stage 3 gathers whole (units.py)."""
    from .hardware import probe, probe_disk
    from .profiler import profile

    if example_inputs is None:
        raise ConfigError("zeroshard: offload/stage 'auto' profiles the model before training: pass "
                         "example_inputs=... to zeroshard.initialize (one micro-batch as the model is "
                         "called, e.g. {'input_ids': x, 'labels': x})")
    dtype = config.dtype
    mine = None
    every = every or comm
    if every.rank == 0:
        try:
            prof = profile(module, example_inputs, dtype=dtype, device=device, leaves=leaves)
        except Exception as e:  # noqa: BLE001 -- every rank waits for the plan: it raises on all of them
            mine = (None, None, f"offload/stage 'auto' profiles the model on the meta device, where it failed "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:300]}). A model whose forward depends "
                                "on its values (a mixture of experts routing by data, a Python branch on a tensor) "
                                "cannot be profiled there: set stage, cache_chunks and the offload keys yourself")
    if every.rank == 0 and mine is None:
        hw = probe(device, dtype).with_(device_memory=config.device_memory, host_memory=config.host_memory)
        if config.offload_dir is not None:  # a disk tier: its disk's figures
            read, write = probe_disk(config.offload_dir)
            hw = hw.with_(disk_read=read, disk_write=write)
        target = Target(hw, world=comm.world, accumulation=config.gradient_accumulation_steps,
                        optimizer_state_bytes=optimizer_state_bytes(make_opt),
                        tensor_parallel=config.tensor_parallel, disk=config.offload_dir is not None)
        planner = Planner(prof, target, chunk_size=None if config.chunk_size == "auto" else config.chunk_size)
        stage = config.stage if config.stage != "auto" else "auto"
        best = planner.plan(stage=stage, offload=config.offload == "auto")
        mine = (best, prof, None if best.fits else planner.why_nothing_fits(best))
    best, prof, why = every.broadcast_object(mine)
    if why is not None:
        raise PlanError(f"zeroshard: {why}")
    return best, prof


def optimizer_state_bytes(make_opt) -> int:
    """Bytes of optimizer state per parameter element (AdamW: 8, SGD with momentum: 4)."""
    if make_opt is None:
        return 8
    from ..optim.param_groups import PROBE_NUMEL, probe_state
    state = probe_state(make_opt)
    n = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return max(0, n // PROBE_NUMEL)


def profiled_sequence(prof: Profile, module, chunks_of) -> list[int]:
    """The profile's trace as the chunk indices stage 3 will acquire (`chunks_of(module)`: the
    chunks holding a module's parameters)."""
    modules = dict(module.named_modules())
    seq = []
    for ev in prof.trace:
        m = modules.get(ev.module)
        if m is not None:
            seq.extend(c.index for c in chunks_of(m))
    return seq
