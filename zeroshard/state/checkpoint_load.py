"""Loading a checkpoint into an view (Engine.load_checkpoint). Every rank holds a lease on the
version it reads (checkpoint_dirs.py), so no save removes it meanwhile. Before any value changes it
checks every file's size and checksum (the ranks split the files between them), that the
checkpoint's parameter names and shapes are this model's, and that its optimizer state is this
optimizer's; then the pieces are read into this rank's shards, whatever world size, stage or chunk
size saved them.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from .checkpoint import describe_model, frozen_tiered, mismatch, quiesce, runs, set_rng_state, tiered
from ..files.checkpoint_dirs import held, lease
from ..files.checkpoint_files import (Piece, SafeReader, dcp_load, failure, read_extra, read_meta, read_sums,
                               verify_all)
from ..errors import CheckpointError
from ..optim.param_groups import probe_state
from .view import TrainingState

log = logging.getLogger("zeroshard")


# -- load ------------------------------------------------------------------------------------------
def load(view: TrainingState, path, tag: str | None = None, load_optimizer: bool = True) -> dict:
    """See Engine.load_checkpoint. Every failure is a CheckpointError (torch's CheckpointException,
    a BaseException, included)."""
    try:
        return _load(view, path, tag, load_optimizer)
    except (CheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise failure(e, f"load checkpoint {path}", view.comm.timeout_s) from e


def _load(view, path, tag: str | None, load_optimizer: bool) -> dict:
    """See Engine.load_checkpoint. `path` is a root (its `latest`, or `tag`) or a checkpoint
    directory. load_optimizer=False loads the model (and buffers, counters, RNG) and clears the
    optimizer's state. Everything that can refuse the checkpoint runs before anything in
    the view changes: files, model, optimizer compatibility, agreement of scalar states."""
    quiesce(view)
    comm = view.comm
    t0 = time.perf_counter()
    with contextlib.ExitStack() as leases:
        found = error = None
        if comm.rank == 0:  # one resolution of `latest` for everyone
            try:
                found = leases.enter_context(lease(path, tag))
            except Exception as e:  # every rank must reach the broadcast
                error = str(e) if isinstance(e, CheckpointError) else f"zeroshard: reading {path}: {e}"
        found, error = comm.broadcast_object((found, error))
        if error:
            raise CheckpointError(error)
        missing = None
        if comm.rank != 0:
            try:
                leases.enter_context(held(found))
            except CheckpointError as e:
                missing = f"rank {comm.rank}: {e}"
        missing = next((m for m in comm.all_gather_objects(missing) if m), None)
        if missing:  # on every rank, not a wait on the others
            raise CheckpointError(missing)
        return _load_version(view, found, load_optimizer, t0)


def _load_version(view, found: str, load_optimizer: bool, t0: float) -> dict:
    """_load of version directory `found`, which every rank holds a lease on."""
    comm = view.comm
    sums = read_sums(found)
    meta = read_meta(found, sums)
    why = mismatch(meta, describe_model(view))
    if why:
        raise CheckpointError(f"zeroshard: checkpoint {found} is of another model:\n  {why}")
    verify_all(found, sums, comm)
    extra = read_extra(found)
    kinds = meta["optim_state"] if load_optimizer else {}
    if load_optimizer:
        _check_optimizer(view, found, kinds, extra["param_groups"])
    # A new chunk layout (if it was not fixed yet) changes no value: refusing after it changes nothing.
    _fix_layout(view, [n for n, _, _ in meta["params"]])
    # A parameter frozen at initialize whose optimizer state the checkpoint holds (unfrozen before
    # the save): its chunk becomes trainable, so the state has somewhere to go.
    view.thaw(frozenset(kinds))
    # Groups added since the last step (as torch needs them added before its load_state_dict)
    # hold the model's parameters until taken: taken now, their pieces get the saved state.
    if view.optim.has_added_groups:
        view.optim.take_added_groups()
    saved = SafeReader(found).read_metadata().state_dict_metadata
    small = _small_state(view, kinds, meta, saved)
    dcp_load(small, found, comm)

    # From here on values change.
    if view.stage == 3:
        view.cache.flush()
    for name, states in kinds.items():  # Python numbers the optimizer kept as such
        for k, kind in states.items():
            key = f"optim.state.{name}.{k}"
            if kind in ("int", "float") and key in small:
                small[key] = (int if kind == "int" else float)(small[key].item())
    for c in view.chunks:  # the disk tier's chunks are loaded into their records, one at a time
        if c.trainable and c.tier is not None:
            c.tier.adopt(c)
    pieces, opt_state = _piece_state(view, kinds)
    dcp_load(pieces, found, comm)
    opt_state.update(_load_tiered(view, kinds, found))
    _apply(view, opt_state, small, extra["param_groups"] if load_optimizer else None)
    for key in meta["buffers"]:
        with torch.no_grad():
            view.module.get_buffer(key).copy_(small[f"model.{key}"])

    view.restore_counters(meta["steps"])  # at a boundary: another accumulation works too
    if load_optimizer:
        # older checkpoints lack optimizer_steps: count as if every step had applied (only
        # delay_update_after reads it)
        view.optim.restore_counters(meta["skipped_steps"],
                                      meta.get("optimizer_steps", meta["steps"] + meta["skipped_steps"]))
    if view.scaler is not None and meta["loss_scale"] is not None:
        view.scaler.load_state_dict(meta["loss_scale"])
    prefix = f"rng.{comm.rank}."
    rng = {k[len(prefix):]: v for k, v in small.items() if k.startswith(prefix)}
    if rng:
        set_rng_state(rng, view.device)
    elif comm.rank == meta["world"]:  # once: the first rank the checkpoint has no RNG state for
        log.info("checkpoint saved at world %d: ranks %d.. keep their own RNG state",
                 meta["world"], meta["world"])
    if comm.rank == 0:
        now = view.config.to_dict()
        changed = {k: (v, now.get(k)) for k, v in meta["config"].items() if now.get(k) != v}
        log.info("loaded checkpoint %s (saved at world %d, stage %d; loaded at world %d, stage %d) "
                 "in %.2f s%s", found, meta["world"], meta["stage"], comm.world, view.stage,
                 time.perf_counter() - t0,
                 "; config now differs: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
                 if changed else "")
    return extra["client_state"] if extra["client_state"] is not None else {}


def _check_optimizer(view, found: str, kinds: dict, groups: list) -> None:
    """A parameter without saved state starts without state (torch's load_state_dict does the same
    for a parameter that was never stepped); the kinds of state must be this optimizer's."""
    theirs = set().union(*(set(k) for k in kinds.values())) if kinds else set()
    ours = set(probe_state(view.optim.make_opt)) if kinds else set()
    if theirs != ours:
        raise CheckpointError(f"zeroshard: checkpoint {found} holds optimizer state {sorted(theirs)}; this "
                              f"optimizer keeps {sorted(ours)}: another optimizer? Load with load_optimizer=False")
    if len(groups) != len(view.optim.optimizer.param_groups):
        raise CheckpointError(f"zeroshard: the checkpoint's optimizer has {len(groups)} parameter groups, this one "
                              f"{len(view.optim.optimizer.param_groups)}")


def _small_state(view, kinds: dict, meta: dict, saved: dict) -> dict:
    """What is loaded before anything changes: scalar optimizer states of this rank's master pieces,
    buffers and this rank's RNG states (fresh tensors, as the checkpoint's metadata `saved`
    describes them)."""
    state = {}
    for c in view.optim.chunks:
        for pc in c.pieces:
            for k, kind in kinds.get(pc.slot.name, {}).items():
                key = f"optim.state.{pc.slot.name}.{k}"
                if kind != "elementwise":
                    state[key] = torch.zeros(saved[key].size, dtype=saved[key].properties.dtype)
    for key in meta["buffers"]:
        md = saved[f"model.{key}"]
        state[f"model.{key}"] = torch.empty(md.size, dtype=md.properties.dtype)
    for key, md in saved.items():
        if key.startswith(f"rng.{view.comm.rank}."):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return state


def _fix_layout(view, order: list[str]) -> None:
    """Before the first training forward the view has not fixed its chunk layout (it re-packs in
    order of first use): take the checkpoint's order instead. A re-pack needs an optimizer with no
    state; otherwise the layout stays as it is (pieces load into any layout)."""
    if view.layout.final:
        return
    by_name = {view.names[id(p)]: p for p in view.params}
    view.fix_layout([by_name[n] for n in order] if not view.optim.optimizer.state else None)


def _piece_state(view, kinds: dict):
    """Pieces of each chunk's owned range, loaded in place: its master (its shard if frozen) and
    the elementwise optimizer states of its master pieces (the optimizer's own tensors when they
    fit: no second copy). Returns (DCP state, {id(master piece): {state name: tensor, or None for
    a scalar state}})."""
    state, opt_state = {}, {}
    opt = view.optim.optimizer
    for c in view.chunks:
        if tiered(c) or frozen_tiered(c):
            continue
        lo, hi = c.owned_range
        dst = (c.master if c.trainable else c.shard).detach()
        piece_of = {id(pc.slot): pc for pc in c.pieces}
        for s, start, a, b in runs(c, lo, hi):
            state[f"model.{s.name}"] = Piece(dst[a - lo:b - lo], s.shape, start)
            pc = piece_of.get(id(s))
            if pc is None or s.name not in kinds:
                continue
            old, bufs = opt.state.get(pc.param, {}), {}
            for k, kind in kinds[s.name].items():
                if kind != "elementwise":
                    bufs[k] = None  # a scalar: loaded before anything changed (_small_state)
                else:
                    v = old.get(k)
                    if not (torch.is_tensor(v) and v.shape == pc.param.shape and v.dtype == torch.float32):
                        v = torch.zeros_like(pc.param, dtype=torch.float32).detach()
                    bufs[k] = v
                    state[f"optim.state.{s.name}.{k}"] = Piece(v.detach().reshape(-1), s.shape, start)
            opt_state[id(pc.param)] = bufs
    return state, opt_state


@torch.no_grad()
def _load_tiered(view, kinds: dict, found: str) -> dict:
    """_piece_state and its load for the disk tier's chunks, one chunk at a time (a DCP load each, a
    collective: every rank has the same chunks): its record opened, the pieces read into it (master
    and elementwise states), its 16-bit copy refreshed, the record written back. The optimizer's
    tiered states are meta tensors (tiered_states.py), returned as _piece_state's are."""
    opt_state = {}
    for c in [c for c in view.chunks if frozen_tiered(c)]:  # a frozen shard in the parameter tier
        with c.shard_values(write=True):
            lo, hi = c.owned_range
            state = {f"model.{s.name}": Piece(c.shard[a - lo:b - lo], s.shape, start) for s, start, a, b in runs(c, lo, hi)}
            dcp_load(state, found, view.comm)
    for c in [c for c in view.chunks if tiered(c)]:
        c.tier.open(c)
        ok = False
        try:
            lo, hi = c.owned_range
            state, piece_of = {}, {id(pc.slot): pc for pc in c.pieces}
            for s, start, a, b in runs(c, lo, hi):
                state[f"model.{s.name}"] = Piece(c.master.detach()[a - lo:b - lo], s.shape, start)
                pc = piece_of.get(id(s))
                if pc is None or s.name not in kinds:
                    continue
                bufs = {}
                for k, kind in kinds[s.name].items():
                    bufs[k] = None  # a scalar: loaded before anything changed (_small_state)
                    if kind == "elementwise":
                        values = c.tier.field(c, k, torch.float32)[pc.lo - lo:pc.hi - lo]
                        state[f"optim.state.{s.name}.{k}"] = Piece(values[a - pc.lo:b - pc.lo], s.shape, start)
                        bufs[k] = torch.empty(pc.shape, dtype=torch.float32, device="meta")
                opt_state[id(pc.param)] = bufs
            dcp_load(state, found, view.comm)
            with c.shard_values(write=True, fresh=True):
                c.shard.copy_(c.master)
            ok = True
        finally:
            c.tier.close(c, write=ok)
    return opt_state


@torch.no_grad()
def _apply(view, opt_state: dict, small: dict, groups) -> None:
    """After the masters (and frozen shards) are loaded: refresh every 16-bit copy and (stages 1-2)
    the full chunks, and hand the optimizer its state: elementwise states from `opt_state`, scalar
    ones from `small` (groups None: no optimizer state loaded, so the optimizer starts afresh)."""
    shards = view.shards
    with shards.uncounted():
        for c in view.chunks:
            if c.trainable:
                c.zero_grad()
                if not c.master_is_shard and not tiered(c):  # (the tier's: _load_tiered)
                    c.shard.copy_(c.master)
            if view.stage in (1, 2):
                shards.all_gather_owned(c.full)
    opt = view.optim.optimizer
    # torch's packed param groups (params as running indices), without state_dict(): that refuses
    # while the disk tier holds states (tiered_states.py)
    index_of, current = iter(range(1 << 62)), []
    for g in opt.param_groups:
        current.append({**{k: v for k, v in g.items() if k != "params"}, "params": [next(index_of) for _ in g["params"]]})
    if groups is None:
        with view.optim.own_load():
            opt.load_state_dict({"state": {}, "param_groups": current})
        return
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    loaded, tier_held = {}, []
    for c in view.optim.chunks:
        for pc in c.pieces:
            if id(pc.param) in opt_state and id(pc.param) in index:
                states = opt_state[id(pc.param)]
                loaded[index[id(pc.param)]] = {k: small[f"optim.state.{pc.slot.name}.{k}"] if v is None else v
                                               for k, v in states.items() if v is None or not v.is_meta}
                tier_held += [(pc.param, k, v) for k, v in states.items() if v is not None and v.is_meta]
    # The saved hyperparameters (a schedule's lr, ...) of every key this optimizer knows.
    with view.optim.own_load():
        opt.load_state_dict({"state": loaded, "param_groups": [{**cur, **{k: v for k, v in g.items() if k in cur}}
                                                               for g, cur in zip(groups, current)]})
    for p, k, placeholder in tier_held:  # in the disk tier's records; torch's load would copy them
        opt.state[p][k] = placeholder
