"""The one module that talks to torch.distributed.

Every collective zeroshard issues goes through `Comm`, which
- counts payload elements the way the ZeRO paper counts volume: an all-reduce of M elements counts
  2M, a reduce-scatter or all-gather counts M, M being the full (unsharded) size;
- handles gloo's quirks once: reduce-scatter always uses SUM (callers divide), equal-size shards;
- turns a world of one process (no process group) into local copies, so world size 1 runs the same
  code path as world size N;
- runs CUDA tensors over a gloo group (ranks sharing one GPU: NCCL refuses that) by staging them
  through host copies, so the engine's code is the same whatever the backend;
- optionally checks, before a collective issued from a module hook, that every rank is about to
  issue the same one (see `check_order`), so a divergent call order raises instead of hanging.
"""
from __future__ import annotations

import collections
import datetime
import os
import warnings

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases (the CUDA images in use
# carry 2.11) have only the old names, with the same arguments.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


TIMEOUT = datetime.timedelta(minutes=10)  # how long a collective waits for the other ranks

# Order-check tags, for the collectives that module hooks drive: (pass << 40) | (kind << 32) | chunk
# index, the pass being the rank's count of forward-backward passes (micro-batches) mod 2^20, so that
# ranks a micro-batch or a step apart disagree at their first check.
GATHER, REDUCE = 1, 2


def order_tag(kind: int, chunk_index: int) -> int:
    return kind << 32 | chunk_index


def describe_tag(tag: int) -> str:
    n, kind, index = tag >> 40, (tag >> 32) & 0xFF, tag & 0xFFFFFFFF
    what = {GATHER: "gather", REDUCE: "reduce the gradients of"}.get(kind, f"op {kind} on")
    return f"{what} chunk {index} in micro-batch {n}"


class DivergedError(RuntimeError):
    """Ranks were about to issue different collectives: their call order diverged."""


def ranks_per_node() -> int:
    """Processes on this node, from torchrun's environment (LOCAL_WORLD_SIZE; WORLD_SIZE if unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def shares_gpus() -> bool:
    """More processes on this node than visible GPUs: some must share one."""
    return torch.cuda.is_available() and ranks_per_node() > torch.cuda.device_count()


def init_process_group(device: torch.device | None = None) -> None:
    """Join torchrun's process group if its environment is set and none exists yet.

    gloo for CPU tensors, NCCL for CUDA, except where several ranks share one GPU (NCCL needs a
    device per rank): then gloo, with CUDA tensors staged through the host (slow; for tests and
    debugging on a single-GPU machine). Without torchrun's environment the world is one process and
    no group is created.
    """
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        cuda = device is not None and device.type == "cuda"
        shared = cuda and shares_gpus()
        if shared:
            warnings.warn(f"zeroshard: {ranks_per_node()} ranks share {torch.cuda.device_count()} GPU(s); NCCL "
                          "needs one GPU per rank, so collectives run over gloo through host memory (slow)")
        backend = "nccl" if cuda and not shared else "gloo"
        dist.init_process_group(backend, timeout=TIMEOUT)


class _Staged:
    """A collective on host copies of CUDA tensors (gloo group): `wait()` copies the result back."""

    def __init__(self, work, host: torch.Tensor, dest: torch.Tensor):
        self.work, self.host, self.dest = work, host, dest

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.dest.copy_(self.host)
        return True


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
        self._pending_checks = collections.deque()  # (tag, pinned answer, event, step epoch): NCCL only
        self._order_epoch = 0
        self.pass_index = 0  # forward-backward passes this rank has run: part of every order check
        # gloo carries CUDA tensors through host copies (see init_process_group)
        self.staged = (self.distributed and device.type == "cuda"
                       and dist.get_backend(group) == dist.Backend.GLOO)
        self.control_device = torch.device("cpu") if self.staged else device

    def reset_counters(self) -> None:
        self.elements = 0
        self.control_collectives = 0

    def side_channel(self) -> "Comm":
        """Collective, at set-up: a Comm over a new gloo group of the same ranks, for host tensors,
        for a thread that issues collectives while the main thread issues its own (the delayed
        update's norm and overflow checks). Within one group, two threads' collectives would be
        paired across ranks in whatever order each rank happened to issue them."""
        if self.world == 1:
            return Comm(torch.device("cpu"), self.group)
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        return Comm(torch.device("cpu"), dist.new_group(ranks, backend="gloo", timeout=TIMEOUT))

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
        if self.staged:
            host = torch.empty(full.shape, dtype=full.dtype)
            work = _all_gather_single(host, shard.cpu(), group=self.group, async_op=True)
            return self._finish(_Staged(work, host, full), async_op)
        return _all_gather_single(full, shard, group=self.group, async_op=async_op)

    @staticmethod
    def _finish(staged: _Staged, async_op: bool):
        if async_op:
            return staged
        staged.wait()
        return None

    def reduce_scatter_sum(self, full: torch.Tensor, async_op: bool = False):
        """In place: this rank's slot of `full` <- the sum over ranks of that slot. Counts len(full).
        (NCCL and gloo both accept an output that is the input's own slot.)"""
        self._count(full.numel())
        if self.world == 1:
            return None
        s = full.numel() // self.world
        shard = full[self.rank * s:(self.rank + 1) * s]
        if self.staged:
            host = full.cpu()
            host_shard = host[self.rank * s:(self.rank + 1) * s]
            work = _reduce_scatter_single(host_shard, host, group=self.group, async_op=True)
            return self._finish(_Staged(work, host_shard, shard), async_op)
        return _reduce_scatter_single(shard, full, group=self.group, async_op=async_op)

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False):
        """t <- sum over ranks of t, in place. Counts 2*len(t)."""
        self._count(2 * t.numel())
        if self.world == 1:
            return None
        if self.staged:
            host = t.cpu()
            return self._finish(_Staged(dist.all_reduce(host, group=self.group, async_op=True), host, t), async_op)
        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Uncounted: used only at set-up, outside any step."""
        if self.world > 1:
            src = dist.get_global_rank(self.group, src) if self.group else src
            self._in_place(t, lambda x: dist.broadcast(x, src=src, group=self.group))

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
            self._in_place(t, lambda x: dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=self.group))
        return t

    def _in_place(self, t: torch.Tensor, collective) -> None:
        """A blocking in-place `collective(tensor)` on t, through a host copy where the group is staged."""
        host = t.cpu() if self.staged else t
        collective(host)
        if host is not t:
            t.copy_(host)

    def check_order(self, tag: int) -> None:
        """Raise DivergedError on every rank unless every rank passes the same `tag` (see order_tag).

        Each rank contributes (tag, -tag) to a MAX all-reduce: the ranks agree iff max == min.
        On NCCL the answer is read without making the host wait for the GPU (which would serialise
        the overlap stage 3 relies on): it is copied to pinned memory behind the collective and
        compared once that copy is done (polled at each later check), at the latest at the end of
        the next step (`verify_order`)."""
        if self.world == 1:
            return
        tag |= (self.pass_index & 0xFFFFF) << 40
        self.control_collectives += 1
        if self.device.type == "cuda" and not self.staged:
            self._check_order_later(tag)
            return
        if self._order_check_buf is None:
            self._order_check_buf = torch.empty(2, dtype=torch.int64, device=self.control_device)
        buf = self._order_check_buf
        buf[0], buf[1] = tag, -tag
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        self._compare(tag, int(buf[0]), -int(buf[1]))

    def _check_order_later(self, tag: int) -> None:
        dev = torch.empty(2, dtype=torch.int64, device=self.device)
        dev[0].fill_(tag)
        dev[1].fill_(-tag)
        dist.all_reduce(dev, op=dist.ReduceOp.MAX, group=self.group)
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending_checks.append((tag, host, done, self._order_epoch))
        self.verify_order(block=False)

    def verify_order(self, block: bool = True) -> None:
        """Compare the order checks whose answers have arrived; with `block`, wait for those issued
        before the current step (the engine calls this at the end of each step, when they are long
        done) and move on to the next step."""
        while self._pending_checks:
            tag, host, done, epoch = self._pending_checks[0]
            if not done.query():
                if not (block and epoch < self._order_epoch):
                    break
                done.synchronize()
            self._pending_checks.popleft()
            self._compare(tag, int(host[0]), -int(host[1]))
        if block:
            self._order_epoch += 1

    def _compare(self, tag: int, hi: int, lo: int) -> None:
        if hi != lo:
            self._pending_checks.clear()
            raise DivergedError(
                f"zeroshard: ranks diverged: rank {self.rank} is about to {describe_tag(tag)}, but another "
                f"rank is about to {describe_tag(hi if hi != tag else lo)}. Every rank must call the same "
                "modules in the same order, and run the same micro-batches (a rank that caught an "
                "exception inside forward or backward and carried on is out of step with the others; "
                "data-dependent control flow that differs between ranks is not supported at this stage)."
            )
