"""An accumulation window's gradients as the step reads them (part of ShardedOptimizer, optimizer.py:
its attributes are set by ShardedOptimizer.__init__): summed across the shard groups and scaled by
the step's divisor once (`_ready_grads`), and clipped as torch's clip_grad_norm_ clips .grad when a
plain loop calls it before the step (`clip_at_step`; runtime/grad_readers.py routes the call here).

torch clips .grad in place at the call; here the call measures the window's global L2 norm as the
step measures it to clip (the same function over the same gradients, so the step finds the same
norm) and the step applies the factor, with the config's clip_grad_norm after it, as two torch
clippings in turn would. A backward between the call and the step would add unclipped gradients
to scaled ones: the engine refuses it (Engine._begin_backward).
"""
from __future__ import annotations

import math

import torch

from .grad_agreement import agree_grads, scale_in_place, sum_across


def clipped(norm: float | None, caps: list[float]) -> tuple[float | None, float | None]:
    """Clipping a gradient of L2 norm `norm` to each max norm of `caps` in turn, as torch's
    clip_grad_norm_ (a factor of max / (norm + 1e-6) where that is below 1): (the factor, None
    when there is none; the norm after it)."""
    coef = None
    for cap in caps:
        if norm + 1e-6 > cap:
            f = cap / (norm + 1e-6)
            coef, norm = f if coef is None else coef * f, norm * f
    return coef, norm


class WindowGradients:
    """The window's gradients made ready for the step, and torch's clip_grad_norm_ asked of them
    (uses ShardedOptimizer's chunks, comm, shards and scaling)."""

    def _ready_grads(self) -> list:
        """This window's reduced gradients, summed across the shard groups (hybrid) and scaled by the
        step's divisor, once: torch's clip_grad_norm_ measures them before the step uses them."""
        if self._ready is None:
            grads = sum_across(self.shards, self.chunks, [c.reduced_grad() for c in self.chunks])
            scale_in_place([None if self._scaled_on_arrival(c) else g for c, g in zip(self.chunks, grads)],
                           self._inv_scale())
            self._ready = grads
        return self._ready

    @torch.no_grad()
    def clip_at_step(self, max_norm: float, refuse_nonfinite: bool) -> float:
        """torch.nn.utils.clip_grad_norm_ in a plain loop (collective): the window's global L2 norm as
        the step measures it to clip, after any earlier call's clipping (inf where a gradient is not
        finite); the step then clips to `max_norm` too, as torch's call would have clipped .grad.
        `refuse_nonfinite` (torch's error_if_nonfinite): a norm that is not finite raises torch's
        RuntimeError instead, and the step will not clip for this call."""
        if self._user_clip is None:
            share, norm_here = self._norm_share(self.comm, exact=True)
            _, overflow, sq = agree_grads(self.comm, self.chunks, self._ready_grads(), self._grads_seen(),
                                          self._inv_scale(), finite_check=True, measure_norm=True, exact_norm=True,
                                          share=share, norm_here=norm_here, tp=self._tp_for(self.comm))
            self._user_clip = (math.inf if overflow else math.sqrt(sq), [])
        norm, caps = self._user_clip
        _, now = clipped(norm, caps)
        if refuse_nonfinite and not math.isfinite(now):
            raise RuntimeError(f"zeroshard: the total norm of order 2.0 of the gradients is {now}, not finite, so "
                               "it cannot be clipped (torch.nn.utils.clip_grad_norm_'s error_if_nonfinite=True)")
        caps.append(float(max_norm))
        return now

    def _norm_share(self, comm, exact: bool) -> tuple[tuple[int, int] | None, bool]:
        """(share, norm_here) of agree_grads. Stage 0: every rank holds the whole gradient: one rank
        measures it for clipping (the exact norm), each rank its share otherwise (no rank then waits
        for one rank's pass). Hybrid: the other shard groups repeat the first's reduced shards, which
        would count once per group. Tensor parallelism: whole gradients (TensorParallelNorm.part)."""
        share = (comm.rank, comm.world) if self.stage == 0 and not exact and self.tp_norm is None else None
        if self.stage == 0:
            return share, comm.rank == 0 or share is not None
        return share, self.shards.replica == 0 or self.shards.split

    def _tp_for(self, comm):
        """The TP group's agreement of a step agreed over `comm` (None without tensor parallelism)."""
        return None if self.tp_norm is None else self.tp_norm.on(main=comm is self.comm)

    @property
    def clip_pending(self) -> bool:
        """torch's clip_grad_norm_ made this window's gradients ready (scaled) and measured them: a
        backward would add unscaled gradients to them."""
        return self._ready is not None
