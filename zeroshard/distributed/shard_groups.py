"""Hybrid sharding (HSDP): the data-parallel ranks split into shard groups (docs/vocabulary.md).

With `shard_group_size` G below the data-parallel world W, model states are sharded over G
consecutive ranks (a node, say) and replicated across the W/G groups, as FSDP2's HSDP, DeepSpeed's
MiCS and ColossalAI's extra_dp_size do:
- a chunk is split into G shards; its all-gathers (stage 3's gathers, stages 1-2's publish after a
  step) stay inside the shard group;
- a gradient is reduce-scattered inside the group during backward; at the step, this rank's 1/G
  shard (summed over the window's micro-batches) is all-reduced across the groups (with the ranks
  holding the same shard: its replica group), so each element is reduced once and every replica
  ends with the sum over all W ranks.

Why at the step and not as each reduce-scatter completes: there, each rank would issue the
all-reduce when it first waited for that reduction, a point that differs between ranks relative to
the gathers and reduce-scatters inside the group. Ranks blocked on each other across and inside
then deadlock (seen at world 4: rank 0 waiting across for rank 2, 2 inside for 3, 3 across for 1,
1 inside for 0). The step is a point every rank reaches with nothing inside in flight, and the
sum over micro-batches is all-reduced once per step instead of once per micro-batch.

hpZ (ZeRO++'s hierarchical partitioning, config `hpz_group_size` G', stage 3): the chunks stay
sharded over the whole data-parallel world (1/W of the parameters per rank, gradients
reduce-scattered over it), and each chunk's gather also leaves this rank a *secondary shard*: its
1/G' of the chunk, inside a group of G' consecutive ranks (the secondary group, a node). Until the
parameters next change (the step), the chunk's gathers read the secondary shards over that group
and never cross it: the backward's, and later micro-batches' forwards. It costs the secondary
shards' memory (the chunk's size / G' per chunk, kept from the first gather on) and moves the
forward's gather and the reduce-scatter over the whole world: per step, across 2Psi, inside Psi
(docs/communication.md), against full sharding's 3Psi across.

With `shard_optimizer_across_replicas` (stages 1-2), each rank's optimizer steps 1/R of its shard
(ZeRO-1 over the replicas: 1/W of the fp32 masters and optimizer states per rank, as Megatron's
HFSDP does): the step reduce-scatters each gradient shard across the replica group instead of
all-reducing it, and all-gathers the updated parts across before the shard group's gather; the
same 2Psi/G cross the groups.

`ShardGroups` is what the chunks, the rCache, the reducer and the layout talk to: the Comm calls
they make, each routed to the group it belongs on. Sizes and counts are in elements, counted per
link as the ZeRO paper counts volume (docs/communication.md has the formulas): `inside` is what
moved over the shard group (hpZ: the secondary group), `across` what moved over groups spanning
several of them (the replica groups, and the data-parallel group's own collectives).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .collectives import Comm, ranks_per_node
from .ordering import collective_timeout


def resolve_group_size(setting, dp_world: int, tensor_parallel: int = 1, key: str = "shard_group_size") -> int:
    """Config `key` (shard_group_size, hpz_group_size) as a number of data-parallel ranks: None =
    all of them; "node" = the data-parallel ranks of one node (torchrun's LOCAL_WORLD_SIZE /
    tensor_parallel). Raises ConfigError when it does not divide the data-parallel world."""
    if setting is None:
        return dp_world
    if setting == "node":
        per_node = ranks_per_node()
        if per_node % tensor_parallel:
            raise ConfigError(f"zeroshard config: {key}='node': {per_node} ranks per node do not split into "
                              f"tensor-parallel groups of {tensor_parallel}")
        size = per_node // tensor_parallel
    else:
        size = setting
    if dp_world % size:
        raise ConfigError(f"zeroshard config: {key}={setting!r} ({size} ranks) does not divide the "
                          f"{dp_world} data-parallel ranks into equal groups")
    return size


def _data_parallel_groups(world: int, tensor_parallel: int) -> list[list[int]]:
    """Every data-parallel group's global ranks, as device_mesh lays them out (TP groups of
    consecutive ranks, so data-parallel group t holds ranks t, t+T, t+2T, ...)."""
    return [list(range(t, world, tensor_parallel)) for t in range(tensor_parallel)]


def _consecutive(size: int, tensor_parallel: int) -> list[list[int]]:
    """Every data-parallel group cut into groups of `size` consecutive data-parallel ranks (the
    shard groups; hpZ's secondary groups)."""
    return [ranks[k:k + size] for ranks in _data_parallel_groups(dist.get_world_size(), tensor_parallel)
            for k in range(0, len(ranks), size)]


def _hybrid_groups(size: int, tensor_parallel: int) -> list[list[list[int]]]:
    """Hybrid sharding's two kinds of group: the shard groups, and the replica groups (the ranks
    holding the same shard in every shard group of a data-parallel group)."""
    replica_groups = [ranks[j::size] for ranks in _data_parallel_groups(dist.get_world_size(), tensor_parallel)
                      for j in range(size)]
    return [_consecutive(size, tensor_parallel), replica_groups]


def _own_groups(device: torch.device, kinds: list[list[list[int]]]) -> list[Comm]:
    """Collective over every rank (torch's new_group): every group of every kind, made in one order
    everywhere; for each kind, the Comm over the group that holds this rank."""
    me = dist.get_rank()
    own = []
    for groups in kinds:
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks, timeout=collective_timeout())
            if me in ranks:
                mine = Comm(device, group)
        own.append(mine)
    return own


class ShardGroups:
    """The collectives of chunks, over the shard group and across the groups.

    `rank`, `world`: this rank's place in its shard group and the group's size G (what a chunk is
    split into). `dp`: the whole data-parallel group (W ranks). `inside`: the shard group (`dp`
    itself when G == W). `across`: this rank's replica group (the ranks holding the same shard in
    the other groups; None when G == W). `replica`: which shard group this rank is in (0..W/G-1).
    hpZ (`secondary_size` G' < W, only with G == W): `secondary` is this rank's secondary group,
    `secondary_rank` its place there; None and 0 otherwise.
    """

    def __init__(self, dp: Comm, size: int, tensor_parallel: int = 1, secondary_size: int | None = None,
                 split_optimizer: bool = False):
        self.dp = dp
        self.size = size
        self.replicas = dp.world // size
        self.replica = dp.rank // size
        self.inside, self.across, self.secondary = dp, None, None
        if self.replicas > 1:
            self.inside, self.across = _own_groups(dp.device, _hybrid_groups(size, tensor_parallel))
        elif secondary_size is not None and secondary_size < dp.world:
            self.secondary, = _own_groups(dp.device, [_consecutive(secondary_size, tensor_parallel)])
        self.rank, self.world = self.inside.rank, self.inside.world
        # Hybrid, config shard_optimizer_across_replicas: each rank steps 1/R of its shard.
        self.split = split_optimizer and self.hybrid
        self.secondary_rank = self.secondary.rank if self.secondary is not None else 0
        self.secondary_size = self.secondary.world if self.secondary is not None else 1
        self.device = dp.device

    @property
    def hybrid(self) -> bool:
        return self.across is not None

    @property
    def hpz(self) -> bool:
        """Secondary shards in use (hpZ)."""
        return self.secondary is not None

    def at(self, pass_index: int | None = None, step: int | None = None) -> None:
        """Where training is, on every group's Comm (their order tags and errors: Comm.at)."""
        for comm in self._comms():
            comm.at(pass_index=pass_index, step=step)

    @property
    def leader(self) -> bool:
        """Rank 0 of the data-parallel group: the source of set-up broadcasts."""
        return self.dp.rank == 0

    def enable_order_checks(self) -> None:
        """Collective, at set-up: order checks on the data-parallel group and, hybrid, on the shard
        group, which carries the collectives the module hooks drive."""
        self.dp.enable_order_checks()
        if self.hybrid:
            self.inside.enable_order_checks()
        if self.hpz:
            self.secondary.enable_order_checks()

    def broadcast_object(self, obj):
        """The shard group's first rank's picklable `obj`, on every rank of the group."""
        return self.inside.broadcast_object(obj)

    def progress(self) -> None:
        self.inside.progress()
        if self.hpz:
            self.secondary.progress()

    def issue_handed_over(self) -> None:
        self.inside.issue_handed_over()
        if self.hpz:
            self.secondary.issue_handed_over()

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False, tag=None):
        """A chunk from its shards: inside the shard group."""
        return self.inside.all_gather(full, shard, async_op=async_op, tag=tag)

    def all_gather_secondary(self, full: torch.Tensor, piece: torch.Tensor, async_op: bool = False, tag=None):
        """hpZ: a chunk from the secondary shards, over the secondary group (`piece`: this rank's,
        in place in `full`)."""
        return self.secondary.all_gather(full, piece, async_op=async_op, tag=tag)

    def reduce_scatter_sum(self, full: torch.Tensor, async_op: bool = False, tag=None):
        """In place: this rank's shard of `full` <- the sum over the shard group of that shard
        (hybrid: the other groups' sums are added at the step, `all_reduce_across`)."""
        return self.inside.reduce_scatter_sum(full, async_op=async_op, tag=tag)

    @property
    def optimizer_split(self) -> tuple[int, int]:
        """(this rank's part, parts) of its shard that its optimizer steps: (replica, replicas)
        with the optimizer split across the replica groups, else (0, 1)."""
        return (self.replica, self.replicas) if self.split else (0, 1)

    def all_gather_owned(self, full: torch.Tensor, async_op: bool = False):
        """In place: the whole chunk in `full` from every rank's owned range, already in place in
        it. Split optimizer: first the shard from its replicas' parts (across, blocking, every rank
        in chunk order), then the chunk from the shards (inside)."""
        shard = full.view(self.world, -1)[self.rank]
        if self.split:
            self.across.all_gather(shard, shard.view(self.replicas, -1)[self.replica])
        return self.inside.all_gather(full, shard, async_op=async_op)

    def reduce_scatter_across(self, shard: torch.Tensor) -> torch.Tensor:
        """Split optimizer, at the step: this rank's part of its reduced gradient shard summed over
        its replica group (in place in `shard`; returned as a view)."""
        self.across.reduce_scatter_sum(shard)
        return shard.view(self.replicas, -1)[self.replica]

    def all_reduce_across(self, shard: torch.Tensor) -> None:
        """Hybrid, at the step: in place, this rank's reduced gradient shard <- its sum over the
        replica group (blocking). A host shard (offloaded optimizer) goes through the device when
        the group's backend needs it there (NCCL)."""
        if shard.device.type != self.device.type and not self.across.gloo:
            on_device = shard.to(self.device)
            self.across.all_reduce_sum(on_device)
            shard.copy_(on_device)
        else:
            self.across.all_reduce_sum(shard)

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False, tag=None, counted: int | None = None):
        """Stage 0's whole-gradient all-reduce, over the data-parallel group (Comm.all_reduce_sum)."""
        return self.dp.all_reduce_sum(t, async_op=async_op, tag=tag, counted=counted)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Set-up: data-parallel rank `src`'s values everywhere (every group starts alike)."""
        self.dp.broadcast(t, src)

    def all_gather_objects(self, obj) -> list:
        return self.dp.all_gather_objects(obj)

    @contextlib.contextmanager
    def uncounted(self):
        with contextlib.ExitStack() as stack:
            for comm in self._comms():
                stack.enter_context(comm.uncounted())
            yield

    def _comms(self) -> list[Comm]:
        return [self.dp] + ([self.inside, self.across] if self.hybrid else []) + \
            ([self.secondary] if self.hpz else [])

    @property
    def elements(self) -> int:
        """Payload elements since the last reset over every group (the ZeRO paper's count)."""
        return sum(c.elements for c in self._comms())

    def elements_by_link(self) -> dict[str, int]:
        """{"inside": elements over the shard group (hpZ: the secondary group), "across": over
        groups spanning several (without either, everything is inside one group)."""
        if self.hpz:
            return {"inside": self.secondary.elements, "across": self.dp.elements}
        if not self.hybrid:
            return {"inside": self.dp.elements, "across": 0}
        return {"inside": self.inside.elements, "across": self.across.elements + self.dp.elements}

    def reset_counters(self) -> None:
        for c in self._comms():
            c.reset_counters()
