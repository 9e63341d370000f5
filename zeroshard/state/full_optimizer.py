"""`engine.full_optimizer_state_dict()`: the optimizer's state as a plain torch optimizer over the
model's parameters would hold it, on every rank: torch's own format (the user's param groups in
their order, a parameter's states whole, shaped as the parameter), on the CPU. It is what a DDP
loop saves from rank 0 beside `full_state_dict()`: plain torch loads it, and so does
`optimizer.load_state_dict` on an engine of any stage and world size (optim/state_dicts.py slices
it). The optimizer's counterpart of full_state_dict, and a collective like it: each chunk's
elementwise states (Adam's moments) are gathered as its masters are (ShardGroups.all_gather_owned),
one state at a time (the device holds one chunk-sized buffer); scalar ones (Adam's step) travel as
objects. Every rank then holds the whole model's optimizer state in host memory for as long as it
keeps the dict, or rank 0 alone with `rank0_only`; engine.save_checkpoint writes shards instead,
for models whose state one process cannot hold.
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError
from .checkpoint import optim_kinds, quiesce
from .view import TrainingState


@torch.no_grad()
def full_optimizer_state_dict(view: TrainingState, rank0_only: bool = False) -> dict:
    """See Engine.full_optimizer_state_dict. `rank0_only`: the other ranks keep nothing and get {}."""
    quiesce(view)
    keep = not rank0_only or view.comm.rank == 0
    optim = view.optim
    if optim.tier is not None:
        raise CheckpointError("zeroshard: the optimizer's states are in the disk tier (offload_optimizer='disk'): "
                              "save them with engine.save_checkpoint (sharded), not full_optimizer_state_dict")
    if view.tp is not None:
        raise CheckpointError("zeroshard: with tensor_parallel each rank's optimizer states are of its own parts of "
                              "the parameters: save them with engine.save_checkpoint, not full_optimizer_state_dict")
    if optim.has_added_groups:  # groups added with add_param_group since the last step: as optimizer.state_dict()
        optim.take_added_groups()
    opt = optim.optimizer
    kinds = optim_kinds(view)  # collective: {parameter name: {state: kind}} over every rank
    orders = _group_orders(view, optim.groups)
    mine = {}  # parameter name -> {state: value} of this rank's scalar states
    for c in optim.chunks:
        for pc in c.pieces:
            got = opt.state.get(pc.param, {})
            for k, kind in kinds.get(pc.slot.name, {}).items():
                if kind != "elementwise" and k in got:
                    v = got[k]
                    mine.setdefault(pc.slot.name, {})[k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    scalars = {}
    for got in view.comm.all_gather_objects(mine):  # a parameter's pieces count the same steps
        for name, states in got.items():
            scalars.setdefault(name, states)
    whole = {name: dict(states) for name, states in scalars.items()}
    with view.shards.uncounted():
        for c in optim.chunks:
            for k in sorted({k for s in c.slots for k, kind in kinds.get(s.name, {}).items() if kind == "elementwise"}):
                _gather_state(view, opt, c, k, kinds, whole if keep else None)
    if not keep:
        return {}
    state, groups, n = {}, [], 0
    for g, order in zip(opt.param_groups, orders):
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                       "params": list(range(n, n + len(order)))})
        for j, name in enumerate(order):
            if name in whole:  # in the order the optimizer made them
                state[n + j] = {k: whole[name][k] for k in kinds[name] if k in whole[name]}
        n += len(order)
    return {"state": state, "param_groups": groups}


def _group_orders(view: TrainingState, groups) -> list[list[str]]:
    """Per param group, its parameters' names in the order a plain torch optimizer over them lists
    them: the user's own (an optimizer instance: every rank has the same), or, where a callable was
    handed this rank's pieces (each rank knows its own parameters' groups only), every rank's
    together in the model's order."""
    mine = [[groups.names[k] for k in order if k in groups.names] for order in groups.user_order]
    everyone = view.comm.all_gather_objects(mine)
    if all(o == mine for o in everyone):
        return mine
    place = {view.names[id(p)]: i for i, p in enumerate(view.params)}
    return [sorted({name for o in everyone for name in o[g]}, key=place.__getitem__) for g in range(len(mine))]


def _gather_state(view, opt, c, k: str, kinds: dict, whole: dict | None) -> None:
    """State `k` of every parameter of chunk c that has it on some rank, whole, into `whole`: each
    rank's pieces written at their places in a chunk-sized buffer (fp32, or the states' dtype where
    every piece of the chunk has one dtype), its owned range gathered."""
    dtypes = {got[k].dtype for pc in c.pieces if k in (got := opt.state.get(pc.param, {}))}
    dtypes = set().union(*view.comm.all_gather_objects(dtypes))
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    full = torch.zeros(c.padded_numel, dtype=dtype, device=view.device)
    for pc in c.pieces:
        v = opt.state.get(pc.param, {}).get(k)
        if v is not None:
            full[pc.lo:pc.hi].copy_(v.reshape(-1))
    if c.owned_range != (0, c.padded_numel):
        view.shards.all_gather_owned(full)
    for s in c.slots if whole is not None else ():
        if kinds.get(s.name, {}).get(k) == "elementwise":
            value = full[s.offset:s.offset + s.numel].view(s.shape)
            whole.setdefault(s.name, {})[k] = value.cpu().clone()
