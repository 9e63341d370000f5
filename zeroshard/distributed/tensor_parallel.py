"""Tensor parallelism beside ZeRO: zeroshard over a 2D device mesh (ZeRO-R's partitioned activations,
P_a, are in runtime/partitioned_activations.py).

How it composes with ZeRO (mesh, local shard, replicated parameter: docs/vocabulary.md):
- mesh: a 2D DeviceMesh with dimensions ("dp", "tp") (`device_mesh`). The model is split with
  PyTorch's tensor parallelism (`parallelize_module` over mesh["tp"]); zeroshard's chunks,
  reductions and gathers all run over mesh["dp"], so the ZeRO paper's volumes hold per
  data-parallel group, for 1/MP of the model.
- local shard: what this rank holds of a DTensor parameter (its `_local_tensor`). Chunks pack local
  shards as they pack plain parameters; the parameter stays the DTensor the model computes with,
  its local tensor a view into the chunk (`set_local`), as FSDP2 rebinds its sharded parameters.
- replicated parameter: a plain tensor parameter (not split by the plan). Every rank of a TP group
  holds all of it and, since the activations it meets are the same on each, computes the same
  gradient, so ZeRO's reduction over the data-parallel group is all it needs. Its initial value is
  TP rank 0's (`TensorParallel.sync_replicated`), so the replicas start equal.
"""
from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from .collectives import Comm, default_device, init_process_group
from ..errors import ConfigError

_meshes: dict[tuple[str, int], DeviceMesh] = {}


def device_mesh(tensor_parallel: int, device: torch.device | None = None) -> DeviceMesh:
    """Collective: the ("dp", "tp") mesh over all ranks, `tensor_parallel` ranks per TP group
    (consecutive ranks, so a TP group stays inside a node), the rest data-parallel. Apply
    `parallelize_module(model, mesh["tp"], plan)` with it, then `zeroshard.initialize(model,
    config={"tensor_parallel": N, ...})`, which finds the same mesh. Made once per process."""
    device = device or default_device()
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ConfigError(f"zeroshard: tensor_parallel={tensor_parallel!r}: give the number of ranks per TP group")
    init_process_group(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tensor_parallel:
        raise ConfigError(f"zeroshard: tensor_parallel={tensor_parallel} does not divide the world of {world} ranks")
    key = (device.type, tensor_parallel)
    if key not in _meshes:
        _meshes[key] = init_device_mesh(device.type, (world // tensor_parallel, tensor_parallel),
                                        mesh_dim_names=("dp", "tp"))
    return _meshes[key]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local tensor, a plain tensor itself (no autograd)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_split(p: torch.Tensor) -> bool:
    """A parameter sharded over the TP group (a DTensor with a Shard placement), as opposed to a
    replicated one, which every TP rank holds whole."""
    return isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)


def local_shape(p: torch.Tensor) -> torch.Size:
    """The shape of what this rank stores of `p` (what its chunk slot holds)."""
    return local(p).shape


def set_local(p: torch.Tensor, value: torch.Tensor) -> None:
    """Make `value` what `p` holds on this rank (a plain parameter's data; a DTensor parameter's
    local tensor), keeping `p` the same object: optimizers, hooks and tied modules keep it."""
    if not isinstance(p, DTensor):
        p.data = value
        return
    if value.dtype != p.dtype:  # DTensor ops take the dtype from the wrapper and its spec
        like = as_dtensor(p, value)
        p.data = like
        p._spec = like._spec
    p._local_tensor = value


def region(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where this rank's shard of DTensor `p` lies in the whole tensor: (offset per dimension, its
    shape), for reading it out of whole-tensor files and state dicts; None for a plain tensor."""
    if not isinstance(p, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offset), tuple(shape)


def shard_of(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole`, a whole-tensor value of `p` (itself for a plain `p`)."""
    where = region(p)
    if where is None:
        return whole
    return whole[tuple(slice(o, o + n) for o, n in zip(*where))]


def local_value(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `value`, loaded into DTensor parameter `p`: a DTensor's local tensor
    (redistributed to p's placements first), the region of a whole tensor; None when `value` is
    not of p's whole shape (torch's load then reports the mismatch)."""
    if isinstance(value, DTensor) and value.device_mesh != p.device_mesh:
        value = value.full_tensor()  # collective over its own mesh: redistribute stays within one
    elif isinstance(value, DTensor):
        return (value if value.placements == p.placements else value.redistribute(p.device_mesh, p.placements)) \
            .to_local()
    return shard_of(p, value) if tuple(value.shape) == tuple(p.shape) else None


def as_dtensor(p: DTensor, value: torch.Tensor) -> DTensor:
    """A DTensor laid out as `p` whose local tensor is `value`."""
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def whole_shape(p: torch.Tensor, stored: torch.Size) -> tuple[int, ...]:
    """The whole tensor's shape of parameter `p`, of which this rank stores `stored`."""
    return tuple(p.shape) if isinstance(p, DTensor) else tuple(stored)


def local_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of `grad`, laid out as p's local shard (a gradient whose placements differ
    from the parameter's, a Partial sum say, is redistributed first: a TP collective)."""
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local()


class TensorParallel:
    """The engine's side of tensor parallelism: the mesh, the groups, and the checks that the model
    was split over that mesh."""

    def __init__(self, module: nn.Module, degree: int, device: torch.device):
        self.degree = degree
        self.mesh = device_mesh(degree, device)
        tp_mesh = self.mesh["tp"]
        self.dp_group = self.mesh["dp"].get_group()
        self.group = tp_mesh.get_group()
        self.rank = tp_mesh.get_local_rank()
        self.comm = Comm(device, group=self.group)  # P_a's all-gathers, counted apart from ZeRO's
        self.world_comm = Comm(device)  # every rank: errors that stop all, files shared out over all
        split = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor)]
        if not split:
            raise ConfigError(f"zeroshard: tensor_parallel={degree} but no parameter of the model is a DTensor: "
                             "split it first with parallelize_module(model, zeroshard.device_mesh"
                             f"({degree})['tp'], plan)")
        for name, p in split:
            if p.device_mesh != tp_mesh:
                raise ConfigError(f"zeroshard: parameter {name} is split over {p.device_mesh}, not over "
                                 f"zeroshard.device_mesh({degree})['tp'] ({tp_mesh}): zeroshard would shard it over "
                                 "the wrong data-parallel group")

    @torch.no_grad()
    def sync_replicated(self, params: list[nn.Parameter]) -> None:
        """Collective over the TP group: every replicated parameter takes TP rank 0's value."""
        for p in params:
            if not isinstance(p, DTensor) and not p.is_meta:  # a meta one's value is the same on every rank
                self.comm.broadcast(p.data, src=0)

    def full_tensor(self, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Collective over the TP group for a DTensor `p`: the whole tensor whose local part on
        this rank is `value` (`value` itself for a replicated parameter)."""
        if not isinstance(p, DTensor):
            return value
        return as_dtensor(p, value).full_tensor()

    def describe(self, params: list[torch.Tensor], names: dict[int, str]) -> dict:
        """What a checkpoint records so that `zeroshard export` can join the TP ranks' shards:
        each split parameter's whole shape and the dimension it is split along ("dim": None for
        a layout other than one Shard, which export refuses)."""
        split = {}
        for p in params:
            if isinstance(p, DTensor):
                (placement,) = p.placements
                split[names[id(p)]] = {"shape": list(p.shape), "dim": placement.dim if type(placement) is Shard else None}
        return {"degree": self.degree, "rank": self.rank, "split": split}

    def checkpoint_root(self, root) -> str:
        """Where this TP rank's data-parallel group keeps its checkpoints under `root`: each group
        saves its own local shards, an ordinary zeroshard checkpoint of 1/MP of the model."""
        return os.path.join(os.fspath(root), f"tp{self.rank}-of-{self.degree}")

    def checkpoint_path(self, path) -> str:
        """This TP rank's part of a checkpoint: `path` is a root that save_checkpoint wrote
        tensor-parallel checkpoints to, or a checkpoint directory inside one (any TP rank's)."""
        from ..errors import CheckpointError
        path = os.path.abspath(os.fspath(path))
        mine = f"tp{self.rank}-of-{self.degree}"
        if os.path.isdir(os.path.join(path, mine)):
            return os.path.join(path, mine)
        parent = os.path.basename(os.path.dirname(path))
        if re.fullmatch(rf"tp\d+-of-{self.degree}", parent):
            return os.path.join(os.path.dirname(os.path.dirname(path)), mine, os.path.basename(path))
        raise CheckpointError(f"zeroshard: {path} holds no checkpoint of tensor parallelism {self.degree} (no {mine}/ "
                              "in it): a tensor-parallel model resumes from a checkpoint of the same TP degree")
