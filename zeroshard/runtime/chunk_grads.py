"""A trainable chunk's gradient (words: docs/vocabulary.md): accumulated from its parameters'
gradients into grad_full, reduced (all-reduced at stage 0, reduce-scattered at stages 1-3) and kept
for the step: the whole buffer at stages 0-1, the reduced shard at stages 2-3, or on the host
where the optimizer lives there. Chunk (chunks.py) is the one class built on it.
"""
from __future__ import annotations

import enum

import torch

from ..distributed.ordering import REDUCE
from ..errors import invariant
from .offload import Pending, fold_host_grad
from .packing import Slot


_ZERO = torch.zeros(())  # a scalar 0.0 that broadcasts: accumulate_grad's first write is 0 + scale * grad


class GradState(enum.Enum):
    """A trainable chunk's gradient within one backward pass."""

    ACCUMULATING = "accumulating"  # gradients arrive into grad_full; no reduction of this pass started
    REDUCING = "reducing"  # a reduction of this pass's gradient is in flight (reduce_work)
    REDUCED = "reduced"  # ... and it finished during backward


class ChunkGrads:
    """The gradient's part of Chunk: its attributes (grad_full, grad_shard, grad_state, slots,
    slots_with_grad, presence_tail, presence, ...) are set by Chunk.__init__."""

    @property
    def grad_numel(self) -> int:
        """Elements of grad_full: the padded chunk, and at stage 0 with peers one presence flag
        per slot after it (see start_reduce)."""
        return self.padded_numel + self.presence_tail

    @property
    def scales_on_arrival(self) -> bool:
        """fp32 gradients into an fp32 buffer: each is multiplied by the step's divisor as it
        arrives (GradientReducer.scale, from the optimizer's arrival_scale), in the pass that
        copies or adds it anyway, so the step makes no pass of its own to scale them. A gradient
        arriving in 16 bits is left as it is: scaled in 16 bits it would round (or, under an fp16
        loss scale, underflow)."""
        return self.dtype == self.grad_dtype == torch.float32

    def accumulate_grad(self, slot: Slot, grad: torch.Tensor, scale: float = 1.0, buffers=None) -> None:
        """Add one parameter's gradient, times `scale`, into its slot of grad_full (made from
        `buffers`, a BufferPool, when it has to be made)."""
        i = self._slot_index[id(slot)]
        if self.grad_full is None:
            self.grad_full = self._unzeroed_grad(buffers)
        dst = self.grad_full[slot.offset:slot.offset + slot.numel]
        if self._unwritten is not None and i in self._unwritten:
            # What zeros + scale * grad gives, bit for bit (-0.0 too)
            torch.add(_ZERO, grad.reshape(-1), alpha=scale, out=dst)
            self._unwritten.discard(i)
        elif scale == 1.0:
            dst.add_(grad.reshape(-1))
        else:
            dst.add_(grad.reshape(-1), alpha=scale)
        self.slots_with_grad.add(i)

    def _unzeroed_grad(self, buffers=None) -> torch.Tensor:
        """A new grad_full whose slots are all unwritten (see __init__): only its gaps are zeroed."""
        if self._gaps is None:
            self._gaps, end = [], 0
            for s in sorted(self.slots, key=lambda s: s.offset):
                if s.offset > end:
                    self._gaps.append((end, s.offset))
                end = max(end, s.offset + s.numel)
            self._gaps.append((end, self.grad_numel))
        buf = buffers.take(self.grad_numel, self.grad_dtype, self.device) if buffers is not None else \
            torch.empty(self.grad_numel, dtype=self.grad_dtype, device=self.device)
        for a, b in self._gaps:
            buf[a:b].zero_()
        self._unwritten = set(range(len(self.slots)))
        return buf

    def _settle_grad(self) -> None:
        """Zero the slots of grad_full that no gradient reached (see __init__): it then holds what
        a zeroed buffer that accumulated this step's gradients would."""
        if self._unwritten:
            for i in self._unwritten:
                s = self.slots[i]
                self.grad_full[s.offset:s.offset + s.numel].zero_()
        self._unwritten = None

    def start_reduce(self, comm) -> None:
        """Start reducing this backward pass's gradient: an all-reduce at stage 0, an in-place
        reduce-scatter into this rank's shard of the full gradient at stages 1-3."""
        invariant(self.grad_state is not GradState.REDUCING,
                  lambda: f"chunk {self.index}: start_reduce in {self.grad_state}")
        self.grad_state = GradState.REDUCING
        if self.grad_full is None:  # no parameter of this chunk got a gradient on this rank
            self.grad_full = torch.zeros(self.grad_numel, dtype=self.grad_dtype, device=self.device)
        self._settle_grad()
        if self.stage == 0:
            if self.presence_tail:
                # Every slot that got a gradient here since the step (several backward passes: all
                # of them), summed with the gradient: finish_reduce keeps the sums (presence).
                tail = self.grad_full[self.padded_numel:]
                tail.zero_()
                if self.slots_with_grad:
                    tail[sorted(self.slots_with_grad)] = 1.0
            self.reduce_work = comm.all_reduce_sum(self.grad_full, async_op=True, tag=(REDUCE, self.index),
                                                   counted=self.padded_numel)
        else:
            self.reduce_work = comm.reduce_scatter_sum(self.grad_full, async_op=True, tag=(REDUCE, self.index))

    def stash_reduced(self) -> None:
        """A gradient arrived after this chunk's reduction started (reentrant checkpointing that
        re-runs a parameter in two regions): set the reduction aside and collect late gradients in a
        new buffer, reduced when backward ends."""
        invariant(self.grad_state is GradState.REDUCING, lambda: f"chunk {self.index}: stash_reduced in {self.grad_state}")
        self.stash = (self.grad_full, self.reduce_work)
        self.grad_full, self.reduce_work = None, None
        self.grad_state = GradState.ACCUMULATING

    def finish_reduce(self, buffers=None) -> None:
        """Wait for this backward pass's reductions and fold them into the kept gradient. Stages
        2-3 hand their full gradient buffer, done with, to `buffers` (a BufferPool)."""
        if self.stash is not None and self.grad_state is not GradState.REDUCING:
            # Late gradients have started a new buffer that is not reduced yet: the stashed
            # reduction is folded in with that one's, later in this backward.
            buf, work = self.stash
            if work is not None:
                work.wait()
            self.stash = (buf, None)
            return
        stashed = None
        if self.stash is not None:
            stashed, work = self.stash
            self.stash = None
            if work is not None:
                work.wait()
        if self.reduce_work is not None:
            self.reduce_work.wait()
            self.reduce_work = None
        if self.grad_state is not GradState.REDUCING:  # nothing reduced (stages 0-1 between boundaries)
            return
        self.grad_state = GradState.REDUCED
        lo, hi = self.reduced_range
        if self.presence_tail:  # per slot, the ranks that got a gradient (a stashed buffer's are older)
            self.presence = self.grad_full[self.padded_numel:].clone()
        if self.stage <= 1:
            if stashed is not None:
                stashed[lo:hi].add_(self.grad_full[lo:hi])
                self.grad_full = stashed
            if self.placement.optimizer_on_host:  # stages 0-1 reduce once per step
                self._send_grad(self.grad_full[lo:hi])
            return
        # Stages 2-3 keep only the reduced slice, accumulated over micro-batches.
        reduced = self.grad_full[lo:hi]
        if stashed is not None:
            reduced = reduced + stashed[lo:hi]
        if self.placement.optimizer_on_host:
            self._send_grad(reduced)
        elif self.grad_shard is None:
            self.grad_shard = reduced.clone()
        else:
            self.grad_shard.add_(reduced)
        if buffers is not None and stashed is None and not self.placement.optimizer_on_host:
            buffers.give(self.grad_full)  # (a host copy in flight may still read it)
        self.grad_full = None

    def _send_grad(self, reduced: torch.Tensor) -> None:
        """Start moving a reduced gradient to the host; the previous one is folded in first, so at
        most one copy per chunk is in flight."""
        self._fold_host_grad()
        self.grad_in_flight = self.transfer.to_host(reduced)

    def _fold_host_grad(self) -> None:
        self.host_grad = fold_host_grad(self.host_grad, self.grad_in_flight)
        self.grad_in_flight = None

    def take_host_grad(self) -> tuple[torch.Tensor | None, Pending | None]:
        """With the optimizer on the host: hand over this step's reduced gradient as (what has
        arrived on the host, the copy still in flight), leaving the chunk without one. The delayed
        update (optimizer.py) folds them with `fold_host_grad` in its own thread while the next
        backward fills the chunk anew."""
        out = (self.host_grad, self.grad_in_flight)
        if self.grad_in_flight is not None and self.stage <= 1:
            self.grad_in_flight.fence()  # its source, grad_full, is zeroed for the next step
        self.host_grad = self.grad_in_flight = None
        return out

    def reduced_grad(self) -> torch.Tensor | None:
        """The reduced gradient of the reduced range (compute dtype; the owned range but where the
        optimizer is split across replicas), or None before any backward. With the optimizer on
        the host it is a host tensor."""
        if self.placement.optimizer_on_host:
            self._fold_host_grad()
            return self.host_grad
        if self.stage >= 2:
            return self.grad_shard
        self._settle_grad()
        lo, hi = self.reduced_range
        return self.grad_full[lo:hi]

    def abandon_reduce(self) -> None:
        """A backward pass failed: drop its reductions in flight and what they were reducing (stages
        2-3: the pass's full gradient; stages 0-1 keep theirs, accumulated as torch's .grad is)."""
        self.reduce_work = None
        self.stash = None
        self.presence = None
        if self.stage >= 2:
            self.grad_full, self._unwritten = None, None
        self.grads_seen = 0
        self.grad_state = GradState.ACCUMULATING

    def end_backward(self) -> None:
        """The backward pass is over (its reductions finished): the next one starts afresh. At stages
        0-1 a reduced buffer stays REDUCED until the step clears it or another backward pass of the
        same step reopens it (`reopen`)."""
        invariant(self.grad_state is not GradState.REDUCING,
                  lambda: f"chunk {self.index}: end_backward in {self.grad_state}")
        self.grads_seen = 0
        if self.stage >= 2 or self.grad_state is not GradState.REDUCED:
            self.grad_state = GradState.ACCUMULATING

    def reopen(self) -> None:
        """Stages 0-1, another backward pass before the step (several backward calls per step): the
        buffer holds this step's reduced sum, which the next reduction would count again on every
        rank. So each rank keeps it only in its own slot (where stage 1 keeps it and no other rank
        does; with the optimizer on the host, where the sum went already, nowhere): the next
        reduction then adds every slot's earlier sum exactly once."""
        invariant(self.stage <= 1 and self.grad_state is GradState.REDUCED,
                  lambda: f"chunk {self.index}: reopen at stage {self.stage} in {self.grad_state}")
        if self.placement.optimizer_on_host:
            self._fold_host_grad()  # the copy to the host reads the buffer
            self.grad_full.zero_()
        else:
            lo, hi = self.shard_range
            self.grad_full[:lo].zero_()
            self.grad_full[hi:].zero_()
        self.presence = None  # the next reduction tells anew
        self.grad_state = GradState.ACCUMULATING

    def zero_grad(self) -> None:
        if self.grad_in_flight is not None:  # left by a failed step: dropped, once its source is read
            self.grad_in_flight.fence()
            self.grad_in_flight = None
        self.host_grad = None
        self.slots_with_grad.clear()
        self.presence = None
        if self.stage <= 1:
            self._unwritten = set(range(len(self.slots)))
        else:
            self.grad_shard = None
            self.grad_full, self._unwritten = None, None
        self.grads_seen = 0
        self.grad_state = GradState.ACCUMULATING
