"""The sharded optimizer step: the user's torch optimizer runs over the fp32 master of each chunk's
owned range, then the updated values are pushed back into the compute parameters.

One step, in order:
1. master grad = reduced gradient of the owned range, in fp32, times 1/(world * accumulation steps *
   loss scale). Gradients are always reduced with SUM; this is the only place that divides.
2. fp16: if any rank's gradient is not finite, every rank skips the step and halves the loss scale.
3. Clipping by the global L2 norm over all shards (one small all-reduce of the squared norm).
4. The optimizer step; then the 16-bit copy of the owned range is refreshed from the master, and at
   stages 1-2 every chunk is all-gathered so each rank again holds all parameters (stage 3 gathers
   lazily when modules run; stage 0 updated everything everywhere).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow, double after `window` clean steps."""

    def __init__(self, initial: float, window: int):
        self.scale = float(initial)
        self.window = window
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.window == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}


def default_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


class ShardedOptimizer:
    def __init__(self, make_opt, comm, *, stage: int, dtype: torch.dtype, accumulation: int,
                 clip_grad_norm: float | None, scaler: LossScaler | None):
        self.make_opt = make_opt or default_optimizer
        self.comm = comm
        self.stage = stage
        self.dtype = dtype
        self.accumulation = accumulation
        self.clip = clip_grad_norm
        self.scaler = scaler
        self.optimizer = None
        self.chunks = []
        self.last_grad_norm = None
        self.skipped_steps = 0

    def attach(self, chunks) -> None:
        """(Re)bind the optimizer to the trainable chunks' masters. Before the first step the
        optimizer holds no state, so re-packing chunks only swaps the tensors it updates."""
        self.chunks = [c for c in chunks if c.trainable]
        masters = [c.master for c in self.chunks]
        if self.optimizer is None:
            self.optimizer = self.make_opt(masters)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise ValueError("zeroshard: optimizer must be a callable returning a torch.optim.Optimizer, "
                                 f"got {type(self.optimizer).__name__}")
        elif len(self.optimizer.param_groups) == 1 and not self.optimizer.state:
            self.optimizer.param_groups[0]["params"] = masters
        else:
            raise RuntimeError("zeroshard: cannot re-pack chunks of an optimizer with several parameter "
                               "groups or existing state")

    @torch.no_grad()  # the masters are Parameters: copies from them must not record history
    def step(self) -> bool:
        """Run one optimizer step over the reduced gradients; False if fp16 overflow skipped it."""
        scale = self.scaler.scale if self.scaler else 1.0
        inv = 1.0 / (self.comm.world * self.accumulation * scale)
        for c in self.chunks:
            g = c.owned_grad()
            if g is None:  # no backward reached this chunk (cannot happen after a flush): zero grad
                g = torch.zeros(c.master.numel(), dtype=self.dtype, device=c.master.device)
            c.master.grad = g.mul_(inv) if self.dtype == torch.float32 else g.float().mul_(inv)

        if self.scaler is not None:
            local = torch.zeros(1, device=self.comm.device)
            for c in self.chunks:
                if not torch.isfinite(c.master.grad).all():
                    local.fill_(1.0)
                    break
            overflow = bool(self.comm.control_all_reduce(local, dist.ReduceOp.MAX).item())
            self.scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                self._drop_grads()
                return False

        if self.clip is not None:
            self.last_grad_norm = self._clip()
        self.optimizer.step()
        self._drop_grads()
        self._push_params()
        return True

    def _clip(self) -> float:
        sq = torch.zeros(1, dtype=torch.float32, device=self.comm.device)
        for c in self.chunks:
            sq += c.master.grad.pow(2).sum()
        if self.stage > 0:  # stage 0: every rank already holds the whole gradient
            self.comm.control_all_reduce(sq)
        norm = math.sqrt(sq.item())
        coef = min(self.clip / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for c in self.chunks:
                c.master.grad.mul_(coef)
        return norm

    def _drop_grads(self) -> None:
        for c in self.chunks:
            c.master.grad = None

    def _push_params(self) -> None:
        if self.dtype != torch.float32:
            for c in self.chunks:
                c.shard.copy_(c.master)
        if self.stage in (1, 2):
            works = [self.comm.all_gather(c.full, c.shard, async_op=True) for c in self.chunks]
            for w in works:
                if w is not None:
                    w.wait()

    def state_bytes(self) -> int:
        """Bytes of the optimizer's own state tensors (moments etc.) on this rank."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
