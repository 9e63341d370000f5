"""The one module that talks to torch.distributed.

Every collective zeroshard issues goes through `Comm`, which
- counts payload elements the way the ZeRO paper counts volume: an all-reduce of M elements counts
  2M, a reduce-scatter or all-gather counts M, M being the full (unsharded) size;
- handles gloo's quirks once: reduce-scatter always uses SUM (callers divide), equal-size shards;
- turns a world of one process (no process group) into local copies, so world size 1 runs the same
  code path as world size N;
- optionally checks, before a collective issued from a module hook, that every rank is about to
  issue the same one (see `check_order`), so a divergent call order raises instead of hanging.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


# Order-check tags: (kind << 32) | chunk index, for the collectives that module hooks drive.
GATHER, REDUCE = 1, 2


def order_tag(kind: int, chunk_index: int) -> int:
    return kind << 32 | chunk_index


def describe_tag(tag: int) -> str:
    kind, index = tag >> 32, tag & 0xFFFFFFFF
    return {GATHER: "gather", REDUCE: "reduce the gradients of"}.get(kind, f"op {kind} on") + f" chunk {index}"


class DivergedError(RuntimeError):
    """Ranks were about to issue different collectives: their call order diverged."""


def init_process_group(device: torch.device | None = None) -> None:
    """Join torchrun's process group if its environment is set and none exists yet.

    gloo for CPU tensors, NCCL for CUDA. Without torchrun's environment the world is one process and
    no group is created.
    """
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))


class Comm:
    """Counted collectives over one process group (or over a single process)."""

    def __init__(self, device: torch.device, group=None):
        self.device = device  # where control tensors live: NCCL needs them on the GPU
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.elements = 0  # payload volume since the last reset, counted as the ZeRO paper does
        self.control_collectives = 0  # small collectives: order checks, overflow flags, norms
        self.counting = True
        self._order_check_buf = None

    def reset_counters(self) -> None:
        self.elements = 0
        self.control_collectives = 0

    def _count(self, n: int) -> None:
        if self.counting and self.world > 1:
            self.elements += n

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """full[r*s:(r+1)*s] <- shard of rank r, for every r. Counts len(full)."""
        self._count(full.numel())
        if self.world == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return None
        return dist.all_gather_single(full, shard, group=self.group, async_op=async_op)

    def reduce_scatter_sum(self, full: torch.Tensor, async_op: bool = False):
        """In place: this rank's slot of `full` <- the sum over ranks of that slot. Counts len(full).
        (NCCL and gloo both accept an output that is the input's own slot.)"""
        self._count(full.numel())
        if self.world == 1:
            return None
        s = full.numel() // self.world
        shard = full[self.rank * s:(self.rank + 1) * s]
        return dist.reduce_scatter_single(shard, full, group=self.group, async_op=async_op)

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False):
        """t <- sum over ranks of t, in place. Counts 2*len(t)."""
        self._count(2 * t.numel())
        if self.world == 1:
            return None
        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Uncounted: used only at set-up, outside any step."""
        if self.world > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, src) if self.group else src,
                           group=self.group)

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s picklable `obj`, on every rank (set-up and checkpoints, not steps)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src) if self.group else src,
                                   group=self.group)
        return box[0]

    def all_gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def control_all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """A small all-reduce that carries no model data (overflow flag, squared norm)."""
        if self.world > 1:
            self.control_collectives += 1
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)
        return t

    def check_order(self, tag: int) -> None:
        """Raise DivergedError on every rank unless every rank passes the same `tag` (see order_tag).

        Each rank contributes (tag, -tag) to a MAX all-reduce: the ranks agree iff max == min."""
        if self.world == 1:
            return
        if self._order_check_buf is None:
            self._order_check_buf = torch.empty(2, dtype=torch.int64, device=self.device)
        buf = self._order_check_buf
        buf[0], buf[1] = tag, -tag
        self.control_collectives += 1
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = int(buf[0]), -int(buf[1])
        if hi != lo:
            raise DivergedError(
                f"zeroshard: ranks diverged: rank {self.rank} is about to {describe_tag(tag)}, but another "
                f"rank is about to {describe_tag(hi if hi != tag else lo)}. Every rank must call the same "
                "modules in the same order (data-dependent control flow that differs between ranks is "
                "not supported at this stage)."
            )
