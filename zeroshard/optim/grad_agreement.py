"""What every rank must agree on before a step: which parameters got a gradient anywhere, whether
any gradient is not finite, and the global gradient norm, in one small all-reduce; and, with
hybrid sharding, the gradient shards summed across the shard groups (`sum_across`); with tensor
parallelism, the norm and the non-finite flag agreed across the TP group too (`TensorParallelNorm`)."""
from __future__ import annotations

import math

import torch

from ..distributed.tensor_parallel import is_split
from ..numerics import all_finite, squares_sum


def agree_grads(comm, chunks, grads, seen, inv: float, *, finite_check: bool, measure_norm: bool,
                exact_norm: bool, norm_here: bool, share: tuple[int, int] | None = None,
                tp: "TensorParallelNorm | None" = None) -> tuple[list[list[bool]], bool, float]:
    """One small all-reduce over `comm` (none at world 1) gives every rank the same answers: per
    chunk and slot, whether that parameter got a gradient on any rank (`seen`: the slots that got
    one here; one that got none anywhere is not stepped: torch skips a parameter whose .grad is
    None); with `finite_check`, whether any rank's gradient is not finite (scaling by a finite
    factor neither makes nor unmakes an inf or NaN, so the unscaled gradients tell); with
    `measure_norm`, the squared L2 norm of the gradients scaled by `inv`, summed over the ranks
    whose `norm_here` is set (stage 0: one rank, which holds the whole gradient; hybrid sharding:
    the first shard group, whose shards the others repeat). fp32 gradients come already scaled
    (scale_in_place), 16-bit ones are scaled here. `exact_norm` (the norm clips): the sum of
    squares of the scaled gradient as it always was, which the bit-identity fingerprints pin;
    otherwise (the norm is a figure in stats()) one pass without a temporary (see squared_norm),
    over this rank's `share` (rank, ranks) of each gradient where every rank holds all of it.
    `tp`: the TP group's agreement, after the data-parallel one (tensor parallelism).
    Returns (present, overflow, sq)."""
    flags = [1.0 if i in got else 0.0 for c, got in zip(chunks, seen) for i in range(len(c.slots))]
    if comm.world == 1 and not finite_check and not measure_norm:  # nothing to agree on: no device sync
        return [[i in got for i in range(len(c.slots))] for c, got in zip(chunks, seen)], False, 0.0
    local = _answers(flags, comm.device)
    if measure_norm and norm_here:
        mine = _share_of(grads, share) if tp is None else tp.part(chunks, grads)
        sq = squared_norm(mine, inv, exact=exact_norm)
        # A finite sum of squares proves the gradients it read finite (all_finite says why). With a
        # share, the ranks' shares cover every gradient and the flag below is summed over them.
        if finite_check and not bool(torch.isfinite(sq)) and not all_finite(mine):
            local[-2] = 1.0
        else:
            local[-1] = sq.to(local.device)
    elif finite_check and not all_finite(grads):
        local[-2] = 1.0
    if comm.world > 1:
        comm.control_all_reduce(local)
    if tp is not None and (finite_check or measure_norm):
        tp.agree(local)
    got = local.tolist()
    present, k = [], 0
    for c in chunks:
        present.append([v > 0 for v in got[k:k + len(c.slots)]])
        k += len(c.slots)
    return present, got[-2] > 0, got[-1]


class TensorParallelNorm:
    """With tensor parallelism each rank's chunks hold its own local shards (tensor_parallel.py), so
    the step's agreement spans the TP group as well as the data-parallel one: the squared norm sums
    a split parameter's shards over the TP ranks and counts a replicated parameter, whose gradient
    every TP rank holds alike, once (TP rank 0's); the non-finite flag is any TP rank's, so every
    TP rank's data-parallel group applies or skips the same steps (the replicas of a replicated
    parameter, and fp16 loss scales, stay equal). One small all-reduce over the TP group per step
    that measures a norm or checks finiteness. `comm`: over the TP group, for the training
    thread's steps; a delayed update's thread takes `side` (Comm.side_channel says why)."""

    def __init__(self, comm, rank: int, side=None):
        self.comm, self.rank, self.side = comm, rank, side

    def on(self, main: bool) -> "TensorParallelNorm":
        """This agreement over the training thread's TP group (main) or the side one."""
        return self if main or self.side is None else TensorParallelNorm(self.side, self.rank)

    def part(self, chunks, grads: list) -> list:
        """What this rank adds to the squared norm: every gradient on TP rank 0; elsewhere the
        elements of split parameters alone (`grads`: per chunk, its owned range or its reduced one)."""
        if self.rank == 0:
            return grads
        out = []
        for c, g in zip(chunks, grads):
            if g is None:
                continue
            lo = c.owned_range[0] if g.numel() == c.owned_range[1] - c.owned_range[0] else c.reduced_range[0]
            for s in c.slots:
                if is_split(s.param):
                    a, b = max(lo, s.offset), min(lo + g.numel(), s.offset + s.numel)
                    if a < b:
                        out.append(g[a - lo:b - lo])
        return out

    def agree(self, answers: torch.Tensor) -> None:
        """Sum the non-finite flag and the squared norm (the last two answers, already summed over
        the data-parallel group) over the TP group, in place."""
        tail = answers[-2:].clone()
        self.comm.control_all_reduce(tail)
        answers[-2:] = tail


def start_agreeing(comm, chunks, grads, inv: float, *, measure_norm: bool, norm_here: bool,
                   share: tuple[int, int] | None = None):
    """agree_grads where every slot of every chunk got a gradient on this rank and nothing is
    decided from the norm (no clipping, no finite check): every slot got one anywhere, so the step
    need not wait. The same all-reduce goes out (the flags all set: a rank with a slot missing
    waits in agree_grads for its answer) without waiting (Comm.start_control_all_reduce); returns
    the call that reads the global squared norm (the ranks' drift and the round trip pass under
    the step: gpt2-tiny, 2 ranks on 2 cores, interleaved A/B, vs DDP: stage 1 1.040 -> 1.019x,
    stage 2 1.049 -> 1.031x, step phase 11.2 -> 9.8 ms and 11.6 -> 9.7 ms)."""
    local = _answers([1.0] * sum(len(c.slots) for c in chunks), comm.device)
    if measure_norm and norm_here:
        local[-1] = squared_norm(_share_of(grads, share), inv, exact=False).to(local.device)
    wait = comm.start_control_all_reduce(local)

    def squared() -> float:
        wait()
        return float(local[-1])
    return squared


def _answers(flags: list[float], device) -> torch.Tensor:
    """The all-reduce's tensor: a flag per slot (1.0: a gradient here), then the non-finite flag and
    the squared norm, both 0 until set."""
    return torch.tensor(flags + [0.0, 0.0], dtype=torch.float32, device=device)


def _share_of(grads: list, share: tuple[int, int] | None) -> list:
    """Rank r's share (r, ranks) of each gradient where every rank holds all of it; all of each
    with no share."""
    if share is None:
        return grads
    r, n = share
    return [None if g is None else g[g.numel() * r // n:g.numel() * (r + 1) // n] for g in grads]


def replicated_grads(chunks, grads, seen, inv: float, *, finite_check: bool, measure_norm: bool
                     ) -> tuple[list[list[bool]], bool, float]:
    """Stage 0 with peers and no clipping: what agree_grads returns, without a collective. Every
    rank holds the same all-reduced gradient (an all-reduce leaves the same bits on every rank, as
    DDP's replicas rely on), so this rank's finite check and norm are every rank's; which slots got
    a gradient on any rank came with the gradient (Chunk.presence, read in one host copy; a chunk
    whose reduction was abandoned, after a failed backward, has only this rank's `seen`). Returns
    (present, overflow, squared norm)."""
    summed = [c.presence for c in chunks if c.presence is not None]
    flags = torch.cat(summed).tolist() if summed else []
    present, k = [], 0
    for c, got in zip(chunks, seen):
        n = len(c.slots)
        if c.presence is None:
            present.append([i in got for i in range(n)])
        else:
            present.append([v > 0 for v in flags[k:k + n]])
            k += n
    sq = float(squared_norm(grads, inv, exact=False)) if measure_norm else 0.0
    # a finite sum of squares proves every gradient finite (all_finite says why)
    overflow = finite_check and not (measure_norm and math.isfinite(sq)) and not all_finite(grads)
    return present, overflow, sq if not overflow else 0.0


def scale_in_place(grads: list, inv: float) -> None:
    """Multiply the fp32 gradients by `inv` in place, once, before anything reads them: what the
    step, the norm and the finite check need (scaling by a finite factor neither makes nor unmakes
    an inf or NaN). The caller passes None for a gradient scaled as it arrived (fp32 training
    without a loss scale: Chunk.scales_on_arrival). A 16-bit gradient is left as it is: its fp32
    copy (or CPUAdamW, as it reads it) is scaled. inv == 1 (world 1, no accumulation, no loss
    scale) skips the pass: x * 1 is x."""
    if inv != 1.0:
        for g in grads:
            if g is not None and g.dtype == torch.float32:
                g.mul_(inv)


def squared_norm(grads: list, inv: float, *, exact: bool) -> torch.Tensor:
    """The squared L2 norm of the scaled gradients (fp32 ones scaled already: scale_in_place).
    exact: each fp32 gradient's squares summed (a temporary the size of the gradient; the result
    clipping has always used). Otherwise numerics.squares_sum, one pass and no temporary: the same
    figure within fp32 rounding, several times faster on a CPU, where a fresh temporary of a
    chunk's size costs more than the arithmetic (page faults)."""
    sq = torch.zeros((), dtype=torch.float32)
    for g in grads:
        if g is None:
            continue
        if exact:
            scaled = g if g.dtype == torch.float32 else g.float().mul_(inv)
            part = scaled.pow(2).sum()
        else:  # fp32 ones were scaled already
            part = squares_sum(g, 1.0 if g.dtype == torch.float32 else inv)
        sq = sq.to(part.device) + part
    return sq


def sum_across(shards, chunks, grads: list) -> list:
    """Hybrid sharding, at the step: each chunk's reduced gradient shard (`grads`, in chunk order)
    summed over the other shard groups (ShardGroups), in chunk order on every rank
    (distributed/shard_groups.py says why at the step). With the optimizer split across the
    replicas, each becomes this rank's part, reduce-scattered. Returns the list, changed in place."""
    if not shards.hybrid:
        return grads
    for i, (c, g) in enumerate(zip(chunks, grads)):
        if g is None:  # no backward reached it here; a replica's may have: zeros join the sum
            n = c.reduced_range[1] - c.reduced_range[0]
            g = grads[i] = torch.zeros(n, dtype=c.grad_dtype, device=c.master.device)
        if shards.split:  # this rank steps its part only
            grads[i] = shards.reduce_scatter_across(g)
        else:
            shards.all_reduce_across(g)
    return grads
