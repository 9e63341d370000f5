"""`optimizer.state_dict()` and `optimizer.load_state_dict()` called on the user's own optimizer, as
plain PyTorch code calls them (a custom loop saving `{"model": ..., "optimizer": ...}`, a resume from a
DDP run's checkpoint). The optimizer steps master pieces (runtime/packing.py's MasterPiece: a whole
parameter, or the elements [lo, hi) of one that this rank owns), so torch's own methods would index
its state by pieces, in chunk order. Hooks on the optimizer translate:

- state_dict(): where every piece this rank steps is a whole parameter (stage 0, or a world of one),
  the state is listed in the order of the parameters in the user's groups: torch's own format, which
  a plain torch optimizer (and every rank) loads. Otherwise each rank's dict holds its own pieces,
  and its `zeroshard` entry lists the element ranges (parameter name, lo, hi) each index holds (a
  warning says so, once: DDP code saves rank 0's dict alone). engine.full_optimizer_state_dict()
  (state/full_optimizer.py) is torch's own format at every stage.
- load_state_dict(): takes either form, from any layout whose elements cover this rank's pieces:
  a plain torch or DDP run's state resumes at any stage and world size; a rank's own pieces load into
  the same pieces only (the same rank, world size, stage and chunk size). Anything else raises
  CheckpointError before any state changes, on every rank (load_state_dict is then collective, as
  every rank holds a part). Elementwise states (one value per parameter element) are sliced; others
  (Adam's step) are copied whole.

zeroshard's own loads (checkpoint_load.py) go through `own_load()`, untranslated.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..errors import CheckpointError

ENTRY = "zeroshard"  # the state_dict entry: {"ranges": [[parameter name, lo, hi] per index], "rank", "world"}


class StateDicts:
    """The hooks on the user's optimizer `opt`. `chunks()`: the trainable chunks, whose master pieces
    it steps; `groups`: ParamGroups (user_order, names); `comm`: the data-parallel group;
    `before_load()`: called before a state loads (the engine lands a delayed update and fixes its
    chunk layout, whose re-pack would otherwise drop the loaded state); `tiered`: a disk tier holds
    the states (its records load through engine.load_checkpoint only); `before_save()`: called
    before torch lists the state (groups added with add_param_group are taken first)."""

    def __init__(self, opt: torch.optim.Optimizer, chunks, groups, comm, before_load, tiered: bool = False,
                 before_save=lambda: None):
        self.chunks, self.groups, self.comm, self.before_load = chunks, groups, comm, before_load
        self.tiered = tiered  # the disk tier's records, not optimizer.state, hold states between steps
        self._own = False
        self._warned = False
        opt.register_state_dict_pre_hook(lambda _: before_save())
        opt.register_state_dict_post_hook(self._saved)
        opt.register_load_state_dict_pre_hook(self._loading)

    def _pieces_by_tensor(self) -> dict:
        """id(the tensor the optimizer steps) -> its master piece, for this rank's pieces."""
        return {id(pc.param): pc for c in self.chunks() for pc in c.pieces}

    @contextlib.contextmanager
    def own_load(self):
        """zeroshard's own `load_state_dict` calls (its state already indexed by pieces)."""
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def _ranges(self, opt) -> list[list]:
        """[parameter name, lo, hi] of each tensor `opt` steps, in its groups' order."""
        of = self._pieces_by_tensor()
        return [list(_elements(of[id(p)])) for g in opt.param_groups for p in g["params"] if id(p) in of]

    def _whole(self, opt) -> list[list[int]] | None:
        """Per group, the index in `opt`'s own listing of each parameter in the user's order (None
        for a frozen one); None unless every piece is a whole parameter and this rank steps every
        trainable parameter of the groups."""
        of = self._pieces_by_tensor()
        listed = [p for g in opt.param_groups for p in g["params"]]
        if len(self.groups.user_order) != len(opt.param_groups) or any(id(p) not in of for p in listed):
            return None
        index = {}
        for i, p in enumerate(listed):
            pc = of[id(p)]
            if pc.hi - pc.lo != pc.slot.numel:
                return None
            index[id(pc.slot.param)] = i
        trained = {id(s.param) for c in self.chunks() for s in c.slots}
        if any(k in trained and k not in index for order in self.groups.user_order for k in order):
            return None  # a piece of it is another rank's
        return [[index.get(k) for k in order] for order in self.groups.user_order]

    def _saved(self, opt, sd: dict) -> dict:
        whole = self._whole(opt)
        if whole is None:
            if not self._warned:  # DDP code saves rank 0's dict alone: the other ranks' states would be lost
                self._warned = True
                warnings.warn("zeroshard: optimizer.state_dict() at stage >= 1 above a world of 1 holds this rank's "
                              "shard of the optimizer's state only: save one per rank (each loads into the same "
                              "rank, world size, stage and chunk size), or take engine.full_optimizer_state_dict() "
                              "(collective; torch's own format, which any layout loads) or engine.save_checkpoint()",
                              stacklevel=5)  # the caller of torch's state_dict, past its two wrappers
            return {**sd, ENTRY: {"ranges": self._ranges(opt), "rank": self.comm.rank, "world": self.comm.world}}
        out_state, out_groups, n = {}, [], 0
        for g, order in zip(sd["param_groups"], whole):
            out_groups.append({**g, "params": list(range(n, n + len(order)))})
            for j, i in enumerate(order):
                if i is not None and i in sd["state"]:
                    out_state[n + j] = sd["state"][i]
            n += len(order)
        return {"state": out_state, "param_groups": out_groups}

    def _loading(self, opt, sd: dict) -> dict | None:
        if self._own:
            return None
        if self.tiered:
            raise CheckpointError("zeroshard: the optimizer's states are in the disk tier (offload_optimizer="
                                  "'disk'): load them with engine.load_checkpoint, not optimizer.load_state_dict")
        self.before_load()
        try:
            out, why = self._translate(opt, sd), None
        except CheckpointError as e:
            out, why = None, str(e)
        whys = self.comm.all_gather_objects(why)
        failed = [(r, w) for r, w in enumerate(whys) if w]
        if failed:
            r, w = failed[0]
            raise CheckpointError(w if r == self.comm.rank or len(whys) == 1 else f"rank {r}: {w}")
        return out

    def _translate(self, opt, sd: dict) -> dict:
        """`sd` indexed as `opt` steps this rank's pieces now, or CheckpointError."""
        saved_groups = sd.get("param_groups")
        if not isinstance(saved_groups, list) or not isinstance(sd.get("state"), dict):
            raise CheckpointError("zeroshard: optimizer.load_state_dict was given no torch optimizer state dict "
                                  "('state' and 'param_groups')")
        if len(saved_groups) != len(opt.param_groups):
            raise CheckpointError(f"zeroshard: the optimizer state dict has {len(saved_groups)} param groups, this "
                                  f"optimizer {len(opt.param_groups)} (add the groups added since before loading)")
        held = self._held(saved_groups, sd.get(ENTRY))
        of = self._pieces_by_tensor()
        state, groups, n = {}, [], 0
        for g, saved in zip(opt.param_groups, saved_groups):
            groups.append({**{k: v for k, v in saved.items() if k not in ("params", "param_names")},
                           "params": list(range(n, n + len(g["params"])))})
            for p in g["params"]:
                pc = of.get(id(p))
                if pc is None:  # the stand-in a callable is handed on a rank without pieces
                    n += 1
                    continue
                name, lo, hi = _elements(pc)
                ranges = held.get(name, [])
                found = next(((i, a, b) for i, a, b in ranges if a <= lo and hi <= b), None)
                if found is None:
                    raise CheckpointError(
                        f"zeroshard: the optimizer state dict holds no state for elements [{lo}, {hi}) of {name}, which "
                        f"this rank steps ({_holds(ranges)}): a rank's own optimizer.state_dict() at stage >= 1 holds "
                        "its shard only, and loads into the same rank, world size, stage and chunk size; "
                        "engine.save_checkpoint and load_checkpoint reshard")
                i, a, b = found
                if i in sd["state"]:
                    state[n] = {k: _slice(v, lo - a, hi - a, b - a, pc.shape, name, k) for k, v in sd["state"][i].items()}
                n += 1
        return {"state": state, "param_groups": groups}

    def _held(self, saved_groups: list, entry) -> dict[str, list[tuple]]:
        """Parameter name -> [(saved index, lo, hi)] of what the state dict holds."""
        indices = [i for g in saved_groups for i in g["params"]]
        if entry is not None:
            ranges = entry.get("ranges", [])
            if len(ranges) != len(indices):
                raise CheckpointError("zeroshard: the optimizer state dict's zeroshard entry does not match its groups")
            held = zip(indices, ranges)
        else:  # torch's own format: each group's parameters in the order the user's groups list them
            names = self.groups.names
            known = set(names.values())
            numel = {s.name: s.numel for c in self.chunks() for s in c.slots}
            held = []
            for g, order in zip(saved_groups, self.groups.user_order):
                if "param_names" in g:
                    listed = list(g["param_names"])
                elif len(g["params"]) == len(order):
                    listed = [names[k] for k in order]
                else:
                    raise CheckpointError(
                        f"zeroshard: a param group of the optimizer state dict lists {len(g['params'])} parameters, the "
                        f"optimizer's {len(order)}: saved from an optimizer over other parameters?")
                for i, name in zip(g["params"], listed):
                    if name not in known:
                        raise CheckpointError(f"zeroshard: the optimizer state dict names {name}, not a parameter of "
                                              "the model")
                    # a parameter no trainable chunk holds (frozen) has no state to give
                    held.append((i, [name, 0, numel.get(name, 0)]))
        out: dict[str, list[tuple]] = {}
        for i, (name, lo, hi) in held:
            out.setdefault(name, []).append((i, lo, hi))
        return out


def _elements(pc) -> tuple[str, int, int]:
    """(parameter name, lo, hi): the elements of its parameter that master piece `pc` holds."""
    return pc.slot.name, pc.lo - pc.slot.offset, pc.hi - pc.slot.offset


def _holds(ranges: list[tuple]) -> str:
    return "it holds " + ", ".join(f"[{a}, {b})" for _, a, b in ranges) if ranges else "it holds none of it"


def _slice(v, a: int, b: int, saved_numel: int, shape: torch.Size, name: str, key):
    """State `key` of elements [a, b) of a saved range of `saved_numel` elements, shaped `shape`: a
    copy (torch's load keeps a scalar tensor such as Adam's step as given, and the step counts it
    up in place: the user's dict, loaded again elsewhere, would start from a later step)."""
    if not torch.is_tensor(v):
        return v
    if v.dim() == 0 or (v.numel() != saved_numel and v.numel() == 1):
        return v.clone()
    if v.numel() != saved_numel:
        raise CheckpointError(f"zeroshard: optimizer state {key!r} of {name} has {v.numel()} values for "
                              f"{saved_numel} elements: only states of one value per element can be split")
    return v.reshape(-1)[a:b].clone().reshape(shape)
