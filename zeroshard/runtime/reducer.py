"""Gradient reduction: when, during backward, each chunk's gradient is reduced across ranks.

- Stages 0-1 keep the full gradient for the whole step and reduce only in the backward pass of the
  micro-batch that ends the step (all-reduce at 0, reduce-scatter at 1), as each chunk completes.
- Stages 2-3 reduce-scatter in every micro-batch, as each chunk completes, and keep only their shard.
A chunk is complete when every trainable parameter in it has its gradient. Reductions start in one
order on every rank, last chunk first: a chunk complete before those ahead of it waits for them.
Whatever is not complete when backward ends (parameters that got no gradient, gradients that came
late) is reduced then, in that order, so every rank issues the same collectives in the same order.

The per-chunk state (GradState: ACCUMULATING -> REDUCING -> REDUCED) lives on the chunk; this module
decides the transitions. At stages 0-1 the reduced gradient stays in its buffer (REDUCED) until the
step; another backward pass before that step reopens it (Chunk.reopen), so gradients add up over
several backward calls as they do in torch's .grad. It issues only reductions; the engine says where a backward pass begins and
ends and hands over each gradient as autograd accumulates it.
"""
from __future__ import annotations

import collections

import torch

from .chunks import Chunk, GradState
from .packing import Slot
from ..distributed.buffers import BufferPool
from ..distributed.collectives import Comm

MAX_REDUCING = 2  # stages 2-3: chunk reductions in flight during backward, each holding a full-chunk gradient


class GradientReducer:
    def __init__(self, comm: Comm, stage: int, accumulation: int):
        self.comm = comm
        self.stage = stage
        self.accumulation = accumulation  # micro-batches per optimizer step
        self.reduce_now = False  # this backward pass reduces (stages 2-3 always; 0-1 at a window's end)
        self._in_flight: collections.deque[Chunk] = collections.deque()  # stages 2-3, oldest first
        self._order: list[Chunk] = []  # this pass's reductions, in the order every rank issues them
        self._next = 0  # index into _order of the next reduction to start
        self._arrived: set[int] = set()  # id(slot) of the parameters counted in this pass
        self._counted_at_leaf_end: set[int] = set()  # id(param): see count_at_leaf_end
        # stages 0-1: gradients accumulated since the last reducing backward pass, not reduced yet
        self.unreduced = False
        self.scale = 1.0  # what a gradient is multiplied by as it arrives in a chunk that scales on arrival
        # stages 2-3: full-chunk gradient buffers, reused (at most MAX_REDUCING in flight and one filling)
        self.buffers = BufferPool(keep=MAX_REDUCING + 1) if stage >= 2 else None

    def begin(self, chunks: list[Chunk], micro_batch: int, sync: bool = True, scale: float | None = None) -> None:
        """A backward pass of micro-batch `micro_batch` (counted from 0) starts. At stages 0-1 it
        reduces if that micro-batch ends an accumulation window and `sync` (False: inside
        Engine.no_sync, the step reduces instead), and a chunk already reduced for this step (an
        earlier backward call before the same step) is reopened, so its earlier sum is not reduced
        twice. `scale`: what each gradient arriving in a chunk that scales on arrival
        (Chunk.scales_on_arrival) is multiplied by (None: as before)."""
        if scale is not None:
            self.scale = scale
        self.reduce_now = self.stage >= 2 or (sync and (micro_batch + 1) % self.accumulation == 0)
        self.unreduced = not self.reduce_now
        for c in chunks:
            if c.grad_state is GradState.REDUCED:
                c.reopen()
        # Last packed first, the order in which backward usually completes chunks (they are packed
        # in order of first use in forward).
        self._order = [c for c in reversed(chunks) if c.trainable] if self.reduce_now else []
        self._next = 0
        self._arrived = set()

    def add(self, chunk: Chunk, slot: Slot, grad: torch.Tensor | None) -> None:
        """Accumulate one parameter's gradient into its chunk. One that arrives after the chunk's
        reduction started (reentrant checkpointing re-runs a parameter in two regions) sets that
        reduction aside, to be folded in with the late gradients' own. None: autograd accumulated
        an undefined gradient (a second backward through torch.autograd.grad(create_graph=True),
        an R1 penalty's, reaches a LayerNorm's bias with none), which leaves torch's .grad as it
        was: the parameter counts as arrived, its slot unchanged."""
        if grad is not None:
            if chunk.grad_state is GradState.REDUCING:
                chunk.stash_reduced()
            chunk.accumulate_grad(slot, grad, self.scale if chunk.scales_on_arrival else 1.0, self.buffers)
        if id(slot.param) not in self._counted_at_leaf_end:
            self._count(chunk, slot)

    def count_at_leaf_end(self, params) -> None:
        """Stage 3: these parameters (of leaf units, units.py) count towards their chunk's
        completion only when their leaf's backward ends (`leaf_done`), never when their gradient
        arrives: which experts got gradients differs by rank, the end of a leaf's backward does
        not, so chunks complete, and reductions start, at the same point on every rank. A leaf
        whose backward end cannot be seen (no input needs a gradient) leaves them to the end of
        backward."""
        self._counted_at_leaf_end = {id(p) for p in params}

    def leaf_done(self, chunk: Chunk, slot: Slot) -> None:
        """The backward of the leaf unit holding `slot`'s parameter ended: it counts as arrived,
        with its gradient or without (an expert no token of this rank was routed to)."""
        if chunk.grad_state is not GradState.REDUCING:
            self._count(chunk, slot)

    def _count(self, chunk: Chunk, slot: Slot) -> None:
        if id(slot) not in self._arrived:
            self._arrived.add(id(slot))
            chunk.count_grad()

    def start_complete(self) -> None:
        """Start the reductions of the chunks complete so far, in one order on every rank (as DDP
        reduces its buckets): a chunk that completes before those ahead of it waits for them, so
        ranks whose backward completes chunks in different orders (their forwards took other
        branches) still issue the same reductions in the same order."""
        while self._next < len(self._order):
            c = self._order[self._next]
            if c.grad_state is GradState.REDUCING or c.grads_seen != c.expected_grads:
                return
            self._next += 1
            self._start(c)
            if self.stage >= 2:
                self._in_flight.append(c)
                self._finish_completed()

    def end(self, chunks: list[Chunk]) -> None:
        """The backward pass is over: reduce what is not reduced yet, wait for every reduction and
        fold it into the kept gradient."""
        self._in_flight.clear()
        for c in self._order[self._next:]:  # not complete (a parameter got no gradient): in order
            if c.grad_state is GradState.ACCUMULATING:
                self._start(c)
        for c in chunks:
            if not c.trainable or not self.reduce_now:
                continue
            late = c.grad_state is GradState.REDUCED and c.grad_full is not None  # came after it finished
            if c.grad_state is GradState.ACCUMULATING or late:
                self._start(c)
        for c in chunks:
            if c.trainable:
                c.finish_reduce(self.buffers)
                c.end_backward()

    def reduce_unreduced(self, chunks: list[Chunk]) -> None:
        """Stages 0-1, at the step: reduce the gradients that the backward passes since the last
        reduction kept unreduced (the window's last one ran under Engine.no_sync), once."""
        self.begin(chunks, self.accumulation - 1)
        self.end(chunks)

    def cleared(self) -> None:
        """The gradients were dropped (a step, zero_grad): nothing is left to reduce."""
        self.unreduced = False

    def abandon(self, chunks: list[Chunk]) -> None:
        """The backward pass raised: forget its reductions without waiting for them (a peer that
        went on may never issue their other halves)."""
        self._in_flight.clear()
        for c in chunks:
            if c.trainable:
                c.abandon_reduce()

    def _start(self, chunk: Chunk) -> None:
        chunk.start_reduce(self.comm)

    def _finish_completed(self) -> None:
        """Stages 2-3, during backward: finish the reductions that are done, oldest first, so their
        full gradient buffers are freed (and, with the optimizer offloaded, their reduced gradient
        starts its copy to the host) while backward goes on. At most MAX_REDUCING stay in flight:
        past that the oldest is waited for, so gradient buffers stay a constant size (ZeRO-R) even
        where a backend's work never reports completion before wait() (gloo's reduce-scatter)."""
        while self._in_flight:
            c = self._in_flight[0]
            done = c.reduce_work is None or c.reduce_work.is_completed()
            if not done and len(self._in_flight) <= MAX_REDUCING:
                return
            self._in_flight.popleft()
            c.finish_reduce(self.buffers)
