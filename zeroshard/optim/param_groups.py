"""Param groups: which of the user's optimizer groups each master piece (chunks.py) is stepped in.

The user gives either a torch optimizer built over the model's own parameters, with any param groups
(as every fine-tuning script builds `AdamW(grouped_parameters)`), or a callable that builds one over
the tensors it is handed. Either way the optimizer ends up stepping this rank's master pieces, each
in the group its parameter belongs to, so each group's hyperparameters (and an LR scheduler's
changes to them) apply to exactly its parameters:
- an optimizer instance is used as it is: only the tensors in its groups change;
- a callable is given this rank's pieces; one that ignores them and builds groups from the model's
  own parameters is taken as if that optimizer had been passed (it used to train nothing).
A trainable parameter in no group is never stepped, as in torch. Some optimizers make state when
built (Adagrad's accumulator): it is made again for the pieces whenever they change. Also here: the
default optimizer, and `probe_state`, which finds what state the user's optimizer keeps.
"""
from __future__ import annotations

import inspect

import torch

from ..errors import ConfigError, FrozenParameterError
from ..runtime.placeholder import real_parameter


class ParamGroups:
    """`optimizer`: the user's optimizer instance or callable; `names`: id(model parameter) -> name."""

    def __init__(self, optimizer, names: dict[int, str]):
        self.user_optimizer = optimizer
        if isinstance(optimizer, torch.optim.Optimizer):  # now, while the parameters still hold their values
            _check_fresh(optimizer)
        self.names = names
        self.group_of: dict[int, int] = {}  # id(model parameter) -> its group index
        self.default_group: int | None = None  # the group of a parameter not in group_of
        self.state_at_build = False  # the optimizer made state when it was built (Adagrad)
        self._by_position = False  # a callable split the tensors it was handed into several groups
        self.known_groups = 0  # the optimizer's groups at the last assign: more are the user's add_param_group
        # Per group, the model parameters (ids) in the order a plain torch optimizer over them lists
        # them: torch's own state_dict format (state_dicts.py). A callable handed pieces saw no such
        # order: its groups take the model's.
        self.user_order: list[list[int]] = []

    def build(self, pieces) -> torch.optim.Optimizer:
        """The optimizer to step `pieces` (this rank's master pieces) with, and each parameter's group."""
        if isinstance(self.user_optimizer, torch.optim.Optimizer):
            opt, self.group_of = self.user_optimizer, owned_groups(self.user_optimizer, self.names)
        else:
            # An optimizer refuses an empty list: a rank without pieces hands it an empty tensor.
            given = [pc.param for pc in pieces] or [torch.nn.Parameter(torch.empty(0))]
            opt = self.user_optimizer(given)
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError("zeroshard: optimizer must be a torch.optim.Optimizer or a callable returning "
                                 f"one, got {type(opt).__name__}")
            param_of = {id(pc.param): pc.slot.param for pc in pieces}
            if all(id(p) in param_of or p is given[0] for g in opt.param_groups for p in g["params"]):
                self.group_of = {id(param_of[id(p)]): i for i, g in enumerate(opt.param_groups)
                                 for p in g["params"] if id(p) in param_of}
                # After a re-pack this rank may own pieces of parameters it was not handed: with one
                # group they join it; with several there is no telling which (assign raises).
                self.default_group = 0 if len(opt.param_groups) == 1 else None
                self._by_position = len(opt.param_groups) > 1
            else:  # built from the model's own parameters
                self.group_of = owned_groups(opt, self.names)
        if self.group_of and all(id(p) in self.names for g in opt.param_groups for p in g["params"]):
            self.user_order = [[id(p) for p in g["params"]] for g in opt.param_groups]
        else:
            self.user_order = [[k for k in self.names if self.group_of.get(k) == i] for i in range(len(opt.param_groups))]
        self.state_at_build = bool(opt.state)
        self.known_groups = len(opt.param_groups)
        return opt

    def assign(self, opt: torch.optim.Optimizer, pieces, new=None) -> None:
        """Put each piece in its parameter's group (replacing the groups' tensors). `new`: the
        pieces that join an optimizer that has stepped (parameters unfrozen since initialize):
        only they get the state the optimizer makes when built (Adagrad's accumulator). Groups the
        user added since the last assign (`add_param_group`) are taken first (take_added): their
        parameters' pieces join them, new as well."""
        taken = self.take_added(opt) if self.added(opt) else set()
        if taken:
            new = list(new or ()) + [pc for pc in pieces if id(pc.slot.param) in taken]
        groups = [[] for _ in opt.param_groups]
        for pc in pieces:
            g = self.group_of.get(id(pc.slot.param), self.default_group)
            if g is None and self._by_position and new is not None:
                raise FrozenParameterError(
                    f"zeroshard: parameter {pc.slot.name} was frozen at initialize and is now unfrozen, but the "
                    "optimizer callable split the tensors it was given into several param groups, so there is no "
                    "telling which group it joins: pass a torch optimizer built over all the model's parameters "
                    "(frozen ones included, in the groups they should train in), as gradual unfreezing in plain "
                    "PyTorch needs")
            if g is None and self._by_position:
                raise ConfigError("zeroshard: the optimizer callable built several param groups from the tensors "
                                   "it was given, and chunks were re-packed since: pass a torch optimizer built "
                                   "over the model's parameters (any groups) instead")
            if g is not None:  # a trainable parameter the optimizer does not hold: never stepped, as in torch
                groups[g].append(pc.param)
        for group, params in zip(opt.param_groups, groups):
            group["params"] = params
        self.known_groups = len(opt.param_groups)
        if self.state_at_build and new is None:
            opt.state.clear()
            opt.state.update(state_at_build(opt, groups))
        elif self.state_at_build:
            joined = {id(pc.param) for pc in new}
            opt.state.update(state_at_build(opt, [[p for p in ps if id(p) in joined] for ps in groups]))

    def added(self, opt: torch.optim.Optimizer) -> bool:
        """The user added param groups since the last assign (`optimizer.add_param_group`)."""
        return len(opt.param_groups) > self.known_groups

    def take_added(self, opt: torch.optim.Optimizer) -> set[int]:
        """Each model parameter in a group added since the last assign joins that group, as in
        torch (assign then gives the group its pieces). Returns their ids. ValueError, before
        anything changes, for a tensor that is not one of the model's parameters or a parameter
        already in a group (torch's add_param_group refuses that too, but cannot see it here:
        the earlier groups hold master pieces, not the parameters)."""
        joined = {}
        for i in range(self.known_groups, len(opt.param_groups)):
            for p in map(real_parameter, opt.param_groups[i]["params"]):
                if id(p) not in self.names:
                    raise ConfigError(f"zeroshard: optimizer.add_param_group was given a tensor of shape "
                                     f"{tuple(p.shape)} that is not a parameter of the model")
                if id(p) in self.group_of or id(p) in joined:
                    raise ConfigError(f"zeroshard: optimizer.add_param_group was given parameter "
                                     f"{self.names[id(p)]}, which is already in a param group")
                joined[id(p)] = i
        self.group_of.update(joined)
        self.user_order += [[k for k, g in joined.items() if g == i] for i in range(self.known_groups, len(opt.param_groups))]
        return set(joined)


def owned_groups(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[int, int]:
    """The param group index of each model parameter `opt` holds (by id); raises ValueError if it
    holds a tensor that is not one of the model's parameters (`names`: id -> name)."""
    group_of = {}
    for i, g in enumerate(opt.param_groups):
        for p in g["params"]:
            if id(p) not in names:
                raise ConfigError(f"zeroshard: the optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                                 "parameter of the model: build it over the model's parameters (any param "
                                 "groups), or pass a callable that takes the tensors zeroshard gives it")
            if id(p) in group_of:
                raise ConfigError(f"zeroshard: parameter {names[id(p)]} is in two param groups of the optimizer")
            group_of[id(p)] = i
    return group_of


def _check_fresh(opt: torch.optim.Optimizer) -> None:
    """Raise ValueError if `opt` holds more state than it made when built (it has stepped)."""
    if opt.state and not _same_state(opt.state, state_at_build(opt, [g["params"] for g in opt.param_groups])):
        raise ConfigError("zeroshard: the optimizer already has state (it has stepped): pass a fresh one, and "
                         "restore optimizer state with engine.load_checkpoint")


def state_at_build(opt: torch.optim.Optimizer, params: list[list]) -> dict:
    """The state an optimizer like `opt` (its class, each group's hyperparameters) holds right after
    it is built over `params` (one list per group): empty for most, Adagrad's initial accumulator."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
              for g, ps in zip(opt.param_groups, params) if ps]
    return dict(type(opt)(groups, **_constructor_args(type(opt), opt.defaults)).state) if groups else {}


def _constructor_args(cls, hyper: dict) -> dict:
    """The entries of `hyper` (a group's or the defaults' hyperparameters) that `cls` takes as
    keyword arguments (AdamW's defaults hold a `decoupled_weight_decay` its constructor refuses)."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in hyper.items() if k != "params" and k in accepted}


def _same_state(a, b) -> bool:
    def same(x, y):
        if torch.is_tensor(x) and torch.is_tensor(y):  # meta tensors (a model built on meta) have no values
            return (x.shape, x.dtype) == (y.shape, y.dtype) if x.is_meta or y.is_meta else torch.equal(x, y)
        return x == y
    return a.keys() == b.keys() and all(a[p].keys() == b[p].keys() and all(same(a[p][k], b[p][k]) for k in a[p])
                                        for p in a)


def as_factory(optimizer):
    """A callable building an optimizer like `optimizer` (its class and first group's
    hyperparameters) over given tensors: what the planner and checkpoints probe. A callable is
    returned as it is."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    cls = type(optimizer)
    kw = _constructor_args(cls, optimizer.param_groups[0])
    return lambda params: cls(params, **kw)


def default_optimizer(host: bool):
    """AdamW, lr 1e-3: torch's, or zeroshard's CPUAdamW when the step runs on the host."""
    if host:
        from .cpu_adam import CPUAdamW
        return lambda params: CPUAdamW(params, lr=1e-3)
    return lambda params: torch.optim.AdamW(params, lr=1e-3)


PROBE_NUMEL = 64


def probe_state(make_opt) -> dict:
    """The state the user's optimizer keeps for one parameter, found by stepping it once on a
    PROBE_NUMEL-element tensor: what it holds per element, and its names."""
    p = torch.zeros(PROBE_NUMEL, requires_grad=True)
    p.grad = torch.zeros(PROBE_NUMEL)
    opt = make_opt([p])
    opt.step()
    return dict(opt.state.get(p, {}))
